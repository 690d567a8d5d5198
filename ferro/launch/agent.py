"""The launcher's engine: start a node's ranks, watch them, stop them all on a failure, restart on request."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from ferro.errors import ConfigurationError
from ferro.launch import bootstrap
from ferro.launch.bootstrap import GRACE_ENV, LAUNCHER_PID_ENV
from ferro.launch.failures import ERROR_FILE_ENV, read_failure
from ferro.launch.hang import HANG_EXIT_CODE, HangWatchdog
from ferro.launch.reaper import become_subreaper, end_descendants

__all__ = ["Interrupted", "LaunchConfig", "OutputPump", "RankFailure", "failure_of", "run_job", "say", "start_rank",
           "stop_ranks"]

POLL_SECONDS = 0.05
# How long the launcher waits, after a rank failed from losing a peer, for that peer to exit and say why.
CAUSE_WAIT_SECONDS = 5.0


@dataclass(frozen=True)
class LaunchConfig:
    """One node's share of a job.

    Attributes:
        target: ``["-m", module, *args]`` or ``[script, *args]``.
        nproc_per_node: Ranks to start on this node.
        nnodes: Nodes in the job.
        node_rank: This node's index.
        master_addr: Host of rank 0 (the rendezvous store).
        master_port: Port of the rendezvous store.
        max_restarts: How many times to restart after a failure: the whole group
            (``restart_policy="group"``), or each rank's process (``"rank"``).
        prefix: Prefix every output line with its rank.
        grace_seconds: How long ranks get to exit after SIGTERM/SIGINT before SIGKILL.
        secret: The job secret handed to every rank.
        restart_policy: ``"group"``: a failure stops every rank and restarts them all.
            ``"rank"``: the others train on (:mod:`ferro.elastic`); only the failed rank
            is replaced, and the launcher serves the store (see :mod:`ferro.launch.in_place`).
        min_size: Under ``"rank"``, the fewest ranks the job trains with.
        min_nodes: Under ``"rank"``, the fewest nodes with a rank training; below it the job stops.
        heartbeat_timeout: Under ``"rank"``, seconds without a heartbeat after which a
            rank is taken for frozen and killed (and a node whose launcher went silent, for lost).
        hang_timeout: Seconds in which no rank made or ended a call after which the job is
            taken for stuck: every rank's flight record is collected, the verdict printed and
            the job stopped (:mod:`ferro.launch.hang`); 0 turns the watchdog off.
        dump_dir: Where the ranks' flight records go (default ``$FERRO_DUMP_DIR``, else
            ``<tmp>/ferro-dumps/run-<master port>``).

    """

    target: Sequence[str]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    max_restarts: int = 0
    prefix: bool = True
    grace_seconds: float = 5.0
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    restart_policy: str = "group"
    min_size: int = 1
    min_nodes: int = 1
    heartbeat_timeout: float = 10.0
    hang_timeout: float = 300.0
    dump_dir: str | None = None

    @property
    def world_size(self) -> int:
        """Ranks in the whole job."""
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True)
class RankFailure:
    """How a rank ended badly.

    Attributes:
        rank: Its global rank.
        exitcode: Its exit status, or None if a signal ended it.
        signal_name: The signal's name, or None.
        error: The exception that ended it (``"ValueError: ..."``), if it said.
        lost_peer: The rank whose loss that exception was, or None.
        waited_on: The rank that exception timed out waiting for, or None.
        unresponsive: The rank has not ended: it was still running when a peer
            timed out waiting for it (frozen, stuck or far behind).

    """

    rank: int
    exitcode: int | None
    signal_name: str | None
    error: str | None = None
    lost_peer: int | None = None
    waited_on: int | None = None
    unresponsive: bool = False

    def describe(self) -> str:
        """Say how the rank ended, e.g. "exited with code 3 (ValueError: bad input)" or "was killed by SIGKILL"."""
        if self.unresponsive:
            return "stopped responding (it was still running, frozen or stuck, when a peer timed out waiting for it)"
        how = f"was killed by {self.signal_name}" if self.signal_name else f"exited with code {self.exitcode}"
        return f"{how} ({self.error})" if self.error else how

    def consequence(self) -> str:
        """Say how this rank's failure followed from its peer's, e.g. "; rank 0 failed after losing rank 1"."""
        if self.lost_peer is not None:
            return f"; rank {self.rank} failed after losing rank {self.lost_peer}"
        return f"; rank {self.rank} failed after timing out waiting for rank {self.waited_on} ({self.error})"

    @property
    def job_exit_code(self) -> int:
        """The launcher's exit status for this failure (128 + signal number, as shells report it)."""
        if self.signal_name:
            return 128 + int(getattr(signal, self.signal_name))
        return self.exitcode or 1


def _error_file(records: str, rank: int, restart: int) -> str:
    return os.path.join(records, f"rank{rank}-attempt{restart}.json")


