"""Parallel training: data parallelism (:class:`DDP`), fully sharded data parallelism (:class:`FSDP`)."""

from ferro.parallel.ddp import DDP, Bucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ferro.parallel.fsdp import FSDP, MixedPrecision, ShardedEntry, ShardingStrategy, size_based_policy

__all__ = ["DDP", "FSDP", "Bucket", "MixedPrecision", "ShardedEntry", "ShardingStrategy", "allreduce_hook",
           "bf16_compress_hook", "fp16_compress_hook", "size_based_policy"]
