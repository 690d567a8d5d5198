"""A rendezvous store in a file, for ``init_method="file:///path"`` (one host, or a shared file system).

It offers the operations rendezvous uses (``set``, ``get``, ``wait``, ``add``,
``check``, ``delete_key``, ``num_keys``) with :class:`~ferro.Store`'s
semantics. Each operation takes an exclusive ``flock`` on the file, reads the
JSON mapping, and writes it back when it changes. Waiting polls the file.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from ferro.errors import ConfigurationError, DistributedTimeoutError, StoreError

__all__ = ["FileStore"]

POLL_SECONDS = 0.01


class FileStore:
    """A key-value store kept in one file, shared by every rank that can open it.

    Args:
        path: The file (created with owner-only permissions if missing).
        timeout: Default seconds for blocking operations.

    Raises:
        ConfigurationError: The file cannot be created or opened.

    """

    def __init__(self, path: str, *, timeout: float = 300.0) -> None:
        self.path = path
        self.timeout = float(timeout)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigurationError(f"init_method file://{path}: cannot open the rendezvous file: {exc.strerror}"
                                     ) from exc
        os.close(fd)

    def _locked(self, change: Callable[[dict[str, str]], Any]) -> Any:
        with open(self.path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                text = f.read()
                data: dict[str, str] = json.loads(text) if text.strip() else {}
                before = dict(data)
                result = change(data)
                if data != before:
                    f.seek(0)
                    f.truncate()
                    f.write(json.dumps(data))
                    f.flush()
                    os.fsync(f.fileno())
                return result
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @staticmethod
    def _encode(value: bytes | str) -> str:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return base64.b64encode(raw).decode()

    def set(self, key: str, value: bytes | str) -> None:
        """Set ``key`` to ``value``."""
        encoded = self._encode(value)
        self._locked(lambda d: d.__setitem__(key, encoded))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` seconds for it.

        Raises:
            DistributedTimeoutError: The key was not set in time.

        """
        self.wait([key], timeout)
        value = self._locked(lambda d: d.get(key))
        return base64.b64decode(value)

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key is set.

        Raises:
            DistributedTimeoutError: Naming the keys still missing.

        """
        wanted = list(keys)
        seconds = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + seconds
        while True:
            missing = self._locked(lambda d: [k for k in wanted if k not in d])
            if not missing:
                return
            if time.monotonic() >= deadline:
                names = ", ".join(repr(k) for k in missing)
                raise DistributedTimeoutError(
                    f"file store {self.path}: keys still missing after {seconds:g} s: {names}")
            time.sleep(POLL_SECONDS)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (missing counts as 0); return the new value.

        Raises:
            StoreError: The key holds something that is not an integer.

        """
        def change(d: dict[str, str]) -> int:
            current = base64.b64decode(d[key]) if key in d else b"0"
            try:
                value = int(current) + int(amount)
            except ValueError:
                raise StoreError(f"file store {self.path}: add: {key!r} does not hold an integer") from None
            d[key] = self._encode(str(value))
            return value

        return self._locked(change)

    def check(self, keys: Iterable[str]) -> bool:
        """Return whether every key is set, without waiting."""
        wanted = list(keys)
        return bool(self._locked(lambda d: all(k in d for k in wanted)))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        return bool(self._locked(lambda d: d.pop(key, None) is not None))

    def num_keys(self) -> int:
        """Return the number of keys."""
        return int(self._locked(len))

    @property
    def refused(self) -> tuple[str, ...]:
        """Always empty: a file has no connections to refuse (the same question a TCP store answers)."""
        return ()

    def close(self) -> None:
        """Nothing to release: every operation opens and closes the file."""
