"""A small key-value store served over TCP, for rendezvous: the client (the server is :mod:`.store_server`).

Rank 0 (or a launcher) serves it; every rank connects as a client, publishes
its listen address and reads what it needs. The operations and their meaning
follow torch.distributed's ``TCPStore``: ``set``, blocking ``get`` and ``wait``
with timeouts, ``add`` on integer counters, ``compare_set``, ``delete_key``,
``check``, ``num_keys``, the batched ``multi_get``, ``multi_set`` and ``append``,
and the queues' ``queue_push``, blocking ``queue_pop`` and ``queue_len``. Every
connection is authenticated with the job secret before any request is read.
The wire format is :mod:`.store_wire`'s.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Sequence

from ferro.errors import (
    BackendClosedError,
    DistributedTimeoutError,
    PeerLostError,
    StoreError,
    StoreKeyTimeoutError,
)
from ferro.rendezvous.auth import connect_handshake, shutdown_quietly
from ferro.rendezvous.connect import dial
from ferro.rendezvous.settings import default_timeout
from ferro.rendezvous.store_server import StoreServer
from ferro.rendezvous.store_wire import MAX_MESSAGE_BYTES, U32, Op, Status, pack, unpack

__all__ = ["Store", "StoreKeyTimeoutError", "StoreServer"]

log = logging.getLogger("ferro.store")

DEFAULT_TIMEOUT = 300.0
# How long this client's own handshake with the server may take.
HANDSHAKE_TIMEOUT = 10.0
# How long a client's close() waits for a request another thread has in flight.
CLOSE_WAIT_SECONDS = 1.0
# A server-side wait (get, wait) ends this much before the caller's deadline, so the server's
# "not yet" normally arrives in time and the connection stays usable.
SERVER_HEADSTART = 0.1
# How long past the caller's deadline a client still reads the answer to a server-side wait. A
# live server's "not yet" can be late on an overloaded host (CI with every core busy delivered
# it more than 30 ms late); reading it keeps the precise error (which keys are missing), the
# connection, and a popped queue item. Only a server silent this long past the deadline is
# reported as not answering; kept short so a frozen store still costs the caller ~its timeout.
ANSWER_GRACE = 0.25


def _read_message(sock: socket.socket) -> bytes | None:
    """Read one length-prefixed message; None on a clean close before it starts."""
    header = _read_exact(sock, 4, allow_eof=True)
    if header is None:
        return None
    (n,) = U32.unpack(header)
    if n > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {n} bytes exceeds the store's limit of {MAX_MESSAGE_BYTES}")
    body = _read_exact(sock, n, allow_eof=False)
    assert body is not None  # allow_eof=False never returns None
    return body


def _read_exact(sock: socket.socket, n: int, allow_eof: bool) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0 and allow_eof:
                return None
            raise ConnectionResetError("connection closed in the middle of a message")
        got += k
    return bytes(buf)


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Store:
    """A client of a :class:`StoreServer`; thread-safe.

    One client carries one request at a time, so a blocking :meth:`get` or
    :meth:`wait` holds it until it returns: give each thread that waits on the
    store a client of its own.

    Connecting retries with exponential backoff until ``timeout`` passes, so
    ranks may start before the rank that serves the store.

    Args:
        host: The server's address (``MASTER_ADDR``).
        port: The server's port (``MASTER_PORT``).
        secret: The job secret (bytes or str).
        timeout: Default seconds for blocking operations and for connecting.
        serve: Start a :class:`StoreServer` on ``host:port`` in this process
            first (rank 0 does this); closing the client stops it.

    Raises:
        DistributedTimeoutError: The server could not be reached in time.
        AuthenticationError: The server or this client lacks the job secret.
        ConfigurationError: ``serve=True`` and the address cannot be bound.

    Example::

        store = Store("127.0.0.1", 29500, secret=b"s3cret", serve=(rank == 0))
        store.set(f"addr/{rank}", "10.0.0.5:4000")
        peer = store.get("addr/1", timeout=30)

    """

    def __init__(self, host: str, port: int, *, secret: bytes | str, timeout: float = DEFAULT_TIMEOUT,
                 serve: bool = False) -> None:
        self.timeout = default_timeout(timeout)
        self._secret = _as_bytes(secret)
        self._lock = threading.Lock()
        self._closed = False
        self._server = StoreServer(host, port, secret=self._secret) if serve else None
        self.host = host
        self.port = self._server.port if self._server is not None else port
        self._sock: socket.socket | None = None
        try:
            self._sock = self._connect(time.monotonic() + self.timeout, self.timeout)
        except BaseException:
            if self._server is not None:
                self._server.close()
            raise

    @property
    def server(self) -> StoreServer | None:
        """The server this client started (``serve=True``), or None."""
        return self._server

    @property
    def refused(self) -> tuple[str, ...]:
        """Connections the server this client runs refused for lacking the job secret (latest 8; else none)."""
        return self._server.refused if self._server is not None else ()

    @property
    def _where(self) -> str:
        return f"the store at {self.host}:{self.port}"

    def _connect(self, deadline: float, seconds: float) -> socket.socket:
        while True:
            sock = dial(self.host, self.port, deadline,
                        f"could not reach {self._where} within {seconds:g} s; is rank 0 running, and are MASTER_ADDR "
                        f"and MASTER_PORT the same on every rank?")
            try:
                connect_handshake(sock, self._secret, b"ferro-store",
                                  max(min(HANDSHAKE_TIMEOUT, deadline - time.monotonic()), 0.001), self._where)
            except DistributedTimeoutError as exc:
                sock.close()
                raise DistributedTimeoutError(f"{exc} (within {seconds:g} s; is the store's host frozen?)") from exc
            except PeerLostError as exc:
                # A server flooded by connections evicts the oldest still authenticating: dial again.
                sock.close()
                if time.monotonic() >= deadline:
                    raise PeerLostError(f"{self._where} dropped this client during authentication: {exc}") from exc
                log.debug("%s dropped this client during authentication (%s); connecting again", self._where, exc)
                continue
            except BaseException:
                sock.close()
                raise
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock

    def _request(self, code: int, args: Sequence[bytes], seconds: float, what: str,
                 grace: float = 0.0) -> tuple[int, list[bytes]]:
        """Send one request and read its answer, all before ``seconds + grace`` from now.

        ``grace`` is for requests the server itself ends at the caller's deadline
        (:data:`ANSWER_GRACE`): its answer may come a little late. If the deadline
        passes first the connection is dropped (a late answer must never be read as
        the next request's) and the next request reconnects.
        """
        deadline = time.monotonic() + seconds + grace
        timed_out = (f"{self._where} did not answer {what} within {seconds + grace:g} s "
                     "(is its host frozen or overloaded?)")
        if not self._lock.acquire(timeout=max(seconds, 0.0)):
            raise DistributedTimeoutError(f"{timed_out}; this client was busy with another thread's request")
        try:
            if self._closed:
                raise BackendClosedError("store: this client was closed")
            if self._sock is None:
                self._sock = self._connect(deadline, seconds)
            sock = self._sock
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                sock.sendall(pack(code, args))
                body = _read_message(sock)
            except TimeoutError as exc:
                self._drop()
                raise DistributedTimeoutError(timed_out) from exc
            except (OSError, ValueError) as exc:
                self._drop()
                raise PeerLostError(f"lost the connection to {self._where}: {exc}") from exc
            if body is None:
                self._drop()
                raise PeerLostError(f"{self._where} closed the connection (its process exited?)")
            status, results = unpack(body)
        finally:
            self._lock.release()
        if status == Status.FAILED:
            raise StoreError(f"{self._where}: {results[0].decode(errors='replace')}")
        return status, results

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _seconds(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else default_timeout(timeout)

    @staticmethod
    def _server_wait_ms(seconds: float) -> bytes:
        # The server gives up a little before the caller's deadline, so its answer arrives in time.
        return str(max(0, int((seconds - min(SERVER_HEADSTART, seconds / 10)) * 1000))).encode()

    def clone(self) -> Store:
        """Return another client of the same server, with a connection of its own.

        A background thread that talks to the store (NCCL's watchdog) uses one, so
        it never waits behind the main thread's long ``get`` or ``wait``.
        """
        return Store(self.host, self.port, secret=self._secret, timeout=self.timeout)

    def set(self, key: str, value: bytes | str, timeout: float | None = None) -> None:
        """Set ``key`` to ``value``, waking every waiter on it.

        Raises:
            DistributedTimeoutError: The store did not answer within ``timeout`` seconds (default: the client's).

        """
        self._request(Op.SET, [key.encode(), _as_bytes(value)], self._seconds(timeout), f"set({key!r})")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` seconds for it to be set.

        Raises:
            DistributedTimeoutError: The key was not set in time, or the store did not answer.

        """
        seconds = self._seconds(timeout)
        status, results = self._request(Op.GET, [self._server_wait_ms(seconds), key.encode()], seconds,
                                        f"get({key!r})", ANSWER_GRACE)
        if status == Status.TIMED_OUT:
            raise StoreKeyTimeoutError(f"store: key {key!r} was not set within {seconds:g} s", (key,))
        return results[0]

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key in ``keys`` is set.

        Raises:
            DistributedTimeoutError: Naming the keys still missing (as :class:`StoreKeyTimeoutError`),
                or the store did not answer.

        """
        key_list = [k.encode() for k in keys]
        seconds = self._seconds(timeout)
        status, missing = self._request(Op.WAIT, [self._server_wait_ms(seconds), *key_list], seconds, "wait()",
                                         ANSWER_GRACE)
        if status == Status.TIMED_OUT:
            names = [k.decode() for k in missing]
            raise StoreKeyTimeoutError(
                f"store: keys still missing after {seconds:g} s: {', '.join(map(repr, names))}", tuple(names))

    def add(self, key: str, amount: int, timeout: float | None = None) -> int:
        """Add ``amount`` to the integer at ``key`` (missing counts as 0) and return the new value.

        Raises:
            StoreError: The key holds something that is not an integer.
            DistributedTimeoutError: The store did not answer in time.

        """
        _, results = self._request(Op.ADD, [key.encode(), str(int(amount)).encode()], self._seconds(timeout),
                                   f"add({key!r})")
        return int(results[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str, timeout: float | None = None) -> bytes:
        """Set ``key`` to ``desired`` if it currently holds ``expected``; return the value afterwards.

        As in torch's TCPStore, a missing key counts as holding ``b""``, and when
        the key is missing and ``expected`` is not empty, ``expected`` is returned.
        """
        _, results = self._request(Op.COMPARE_SET, [key.encode(), _as_bytes(expected), _as_bytes(desired)],
                                   self._seconds(timeout), f"compare_set({key!r})")
        return results[0]

    def delete_key(self, key: str, timeout: float | None = None) -> bool:
        """Delete ``key``; return whether it existed."""
        _, results = self._request(Op.DELETE, [key.encode()], self._seconds(timeout), f"delete_key({key!r})")
        return results[0] == b"1"

    def check(self, keys: Iterable[str], timeout: float | None = None) -> bool:
        """Return whether every key in ``keys`` is set, without waiting for them."""
        _, results = self._request(Op.CHECK, [k.encode() for k in keys], self._seconds(timeout), "check()")
        return results[0] == b"1"

    def present(self, keys: Sequence[str], timeout: float | None = None) -> list[bool]:
        """Return, per key, whether it is set, without waiting: one request for any number of keys.

        ferro's own operation (torch's store has only :meth:`check`, all or nothing):
        a rank that polls who of N members arrived asks once, not N times.
        """
        _, results = self._request(Op.PRESENT, [k.encode() for k in keys], self._seconds(timeout), "present()")
        return [bool(b) for b in results[0]] if keys else []

    def num_keys(self, timeout: float | None = None) -> int:
        """Return the number of keys in the store."""
        _, results = self._request(Op.NUM_KEYS, [], self._seconds(timeout), "num_keys()")
        return int(results[0])

    def multi_get(self, keys: Sequence[str], timeout: float | None = None) -> list[bytes]:
        """Return the values of ``keys``, in order, waiting up to ``timeout`` seconds until all are set: one request.

        Raises:
            DistributedTimeoutError: Naming the keys still missing (as :class:`StoreKeyTimeoutError`).

        """
        seconds = self._seconds(timeout)
        status, results = self._request(Op.MULTI_GET, [self._server_wait_ms(seconds), *(k.encode() for k in keys)],
                                        seconds, "multi_get()", ANSWER_GRACE)
        if status == Status.TIMED_OUT:
            names = [k.decode() for k in results]
            raise StoreKeyTimeoutError(
                f"store: keys still missing after {seconds:g} s: {', '.join(map(repr, names))}", tuple(names))
        return results

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str], timeout: float | None = None) -> None:
        """Set every key to its value in one request (waking their waiters).

        Raises:
            ValueError: ``keys`` and ``values`` differ in length.

        """
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        args = [part for key, value in zip(keys, values, strict=True) for part in (key.encode(), _as_bytes(value))]
        self._request(Op.MULTI_SET, args, self._seconds(timeout), "multi_set()")

    def append(self, key: str, value: bytes | str, timeout: float | None = None) -> None:
        """Append ``value`` to the bytes at ``key`` (a missing key starts empty)."""
        self._request(Op.APPEND, [key.encode(), _as_bytes(value)], self._seconds(timeout), f"append({key!r})")

    def queue_push(self, key: str, value: bytes | str, timeout: float | None = None) -> None:
        """Push ``value`` at the back of the queue ``key`` (queues live apart from keys, as in torch's store)."""
        self._request(Op.QUEUE_PUSH, [key.encode(), _as_bytes(value)], self._seconds(timeout), f"queue_push({key!r})")

    def queue_pop(self, key: str, timeout: float | None = None) -> bytes:
        """Pop the front of the queue ``key``, waiting up to ``timeout`` seconds for one to be pushed.

        Waiters are served in the order they asked; the server holds no thread for them.

        Raises:
            DistributedTimeoutError: Nothing was pushed in time (as :class:`StoreKeyTimeoutError`).

        """
        seconds = self._seconds(timeout)
        status, results = self._request(Op.QUEUE_POP, [self._server_wait_ms(seconds), key.encode()], seconds,
                                        f"queue_pop({key!r})", ANSWER_GRACE)
        if status == Status.TIMED_OUT:
            raise StoreKeyTimeoutError(f"store: nothing was pushed to queue {key!r} within {seconds:g} s", (key,))
        return results[0]

    def queue_len(self, key: str, timeout: float | None = None) -> int:
        """Return how many values wait in the queue ``key``."""
        _, results = self._request(Op.QUEUE_LEN, [key.encode()], self._seconds(timeout), f"queue_len({key!r})")
        return int(results[0])

    def close(self) -> None:
        """Close the connection (and stop the server if this client started it). Idempotent."""
        self._closed = True
        # A request in flight on another thread gets its answer first; one blocked on a frozen server
        # (holding the lock for up to its deadline) is cut short instead.
        locked = self._lock.acquire(timeout=CLOSE_WAIT_SECONDS)
        try:
            sock, self._sock = self._sock, None
            if sock is not None:
                shutdown_quietly(sock)
                sock.close()
        finally:
            if locked:
                self._lock.release()
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