def _environment(config: LaunchConfig, local_rank: int, restart: int, records: str,
                 extra: dict[str, str] | None = None) -> dict[str, str]:
    rank = config.node_rank * config.nproc_per_node + local_rank
    env = dict(os.environ)
    env.update(extra or {})
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(config.world_size),
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node), "GROUP_RANK": str(config.node_rank),
        "MASTER_ADDR": config.master_addr, "MASTER_PORT": str(config.master_port),
        "FERRO_RESTART_COUNT": str(restart), "FERRO_SECRET": config.secret,
        LAUNCHER_PID_ENV: str(os.getpid()), GRACE_ENV: str(config.grace_seconds), "PYTHONUNBUFFERED": "1",
        ERROR_FILE_ENV: _error_file(records, rank, restart),
    })
    return env


class OutputPump:
    """Copies a rank's output to ours line by line, prefixed with its rank."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._threads: list[threading.Thread] = []

    def follow(self, stream: IO[bytes], sink: IO[bytes], prefix: bytes) -> None:
        """Copy ``stream`` to ``sink`` from a thread of its own, each line prefixed."""
        thread = threading.Thread(target=self._copy, args=(stream, sink, prefix), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _copy(self, stream: IO[bytes], sink: IO[bytes], prefix: bytes) -> None:
        reader_gone = False
        for line in iter(stream.readline, b""):
            if reader_gone:
                continue  # keep reading: a rank whose output pipe filled up would block in print() forever
            with self._lock:
                try:
                    sink.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                    sink.flush()
                except BrokenPipeError:  # `ferro run ... | head`: whoever read our output has gone
                    reader_gone = True
        stream.close()

    def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every copy to reach its stream's end."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0))
        self._threads = [t for t in self._threads if t.is_alive()]


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the launcher; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def start_rank(config: LaunchConfig, local: int, restart: int, pump: OutputPump, records: str,
               extra: dict[str, str] | None = None, label: str | None = None) -> subprocess.Popen[bytes]:
    """Start local rank ``local`` (attempt ``restart``), its output prefixed with ``label`` (default its rank)."""
    # The bootstrap runs by its path, not with -m: -m would put our working directory first on
    # sys.path, where a ferro source tree (a clone's root) would shadow the installed package.
    command = [sys.executable, "-u", os.path.abspath(bootstrap.__file__), *config.target]
    # A session of its own: the rank and everything it starts can be signalled as one group.
    process = subprocess.Popen(command, env=_environment(config, local, restart, records, extra),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    # Output always passes through here line by line, so ranks' lines never interleave mid-line.
    rank = config.node_rank * config.nproc_per_node + local
    prefix = f"[rank {label or rank}] ".encode() if config.prefix else b""
    assert process.stdout is not None and process.stderr is not None  # piped above
    pump.follow(process.stdout, sys.stdout.buffer, prefix)
    pump.follow(process.stderr, sys.stderr.buffer, prefix)
    return process


def _start(config: LaunchConfig, restart: int, pump: OutputPump, records: str,
           extra: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    return [start_rank(config, local, restart, pump, records, extra) for local in range(config.nproc_per_node)]


def _signal_all(ranks: list[subprocess.Popen[bytes]], signum: int) -> None:
    for process in ranks:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signum)
            except ProcessLookupError:
                pass


def stop_ranks(ranks: list[subprocess.Popen[bytes]], signum: int, grace: float) -> None:
    """Ask every rank's process group to stop, then kill what is left after ``grace`` seconds."""
    _signal_all(ranks, signum)
    _signal_all(ranks, signal.SIGCONT)  # a stopped rank (SIGSTOP, a debugger let go) must run to hear it
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    _signal_all(ranks, signal.SIGKILL)
    for process in ranks:
        process.wait()
        try:  # anything the rank left behind in its group
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _watch(ranks: list[subprocess.Popen[bytes]], config: LaunchConfig, records: str,
           restart: int, watchdog: HangWatchdog) -> RankFailure | str | None:
    """Wait until all ranks succeed (None), one fails (the first failure) or the job hangs (the verdict)."""
    while True:
        verdict = watchdog.check()
        if verdict is not None and verdict.stuck:
            return verdict.text
        if verdict is not None:  # a note: the awaited ranks work (the group policy stops only a stuck job)
            for line in verdict.text.splitlines():
                say(line)
        running = False
        for local, process in enumerate(ranks):
            code = process.poll()
            if code is None:
                running = True
            elif code != 0:
                return failure_of(config.node_rank * config.nproc_per_node + local, code, records, restart)
        if not running:
            return None
        time.sleep(POLL_SECONDS)


