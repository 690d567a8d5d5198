"""``ferro run --restart-policy rank``: the agent of an elastic job, which replaces only the ranks that fail.

Where ``run_job`` stops every rank when one fails and starts them all again,
this agent lets the others train on (:mod:`ferro.elastic` shrinks their group in
place) and does three things no rank can do for itself:

* **It serves the job's store** (on the first node), so membership and
  rendezvous survive the loss of any rank, rank 0 included.
* **It records each death** in the store (``ferro/elastic/dead/<member>``) the
  moment it reaps the process, so the survivors agree on who is gone without
  waiting for a timeout.
* **It kills a hung rank** (``--hang-timeout``): the hang watchdog of
  :mod:`ferro.launch.hang`, in its per-rank mode, names an awaited rank that uses
  no CPU, or one idle outside any call, with the records' verdict.
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
from dataclasses import dataclass, field

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
from ferro.launch.hang import HangWatchdog
from ferro.launch.heartbeat import HEARTBEAT_FILE_ENV, age
from ferro.launch.reaper import become_subreaper, end_descendants
from ferro.rendezvous.connect import wait_before_closing
from ferro.rendezvous.store import Store

__all__ = ["run_in_place"]


# How a rank ends when the membership, not its program, ended it (ferro.elastic raises them).
_MEMBERSHIP_ENDINGS = ("MembershipError", "QuorumLostError")


@dataclass(frozen=True)
class _Life:
    """How one process of a slot ended badly: its member id, how, and whether it was a failure of its own."""

    member: str
    how: str
    error: str | None  # the program's own error ("RuntimeError: ..."), None when it was lost (killed, frozen)


@dataclass
class _Slot:
    """One launch rank: its current process, how many times it was started again, and how its lives ended."""

    rank: int
    local: int
    incarnation: int
    process: subprocess.Popen[bytes] | None
    beat_file: str
    killed_as: str | None = None  # why the launcher killed the current process (frozen, hung), if it did
    exit_code: int | None = None
    ended: list[_Life] = field(default_factory=list)

    @property
    def member(self) -> str:
        return f"{self.rank}.{self.incarnation}"

    def kill(self, why: str) -> None:
        """Kill the current process's whole group; ``why`` is how its end is reported."""
        assert self.process is not None
        if self.killed_as is None:
            self.killed_as = why
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _start_slot(config: LaunchConfig, slot: _Slot, pump: OutputPump, records: str, watch: dict[str, str]) -> None:
    if os.path.exists(slot.beat_file):
        os.unlink(slot.beat_file)  # a new process's age counts from its own start
    extra = {ELASTIC_ENV: "1", MIN_SIZE_ENV: str(config.min_size), MIN_NODES_ENV: str(config.min_nodes),
             HEARTBEAT_FILE_ENV: slot.beat_file, **watch}
    label = str(slot.rank) if slot.incarnation == 0 else slot.member
    slot.process = start_rank(config, slot.local, slot.incarnation, pump, records, extra, label)
    slot.killed_as = None


def _check_heartbeat(config: LaunchConfig, slot: _Slot) -> None:
    assert slot.process is not None
    silent = age(slot.beat_file)
    if silent > config.heartbeat_timeout and slot.killed_as is None:
        say(f"rank {slot.member} sent no heartbeat for {silent:.1f} s (frozen or stopped): killing it")
        slot.kill("stopped responding and was killed")


def _runs(slot: _Slot, pid: int | None) -> bool:
    """Whether process ``pid`` (from a dump) is the slot's current rank: its guardian, or the rank it forked.

    A verdict can name a rank whose hung process was replaced since; the replacement must not pay for it.
    """
    assert slot.process is not None
    if pid is None:
        return False
    if pid == slot.process.pid:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1]) == slot.process.pid
    except (OSError, ValueError, IndexError):
        return False


def _kill_hung(watchdog: HangWatchdog, slots: list[_Slot]) -> None:
    """Kill the local ranks the watchdog found hung: from then on they are dead ranks like any other."""
    verdict = watchdog.check()
    if verdict is None:
        return
    for line in verdict.text.splitlines():
        say(line)
    for slot in slots:
        if slot.rank in verdict.hung and slot.process is not None and _runs(slot, verdict.pids.get(slot.rank)):
            say(f"rank {slot.member} is hung (--hang-timeout {watchdog.hang_timeout:g} s): killing it; the others "
                f"train on")
            slot.kill(f"hung (no call made or ended for {watchdog.hang_timeout:g} s, idle) and was killed")


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
        0 when the job finished its last step and no rank of this node failed by an error of its own (ranks
        lost to a signal, a freeze, a hang or their node are survived); 1 when it stopped below its minimum
        size, never finished, or a rank of this node raised; 128 + the signal when interrupted.

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
    # One dump folder for the whole job, whatever becomes of its processes (ferro doctor reads them all there).
    watchdog = HangWatchdog(config.hang_timeout, config.dump_dir, config.world_size,
                            [slot.rank for slot in slots], config.master_port, per_rank=True)
    watch = watchdog.environment()
    published: list[str] = []
    try:
        for slot in slots:
            _start_slot(config, slot, pump, records, watch)
        while any(slot.process is not None for slot in slots):
            _kill_hung(watchdog, slots)
            for slot in slots:
                if slot.process is not None:
                    _follow(config, slot, store, pump, records, watch)
            members = [slot.member for slot in slots if slot.process is not None]
            if members != published:  # what the serving agent records dead if this node is lost
                store.set(keys.node_members(config.node_rank), json.dumps(members))
                published = members
            if config.node_rank == 0:
                nodes.look(store)
            time.sleep(POLL_SECONDS)
        pump.drain(5.0)
        if config.node_rank > 0:
            outcome = _outcome(store, slots)
            # What the first node's exit status adds up: this node's ranks that failed by their own error.
            store.set(keys.node_errors(config.node_rank), json.dumps(_own_errors(slots)))
            store.set(keys.agent_done(config.node_rank), "1")
            return outcome
        # The other nodes' agents read the outcome from this store: serve it until they have; their ranks' own
        # errors count in this node's exit status too, so the job's first node speaks for the whole job.
        others = [n for n in range(1, config.nnodes) if n not in nodes.lost]
        wait_before_closing(store, [keys.agent_done(n) for n in others], 30.0)
        elsewhere = sorted(rank for n in others if store.check([keys.node_errors(n)])
                           for rank in json.loads(bytes(store.get(keys.node_errors(n)))))
        return _outcome(store, slots, elsewhere)
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


