"""Dtypes as the collectives see them: NumPy, ml_dtypes and PyTorch arrays mapped to kernel codes.

A collective takes NumPy arrays and PyTorch CPU tensors. Both are handled as
NumPy arrays internally (tensors zero-copy through ``.numpy()``; bfloat16
tensors through a same-width integer view, since NumPy has no bfloat16), with
a :class:`DType` that says how to reduce their elements. Results that are new
arrays go back in the caller's type.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ferro.errors import InvalidBufferError

__all__ = ["DType", "Operand", "fingerprint", "operand", "wrap_like"]


@dataclass(frozen=True)
class DType:
    """A dtype's reduction code (``reduce_kernels.h``) and properties.

    Attributes:
        code: The ``FERRO_*`` dtype code, or -1 for dtypes that can be moved but not reduced.
        name: Its name, for messages.
        itemsize: Bytes per element.
        kind: ``"f"`` floating, ``"i"`` signed, ``"u"`` unsigned integer, ``"o"`` other.

    """

    code: int
    name: str
    itemsize: int
    kind: str

    @property
    def reducible(self) -> bool:
        """Whether reduction kernels exist for this dtype."""
        return self.code >= 0


_BY_NAME = {
    "float16": DType(0, "float16", 2, "f"),
    "bfloat16": DType(1, "bfloat16", 2, "f"),
    "float32": DType(2, "float32", 4, "f"),
    "float64": DType(3, "float64", 8, "f"),
    "int8": DType(4, "int8", 1, "i"),
    "int16": DType(5, "int16", 2, "i"),
    "int32": DType(6, "int32", 4, "i"),
    "int64": DType(7, "int64", 8, "i"),
    "uint8": DType(8, "uint8", 1, "u"),
    "uint16": DType(9, "uint16", 2, "u"),
    "uint32": DType(10, "uint32", 4, "u"),
    "uint64": DType(11, "uint64", 8, "u"),
}
_BY_CODE = {d.code: d for d in _BY_NAME.values()}


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
    elif type(x).__module__.startswith("torch") and hasattr(x, "numpy"):
        array, torch_dtype = _torch_array(x, op)
    else:
        raise InvalidBufferError(f"{op}: expected a NumPy array or a PyTorch CPU tensor, got {type(x).__name__}")
    if not array.flags.c_contiguous:
        raise InvalidBufferError(
            f"{op}: the array is not C-contiguous (shape {array.shape}, strides {array.strides}); "
            f"pass numpy.ascontiguousarray(x) (or tensor.contiguous())")
    if writable and not array.flags.writeable:
        raise InvalidBufferError(f"{op} writes its result into the input, but the array is read-only")
    if torch_dtype is not None and str(torch_dtype) == "torch.bfloat16":
        return Operand(array, _BY_NAME["bfloat16"], torch_dtype)
    dtype, exportable = _classify(array.dtype)
    if not exportable:
        return Operand(array.view(f"u{array.dtype.itemsize}"), dtype, None, array.dtype)
    return Operand(array, dtype, torch_dtype)


@functools.cache  # one entry per distinct dtype; dtype.name costs microseconds
def _classify(numpy_dtype: np.dtype) -> tuple[DType, bool]:
    name = numpy_dtype.name
    found = _BY_NAME.get(name)
    dtype = found if found is not None else DType(-1, name, numpy_dtype.itemsize, "o")
    return dtype, name not in _NOT_EXPORTABLE


def _torch_array(tensor: Any, op: str) -> tuple[np.ndarray, Any]:
    if tensor.device.type != "cpu":
        raise InvalidBufferError(
            f"{op}: the tensor lives on {tensor.device}; this backend moves host memory only "
            f"(use a GPU backend, or .cpu() first)")
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        raise InvalidBufferError(f"{op}: the tensor is not contiguous; pass tensor.contiguous()")
    try:
        return tensor.numpy(), tensor.dtype
    except TypeError:
        import torch

        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
        return tensor.view(width).numpy(), tensor.dtype


# Extension dtypes whose arrays NumPy cannot export through the buffer protocol.
_NOT_EXPORTABLE = {"bfloat16"}


def wrap_like(array: np.ndarray, like: Operand) -> Any:
    """Return a new result array in the caller's type (a tensor when the input was one)."""
    if like.numpy_dtype is not None:
        return array.view(like.numpy_dtype)
    if like.torch_dtype is None:
        return array
    import torch

    tensor = torch.from_numpy(array)
    return tensor.view(like.torch_dtype) if tensor.dtype != like.torch_dtype else tensor


# Collective ids in the fingerprint's top 6 bits.
COLLECTIVE_IDS = {
    "allreduce": 1, "broadcast": 2, "reduce": 3, "all_gather": 4, "gather": 5, "scatter": 6,
    "reduce_scatter": 7, "all_to_all": 8, "all_to_all_single_uneven": 9, "broadcast_object": 10,
    "all_gather_object": 11, "p2p": 12,
}
_COLLECTIVE_NAMES = {v: k for k, v in COLLECTIVE_IDS.items()}
_OP_NAMES = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "MEAN"]


@functools.lru_cache(maxsize=4096)  # the same calls repeat every training step
def fingerprint(collective: str, dtype_code: int = -1, op_code: int = 0, root: int = 0, count: int = 0,
                shape: tuple[int, ...] = ()) -> int:
    """Pack a collective call into the 64-bit frame fingerprint.

    Layout (high to low): collective id (6 bits), dtype code + 1 (5), op (3),
    root (10), element count (32), a hash of the shape (8). Two ranks whose calls
    differ in any of these refuse each other's frames.
    """
    shape_hash = zlib.crc32(repr(tuple(shape)).encode()) & 0xFF
    return ((COLLECTIVE_IDS[collective] & 0x3F) << 58 | ((dtype_code + 1) & 0x1F) << 53 | (op_code & 0x7) << 50
            | (root & 0x3FF) << 40 | (count & 0xFFFFFFFF) << 8 | shape_hash)


def describe_fingerprint(value: int) -> str:
    """Decode a fingerprint into ``allreduce(float32, SUM, root 0, 1024 elements)`` for messages."""
    collective = _COLLECTIVE_NAMES.get(value >> 58, f"collective {value >> 58}")
    code = ((value >> 53) & 0x1F) - 1
    dtype = _BY_CODE[code].name if code in _BY_CODE else "bytes"
    op = _OP_NAMES[(value >> 50) & 0x7]
    root = (value >> 40) & 0x3FF
    count = (value >> 8) & 0xFFFFFFFF
    return f"{collective}({dtype}, {op}, root {root}, {count} elements, shape hash {value & 0xFF:02x})"
