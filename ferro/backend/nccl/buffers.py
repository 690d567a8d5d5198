"""GPU buffers as NCCL sees them: an address, a size, a dtype, a device and the stream to order against.

Two kinds of objects are accepted: PyTorch CUDA tensors, and anything that
exports ``__cuda_array_interface__`` (CuPy, Numba, JAX...). Work is ordered
against the producer's stream: PyTorch's current stream for a tensor, CuPy's
current stream for a CuPy array, else the stream the interface names (version
3's ``stream``; 1 and 2 are CUDA's legacy and per-thread default streams).
"""

from __future__ import annotations

import math
import sys
from typing import Any, NamedTuple

import numpy as np

from ferro._buffers import before_writing, is_torch_tensor
from ferro.errors import InvalidBufferError

__all__ = ["DeviceArray", "describe"]


class DeviceArray(NamedTuple):
    """One GPU buffer of a call.

    Attributes:
        obj: The caller's object (kept alive while NCCL uses its memory).
        pointer: The device address of its first element.
        shape: Its shape.
        dtype: ferro's (NumPy's) dtype name: ``"float32"``, ``"bfloat16"``...
        itemsize: Bytes per element.
        device: The CUDA device index, or None when only the driver can tell.
        stream: The stream the caller's work on it is ordered by.

    """

    obj: Any
    pointer: int
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    device: int | None
    stream: int

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Number of bytes."""
        return self.size * self.itemsize


def describe(x: Any, call: str, writable: bool) -> DeviceArray:
    """Describe a GPU buffer for an NCCL call.

    Args:
        x: A PyTorch CUDA tensor or an object with ``__cuda_array_interface__``.
        call: The collective, for messages.
        writable: The call writes into it.

    Raises:
        InvalidBufferError: Not contiguous, not dense, read-only where written, or not a GPU buffer.

    """
    if is_torch_tensor(x):
        return _torch(x, call, writable)
    try:
        interface = x.__cuda_array_interface__
    except AttributeError:
        raise InvalidBufferError(f"{call}: expected a CUDA tensor or an object with __cuda_array_interface__, got "
                                 f"{type(x).__name__}") from None
    shape = tuple(int(n) for n in interface["shape"])
    dtype = np.dtype(interface["typestr"])
    pointer, readonly = interface["data"]
    strides = interface.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, dtype.itemsize) and math.prod(shape) > 1:
        raise InvalidBufferError(f"{call}: the array is not C-contiguous (shape {shape}, strides {tuple(strides)}); "
                                 f"pass a contiguous copy (cupy.ascontiguousarray(x))")
    if writable and readonly:
        raise InvalidBufferError(f"{call} writes its result into the array, but it is read-only")
    stream = interface.get("stream") or 0
    module = sys.modules.get("cupy")
    if module is not None and type(x).__module__.startswith("cupy"):
        stream = module.cuda.get_current_stream().ptr
    return DeviceArray(x, int(pointer or 0), shape, dtype.name, dtype.itemsize, None, int(stream))


def _torch(tensor: Any, call: str, writable: bool) -> DeviceArray:
    import torch

    if not tensor.is_cuda:
        raise InvalidBufferError(f"{call}: the tensor lives on {tensor.device}; NCCL moves CUDA memory only")
    if tensor.layout is not torch.strided:
        raise InvalidBufferError(f"{call}: the tensor is not dense; pass tensor.to_dense()")
    if not tensor.is_contiguous():
        raise InvalidBufferError(f"{call}: the tensor is not contiguous; pass tensor.contiguous()")
    if writable:
        before_writing(tensor, call)
    index = tensor.get_device()
    return DeviceArray(tensor, tensor.data_ptr(), tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                       tensor.element_size(), index, _current_stream(torch, index))


def _current_stream(torch: Any, device: int) -> int:
    """Return the handle of PyTorch's current stream on ``device``.

    The raw getter (what torch's own compiled kernels launch with) skips building a
    ``torch.cuda.Stream`` object, several microseconds of every call; builds without
    it take the public route.
    """
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
