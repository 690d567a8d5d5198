"""What users pass (NumPy arrays, bytes, PyTorch CPU tensors) turned into what the core takes.

The compiled core accepts any C-contiguous buffer-protocol object and diagnoses
the rest itself. PyTorch tensors do not export the buffer protocol, so they are
viewed through NumPy here, zero-copy (:func:`torch_view`, the one place that
does it); tensors of dtypes NumPy lacks (bfloat16) are viewed as same-width
integers, since the wire carries bytes. Collectives go further and describe
their input as an :class:`Operand`: the array plus how its elements reduce and
how to hand results back in the caller's type.

This module belongs to the bottom layer: it imports :mod:`ferro.types`,
:mod:`ferro.errors` and the compiled core only.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, cast

import numpy as np

from ferro.errors import InvalidBufferError
from ferro.types import DType, dtype_by_name

__all__ = ["Operand", "as_buffer", "before_writing", "byte_view", "is_device_array", "is_torch_tensor", "operand",
           "plain_tensor_view", "torch_view", "wrap_like"]

_PASS_THROUGH = (np.ndarray, bytes, bytearray, memoryview)
# Extension dtypes whose arrays NumPy cannot export through the buffer protocol.
_NOT_EXPORTABLE = {"bfloat16"}


def is_torch_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a PyTorch tensor (without importing torch)."""
    return type(obj).__module__.startswith("torch") and hasattr(obj, "numpy")


def is_device_array(obj: Any) -> bool:
    """Whether ``obj`` lives in GPU memory: a CUDA tensor, or an object exporting ``__cuda_array_interface__``."""
    if is_torch_tensor(obj):
        return bool(obj.is_cuda)
    return not isinstance(obj, _PASS_THROUGH) and hasattr(obj, "__cuda_array_interface__")


def torch_view(tensor: Any, op: str, writable: bool = False) -> tuple[np.ndarray, Any]:
    """Return a zero-copy NumPy view of a CPU tensor and the tensor's dtype.

    Tensors of dtypes NumPy lacks (bfloat16, float8) are viewed as same-width
    integers: the wire and the byte-moving collectives carry bytes, and the
    reduction kernels are told the real dtype separately.

    A tensor the call writes into is treated as torch treats its own in-place
    operations, so autograd never computes with values a collective replaced:
    its version counter is bumped (a backward that saved it raises "modified by
    an inplace operation"), and a leaf that requires grad is refused while grad
    mode is on.

    Raises:
        InvalidBufferError: A tensor off the CPU, sparse, or not contiguous; or, where the call
            writes, a leaf that requires grad outside ``torch.no_grad()``.

    """
    if tensor.device.type != "cpu":
        raise InvalidBufferError(
            f"{op}: the tensor lives on {tensor.device}; this backend moves host memory only "
            f"(use a GPU backend, or .cpu() first)")
    if tensor.layout is not _torch().strided:
        raise InvalidBufferError(
            f"{op}: the tensor is {str(tensor.layout).replace('torch.', '')}, not dense; collectives move dense "
            f"tensors: pass tensor.to_dense() (or its values())")
    if writable:
        before_writing(tensor, op)
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        raise InvalidBufferError(f"{op}: the tensor is not contiguous; pass tensor.contiguous()")
    try:
        return tensor.numpy(), tensor.dtype
    except TypeError:
        import torch

        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
        return tensor.view(width).numpy(), tensor.dtype


def _torch() -> Any:
    import torch  # only ever reached with a tensor in hand: torch is loaded already

    return torch


def before_writing(tensor: Any, op: str) -> None:
    """Do what torch does before an in-place write: refuse a leaf that requires grad, bump the version."""
    torch = _torch()
    if tensor.requires_grad and tensor.is_leaf and torch.is_grad_enabled():
        raise InvalidBufferError(
            f"{op} writes into its tensor, but it is a leaf that requires grad; torch refuses in-place writes to "
            f"such a tensor too: call it under torch.no_grad(), or pass tensor.detach()")
    from torch.autograd.graph import increment_version

    increment_version(tensor)


def plain_tensor_view(obj: Any) -> np.ndarray | None:
    """Return a writable NumPy view of a plain CPU tensor, or None for anything else.

    Plain: a contiguous CPU tensor that does not require grad, of a dtype NumPy
    has. The compiled direct paths take such a view as they take an array (the
    full path handles every other case, with its messages). The tensor's version
    counter moves, as :func:`before_writing` moves it.
    """
    # A CUDA tensor is turned away before .numpy(), whose refusal (a C++ exception) would cost the GPU path
    # tens of microseconds per call.
    if not is_torch_tensor(obj) or obj.is_cuda or obj.requires_grad or not obj.is_contiguous():
        return None
    try:
        view = obj.numpy()  # refuses tensors off the CPU, sparse ones and dtypes NumPy lacks
    except (TypeError, RuntimeError):
        return None
    _increment_version()(obj)
    return cast(np.ndarray, view)


