"""The elastic training loop: a :class:`Manager` that shrinks and grows the group in place, and its :class:`Step`."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferro import environment
from ferro.backend.base import Backend
from ferro.collective.hang_watch import start_hang_watch, waiting_in
from ferro.collective.reductions import allreduce
from ferro.dtensor.device_mesh import DeviceMesh, init_device_mesh
from ferro.elastic import keys
from ferro.elastic.epoch_group import EpochAbandoned, connect_epoch
from ferro.elastic.membership import Epoch, Membership, launch_rank, members_named, whole_replicas
from ferro.elastic.sampler import ElasticSampler
from ferro.elastic.step import MEMBERSHIP_FAILURES, Change, Step, failure_cause, membership_failure
from ferro.elastic.sync import LocalShards, synchronise
from ferro.elastic.watcher import DeathWatcher
from ferro.errors import (
    ConfigurationError,
    DistributedError,
    MembershipError,
    QuorumLostError,
)
from ferro.parallel.ddp import DDP
from ferro.parallel.fsdp import FSDP
from ferro.rendezvous.env import ELASTIC_ENV
from ferro.rendezvous.settings import default_timeout, job_secret, parse_port
from ferro.rendezvous.store import Store
from ferro.types import ReduceOp

__all__ = ["ELASTIC_ENV", "MIN_NODES_ENV", "MIN_SIZE_ENV", "Change", "Manager", "Step", "membership_failure"]

log = logging.getLogger("ferro.elastic")

#: The job's minimum number of ranks (``ferro run --min-size``); below it training stops on every rank.
MIN_SIZE_ENV = "FERRO_MIN_SIZE"
#: The job's minimum number of nodes with a rank training (``ferro run --min-nodes``).
MIN_NODES_ENV = "FERRO_MIN_NODES"


@dataclass
class _Environment:
    member: str
    world_size: int
    incarnation: int
    master_addr: str
    master_port: int


def _environment() -> _Environment:
    if environment.get(ELASTIC_ENV) != "1":
        raise ConfigurationError(
            "ferro.elastic.Manager: start the job with `ferro run --restart-policy rank ...`: its agent serves the "
            "membership store, records ranks that die and starts their replacements (or pass store=, member= and "
            "members= yourself)")
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        incarnation = int(environment.get("FERRO_RESTART_COUNT", "0") or 0)
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
        min_nodes: Stop likewise when the ranks left are on fewer nodes (default ``$FERRO_MIN_NODES``
            or 1); a node is ``launch rank // ranks_per_node``.
        ranks_per_node: Ranks each node started (default ``$LOCAL_WORLD_SIZE``, which ``ferro run`` sets).
        backend: The backend of each epoch's group (``"tcp"`` or ``"shm"``).
        timeout: Seconds for each blocking operation (default ``$FERRO_TIMEOUT`` or 60); a
            backstop only: death is seen on the connections, freezing by ``ferro run``'s heartbeat.
        store: The job's store client (default: the one ``ferro run`` serves, from the environment).
        member: This process's member id (default ``"<RANK>.<FERRO_RESTART_COUNT>"``).
        members: The initial members (default ``"<r>.0"`` for every rank of ``WORLD_SIZE``).
        secret: The job secret (default ``$FERRO_SECRET``).
        replica_size: Ranks per replica for hybrid sharding (:meth:`fsdp`): launch rank ``r`` is
            shard ``r % replica_size`` of replica ``r // replica_size``. A replica that loses a rank
            stops training as a whole (its other ranks wait, in place) until its replacement has
            joined; the other replicas train on. 1 (the default): every rank is a replica (DDP).

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

    def __init__(self, state: Mapping[str, Any] | None = None, *, min_size: int | None = None,
                 min_nodes: int | None = None, ranks_per_node: int | None = None, backend: str = "tcp",
                 timeout: float | None = None, store: Any = None, member: str | None = None,
                 members: list[str] | None = None, secret: bytes | str | None = None,
                 replica_size: int = 1) -> None:
        self.timeout = default_timeout(timeout)
        self.min_size = int(environment.get(MIN_SIZE_ENV, "1") or 1) if min_size is None else int(min_size)
        if self.min_size < 1:
            raise ConfigurationError(f"ferro.elastic.Manager: min_size must be at least 1, got {self.min_size}")
        self.min_nodes = int(environment.get(MIN_NODES_ENV, "1") or 1) if min_nodes is None else int(min_nodes)
        per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        self.ranks_per_node = per_node if per_node > 0 else None
        if self.min_nodes > 1 and self.ranks_per_node is None:
            raise ConfigurationError("ferro.elastic.Manager: min_nodes needs ranks_per_node (ferro run sets "
                                     "$LOCAL_WORLD_SIZE)")
        if backend not in ("tcp", "shm"):
            raise ConfigurationError(f"ferro.elastic.Manager: backend must be \"tcp\" or \"shm\", got {backend!r}")
        self.backend = backend
        self.replica_size = int(replica_size)
        if self.replica_size < 1:
            raise ConfigurationError(f"ferro.elastic.Manager: replica_size must be at least 1, got {replica_size}")
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
        assert member is not None and members is not None
        if len(members) % self.replica_size:
            raise ConfigurationError(f"ferro.elastic.Manager: {len(members)} ranks do not make whole replicas of "
                                     f"replica_size={self.replica_size}")
        self.member: str = member
        self._store = store
        self._membership = Membership(store, member)
        self._state: dict[str, Any] = dict(state or {})
        self._tracked: list[Callable[[], None]] = []  # each re-points one wrapper at the new group
        self.step = 0
        self.history: list[Change] = []
        self.group: Backend | None = None
        #: The current ``(replicate, shard)`` mesh over :attr:`group` when ``replica_size > 1``, else None.
        self.mesh: DeviceMesh | None = None
        self.epoch: Epoch | None = None
        self._fresh = True  # state not yet synchronised with the group: rank 0's (or a source's) wins
        self._initial = tuple(members)
        self._needs_sync = True
        self._cut_epoch = -1  # the epoch whose connections the watcher cut (its errors mean a lost member)
        # The hang watch names this process by its launch rank; ferro run's watchdog reads it (--hang-timeout).
        start_hang_watch(rank=launch_rank(member))
        self._watcher = DeathWatcher(store.clone(), member, lambda: self.epoch.number if self.epoch else -1,
                                     self._cut_dead)
        started = time.time()
        if not joining:
            self._advance(0, list(members), 0, "start", started)
            return
        index = self._membership.request_join()
        log.info("member %s: asked to join (request %d)", member, index)
        self._join(index, 1, started)

    def _join(self, index: int | None, start: int, started: float) -> None:
        """Wait for an epoch from ``start`` on to invite this member (a replacement, or a replica's survivor)."""
        with waiting_in("an invitation to join"):
            invitation = self._membership.wait_for_invitation(index, start, self._initial)
        if invitation is None:
            reason = self._membership.ended()
            if reason == "finished":
                log.warning("member %s: the job finished before it could join; nothing to do", self.member)
                raise SystemExit(0)
            raise QuorumLostError(f"member {self.member}: the job stopped before it could join: {reason}")
        candidates = list(invitation.previous) + [m for m in invitation.invited if m not in invitation.previous]
        self._advance(invitation.number, candidates, invitation.joins, "grow", started, invitation.waiting)

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
        """Re-point ``obj`` at every new group; return it.

        ``obj`` is a :class:`~ferro.FSDP` built on :attr:`mesh` (given each
        epoch's mesh), or anything with ``rebind(group)``: a :class:`~ferro.DDP`,
        or what :func:`ferro.interop.torch_elastic.elastic_ddp` tracks for torch's DDP.

        Raises:
            ConfigurationError: ``obj`` is neither.

        """
        if isinstance(obj, FSDP):
            self._tracked.append(lambda: obj.rebind(device_mesh=self._mesh()))
        elif callable(getattr(obj, "rebind", None)):
            self._tracked.append(lambda: obj.rebind(self._group()))
        else:
            raise ConfigurationError(f"ferro.elastic.Manager.track: {type(obj).__name__} has no rebind(group) and is "
                                     f"not a ferro.FSDP (for torch's DDP use ferro.interop.torch_elastic.elastic_ddp)")
        return obj

    def ddp(self, module: Any, **options: Any) -> DDP:
        """Return a :class:`~ferro.DDP` of ``module`` over the current group that follows every change.

        Parameters are not broadcast here: the first :meth:`steps` iteration makes
        every rank's state rank 0's (a replacement's, the healthy ranks').
        """
        return self.track(DDP(module, group=self._group(), broadcast_parameters=False, **options))

    def fsdp(self, module: Any, **options: Any) -> FSDP:
        """Return a hybrid-sharded :class:`~ferro.FSDP` of ``module`` over :attr:`mesh`, following every change.

        Each replica (``replica_size`` ranks) shards one copy of the model;
        gradients are averaged across the replicas that train the step. A
        replica that loses a rank drops out as a whole until its replacement
        joins, and the rejoining ranks receive their shards (and optimizer
        state) from the ranks at the same shard place of a healthy replica.
        This rank's shards are registered under ``"fsdp"``: register the
        optimizer (built on the wrapper's :meth:`~ferro.FSDP.parameters`) yourself.

        Args:
            module: A ferro.nn or CPU torch module.
            **options: FSDP's own (``auto_wrap_policy``, ``mixed_precision``, ...), except
                ``group``, ``device_mesh``, ``sharding_strategy`` and ``sync_module_states``.

        Raises:
            ConfigurationError: ``replica_size`` is 1 (use :meth:`ddp`), or an option the manager sets.

        """
        if self.replica_size == 1:
            raise ConfigurationError("ferro.elastic.Manager.fsdp: give Manager(replica_size=N), the ranks that shard "
                                     "one copy of the model; with whole copies on every rank use manager.ddp()")
        taken = sorted({"group", "device_mesh", "sharding_strategy", "sync_module_states"} & set(options))
        if taken:
            raise ConfigurationError(f"ferro.elastic.Manager.fsdp: the manager sets {', '.join(taken)}")
        model = FSDP(module, device_mesh=self._mesh(), sharding_strategy="hybrid_shard", sync_module_states=False,
                     **options)
        self._state.setdefault("fsdp", LocalShards(model))
        return self.track(model)

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
                while self._needs_sync:  # a refusal re-forms the group, which is synchronised again
                    self._synchronise()
                if self.step >= total:
                    break
                admitted = self._joins_waiting()
                if admitted:
                    self._grow(admitted)
                    continue
            except BaseException as exc:
                if self._lost_member(exc) is None:
                    raise
                self._recover(exc)
                continue
            group, epoch = self._group(), self.epoch
            shard = sampler.shard(self.step, group.rank, group.world_size) if sampler is not None else None
            step = Step(self.step, group.rank, group.world_size, shard, self._lost_member,
                        epoch.members if epoch is not None else ())
            yield step
            if step.failure is not None:
                self._recover(step.failure)
                continue
            self.step += 1  # committed: this rank applied the step's complete reduction
        if self._group().rank == 0:
            self._store.set(keys.finished(), "1")

    def close(self) -> None:
        """Close the current group (and mesh), the watcher and the store client."""
        self._watcher.stop()
        for group in self._take_groups():
            group.close()
        self._store.close()

    # --- changes ------------------------------------------------------------------------

    def _group(self) -> Backend:
        if self.group is None:
            raise MembershipError(f"member {self.member}: no group (the manager was closed)")
        return self.group

    def _lost_member(self, exc: BaseException) -> BaseException | None:
        """Return the error in ``exc`` that means a lost member, or None (see :func:`membership_failure`).

        After the watcher cut this epoch's connections to a dead member, a
        collective that was waiting on one fails as closed by this process:
        that too is the lost member (so is torch's wrapping of it).
        """
        found = membership_failure(exc)
        if found is None and self.epoch is not None and self._cut_epoch == self.epoch.number and isinstance(
                exc, (DistributedError, RuntimeError)):
            return exc
        return found

    def _cut_dead(self, membership: Membership) -> None:
        """Cut the connections to current members recorded dead (the watcher's thread)."""
        group, epoch, mesh = self.group, self.epoch, self.mesh
        if group is None or epoch is None:
            return
        gone = membership.dead_among(m for m in epoch.members if m != self.member)
        if not gone:
            return
        dead = [epoch.rank_of(m) for m in gone]
        log.warning("member %s: the launcher recorded %s of epoch %d dead: cutting their connections",
                    self.member, members_named(gone), epoch.number)
        self._cut_epoch = epoch.number
        for rank in dead:
            group.cut_peer(rank)
        if mesh is not None:
            coordinate = mesh.get_coordinate()
            for dim in range(mesh.ndim):
                sub = mesh.get_group(dim)
                if sub is group:
                    continue
                line = [int(r) for r in mesh.mesh[coordinate[:dim] + (slice(None),) + coordinate[dim + 1:]]]
                for rank in dead:
                    if rank in line:
                        sub.cut_peer(line.index(rank))

    def _mesh(self) -> DeviceMesh:
        if self.mesh is None:
            raise MembershipError(f"member {self.member}: no mesh (replica_size is 1, or the manager was closed)")
        return self.mesh

    def _joins_waiting(self) -> int:
        """Return the join-request count all ranks agree on when some can be admitted now, else 0.

        Rank 0 looks: a request can be admitted once its replica is whole among
        the waiting members and the requests (always, with one rank per replica).
        """
        group, epoch = self._group(), self.epoch
        assert epoch is not None
        count = np.array([self._admissible_joins() if group.rank == 0 else 0], np.int64)
        allreduce(count, ReduceOp.MAX, group=group)
        return int(count[0]) if int(count[0]) > epoch.joins else 0

    def _admissible_joins(self) -> int:
        epoch = self.epoch
        assert epoch is not None
        count = self._membership.pending_joins()
        if self.replica_size == 1 or count <= epoch.joins:
            return count
        invite, _ = self._joining(count)
        return count if invite else 0

    def _joining(self, joins: int) -> tuple[list[str], list[str]]:
        """Split the waiting members and join requests up to ``joins`` into ``(admitted now, still waiting)``."""
        epoch = self.epoch
        assert epoch is not None
        pool = list(epoch.waiting) + [m for m in self._membership.join_requests(epoch.joins, joins)
                                      if m not in epoch.waiting]
        alive = [m for m in pool if not self._membership.is_dead(m)]
        return whole_replicas(alive, self.replica_size)

    def _grow(self, joins: int) -> None:
        started = time.time()
        invite, waiting = self._joining(joins)
        self._leave_group()
        self._next_epoch(invite, joins, "grow", started, waiting)

    def _recover(self, failure: BaseException) -> None:
        started = time.time()
        epoch = self.epoch
        assert epoch is not None
        cause = failure_cause(failure, epoch.members)  # the epoch's ranks named as the members they are
        log.warning("member %s: step %d abandoned: %s", self.member, self.step, cause)
        self._leave_group()
        self._next_epoch([], epoch.joins, cause, started, list(epoch.waiting))

    def _take_groups(self) -> list[Backend]:
        """Let go of the current group and mesh; return every group to close (the mesh's sub-groups first)."""
        group, mesh = self.group, self.mesh
        self.group = self.mesh = None
        groups = [group] if group is not None else []
        if mesh is not None:  # the mesh's sub-groups have connections of their own
            groups = [g for g in (mesh.get_group(0), mesh.get_group(1)) if g is not group] + groups
        return groups

    def _leave_group(self) -> None:
        groups = self._take_groups()

        def close() -> None:
            for group in groups:
                group.close()

        if groups:
            # Closed on the side: a group that sent abort notices lingers up to 2 s for its peers to close,
            # and a frozen peer never does. The new group has connections of its own.
            threading.Thread(target=close, name="ferro-elastic-close", daemon=True).start()

    def _next_epoch(self, invite: list[str], joins: int, cause: str, started: float,
                    waiting: list[str] | None = None) -> None:
        epoch = self.epoch
        assert epoch is not None
        number = epoch.number + 1
        invited, joins, still = self._membership.propose_invited(number, invite, joins, waiting or [])
        candidates = list(epoch.members) + [m for m in invited if m not in epoch.members]
        self._advance(number, candidates, joins, cause, started, still)

    def _advance(self, number: int, candidates: list[str], joins: int, cause: str, started: float,
                 waiting: tuple[str, ...] | list[str] = ()) -> None:
        """Settle epoch ``number`` and connect its group; on a death while connecting, move on to the next."""
        while True:
            reason = self._membership.ended()
            if reason is not None and reason != "finished":
                raise QuorumLostError(f"member {self.member}: the job stopped: {reason}")
            with waiting_in(f"epoch {number}'s rendezvous"):
                epoch = self._membership.settle(number, candidates, joins, self.timeout, waiting, self.replica_size)
            message = self._below_minimum(epoch)
            if message is not None:
                self._store.compare_set(keys.failed(), "", message)
                raise QuorumLostError(f"member {self.member}: {message}", epoch.members, self.min_size)
            if self.member in epoch.waiting:
                self._wait_for_replica(epoch, started)
                return
            try:
                group = self._connect(epoch)
                self.mesh = self._layout(group)
            except (EpochAbandoned, *MEMBERSHIP_FAILURES) as exc:
                log.warning("member %s: epoch %d did not form (%s); trying again without the lost", self.member,
                            number, exc)
                self.epoch = epoch
                number, candidates = number + 1, list(epoch.members)
                invited, joins, waiting = self._membership.propose_invited(number, [], epoch.joins, epoch.waiting)
                candidates += [m for m in invited if m not in candidates]
                continue
            self.epoch, self.group = epoch, group
            for rebind in self._tracked:
                rebind()
            self._needs_sync = True
            self.history.append(Change(number, epoch.members, cause, self.step, started, time.time()))
            log.info("member %s: epoch %d formed: rank %d of %d (%s)", self.member, number, group.rank,
                     group.world_size, cause)
            return

    def _below_minimum(self, epoch: Epoch) -> str | None:
        """Say why ``epoch`` is too small to train (``min_size`` ranks, ``min_nodes`` nodes), or None."""
        message = None
        if len(epoch.members) < self.min_size:
            message = (f"only {len(epoch.members)} rank(s) left ({', '.join(epoch.members)}), fewer than "
                       f"min_size={self.min_size}: training stops")
        elif self.min_nodes > 1 and self.ranks_per_node is not None:
            nodes = sorted({launch_rank(m) // self.ranks_per_node for m in epoch.members})
            if len(nodes) < self.min_nodes:
                message = (f"ranks on only {len(nodes)} node(s) left (node(s) {', '.join(map(str, nodes)) or 'none'}:"
                           f" {', '.join(epoch.members)}), fewer than min_nodes={self.min_nodes}: training stops")
        if message is not None and epoch.waiting:
            message += (f" ({', '.join(epoch.waiting)} alive but out of training: their replicas of "
                        f"{self.replica_size} ranks each lost a rank)")
        return message

    def _wait_for_replica(self, epoch: Epoch, started: float) -> None:
        """Wait, out of training, until an epoch takes this member's replica (which lost a rank) back whole."""
        log.warning("member %s: its replica lost a rank; waiting out of epoch %d until it is whole again",
                    self.member, epoch.number)
        self.epoch = epoch
        self._fresh = True  # the replica missed steps: its state comes from a healthy replica when it rejoins
        self._join(None, epoch.number + 1, started)

    def _layout(self, group: Backend) -> DeviceMesh | None:
        """Lay the group out as ``(replicate, shard)`` when replicas have several ranks (collective)."""
        if self.replica_size == 1:
            return None
        return init_device_mesh((group.world_size // self.replica_size, self.replica_size), ("replicate", "shard"),
                                group=group, timeout=self.timeout)

    def _connect(self, epoch: Epoch) -> Backend:
        with waiting_in(f"epoch {epoch.number}'s group to connect"):
            return connect_epoch(epoch, self.member, self._store, self._membership, self.backend, self._master,
                                 self._secret, self.timeout)

    def _synchronise(self) -> None:
        """Agree on the committed step and bring every rank that lacks it up to date from one that has it.

        Raises:
            ConfigurationError: This rank's objects refused the job's state (another model): it is left out.

        """
        group, epoch = self._group(), self.epoch
        assert epoch is not None
        change = self.history[-1] if self.history else None
        done = synchronise(group, self._state, self.step, self._fresh, epoch.number == 0, self.replica_size,
                           self.timeout)
        if self.member not in [epoch.members[r] for r in done.refused]:
            self.step = done.step  # this rank holds the agreed state now, whatever others refused
            self._fresh = False
        if done.refused:
            self._refuse([epoch.members[r] for r in done.refused], done.reason)
            return
        self._needs_sync = False
        if change is not None:
            change.synced = time.time()
            change.step = done.step
            change.sent_bytes, change.received_bytes = done.sent_bytes, done.received_bytes

    def _refuse(self, members: list[str], reason: str | None) -> None:
        """Leave out members whose objects refused the state, before any of them trained (all ranks agree)."""
        epoch = self.epoch
        assert epoch is not None
        why = "refused: its objects do not take the job's training state (another model?)"
        if self.member in members:
            self._leave_group()
            raise ConfigurationError(f"member {self.member}: {why}: {reason}; the others train on without it")
        for member in members:  # the survivors' next rendezvous takes it for dead at once
            self._store.compare_set(keys.dead(member), "", why)
        self._store.add(keys.deaths(), 1)
        log.warning("member %s: %s %s; re-forming without", self.member, members_named(members), why)
        started = time.time()
        self._leave_group()
        self._next_epoch([], epoch.joins, f"refused {', '.join(members)}", started, list(epoch.waiting))
