"""Flat-range shards (FSDP's sharded state dict) described as ``Shard(0)`` DTensors, torch FSDP2's layout.

ferro's FSDP shards a *flat vector* of parameters, so a rank holds an arbitrary
range ``[start, stop)`` of each flattened parameter. torch's ``fully_shard``
state dict instead holds each parameter as a DTensor sharded along dimension 0.
Moving from one to the other is an uneven all_to_all per tensor: every rank
sends each other rank the part of its range that lies in that rank's rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ferro import collective
from ferro.backend.base import Backend
from ferro.collective.process_group import get_default_group
from ferro.dtensor.api import DTensor, _as_mesh
from ferro.dtensor.layout import chunk_bounds
from ferro.dtensor.placements import Replicate, Shard

__all__ = ["from_sharded_entries"]


def _is_entry(value: Any) -> bool:
    return not isinstance(value, DTensor) and all(hasattr(value, n) for n in ("local", "global_shape", "start",
                                                                             "stop"))


def from_sharded_entries(state: Mapping[str, Any], group: Backend | None = None, *,
                         timeout: float | None = None) -> dict[str, Any]:
    """Return ``state`` with every flat-range entry replaced by a DTensor sharded along dimension 0.

    Collective over ``group`` (the group whose ranks hold the ranges, FSDP's
    shard group): one all_gather of every rank's ranges, then one
    ``all_to_all_single_uneven`` per entry. 0-d entries become ``Replicate()``.
    Other values pass through unchanged.

    Args:
        state: Names to :class:`~ferro.parallel.fsdp.ShardedEntry` pieces (``local``,
            ``global_shape``, ``start``, ``stop``) and other values, as
            ``FSDP.sharded_state_dict()`` returns them.
        group: The group (default: the default group).
        timeout: Seconds for each collective.

    Raises:
        ValueError: The ranks' ranges of an entry do not lie in rank order and tile the tensor.

    Example::

        # 2 ranks; FSDP's flat shards of a (3, 4) weight: rank 0 elements [0, 7), rank 1 [7, 12)
        dt = from_sharded_entries(model.sharded_state_dict(), group)["fc.weight"]
        # rank 0: dt.to_local() = rows 0-1   rank 1: row 2   (Shard(0), torch.chunk's split)

    """
    g = group if group is not None else get_default_group()
    mesh = _as_mesh(g)
    names = [name for name, value in state.items() if _is_entry(value)]
    mine = np.array([[int(state[n].start), int(state[n].stop)] for n in names], np.int64).reshape(-1, 2)
    ranges = collective.all_gather(mine.reshape(-1), group=g, timeout=timeout).reshape(g.world_size, len(names), 2)
    out = dict(state)
    for index, name in enumerate(names):
        out[name] = _entry_to_dtensor(name, state[name], ranges[:, index], mesh, g, timeout)
    return out


def _entry_to_dtensor(name: str, entry: Any, ranges: np.ndarray, mesh: Any, group: Backend,
                      timeout: float | None) -> DTensor:
    shape = tuple(int(n) for n in entry.global_shape)
    numel = int(np.prod(shape, dtype=np.int64))
    n, rank = group.world_size, group.rank
    position = 0
    for r in range(n):  # the ranges must tile [0, numel) in rank order (empty ones anywhere)
        start, stop = int(ranges[r, 0]), int(ranges[r, 1])
        if start == stop:
            continue
        if start != position or stop < start:
            raise ValueError(f"from_sharded_entries: {name}: rank {r} holds [{start}, {stop}) but the ranges must "
                             f"tile the {numel} elements in rank order (next expected at {position})")
        position = stop
    if position != numel:
        raise ValueError(f"from_sharded_entries: {name}: the ranks' ranges cover {position} of {numel} elements")
    if shape:
        row = numel // shape[0] if shape[0] else 0
        targets = [(lo * row, hi * row) for lo, hi in (chunk_bounds(shape[0], n, r) for r in range(n))]
    else:
        targets = [(0, numel)] * n  # a 0-d tensor cannot be split: every rank gets it
    start, stop = int(entry.start), int(entry.stop)

    def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        low, high = max(a[0], b[0]), min(a[1], b[1])
        return (low, high) if high > low else (low, low)

    sends = [overlap((start, stop), t) for t in targets]
    receives = [overlap((int(ranges[s, 0]), int(ranges[s, 1])), targets[rank]) for s in range(n)]
    local = entry.local.reshape(-1)
    if shape:
        send = local  # the targets tile the tensor in order, so the parts to send are `local`, in order
    else:
        send = local[np.zeros(sum(hi - lo for lo, hi in sends), np.int64)] if local.shape[0] else local
    received = collective.all_to_all_single_uneven(send, [hi - lo for lo, hi in sends],
                                                   [hi - lo for lo, hi in receives], group=group, timeout=timeout)
    if not shape:
        return DTensor.from_local(received.reshape(()), mesh, [Replicate()], shape=())
    rows = chunk_bounds(shape[0], n, rank)
    return DTensor.from_local(received.reshape((rows[1] - rows[0],) + shape[1:]), mesh, [Shard(0)], shape=shape)
