"""The elastic training loop: a :class:`Manager` that shrinks and grows the group in place, and its :class:`Step`."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferro.backend import JoinSpec, join_backend
from ferro.backend.base import Backend
from ferro.collective.movement import all_gather
from ferro.collective.reductions import allreduce
from ferro.elastic import keys
from ferro.elastic.membership import Epoch, Membership
from ferro.elastic.sampler import ElasticSampler, Shard
from ferro.elastic.transfer import receive_state, send_state
from ferro.errors import (
    ConfigurationError,
    ConnectionBrokenError,
    DistributedTimeoutError,
    MembershipError,
    PeerLostError,
    QuorumLostError,
    TransportError,
)
from ferro.parallel.ddp import DDP
from ferro.rendezvous.scoped import ScopedStore
from ferro.rendezvous.settings import default_timeout, job_secret, parse_port
from ferro.rendezvous.store import Store
from ferro.types import ReduceOp

__all__ = ["ELASTIC_ENV", "MIN_SIZE_ENV", "Change", "Manager", "Step", "membership_failure"]

log = logging.getLogger("ferro.elastic")

#: Set by ``ferro run --restart-policy rank``: its agent serves the store and records dead ranks.
ELASTIC_ENV = "FERRO_ELASTIC"
#: The job's minimum number of ranks (``ferro run --min-size``); below it training stops on every rank.
MIN_SIZE_ENV = "FERRO_MIN_SIZE"

# The errors that mean "a member is gone or unreachable": the step is abandoned and the group re-formed.
# A mismatch or bad input is a bug in the program, not a membership change, and still raises.
_MEMBERSHIP_FAILURES = (PeerLostError, ConnectionBrokenError, DistributedTimeoutError, TransportError)
_FAILURE_NAMES = tuple(cls.__name__ for cls in _MEMBERSHIP_FAILURES)


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
        if isinstance(current, _MEMBERSHIP_FAILURES):
            return current
        if isinstance(current, RuntimeError) and any(name in str(current) for name in _FAILURE_NAMES):
            return current
        current = current.__cause__ or current.__context__
    return None


class _Abandoned(Exception):
    """An epoch's group could not form: a member died while it was being built."""


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

    def __init__(self, number: int, rank: int, world_size: int, shard: Shard | None) -> None:
        self.number, self.rank, self.world_size, self.shard = number, rank, world_size, shard
        self.failure: BaseException | None = None

    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        failure = membership_failure(exc)
        if failure is None:
            return False  # not a lost member: the program's own error propagates
        self.failure = exc
        return True

    def __int__(self) -> int:
        return self.number

    def __repr__(self) -> str:
        return f"Step({self.number}, rank {self.rank} of {self.world_size})"


@dataclass
class _Environment:
    member: str
    world_size: int
    incarnation: int
    master_addr: str
    master_port: int


def _environment() -> _Environment:
    if os.environ.get(ELASTIC_ENV) != "1":
        raise ConfigurationError(
            "ferro.elastic.Manager: start the job with `ferro run --restart-policy rank ...`: its agent serves the "
            "membership store, records ranks that die and starts their replacements (or pass store=, member= and "
            "members= yourself)")
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        incarnation = int(os.environ.get("FERRO_RESTART_COUNT", "0"))
    except (KeyError, ValueError) as exc:
        raise ConfigurationError(f"ferro.elastic.Manager: RANK and WORLD_SIZE must be set ({exc})") from None
    port = parse_port(os.environ.get("MASTER_PORT", ""))
    return _Environment(f"{rank}.{incarnation}", size, incarnation, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                        port)


