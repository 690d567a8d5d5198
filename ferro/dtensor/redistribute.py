"""Moving a DTensor between placements with real communication, one mesh dimension at a time.

:func:`plan_redistribute` (pure) turns a pair of placement tuples into steps,
each changing one mesh dimension with the cheapest operation that does it:

===================  ============================  =====================================
from                 to                            how
===================  ============================  =====================================
``Shard(d)``         ``Replicate()``               ``all_gather`` over the dimension's group
``Partial(op)``      ``Replicate()``               ``allreduce(op)``
``Partial(op)``      ``Shard(d)``                  ``reduce_scatter(op)``
``Shard(i)``         ``Shard(j)``                  ``all_to_all`` (uneven blocks)
``Replicate()``      ``Shard(d)``                  local: keep this coordinate's chunk
``Replicate()``      ``Partial(op)``               local: SUM keeps the value on coordinate 0, zeros elsewhere
``Shard(d)``         ``Partial(op)``               ``all_gather``, then the local partition
``Partial(a)``       ``Partial(b)``                ``allreduce(a)``, then the local partition
===================  ============================  =====================================

Nested sharding (a tensor dimension sharded by several mesh dimensions) fixes
an order: a mesh dimension's chunk is a chunk of what the earlier mesh
dimensions left. So the plan first undoes, from the last mesh dimension to the
first, every shard that will not survive as it is (gathering it, or moving it to
another tensor dimension with ``all_to_all`` when that is already its final
place), then builds the target from the first mesh dimension to the last
(reductions and local chunking). Shards become uneven blocks the way
``torch.chunk`` makes them; ``all_gather`` and ``reduce_scatter`` pad the last
chunks to ``ceil(n / k)`` rows, ``all_to_all`` sends uneven blocks as they are.
A dimension other than 0 is never transposed to the front: blocks are packed and
placed with copies whose inner runs stay contiguous (a transposing copy cost
10x the collective at 4 MiB), and dimension 0 needs no copy at all when the
chunks are even.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ferro import collective
from ferro.dtensor import _arrays as xp
from ferro.dtensor.device_mesh import DeviceMesh
from ferro.dtensor.layout import chunk_bounds, chunk_size, parent_length
from ferro.dtensor.placements import Partial, Placement, Replicate, Shard
from ferro.types import ReduceOp

__all__ = ["Step", "plan_redistribute", "run_plan"]


@dataclass(frozen=True)
class Step:
    """One change of one mesh dimension's placement.

    Attributes:
        mesh_dim: The mesh dimension that changes.
        before: Its placement before the step.
        after: Its placement after.
        collective: The ferro collective the step runs over that dimension's group, or None when local.

    """

    mesh_dim: int
    before: Placement
    after: Placement
    collective: str | None


def plan_redistribute(source: Sequence[Placement], target: Sequence[Placement]) -> list[Step]:
    """Return the steps that take a tensor from ``source`` placements to ``target``.

    Example::

        plan_redistribute([Shard(0)], [Shard(1)])
        # [Step(mesh_dim=0, before=Shard(0), after=Shard(1), collective="all_to_all_single_uneven")]

    """
    current = list(source)
    steps: list[Step] = []

    def move(mesh_dim: int, after: Placement, name: str | None) -> None:
        steps.append(Step(mesh_dim, current[mesh_dim], after, name))
        current[mesh_dim] = after

    def same_prefix(mesh_dim: int, dim: int) -> bool:
        # The mesh dimensions before mesh_dim shard `dim` alike now and in the target.
        return all((current[k] == Shard(dim)) == (target[k] == Shard(dim)) for k in range(mesh_dim))

    # Undo, last mesh dimension first, every shard that does not survive as it is.
    for mesh_dim in reversed(range(len(current))):
        now, wanted = current[mesh_dim], target[mesh_dim]
        if not isinstance(now, Shard) or (now == wanted and same_prefix(mesh_dim, now.dim)):
            continue
        if isinstance(wanted, Shard) and same_prefix(mesh_dim, wanted.dim):
            move(mesh_dim, wanted, "all_to_all_single_uneven")
        else:
            move(mesh_dim, Replicate(), "all_gather")
    # Build the target, first mesh dimension first, so nested chunks are cut in torch's order.
    for mesh_dim, wanted in enumerate(target):
        now = current[mesh_dim]
        if now == wanted:
            continue
        if isinstance(now, Partial):
            if isinstance(wanted, Shard):
                move(mesh_dim, wanted, "reduce_scatter")
                continue
            move(mesh_dim, Replicate(), "allreduce")
            if isinstance(wanted, Replicate):
                continue
        assert isinstance(current[mesh_dim], Replicate), "every shard that changes was gathered above"
        move(mesh_dim, wanted, None)
    return steps


def run_plan(local: Any, shape: tuple[int, ...], source: Sequence[Placement], steps: list[Step],
             mesh: DeviceMesh, timeout: float | None) -> Any:
    """Run ``steps`` on this rank's piece ``local`` of a tensor of global ``shape``; return the new piece.

    The input is never modified: every step writes into new memory, except a
    local chunk along the first dimension, which may be a view of its input.
    """
    if xp.is_torch(local):
        local = local.detach()  # communication is not differentiable: say so by never carrying a graph
    placements = list(source)
    coordinate = mesh.get_coordinate()
    for step in steps:
        runner = _RUNNERS[(type(step.before), type(step.after))]
        local = runner(local, shape, placements, mesh, coordinate, step, timeout)
        placements[step.mesh_dim] = step.after
    return local


Runner = Any


def _parent(shape: tuple[int, ...], placements: list[Placement], mesh: DeviceMesh, coordinate: tuple[int, ...],
            mesh_dim: int, dim: int) -> int:
    return parent_length(shape, placements, mesh.shape, coordinate, mesh_dim, dim)


def _gather(local: Any, shape: tuple[int, ...], placements: list[Placement], mesh: DeviceMesh,
            coordinate: tuple[int, ...], step: Step, timeout: float | None) -> Any:
    """Shard(d) -> Replicate: all_gather the chunks padded to one length; place each rank's block along d."""
    assert isinstance(step.before, Shard)
    dim, parts = step.before.dim, mesh.size(step.mesh_dim)
    length = _parent(shape, placements, mesh, coordinate, step.mesh_dim, dim)
    rows = chunk_size(length, parts)
    send = xp.contiguous(local)
    if send.shape[dim] != rows:
        send = xp.zeros(_with_length(local.shape, dim, rows), local)
        xp.copy_into(xp.narrow(send, dim, 0, local.shape[dim]), local)
    gathered = collective.all_gather(send, group=mesh.get_group(step.mesh_dim), timeout=timeout)
    if dim == 0:
        return gathered[:length]  # blocks lie in order along dim 0; the padding is all at the end
    blocks = gathered.reshape((parts,) + tuple(send.shape))
    out = xp.empty(_with_length(local.shape, dim, length), local)
    for index in range(parts):
        start, stop = chunk_bounds(length, parts, index)
        xp.copy_into(xp.narrow(out, dim, start, stop - start), xp.narrow(blocks[index], dim, 0, stop - start))
    return out


