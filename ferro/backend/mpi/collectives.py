"""The MPI group's native collectives: each one MPI call (or its nonblocking twin), split at MPI's count limit.

A mixin of :class:`~ferro.backend.mpi.backend.MpiBackend`: it runs every call
through the group's watched runner (``_run``), which issues the nonblocking twin
inside an async collective, and first agrees on the call where ``check_calls`` asks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ferro._core.foreign import DirectForeignAllreduce
from ferro._core.reduce import divide, has_kernel
from ferro._core.state import GroupState
from ferro.backend.mpi.library import MpiTypes, mpi_error
from ferro.backend.mpi.pending import Issued, count_spans
from ferro.backend.mpi.watchdog import Watchdog
from ferro.backend.native import NativeCollectives
from ferro.rendezvous.settings import default_timeout
from ferro.types import KERNEL_CODES, DType, ReduceOp, dtype_by_name

__all__ = ["MpiCollectives"]


class MpiCollectives(NativeCollectives):
    """Native collectives over the group's duplicated communicator (see the module)."""

    # Kept by MpiBackend: the communicator and its size, the library, the largest count of one call.
    _comm: Any
    _mpi: Any
    _types: MpiTypes
    _rank: int
    _world_size: int
    _max_count: int
    _check_calls: bool
    _timeout: float
    _watchdog: Watchdog
    _run: Callable[..., Any]
    _blocking: Callable[..., None]
    _agree: Callable[[str, int, float], None]
    _current_issue: Callable[[], Issued | None]

    @property
    def state(self) -> GroupState:
        """The group's state: Backend's, which comes first in MpiBackend's bases."""
        raise NotImplementedError

    def _mean(self, flat: np.ndarray, dtype: DType, op: ReduceOp) -> Callable[[], None] | None:
        if op is not ReduceOp.MEAN:
            return None
        divisor = float(self._world_size)
        return lambda: divide(flat, dtype.code, divisor, dtype.itemsize)

    def make_direct_allreduce(self, on_failure: Callable[[BaseException], BaseException]) -> Any:
        """Return the compiled direct path: one ``MPI_Allreduce`` called from C (none with ``check_calls``)."""
        if self._check_calls:
            return None
        mpi = self._mpi

        def failed(exc: BaseException) -> BaseException:
            return on_failure(mpi_error(exc, self._rank, "allreduce") if isinstance(exc, mpi.Exception) else exc)

        self._watchdog.start()
        return DirectForeignAllreduce(self._comm.Allreduce, mpi.IN_PLACE, self.state, self._watchdog.slot,
                                      self._direct_plan, failed, np.ndarray, self._timeout, default_timeout)

    def _direct_plan(self, numpy_dtype: np.dtype, op: Any) -> tuple[Any, Any, int, float, int] | bool:
        """``(datatype, MPI.Op, dtype code, MEAN's divisor or 0, count limit)`` for the direct path, or False."""
        dtype = dtype_by_name(numpy_dtype.name) if numpy_dtype.isnative else None
        if dtype is None or not isinstance(op, ReduceOp) or not has_kernel(dtype.code, KERNEL_CODES[op]) or (
                op is ReduceOp.MEAN and dtype.kind != "f"):
            return False  # the full path validates (and explains) everything else
        datatype, mpi_op = self._types.reduction(dtype, op)
        if self._types.inferred(numpy_dtype) == datatype:
            datatype = None  # mpi4py reads it off the array's format: a step saved on every call
        return datatype, mpi_op, dtype.code, float(self._world_size) if op is ReduceOp.MEAN else 0.0, self._max_count

    def native_allreduce(self, flat: Any, dtype: DType, op: ReduceOp, fingerprint: int, timeout: float,
                         algorithm: str) -> bool:
        """``MPI_Allreduce`` in place (MPI picks its own algorithm); MEAN divides the final sum."""
        self._agree("allreduce", fingerprint, timeout)
        datatype, mpi_op = self._types.reduction(dtype, op)
        spans = count_spans(flat.size, self._max_count)
        finish = self._mean(flat, dtype, op)
        for index, (start, end) in enumerate(spans):
            self._run("allreduce", timeout, self._comm.Allreduce, self._mpi.IN_PLACE, [flat[start:end], datatype],
                      op=mpi_op, finish=finish if index == len(spans) - 1 else None)
        return True

    def native_reduce(self, flat: Any, root: int, dtype: DType, op: ReduceOp, fingerprint: int,
                      timeout: float) -> bool:
        """``MPI_Reduce``, in place on ``root``."""
        self._agree("reduce", fingerprint, timeout)
        datatype, mpi_op = self._types.reduction(dtype, op)
        spans = count_spans(flat.size, self._max_count)
        finish = self._mean(flat, dtype, op) if self._rank == root else None
        for index, (start, end) in enumerate(spans):
            part = [flat[start:end], datatype]
            send, recv = (self._mpi.IN_PLACE, part) if self._rank == root else (part, None)
            self._run("reduce", timeout, self._comm.Reduce, send, recv, op=mpi_op, root=root,
                      finish=finish if index == len(spans) - 1 else None)
        return True

    def native_reduce_scatter(self, flat: Any, bounds: list[int], dtype: DType, op: ReduceOp, fingerprint: int,
                              timeout: float) -> bool:
        """``MPI_Reduce_scatter`` into this rank's part; parts over the count limit reduce one ``MPI_Reduce`` each."""
        self._agree("reduce_scatter", fingerprint, timeout)
        datatype, mpi_op = self._types.reduction(dtype, op)
        counts = [bounds[i + 1] - bounds[i] for i in range(self._world_size)]
        mine = flat[bounds[self._rank]:bounds[self._rank + 1]]
        if flat.size <= self._max_count:
            received = np.empty_like(mine)
            mean = self._mean(mine, dtype, op)

            def finish() -> None:
                mine[:] = received
                if mean is not None:
                    mean()
            self._run("reduce_scatter", timeout, self._comm.Reduce_scatter, [flat, datatype],
                      [received, datatype], counts, op=mpi_op, finish=finish)
            return True
        for owner in range(self._world_size):  # each part reduced onto its owner, in spans
            part = flat[bounds[owner]:bounds[owner + 1]]
            for start, end in count_spans(part.size, self._max_count):
                piece = [part[start:end], datatype]
                send, recv = (self._mpi.IN_PLACE, piece) if owner == self._rank else (piece, None)
                self._run("reduce_scatter", timeout, self._comm.Reduce, send, recv, op=mpi_op, root=owner)
        if op is ReduceOp.MEAN:
            self._run_after(self._mean(mine, dtype, op))
        return True

    def _run_after(self, step: Callable[[], None] | None) -> None:
        """Run ``step`` once the calls made so far are complete: now, or after an async call's requests."""
        if step is None:
            return
        issued = self._current_issue()
        if issued is not None:
            issued.finishers.append(step)
        else:
            step()

    def native_all_gather(self, flat: Any, bounds: list[int], fingerprint: int, timeout: float) -> bool:
        """``MPI_Allgather`` in place; parts over the count limit are broadcast by their owners, in spans."""
        self._agree("all_gather", fingerprint, timeout)
        part = bounds[1] - bounds[0]
        byte = self._types.byte
        if part <= self._max_count:
            self._run("all_gather", timeout, self._comm.Allgather, self._mpi.IN_PLACE,
                      [flat, part, byte])
            return True
        for owner in range(self._world_size):
            for start, end in count_spans(part, self._max_count):
                base = bounds[owner]
                self._run("all_gather", timeout, self._comm.Bcast, [flat[base + start:base + end], byte], root=owner)
        return True

    def native_broadcast(self, flat: Any, root: int, fingerprint: int, timeout: float) -> bool:
        """``MPI_Bcast`` of the bytes, in spans of at most the count limit."""
        self._agree("broadcast", fingerprint, timeout)
        for start, end in count_spans(flat.size, self._max_count):
            self._run("broadcast", timeout, self._comm.Bcast, [flat[start:end], self._types.byte], root=root)
        return True

    def native_all_to_all(self, send: Any, send_offsets: list[int], recv: Any, recv_offsets: list[int],
                          fingerprint: int, timeout: float, even: bool = False) -> bool:
        """``MPI_Alltoall`` for ``ferro.all_to_all``'s equal blocks, ``MPI_Alltoallv`` for uneven calls.

        When some rank's blocks or offsets exceed the count limit (uneven blocks
        first agree on it, one ``MPI_Allreduce``), this returns False: the
        collective then runs ferro's pairwise exchange over this group's
        point-to-point messages, which split large messages themselves.
        """
        n, byte = self._world_size, self._types.byte
        send_counts = [send_offsets[i + 1] - send_offsets[i] for i in range(n)]
        recv_counts = [recv_offsets[i + 1] - recv_offsets[i] for i in range(n)]
        # Only the even call is equal on every rank: an uneven call's counts may happen to be equal on one rank
        # and not on another, which would then run MPI_Alltoallv (and the Allreduce below) against its Alltoall.
        equal = even
        largest = max(send_offsets[-1], recv_offsets[-1])
        if not equal:  # totals differ between ranks: all must take the same path
            agreed = np.array([largest], np.int64)
            self._blocking("all_to_all", timeout, self._comm.Allreduce, self._mpi.IN_PLACE, agreed, op=self._mpi.MAX)
            largest = int(agreed[0])
        if largest > self._max_count:
            return False
        self._agree("all_to_all", fingerprint, timeout)
        if equal:
            self._run("all_to_all", timeout, self._comm.Alltoall, [send, send_counts[0], byte],
                      [recv, recv_counts[0], byte])
        else:
            self._run("all_to_all", timeout, self._comm.Alltoallv, [send, (send_counts, send_offsets[:-1]), byte],
                      [recv, (recv_counts, recv_offsets[:-1]), byte])
        return True

    def native_gather(self, flat: Any, out: Any, root: int, fingerprint: int, timeout: float) -> bool:
        """``MPI_Gather`` of equal byte blocks into ``out`` on ``root``; blocks over the limit go as messages."""
        if flat.size * self._world_size > self._max_count:  # equal sizes: every rank decides alike
            return False
        self._agree("gather", fingerprint, timeout)
        byte = self._types.byte
        self._run("gather", timeout, self._comm.Gather, [flat, byte], [out, byte] if self._rank == root else None,
                  root=root)
        return True

    def native_scatter(self, blocks: list[Any] | None, out: Any, root: int, fingerprint: int,
                       timeout: float) -> bool:
        """``MPI_Scatterv`` of the root's byte blocks into ``out`` on every rank, in rounds under the count limit.

        The root first broadcasts its largest block's size (one ``MPI_Bcast``), so
        every rank runs the same number of rounds; each round sends every rank
        at most ``limit / world_size`` bytes, so no count or offset overflows.
        """
        self._agree("scatter", fingerprint, timeout)
        n, byte = self._world_size, self._types.byte
        largest = np.array([max((b.size for b in blocks), default=0) if blocks is not None else 0], np.int64)
        self._blocking("scatter", timeout, self._comm.Bcast, largest, root=root)
        per_round = max(1, self._max_count // n)
        for start in range(0, max(int(largest[0]), 1), per_round):
            send = None
            if blocks is not None:
                pieces = [b[start:start + per_round] for b in blocks]
                counts = [p.size for p in pieces]
                offsets = np.cumsum([0, *counts[:-1]]).tolist()
                send = [np.concatenate(pieces), (counts, offsets), byte]
            mine = out[start:start + per_round]
            self._run("scatter", timeout, self._comm.Scatterv, send, [mine, byte], root=root)
        return True
