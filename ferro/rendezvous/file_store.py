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

from ferro.errors import ConfigurationError, DistributedTimeoutError, StoreError, StoreKeyTimeoutError
from ferro.rendezvous.settings import default_timeout

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
        self.timeout = default_timeout(timeout)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigurationError(f"init_method file://{path}: cannot open the rendezvous file: {exc.strerror}"
                                     ) from exc
        os.close(fd)

    def _seconds(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else default_timeout(timeout)

    def _locked(self, change: Callable[[dict[str, str]], Any], seconds: float | None = None) -> Any:
        """Apply ``change`` to the data under the file's lock, taken within ``seconds`` (default: the store's)."""
        limit = self._seconds(seconds)
        deadline = time.monotonic() + limit
        with open(self.path, "r+") as f:
            while True:  # never block on the lock: a frozen process may hold it
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise DistributedTimeoutError(
                            f"file store {self.path}: could not lock the file within {limit:g} s (a process "
                            f"holding it is frozen?)") from None
                    time.sleep(POLL_SECONDS / 10)
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

    def set(self, key: str, value: bytes | str, timeout: float | None = None) -> None:
        """Set ``key`` to ``value``."""
        encoded = self._encode(value)
        self._locked(lambda d: d.__setitem__(key, encoded), timeout)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` seconds for it.

        Raises:
            DistributedTimeoutError: The key was not set in time.

        """
        deadline = time.monotonic() + self._seconds(timeout)
        self.wait([key], timeout)
        value = self._locked(lambda d: d.get(key), max(deadline - time.monotonic(), 0.001))
        return base64.b64decode(value)

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key is set.

        Raises:
            DistributedTimeoutError: Naming the keys still missing.

        """
        wanted = list(keys)
        seconds = self._seconds(timeout)
        deadline = time.monotonic() + seconds
        while True:
            missing = self._locked(lambda d: [k for k in wanted if k not in d], max(deadline - time.monotonic(), 0.001))
            if not missing:
                return
            if time.monotonic() >= deadline:
                names = ", ".join(repr(k) for k in missing)
                raise StoreKeyTimeoutError(
                    f"file store {self.path}: keys still missing after {seconds:g} s: {names}", tuple(missing))
            time.sleep(POLL_SECONDS)

    def add(self, key: str, amount: int, timeout: float | None = None) -> int:
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

        return self._locked(change, timeout)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str, timeout: float | None = None) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return the value afterwards (as the TCP store does).

        A missing key counts as holding ``b""``; when it is missing and ``expected``
        is not empty, ``expected`` is returned.
        """
        want, new = self._encode(expected), self._encode(desired)

        def change(d: dict[str, str]) -> bytes:
            current = d.get(key)
            if (current is None and want == self._encode(b"")) or current == want:
                d[key] = new
                return base64.b64decode(new)
            return base64.b64decode(want if current is None else current)

        return bytes(self._locked(change, timeout))

    def check(self, keys: Iterable[str], timeout: float | None = None) -> bool:
        """Return whether every key is set, without waiting for them."""
        wanted = list(keys)
        return bool(self._locked(lambda d: all(k in d for k in wanted), timeout))

    def delete_key(self, key: str, timeout: float | None = None) -> bool:
        """Delete ``key``; return whether it existed."""
        return bool(self._locked(lambda d: d.pop(key, None) is not None, timeout))

    def num_keys(self, timeout: float | None = None) -> int:
        """Return the number of keys."""
        return int(self._locked(len, timeout))

    @property
    def refused(self) -> tuple[str, ...]:
        """Always empty: a file has no connections to refuse (the same question a TCP store answers)."""
        return ()

    def close(self) -> None:
        """Nothing to release: every operation opens and closes the file."""