def _with_length(shape: Any, dim: int, length: int) -> tuple[int, ...]:
    return tuple(length if d == dim else int(n) for d, n in enumerate(shape))


def _reduce_scatter(local: Any, shape: tuple[int, ...], placements: list[Placement], mesh: DeviceMesh,
                    coordinate: tuple[int, ...], step: Step, timeout: float | None) -> Any:
    """Partial -> Shard(d): reduce_scatter of the chunks laid out as equal blocks; keep this chunk."""
    assert isinstance(step.before, Partial) and isinstance(step.after, Shard)
    dim, parts, index = step.after.dim, mesh.size(step.mesh_dim), coordinate[step.mesh_dim]
    length = _parent(shape, placements, mesh, coordinate, step.mesh_dim, dim)
    rows = chunk_size(length, parts)
    if dim == 0 and rows * parts == length:
        send = xp.contiguous(local)  # already equal blocks along dim 0
    else:
        send = xp.zeros((parts,) + _with_length(local.shape, dim, rows), local)
        for block in range(parts):
            start, stop = chunk_bounds(length, parts, block)
            xp.copy_into(xp.narrow(send[block], dim, 0, stop - start), xp.narrow(local, dim, start, stop - start))
    part = collective.reduce_scatter(send, step.before.reduce_op, group=mesh.get_group(step.mesh_dim),
                                     timeout=timeout)
    start, stop = chunk_bounds(length, parts, index)
    if dim == 0 and rows * parts == length:
        return part
    return xp.contiguous(xp.narrow(part[0], dim, 0, stop - start))


