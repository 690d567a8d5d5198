"""The reductions: allreduce, reduce and reduce_scatter.

Each call reads top to bottom as its three rooms: resolve its arguments
(:mod:`ferro.collective.resolve`), route it (a GPU buffer to the group's NCCL
communicator, the compiled direct path of :mod:`ferro.collective.direct`, else the
backend's native algorithm or the generic one of :mod:`ferro.collective.algorithms`),
and execute it in the group's order (:mod:`ferro.collective.execute`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro._buffers import is_device_array, operand, plain_tensor_view, wrap_like
from ferro._core.collectives import ALGORITHMS as ALLREDUCE_ALGORITHMS
from ferro._core.reduce import divide
from ferro._core.state import UNSET
from ferro.backend.base import Backend
from ferro.backend.nccl import routing
from ferro.collective import algorithms as algo
from ferro.collective import process_group as _groups
from ferro.collective.direct import direct_path
from ferro.collective.execute import execute, make_link
from ferro.collective.resolve import (
    OP_VALUES,
    chunk_bounds,
    is_backend_type,
    no_device_out,
    output,
    parse_op,
    resolve_allreduce_algorithm,
    resolve_group,
    resolve_op,
    resolve_root,
    resolve_tag,
    resolve_timeout,
)
from ferro.collective.work import PendingCollective
from ferro.errors import InvalidBufferError
from ferro.types import KERNEL_CODES, DType, ReduceOp

__all__ = ["allreduce", "async_reduce_scatter", "reduce", "reduce_scatter"]


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
        PeerLostError: A peer died or closed its connection.
        DistributedTimeoutError: A peer did not answer within ``timeout``.
        ConnectionBrokenError: A connection failed mid-call.

    Example::

        # rank 0: x = [1., 2.]    rank 1: x = [10., 20.]
        ferro.allreduce(x, group=g)
        # rank 0: x = [11., 22.]  rank 1: x = [11., 22.]

    """
    # The direct path: one compiled call where the group has one (see ferro.collective.direct). Every step here
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
        direct = direct_path(g)
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
        return routing.device_allreduce(g, x, parse_op(op, "allreduce"), timeout, async_op)
    data = operand(x, "allreduce", writable=True)
    reduce_op = resolve_op(op, data.dtype, "allreduce")
    native = g.native
    # The algorithm is chosen for the exchange that runs it: the hierarchy's leaders, a piece at a time.
    exchange = native.exchange_shape(data.array.nbytes, g.world_size) if native is not None else (
        data.array.nbytes, g.world_size)
    chosen = resolve_allreduce_algorithm(*exchange, algorithm)
    # The algorithm rides in the fingerprint's root field, so ranks that chose differently fail with a mismatch.
    link = make_link(g, "allreduce", resolve_timeout(g, timeout), data, OP_VALUES[reduce_op],
                     ALLREDUCE_ALGORITHMS[chosen] + 1, data.array.size, data.array.shape)
    kernel_code = KERNEL_CODES[reduce_op]

    def body() -> Any:
        flat = data.array.reshape(-1)
        if g.world_size > 1 and flat.size > 0:
            if native is not None and native.native_allreduce(flat, data.dtype, reduce_op, link.fingerprint,
                                                              link.timeout, chosen):
                return x  # the backend finished MEAN itself
            algo.allreduce(link, flat, data.dtype, kernel_code, chosen)
        if reduce_op is ReduceOp.MEAN:
            _finish_mean(flat, data.dtype, reduce_op, g.world_size)
        return x

    return execute(g, "allreduce", body, async_op, (x,), link)


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
    if not async_op:  # the direct path (see ferro.collective.direct)
        direct = g.state.direct_reduce
        if direct is UNSET:
            direct_path(g)
            direct = g.state.direct_reduce
        if direct is not None and direct(x, dst, op, timeout):
            return x
    if type(x) is not np.ndarray and is_device_array(x):
        return routing.device_reduce(g, x, resolve_root(dst, g, "reduce", "dst"), parse_op(op, "reduce"),
                                     timeout, async_op)
    data = operand(x, "reduce", writable=True)
    root = resolve_root(dst, g, "reduce", "dst")
    reduce_op = resolve_op(op, data.dtype, "reduce")
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

    return execute(g, "reduce", body, async_op, (x,), link)


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
    if not async_op:  # the direct path (see ferro.collective.direct)
        direct = g.state.direct_reduce_scatter
        if direct is UNSET:
            direct_path(g)
            direct = g.state.direct_reduce_scatter
        if direct is not None:
            part = direct(x, op, out, tag, timeout)
            if part is not None:
                return part
    if type(x) is not np.ndarray and is_device_array(x):
        no_device_out(out, "reduce_scatter")
        return routing.device_reduce_scatter(g, x, parse_op(op, "reduce_scatter"), timeout, async_op)
    data = operand(x, "reduce_scatter", writable=False)
    if data.array.ndim == 0:
        raise InvalidBufferError("reduce_scatter: the input needs at least one dimension to split along axis 0")
    reduce_op = resolve_op(op, data.dtype, "reduce_scatter")
    seconds, tag_value = resolve_timeout(g, timeout), resolve_tag(tag, g, "reduce_scatter")
    row_bounds = chunk_bounds(data.array.shape[0], g.world_size)
    part_shape = (row_bounds[g.rank + 1] - row_bounds[g.rank],) + data.array.shape[1:]
    given = output(out, part_shape, data, "reduce_scatter") if out is not None else None
    row_size = int(np.prod(data.array.shape[1:], dtype=np.int64))
    bounds = [b * row_size for b in row_bounds]
    link = make_link(g, "reduce_scatter", seconds, data, reduce_op.value, tag_value, data.array.size, data.array.shape)

    def body() -> Any:
        source = data.array.reshape(-1)
        native = g.native
        # The backend fills the scratch from the input (a hierarchy does it piece by piece behind its links).
        scratch = np.empty_like(source) if native is not None and g.world_size > 1 else source.copy()
        mine = scratch[bounds[g.rank]:bounds[g.rank + 1]]
        if g.world_size == 1 or scratch.size == 0:
            _finish_mean(mine, data.dtype, reduce_op, g.world_size)
        elif native is None or not native.native_reduce_scatter_from(source, scratch, bounds, data.dtype, reduce_op,
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

    return execute(g, "reduce_scatter", body, async_op, (x,) if given is None else (x, given.array), link)


def async_reduce_scatter(x: Any, op: ReduceOp = ReduceOp.SUM, *, group: Backend | None = None,
                         timeout: float | None = None) -> PendingCollective:
    """Start :func:`reduce_scatter` and return its handle (the seed's name for ``async_op=True``)."""
    return reduce_scatter(x, op, group=group, timeout=timeout, async_op=True)


def _finish_mean(flat: np.ndarray, dtype: DType, op: ReduceOp, world_size: int) -> None:
    if op is ReduceOp.MEAN:
        divide(flat, dtype.code, float(world_size), dtype.itemsize)
