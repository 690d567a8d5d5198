"""Connecting one epoch's process group, abandoned at once if one of its members dies meanwhile."""

from __future__ import annotations

import threading
from typing import Any

from ferro.backend import JoinSpec, join_backend
from ferro.backend.base import Backend
from ferro.elastic import keys
from ferro.elastic.membership import Epoch, Membership, launch_rank, members_named
from ferro.rendezvous.scoped import ScopedStore

__all__ = ["EpochAbandoned", "connect_epoch"]

# Seconds between looks at the dead records while the group connects.
_LOOK_SECONDS = 0.005


class EpochAbandoned(Exception):
    """An epoch's group could not form: a member died while it was being built."""


def connect_epoch(epoch: Epoch, member: str, store: Any, membership: Membership, backend: str,
                  master: tuple[str, int], secret: bytes, timeout: float) -> Backend:
    """Build ``epoch``'s group on fresh connections under the epoch's own keys; return it.

    The group's ranks are named after the members' launch ranks (:meth:`Backend.name_members`), so
    flight records, ``ferro doctor`` and the launcher's hang verdicts speak of the ranks it started.

    Raises:
        EpochAbandoned: A member died while the group connected.
        DistributedError: The group could not form (a timeout, a lost connection).

    """
    scoped = ScopedStore(store.clone(), keys.epoch(epoch.number, "group/"), owns=True)
    spec = JoinSpec(epoch.rank_of(member), len(epoch.members), master[0], master[1] or 29500, timeout=timeout,
                    store=scoped, close_store=True, secret=secret)
    outcome: dict[str, Any] = {}
    abandoned = threading.Event()

    def build() -> None:
        try:
            group = join_backend(backend, spec)
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc
            return
        if abandoned.is_set():
            group.close()
        else:
            outcome["group"] = group

    thread = threading.Thread(target=build, name=f"ferro-elastic-epoch-{epoch.number}", daemon=True)
    thread.start()
    others = [m for m in epoch.members if m != member]
    while thread.is_alive():
        thread.join(_LOOK_SECONDS)
        if thread.is_alive():
            dead = membership.dead_among(others)
            if dead:
                abandoned.set()
                raise EpochAbandoned(f"{members_named(dead)} ended while epoch {epoch.number} was connecting")
    if "error" in outcome:
        raise outcome["error"]
    group: Backend = outcome["group"]
    group.name_members([launch_rank(m) for m in epoch.members], f"epoch {epoch.number}")
    return group
