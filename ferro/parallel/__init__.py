"""Parallel training: data parallelism (:class:`DDP`), and the model adapters the wrappers share."""

from ferro.parallel.ddp import DDP, Bucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook

__all__ = ["DDP", "Bucket", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]
