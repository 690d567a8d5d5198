"""The values a worker owns for remote references, with their counts (see :mod:`ferro.rpc.rref`)."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Owned", "OwnerTable", "RRefId"]

RRefId = tuple[int, int]  # (creating rank, serial there): unique in the job without asking anyone


class Owned:
    """A value this worker owns, and how many RRef objects point at it."""

    __slots__ = ("count", "error", "made", "value")

    def __init__(self) -> None:
        self.count = 0
        self.made = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class OwnerTable:
    """The values this worker owns, by RRef id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[RRefId, Owned] = {}

    def entry(self, rref_id: RRefId) -> Owned:
        """Return the entry of ``rref_id``, made empty if the value is not there yet."""
        with self._lock:
            return self._entries.setdefault(rref_id, Owned())

    def add(self, rref_id: RRefId, delta: int) -> None:
        """Count ``delta`` more references; free the value at zero once it exists."""
        with self._lock:
            entry = self._entries.setdefault(rref_id, Owned())
            entry.count += delta
            if entry.count <= 0 and entry.made.is_set():
                del self._entries[rref_id]

    def made(self, rref_id: RRefId, value: Any = None, error: BaseException | None = None) -> None:
        """Store the value (or the error making it raised), counting the creator's reference."""
        with self._lock:
            entry = self._entries.setdefault(rref_id, Owned())
            entry.value, entry.error = value, error
            entry.count += 1  # the creator's RRef
            entry.made.set()
            if entry.count <= 0:
                del self._entries[rref_id]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
