"""Describing an array to a receiver that knows nothing of it: a fixed-size frame of dtype, shape and type.

Used by :func:`ferro.scatter` and :mod:`ferro.p2p`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ferro._buffers import Operand
from ferro.errors import InvalidBufferError, SizeMismatchError
from ferro.types import DType

__all__ = ["META_BYTES", "array_from_meta", "decode_meta", "encode_meta"]

# Fixed size of the description frame, so the receiver can post its buffer first.
META_BYTES = 256


def encode_meta(data: Operand, extra: dict[str, Any] | None = None) -> np.ndarray:
    """Describe an array for a receiver that knows nothing of it: wire dtype, shape, the caller's type."""
    array = data.array
    dtype = array.dtype.str if array.dtype.names is None else None
    fields = {"dtype": dtype, "shape": list(array.shape), "torch": str(data.torch_dtype) if data.torch_dtype else None,
              "view": data.numpy_dtype.name if data.numpy_dtype is not None else None}
    fields.update(extra or {})
    text = json.dumps(fields).encode()
    if dtype is None or len(text) > META_BYTES:
        raise InvalidBufferError(f"cannot describe an array of dtype {array.dtype} and shape {array.shape} "
                                 f"to its receiver (structured dtypes and very high ranks are not supported)")
    meta = np.full(META_BYTES, ord(" "), np.uint8)
    meta[: len(text)] = np.frombuffer(text, np.uint8)
    return meta


def decode_meta(meta: np.ndarray) -> dict[str, Any]:
    """Read back the fields :func:`encode_meta` wrote."""
    return json.loads(meta.tobytes().decode().rstrip())


def array_from_meta(fields: dict[str, Any], max_bytes: int | None, where: str) -> Operand:
    """Allocate the array a description announces, as an Operand that returns it in the sender's type."""
    dtype = np.dtype(fields["dtype"])
    shape = tuple(int(d) for d in fields["shape"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if max_bytes is not None and nbytes > max_bytes:
        raise SizeMismatchError(f"{where}: the sender announced {nbytes} bytes, above max_bytes={max_bytes}",
                                expected=max_bytes, actual=nbytes)
    torch_dtype = numpy_dtype = None
    if fields.get("torch"):
        import torch

        torch_dtype = getattr(torch, fields["torch"].replace("torch.", ""))
    if fields.get("view"):
        numpy_dtype = _extension_dtype(fields["view"])
    return Operand(np.empty(shape, dtype), DType(-1, dtype.name, dtype.itemsize, "o"), torch_dtype, numpy_dtype)


def _extension_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # the sender used one of its dtypes, so it is installed there

        return np.dtype(getattr(ml_dtypes, name))
