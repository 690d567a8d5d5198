"""ferro's dtypes and reduce ops as NCCL's enums, and the refusals where NCCL has no equivalent."""

from __future__ import annotations

from ferro.errors import InvalidBufferError
from ferro.types import ReduceOp

__all__ = ["BYTES", "NCCL_DTYPES", "NCCL_OPS", "reduction"]

#: ferro's dtype name -> ncclDataType_t, with the NCCL version that added it.
NCCL_DTYPES: dict[str, tuple[int, tuple[int, int, int]]] = {
    "int8": (0, (2, 0, 0)),
    "uint8": (1, (2, 0, 0)),
    "int32": (2, (2, 0, 0)),
    "uint32": (3, (2, 0, 0)),
    "int64": (4, (2, 0, 0)),
    "uint64": (5, (2, 0, 0)),
    "float16": (6, (2, 0, 0)),
    "float32": (7, (2, 0, 0)),
    "float64": (8, (2, 0, 0)),
    "bfloat16": (9, (2, 10, 0)),
    "float8_e4m3fn": (10, (2, 24, 0)),
    "float8_e5m2": (11, (2, 24, 0)),
}
#: ncclUint8: collectives that only move data (broadcast, all_gather, all_to_all, send/recv) move bytes.
BYTES = 1

#: ReduceOp -> ncclRedOp_t. MEAN is ncclAvg (NCCL divides, so every rank gets the same bits).
NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.MEAN: 4}
# Complex numbers sum (and average) as pairs of reals; NCCL has no complex type.
_COMPLEX_AS = {"complex64": "float32", "complex128": "float64"}


def reduction(dtype: str, op: ReduceOp, call: str, version: tuple[int, int, int]) -> tuple[int, int, int]:
    """Return (ncclDataType_t, ncclRedOp_t, elements per item) for reducing ``dtype`` with ``op``.

    Args:
        dtype: ferro's (NumPy's) dtype name.
        op: The reduction.
        call: The collective, for messages.
        version: The loaded NCCL's version.

    Raises:
        InvalidBufferError: NCCL cannot do it: a bitwise op, MEAN of integers, a dtype NCCL lacks
            (int16, uint16, bool), or one the loaded NCCL is too old for. The message says what to use instead.

    """
    if op not in NCCL_OPS:
        raise InvalidBufferError(
            f"{call}: NCCL has no {op.name} reduction (it reduces with SUM, PRODUCT, MIN, MAX and MEAN); run "
            f"{op.name} on a CPU array over TCP (backend='hybrid'), or express it with MAX/MIN on 0/1 values")
    per_item = 1
    if dtype in _COMPLEX_AS:
        if op not in (ReduceOp.SUM, ReduceOp.MEAN):
            raise InvalidBufferError(f"{call}: {op.name} of {dtype} is not defined; complex numbers reduce with "
                                     f"SUM or MEAN")
        dtype, per_item = _COMPLEX_AS[dtype], 2
    entry = NCCL_DTYPES.get(dtype)
    if entry is None:
        raise InvalidBufferError(f"{call}: NCCL cannot reduce {dtype} (it has no such type); cast to "
                                 f"{'int32' if dtype in ('int16', 'uint16', 'bool') else 'float32'} first")
    code, since = entry
    if version < since:
        raise InvalidBufferError(f"{call}: {dtype} needs NCCL {'.'.join(map(str, since))} or newer; this one is "
                                 f"{'.'.join(map(str, version))}")
    if op is ReduceOp.MEAN and code not in (6, 7, 8, 9, 10, 11):
        raise InvalidBufferError(
            f"{call}: MEAN of {dtype} would not be an integer; use SUM and divide, or a float dtype")
    return code, NCCL_OPS[op], per_item
