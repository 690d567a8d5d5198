"""The hang watch: a thread in every rank that writes its flight record when asked, and notices a stalled job.

:func:`start_hang_watch` (``init_process_group`` calls it) starts one daemon
thread per process. It sleeps on a pipe and wakes five times a second; the
collectives never touch it, so it costs nothing per call. It:

* writes the rank's dump (:mod:`ferro.collective.flight_recorder`) on
  ``SIGUSR1`` (delivered through :mod:`faulthandler`, which also writes the
  Python stacks of every thread at that instant, even while a thread holds the
  GIL in C code);
* answers collection rounds: a collector writes ``request.json`` in the dump
  folder and every rank writes ``rank-<r>.json`` with that round's id;
* with a hang timeout (``$FERRO_HANG_TIMEOUT`` seconds, or ``hang_timeout=``),
  watches its groups' progress (calls made and ended). When nothing moved for
  that long, the job may be stuck: under ``ferro run`` the rank tells the
  launcher (``suspect-<r>``), which collects every rank's dump and decides
  (:mod:`ferro.launch.hang`); under another launcher (torchrun, mpirun, srun)
  the first rank to notice collects the dumps itself, prints the verdict of
  :mod:`ferro.collective.diagnosis` and ends the job with exit code
  :data:`HANG_EXIT_CODE`. A rank that cannot answer (stopped, or frozen in C
  with the GIL) is seen from outside where it shares the collector's host: its
  process state from ``/proc``, and its stack through ``py-spy`` when installed.

The dump folder is the rendezvous: ranks on several hosts need it shared
(``$FERRO_DUMP_DIR`` on a shared file system); otherwise each host's ranks are
collected and judged on their own.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ferro import environment
from ferro._core import state as _state
from ferro.backend.shm import process_alive
from ferro.collective import diagnosis, flight_recorder
from ferro.errors import ConfigurationError

__all__ = ["HANG_EXIT_CODE", "HANG_TIMEOUT_ENV", "LAUNCHER_COLLECTS_ENV", "collect", "outside_view",
           "start_hang_watch", "stop_hang_watch", "waiting_in"]

log = logging.getLogger("ferro.collective.hang_watch")

#: Seconds without any call made or ended by any group of the rank before the job is taken for stuck (0: off).
HANG_TIMEOUT_ENV = "FERRO_HANG_TIMEOUT"
#: Set by ``ferro run``: ranks report a stall to the launcher instead of collecting the dumps themselves.
LAUNCHER_COLLECTS_ENV = "FERRO_HANG_COLLECTOR"
#: The exit code of a job the hang watch stopped (``ferro run`` exits with it too).
HANG_EXIT_CODE = 86
POLL_SECONDS = 0.2
#: How long a collector waits for the ranks' answers before it looks at the missing ones from outside.
ANSWER_SECONDS = 1.0
#: The span over which a rank's CPU use is measured for a dump's ``activity`` (seconds).
ACTIVITY_SECONDS = 2.0
#: How long a collector watches a rank that could not answer, to measure its CPU use from outside.
OUTSIDE_SAMPLE_SECONDS = 0.3


class _Watch:
    """The thread and its pipe (one per process: the signal handler has no group to ask)."""

    def __init__(self, hang_timeout: float, rank: int | None) -> None:
        self.hang_timeout = hang_timeout
        self.rank = rank
        self.previous_handler: Any = None
        self.read_end, self.write_end = os.pipe()
        os.set_blocking(self.write_end, False)  # a full pipe drops a traceback rather than block a signal handler
        os.set_blocking(self.read_end, False)
        self.stopping = threading.Event()
        self.answered: str | None = None
        self.request_mtime = 0.0
        self.signature: tuple[Any, ...] = ()
        self.changed = time.monotonic()
        self.suspected: tuple[Any, ...] | None = None
        #: ``(monotonic time, main thread's CPU seconds)`` at each poll, the last ACTIVITY_SECONDS of them.
        self.cpu_samples: collections.deque[tuple[float, float]] = collections.deque()
        #: What the rank waits for inside ferro outside any call (an elastic rendezvous), or None.
        self.inside: str | None = None
        self.thread = threading.Thread(target=self._run, name="ferro-hang-watch", daemon=True)

    def start(self) -> None:
        faulthandler.unregister(signal.SIGUSR1)  # an earlier registration would keep its own handler in place
        self.previous_handler = signal.getsignal(signal.SIGUSR1)
        if self.previous_handler in (signal.SIG_DFL, signal.SIG_IGN, None):
            # Chaining to the default action would end the process: a handler that does nothing instead.
            signal.signal(signal.SIGUSR1, _ignore)
        faulthandler.register(signal.SIGUSR1, file=self.write_end, all_threads=True, chain=True)
        self._hello()
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        try:
            os.write(self.write_end, b"\0")  # wake the thread now rather than at its next poll
        except OSError:
            pass
        try:
            faulthandler.unregister(signal.SIGUSR1)
            if self.previous_handler is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGUSR1, self.previous_handler)
        except (ValueError, RuntimeError):
            pass
        self.thread.join(timeout=2 * POLL_SECONDS)
        for fd in (self.read_end, self.write_end):
            try:
                os.close(fd)
            except OSError:
                pass

    def _hello(self) -> None:
        # Who this rank is, for a collector that must look at it from outside.
        try:
            folder = flight_recorder.dump_dir()
            folder.mkdir(parents=True, exist_ok=True)
            if self.rank is None:
                self.rank = flight_recorder.job_rank([g for _, g in flight_recorder.describe_groups()])
            info = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "time_ns": time.time_ns()}
            flight_recorder.write_json(folder / f"hello-{self.rank if self.rank is not None else os.getpid()}.json",
                                       info)
            self.request_mtime = _mtime(folder / "request.json")  # a request already there is an old job's
            lock = folder / "collector.lock"
            if 0 < _mtime(lock) < time.time() - 5:
                lock.unlink(missing_ok=True)  # left by an earlier job that used this folder
        except OSError as exc:
            log.warning("hang watch: cannot write to the dump folder: %s", exc)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                ready, _, _ = select.select([self.read_end], [], [], POLL_SECONDS)
            except (OSError, ValueError):
                return
            if self.stopping.is_set():
                return
            try:
                self._sample_cpu()
                if ready:
                    self._on_signal()
                self._answer_request()
                if self.hang_timeout > 0:
                    self._watch_progress()
            except Exception as exc:  # the watch must outlive anything it meets
                log.warning("hang watch: %s: %s", type(exc).__name__, exc)

    def _on_signal(self) -> None:
        chunks = []
        while True:
            try:
                chunk = os.read(self.read_end, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        text = b"".join(chunks).decode(errors="replace").strip("\0\n ")
        if text:
            path = flight_recorder.write_dump(self._snapshot("signal SIGUSR1", None, text))
            log.warning("flight record written to %s (SIGUSR1)", path)

    def _sample_cpu(self) -> None:
        now = time.monotonic()
        self.cpu_samples.append((now, _main_thread_cpu()))
        while len(self.cpu_samples) > 2 and now - self.cpu_samples[1][0] >= ACTIVITY_SECONDS:
            self.cpu_samples.popleft()

    def cpu_share(self) -> float | None:
        """Return the share of a core the main thread used over the last ACTIVITY_SECONDS (None: not yet known).

        The main thread's alone: neither this watch's own work (a dump) nor a helper thread's counts.
        """
        self._sample_cpu()
        (start, cpu_start), (end, cpu_end) = self.cpu_samples[0], self.cpu_samples[-1]
        return (cpu_end - cpu_start) / (end - start) if end - start >= POLL_SECONDS else None

    def _snapshot(self, reason: str, round_id: str | None, traceback: str | None = None) -> dict[str, Any]:
        share = self.cpu_share()  # before the dump's own work
        # Calls made since the last poll count: a rank that moved on within the poll (an elastic job's new epoch)
        # is not stalled. Seen in CI: a dump said 4.7 s stalled 0.15 s into a new epoch; the launcher killed it.
        self._note_progress()
        data = flight_recorder.snapshot(reason, round_id, traceback, native=True)
        data["progress"] = {"stalled_for": round(time.monotonic() - self.changed, 3),
                            "hang_timeout": self.hang_timeout}
        data["activity"] = {"cpu_share": None if share is None else round(share, 3), "over": ACTIVITY_SECONDS}
        data["inside"] = self.inside
        return data

    def _answer_request(self) -> None:
        request = flight_recorder.dump_dir() / "request.json"
        try:
            mtime = request.stat().st_mtime
        except OSError:
            return
        if mtime == self.request_mtime:
            return
        self.request_mtime = mtime
        try:
            asked = json.loads(request.read_text())
        except (OSError, ValueError):
            self.request_mtime = 0.0  # half written: look again next time
            return
        round_id = asked.get("round")
        if round_id and round_id != self.answered:
            self.answered = round_id
            flight_recorder.write_dump(self._snapshot(f"collected by {asked.get('by', 'a collector')}", round_id))

    def _note_progress(self) -> bool:
        """Bring the time of the latest progress (a call made or ended) up to date; return whether there was some."""
        signature = tuple(state.progress()[:2] + (state.created,) for state in _state.live_states())
        now = time.monotonic()
        if self.inside is not None:  # waiting in ferro with a timeout of its own: not stalled
            self.changed = now
        if signature != self.signature:
            self.signature, self.changed = signature, now
            return True
        return False

    def _watch_progress(self) -> None:
        if self._note_progress():
            return
        signature, now = self.signature, time.monotonic()
        if not any(calls for calls, _, _ in signature) or now - self.changed < self.hang_timeout:
            return
        if self.suspected == signature:
            return
        self.suspected = signature
        folder = flight_recorder.dump_dir()
        groups = [g for _, g in flight_recorder.describe_groups()]  # without their records: cheap
        rank = self.rank if self.rank is not None else flight_recorder.job_rank(groups)
        if environment.get(LAUNCHER_COLLECTS_ENV) == "launcher":
            flight_recorder.write_json(folder / f"suspect-{rank}.json",
                                       {"rank": rank, "stalled_for": now - self.changed, "time_ns": time.time_ns()})
            return
        try:  # the first rank to notice collects; the others answer it
            os.close(os.open(folder / "collector.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
        world = max((g["world_size"] for g in groups if g.get("world_size")), default=1)
        dumps = collect(folder, world, by=f"rank {rank}", own=self._snapshot)
        verdict = diagnosis.diagnose(dumps, world)
        if not verdict.findings:
            os.unlink(folder / "collector.lock")  # the others are busy, not stuck: watch on
            return
        if not verdict.hung():  # the ranks the others wait for are working (their CPU use says so)
            os.unlink(folder / "collector.lock")
            sys.stderr.write(f"[ferro] rank {rank}: {verdict.working_note()}\n")
            self.suspected, self.changed = None, now  # look again a whole timeout later
            return
        report = verdict.report(stragglers=False)
        (folder / "verdict.txt").write_text(report + "\n")
        sys.stderr.write(f"[ferro] rank {rank}: no call made or ended for {self.hang_timeout:g} s "
                         f"({HANG_TIMEOUT_ENV}); the job looks stuck\n{report}\n"
                         f"[ferro] dumps in {folder}; stopping the job (exit code {HANG_EXIT_CODE})\n")
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)


def _ignore(signum: int, frame: Any) -> None:
    """SIGUSR1's Python-level handler when the program had none: the hang watch's thread does the work."""


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def collect(folder: Path, world_size: int, *, by: str, own: Any = None, wait: float = ANSWER_SECONDS,
            ranks: list[int] | None = None) -> dict[int, dict[str, Any]]:
    """Ask every rank for its dump through ``folder`` and return the answers, by rank.

    Ranks that do not answer within ``wait`` seconds are looked at from outside
    (:func:`outside_view`) when their ``hello`` file says they run on this host.

    Args:
        folder: The job's dump folder.
        world_size: Ranks expected.
        by: Who asks (kept in the dumps).
        own: The collector's own snapshot function, when the collector is a rank (it answers itself).
        wait: Seconds to wait for answers.
        ranks: Only these ranks (default all).

    """
    round_id = flight_recorder.request_round(folder, by)
    if own is not None:
        flight_recorder.write_dump(own(f"collected by {by}", round_id))
    wanted = list(range(world_size)) if ranks is None else ranks
    deadline = time.monotonic() + wait
    dumps: dict[int, dict[str, Any]] = {}
    while True:
        dumps = {r: d for r, d in diagnosis.load_dumps(folder, round_id).items() if r in wanted}
        if len(dumps) == len(wanted) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for rank in wanted:
        if rank not in dumps:
            view = outside_view(folder, rank)
            if view is not None:
                view["round"] = round_id
                flight_recorder.write_dump(view, folder)  # for ferro doctor, beside the ranks' own
                dumps[rank] = view
    return dumps


def outside_view(folder: Path, rank: int) -> dict[str, Any] | None:
    """Look from outside at a rank that did not answer (from its ``hello`` file): process state and stack.

    Returns None when the rank runs on another host (or never said hello).
    """
    try:
        hello = json.loads((folder / f"hello-{rank}.json").read_text())
    except (OSError, ValueError):
        return None
    if hello.get("host") != socket.gethostname():
        return None
    pid = int(hello["pid"])
    view: dict[str, Any] = {"format": flight_recorder.FORMAT, "version": flight_recorder.VERSION,
                            "source": "outside", "rank": rank, "pid": pid, "host": hello["host"],
                            "time_ns": time.time_ns(), "groups": [], "threads": [], "where": None}
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        state = next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")),
                     "unknown")
        view["process_state"] = f"process {pid} did not answer; its state: {state}"
        view["activity"] = {"cpu_share": _outside_cpu_share(pid), "over": OUTSIDE_SAMPLE_SECONDS}
    except OSError:
        if not process_alive(pid):
            view["process_state"] = f"process {pid} has exited"
            return view
        # Seen once under load: the status file could not be read of a process that ran on. Measure it anyway.
        view["process_state"] = f"process {pid} did not answer; its state could not be read"
        view["activity"] = {"cpu_share": _outside_cpu_share(pid), "over": OUTSIDE_SAMPLE_SECONDS}
    if flight_recorder.py_spy() is None:
        view["process_state"] += "; install py-spy (pip install 'ferro[doctor]') to read its stack from outside"
        return view
    for thread in flight_recorder.py_spy_stacks(pid, native=False) or []:  # without pausing: stopped ones too
        # The main thread's id is the process's.
        thread.update(main=thread["native_id"] == pid, where=flight_recorder.where_is(thread["frames"]))
        view["threads"].append(thread)
        if thread["main"] and thread["where"]:
            view["where"] = f"{thread['where']} (read by py-spy)"
    return view


def _main_thread_cpu() -> float:
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(threading.main_thread().ident or 0))
    except (AttributeError, OSError):  # no per-thread clocks here: the process's
        return time.process_time()


def _cpu_seconds(pid: int) -> float:
    # The main thread's task (its id is the process's): utime + stime, in clock ticks.
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _outside_cpu_share(pid: int) -> float | None:
    """Return the share of a core process ``pid``'s main thread used over OUTSIDE_SAMPLE_SECONDS (None: unreadable)."""
    try:
        before, started = _cpu_seconds(pid), time.monotonic()
        time.sleep(OUTSIDE_SAMPLE_SECONDS)
        return round((_cpu_seconds(pid) - before) / (time.monotonic() - started), 3)
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def waiting_in(what: str) -> Iterator[None]:
    """Mark the process as waiting inside ferro outside any collective (e.g. an elastic rendezvous).

    Such a wait has a timeout of its own, so the hang watch does not count it as
    a stall, and a dump says what the rank waits for.
    """
    watch = _watch
    if watch is None:
        yield
        return
    before, watch.inside = watch.inside, what
    try:
        yield
    finally:
        watch.inside = before


