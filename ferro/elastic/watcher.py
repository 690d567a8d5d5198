"""The manager's watcher: cuts connections to members the launcher recorded dead, from a thread of its own."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ferro.elastic import keys
from ferro.elastic.membership import Membership
from ferro.errors import DistributedError

__all__ = ["WATCH_SECONDS", "DeathWatcher"]

#: Seconds between the watcher's looks at the launcher's count of deaths.
WATCH_SECONDS = 0.25


class DeathWatcher:
    """Polls the launcher's count of deaths and, when it moved, calls ``cut_dead``.

    A lost node or a frozen host closes no connection, so a rank waiting on it
    would wait for the collective's timeout. The launcher records such members
    dead (a node's lease ran out) and counts every record under ``deaths``;
    this polls that one counter and, when it (or the epoch) moved, lets the
    manager cut the connections to current members now dead, so the step in
    flight fails at once.

    Args:
        store: A store client of the watcher's own (closed by :meth:`stop`).
        member: The watching member's id.
        epoch_number: Returns the manager's current epoch number (-1 before the first).
        cut_dead: Cuts the current group's connections to members ``Membership`` finds dead.

    """

    def __init__(self, store: Any, member: str, epoch_number: Callable[[], int],
                 cut_dead: Callable[[Membership], None]) -> None:
        self._store = store
        self._membership = Membership(store, member)
        self._epoch_number, self._cut_dead = epoch_number, cut_dead
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ferro-elastic-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen: tuple[int, int] | None = None
        try:
            while not self._stopped.wait(WATCH_SECONDS):
                look = (int(self._store.add(keys.deaths(), 0)), self._epoch_number())
                if look != seen:
                    seen = look
                    self._cut_dead(self._membership)
        except DistributedError:
            return  # the store is gone: the launcher says so, and the ranks' next store call raises

    def stop(self) -> None:
        """Stop the thread and close its store client."""
        self._stopped.set()
        self._thread.join(5.0)
        self._store.close()