def _allreduce(local: Any, shape: tuple[int, ...], placements: list[Placement], mesh: DeviceMesh,
               coordinate: tuple[int, ...], step: Step, timeout: float | None) -> Any:
    """Partial -> Replicate: allreduce a copy (the source DTensor keeps its terms)."""
    assert isinstance(step.before, Partial)
    result = xp.copy(local)
    collective.allreduce(result, step.before.reduce_op, group=mesh.get_group(step.mesh_dim), timeout=timeout)
    return result


def _all_to_all(local: Any, shape: tuple[int, ...], placements: list[Placement], mesh: DeviceMesh,
                coordinate: tuple[int, ...], step: Step, timeout: float | None) -> Any:
    """Shard(i) -> Shard(j): send rank s this piece's chunk s along j; place the blocks received along i."""
    assert isinstance(step.before, Shard) and isinstance(step.after, Shard)
    old, new = step.before.dim, step.after.dim
    parts, index = mesh.size(step.mesh_dim), coordinate[step.mesh_dim]
    old_length = _parent(shape, placements, mesh, coordinate, step.mesh_dim, old)
    new_length = _parent(shape, placements, mesh, coordinate, step.mesh_dim, new)
    old_chunks = [chunk_bounds(old_length, parts, s) for s in range(parts)]
    new_chunks = [chunk_bounds(new_length, parts, s) for s in range(parts)]
    mine = new_chunks[index][1] - new_chunks[index][0]
    # Elements per unit length along `new` (sending) and along `old` (receiving).
    per_new = math.prod(int(n) for d, n in enumerate(local.shape) if d != new)
    per_old = mine * math.prod(int(n) for d, n in enumerate(local.shape) if d not in (old, new))
    sends = [(stop - start) * per_new for start, stop in new_chunks]
    receives = [(stop - start) * per_old for start, stop in old_chunks]
    local = xp.contiguous(local)
    if new == 0:
        send = local.reshape(-1)  # the chunks along dim 0 are already the blocks, in order
    else:
        send = xp.empty((sum(sends),), local)
        offset = 0
        for (start, stop), count in zip(new_chunks, sends, strict=True):
            block = xp.narrow(local, new, start, stop - start)
            xp.copy_into(send[offset:offset + count].reshape(tuple(block.shape)), block)
            offset += count
    received = collective.all_to_all_single_uneven(send, sends, receives, group=mesh.get_group(step.mesh_dim),
                                                   timeout=timeout)
    out_shape = _with_length(_with_length(local.shape, new, mine), old, old_length)
    if old == 0:
        return received.reshape(out_shape)  # the blocks from each rank, in order along dim 0
    out = xp.empty(out_shape, local)
    offset = 0
    for (start, stop), count in zip(old_chunks, receives, strict=True):
        target = xp.narrow(out, old, start, stop - start)
        xp.copy_into(target, received[offset:offset + count].reshape(tuple(target.shape)))
        offset += count
    return out


def _chunk(local: Any, shape: tuple[int, ...], placements: list[Placement], mesh: DeviceMesh,
           coordinate: tuple[int, ...], step: Step, timeout: float | None) -> Any:
    """Replicate -> Shard(d): keep this coordinate's chunk; no communication."""
    assert isinstance(step.after, Shard)
    dim = step.after.dim
    length = _parent(shape, placements, mesh, coordinate, step.mesh_dim, dim)
    start, stop = chunk_bounds(length, mesh.size(step.mesh_dim), coordinate[step.mesh_dim])
    return xp.contiguous(xp.narrow(local, dim, start, stop - start))


def _partition(local: Any, shape: tuple[int, ...], placements: list[Placement], mesh: DeviceMesh,
               coordinate: tuple[int, ...], step: Step, timeout: float | None) -> Any:
    """Replicate -> Partial(op): terms whose reduction is the value, exactly; no communication."""
    assert isinstance(step.after, Partial)
    if step.after.reduce_op is ReduceOp.SUM and coordinate[step.mesh_dim] != 0:
        return xp.zeros_like(local)
    return xp.copy(local)


_RUNNERS: dict[tuple[type, type], Runner] = {
    (Shard, Replicate): _gather,
    (Shard, Shard): _all_to_all,
    (Partial, Replicate): _allreduce,
    (Partial, Shard): _reduce_scatter,
    (Replicate, Shard): _chunk,
    (Replicate, Partial): _partition,
}
