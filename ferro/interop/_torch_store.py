"""torch's rendezvous store seen through the interface ferro's groups join through."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

from torch.distributed import DistError, DistStoreError

from ferro.errors import StoreKeyTimeoutError, TransportError

__all__ = ["TorchStore"]


class TorchStore:
    """A ``torch.distributed.Store`` (the group's ``PrefixStore``) with ferro's store interface.

    ferro's :class:`~ferro.rendezvous.store.Store` takes a timeout on every
    request; torch's takes one only for ``wait``. Reads therefore wait for
    their key first (with the caller's timeout) and then read it; writes and
    counters use the timeout torch's store was made with. torch's timeouts
    become ferro's :class:`~ferro.errors.StoreKeyTimeoutError`
    naming the missing keys, which rendezvous turns into "rank(s) [2] did not
    ...". Closing it leaves torch's store alone: torch owns it.

    Args:
        store: The store torch hands a backend's creator.
        timeout: Default seconds for reads.

    """

    #: Connections the store refused (torch's store does not report them).
    refused: tuple[str, ...] = ()

    def __init__(self, store: Any, timeout: float) -> None:
        self._store = store
        self._timeout = timeout

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        """Run one request of torch's store; its failures become ferro's errors."""
        try:
            return fn(*args)
        except DistError as exc:  # the store's host is gone (the job ended) or unreachable
            raise TransportError(f"torch's store failed during {what}: {exc}") from exc

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        seconds = self._timeout if timeout is None else timeout
        try:
            self._store.wait(keys, datetime.timedelta(seconds=max(seconds, 0.001)))
        except DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise TransportError(f"torch's store failed while waiting for {keys}: {exc}") from exc
            missing = tuple(key for key in keys if not self._call("check", self._store.check, [key]))
            raise StoreKeyTimeoutError(
                f"store: keys still missing after {seconds:g} s: {', '.join(map(repr, missing))}", missing) from None
        except DistError as exc:  # DistNetworkError: the store's host is gone
            raise TransportError(f"torch's store failed while waiting for {keys}: {exc}") from exc

    def set(self, key: str, value: bytes | str, timeout: float | None = None) -> None:
        """Set ``key`` to ``value``."""
        self._call(f"set({key!r})", self._store.set, key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` seconds for it to be set."""
        self._wait([key], timeout)
        return bytes(self._call(f"get({key!r})", self._store.get, key))

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key in ``keys`` is set; a timeout names the keys still missing."""
        self._wait(list(keys), timeout)

    def add(self, key: str, amount: int, timeout: float | None = None) -> int:
        """Add ``amount`` to the integer at ``key`` (missing counts as 0); return the new value."""
        return int(self._call(f"add({key!r})", self._store.add, key, int(amount)))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str, timeout: float | None = None) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (missing holds ``b""``); return its value after."""
        return bytes(self._call(f"compare_set({key!r})", self._store.compare_set, key, expected, desired))

    def check(self, keys: Iterable[str], timeout: float | None = None) -> bool:
        """Return whether every key in ``keys`` is set, without waiting."""
        return bool(self._call("check", self._store.check, list(keys)))

    def delete_key(self, key: str, timeout: float | None = None) -> bool:
        """Delete ``key``; return whether it existed."""
        return bool(self._call(f"delete_key({key!r})", self._store.delete_key, key))

    def close(self) -> None:
        """Do nothing: the store is torch's, and lives as long as torch's group."""
