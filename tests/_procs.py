"""Reading the process table: which of a test's processes still run."""

import os
import signal
import time


def _state(stat_path: str) -> str:
    """The state letter of a ``/proc/.../stat`` file (the field after "(comm)"); OSError if it is gone."""
    with open(stat_path) as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: only its exit status is left)."""
    try:
        return _state(f"/proc/{pid}/stat") != "Z"
    except OSError:
        return False


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped.

    kill() returns before the process stops: the kernel wakes one thread, which then stops the others. Under
    load a request sent at once was answered by a server thread still running (23 of 40 tries on 2 busy cores).
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                states.append(_state(f"/proc/{pid}/task/{tid}/stat"))
            except OSError:
                continue  # a thread that ended meanwhile
        if states and all(state == "T" for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within {timeout} s of SIGSTOP")


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
