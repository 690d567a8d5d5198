"""``ferro run --restart-policy rank``: the agent of an elastic job, which replaces only the ranks that fail.

Where ``run_job`` stops every rank when one fails and starts them all again,
this agent lets the others train on (:mod:`ferro.elastic` shrinks their group in
place) and does three things no rank can do for itself:

* **It serves the job's store** (on the first node), so membership and
  rendezvous survive the loss of any rank, rank 0 included.
* **It records each death** in the store (``ferro/elastic/dead/<member>``) the
  moment it reaps the process, so the survivors agree on who is gone without
  waiting for a timeout.
* **It kills a frozen rank**: each rank beats a heartbeat file
  (:mod:`ferro.launch.heartbeat`); one silent for ``heartbeat_timeout`` seconds is
  killed, and from then on it is a dead rank like any other.
* **It notices a lost node.** The agent of every other node holds a lease: a
  counter in the store it bumps twice a second, next to its node's current
  members. When a node dies whole (its agent with it), the serving agent sees
  the counter stop for ``heartbeat_timeout`` seconds and records that node's
  members dead, so the survivors' rendezvous does not wait out a timeout.

A failed rank's slot is started again (a new *incarnation*:
``FERRO_RESTART_COUNT`` counts them) up to ``max_restarts`` times per slot; the
replacement joins the running job at its next step boundary. The job succeeds
when it finished its last step and every rank still running exits 0; it fails
when its ranks stopped below ``min_size`` ranks or ``min_nodes`` nodes (the
reason is printed) or no rank finished.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

from ferro.elastic import keys
from ferro.elastic.manager import ELASTIC_ENV, MIN_NODES_ENV, MIN_SIZE_ENV
from ferro.errors import ConfigurationError, DistributedError
from ferro.launch.agent import (
    POLL_SECONDS,
    Interrupted,
    LaunchConfig,
    OutputPump,
    failure_of,
    say,
    start_rank,
    stop_ranks,
)
from ferro.launch.heartbeat import HEARTBEAT_FILE_ENV, age
from ferro.launch.reaper import become_subreaper, end_descendants
from ferro.rendezvous.connect import wait_before_closing
from ferro.rendezvous.store import Store

__all__ = ["run_in_place"]


@dataclass
class _Slot:
    """One launch rank: its current process and how many times it was started again."""

    rank: int
    local: int
    incarnation: int
    process: subprocess.Popen[bytes] | None
    beat_file: str
    killed_frozen: bool = False
    exit_code: int | None = None

    @property
    def member(self) -> str:
        return f"{self.rank}.{self.incarnation}"


def _start_slot(config: LaunchConfig, slot: _Slot, pump: OutputPump, records: str) -> None:
    if os.path.exists(slot.beat_file):
        os.unlink(slot.beat_file)  # a new process's age counts from its own start
    extra = {ELASTIC_ENV: "1", MIN_SIZE_ENV: str(config.min_size), MIN_NODES_ENV: str(config.min_nodes),
             HEARTBEAT_FILE_ENV: slot.beat_file}
    label = str(slot.rank) if slot.incarnation == 0 else slot.member
    slot.process = start_rank(config, slot.local, slot.incarnation, pump, records, extra, label)
    slot.killed_frozen = False


def _check_heartbeat(config: LaunchConfig, slot: _Slot) -> None:
    assert slot.process is not None
    silent = age(slot.beat_file)
    if silent > config.heartbeat_timeout and not slot.killed_frozen:
        say(f"rank {slot.member} sent no heartbeat for {silent:.1f} s (frozen or stopped): killing it")
        try:
            os.killpg(slot.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        slot.killed_frozen = True


def _validate(config: LaunchConfig) -> None:
    if config.nproc_per_node < 1 or config.nnodes < 1 or not 0 <= config.node_rank < config.nnodes:
        raise ConfigurationError(
            f"ferro run: need --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes "
            f"(got {config.nproc_per_node}, {config.nnodes}, {config.node_rank})")
    if not 1 <= config.min_size <= config.world_size:
        raise ConfigurationError(f"ferro run: --min-size must be between 1 and the {config.world_size} ranks, "
                                 f"got {config.min_size}")
    if not 1 <= config.min_nodes <= config.nnodes:
        raise ConfigurationError(f"ferro run: --min-nodes must be between 1 and the {config.nnodes} node(s), "
                                 f"got {config.min_nodes}")
    if not config.heartbeat_timeout > 0:
        raise ConfigurationError(f"ferro run: --heartbeat-timeout must be positive, got {config.heartbeat_timeout}")


def run_in_place(config: LaunchConfig) -> int:
    """Run the node's ranks of an elastic job, replacing each failed rank up to ``max_restarts`` times.

    Returns:
        0 when the job finished its last step and every rank still running exited 0;
        1 when it stopped below its minimum size or never finished; 128 + the signal when interrupted.

    Raises:
        ConfigurationError: Invalid settings.

    """
    _validate(config)
    pump = OutputPump(threading.Lock())

    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    become_subreaper()
    records = tempfile.mkdtemp(prefix="ferro-run-")
    store = Store(config.master_addr, config.master_port, secret=config.secret, serve=(config.node_rank == 0))
    first = config.node_rank * config.nproc_per_node
    slots = [_Slot(first + local, local, 0, None, os.path.join(records, f"heartbeat-{first + local}"))
             for local in range(config.nproc_per_node)]
    lease = _Lease(store.clone(), config) if config.node_rank > 0 else None
    nodes = _NodeWatch(config)
    published: list[str] = []
    try:
        for slot in slots:
            _start_slot(config, slot, pump, records)
        while any(slot.process is not None for slot in slots):
            for slot in slots:
                if slot.process is not None:
                    _follow(config, slot, store, pump, records)
            members = [slot.member for slot in slots if slot.process is not None]
            if members != published:  # what the serving agent records dead if this node is lost
                store.set(keys.node_members(config.node_rank), json.dumps(members))
                published = members
            if config.node_rank == 0:
                nodes.look(store)
            time.sleep(POLL_SECONDS)
        pump.drain(5.0)
        outcome = _outcome(store, slots)
        if config.node_rank > 0:
            store.set(keys.agent_done(config.node_rank), "1")
        else:  # the other nodes' agents read the outcome from this store: serve it until they have
            wait_before_closing(store, [keys.agent_done(n) for n in range(1, config.nnodes) if n not in nodes.lost],
                                30.0)
        return outcome
    except DistributedError as exc:  # only the store can raise here: the first node's launcher is gone
        say(f"job failed: lost the job's store, served by the first node's launcher ({exc}); stopping this node")
        stop_ranks([s.process for s in slots if s.process is not None], signal.SIGTERM, config.grace_seconds)
        pump.drain(2.0)
        return 1
    except Interrupted as stop:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        say(f"received {signal.Signals(stop.signum).name}; stopping all ranks")
        stop_ranks([s.process for s in slots if s.process is not None], stop.signum, config.grace_seconds)
        pump.drain(2.0)
        return 128 + stop.signum
    finally:
        if lease is not None:
            lease.stop()
        for slot in slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.kill()
            if slot.process is not None:
                slot.process.wait()
        end_descendants(os.getpid(), config.grace_seconds)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.close()
        shutil.rmtree(records, ignore_errors=True)


class _Lease:
    """A node's lease on the serving agent's store: a counter bumped on a thread of its own while the agent lives."""

    def __init__(self, store: Store, config: LaunchConfig) -> None:
        self._store, self._node = store, config.node_rank
        self._interval = min(0.5, config.heartbeat_timeout / 4)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ferro-run-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._store.add(keys.agent_beat(self._node), 1)
                if self._stopped.wait(self._interval):
                    return
        except DistributedError:
            return  # the store is gone: the main loop says so when it next uses it

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5.0)
        self._store.close()


class _NodeWatch:
    """The serving agent's view of the other nodes' leases: a node whose counter stops is lost, its members dead.

    A node's clock starts at its first beat: one whose launcher starts late is not lost
    for that. A node whose agent said it is done is not watched any more.
    """

    def __init__(self, config: LaunchConfig) -> None:
        self._timeout = config.heartbeat_timeout
        self._seen: dict[int, tuple[int, float]] = {node: (0, 0.0) for node in range(1, config.nnodes)}
        self._next_look = 0.0
        self.lost: set[int] = set()

    def look(self, store: Store) -> None:
        now = time.monotonic()
        if not self._seen or now < self._next_look:
            return
        self._next_look = now + min(0.5, self._timeout / 4)
        for node, (count, since) in list(self._seen.items()):
            if store.check([keys.agent_done(node)]):
                del self._seen[node]
                continue
            current = int(store.add(keys.agent_beat(node), 0))
            if current != count:
                self._seen[node] = (current, now)
            elif count > 0 and now - since > self._timeout:
                del self._seen[node]
                self._lose(store, node, now - since)

    def _lose(self, store: Store, node: int, silent: float) -> None:
        self.lost.add(node)
        key = keys.node_members(node)
        members = json.loads(bytes(store.get(key))) if store.check([key]) else []
        for member in members:  # a death its own agent recorded first keeps its words
            store.compare_set(keys.dead(member), "", f"was lost with node {node}")
        store.add(keys.deaths(), 1)  # the survivors' watchers cut their connections to the lost node
        say(f"node {node}'s launcher sent nothing for {silent:.1f} s: its ranks ({', '.join(members) or 'none'}) "
            f"are taken for lost; the others train on")


def _follow(config: LaunchConfig, slot: _Slot, store: Store, pump: OutputPump, records: str) -> None:
    """Look at one slot's process: beat check while it runs; record, and maybe replace, once it ended."""
    assert slot.process is not None
    code = slot.process.poll()
    if code is None:
        _check_heartbeat(config, slot)
        return
    slot.process, slot.exit_code = None, code
    if code == 0:
        return
    failure = failure_of(slot.rank, code, records, slot.incarnation)
    how = "stopped responding and was killed" if slot.killed_frozen else failure.describe()
    store.set(keys.dead(slot.member), how)  # the survivors' rendezvous reads it: no timeout to wait out
    store.add(keys.deaths(), 1)  # and their watchers, which cut a connection that stays open
    if store.check([keys.failed()]):
        return  # the job stopped below its minimum: nothing to replace
    if store.check([keys.finished()]):
        say(f"rank {slot.member} {how} after the job finished")
        return
    if slot.incarnation < config.max_restarts:
        say(f"rank {slot.member} {how}; the others train on; starting a replacement "
            f"({slot.incarnation + 1} of {config.max_restarts})")
        slot.incarnation += 1
        _start_slot(config, slot, pump, records)
    else:
        say(f"rank {slot.member} {how}; the others train on without it (no restarts left for it)")


def _outcome(store: Store, slots: list[_Slot]) -> int:
    if store.check([keys.failed()]):
        say(f"job failed: {bytes(store.get(keys.failed())).decode(errors='replace')}")
        return 1
    if not store.check([keys.finished()]):
        say("job failed: every rank ended before training finished")
        return 1
    failed = [s for s in slots if s.exit_code not in (0, None)]
    for slot in failed:
        say(f"rank {slot.member} was lost along the way (the job finished without it)")
    return 0
