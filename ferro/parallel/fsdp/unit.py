"""A unit of FSDP: one wrapped module, its flat parameter groups, and where it is in the step."""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass
from typing import Any

from ferro.collective.work import PendingCollective
from ferro.parallel.fsdp.flat import FlatGroup
from ferro.types import MAX_TAG

__all__ = ["BACKWARD", "FORWARD", "PHASE_NAMES", "REDUCE", "Unit", "UnitState", "unit_tag"]

FORWARD, BACKWARD, REDUCE = 0, 1, 2
PHASE_NAMES = {FORWARD: "forward all_gather", BACKWARD: "backward all_gather", REDUCE: "reduce_scatter"}


class UnitState(enum.Enum):
    """Where a unit's parameters are: sharded, being gathered, or gathered."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


@dataclass(eq=False)
class Unit:
    """One wrapped module: its flat parameter groups and where it is in the step."""

    index: int
    name: str
    module: Any
    groups: list[FlatGroup]
    state: UnitState = UnitState.SHARDED
    pending: PendingCollective | None = None
    backward_started: bool = False
    reduced: bool = False
    grads_waiting: int = 0
    backward_tag: int = 0
    keeps_gathered: bool = False  # its gathered vectors are its shards (one shard, no cast): nothing to free

    @property
    def label(self) -> str:
        """How messages name the unit."""
        return repr(self.name) if self.name else "<root>"


def unit_tag(unit: Unit, position: int, phase: int) -> int:
    """Return the tag of ``unit``'s collective at ``position`` of a step's ``phase``, alike on every rank."""
    return zlib.crc32(f"{unit.index}/{position}/{phase}".encode()) & MAX_TAG
