"""Who writes what: every rank's description of its state, checked for agreement and turned into one plan.

Each rank describes its tensor pieces and plain values (:class:`Description`); the
descriptions are all-gathered and every rank computes the same :class:`SavePlan`
from them, so no second round of messages is needed. Identical pieces held by
several ranks (a replicated model under DDP, the replica groups of HYBRID_SHARD)
are written once, by the holder with the fewest bytes assigned so far, largest
pieces first: the bytes spread over the ranks instead of landing on rank 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from ferro.checkpoint._items import Path, PlainItem, TensorItem, dotted
from ferro.errors import CheckpointError

__all__ = ["Description", "SavePlan", "describe", "plan_save"]

PieceKey = tuple[Path, int, int]


@dataclass
class Description:
    """What one rank holds: ``(path, dtype code, shape, start, stop, nbytes)`` per piece, and its plain values."""

    save_id: str
    pieces: list[tuple[Path, str, tuple[int, ...], int, int, int]]
    values: list[tuple[Path, str]]


def describe(save_id: str, tensors: list[TensorItem], plain: list[PlainItem]) -> Description:
    """Return this rank's description of its state."""
    return Description(save_id, [(t.path, t.code, t.shape, t.start, t.stop, t.nbytes) for t in tensors],
                       [(p.path, p.encoded) for p in plain])


@dataclass
class SavePlan:
    """The agreed save: the tensors' dtypes and shapes, the plain values, and the writer of every piece."""

    save_id: str
    world_size: int
    tensors: dict[Path, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    values: dict[Path, str] = field(default_factory=dict)
    writer: dict[PieceKey, int] = field(default_factory=dict)
    bytes_per_rank: list[int] = field(default_factory=list)


def plan_save(descriptions: list[Description]) -> SavePlan:
    """Check the ranks' descriptions against each other and assign every distinct piece one writer.

    Raises:
        CheckpointError: Ranks disagree on a tensor's dtype or shape, or on a plain value; a path is a
            tensor on one rank and a plain value on another; held ranges overlap without being equal,
            or leave elements no rank holds. The message names the path and the ranks.

    """
    plan = SavePlan(descriptions[0].save_id, len(descriptions))
    seen: dict[Path, tuple[str, tuple[int, ...], int]] = {}
    holders: dict[PieceKey, list[int]] = defaultdict(list)
    sizes: dict[PieceKey, int] = {}
    for rank, description in enumerate(descriptions):
        for path, code, shape, start, stop, nbytes in description.pieces:
            if path in seen and seen[path][:2] != (code, shape):
                other_code, other_shape, other = seen[path]
                raise CheckpointError(f"save: ranks disagree on {dotted(path)}: rank {other} has {other_code} "
                                      f"{list(other_shape)}, rank {rank} has {code} {list(shape)}")
            seen.setdefault(path, (code, shape, rank))
            if stop > start:
                holders[(path, start, stop)].append(rank)
                sizes[(path, start, stop)] = nbytes
    value_owner: dict[Path, int] = {}
    for rank, description in enumerate(descriptions):
        for path, encoded in description.values:
            if path in seen:
                raise CheckpointError(f"save: {dotted(path)} is a tensor on rank {seen[path][2]} and a plain value "
                                      f"on rank {rank}")
            if path in plan.values and plan.values[path] != encoded:
                raise CheckpointError(
                    f"save: ranks disagree on the value of {dotted(path)} (rank {value_owner[path]}: "
                    f"{_short(plan.values[path])}, rank {rank}: {_short(encoded)}); a value that differs per rank "
                    f"needs a key per rank, e.g. f'{dotted(path)}.{{rank}}'")
            plan.values.setdefault(path, encoded)
            value_owner.setdefault(path, rank)
    ranges: dict[Path, list[PieceKey]] = defaultdict(list)
    for key in holders:
        ranges[key[0]].append(key)
    for path, (code, shape, _) in seen.items():
        plan.tensors[path] = (code, shape)
        _check_ranges(path, shape, ranges[path], holders)
    plan.bytes_per_rank = [0] * len(descriptions)
    for key in sorted(holders, key=lambda k: (-sizes[k], dotted(k[0]), k[1])):
        rank = min(holders[key], key=lambda r: (plan.bytes_per_rank[r], r))
        plan.writer[key] = rank
        plan.bytes_per_rank[rank] += sizes[key]
    return plan


def _check_ranges(path: Path, shape: tuple[int, ...], keys: list[PieceKey], holders: dict[PieceKey, list[int]]
                  ) -> None:
    numel = math.prod(shape)
    position = 0
    for _, start, stop in sorted(keys, key=lambda k: (k[1], k[2])):
        if start < position:
            raise CheckpointError(f"save: ranks {holders[(path, start, stop)]} hold elements [{start}, {stop}) of "
                                  f"{dotted(path)}, which overlap another rank's piece without being equal to it")
        if start > position:
            break
        position = stop
    if position != numel:
        raise CheckpointError(f"save: no rank holds elements [{position}, ...) of {dotted(path)} (shape "
                              f"{list(shape)}): the ranks' pieces must cover it")


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