class Manager:
    """Train through lost and returning ranks in place: no restart, no lost step, nothing read from disk.

    Each rank builds one Manager. When a rank dies (or freezes and ``ferro run``
    kills it), the survivors abandon the step in flight, agree on the new
    membership through the launcher's store, connect a new group and redo the
    step with their shares of its samples. A replacement started by
    ``ferro run`` joins at the next step boundary and receives the model and
    optimizer state from a healthy rank, peer to peer. Whichever rank held the
    most recent committed step is the source, so a step some ranks committed
    before the loss is kept, not redone.

    Args:
        state: Name -> object with ``state_dict()`` / ``load_state_dict()`` (modules,
            optimizers): what a replacement receives. May also be given by :meth:`register`.
        min_size: Stop (on every rank, with :class:`~ferro.errors.QuorumLostError`) when fewer
            ranks remain (default ``$FERRO_MIN_SIZE`` or 1).
        backend: The backend of each epoch's group (``"tcp"`` or ``"shm"``).
        timeout: Seconds for each blocking operation (default ``$FERRO_TIMEOUT`` or 60); a
            backstop only: death is seen on the connections, freezing by ``ferro run``'s heartbeat.
        store: The job's store client (default: the one ``ferro run`` serves, from the environment).
        member: This process's member id (default ``"<RANK>.<FERRO_RESTART_COUNT>"``).
        members: The initial members (default ``"<r>.0"`` for every rank of ``WORLD_SIZE``).
        secret: The job secret (default ``$FERRO_SECRET``).

    Raises:
        ConfigurationError: Not started by ``ferro run --restart-policy rank``, and no store given;
            or another backend.
        QuorumLostError: Fewer than ``min_size`` ranks are left.
        SystemExit: (code 0) A replacement whose job finished before it could join.

    Example::

        # ferro run --nproc-per-node 4 --restart-policy rank --max-restarts 3 train.py
        manager = ferro.elastic.Manager(min_size=2)
        model = manager.ddp(net)                       # ferro.DDP that follows the membership
        optimizer = ferro.nn.SGD(net.parameters(), lr=0.1)
        manager.register(model=net, optimizer=optimizer)
        for step in manager.steps(200, ElasticSampler(len(x), batch_size=64)):
            with step:                                 # a lost rank: the step is run again
                optimizer.zero_grad()
                out = model(x[step.shard.indices])
                model.backward(loss_grad(out, y[step.shard.indices]) * step.shard.loss_weight)
                optimizer.step()

    """

    def __init__(self, state: Mapping[str, Any] | None = None, *, min_size: int | None = None, backend: str = "tcp",
                 timeout: float | None = None, store: Any = None, member: str | None = None,
                 members: list[str] | None = None, secret: bytes | str | None = None) -> None:
        self.timeout = default_timeout(timeout)
        self.min_size = int(os.environ.get(MIN_SIZE_ENV, "1")) if min_size is None else int(min_size)
        if self.min_size < 1:
            raise ConfigurationError(f"ferro.elastic.Manager: min_size must be at least 1, got {self.min_size}")
        if backend not in ("tcp", "shm"):
            raise ConfigurationError(f"ferro.elastic.Manager: backend must be \"tcp\" or \"shm\", got {backend!r}")
        self.backend = backend
        env = _environment() if store is None else None
        self._secret = job_secret(secret)
        if env is not None:
            store = Store(env.master_addr, env.master_port, secret=self._secret, timeout=self.timeout)
            member = member or env.member
            joining = env.incarnation > 0
            members = members or [f"{r}.0" for r in range(env.world_size)]
            self._master = (env.master_addr, env.master_port)
        else:
            if member is None or members is None:
                raise ConfigurationError("ferro.elastic.Manager: with store=, give member= and members=")
            joining = member not in members
            self._master = (getattr(store, "host", "127.0.0.1"), int(getattr(store, "port", 0)))
        self.member: str = member
        self._store = store
        self._membership = Membership(store, member)
        self._state: dict[str, Any] = dict(state or {})
        self._tracked: list[Any] = []
        self.step = 0
        self.history: list[Change] = []
        self.group: Backend | None = None
        self.epoch: Epoch | None = None
        self._fresh = True  # state not yet synchronised with the group: rank 0's (or a source's) wins
        self._needs_sync = True
        started = time.time()
        if not joining:
            self._advance(0, list(members), 0, "start", started)
            return
        index = self._membership.request_join()
        log.info("member %s: asked to join (request %d)", member, index)
        invitation = self._membership.wait_for_invitation(index)
        if invitation is None:
            reason = self._membership.ended()
            if reason == "finished":
                log.warning("member %s: the job finished before it could join; nothing to do", member)
                raise SystemExit(0)
            raise QuorumLostError(f"member {member}: the job stopped before it could join: {reason}")
        candidates = list(invitation.previous) + [m for m in invitation.invited if m not in invitation.previous]
        self._advance(invitation.number, candidates, invitation.joins, "grow", started)

    # --- what the training loop uses -------------------------------------------------

    @property
    def rank(self) -> int:
        """Return this process's rank in the current group."""
        return self._group().rank

    @property
    def world_size(self) -> int:
        """Ranks in the current group."""
        return self._group().world_size

    def register(self, **objects: Any) -> None:
        """Add objects with ``state_dict()``/``load_state_dict()`` to what a replacement receives."""
        self._state.update(objects)

    def track(self, obj: Any) -> Any:
        """Call ``obj.rebind(group)`` whenever the group changes (a :class:`~ferro.DDP` built elsewhere); return it."""
        self._tracked.append(obj)
        return obj

    def ddp(self, module: Any, **options: Any) -> DDP:
        """Return a :class:`~ferro.DDP` of ``module`` over the current group that follows every change.

        Parameters are not broadcast here: the first :meth:`steps` iteration makes
        every rank's state rank 0's (a replacement's, the healthy ranks').
        """
        return self.track(DDP(module, group=self._group(), broadcast_parameters=False, **options))

    def steps(self, total: int, sampler: ElasticSampler | None = None) -> Iterator[Step]:
        """Yield the steps from the current one up to ``total``, each a :class:`Step` to run inside ``with step:``.

        A step abandoned for a lost rank is yielded again (same number, new
        world size and shard); between steps, replacements waiting to join are
        admitted. When the last step is done, the job is marked finished.

        Raises:
            QuorumLostError: Fewer than ``min_size`` ranks are left.

        """
        while True:
            try:
                if self._needs_sync:
                    self._synchronise()
                if self.step >= total:
                    break
                admitted = self._joins_waiting()
                if admitted:
                    self._grow(admitted)
                    continue
            except BaseException as exc:
                if membership_failure(exc) is None:
                    raise
                self._recover(exc)
                continue
            group = self._group()
            shard = sampler.shard(self.step, group.rank, group.world_size) if sampler is not None else None
            step = Step(self.step, group.rank, group.world_size, shard)
            yield step
            if step.failure is not None:
                self._recover(step.failure)
                continue
            self.step += 1  # committed: this rank applied the step's complete reduction
        if self._group().rank == 0:
            self._store.set(keys.finished(), "1")

    def close(self) -> None:
        """Close the current group and the store client."""
        if self.group is not None:
            self.group.close()
            self.group = None
        self._store.close()

    # --- changes ------------------------------------------------------------------------

    def _group(self) -> Backend:
        if self.group is None:
            raise MembershipError(f"member {self.member}: no group (the manager was closed)")
        return self.group

    def _joins_waiting(self) -> int:
        """Return the join-request count all ranks agree on when it is past this epoch's, else 0."""
        group, epoch = self._group(), self.epoch
        assert epoch is not None
        count = np.array([self._membership.pending_joins() if group.rank == 0 else 0], np.int64)
        allreduce(count, ReduceOp.MAX, group=group)
        return int(count[0]) if int(count[0]) > epoch.joins else 0

    def _grow(self, joins: int) -> None:
        epoch = self.epoch
        assert epoch is not None
        started = time.time()
        requests = self._membership.join_requests(epoch.joins, joins)
        self._leave_group()
        self._next_epoch(requests, joins, "grow", started)

    def _recover(self, failure: BaseException) -> None:
        started = time.time()
        log.warning("member %s: step %d abandoned: %s", self.member, self.step, str(failure).splitlines()[0])
        self._leave_group()
        epoch = self.epoch
        assert epoch is not None
        self._next_epoch([], epoch.joins, f"{type(failure).__name__}: {str(failure).splitlines()[0]}", started)

    def _leave_group(self) -> None:
        old, self.group = self.group, None
        if old is not None:
            # Closed on the side: a group that sent abort notices lingers up to 2 s for its peers to close,
            # and a frozen peer never does. The new group has connections of its own.
            threading.Thread(target=old.close, name="ferro-elastic-close", daemon=True).start()

    def _next_epoch(self, invite: list[str], joins: int, cause: str, started: float) -> None:
        epoch = self.epoch
        assert epoch is not None
        number = epoch.number + 1
        invited, joins = self._membership.propose_invited(number, invite, joins)
        candidates = list(epoch.members) + [m for m in invited if m not in epoch.members]
        self._advance(number, candidates, joins, cause, started)

    def _advance(self, number: int, candidates: list[str], joins: int, cause: str, started: float) -> None:
        """Settle epoch ``number`` and connect its group; on a death while connecting, move on to the next."""
        while True:
            reason = self._membership.ended()
            if reason is not None and reason != "finished":
                raise QuorumLostError(f"member {self.member}: the job stopped: {reason}")
            epoch = self._membership.settle(number, candidates, joins, self.timeout)
            if len(epoch.members) < self.min_size:
                message = (f"only {len(epoch.members)} rank(s) left ({', '.join(epoch.members)}), fewer than "
                           f"min_size={self.min_size}: training stops")
                self._store.compare_set(keys.failed(), "", message)
                raise QuorumLostError(f"member {self.member}: {message}", epoch.members, self.min_size)
            try:
                group = self._connect(epoch)
            except (_Abandoned, *_MEMBERSHIP_FAILURES) as exc:
                log.warning("member %s: epoch %d did not form (%s); trying again without the lost", self.member,
                            number, exc)
                self.epoch = epoch
                number, candidates = number + 1, list(epoch.members)
                invited, joins = self._membership.propose_invited(number, [], epoch.joins)
                candidates += [m for m in invited if m not in candidates]
                continue
            self.epoch, self.group = epoch, group
            for obj in self._tracked:
                obj.rebind(group)
            self._needs_sync = True
            self.history.append(Change(number, epoch.members, cause, self.step, started, time.time()))
            log.info("member %s: epoch %d formed: rank %d of %d (%s)", self.member, number, group.rank,
                     group.world_size, cause)
            return

    def _connect(self, epoch: Epoch) -> Backend:
        """Build ``epoch``'s group on fresh connections, abandoning it if one of its members dies meanwhile."""
        rank = epoch.rank_of(self.member)
        scoped = ScopedStore(self._store.clone(), keys.epoch(epoch.number, "group/"), owns=True)
        spec = JoinSpec(rank, len(epoch.members), self._master[0], self._master[1] or 29500, timeout=self.timeout,
                        store=scoped, close_store=True, secret=self._secret)
        outcome: dict[str, Any] = {}
        abandoned = threading.Event()

        def build() -> None:
            try:
                group = join_backend(self.backend, spec)
            except BaseException as exc:  # handed to the waiting thread
                outcome["error"] = exc
                return
            if abandoned.is_set():
                group.close()
            else:
                outcome["group"] = group

        thread = threading.Thread(target=build, name=f"ferro-elastic-epoch-{epoch.number}", daemon=True)
        thread.start()
        others = [m for m in epoch.members if m != self.member]
        while thread.is_alive():
            thread.join(0.005)
            if thread.is_alive():
                dead = self._membership.dead_among(others)
                if dead:
                    abandoned.set()
                    raise _Abandoned(f"member(s) {', '.join(dead)} ended while epoch {epoch.number} was connecting")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["group"]

    def _synchronise(self) -> None:
        """Agree on the committed step and bring every rank that lacks it up to date from one that has it."""
        group = self._group()
        change = self.history[-1] if self.history else None
        # Fresh state (just started, or a replacement) reports -1, except rank 0 of a fresh start: its
        # parameters become everyone's, as DDP's initial broadcast would make them.
        mine = self.step if not self._fresh or (group.rank == 0 and self.epoch is not None and
                                                self.epoch.number == 0) else -1
        steps = np.asarray(all_gather(np.array([mine], np.int64), group=group)).reshape(-1)
        newest = int(steps.max())
        if newest < 0:  # everyone fresh (rank 0 of epoch 0 died before anyone trained): take the lowest rank's
            steps[0] = newest = 0
        sources = [r for r in range(group.world_size) if steps[r] == newest]
        receivers = [r for r in range(group.world_size) if steps[r] < newest]
        sent = received = 0
        for index, receiver in enumerate(receivers):
            source = sources[index % len(sources)]
            if group.rank == source:
                sent += send_state(self._state, receiver, group, timeout=self.timeout)
            elif group.rank == receiver:
                received += receive_state(self._state, source, group, timeout=self.timeout)
        self.step = newest
        self._fresh = False
        self._needs_sync = False
        if change is not None:
            change.synced = time.time()
            change.step = newest
            change.sent_bytes, change.received_bytes = sent, received
