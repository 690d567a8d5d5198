"""Type stub for the reduction kernels (ferro/_core/reduce.pyx)."""

from typing import Any

DTYPE_COUNT: int
OP_COUNT: int

def has_kernel(dtype: int, op: int) -> bool: ...
def reduce_into(dst: Any, src: Any, dtype: int, op: int, itemsize: int) -> None: ...
def divide(buf: Any, dtype: int, divisor: float, itemsize: int) -> None: ...
