"""A rank's heartbeat under ``ferro run --restart-policy rank``: a file the rank touches and the agent watches.

The rank's side is a daemon thread that sets the file's modification time
every :data:`BEAT_SECONDS`. A rank that stops (SIGSTOP, a swapped-out or
hung host process, a debugger) stops touching it, and the agent kills the rank
once the file is older than the job's ``--heartbeat-timeout``, so the rank ends
as a dead one and the survivors shrink past it instead of waiting out a
collective timeout. The thread needs the GIL a few microseconds every beat: a
rank busy in NumPy or torch (which release it) or in Python (which hands it
over every 5 ms) keeps beating.

Standard library only: the bootstrap imports it before ferro.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["BEAT_SECONDS", "HEARTBEAT_FILE_ENV", "age", "start_beating"]

HEARTBEAT_FILE_ENV = "FERRO_HEARTBEAT_FILE"
BEAT_SECONDS = 0.25


def _beat(path: str) -> None:
    while True:
        try:
            os.utime(path)
        except OSError:
            with open(path, "a"):
                pass
        time.sleep(BEAT_SECONDS)


def start_beating(path: str) -> None:
    """Touch ``path`` now and every :data:`BEAT_SECONDS` from a daemon thread."""
    with open(path, "a"):
        pass
    threading.Thread(target=_beat, args=(path,), name="ferro-heartbeat", daemon=True).start()


def age(path: str) -> float:
    """Seconds since ``path`` was last touched (0 when it does not exist yet)."""
    try:
        return max(time.time() - os.stat(path).st_mtime, 0.0)
    except FileNotFoundError:
        return 0.0
