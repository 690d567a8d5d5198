"""A unit's parameters as flat vectors: which element of which parameter each rank's shard holds.

Pure bookkeeping, no arrays: :class:`FlatGroup` lays a unit's parameters of one
dtype end to end, pads the vector to a multiple of the shard group's size and
gives each rank one equal slice. A rank whose slice is all padding (more ranks
than elements) holds an empty share and still takes part in every collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FlatGroup", "ShardedEntry", "Slot"]


@dataclass
class Slot:
    """One parameter inside a flat vector.

    Attributes:
        fqn: Its name in the unwrapped module's ``state_dict`` (``"layers.0.weight"``).
        places: Every ``(module, attribute)`` that holds it (several when modules share it).
        shape: Its shape.
        offset: Where its first element sits in the flat vector.

    """

    fqn: str
    places: list[tuple[Any, str]]
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)


@dataclass
class ShardedEntry:
    """The part of one parameter that this rank holds, as :meth:`FSDP.sharded_state_dict` gives it.

    The parameter, flattened in row-major order, has ``numel`` elements; this rank
    holds elements ``[start, stop)`` of it in ``local`` (1-d, possibly empty).

    Attributes:
        local: This rank's elements: a view of its shard (an array or a tensor), not a copy.
        global_shape: The full parameter's shape.
        start: Index of ``local[0]`` in the flattened parameter.
        stop: One past the last index held here.

    """

    local: Any
    global_shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return math.prod(self.global_shape)


@dataclass
class FlatGroup:
    """A unit's parameters of one dtype and trainability, padded and split into equal shards.

    Attributes:
        slots: The parameters, in the order they lie in the vector.
        shard_size: Ranks the vector is split across (1: not sharded).
        shard_rank: This rank's index among them.
        requires_grad: Whether these parameters train.
        shard: The persistent shard parameter (the optimizer's), set by the framework adapter.
        full: The gathered vector while the unit is unsharded (framework-specific).

    """

    slots: list[Slot]
    shard_size: int
    shard_rank: int
    requires_grad: bool
    shard: Any = None
    full: Any = None
    compute_dtype: Any = None
    reduce_dtype: Any = None
    grad_full: Any = None  # ferro.nn: the gathered gradient buffer during backward
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Real (unpadded) elements."""
        return sum(slot.numel for slot in self.slots)

    @property
    def shard_len(self) -> int:
        """Elements of every rank's shard, padding included."""
        return max(1, -(-self.total // self.shard_size))

    @property
    def padded(self) -> int:
        """Elements of the gathered vector: ``shard_len * shard_size``."""
        return self.shard_len * self.shard_size

    @property
    def start(self) -> int:
        """Where this rank's shard begins in the gathered vector."""
        return self.shard_rank * self.shard_len

    def local(self, slot: Slot, shard_rank: int | None = None) -> tuple[int, int, int]:
        """Return ``(start, stop, position)``: the slot's elements a rank holds, and where they sit in its shard.

        ``start``/``stop`` index the flattened parameter; ``position`` indexes the
        shard. An empty share is ``(0, 0, 0)``.
        """
        begin = (self.shard_rank if shard_rank is None else shard_rank) * self.shard_len
        lo, hi = max(slot.offset, begin), min(slot.offset + slot.numel, begin + self.shard_len)
        if lo >= hi:
            return 0, 0, 0
        return lo - slot.offset, hi - slot.offset, lo - begin
