"""After every change of membership: agree on the committed step, and bring every rank that lacks it up to date.

Ranks at the highest committed step are the sources; the others (replacements,
a rank that missed the last step) receive the state from one of them
(:mod:`ferro.elastic.transfer`). A receiver whose objects refuse that state (a
replacement built with another model: other shapes, other names) says so to
every rank in one more small all_gather, before anyone trains a step with it:
the others then re-form without it, and it stops with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferro.backend.base import Backend
from ferro.collective.movement import all_gather
from ferro.elastic.transfer import receive_state, send_state
from ferro.errors import DistributedError

__all__ = ["LocalShards", "Synchronised", "synchronise"]


class LocalShards:
    """What a rejoining rank receives of a hybrid-sharded model: the shards at its place (no communication)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        """Return the model's shards at this rank's place."""
        return dict(self.model.local_state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load shards received from a rank at the same place of a healthy replica."""
        self.model.load_local_state_dict(state)


@dataclass
class Synchronised:
    """What one synchronisation did on this rank.

    Attributes:
        step: The committed step every rank now holds (refused ranks aside).
        sent_bytes: State bytes this rank sent.
        received_bytes: State bytes this rank received.
        refused: The group ranks whose objects refused the state they received.
        reason: Why this rank refused, when it did.

    """

    step: int
    sent_bytes: int = 0
    received_bytes: int = 0
    refused: list[int] = field(default_factory=list)
    reason: str | None = None


def synchronise(group: Backend, state: Mapping[str, Any], step: int, fresh: bool, first_epoch: bool,
                replica_size: int, timeout: float) -> Synchronised:
    """Agree on the committed step and move the state from ranks that hold it to ranks that lack it (collective).

    Args:
        group: The epoch's group.
        state: Name -> object with ``state_dict()`` / ``load_state_dict()``.
        step: This rank's committed step.
        fresh: This rank's state was never synchronised (just started, a replacement, a replica that waited).
        first_epoch: The group is the job's first: a fresh rank 0 (of each shard place) is a source, its
            parameters becoming everyone's as DDP's initial broadcast would make them.
        replica_size: Ranks per replica: a shard's state comes from the same place of a healthy replica.
        timeout: Seconds for each transfer.

    """
    size = replica_size
    mine = step if not fresh or (group.rank < size and first_epoch) else -1
    steps = np.asarray(all_gather(np.array([mine], np.int64), group=group)).reshape(-1)
    newest = int(steps.max())
    if newest < 0:  # everyone fresh (replica 0 of epoch 0 died before anyone trained): take the lowest ranks'
        steps[:size] = newest = 0
    sources = [r for r in range(group.world_size) if steps[r] == newest]
    receivers = [r for r in range(group.world_size) if steps[r] < newest]
    done = Synchronised(newest)
    for index, receiver in enumerate(receivers):
        # A shard's state comes from the same shard place of a healthy replica (place = rank % replica_size).
        same_place = [r for r in sources if r % size == receiver % size]
        source = same_place[index % len(same_place)]
        if group.rank == source:
            done.sent_bytes += send_state(state, receiver, group, timeout=timeout)
        elif group.rank == receiver:
            try:
                done.received_bytes += receive_state(state, source, group, timeout=timeout)
            except DistributedError:
                raise  # the transfer itself failed (a lost member): the manager re-forms the group
            except (KeyError, ValueError, TypeError, RuntimeError) as exc:  # the objects' own refusals
                done.reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if receivers:  # one verdict every rank reads alike, before anyone trains with a refused state
        refused = np.asarray(all_gather(np.array([done.reason is not None], np.int8), group=group)).reshape(-1)
        done.refused = [r for r in range(group.world_size) if refused[r]]
    return done
