"""Reading the process table: which of a test's processes still run."""

import os
import time


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def survivors(marker: str) -> list[int]:
    """Running processes whose command line mentions ``marker`` (the test's own scripts or directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return [pid for pid in found if alive(pid)]


def wait_gone(marker: str, seconds: float = 10.0) -> list[int]:
    """Wait up to ``seconds`` for every process mentioning ``marker`` to end; return those still running."""
    deadline = time.monotonic() + seconds
    while survivors(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return survivors(marker)


def wait_dead(pids: list[int], seconds: float = 15.0) -> list[int]:
    """Wait up to ``seconds`` for ``pids`` to end; return those still running."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
