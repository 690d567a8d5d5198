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
)
from ferro.rendezvous.auth import accept_handshake, connect_handshake
from ferro.rendezvous.connect import dial

__all__ = ["Store", "StoreServer"]

log = logging.getLogger("ferro.store")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT = 300.0
HANDSHAKE_TIMEOUT = 10.0
# How long close() lets requests already being served send their answers.
DRAIN_SECONDS = 2.0
# Extra seconds a client waits beyond a server-side wait, so the server's answer wins the race.
REPLY_MARGIN = 5.0

_SET, _GET, _WAIT, _ADD, _COMPARE_SET, _DELETE, _CHECK, _NUM_KEYS = range(1, 9)
_OK, _TIMED_OUT, _FAILED = 0, 1, 2
_U32 = struct.Struct("<I")


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

    Args:
        host: Address to bind (the master address the ranks will connect to).
        port: Port to bind; 0 picks a free one (see :attr:`port`).
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
        self._refused: list[str] = []
        self._in_flight = 0  # requests read whose answer is not yet sent
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            raise ConfigurationError(
                f"cannot serve the store on {host}:{port}: {exc.strerror}; choose another MASTER_PORT "
                f"or check that MASTER_ADDR is an address of this host") from exc
        self._listener.listen(128)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name=f"ferro-store:{self.port}", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> tuple[str, ...]:
        """Descriptions of the latest connections refused for lacking the job secret (at most 8)."""
        with self._cond:
            return tuple(self._refused)

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
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock in clients:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5.0)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve_client, args=(sock, address), name="ferro-store-client", daemon=True
            ).start()

    def _serve_client(self, sock: socket.socket, address: tuple[str, int]) -> None:
        peer = f"store client {address[0]}:{address[1]}"
        try:
            accept_handshake(sock, self._secret, HANDSHAKE_TIMEOUT, peer)
        except (AuthenticationError, DistributedError) as exc:
            log.warning("store on port %d: %s", self.port, exc)
            with self._cond:
                self._refused = [*self._refused[-7:], str(exc)]
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._cond:
            if self._closing:
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
        self.timeout = float(timeout)
        self._secret = _as_bytes(secret)
        self._lock = threading.Lock()
        self._server = StoreServer(host, port, secret=self._secret) if serve else None
        self.host = host
        self.port = self._server.port if self._server is not None else port
        self._sock: socket.socket | None = None
        try:
            self._sock = self._connect()
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

    def _connect(self) -> socket.socket:
        where = f"the store at {self.host}:{self.port}"
        sock = dial(self.host, self.port, time.monotonic() + self.timeout,
                    f"could not reach {where} within {self.timeout:g} s; is rank 0 running, and are MASTER_ADDR "
                    f"and MASTER_PORT the same on every rank?")
        try:
            connect_handshake(sock, self._secret, b"ferro-store", min(HANDSHAKE_TIMEOUT, self.timeout), where)
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _request(self, code: int, args: Sequence[bytes], wait: float | None = None) -> tuple[int, list[bytes]]:
        with self._lock:
            if self._sock is None:
                raise BackendClosedError("store: this client was closed")
            where = f"the store at {self.host}:{self.port}"
            self._sock.settimeout(None if wait is None else wait + REPLY_MARGIN)
            try:
                self._sock.sendall(_pack(code, args))
                body = _read_message(self._sock)
            except TimeoutError as exc:
                raise DistributedTimeoutError(f"{where} did not answer within {wait:g} s") from exc
            except (OSError, ValueError) as exc:
                raise PeerLostError(f"lost the connection to {where}: {exc}") from exc
            if body is None:
                raise PeerLostError(f"{where} closed the connection (its process exited?)")
            status, results = _unpack(body)
        if status == _FAILED:
            raise StoreError(f"{where}: {results[0].decode(errors='replace')}")
        return status, results

    def _timeout_ms(self, timeout: float | None) -> tuple[float, bytes]:
        seconds = self.timeout if timeout is None else float(timeout)
        return seconds, str(max(0, int(seconds * 1000))).encode()

    def set(self, key: str, value: bytes | str) -> None:
        """Set ``key`` to ``value``, waking every waiter on it."""
        self._request(_SET, [key.encode(), _as_bytes(value)])

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` seconds for it to be set.

        Raises:
            DistributedTimeoutError: The key was not set in time.

        """
        seconds, ms = self._timeout_ms(timeout)
        status, results = self._request(_GET, [ms, key.encode()], wait=seconds)
        if status == _TIMED_OUT:
            raise DistributedTimeoutError(f"store: key {key!r} was not set within {seconds:g} s")
        return results[0]

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key in ``keys`` is set.

        Raises:
            DistributedTimeoutError: Naming the keys still missing.

        """
        key_list = [k.encode() for k in keys]
        seconds, ms = self._timeout_ms(timeout)
        status, missing = self._request(_WAIT, [ms, *key_list], wait=seconds)
        if status == _TIMED_OUT:
            names = ", ".join(repr(k.decode()) for k in missing)
            raise DistributedTimeoutError(f"store: keys still missing after {seconds:g} s: {names}")

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (missing counts as 0) and return the new value.

        Raises:
            StoreError: The key holds something that is not an integer.

        """
        _, results = self._request(_ADD, [key.encode(), str(int(amount)).encode()])
        return int(results[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it currently holds ``expected``; return the value afterwards.

        As in torch's TCPStore, a missing key counts as holding ``b""``, and when
        the key is missing and ``expected`` is not empty, ``expected`` is returned.
        """
        _, results = self._request(_COMPARE_SET, [key.encode(), _as_bytes(expected), _as_bytes(desired)])
        return results[0]

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        _, results = self._request(_DELETE, [key.encode()])
        return results[0] == b"1"

    def check(self, keys: Iterable[str]) -> bool:
        """Return whether every key in ``keys`` is set, without waiting."""
        _, results = self._request(_CHECK, [k.encode() for k in keys])
        return results[0] == b"1"

    def num_keys(self) -> int:
        """Return the number of keys in the store."""
        _, results = self._request(_NUM_KEYS, [])
        return int(results[0])

    def close(self) -> None:
        """Close the connection (and stop the server if this client started it). Idempotent."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
