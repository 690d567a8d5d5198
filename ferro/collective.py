"""Collective operations over a process group.

Every function validates its arguments once, then runs the backend's native
algorithm where it has one, else a generic algorithm over the backend's tagged
send/recv, so every backend supports every collective. Every frame of a call
carries the call's fingerprint: ranks that call different collectives (or the
same one with different sizes, dtypes, ops or roots) raise
:class:`~ferro.CollectiveMismatchError` naming both calls.

Semantics, the same on every backend:

* Results are identical on every rank, bit for bit.
* ``ReduceOp.MEAN`` (alias ``AVG``) is SUM divided by the world size, for
  floating-point dtypes; float16 and bfloat16 are combined in float32 at each step.
* World size 1 and empty arrays need no communication; results documented as
  new arrays never alias the input.
* When a collective fails part-way (a lost peer, a mismatch, a timeout), this
  rank tells the others so they fail at once too, and the group is marked
  failed: frames of the abandoned call may still be in flight, so later
  collectives on it raise :class:`~ferro.ConnectionBrokenError`. Create a new group.
* ``async_op=True`` returns a :class:`~ferro.PendingCollective`. A group runs its
  collectives one at a time, in call order, on every rank.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferro import _algorithms as algo
from ferro import gpu
from ferro import process_group as _groups
from ferro._buffers import Operand, is_device_array, operand, plain_tensor_view, wrap_like
from ferro._core.arena import DirectAllreduce
from ferro._core.collectives import ALGORITHMS as ALLREDUCE_ALGORITHMS
from ferro._core.collectives import DirectMeshAllGather, DirectMeshAllreduce, DirectMeshBarrier, DirectMeshBroadcast
from ferro._core.reduce import divide, has_kernel
from ferro._core.state import UNSET
from ferro._dispatch import (
    execute,
    fail_together,
    is_backend_type,
    make_link,
    make_link_fingerprint,
    resolve_group,
    resolve_root,
    resolve_timeout,
)
from ferro._meta import META_BYTES, array_from_meta, decode_meta, encode_meta
from ferro.backend.base import Backend
from ferro.errors import InvalidBufferError, InvalidRankError, SizeMismatchError
from ferro.rendezvous.settings import default_timeout
from ferro.types import COLLECTIVE_IDS, KERNEL_CODES, MAX_TAG, DType, ReduceOp
from ferro.work import PendingCollective

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single_uneven",
    "allreduce",
    "async_all_gather",
    "async_reduce_scatter",
    "barrier",
    "broadcast",
    "broadcast_object",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
]

# Generic broadcasts up to this size use a binomial tree (latency-optimal); larger ones a
# pipelined chain (bandwidth-optimal).
SMALL_MESSAGE_BYTES = 64 * 1024
# Recursive doubling moves the whole message log2(n) times, the ring and halving-doubling 2(n-1)/n
# times, in 2(n-1) and 2 log2(n) rounds: below this many bytes x log2(n), fewer rounds win. Measured on
# loopback (DESIGN.md, "Choosing the allreduce"): 1 MiB up to 3 ranks; from 4 ranks recursive doubling's
# extra bytes already lose at 64-256 KiB, so 128 KiB there. Above, halving-doubling where the ranks are a
# power of two (no fold: as fast as the ring for large messages, 1.1-1.7x faster for 64 KiB-1 MiB), else the ring.
RECURSIVE_DOUBLING_BYTES = 1024 * 1024
RECURSIVE_DOUBLING_BYTES_MANY = 128 * 1024
BROADCAST_SEGMENT_BYTES = 1024 * 1024
# Signatures (dtype, shape, op) of direct allreduces remembered per group.
DIRECT_PLANS_KEPT = 256


# Looked up on every call: plain dictionaries beat enum attribute access.
_OP_VALUES = {op: op.value for op in ReduceOp}


# --- shared plumbing -----------------------------------------------------------

@functools.lru_cache(maxsize=256)  # validated once per (op, dtype, collective)
def _reduce_op(op: Any, dtype: DType, name: str) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        try:
            op = ReduceOp[str(op).upper()]
        except KeyError:
            raise ValueError(f"{name}: unknown reduce op {op!r}; use ferro.ReduceOp") from None
    if not dtype.reducible:
        raise InvalidBufferError(f"{name}: cannot reduce dtype {dtype.name}")
    if op is ReduceOp.MEAN and dtype.kind != "f":
        raise InvalidBufferError(
            f"{name}: MEAN of {dtype.name} would not be an integer; use SUM and divide, or a float dtype")
    if not has_kernel(dtype.code, op.kernel_code):
        raise InvalidBufferError(f"{name}: {op.name} does not apply to {dtype.name} (bitwise ops need integers)")
    return op


def _finish_mean(flat: np.ndarray, dtype: DType, op: ReduceOp, world_size: int) -> None:
    if op is ReduceOp.MEAN:
        divide(flat, dtype.code, float(world_size), dtype.itemsize)


# --- reductions -------------------------------------------------------------------

def allreduce(x: Any, op: ReduceOp = ReduceOp.SUM, *, group: Backend | None = None, timeout: float | None = None,
              async_op: bool = False, algorithm: str | None = None) -> Any:
    """Reduce ``x`` across all ranks, in place; every rank ends with the result.

    Args:
        x: A C-contiguous, writable NumPy array or PyTorch CPU tensor.
        op: How to combine values (:class:`ReduceOp`).
        group: The process group.
        timeout: Seconds (default: the group's).
        async_op: Return a :class:`~ferro.PendingCollective` instead of waiting.
        algorithm: ``"ring"``, ``"recursive_doubling"`` or ``"halving_doubling"``
            (Rabenseifner's: reduce-scatter by recursive halving, all-gather by
            recursive doubling) to override the choice by size: recursive doubling
            while ``nbytes * ceil(log2(world_size))`` is at most 1 MiB (up to 3
            ranks) or 128 KiB (4 or more); above, halving-doubling on a power of
            two of 4 ranks or more, else the ring. A backend with an engine of its
            own (shared memory, MPI) may choose for itself.

    Returns:
        ``x`` (or a handle whose ``wait()`` returns it).

    Raises:
        InvalidBufferError: Not contiguous, read-only, or an op that does not apply to the dtype.
        CollectiveMismatchError: Ranks disagree on the call (size, dtype, op).
        PeerLostError, DistributedTimeoutError, ConnectionBrokenError.

    Example::

        # rank 0: x = [1., 2.]    rank 1: x = [10., 20.]
        ferro.allreduce(x, group=g)
        # rank 0: x = [11., 22.]  rank 1: x = [11., 22.]

    """
    # The direct path: one compiled call where the group has one (see _direct_path). Every step here
    # is paid on every call, so the common cases skip function calls: the default group read off its
    # module, the state off the group's own dictionary (a sub-group's comes through the property).
    g = group if group is not None and is_backend_type(type(group)) else (
        _groups._default_group if group is None and _groups._default_group is not None
        else resolve_group(group, "allreduce"))
    try:
        direct = g._group_state.direct_allreduce
    except AttributeError:
        direct = g.state.direct_allreduce
    if direct is UNSET:
        direct = _direct_path(g)
    if direct is not None and not async_op and algorithm is None and direct(x, op, timeout):
        return x
    if type(x) is not np.ndarray and not async_op:
        view = plain_tensor_view(x)  # a plain CPU tensor travels as its NumPy view, on either path
        if view is not None:
            if not (direct is not None and algorithm is None and direct(view, op, timeout)):
                _allreduce(g, view, op, timeout, False, algorithm)
            return x
    return _allreduce(g, x, op, timeout, async_op, algorithm)


def _allreduce(g: Backend, x: Any, op: Any, timeout: float | None, async_op: bool, algorithm: str | None) -> Any:
    # The full path, kept out of allreduce() itself: its closure would make every call, the
    # direct ones too, allocate cells for the captured variables.
    if type(x) is not np.ndarray and is_device_array(x):
        return gpu.device_allreduce(g, x, op, timeout, async_op)
    data = operand(x, "allreduce", writable=True)
    reduce_op = _reduce_op(op, data.dtype, "allreduce")
    if algorithm not in (None, *ALLREDUCE_ALGORITHMS):
        raise ValueError(f"allreduce: unknown algorithm {algorithm!r}; use one of {', '.join(ALLREDUCE_ALGORITHMS)}")
    link = make_link(g, "allreduce", resolve_timeout(g, timeout), data, _OP_VALUES[reduce_op], 0, data.array.size,
                 data.array.shape)
    kernel_code = KERNEL_CODES[reduce_op]

    def body() -> Any:
        flat = data.array.reshape(-1)
        if g.world_size > 1 and flat.size > 0:
            native = g.native
            chosen = algorithm or _allreduce_algorithm(flat.nbytes, g.world_size)
            if native is not None and native.native_allreduce(flat, data.dtype, reduce_op, link.fingerprint,
                                                              link.timeout, chosen):
                return x  # the backend finished MEAN itself
            if chosen != "recursive_doubling" and flat.size >= g.world_size:  # the generic engine's ring
                algo.allreduce_ring(link, flat, data.dtype, kernel_code)
            else:
                algo.allreduce_recursive_doubling(link, flat, data.dtype, kernel_code)
        if reduce_op is ReduceOp.MEAN:
            _finish_mean(flat, data.dtype, reduce_op, g.world_size)
        return x

    return execute(g, "allreduce", body, async_op, (x,))


def _remember(plans: dict[Any, Any], key: Any, plan: Any) -> Any:
    if len(plans) >= DIRECT_PLANS_KEPT:
        plans.clear()
    plans[key] = plan
    return plan


def _plan_operand(numpy_dtype: Any, name: str, writable: bool) -> Operand | None:
    """Return the dtype of a direct plan as the full path sees it, or None where the full path must explain."""
    try:
        data = operand(np.empty(0, numpy_dtype), name, writable=writable)
    except (InvalidBufferError, ValueError):
        return None
    # Not viewed as another dtype (ml_dtypes' bfloat16): the full path handles those.
    return data if data.array.dtype == numpy_dtype else None


def _count(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _direct_plan(plans: dict[Any, Any], key: Any, op: Any, group: Backend
                 ) -> tuple[int, int, int, float, int, int] | bool:
    """Return what a direct in-place allreduce needs (and remember it under ``key``), or False for the full path.

    ``key`` is ``(dtype, shape, op or op's identity)``. The plan: dtype code, kernel
    code, fingerprint, MEAN's divisor (else 0), itemsize, and the code of the algorithm
    the full path would choose for this size (a mesh must choose alike on every rank).
    """
    numpy_dtype, shape = key[0], key[1]
    plan: tuple[int, int, int, float, int, int] | bool = False
    data = _plan_operand(numpy_dtype, "allreduce", True)
    try:
        reduce_op = _reduce_op(op, data.dtype, "allreduce") if data is not None else None
    except (InvalidBufferError, ValueError):
        reduce_op = None  # the full path raises the error, with the caller's array in the message
    if data is not None and reduce_op is not None:
        count = _count(shape)
        divisor = float(group.world_size) if reduce_op is ReduceOp.MEAN else 0.0
        algorithm = ALLREDUCE_ALGORITHMS[_allreduce_algorithm(count * data.dtype.itemsize, group.world_size)]
        plan = (data.dtype.code, KERNEL_CODES[reduce_op],
                make_link_fingerprint(group, "allreduce", data, _OP_VALUES[reduce_op], 0, count, shape), divisor,
                data.dtype.itemsize, algorithm)
    return _remember(plans, key, plan)


def _direct_broadcast_plan(plans: dict[Any, Any], key: Any, root: Any, group: Backend) -> tuple[int, int] | bool:
    """``(fingerprint, root rank)`` of a direct broadcast (``key``: dtype, shape, root), or False."""
    numpy_dtype, shape = key[0], key[1]
    plan: tuple[int, int] | bool = False
    data = _plan_operand(numpy_dtype, "broadcast", False)
    try:
        root_rank = resolve_root(root, group, "broadcast")
    except InvalidRankError:
        data = None
    if data is not None:
        plan = (make_link_fingerprint(group, "broadcast", data, 0, root_rank, _count(shape), shape), root_rank)
    return _remember(plans, key, plan)


def _direct_all_gather_plan(plans: dict[Any, Any], key: Any, tag: Any, group: Backend
                            ) -> tuple[int, tuple[int, ...]] | bool:
    """``(fingerprint, gathered shape)`` of a direct all_gather (``key``: dtype, shape, tag), or False."""
    numpy_dtype, shape = key[0], key[1]
    plan: tuple[int, tuple[int, ...]] | bool = False
    data = _plan_operand(numpy_dtype, "all_gather", False)
    try:
        tag_value = _tag(tag, group, "all_gather")
    except ValueError:
        data = None
    if data is not None:
        plan = (make_link_fingerprint(group, "all_gather", data, 0, tag_value, _count(shape), shape),
                _gathered_shape(shape, group.world_size))
    return _remember(plans, key, plan)


def _direct_path(g: Backend) -> Any:
    """Build the group's compiled direct paths, keep them in its state, and return the allreduce's (or None).

    A backend offers them through :class:`~ferro.backend.native.NativeCollectives`:
    an arena (shared memory: allreduce), a mesh (TCP: allreduce, broadcast,
    all_gather and barrier) or a foreign call of its own (MPI's allreduce). Built by
    (and, by the thread rule of :mod:`ferro.work`, only ever taken by) the calling
    thread: their plans carry this thread's tag.
    """
    native = g.native
    direct = others = None
    if native is not None:
        direct = native.make_direct_allreduce(lambda exc: _failed(g, exc))
        arena, mesh = native.direct_arena, native.direct_mesh
        if direct is None and arena is not None:
            direct = DirectAllreduce(*_direct_args(g, "allreduce", _direct_plan), op_type=ReduceOp, engine=arena)
        elif direct is None and mesh is not None:
            direct = DirectMeshAllreduce(*_direct_args(g, "allreduce", _direct_plan), op_type=ReduceOp, engine=mesh)
            others = (DirectMeshBroadcast(*_direct_args(g, "broadcast", _direct_broadcast_plan), engine=mesh),
                      DirectMeshAllGather(*_direct_args(g, "all_gather", _direct_all_gather_plan), engine=mesh,
                                          empty=np.empty),
                      DirectMeshBarrier(*_direct_args(g, "barrier", None), engine=mesh))
    g.state.set_direct(direct, *(others or (None, None, None)))
    return direct


def _direct_args(g: Backend, name: str, make_plan: Any) -> tuple[Any, int, Any, Any, Any, type, Any, float]:
    """Return the arguments every direct path of ``name`` on ``g`` takes (see ``ferro._core.direct.DirectCall``)."""
    return (g.state, COLLECTIVE_IDS[name],
            (lambda plans, key, extra: make_plan(plans, key, extra, g)) if make_plan is not None else None,
            lambda exc: fail_together(g, name, exc), lambda: _wake(g), np.ndarray, default_timeout, g.timeout)


def _wake(group: Backend) -> None:
    worker = group.state.worker
    if worker is not None:
        worker.wake()


def _failed(group: Backend, exc: BaseException) -> BaseException:
    """Tell the group's peers about a direct call's failure; return the error to raise."""
    fail_together(group, "allreduce", exc)
    return exc


def _allreduce_algorithm(nbytes: int, world_size: int) -> str:
    rounds = max(1, (world_size - 1).bit_length())
    limit = RECURSIVE_DOUBLING_BYTES if world_size <= 3 else RECURSIVE_DOUBLING_BYTES_MANY
    if nbytes * rounds <= limit:
        return "recursive_doubling"
    if world_size >= 4 and world_size & (world_size - 1) == 0:
        return "halving_doubling"
    return "ring"


def reduce(x: Any, dst: int = 0, op: ReduceOp = ReduceOp.SUM, *, group: Backend | None = None,
           timeout: float | None = None, async_op: bool = False) -> Any:
    """Reduce ``x`` across all ranks into ``x`` on rank ``dst``; other ranks' ``x`` is left unchanged.

    Returns:
        ``x`` on every rank (holding the result on ``dst``).

    Raises:
        InvalidRankError: ``dst`` outside the group. Otherwise as :func:`allreduce`.

    Example::

        # rank 0: x = [1.]   rank 1: x = [2.]   rank 2: x = [3.]
        ferro.reduce(x, dst=1, group=g)
        # rank 0: x = [1.]   rank 1: x = [6.]   rank 2: x = [3.]

    """
    g = resolve_group(group, "reduce")
    if type(x) is not np.ndarray and is_device_array(x):
        return gpu.device_reduce(g, x, dst, op, timeout, async_op)
    data = operand(x, "reduce", writable=True)
    root = resolve_root(dst, g, "reduce", "dst")
    reduce_op = _reduce_op(op, data.dtype, "reduce")
    link = make_link(g, "reduce", resolve_timeout(g, timeout), data, reduce_op.value, root, data.array.size,
                     data.array.shape)

    def body() -> Any:
        flat = data.array.reshape(-1)
        if g.world_size > 1 and flat.size > 0:
            accumulator = flat if g.rank == root else flat.copy()
            native = g.native
            if native is not None and native.native_reduce(accumulator, root, data.dtype, reduce_op,
                                                           link.fingerprint, link.timeout):
                return x  # the backend finished MEAN itself
            algo.reduce_tree(link, accumulator, root, data.dtype, reduce_op.kernel_code)
        if g.rank == root:
            _finish_mean(flat, data.dtype, reduce_op, g.world_size)
        return x

    return execute(g, "reduce", body, async_op, (x,))


def reduce_scatter(x: Any, op: ReduceOp = ReduceOp.SUM, *, group: Backend | None = None,
                   timeout: float | None = None, async_op: bool = False, tag: int = 0, out: Any = None) -> Any:
    """Reduce ``x`` across ranks and give each rank one part of the result.

    ``x`` is split along axis 0 as ``numpy.array_split(x, world_size)`` splits
    it (sizes may differ by one row); rank ``i`` gets reduced part ``i``.
    ``tag`` works as in :func:`all_gather`; ``out`` (optional) receives this
    rank's part: an array of the part's shape and ``x``'s dtype.

    Returns:
        ``out``, or a new array (a tensor for tensor input) holding this rank's part.

    Raises:
        InvalidBufferError: A 0-d input, or as :func:`allreduce`.
        SizeMismatchError: ``out`` has the wrong shape or dtype.

    Example::

        # world of 2; rank 0: x = [1, 2, 3]   rank 1: x = [10, 20, 30]
        part = ferro.reduce_scatter(x, group=g)
        # rank 0: part = [11, 22]   rank 1: part = [33]

    """
    g = resolve_group(group, "reduce_scatter")
    if type(x) is not np.ndarray and is_device_array(x):
        _no_device_out(out, "reduce_scatter")
        return gpu.device_reduce_scatter(g, x, op, timeout, async_op)
    data = operand(x, "reduce_scatter", writable=False)
    if data.array.ndim == 0:
        raise InvalidBufferError("reduce_scatter: the input needs at least one dimension to split along axis 0")
    reduce_op = _reduce_op(op, data.dtype, "reduce_scatter")
    link = make_link(g, "reduce_scatter", resolve_timeout(g, timeout), data, reduce_op.value,
                     _tag(tag, g, "reduce_scatter"), data.array.size, data.array.shape)
    rows = data.array.shape[0]
    row_size = int(np.prod(data.array.shape[1:], dtype=np.int64))
    row_bounds = algo.chunk_bounds(rows, g.world_size)
    bounds = [b * row_size for b in row_bounds]
    part_shape = (row_bounds[g.rank + 1] - row_bounds[g.rank],) + data.array.shape[1:]
    given = _output(out, part_shape, data, "reduce_scatter") if out is not None else None

    def body() -> Any:
        scratch = data.array.reshape(-1).copy()
        mine = scratch[bounds[g.rank]:bounds[g.rank + 1]]
        native = g.native
        if g.world_size == 1 or scratch.size == 0:
            _finish_mean(mine, data.dtype, reduce_op, g.world_size)
        elif native is None or not native.native_reduce_scatter(scratch, bounds, data.dtype, reduce_op,
                                                                link.fingerprint, link.timeout):
            algo.reduce_scatter_ring(link, scratch, bounds, data.dtype, reduce_op.kernel_code)
            _finish_mean(mine, data.dtype, reduce_op, g.world_size)
        part = mine.reshape(part_shape)

        def result() -> Any:
            # Made once the part is final (after MPI's nonblocking call completes, for an async call there).
            if given is not None:
                np.copyto(given.array, part)
                return out
            # A copy, so the result does not keep the whole input-sized scratch alive (N times its own size).
            return wrap_like(part.copy() if part.size < scratch.size else part, data)

        return native.when_complete(result) if native is not None else result()

    return execute(g, "reduce_scatter", body, async_op, (x,) if given is None else (x, given.array))


# --- data movement ------------------------------------------------------------------

def broadcast(x: Any, root: int = 0, *, group: Backend | None = None, timeout: float | None = None,
              async_op: bool = False) -> Any:
    """Copy ``x`` from rank ``root`` into ``x`` on every other rank, in place.

    Returns:
        ``x``.

    Raises:
        InvalidRankError: ``root`` outside the group.
        InvalidBufferError: Not contiguous, or read-only on a receiving rank.
        CollectiveMismatchError: Ranks disagree on size, dtype or root.

    Example::

        # rank 0: x = [1, 2]   rank 1: x = [0, 0]
        ferro.broadcast(x, root=0, group=g)
        # rank 0: x = [1, 2]   rank 1: x = [1, 2]

    """
    g = resolve_group(group, "broadcast")
    if not async_op:  # the direct path: one compiled call where the group has one (see _direct_path)
        direct = g.state.direct_broadcast
        if direct is UNSET:
            _direct_path(g)
            direct = g.state.direct_broadcast
        if direct is not None and direct(x, root, timeout):
            return x
    if type(x) is not np.ndarray and is_device_array(x):
        return gpu.device_broadcast(g, x, root, timeout, async_op)
    root_rank = resolve_root(root, g, "broadcast")
    data = operand(x, "broadcast", writable=g.rank != root_rank)
    link = make_link(g, "broadcast", resolve_timeout(g, timeout), data, 0, root_rank, data.array.size, data.array.shape)

    def body() -> Any:
        flat = data.array.reshape(-1).view(np.uint8)
        if g.world_size > 1 and flat.size > 0:
            native = g.native
            if native is not None and native.native_broadcast(flat, root_rank, link.fingerprint, link.timeout):
                return x
            if flat.nbytes > SMALL_MESSAGE_BYTES and g.world_size > 2:
                algo.broadcast_chain(link, flat, root_rank, BROADCAST_SEGMENT_BYTES)
            else:
                algo.broadcast_tree(link, flat, root_rank)
        return x

    return execute(g, "broadcast", body, async_op, (x,))


def _gathered_shape(shape: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    if not shape:
        return (world_size,)
    return (world_size * shape[0],) + shape[1:]


def all_gather(x: Any, out: Any = None, *, group: Backend | None = None, timeout: float | None = None,
               async_op: bool = False, tag: int = 0) -> Any:
    """Concatenate every rank's ``x`` along axis 0, in rank order, on every rank.

    All ranks pass arrays of the same shape and dtype. A 0-d input gives a result
    of shape ``(world_size,)``.

    Args:
        x: This rank's contribution.
        out: Optional result array of the gathered shape and ``x``'s dtype.
        group: The process group.
        timeout: Seconds (default: the group's).
        async_op: Return a :class:`~ferro.PendingCollective` instead of waiting.
        tag: A number in ``[0, 1024)`` every rank passes alike, carried in the
            call's fingerprint: calls whose tags differ refuse each other with
            :class:`~ferro.CollectiveMismatchError` instead of pairing up. Libraries
            use it to say *what* they gather (FSDP tags each unit's gathers), so
            ranks that reach two equal-sized calls in different orders fail loudly.

    Returns:
        ``out``, or a new array (a tensor for tensor input).

    Raises:
        SizeMismatchError: ``out`` has the wrong shape or dtype.
        CollectiveMismatchError: Ranks disagree on shape or dtype.

    Example::

        # rank 0: x = [1, 2]   rank 1: x = [3, 4]
        y = ferro.all_gather(x, group=g)
        # both ranks: y = [1, 2, 3, 4]

    """
    g = resolve_group(group, "all_gather")
    if not async_op:  # the direct path (see _direct_path)
        direct = g.state.direct_all_gather
        if direct is UNSET:
            _direct_path(g)
            direct = g.state.direct_all_gather
        if direct is not None:
            gathered = direct(x, out, tag, timeout)
            if gathered is not None:
                return gathered
    if type(x) is not np.ndarray and is_device_array(x):
        return gpu.device_all_gather(g, x, out, timeout, async_op)
    data = operand(x, "all_gather", writable=False)
    shape = _gathered_shape(data.array.shape, g.world_size)
    result = _output(out, shape, data, "all_gather")
    link = make_link(g, "all_gather", resolve_timeout(g, timeout), data, 0, _tag(tag, g, "all_gather"),
                     data.array.size, data.array.shape)

    def body() -> Any:
        flat_out = result.array.reshape(-1)
        size = data.array.size
        bounds = [i * size for i in range(g.world_size + 1)]
        flat_out[bounds[g.rank]:bounds[g.rank + 1]] = data.array.reshape(-1)
        if g.world_size > 1 and size > 0:
            byte_bounds = [b * data.dtype.itemsize for b in bounds]
            out_bytes = flat_out.view(np.uint8).reshape(-1)
            native = g.native
            if native is None or not native.native_all_gather(out_bytes, byte_bounds, link.fingerprint, link.timeout):
                algo.all_gather_ring(link, out_bytes, byte_bounds)
        return out if out is not None else wrap_like(result.array, data)

    return execute(g, "all_gather", body, async_op, (x, result.array))


def _separate_output(out: Any, shape: tuple[int, ...], like: Operand, name: str) -> Operand | None:
    """Return ``out`` checked as :func:`_output` checks it and not overlapping the input (None if not given)."""
    if out is None:
        return None
    result = _output(out, shape, like, name)
    if np.may_share_memory(result.array, like.array):
        raise InvalidBufferError(f"{name}: out overlaps the input; blocks would be overwritten before they are sent")
    return result


def _no_device_out(out: Any, name: str) -> None:
    if out is not None:
        raise InvalidBufferError(f"{name}: out= takes host arrays; for GPU arrays use the returned result")


def _tag(tag: Any, group: Backend, name: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise ValueError(f"rank {group.rank}: {name}: tag must be an int in [0, {MAX_TAG}], got {tag!r}")
    return tag


def _output(out: Any, shape: tuple[int, ...], like: Operand, name: str) -> Operand:
    if out is None:
        return Operand(np.empty(shape, like.array.dtype), like.dtype, like.torch_dtype)
    result = operand(out, name, writable=True)
    if result.array.shape != shape or result.array.dtype != like.array.dtype:
        raise SizeMismatchError(
            f"{name}: out has shape {result.array.shape} and dtype {result.array.dtype}; it needs shape {shape} "
            f"and dtype {like.array.dtype}")
    return result


def gather(x: Any, dst: int = 0, *, group: Backend | None = None, timeout: float | None = None,
           async_op: bool = False) -> Any:
    """Concatenate every rank's ``x`` along axis 0 on rank ``dst`` only.

    Returns:
        On ``dst``, a new array (as :func:`all_gather` returns); elsewhere ``None``.

    Example::

        # rank 0: x = [1]   rank 1: x = [2]   rank 2: x = [3]
        y = ferro.gather(x, dst=0, group=g)
        # rank 0: y = [1, 2, 3]   ranks 1, 2: y is None

    """
    g = resolve_group(group, "gather")
    root = resolve_root(dst, g, "gather", "dst")
    data = operand(x, "gather", writable=False)
    shape = _gathered_shape(data.array.shape, g.world_size)
    link = make_link(g, "gather", resolve_timeout(g, timeout), data, 0, root, data.array.size, data.array.shape)

    def body() -> Any:
        out = np.empty(shape, data.array.dtype) if g.rank == root else None
        flat = data.array.reshape(-1)
        native = g.native
        if g.world_size == 1 or flat.size == 0:
            if out is not None:
                out.reshape(-1)[:] = flat
        elif native is None or not native.native_gather(
                flat.view(np.uint8), out.reshape(-1).view(np.uint8) if out is not None else None, root,
                link.fingerprint, link.timeout):
            algo.gather_direct(link, flat, out, root)
        return wrap_like(out, data) if out is not None else None

    return execute(g, "gather", body, async_op, (x,))


def scatter(chunks: Sequence[Any] | None, src: int = 0, *, group: Backend | None = None,
            timeout: float | None = None, async_op: bool = False) -> Any:
    """Send ``chunks[i]`` from rank ``src`` to rank ``i``.

    Receivers need no prior knowledge of the chunks: dtype and shape travel with them.

    Args:
        chunks: On ``src``, a sequence of ``world_size`` arrays (or tensors) of one
            dtype; ignored (pass ``None``) elsewhere.
        src: The sending rank.
        group: The process group.
        timeout: Seconds (default: the group's).
        async_op: Return a :class:`~ferro.PendingCollective` instead of waiting.

    Returns:
        This rank's chunk as a new array (a tensor if the source chunks were tensors).

    Raises:
        ValueError: On ``src``, a number of chunks other than the world size, or mixed dtypes.

    Example::

        # rank 0: chunks = [np.array([1, 2]), np.array([3, 4])]   rank 1: chunks = None
        mine = ferro.scatter(chunks, src=0, group=g)
        # rank 0: mine = [1, 2]   rank 1: mine = [3, 4]

    """
    g = resolve_group(group, "scatter")
    root = resolve_root(src, g, "scatter", "src")
    blocks: list[Operand] | None = None
    if g.rank == root:
        if chunks is None or len(chunks) != g.world_size:
            raise ValueError(f"scatter: rank {root} must pass {g.world_size} chunks, got "
                             f"{'None' if chunks is None else len(chunks)}")
        blocks = [operand(c, "scatter", writable=False) for c in chunks]
        if len({b.array.dtype for b in blocks}) > 1:
            raise ValueError("scatter: all chunks must have the same dtype")
    link = make_link(g, "scatter", resolve_timeout(g, timeout), None, 0, root)

    def body() -> Any:
        if g.rank == root:
            assert blocks is not None  # checked above on the root
            for dst, block in enumerate(blocks):
                if dst != root:
                    link.send(encode_meta(block), dst)
            out = np.empty_like(blocks[root].array)
            if not _native_scatter(g, link, [b.array for b in blocks], out, root):
                algo.scatter_direct(link, [b.array for b in blocks], out, root)
            return wrap_like(out, blocks[root])
        meta = np.empty(META_BYTES, np.uint8)
        link.recv(meta, root)
        incoming = array_from_meta(decode_meta(meta), None, f"rank {g.rank}: scatter")
        if not _native_scatter(g, link, None, incoming.array, root):
            algo.scatter_direct(link, None, incoming.array, root)
        return wrap_like(incoming.array, incoming)

    return execute(g, "scatter", body, async_op, tuple(chunks) if chunks is not None else ())


def _native_scatter(group: Backend, link: algo.Link, blocks: list[np.ndarray] | None, out: np.ndarray,
                    root: int) -> bool:
    """Run scatter's data step natively where the backend has it (the descriptions went first)."""
    native = group.native
    as_bytes = [b.reshape(-1).view(np.uint8) for b in blocks] if blocks is not None else None
    return native is not None and native.native_scatter(as_bytes, out.reshape(-1).view(np.uint8), root,
                                                        link.fingerprint, link.timeout)


def all_to_all(x: Any, *, group: Backend | None = None, timeout: float | None = None, async_op: bool = False,
               out: Any = None) -> Any:
    """Exchange equal blocks: block ``j`` of ``x`` on rank ``i`` becomes block ``i`` of the result on rank ``j``.

    ``x`` is split along axis 0 into ``world_size`` equal blocks. ``out``
    (optional, not ``x`` itself) receives the result: ``x``'s shape and dtype.

    Returns:
        ``out``, or a new array of ``x``'s shape.

    Raises:
        InvalidBufferError: ``x.shape[0]`` not divisible by the world size.
        SizeMismatchError: ``out`` has the wrong shape or dtype.

    Example::

        # rank 0: x = [1, 2]   rank 1: x = [3, 4]
        y = ferro.all_to_all(x, group=g)
        # rank 0: y = [1, 3]   rank 1: y = [2, 4]

    """
    g = resolve_group(group, "all_to_all")
    if type(x) is not np.ndarray and is_device_array(x):
        _no_device_out(out, "all_to_all")
        return gpu.device_all_to_all(g, x, timeout, async_op)
    data = operand(x, "all_to_all", writable=False)
    if data.array.ndim == 0 or data.array.shape[0] % g.world_size:
        raise InvalidBufferError(
            f"all_to_all: axis 0 of shape {data.array.shape} must split into {g.world_size} equal blocks; "
            f"use all_to_all_single_uneven for uneven blocks")
    given = _separate_output(out, data.array.shape, data, "all_to_all")
    link = make_link(g, "all_to_all", resolve_timeout(g, timeout), data, 0, 0, data.array.size, data.array.shape)

    def body() -> Any:
        result = np.empty_like(data.array) if given is None else given.array
        block = data.array.nbytes // g.world_size
        offsets = [i * block for i in range(g.world_size + 1)]
        _exchange_blocks(g, link, data.array, offsets, result, offsets)
        return wrap_like(result, data) if given is None else out

    return execute(g, "all_to_all", body, async_op, (x,) if given is None else (x, given.array))


def all_to_all_single_uneven(x: Any, send_counts: Sequence[int], recv_counts: Sequence[int], *,
                             group: Backend | None = None, timeout: float | None = None,
                             async_op: bool = False, out: Any = None) -> Any:
    """Exchange blocks of any size: rows ``send_counts[j]`` of ``x`` go to rank ``j``.

    Args:
        x: This rank's rows, concatenated in destination order along axis 0.
        send_counts: Rows for each destination; they sum to ``x.shape[0]``.
        recv_counts: Rows expected from each source (each must equal that
            source's ``send_counts`` for this rank).
        group: The process group.
        timeout: Seconds (default: the group's).
        async_op: Return a :class:`~ferro.PendingCollective` instead of waiting.
        out: Optional result array (not ``x`` itself): ``sum(recv_counts)`` rows
            shaped like ``x``'s, of ``x``'s dtype.

    Returns:
        ``out``, or a new array of ``sum(recv_counts)`` rows, blocks in source order.

    Raises:
        ValueError: Counts of the wrong length, negative, or not summing to ``x.shape[0]``.
        SizeMismatchError: A source sends a block of another size than expected; ``out``
            of the wrong shape or dtype.

    Example::

        # rank 0: x = [1, 2, 3], send_counts = [1, 2], recv_counts = [1, 1]
        # rank 1: x = [4, 5],    send_counts = [1, 1], recv_counts = [2, 1]
        y = ferro.all_to_all_single_uneven(x, send_counts, recv_counts, group=g)
        # rank 0: y = [1, 4]   rank 1: y = [2, 3, 5]

    """
    g = resolve_group(group, "all_to_all_single_uneven")
    data = operand(x, "all_to_all_single_uneven", writable=False)
    n = g.world_size
    sends, recvs = _counts(send_counts, n, "send_counts"), _counts(recv_counts, n, "recv_counts")
    if data.array.ndim == 0 or sum(sends) != data.array.shape[0]:
        raise ValueError(f"all_to_all_single_uneven: send_counts sum to {sum(sends)} but x has "
                         f"{data.array.shape[0] if data.array.ndim else 'no'} rows")
    row_shape = data.array.shape[1:]
    link = make_link(g, "all_to_all_single_uneven", resolve_timeout(g, timeout), data, 0, 0, 0, row_shape)

    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * data.array.dtype.itemsize
    if recvs[g.rank] != sends[g.rank]:
        raise SizeMismatchError(f"all_to_all_single_uneven: rank {g.rank} sends itself {sends[g.rank]} rows "
                                f"but expects {recvs[g.rank]}", recvs[g.rank], sends[g.rank])
    out_shape = (sum(recvs),) + row_shape
    given = _separate_output(out, out_shape, data, "all_to_all_single_uneven")

    def body() -> Any:
        result = np.empty(out_shape, data.array.dtype) if given is None else given.array
        send_offsets = [0, *np.cumsum(sends).tolist()]
        recv_offsets = [0, *np.cumsum(recvs).tolist()]
        _exchange_blocks(g, link, data.array, [o * row_bytes for o in send_offsets], result,
                         [o * row_bytes for o in recv_offsets])
        return wrap_like(result, data) if given is None else out

    return execute(g, "all_to_all_single_uneven", body, async_op, (x,) if given is None else (x, given.array))


def _exchange_blocks(group: Backend, link: algo.Link, send: np.ndarray, send_offsets: list[int], recv: np.ndarray,
                     recv_offsets: list[int]) -> None:
    """All-to-all of byte blocks: natively on backends that have it, else pairwise over tagged frames."""
    send_bytes, recv_bytes = send.reshape(-1).view(np.uint8), recv.reshape(-1).view(np.uint8)
    if group.world_size == 1:
        recv_bytes[:] = send_bytes
        return
    native = group.native
    if native is not None and native.native_all_to_all(send_bytes, send_offsets, recv_bytes, recv_offsets,
                                                       link.fingerprint, link.timeout):
        return
    n = group.world_size
    algo.all_to_all_pairwise(link, [send_bytes[send_offsets[i]:send_offsets[i + 1]] for i in range(n)],
                             [recv_bytes[recv_offsets[i]:recv_offsets[i + 1]] for i in range(n)])


def _counts(counts: Sequence[int], n: int, name: str) -> list[int]:
    values = [int(c) for c in counts]
    if len(values) != n or any(c < 0 for c in values):
        raise ValueError(f"all_to_all_single_uneven: {name} needs {n} non-negative counts, got {list(counts)}")
    return values


def barrier(*, group: Backend | None = None, timeout: float | None = None, async_op: bool = False) -> Any:
    """Block until every rank of the group has called ``barrier``.

    Example::

        ferro.barrier(group=g)   # no rank passes until all have arrived
    """
    g = resolve_group(group, "barrier")
    if not async_op:  # the direct path (see _direct_path)
        direct = g.state.direct_barrier
        if direct is UNSET:
            _direct_path(g)
            direct = g.state.direct_barrier
        if direct is not None and direct(timeout):
            return None
    seconds = resolve_timeout(g, timeout)
    return execute(g, "barrier", lambda: g.barrier(timeout=seconds), async_op, ())


def async_all_gather(x: Any, *, group: Backend | None = None, timeout: float | None = None) -> PendingCollective:
    """Start :func:`all_gather` and return its handle (the seed's name for ``async_op=True``)."""
    return all_gather(x, group=group, timeout=timeout, async_op=True)


def async_reduce_scatter(x: Any, op: ReduceOp = ReduceOp.SUM, *, group: Backend | None = None,
                         timeout: float | None = None) -> PendingCollective:
    """Start :func:`reduce_scatter` and return its handle (the seed's name for ``async_op=True``)."""
    return reduce_scatter(x, op, group=group, timeout=timeout, async_op=True)


# --- small Python objects ------------------------------------------------------------

def broadcast_object(obj: Any, root: int = 0, *, group: Backend | None = None, timeout: float | None = None) -> Any:
    """Send a picklable object from ``root`` to every rank.

    Objects are pickled and unpickled only between authenticated peers of the
    job (every connection proved it holds the job secret); keep them small.

    Returns:
        The root's object (a copy on the other ranks).

    Example::

        config = ferro.broadcast_object({"lr": 0.1} if g.rank == 0 else None, group=g)

    """
    g = resolve_group(group, "broadcast_object")
    root_rank = resolve_root(root, g, "broadcast_object")
    link = make_link(g, "broadcast_object", resolve_timeout(g, timeout), None, 0, root_rank)

    def body() -> Any:
        if g.world_size == 1:
            return obj
        payload = np.frombuffer(pickle.dumps(obj), np.uint8) if g.rank == root_rank else None
        length = np.array([payload.size if payload is not None else 0], np.int64)
        algo.broadcast_tree(link, length, root_rank)
        data = payload if payload is not None else np.empty(int(length[0]), np.uint8)
        if data.size:
            algo.broadcast_tree(link, data, root_rank)
        return obj if g.rank == root_rank else pickle.loads(data.tobytes())

    return execute(g, "broadcast_object", body, False, ())


def all_gather_object(obj: Any, *, group: Backend | None = None, timeout: float | None = None) -> list[Any]:
    """Gather a picklable object from every rank onto every rank, as a list in rank order.

    Pickled only between authenticated peers of the job (see :func:`broadcast_object`).

    Example::

        # rank 0: obj = "a"   rank 1: obj = {"b": 2}
        everything = ferro.all_gather_object(obj, group=g)   # ["a", {"b": 2}] on both
    """
    g = resolve_group(group, "all_gather_object")
    link = make_link(g, "all_gather_object", resolve_timeout(g, timeout))

    def body() -> list[Any]:
        mine = np.frombuffer(pickle.dumps(obj), np.uint8)
        n = g.world_size
        lengths = np.zeros(n, np.int64)
        lengths[g.rank] = mine.size
        if n > 1:
            algo.all_gather_ring(link, lengths.view(np.uint8), [i * 8 for i in range(n + 1)])
        width = int(lengths.max())
        padded = np.zeros(n * width, np.uint8)
        padded[g.rank * width: g.rank * width + mine.size] = mine
        if n > 1 and width:
            algo.all_gather_ring(link, padded, [i * width for i in range(n + 1)])
        return [pickle.loads(padded[i * width: i * width + int(lengths[i])].tobytes()) for i in range(n)]

    return execute(g, "all_gather_object", body, False, ())