def _follow(config: LaunchConfig, slot: _Slot, store: Store, pump: OutputPump, records: str,
            watch: dict[str, str]) -> None:
    """Look at one slot's process: beat check while it runs; record, and maybe replace, once it ended.

    A rank lost to the outside (a signal, a freeze, a hang, its node) is replaced while restarts last. A rank
    that failed by an exception of its own is a program error: it is replaced too (the error may not come
    back), but never after the same error twice in a row, and the job's exit status says so (:func:`_outcome`).
    """
    assert slot.process is not None
    code = slot.process.poll()
    if code is None:
        _check_heartbeat(config, slot)
        return
    slot.process, slot.exit_code = None, code
    if code == 0:
        return
    failure = failure_of(slot.rank, code, records, slot.incarnation)
    how = slot.killed_as or failure.describe()
    own_error = None if slot.killed_as or failure.signal_name else (failure.error or f"exit code {code}")
    if own_error is not None and own_error.startswith(_MEMBERSHIP_ENDINGS):
        own_error = None  # left out of an epoch (too slow to arrive), or the job stopped: not the program's bug
    store.set(keys.dead(slot.member), how)  # the survivors' rendezvous reads it: no timeout to wait out
    store.add(keys.deaths(), 1)  # and their watchers, which cut a connection that stays open
    if store.check([keys.failed()]):
        return  # the job stopped below its minimum: nothing to replace, and each rank's exit is that
    previous = slot.ended[-1] if slot.ended else None
    slot.ended.append(_Life(slot.member, how, own_error))
    if store.check([keys.finished()]):
        say(f"rank {slot.member} {how} after the job finished")
        return
    if own_error is not None and previous is not None and previous.error == own_error:
        say(f"rank {slot.member} {how}; the same error as its previous life ({previous.member}): a bug in the "
            f"program, not a lost rank, so it is not restarted again; the others train on without it")
    elif slot.incarnation < config.max_restarts:
        say(f"rank {slot.member} {how}; the others train on; starting a replacement "
            f"({slot.incarnation + 1} of {config.max_restarts})")
        slot.incarnation += 1
        _start_slot(config, slot, pump, records, watch)
    else:
        say(f"rank {slot.member} {how}; the others train on without it (no restarts left for it)")


def _own_errors(slots: list[_Slot]) -> list[int]:
    """Return the launch ranks of ``slots`` that ended at least once by an error of their own."""
    return sorted({slot.rank for slot in slots for life in slot.ended if life.error is not None})


def _outcome(store: Store, slots: list[_Slot], elsewhere: list[int] | None = None) -> int:
    """Say how the job ended and return the exit status.

    0 only when training finished and no rank failed by an error of its own: a rank lost to the outside
    (killed, frozen, hung, its node lost) is what the policy survives, an exception is a bug that must not
    end in success however often the rank was restarted. Each rank that ended badly is summed up.
    ``elsewhere``: ranks of other nodes that failed by their own error (their launchers summed them up).
    """
    _summarise(slots)
    if store.check([keys.failed()]):
        say(f"job failed: {bytes(store.get(keys.failed())).decode(errors='replace')}")
        return 1
    if not store.check([keys.finished()]):
        say("job failed: every rank ended before training finished")
        return 1
    failed = sorted(set(_own_errors(slots)) | set(elsewhere or ()))
    if failed:
        say(f"job failed: training finished, but rank(s) {', '.join(map(str, failed))} failed by an error of their "
            f"own (each node's launcher sums up its own ranks above)")
        return 1
    return 0


def _summarise(slots: list[_Slot]) -> None:
    for slot in slots:
        errors = [life for life in slot.ended if life.error is not None]
        lost = [life for life in slot.ended if life.error is None]
        if errors:
            reasons = sorted({life.error for life in errors if life.error})
            say(f"summary: rank {slot.rank} failed {len(errors)} time(s) "
                f"({', '.join(life.member for life in errors)}): {'; '.join(reasons)}")
        if lost:
            say(f"summary: rank {slot.rank} was lost {len(lost)} time(s): "
                + "; ".join(f"{life.member} {life.how}" for life in lost))
