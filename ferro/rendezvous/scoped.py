"""A view of a store whose every key lives under one prefix: a fresh namespace on a long-lived store."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["ScopedStore"]


def present_or_values(store: Any, op: str, keys: list[str], timeout: float | None) -> Any:
    """Run ``multi_get`` or ``present`` in one request where ``store`` has it, else key by key (a file store)."""
    batched = getattr(store, op, None)
    if batched is not None:
        return batched(keys, timeout=timeout)
    if op == "present":
        return [bool(store.check([key], timeout=timeout)) for key in keys]
    return [bytes(store.get(key, timeout=timeout)) for key in keys]


class ScopedStore:
    """The keys of ``store`` under ``prefix``, as a store of their own.

    A group created through it meets only keys written through the same prefix,
    so an elastic job can build one fresh group per membership epoch on the
    launcher's store without ever reading a previous epoch's addresses, claims
    or join counts. ``close()`` closes the underlying client when the view owns it.

    Args:
        store: A :class:`~ferro.rendezvous.store.Store` (or anything with its methods).
        prefix: Prepended to every key, e.g. ``"ferro/elastic/3/"``.
        owns: Close ``store`` with this view.

    Example::

        epoch_store = ScopedStore(store.clone(), "ferro/elastic/3/", owns=True)
        epoch_store.set("ready/0", "1")       # key "ferro/elastic/3/ready/0" of the store

    """

    def __init__(self, store: Any, prefix: str, *, owns: bool = False) -> None:
        self._store, self._prefix, self._owns = store, prefix, owns

    @property
    def timeout(self) -> float:
        """The underlying client's default timeout."""
        return float(self._store.timeout)

    @property
    def refused(self) -> tuple[str, ...]:
        """Connections the underlying server refused (see :attr:`Store.refused`)."""
        return tuple(getattr(self._store, "refused", ()))

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes | str, timeout: float | None = None) -> None:
        """Set ``key`` (under the prefix) to ``value``."""
        self._store.set(self._key(key), value, timeout=timeout)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return ``key``'s value, waiting until it is set."""
        return bytes(self._store.get(self._key(key), timeout=timeout))

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key is set."""
        self._store.wait([self._key(k) for k in keys], timeout=timeout)

    def add(self, key: str, amount: int, timeout: float | None = None) -> int:
        """Add ``amount`` to the integer at ``key``; return the new value."""
        return int(self._store.add(self._key(key), amount, timeout=timeout))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str, timeout: float | None = None) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return the value it holds after."""
        return bytes(self._store.compare_set(self._key(key), expected, desired, timeout=timeout))

    def delete_key(self, key: str, timeout: float | None = None) -> bool:
        """Delete ``key``; return whether it existed."""
        return bool(self._store.delete_key(self._key(key), timeout=timeout))

    def check(self, keys: Iterable[str], timeout: float | None = None) -> bool:
        """Return whether every key is set, without waiting."""
        return bool(self._store.check([self._key(k) for k in keys], timeout=timeout))

    def multi_get(self, keys: Sequence[str], timeout: float | None = None) -> list[bytes]:
        """Return every key's value, waiting until all are set (one request on ferro's store)."""
        return present_or_values(self._store, "multi_get", [self._key(k) for k in keys], timeout)

    def present(self, keys: Sequence[str], timeout: float | None = None) -> list[bool]:
        """Return, per key, whether it is set, without waiting (one request on ferro's store)."""
        return present_or_values(self._store, "present", [self._key(k) for k in keys], timeout)

    def clone(self) -> ScopedStore:
        """Return the same view over a new client of the same server (owned by the view)."""
        return ScopedStore(self._store.clone(), self._prefix, owns=True)

    def close(self) -> None:
        """Close the underlying client if this view owns it."""
        if self._owns:
            self._store.close()
