"""The direct paths: one compiled call per collective, planned once per signature, where the group has one.

A backend offers them through :class:`~ferro.backend.native.NativeCollectives`:
an arena (shared memory: allreduce), a mesh (TCP: allreduce, broadcast, reduce,
all_gather, reduce_scatter, all_to_all and barrier) or a foreign call of its own (MPI's allreduce). The
compiled side (:mod:`ferro._core.direct`) checks a call's signature against the
plans kept here and runs it without the GIL; a signature it has not seen comes
back here to be planned once, and a plan of ``False`` (an argument the full path
must explain) sends that signature down the full path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro._buffers import Operand, operand
from ferro._core.arena import DirectAllreduce
from ferro._core.collectives import ALGORITHMS as ALLREDUCE_ALGORITHMS
from ferro._core.collectives import (
    DIRECT_REDUCE_SCATTER_BYTES,
    DirectMeshAllGather,
    DirectMeshAllreduce,
    DirectMeshAllToAll,
    DirectMeshBarrier,
    DirectMeshBroadcast,
    DirectMeshReduce,
    DirectMeshReduceScatter,
)
from ferro.backend.base import Backend
from ferro.collective.execute import fail_together, make_link_fingerprint
from ferro.collective.resolve import (
    OP_VALUES,
    chunk_bounds,
    element_count,
    gathered_shape,
    resolve_allreduce_algorithm,
    resolve_op,
    resolve_root,
    resolve_tag,
)
from ferro.errors import InvalidBufferError, InvalidRankError
from ferro.rendezvous.settings import default_timeout
from ferro.types import COLLECTIVE_IDS, KERNEL_CODES, ReduceOp

__all__ = ["direct_path"]

# Signatures (dtype, shape, op) of direct allreduces remembered per group.
DIRECT_PLANS_KEPT = 256


def _remember(plans: dict[Any, Any], key: Any, plan: Any) -> Any:
    if len(plans) >= DIRECT_PLANS_KEPT:
        plans.clear()
    plans[key] = plan
    return plan


def _declined(group: Backend, op: str, nbytes: int) -> bool:
    """Whether ``group`` runs this call of ``op`` otherwise than its direct mesh would (the hierarchy's two levels)."""
    native = group.native
    return native is not None and not native.direct_takes(op, nbytes)


def _plan_operand(numpy_dtype: Any, name: str, writable: bool) -> Operand | None:
    """Return the dtype of a direct plan as the full path sees it, or None where the full path must explain."""
    try:
        data = operand(np.empty(0, numpy_dtype), name, writable=writable)
    except (InvalidBufferError, ValueError):
        return None
    # Not viewed as another dtype (ml_dtypes' bfloat16): the full path handles those.
    return data if data.array.dtype == numpy_dtype else None


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
        parsed = resolve_op(op, data.dtype, "allreduce") if data is not None else None
    except (InvalidBufferError, ValueError):
        parsed = None  # the full path raises the error, with the caller's array in the message
    if data is not None and parsed is not None and not _declined(
            group, "allreduce", element_count(shape) * data.dtype.itemsize):
        count = element_count(shape)
        divisor = float(group.world_size) if parsed is ReduceOp.MEAN else 0.0
        algorithm = ALLREDUCE_ALGORITHMS[resolve_allreduce_algorithm(count * data.dtype.itemsize, group.world_size)]
        plan = (data.dtype.code, KERNEL_CODES[parsed],
                make_link_fingerprint(group, "allreduce", data, OP_VALUES[parsed], algorithm + 1, count, shape),
                divisor, data.dtype.itemsize, algorithm)
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
    if data is not None and not _declined(group, "broadcast", element_count(shape) * data.dtype.itemsize):
        plan = (make_link_fingerprint(group, "broadcast", data, 0, root_rank, element_count(shape), shape), root_rank)
    return _remember(plans, key, plan)


def _direct_reduce_plan(plans: dict[Any, Any], key: Any, root_and_op: Any, group: Backend
                        ) -> tuple[int, int, int, float, int, int] | bool:
    """Return what a direct reduce needs (``key``: dtype, shape, ``(dst, op)``), or False for the full path.

    The plan: dtype code, kernel code, fingerprint, MEAN's divisor (else 0), itemsize and the root's rank.
    """
    numpy_dtype, shape = key[0], key[1]
    dst, op = root_and_op
    plan: tuple[int, int, int, float, int, int] | bool = False
    data = _plan_operand(numpy_dtype, "reduce", True)
    try:
        root_rank = resolve_root(dst, group, "reduce", "dst")
        parsed = resolve_op(op, data.dtype, "reduce") if data is not None else None
    except (InvalidRankError, InvalidBufferError, ValueError):
        parsed = None  # the full path raises the error, with the caller's array in the message
    if data is not None and parsed is not None and not _declined(
            group, "reduce", element_count(shape) * data.dtype.itemsize):
        plan = (data.dtype.code, KERNEL_CODES[parsed],
                make_link_fingerprint(group, "reduce", data, OP_VALUES[parsed], root_rank, element_count(shape),
                                      shape),
                float(group.world_size) if parsed is ReduceOp.MEAN else 0.0, data.dtype.itemsize, root_rank)
    return _remember(plans, key, plan)


def _direct_all_to_all_plan(plans: dict[Any, Any], key: Any, _: Any, group: Backend) -> tuple[int] | bool:
    """``(fingerprint,)`` of a direct all_to_all (``key``: dtype, shape, None), or False.

    False for a 0-d input or an axis 0 that does not split into equal blocks: the full path explains.
    """
    numpy_dtype, shape = key[0], key[1]
    data = _plan_operand(numpy_dtype, "all_to_all", False)
    plan: tuple[int] | bool = False
    if (data is not None and shape and shape[0] % group.world_size == 0
            and not _declined(group, "all_to_all", element_count(shape) * data.dtype.itemsize)):
        plan = (make_link_fingerprint(group, "all_to_all", data, 0, 0, element_count(shape), shape),)
    return _remember(plans, key, plan)


def _direct_all_gather_plan(plans: dict[Any, Any], key: Any, tag: Any, group: Backend
                            ) -> tuple[int, tuple[int, ...]] | bool:
    """``(fingerprint, gathered shape)`` of a direct all_gather (``key``: dtype, shape, tag), or False."""
    numpy_dtype, shape = key[0], key[1]
    plan: tuple[int, tuple[int, ...]] | bool = False
    data = _plan_operand(numpy_dtype, "all_gather", False)
    try:
        tag_value = resolve_tag(tag, group, "all_gather")
    except ValueError:
        data = None
    if data is not None and not _declined(group, "all_gather",
                                          element_count(shape) * data.dtype.itemsize * group.world_size):
        plan = (make_link_fingerprint(group, "all_gather", data, 0, tag_value, element_count(shape), shape),
                gathered_shape(shape, group.world_size))
    return _remember(plans, key, plan)


def _direct_reduce_scatter_plan(plans: dict[Any, Any], key: Any, op: Any, group: Backend
                                ) -> tuple[int, int, int, float, int, tuple[int, ...], tuple[int, ...]] | bool:
    """Return what a direct reduce_scatter needs (``key``: dtype, shape, op), or False for the full path.

    The plan: dtype code, kernel code, fingerprint, MEAN's divisor (else 0), itemsize,
    this rank's part's shape, and the parts' ``n + 1`` element offsets (axis 0 cut as
    :func:`numpy.array_split` cuts it). False for a 0-d input (the full path explains)
    and for inputs over :data:`~ferro._core.collectives.DIRECT_REDUCE_SCATTER_BYTES`.
    """
    numpy_dtype, shape = key[0], key[1]
    plan: tuple[int, int, int, float, int, tuple[int, ...], tuple[int, ...]] | bool = False
    data = _plan_operand(numpy_dtype, "reduce_scatter", False)
    try:
        parsed = resolve_op(op, data.dtype, "reduce_scatter") if data is not None else None
    except (InvalidBufferError, ValueError):
        parsed = None
    count = element_count(shape)
    if (data is not None and parsed is not None and shape and count * data.dtype.itemsize <= DIRECT_REDUCE_SCATTER_BYTES
            and not _declined(group, "reduce_scatter", count * data.dtype.itemsize)):
        n, rank = group.world_size, group.rank
        rows = chunk_bounds(shape[0], n)
        row_size = element_count(shape[1:])
        plan = (data.dtype.code, KERNEL_CODES[parsed],
                make_link_fingerprint(group, "reduce_scatter", data, OP_VALUES[parsed], 0, count, shape),
                float(n) if parsed is ReduceOp.MEAN else 0.0, data.dtype.itemsize,
                (rows[rank + 1] - rows[rank],) + tuple(shape[1:]), tuple(b * row_size for b in rows))
    return _remember(plans, key, plan)


def direct_path(g: Backend) -> Any:
    """Build the group's compiled direct paths, keep them in its state, and return the allreduce's (or None).

    Built by (and, by the thread rule of :mod:`ferro.collective.work`, only ever
    taken by) the calling thread: their plans carry this thread's tag.
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
                      DirectMeshReduceScatter(*_direct_args(g, "reduce_scatter", _direct_reduce_scatter_plan),
                                              op_type=ReduceOp, engine=mesh, empty=np.empty),
                      DirectMeshBarrier(*_direct_args(g, "barrier", None), engine=mesh)
                      if native.direct_takes("barrier", 0) else None,
                      DirectMeshReduce(*_direct_args(g, "reduce", _direct_reduce_plan), engine=mesh),
                      DirectMeshAllToAll(*_direct_args(g, "all_to_all", _direct_all_to_all_plan), engine=mesh,
                                         empty=np.empty))
    g.state.set_direct(direct, *(others or ()))
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
