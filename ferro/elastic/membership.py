"""Who trains in each epoch: the membership protocol, over the job's store.

A *member* is one process, named ``"<launch rank>.<incarnation>"`` (``"2.0"``
for the third rank as first started, ``"2.1"`` for its first replacement). An
*epoch* is one membership and one process group: epoch 0 is every rank as
launched; each shrink or grow makes the next. Moving to epoch ``n``:

1. Every participant (the previous epoch's survivors, and the replacements it
   invited) marks itself *here*.
2. Each waits until every candidate is here or known dead (``ferro run``'s
   agent writes ``dead/<member>`` within one poll of a process ending; a frozen
   rank is killed by the agent when its heartbeat stops, so it too ends as dead).
3. The first to see that proposes the members (the candidates here and not
   dead, survivors first in their old order, then the newcomers) with a
   compare-and-set on ``<n>/members``; everyone adopts what the store holds, so
   all agree even when a rank died between two participants' looks.

No participant decides alone about another's life: the store holds what the
agent saw. Only if a candidate neither arrives nor dies within the group's
timeout (alive but stuck, heartbeat still beating) is it left out; if it comes
later it finds itself outside the epoch and raises :class:`MembershipError`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ferro.elastic import keys
from ferro.errors import MembershipError
from ferro.rendezvous.scoped import present_or_values

__all__ = ["Epoch", "Invitation", "Membership", "launch_rank", "whole_replicas"]

# Seconds between looks at the store while a rendezvous or an invitation is pending.
SETTLE_POLL_SECONDS = 0.002
INVITE_POLL_SECONDS = 0.02
# Seconds between a waiting member's looks at whether anyone is left to invite it.
ORPHAN_POLL_SECONDS = 0.25


@dataclass(frozen=True)
class Epoch:
    """One membership: its number, its members in rank order, and how many join requests it has considered.

    Attributes:
        number: 0 for the ranks as launched, then one more per change.
        members: Member ids in rank order.
        joins: Join requests considered up to this epoch (admitted, waiting, or dead before they could be).
        waiting: Live members left out until their replica is whole again (only with replicas of
            several ranks: a replica that lost a rank stops training as a whole).

    """

    number: int
    members: tuple[str, ...]
    joins: int
    waiting: tuple[str, ...] = ()

    def rank_of(self, member: str) -> int:
        """Return ``member``'s rank in this epoch."""
        return self.members.index(member)


@dataclass(frozen=True)
class Invitation:
    """A replacement's place: the epoch that admits it and who else takes part."""

    number: int
    previous: tuple[str, ...]
    invited: tuple[str, ...]
    joins: int
    waiting: tuple[str, ...] = ()


def _epoch(number: int, record: dict[str, Any]) -> Epoch:
    return Epoch(number, tuple(record["members"]), int(record["joins"]), tuple(record.get("waiting", ())))


def launch_rank(member: str) -> int:
    """Return the launch rank in a member id (``"2.1"`` -> 2): its replica and place in it never change."""
    return int(member.split(".", 1)[0])


def members_named(members: Iterable[str]) -> str:
    """Name members for a message: ``member 1.0``, ``members 1.0 and 2.1``, ``members 0.0, 1.0 and 2.1``."""
    names = list(members)
    if len(names) == 1:
        return f"member {names[0]}"
    return f"members {', '.join(names[:-1])} and {names[-1]}"


