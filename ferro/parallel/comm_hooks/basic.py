"""The plain hooks: an exact average, and averages carried in 16-bit floats."""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro.backend.base import Backend
from ferro.collective import ReduceOp, allreduce
from ferro.errors import ConfigurationError
from ferro.parallel.comm_hooks.bucket import Bucket, float_view

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]


def allreduce_hook(group: Backend, bucket: Bucket) -> None:
    """Average the bucket over the group, in place (the default communication hook)."""
    allreduce(bucket.buffer, ReduceOp.MEAN, group=group)


def _compress_hook(group: Backend, bucket: Bucket, compressed_dtype: Any) -> None:
    data = float_view(bucket)
    if data is None:
        allreduce(bucket.buffer, ReduceOp.MEAN, group=group)  # already 16-bit (or not float): nothing to gain
        return
    # Divide first: the sum of n compressed gradients then stays in the narrow type's range. The
    # 16-bit sum is reduced natively by ferro's kernels, hop by hop, never widened on the wire.
    compressed = (data / group.world_size).astype(compressed_dtype)
    allreduce(compressed, ReduceOp.SUM, group=group)
    data[...] = compressed.astype(data.dtype)


def fp16_compress_hook(group: Backend, bucket: Bucket) -> None:
    """Average in float16: divide by the world size, compress, sum, decompress. Halves the bytes sent.

    Example::

        model = ferro.DDP(net, comm_hook=ferro.parallel.fp16_compress_hook)
    """
    _compress_hook(group, bucket, np.float16)


def bf16_compress_hook(group: Backend, bucket: Bucket) -> None:
    """Average in bfloat16 (float32's range, 8 bits of mantissa). Halves the bytes sent; needs ``ml_dtypes``.

    Example::

        model = ferro.DDP(net, comm_hook=ferro.parallel.bf16_compress_hook)

    Raises:
        ConfigurationError: ``ml_dtypes`` is not installed.

    """
    try:
        import ml_dtypes
    except ImportError as exc:
        raise ConfigurationError("bf16_compress_hook needs ml_dtypes: pip install ml_dtypes") from exc
    _compress_hook(group, bucket, ml_dtypes.bfloat16)