_watch: _Watch | None = None  # the process's one watch (see _Watch): started by start_hang_watch


def start_hang_watch(hang_timeout: float | None = None, rank: int | None = None) -> None:
    """Start the process's hang watch (once; later calls change nothing but a given timeout).

    Args:
        hang_timeout: Seconds without progress before the job is taken for stuck
            (default ``$FERRO_HANG_TIMEOUT``, else off: dumps on request and on ``SIGUSR1`` only).
        rank: This process's rank in the job, for a collector that must find it (default the launcher's ``RANK``).

    """
    global _watch
    if hang_timeout is None:
        value = environment.get(HANG_TIMEOUT_ENV, "")
        try:
            hang_timeout = float(value) if value else 0.0
        except ValueError:
            raise ConfigurationError(
                f"{HANG_TIMEOUT_ENV}={value!r}: give seconds (0 turns the hang watch off)") from None
    if _watch is not None:
        _watch.hang_timeout = hang_timeout
        return
    if threading.current_thread() is not threading.main_thread():
        return  # simulated ranks (threads): the process's main thread owns signals
    watch = _Watch(hang_timeout, rank)
    watch.start()
    _watch = watch


def stop_hang_watch() -> None:
    """Stop the hang watch (``destroy_process_group`` calls it)."""
    global _watch
    watch, _watch = _watch, None
    if watch is not None:
        watch.stop()
