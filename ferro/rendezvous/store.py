"""A small key-value store served over TCP, for rendezvous.

Rank 0 (or a launcher) serves it; every rank connects as a client, publishes
its listen address and reads the others'. The operations and their meaning
follow torch.distributed's ``TCPStore``: ``set``, blocking ``get`` and ``wait``
with timeouts, ``add`` on integer counters, ``compare_set``, ``delete_key``,
``check`` and ``num_keys``. Every connection is authenticated with the job
secret before any request is read.

Wire format: each message is a little-endian u32 length and a body; a request
body is an op byte and arguments, a response body a status byte and arguments;
each argument is a u32 length and its bytes. Lengths are checked against
``MAX_MESSAGE_BYTES`` before anything is allocated.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence

from ferro.errors import (
    AuthenticationError,
    BackendClosedError,
    ConfigurationError,
    DistributedError,
    DistributedTimeoutError,
    PeerLostError,
    StoreError,
    StoreKeyTimeoutError,
)
from ferro.rendezvous.auth import (
    PRE_AUTH_SECONDS,
    Admission,
    RefusalLog,
    accept_handshake,
    connect_handshake,
    shutdown_quietly,
)
from ferro.rendezvous.connect import dial
from ferro.rendezvous.settings import default_timeout

__all__ = ["Store", "StoreKeyTimeoutError", "StoreServer"]

log = logging.getLogger("ferro.store")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT = 300.0
# How long this client's own handshake with the server may take.
HANDSHAKE_TIMEOUT = 10.0
# How long close() lets requests already being served send their answers.
DRAIN_SECONDS = 2.0
# How long a client's close() waits for a request another thread has in flight.
CLOSE_WAIT_SECONDS = 1.0
# A server-side wait (get, wait) ends this much before the caller's deadline, so the server's
# "not yet" normally arrives in time and the connection stays usable.
SERVER_HEADSTART = 0.1
# Each authenticated client holds one thread (authentication is limited by auth.Admission); at most
# this many are kept.
MAX_CLIENTS = 4096

_SET, _GET, _WAIT, _ADD, _COMPARE_SET, _DELETE, _CHECK, _NUM_KEYS = range(1, 9)
_OK, _TIMED_OUT, _FAILED = 0, 1, 2
_U32 = struct.Struct("<I")
# How many arguments each operation takes: (at least, at most or None for any number).
_ARITY: dict[int, tuple[int, int | None]] = {
    _SET: (2, 2), _GET: (2, 2), _WAIT: (1, None), _ADD: (2, 2), _COMPARE_SET: (3, 3), _DELETE: (1, 1),
    _CHECK: (0, None), _NUM_KEYS: (0, 0)}


def _pack(code: int, args: Sequence[bytes]) -> bytes:
    parts = [bytes([code])]
    for arg in args:
        parts.append(_U32.pack(len(arg)))
        parts.append(arg)
    body = b"".join(parts)
    return _U32.pack(len(body)) + body


def _unpack(body: bytes) -> tuple[int, list[bytes]]:
    if not body:
        raise ValueError("empty message")
    args: list[bytes] = []
    offset = 1
    while offset < len(body):
        if offset + 4 > len(body):
            raise ValueError("truncated argument length")
        (n,) = _U32.unpack_from(body, offset)
        offset += 4
        if offset + n > len(body):
            raise ValueError("argument longer than its message")
        args.append(body[offset : offset + n])
        offset += n
    return body[0], args


def _read_message(sock: socket.socket) -> bytes | None:
    """Read one length-prefixed message; None on a clean close before it starts."""
    header = _read_exact(sock, 4, allow_eof=True)
    if header is None:
        return None
    (n,) = _U32.unpack(header)
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


class StoreServer:
    """Serves the key-value store on ``host:port`` from background threads.

    Hostile or broken clients cannot stop it: at most ``MAX_HANDSHAKES``
    connections authenticate at once (a new one evicts the oldest, so idle
    connections cannot starve the ranks, whose handshakes take microseconds);
    running out of file descriptors pauses accepting instead of ending it; only
    authenticated clients get a thread of their own.

    Args:
        host: Address to bind (the master address the ranks will connect to).
        port: Port to bind; 0 picks a free one (the bound one is then the ``port`` attribute).
        secret: The job secret every client must prove it holds.

    Raises:
        ConfigurationError: The address cannot be bound (in use, or not local).

    """

    def __init__(self, host: str, port: int, *, secret: bytes) -> None:
        self._secret = secret
        self._data: dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._clients: set[socket.socket] = set()
        self._in_flight = 0  # requests read whose answer is not yet sent
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            raise ConfigurationError(
                f"cannot serve the store on {host}:{port}: {exc.strerror}; if the port is in use, rank 0 was "
                f"started twice or another job uses MASTER_PORT (choose another); else check that MASTER_ADDR is an "
                f"address of this host") from exc
        self._listener.listen(1024)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._refusals = RefusalLog(log, f"store on port {self.port}")
        self._admission = Admission(self._listener, self._serve_client, self._refusals, f"ferro-store:{self.port}")
        self._admission.start()

    @property
    def refused(self) -> tuple[str, ...]:
        """Descriptions of the latest connections refused for lacking the job secret (at most 8)."""
        return self._refusals.latest

    @property
    def threads(self) -> int:
        """Threads serving connections now (authenticating or authenticated)."""
        with self._cond:
            return self._admission.unsettled + len(self._clients)

    def close(self) -> None:
        """Stop serving: wake waiting requests, let answers in progress go out, close every connection.

        A request the server already applied (the last ``set`` of a rank that is
        done with the store, say) still gets its answer, so the client sees success
        rather than a lost connection. Idempotent.
        """
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
            deadline = time.monotonic() + DRAIN_SECONDS
            while self._in_flight and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            clients = list(self._clients)
        self._admission.stop()
        self._listener.close()
        for sock in clients:
            shutdown_quietly(sock)

    def _serve_client(self, sock: socket.socket, address: tuple[str, int]) -> None:
        peer = f"store client {address[0]}:{address[1]}"
        try:
            accept_handshake(sock, self._secret, PRE_AUTH_SECONDS, peer)
        except (AuthenticationError, DistributedError, OSError) as exc:
            self._refusals.note(str(exc))
            sock.close()
            return
        finally:
            self._admission.settled(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._cond:
            if self._closing or len(self._clients) >= MAX_CLIENTS:
                sock.close()
                return
            self._clients.add(sock)
        try:
            while True:
                body = _read_message(sock)
                if body is None:
                    return
                with self._cond:
                    self._in_flight += 1
                try:
                    code, args = _unpack(body)
                    status, results = self._execute(code, args)
                    sock.sendall(_pack(status, results))
                finally:
                    with self._cond:
                        self._in_flight -= 1
                        self._cond.notify_all()
        except (OSError, ValueError) as exc:
            if not self._closing:
                log.debug("store on port %d: dropping %s: %s", self.port, peer, exc)
        finally:
            with self._cond:
                self._clients.discard(sock)
            sock.close()

    def _wait_for(self, keys: list[bytes], timeout_ms: int) -> bool:
        deadline = time.monotonic() + timeout_ms / 1000.0
        while not all(k in self._data for k in keys):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closing:
                return False
            self._cond.wait(remaining)
        return True

    def _execute(self, code: int, args: list[bytes]) -> tuple[int, list[bytes]]:
        arity = _ARITY.get(code)
        if arity is None:
            return _FAILED, [f"unknown store operation {code}".encode()]
        if len(args) < arity[0] or (arity[1] is not None and len(args) > arity[1]):
            return _FAILED, [f"store operation {code} got {len(args)} argument(s)".encode()]
        if code in (_GET, _WAIT) and not args[0].isdigit():
            return _FAILED, [b"the wait limit is not a number of milliseconds"]
        with self._cond:
            if code == _SET:
                self._data[args[0]] = args[1]
                self._cond.notify_all()
                return _OK, []
            if code in (_GET, _WAIT):
                timeout_ms = int(args[0])
                keys = args[1:]
                if not self._wait_for(keys, timeout_ms):
                    return _TIMED_OUT, [k for k in keys if k not in self._data]
                return _OK, [self._data[keys[0]]] if code == _GET else []
            if code == _ADD:
                current = self._data.get(args[0], b"0")
                try:
                    value = int(current) + int(args[1])
                except ValueError:
                    return _FAILED, [b"add: the key holds " + current[:64] + b", not an integer"]
                self._data[args[0]] = str(value).encode()
                self._cond.notify_all()
                return _OK, [self._data[args[0]]]
            if code == _COMPARE_SET:
                key, expected, desired = args
                current_or_none = self._data.get(key)
                if (current_or_none is None and expected == b"") or current_or_none == expected:
                    self._data[key] = desired
                    self._cond.notify_all()
                    return _OK, [desired]
                return _OK, [expected if current_or_none is None else current_or_none]
            if code == _DELETE:
                existed = self._data.pop(args[0], None) is not None
                return _OK, [b"1" if existed else b"0"]
            if code == _CHECK:
                return _OK, [b"1" if all(k in self._data for k in args) else b"0"]
            if code == _NUM_KEYS:
                return _OK, [str(len(self._data)).encode()]
            return _FAILED, [f"unknown store operation {code}".encode()]


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
        sock = dial(self.host, self.port, deadline,
                    f"could not reach {self._where} within {seconds:g} s; is rank 0 running, and are MASTER_ADDR "
                    f"and MASTER_PORT the same on every rank?")
        try:
            connect_handshake(sock, self._secret, b"ferro-store",
                              max(min(HANDSHAKE_TIMEOUT, deadline - time.monotonic()), 0.001), self._where)
        except DistributedTimeoutError as exc:
            sock.close()
            raise DistributedTimeoutError(f"{exc} (within {seconds:g} s; is the store's host frozen?)") from exc
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _request(self, code: int, args: Sequence[bytes], seconds: float, what: str) -> tuple[int, list[bytes]]:
        """Send one request and read its answer, all before ``seconds`` from now.

        If the deadline passes first the connection is dropped (a late answer must
        never be read as the next request's) and the next request reconnects.
        """
        deadline = time.monotonic() + seconds
        timed_out = f"{self._where} did not answer {what} within {seconds:g} s (is its host frozen or overloaded?)"
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
                sock.sendall(_pack(code, args))
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
            status, results = _unpack(body)
        finally:
            self._lock.release()
        if status == _FAILED:
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
        self._request(_SET, [key.encode(), _as_bytes(value)], self._seconds(timeout), f"set({key!r})")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` seconds for it to be set.

        Raises:
            DistributedTimeoutError: The key was not set in time, or the store did not answer.

        """
        seconds = self._seconds(timeout)
        status, results = self._request(_GET, [self._server_wait_ms(seconds), key.encode()], seconds,
                                        f"get({key!r})")
        if status == _TIMED_OUT:
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
        status, missing = self._request(_WAIT, [self._server_wait_ms(seconds), *key_list], seconds, "wait()")
        if status == _TIMED_OUT:
            names = [k.decode() for k in missing]
            raise StoreKeyTimeoutError(
                f"store: keys still missing after {seconds:g} s: {', '.join(map(repr, names))}", tuple(names))

    def add(self, key: str, amount: int, timeout: float | None = None) -> int:
        """Add ``amount`` to the integer at ``key`` (missing counts as 0) and return the new value.

        Raises:
            StoreError: The key holds something that is not an integer.
            DistributedTimeoutError: The store did not answer in time.

        """
        _, results = self._request(_ADD, [key.encode(), str(int(amount)).encode()], self._seconds(timeout),
                                   f"add({key!r})")
        return int(results[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str, timeout: float | None = None) -> bytes:
        """Set ``key`` to ``desired`` if it currently holds ``expected``; return the value afterwards.

        As in torch's TCPStore, a missing key counts as holding ``b""``, and when
        the key is missing and ``expected`` is not empty, ``expected`` is returned.
        """
        _, results = self._request(_COMPARE_SET, [key.encode(), _as_bytes(expected), _as_bytes(desired)],
                                   self._seconds(timeout), f"compare_set({key!r})")
        return results[0]

    def delete_key(self, key: str, timeout: float | None = None) -> bool:
        """Delete ``key``; return whether it existed."""
        _, results = self._request(_DELETE, [key.encode()], self._seconds(timeout), f"delete_key({key!r})")
        return results[0] == b"1"

    def check(self, keys: Iterable[str], timeout: float | None = None) -> bool:
        """Return whether every key in ``keys`` is set, without waiting for them."""
        _, results = self._request(_CHECK, [k.encode() for k in keys], self._seconds(timeout), "check()")
        return results[0] == b"1"

    def num_keys(self, timeout: float | None = None) -> int:
        """Return the number of keys in the store."""
        _, results = self._request(_NUM_KEYS, [], self._seconds(timeout), "num_keys()")
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
