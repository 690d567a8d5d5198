"""Owning every process a rank starts: a subreaper, and an end to all its descendants.

A rank's script may start processes that leave its process group or session
(``start_new_session=True``, a double fork, a daemon). Signalling the rank's
group does not reach them, and when the rank exits they are re-parented away
from it. A process that declares itself a *child subreaper* (Linux,
``PR_SET_CHILD_SUBREAPER``) receives its orphaned descendants instead of init,
so it can always find them under itself in ``/proc`` and end them.

Only the standard library is used: the bootstrap imports this module before
ferro itself (and before the fork that makes a rank's guardian).
"""

from __future__ import annotations

import os
import signal
import sys
import time

__all__ = ["become_subreaper", "descendants", "end_descendants", "reap_children"]

_PR_SET_CHILD_SUBREAPER = 36
_POLL_SECONDS = 0.02


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants; return whether the kernel agreed (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _parents() -> dict[int, tuple[int, str]]:
    """Every visible process's parent and state, read from ``/proc/<pid>/stat``."""
    found: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue  # it ended while we looked
        # The command name is in parentheses and may hold spaces or parentheses itself.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 2:
            found[int(entry)] = (int(fields[1]), fields[0])
    return found


def descendants(root: int) -> list[int]:
    """Return the living (not zombie) descendants of ``root``, parents before their children."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in parents.items():
        children.setdefault(ppid, []).append(pid)
    order, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        for child in children.get(pid, ()):
            order.append(child)
            frontier.append(child)
    return [pid for pid in order if parents[pid][1] != "Z"]


def reap_children() -> list[tuple[int, int]]:
    """Collect the exit status of every child of this process that has ended; return ``(pid, status)`` pairs."""
    reaped: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, status))


def end_descendants(root: int, grace: float) -> int:
    """End every descendant of ``root``: SIGTERM (and SIGCONT, for stopped ones), SIGKILL after ``grace`` seconds.

    Call it from ``root`` itself once it is a subreaper, so descendants that
    are orphaned meanwhile come back under it, and their ends are reaped here.

    Returns:
        How many processes were signalled.

    """
    deadline = time.monotonic() + grace
    asked: set[int] = set()
    while True:
        if root == os.getpid():
            reap_children()
        living = descendants(root)
        if not living:
            return len(asked)
        late = time.monotonic() >= deadline
        for pid in living:
            try:
                if late:
                    os.kill(pid, signal.SIGKILL)
                elif pid not in asked:
                    os.kill(pid, signal.SIGTERM)
                    os.kill(pid, signal.SIGCONT)  # a stopped process must run to act on SIGTERM
            except (ProcessLookupError, PermissionError):
                pass
            asked.add(pid)
        time.sleep(_POLL_SECONDS)
