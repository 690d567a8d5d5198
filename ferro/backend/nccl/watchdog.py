"""The watchdog of an NCCL communicator: completion, asynchronous errors, timeouts, and who is to blame.

NCCL work runs on the GPU after the host call returned, so a peer that died
or never made the call shows up as work that never completes: NCCL itself
would wait forever. Each communicator's watchdog thread therefore

* polls the events recorded after each operation, releasing the buffers of
  completed work;
* polls ``ncclCommGetAsyncError`` for errors NCCL found in the background;
* fails (and aborts: ``ncclCommAbort``) the communicator when an operation
  outlives its timeout or NCCL reports an error;
* publishes this rank's progress (operations issued and completed, the last
  one's description, the time) in the job's store every
  :data:`HEARTBEAT_SECONDS`, a small flight recorder.

On a timeout the progress records of the other ranks say who is to blame: a
rank that has not issued the stuck operation (it called something else, or
is behind), a rank whose record went stale (its process died or froze), or
nobody (every rank issued it: NCCL's own problem, ``NCCL_DEBUG=INFO``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from ferro import environment
from ferro.errors import ConfigurationError, DistributedError

__all__ = ["HEARTBEAT_ENV", "HEARTBEAT_SECONDS", "Progress", "Watchdog", "blame", "heartbeat_seconds"]

log = logging.getLogger("ferro.nccl")

HEARTBEAT_ENV = "FERRO_NCCL_HEARTBEAT_S"
HEARTBEAT_SECONDS = 1.0
# A record older than this many heartbeats belongs to a rank that stopped (died or froze).
STALE_HEARTBEATS = 3
POLL_BUSY_SECONDS = 0.002  # while work is pending
POLL_IDLE_SECONDS = 0.1


def heartbeat_seconds() -> float:
    """Return the heartbeat period (``$FERRO_NCCL_HEARTBEAT_S``, default 1 s)."""
    raw = environment.get(HEARTBEAT_ENV)
    if raw is None:
        return HEARTBEAT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise ConfigurationError(f"{HEARTBEAT_ENV}={raw!r} is not a positive number of seconds")
    return value


class Progress:
    """One rank's published progress: operations issued and completed, and the last one issued."""

    def __init__(self, issued: int, completed: int, last: str, stamp: float) -> None:
        self.issued, self.completed, self.last, self.stamp = issued, completed, last, stamp

    def encode(self) -> bytes:
        """Return the record as the store holds it (JSON)."""
        return json.dumps({"issued": self.issued, "completed": self.completed, "last": self.last,
                           "time": self.stamp}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Progress:
        """Read a record written by :meth:`encode`."""
        data = json.loads(raw)
        return cls(int(data["issued"]), int(data["completed"]), str(data["last"]), float(data["time"]))


def progress_key(prefix: str, rank: int) -> str:
    """Return the store key of ``rank``'s progress record."""
    return f"{prefix}/progress/{rank}"


def blame(store: Any, prefix: str, rank: int, world_size: int, seq: int, name: str, heartbeat: float) -> str:
    """Say which ranks keep operation ``seq`` (``name``) of this rank from completing, from their records."""
    findings = []
    now = time.time()
    for peer in range(world_size):
        if peer == rank:
            continue
        key = progress_key(prefix, peer)
        try:
            record = Progress.decode(store.get(key, timeout=1.0)) if store.check([key], timeout=1.0) else None
        except DistributedError:
            return "the job's store (served by rank 0) does not answer: rank 0 died or froze"
        if record is None:
            findings.append(f"rank {peer} never reported (not started, or died before its first NCCL operation)")
        elif now - record.stamp > STALE_HEARTBEATS * heartbeat:
            findings.append(f"rank {peer} stopped reporting {now - record.stamp:.1f} s ago (its process died or "
                            f"froze) after issuing #{record.issued} ({record.last})")
        elif record.issued < seq:
            findings.append(f"rank {peer} has not issued #{seq}: its last is #{record.issued} "
                            f"({record.last or 'none'})")
    if not findings:
        return ("every rank issued it, and NCCL did not complete it: NCCL_DEBUG=INFO shows why (a mismatch of "
                "calls with equal counts also looks like this)")
    return "; ".join(findings)


class Watchdog:
    """The thread that watches one communicator (see the module docstring).

    Args:
        comm: The :class:`~ferro.backend.nccl.communicator.Communicator` watched.

    """

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.heartbeat = heartbeat_seconds()
        self._last_beat = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"ferro-nccl-watchdog-{comm.rank}", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Tell the thread new work is pending."""
        self._wake.set()

    def stop(self) -> None:
        """End the thread (it publishes nothing more)."""
        self._stop.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        comm = self._comm
        while not self._stop.is_set():
            try:
                comm.poll()
                now = time.monotonic()
                if now - self._last_beat >= self.heartbeat:
                    self._last_beat = now
                    comm.publish_progress()
            except Exception:  # the watchdog must outlive anything it polls; the failure is on comm
                log.exception("ferro NCCL watchdog of rank %s", comm.rank)
            self._wake.wait(POLL_BUSY_SECONDS if comm.busy else POLL_IDLE_SECONDS)
            self._wake.clear()
