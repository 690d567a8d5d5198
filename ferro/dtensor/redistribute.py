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
chunks to ``ceil(n / k)`` rows (the padding always lies after the data, so it
is cut off for free), ``all_to_all`` sends uneven blocks as they are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ferro import collective
from ferro.device_mesh import DeviceMesh
from ferro.dtensor import _arrays as xp
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
    """Shard(d) -> Replicate: all_gather the chunks, padded to one length, and cut the padding off."""
    assert isinstance(step.before, Shard)
    dim, parts = step.before.dim, mesh.size(step.mesh_dim)
    length = _parent(shape, placements, mesh, coordinate, step.mesh_dim, dim)
    rows = chunk_size(length, parts)
    front = xp.contiguous(xp.movedim(local, dim, 0))
    if front.shape[0] != rows:
        padded = xp.zeros((rows,) + tuple(front.shape[1:]), front)
        padded[:front.shape[0]] = front
        front = padded
    gathered = collective.all_gather(front, group=mesh.get_group(step.mesh_dim), timeout=timeout)
    return xp.contiguous(xp.movedim(gathered[:length], 0, dim))


def _reduce_scatter(local: Any, shape: tuple[int, ...], placements: list[Placement], mesh: DeviceMesh,
                    coordinate: tuple[int, ...], step: Step, timeout: float | None) -> Any:
    """Partial -> Shard(d): reduce_scatter of the tensor padded to equal chunks; keep this chunk's rows."""
    assert isinstance(step.before, Partial) and isinstance(step.after, Shard)
    dim, parts, index = step.after.dim, mesh.size(step.mesh_dim), coordinate[step.mesh_dim]
    length = _parent(shape, placements, mesh, coordinate, step.mesh_dim, dim)
    rows = chunk_size(length, parts)
    front = xp.movedim(local, dim, 0)
    padded = xp.zeros((rows * parts,) + tuple(front.shape[1:]), front)
    padded[:length] = front
    part = collective.reduce_scatter(padded, step.before.reduce_op, group=mesh.get_group(step.mesh_dim),
                                     timeout=timeout)
    start, stop = chunk_bounds(length, parts, index)
    return xp.contiguous(xp.movedim(part[:stop - start], 0, dim))


def _allreduce(local: Any, shape: tuple[int, ...], placements: list[Placement], mesh: DeviceMesh,
               coordinate: tuple[int, ...], step: Step, timeout: float | None) -> Any:
    """Partial -> Replicate: allreduce a copy (the source DTensor keeps its terms)."""
    assert isinstance(step.before, Partial)
    result = xp.copy(local)
    collective.allreduce(result, step.before.reduce_op, group=mesh.get_group(step.mesh_dim), timeout=timeout)
    return result


def _all_to_all(local: Any, shape: tuple[int, ...], placements: list[Placement], mesh: DeviceMesh,
                coordinate: tuple[int, ...], step: Step, timeout: float | None) -> Any:
    """Shard(i) -> Shard(j): each rank sends every other its columns of j, and joins the rows of i it receives."""
    assert isinstance(step.before, Shard) and isinstance(step.after, Shard)
    old, new = step.before.dim, step.after.dim
    parts, index = mesh.size(step.mesh_dim), coordinate[step.mesh_dim]
    old_length = _parent(shape, placements, mesh, coordinate, step.mesh_dim, old)
    new_length = _parent(shape, placements, mesh, coordinate, step.mesh_dim, new)
    # With `new` in front, the block for rank s is one contiguous run: its chunk of rows.
    front = xp.contiguous(xp.movedim(local, new, 0))
    axis = 1 + _after_front(old, new)
    row = math.prod(int(n) for n in front.shape[1:])
    row_elsewhere = math.prod(int(n) for i, n in enumerate(front.shape) if i not in (0, axis))
    new_chunks = [chunk_bounds(new_length, parts, s) for s in range(parts)]
    old_chunks = [chunk_bounds(old_length, parts, s) for s in range(parts)]
    sends = [(stop - start) * row for start, stop in new_chunks]
    mine = new_chunks[index][1] - new_chunks[index][0]
    receives = [mine * (stop - start) * row_elsewhere for start, stop in old_chunks]
    received = collective.all_to_all_single_uneven(front.reshape(-1), sends, receives,
                                                   group=mesh.get_group(step.mesh_dim), timeout=timeout)
    blocks = []
    offset = 0
    for s, (start, stop) in enumerate(old_chunks):
        block_shape = list(front.shape)
        block_shape[0], block_shape[axis] = mine, stop - start
        blocks.append(received[offset:offset + receives[s]].reshape(block_shape))
        offset += receives[s]
    return xp.contiguous(xp.movedim(xp.cat(blocks, axis), 0, new))


def _after_front(dim: int, front: int) -> int:
    """Where tensor dimension ``dim`` sits among the others once ``front`` moved to axis 0 (0-based, after it)."""
    return dim if dim < front else dim - 1


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