@functools.cache
def _increment_version() -> Any:
    from torch.autograd.graph import increment_version  # reached with a tensor in hand: torch is loaded

    return increment_version


def as_buffer(obj: Any, op: str, writable: bool = False) -> Any:
    """Return ``obj``, or a zero-copy NumPy view of it when it is a PyTorch tensor.

    Args:
        obj: A buffer, or a CPU tensor.
        op: The call, for messages.
        writable: The call writes into it (see :func:`torch_view` for what that means to autograd).

    Raises:
        InvalidBufferError: A tensor off the CPU, sparse or not contiguous (see :func:`torch_view`).

    """
    if isinstance(obj, _PASS_THROUGH):
        return obj
    if is_torch_tensor(obj):
        return torch_view(obj, op, writable)[0]
    return obj


def byte_view(obj: Any, op: str, writable: bool) -> memoryview:
    """Return a flat byte view of a C-contiguous buffer, checked as the compiled core checks it.

    Raises:
        InvalidBufferError: Not a buffer, not C-contiguous, or read-only when ``writable``.

    """
    from ferro._core.transport import describe_buffer_problem

    data = as_buffer(obj, op, writable)
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidBufferError(f"{op}: {describe_buffer_problem(data, writable)}") from None
    if not view.c_contiguous or (writable and view.readonly):
        raise InvalidBufferError(f"{op}: {describe_buffer_problem(data, writable)}")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


class Operand(NamedTuple):
    """A collective's input as a NumPy array, with what is needed to reduce it and to return results.

    Attributes:
        array: The data, C-contiguous (a zero-copy view of a tensor when the input is one).
        dtype: How its elements reduce.
        torch_dtype: The tensor dtype when the input was a PyTorch tensor, else None.
        numpy_dtype: The caller's NumPy dtype when ``array`` is a same-width integer view
            of it (dtypes such as ml_dtypes' bfloat16 cannot export the buffer protocol).

    """

    array: np.ndarray
    dtype: DType
    torch_dtype: Any = None
    numpy_dtype: Any = None


def operand(x: Any, op: str, *, writable: bool) -> Operand:
    """Check a collective's input and view it as an :class:`Operand`.

    Raises:
        InvalidBufferError: Not an array or tensor; not C-contiguous; read-only
            where the collective writes; or a tensor off the CPU.

    """
    torch_dtype = None
    if isinstance(x, np.ndarray):
        array = x
    elif isinstance(x, np.generic) and not writable:
        array = np.asarray(x)  # a NumPy scalar reads as a 0-d array (it cannot be written into)
    elif is_torch_tensor(x):
        array, torch_dtype = torch_view(x, op, writable)
    else:
        hint = (" (view raw bytes as an array: numpy.frombuffer(buf, numpy.uint8), writable for a bytearray)"
                if isinstance(x, (bytes, bytearray, memoryview)) else "")
        raise InvalidBufferError(
            f"{op}: expected a NumPy array or a PyTorch CPU tensor, got {type(x).__name__}{hint}")
    if not array.flags.c_contiguous:
        raise InvalidBufferError(
            f"{op}: the array is not C-contiguous (shape {array.shape}, strides {array.strides}); "
            f"pass numpy.ascontiguousarray(x) (or tensor.contiguous())")
    if writable and not array.flags.writeable:
        raise InvalidBufferError(f"{op} writes its result into the input, but the array is read-only")
    if torch_dtype is not None and str(torch_dtype) == "torch.bfloat16":
        return Operand(array, _BFLOAT16, torch_dtype)
    dtype, exportable = _classify(array.dtype)
    if not exportable:
        return Operand(array.view(f"u{array.dtype.itemsize}"), dtype, None, array.dtype)
    return Operand(array, dtype, torch_dtype)


_BFLOAT16 = cast(DType, dtype_by_name("bfloat16"))  # always in the table


@functools.cache  # one entry per distinct dtype; dtype.name costs microseconds
def _classify(numpy_dtype: np.dtype) -> tuple[DType, bool]:
    name = numpy_dtype.name
    found = dtype_by_name(name)
    dtype = found if found is not None else DType(-1, name, numpy_dtype.itemsize, "o")
    return dtype, name not in _NOT_EXPORTABLE


def wrap_like(array: np.ndarray, like: Operand) -> Any:
    """Return a new result array in the caller's type (a tensor when the input was one)."""
    if like.numpy_dtype is not None:
        return array.view(like.numpy_dtype)
    if like.torch_dtype is None:
        return array
    import torch

    tensor = torch.from_numpy(array)
    return tensor.view(like.torch_dtype) if tensor.dtype != like.torch_dtype else tensor
