"""One step of elastic training, and what a lost member looks like: :class:`Step`, :class:`Change`."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ferro.elastic.sampler import Shard
from ferro.errors import ConnectionBrokenError, DistributedTimeoutError, PeerLostError, TransportError

__all__ = ["MEMBERSHIP_FAILURES", "Change", "Step", "failure_cause", "in_members", "membership_failure"]

#: The errors that mean "a member is gone or unreachable": the step is abandoned and the group re-formed.
#: A mismatch or bad input is a bug in the program, not a membership change, and still raises.
MEMBERSHIP_FAILURES = (PeerLostError, ConnectionBrokenError, DistributedTimeoutError, TransportError)
_FAILURE_NAMES = tuple(cls.__name__ for cls in MEMBERSHIP_FAILURES)
_RANK = re.compile(r"\brank(s?) (\d+)\b")


def membership_failure(exc: BaseException) -> BaseException | None:
    """Return the ferro error in ``exc``'s chain that means a member was lost, or None.

    torch re-raises an error from an autograd callback or a future as a
    ``RuntimeError`` holding its text, so a text naming one of ferro's
    errors counts too.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MEMBERSHIP_FAILURES):
            return current
        if isinstance(current, RuntimeError) and any(name in str(current) for name in _FAILURE_NAMES):
            return current
        current = current.__cause__ or current.__context__
    return None


def in_members(text: str, members: Sequence[str]) -> str:
    """Rewrite an epoch group's ``rank N`` in ``text`` as the member id the launcher uses (``member 1.1``).

    A group's errors number its ranks within the epoch, while ``ferro run`` and
    every other message name launch ranks and member ids: after a change of
    membership, epoch rank 2 may be launch rank 1's replacement.
    """
    def member(match: re.Match[str]) -> str:
        index = int(match.group(2))
        return f"member {members[index]}" if index < len(members) else match.group(0)

    return _RANK.sub(member, text)


def failure_cause(failure: BaseException, members: Sequence[str] = ()) -> str:
    """Name a step's failure by the ferro error in it (torch wraps them in RuntimeErrors), members by their ids."""
    found = membership_failure(failure) or failure
    name = type(found).__name__
    if not isinstance(found, MEMBERSHIP_FAILURES):
        name = next((n for n in _FAILURE_NAMES if n in str(found)), name)
    first = str(failure).splitlines()[0] if str(failure) else ""
    return f"{name}: {in_members(first, members) if members else first}"


@dataclass
class Change:
    """One membership change, as this rank saw it (:attr:`Manager.history`).

    Attributes:
        epoch: The epoch it led to.
        members: That epoch's members, in rank order.
        cause: Why: the error that ended the step, ``"grow"`` for admitted replacements, ``"start"``.
        step: The first step the new epoch trains.
        detected: ``time.time()`` when this rank met the cause.
        formed: When the new group was connected.
        synced: When the state transfer (if any) was done.
        sent_bytes: State bytes this rank sent; ``received_bytes``: received.

    """

    epoch: int
    members: tuple[str, ...]
    cause: str
    step: int = 0
    detected: float = 0.0
    formed: float = 0.0
    synced: float = 0.0
    sent_bytes: int = 0
    received_bytes: int = 0


class Step:
    """One training step, as a context: a membership failure inside it abandons the step, to be run again.

    Attributes:
        number: The step (0-based); a step redone after a change keeps its number.
        rank: This rank in the step's group.
        world_size: Ranks training this step.
        shard: This rank's samples when the loop has a sampler, else None.
        failure: The error that abandoned the step, once it has.

    Example::

        for step in manager.steps(200, sampler):
            with step:
                x, y = data[step.shard.indices], labels[step.shard.indices]
                loss = loss_fn(model(x), y) * step.shard.loss_weight
                ...

    """

    def __init__(self, number: int, rank: int, world_size: int, shard: Shard | None,
                 lost_member: Callable[[BaseException], BaseException | None] = membership_failure,
                 members: Sequence[str] = ()) -> None:
        self.number, self.rank, self.world_size, self.shard = number, rank, world_size, shard
        self.failure: BaseException | None = None
        self._lost_member = lost_member
        self._members = tuple(members)

    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        failure = self._lost_member(exc)
        if failure is None:
            # The program's own error propagates; its "rank N" are this epoch's ranks: say whose they are.
            if self._members and hasattr(exc, "add_note") and _RANK.search(str(exc)):
                exc.add_note("(this step's ranks are members " + ", ".join(
                    f"{rank}: {member}" for rank, member in enumerate(self._members)) + ")")
            return False
        self.failure = exc
        return True

    def __int__(self) -> int:
        return self.number

    def __repr__(self) -> str:
        return f"Step({self.number}, rank {self.rank} of {self.world_size})"