def failure_of(rank: int, code: int, records: str, restart: int) -> RankFailure:
    """Return how rank ``rank`` (attempt ``restart``) ended with exit status ``code``, with its record if any."""
    record = read_failure(_error_file(records, rank, restart))
    return RankFailure(rank, code if code >= 0 else None, signal.Signals(-code).name if code < 0 else None,
                       record.error if record else None, record.lost_peer if record else None,
                       record.waited_on if record else None)


def _trace_cause(failure: RankFailure, ranks: list[subprocess.Popen[bytes]], config: LaunchConfig, records: str,
                 restart: int) -> list[RankFailure]:
    """Follow lost and waited-for peers from ``failure`` to the rank that failed by itself; return them, cause last.

    A lost peer still running is waited for, CAUSE_WAIT_SECONDS at most: it is
    typically printing its traceback or closing its group. A waited-for peer
    still running then is the cause itself: it stopped responding. A peer on
    another node, or one that exited cleanly, ends the chain where it is.
    """
    chain = [failure]
    first_local = config.node_rank * config.nproc_per_node
    deadline = time.monotonic() + CAUSE_WAIT_SECONDS
    while True:
        last = chain[-1]
        peer = last.lost_peer if last.lost_peer is not None else last.waited_on
        if peer is None or not 0 <= peer - first_local < len(ranks) or any(f.rank == peer for f in chain):
            break  # no one named, a rank on another node, or two ranks that blame each other: no one says more
        code = ranks[peer - first_local].poll()
        if code is None and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        elif code is None:
            if last.lost_peer is None:
                chain.append(RankFailure(peer, None, None, unresponsive=True))
            break
        elif code == 0:
            break
        else:
            chain.append(failure_of(peer, code, records, restart))
    return chain


def say(message: str) -> None:
    """Print ``message`` on stderr as the launcher's ("ferro run: ...")."""
    sys.stderr.write(f"ferro run: {message}\n")
    sys.stderr.flush()


def run_job(config: LaunchConfig) -> int:
    """Run the node's ranks to completion, restarting the whole group up to ``max_restarts`` times.

    Returns:
        0 when every rank succeeded; otherwise the failing rank's exit code (or
        128 + the signal number), and 128 + SIGINT/SIGTERM when interrupted.

    Raises:
        ConfigurationError: Invalid settings.

    """
    if config.nproc_per_node < 1 or config.nnodes < 1 or not 0 <= config.node_rank < config.nnodes:
        raise ConfigurationError(
            f"ferro run: need --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes "
            f"(got {config.nproc_per_node}, {config.nnodes}, {config.node_rank})")
    lock = threading.Lock()
    pump = OutputPump(lock)

    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    ranks: list[subprocess.Popen[bytes]] = []
    # Whatever a rank's processes orphan comes back here (if its guardian was killed first), to be ended below.
    become_subreaper()
    records = tempfile.mkdtemp(prefix="ferro-run-")  # the ranks' failure records (see ferro.launch.failures)
    first_local = config.node_rank * config.nproc_per_node
    watchdog = HangWatchdog(config.hang_timeout, config.dump_dir, config.world_size,
                            list(range(first_local, first_local + config.nproc_per_node)), config.master_port)
    try:
        for restart in range(config.max_restarts + 1):
            ranks = _start(config, restart, pump, records, watchdog.environment())
            first = _watch(ranks, config, records, restart, watchdog)
            if first is None:
                pump.drain(5.0)
                return 0
            if isinstance(first, str):
                for line in first.splitlines():
                    say(line)
                say(f"stopping the job (exit code {HANG_EXIT_CODE})")
                stop_ranks(ranks, signal.SIGTERM, config.grace_seconds)
                pump.drain(5.0)
                return HANG_EXIT_CODE
            chain = _trace_cause(first, ranks, config, records, restart)
            *consequences, failure = chain
            after = "".join(f.consequence() for f in consequences)
            say(f"rank {failure.rank} {failure.describe()}{after}; stopping the other ranks")
            stop_ranks(ranks, signal.SIGTERM, config.grace_seconds)
            end_descendants(os.getpid(), config.grace_seconds)  # nothing of this attempt lives into the next
            pump.drain(5.0)
            explained = watchdog.explain_failure({f.rank: f.describe() for f in chain if not f.unresponsive})
            for line in (explained or "").splitlines():
                say(line)
            if restart < config.max_restarts:
                say(f"restarting all ranks (restart {restart + 1} of {config.max_restarts})")
                continue
            say(f"job failed: rank {failure.rank} {failure.describe()}")
            return failure.job_exit_code
        return 1  # unreachable: the loop returns
    except Interrupted as stop:
        for sig in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        say(f"received {signal.Signals(stop.signum).name}; stopping all ranks")
        stop_ranks(ranks, stop.signum, config.grace_seconds)
        pump.drain(2.0)
        return 128 + stop.signum
    finally:
        # No process of the job outlives the launcher, whatever its session or process group.
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
        end_descendants(os.getpid(), config.grace_seconds)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(records, ignore_errors=True)