def whole_replicas(members: Sequence[str], replica_size: int) -> tuple[list[str], list[str]]:
    """Split ``members`` into those of whole replicas, in rank order, and the rest (in the order given).

    Launch rank ``r`` is place ``r % replica_size`` of replica ``r // replica_size``
    (a replica: the ranks that shard one copy of the model, ``HYBRID_SHARD``).
    A replica trains only with every place filled, so its members are ordered by
    launch rank: epoch rank ``i`` is place ``i % replica_size``. With one rank per
    replica every member is whole, in the order given.

    Example::

        whole_replicas(["0.0", "2.0", "3.0", "1.1"], 2)   # (["0.0", "1.1", "2.0", "3.0"], [])
        whole_replicas(["0.0", "2.0", "3.0"], 2)          # (["2.0", "3.0"], ["0.0"])

    """
    if replica_size == 1:
        return list(members), []
    by_replica: dict[int, dict[int, str]] = {}
    for member in members:
        rank = launch_rank(member)
        by_replica.setdefault(rank // replica_size, {})[rank % replica_size] = member
    whole = [member for replica in sorted(by_replica) if len(by_replica[replica]) == replica_size
             for _place, member in sorted(by_replica[replica].items())]
    return whole, [m for m in members if m not in whole]


class Membership:
    """One member's side of the protocol, through a store client of its own.

    Args:
        store: A client of the job's store (not shared with a thread that blocks on it).
        member: This process's member id.

    """

    def __init__(self, store: Any, member: str) -> None:
        self.store, self.member = store, member

    # --- what the store says ------------------------------------------------------

    def is_dead(self, member: str) -> bool:
        """Whether the agent recorded ``member``'s process as ended."""
        return bool(self.store.check([keys.dead(member)]))

    def dead_among(self, members: Iterable[str]) -> list[str]:
        """Return the members the agent recorded as ended (one store request for them all)."""
        listed = list(members)
        return [m for m, dead in zip(listed, self._present([keys.dead(m) for m in listed]), strict=True) if dead]

    def _present(self, names: list[str]) -> list[bool]:
        return list(present_or_values(self.store, "present", names, None)) if names else []

    def decided(self, number: int) -> Epoch | None:
        """Return epoch ``number`` if its members were decided, else None."""
        key = keys.epoch(number, "members")
        if not self.store.check([key]):
            return None
        return _epoch(number, json.loads(bytes(self.store.get(key))))

    def ended(self) -> str | None:
        """``"finished"``, or the failure's reason, once the job has ended; else None."""
        if self.store.check([keys.finished()]):
            return "finished"
        if self.store.check([keys.failed()]):
            return bytes(self.store.get(keys.failed())).decode(errors="replace")
        return None

    # --- join requests ------------------------------------------------------------

    def pending_joins(self) -> int:
        """Return how many join requests were ever made."""
        return int(self.store.add(keys.join_count(), 0))

    def join_requests(self, start: int, stop: int) -> list[str]:
        """Return the member ids of join requests ``start`` to ``stop - 1``."""
        return [bytes(self.store.get(keys.join_request(k))).decode() for k in range(start, stop)]

    def request_join(self) -> int:
        """Ask to join; return this request's index."""
        index = int(self.store.add(keys.join_count(), 1)) - 1
        self.store.set(keys.join_request(index), self.member)
        return index

    def propose_invited(self, number: int, invited: Sequence[str], joins: int, waiting: Sequence[str] = ()
                        ) -> tuple[tuple[str, ...], int, tuple[str, ...]]:
        """Propose who epoch ``number`` admits and who keeps waiting; return what the store holds (the first proposal).

        Returns:
            ``(invited, joins, waiting)`` as the store holds them.

        """
        proposal = json.dumps({"invited": list(invited), "joins": joins, "waiting": list(waiting)})
        held = json.loads(bytes(self.store.compare_set(keys.epoch(number, "invited"), "", proposal)))
        return tuple(held["invited"]), int(held["joins"]), tuple(held.get("waiting", ()))

    def wait_for_invitation(self, index: int | None, start: int = 1, initial: Sequence[str] = ()
                            ) -> Invitation | None:
        """Wait until an epoch invites this member; None if the job ended first.

        Only the members of the latest epoch can invite: when every one of them
        has ended, nobody holds the training state any more, and this records
        the job as failed (saying so) rather than waiting forever.

        Args:
            index: This member's join request, or None for a member waiting since epoch ``start - 1``
                for its replica to be whole again.
            start: The first epoch that may invite it.
            initial: The members as launched (epoch 0's candidates, until it is decided).

        Raises:
            MembershipError: An epoch considered this member and left it out (neither admitted nor waiting).
            QuorumLostError: Never; a job that failed returns None too (see :meth:`ended`).

        """
        number = start
        next_look = 0.0
        while True:
            if self.ended() is not None:
                return None
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + ORPHAN_POLL_SECONDS
                if self._orphaned(number - 1, initial):
                    return None
            record = self.decided(number)
            if record is not None:
                considered = index is None or record.joins > index
                if considered and self.member not in record.members and self.member not in record.waiting:
                    raise MembershipError(
                        f"member {self.member}: epoch {number} considered this member and left it out "
                        f"(it did not arrive in time)")
                number += 1
                continue
            invited_key = keys.epoch(number, "invited")
            if self.store.check([invited_key]):
                held = json.loads(bytes(self.store.get(invited_key)))
                previous = self.decided(number - 1)
                if self.member in held["invited"] and previous is not None:
                    return Invitation(number, previous.members, tuple(held["invited"]), int(held["joins"]),
                                      tuple(held.get("waiting", ())))
            time.sleep(INVITE_POLL_SECONDS)

    def _orphaned(self, latest: int, initial: Sequence[str]) -> bool:
        """Record the job failed if every member of epoch ``latest`` (the last decided) has ended; say whether."""
        epoch = self.decided(latest) if latest >= 0 else None
        members = epoch.members if epoch is not None else tuple(initial)
        if not members or not all(self.is_dead(m) for m in members):
            return False
        if self.store.check([keys.epoch(latest + 1, "members")]):
            return False  # a later epoch was decided meanwhile: the caller's next look finds it
        self.store.compare_set(keys.failed(), "", f"every rank of epoch {max(latest, 0)} ended ({', '.join(members)}): "
                               f"no rank holds the training state any more, so nothing can be joined")
        return True

    # --- the rendezvous -----------------------------------------------------------

    def settle(self, number: int, candidates: Sequence[str], joins: int, timeout: float,
               waiting: Sequence[str] = (), replica_size: int = 1) -> Epoch:
        """Arrive at epoch ``number`` and return its members, the same on every participant.

        Args:
            number: The epoch.
            candidates: Who may take part, in rank order (survivors, then invited replacements).
            joins: Join requests considered by this epoch.
            timeout: Seconds to wait for a candidate that neither arrives nor dies.
            waiting: Members already waiting for their replica (carried into the epoch's record).
            replica_size: Ranks per replica: only whole replicas train (see :func:`whole_replicas`).

        Returns:
            The epoch; this member is among its ``members``, or among its ``waiting`` when its replica lost a rank.

        Raises:
            MembershipError: The epoch was decided without this member.

        """
        self.store.set(keys.epoch(number, f"here/{self.member}"), "1")
        deadline = time.monotonic() + timeout
        while True:
            epoch = self.decided(number)
            if epoch is not None:
                break
            arrived = self._present([keys.epoch(number, f"here/{m}") for m in candidates])
            here = {m for m, came in zip(candidates, arrived, strict=True) if came}
            dead = set(self.dead_among(candidates))
            if all(m in here or m in dead for m in candidates) or time.monotonic() > deadline:
                alive = [m for m in candidates if m in here and m not in dead]
                members, benched = whole_replicas(alive, replica_size)
                still = [m for m in waiting if m not in members and not self.is_dead(m)]
                proposal = json.dumps({"members": members, "joins": joins, "waiting": still + benched})
                record = json.loads(bytes(self.store.compare_set(keys.epoch(number, "members"), "", proposal)))
                epoch = _epoch(number, record)
                break
            time.sleep(SETTLE_POLL_SECONDS)
        if self.member not in epoch.members and self.member not in epoch.waiting:
            raise MembershipError(
                f"member {self.member}: epoch {number} formed without it (members {', '.join(epoch.members)}); "
                f"it arrived after the others stopped waiting")
        return epoch
