"""The store's server: one thread, one epoll loop, whatever the number of clients.

A thread per client (ferro's first server, and torch's before libuv) stops at a
few thousand clients: threads cost memory and the scheduler's time, and every
request wakes one. Here one thread multiplexes every connection through
:mod:`selectors` (epoll on Linux): a connection is a buffer in, a buffer out and
a state; a blocking ``get``, ``wait`` or ``queue_pop`` is a waiter record filed
under the one key it still misses, answered when that key is set or when its
deadline (kept in a heap) passes. Authentication is the same HMAC handshake as
everywhere, driven by bytes as they arrive (:class:`~ferro.rendezvous.auth.HandshakeAcceptor`).

What hostile or broken clients cannot do: an unauthenticated connection costs a
descriptor and nothing else, and is cut after ``PRE_AUTH_SECONDS``; past
``MAX_UNAUTHENTICATED`` of them, or when accept() runs out of descriptors, the
oldest is evicted to make room. When every descriptor holds an authenticated
client, a newcomer is told why it cannot be served (the descriptor limit, and
how to raise it) instead of seeing the connection close.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
import time

from ferro.errors import AuthenticationError, ConfigurationError
from ferro.rendezvous.auth import PRE_AUTH_SECONDS, HandshakeAcceptor, RefusalLog, rejection, shutdown_quietly
from ferro.rendezvous.limits import descriptor_limits, raise_descriptor_limit
from ferro.rendezvous.store_wire import MAX_MESSAGE_BYTES, U32, Op, Status, arity_error, pack, unpack

__all__ = ["MAX_UNAUTHENTICATED", "StoreServer"]

log = logging.getLogger("ferro.store")

# How long close() lets answers already queued go out.
DRAIN_SECONDS = 2.0
# Connections allowed to be authenticating at once; another evicts the oldest (a real client answers within
# milliseconds, and retries if it was evicted all the same).
MAX_UNAUTHENTICATED = 4096
# After accept() fails for lack of descriptors with nothing to evict, listen again after this long.
ACCEPT_RETRY_SECONDS = 0.05
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_READ_BYTES = 256 * 1024
_READ, _BOTH = selectors.EVENT_READ, selectors.EVENT_READ | selectors.EVENT_WRITE


class _Conn:
    __slots__ = ("sock", "peer", "inbuf", "out", "handshake", "waiter", "closing", "events")

    def __init__(self, sock: socket.socket, peer: str, handshake: HandshakeAcceptor) -> None:
        self.sock, self.peer = sock, peer
        self.handshake: HandshakeAcceptor | None = handshake  # None once authenticated
        self.inbuf = bytearray()
        self.out = bytearray()
        self.waiter: _Waiter | None = None  # a blocking request in progress: later requests wait behind it
        self.closing = False  # close once the output is flushed
        self.events = _READ


class _Waiter:
    __slots__ = ("conn", "code", "keys", "deadline", "done", "filed_under")

    def __init__(self, conn: _Conn, code: int, keys: list[bytes], deadline: float) -> None:
        self.conn, self.code, self.keys, self.deadline = conn, code, keys, deadline
        self.done = False
        self.filed_under: bytes | None = None  # the key (or queue) it waits on now


class StoreServer:
    """Serves the key-value store on ``host:port`` from one background thread (an epoll loop).

    Args:
        host: Address to bind (the master address the ranks will connect to).
        port: Port to bind; 0 picks a free one (the bound one is then the ``port`` attribute).
        secret: The job secret every client must prove it holds.

    Raises:
        ConfigurationError: The address cannot be bound (in use, or not local).

    """

    def __init__(self, host: str, port: int, *, secret: bytes) -> None:
        raise_descriptor_limit()  # as MPI launchers do: a big job's clients need descriptors, the soft limit is low
        self._secret = secret
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, collections.deque[bytes]] = {}
        self._key_waiters: dict[bytes, dict[_Waiter, None]] = {}
        self._pop_waiters: dict[bytes, dict[_Waiter, None]] = {}
        self._timers: list[tuple[float, int, _Waiter]] = []
        self._timer_ids = itertools.count()
        self._unauthenticated: collections.OrderedDict[_Conn, float] = collections.OrderedDict()
        self._clients = 0
        self._closing = False
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
        self._listener.listen(4096)
        self._listener.setblocking(False)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._refusals = RefusalLog(log, f"store on port {self.port}")
        self._listening_again_at: float | None = None
        self._spare: int | None = os.open(os.devnull, os.O_RDONLY)  # given up to tell a newcomer why not
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, _READ, "listener")
        self._selector.register(self._wake_read, _READ, "wake")
        self._thread = threading.Thread(target=self._run, name=f"ferro-store:{self.port}", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> tuple[str, ...]:
        """Descriptions of the latest connections refused for lacking the job secret (at most 8)."""
        return self._refusals.latest

    @property
    def threads(self) -> int:
        """Threads serving connections (one, whatever the number of clients; 0 once closed)."""
        return int(self._thread.is_alive())

    @property
    def clients(self) -> int:
        """Authenticated clients connected now."""
        return self._clients

    def close(self) -> None:
        """Stop serving: answer waiting requests "timed out", let queued answers go out, close every connection.

        A request the server already applied (the last ``set`` of a rank that is
        done with the store, say) still gets its answer, so the client sees success
        rather than a lost connection. Idempotent.
        """
        if self._closing:
            return
        self._closing = True
        try:
            self._wake_write.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(DRAIN_SECONDS + 3.0)

    # --- the loop ------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                for key, mask in self._selector.select(self._next_timeout()):
                    if key.data == "listener":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if mask & selectors.EVENT_READ and conn.sock.fileno() >= 0:
                            self._read(conn)
                self._expire(time.monotonic())
            self._shut_down()
        except Exception:  # a bug here would otherwise leave every rank waiting for its timeout
            log.exception("store on port %d: the server loop failed; closing every connection", self.port)
            self._shut_down()

    def _next_timeout(self) -> float | None:
        soonest = []
        if self._timers:
            soonest.append(self._timers[0][0])
        if self._unauthenticated:
            soonest.append(next(iter(self._unauthenticated.values())))
        if self._listening_again_at is not None:
            soonest.append(self._listening_again_at)
        return max(0.0, min(soonest) - time.monotonic()) if soonest else None

    def _drain_wake(self) -> None:
        try:
            while self._wake_read.recv(4096):
                pass
        except OSError:
            pass

    def _shut_down(self) -> None:
        self._closing = True
        for waiter in [t[2] for t in self._timers]:
            self._time_out(waiter)  # as the threaded server did: a closing store answers "not yet"
        deadline = time.monotonic() + DRAIN_SECONDS
        conns = [key.data for key in list(self._selector.get_map().values()) if isinstance(key.data, _Conn)]
        while any(c.out for c in conns) and time.monotonic() < deadline:
            for key, _ in self._selector.select(max(0.0, deadline - time.monotonic())):
                if isinstance(key.data, _Conn):
                    self._flush(key.data)
        for conn in conns:
            shutdown_quietly(conn.sock)
            conn.sock.close()
        for sock in (self._listener, self._wake_read, self._wake_write):
            sock.close()
        self._selector.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None

    # --- connections ---------------------------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(512):  # a batch per wake-up, so that clients already connected are served between batches
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._out_of_descriptors()
                return
            sock.setblocking(False)
            conn = _Conn(sock, f"store client {address[0]}:{address[1]}",
                         HandshakeAcceptor(self._secret, f"store client {address[0]}:{address[1]}"))
            self._selector.register(sock, _READ, conn)
            self._unauthenticated[conn] = time.monotonic() + PRE_AUTH_SECONDS
            if len(self._unauthenticated) > MAX_UNAUTHENTICATED:
                oldest = next(iter(self._unauthenticated))
                self._refusals.note(f"{oldest.peer}: evicted before authenticating (too many at once)")
                self._drop(oldest)

    def _out_of_descriptors(self) -> None:
        """accept() found no descriptor free (Linux says so even when no connection waits)."""
        if not self._unauthenticated:
            # Every descriptor holds an authenticated client: tell a newcomer why, through the spare one.
            self._reject_newcomer()
        # Handshakes in progress end soon (authenticated, or cut at PRE_AUTH_SECONDS): listen again after a pause.
        self._selector.unregister(self._listener)
        self._listening_again_at = time.monotonic() + ACCEPT_RETRY_SECONDS

    def _reject_newcomer(self) -> None:
        if self._spare is None:
            return
        os.close(self._spare)
        try:
            sock, _ = self._listener.accept()
        except OSError:
            sock = None  # nobody waits after all
        if sock is not None:
            soft, hard = descriptor_limits()
            reason = (f"the store at port {self.port} serves {self._clients} clients and has reached its process's "
                      f"descriptor limit (RLIMIT_NOFILE: soft {soft}, hard {hard}); raise the hard limit on the "
                      f"store's host (ulimit -Hn, LimitNOFILE= in systemd, or nofile in "
                      f"/etc/security/limits.conf), or run fewer ranks per job")
            self._refusals.note(reason)
            sock.settimeout(0.05)
            try:
                sock.sendall(rejection(reason))
            except OSError:
                pass
            sock.close()
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY)
        except OSError:
            self._spare = None

    def _drop(self, conn: _Conn) -> None:
        if conn.sock.fileno() < 0:
            return
        if self._unauthenticated.pop(conn, None) is None and conn.handshake is None:
            self._clients -= 1
        if conn.waiter is not None:
            self._forget(conn.waiter)
        self._selector.unregister(conn.sock)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            log.debug("store on port %d: dropping %s: %s", self.port, conn.peer, exc)
            self._drop(conn)
            return
        if not data:
            if conn.handshake is not None and conn.handshake.challenged:
                # A client without the secret hangs up once it sees our answer is wrong for it.
                self._refusals.note(f"{conn.peer} hung up during authentication: it does not hold the job secret")
            self._drop(conn)
            return
        conn.inbuf += data
        self._process(conn)

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.sock.fileno() < 0:
            return
        if not conn.out:
            try:
                sent = conn.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._drop(conn)
                return
            if sent == len(data):
                return
            data = data[sent:]
        conn.out += data
        if conn.events != _BOTH:
            conn.events = _BOTH
            self._selector.modify(conn.sock, _BOTH, conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except BlockingIOError:
                return
            except OSError:
                self._drop(conn)
                return
            del conn.out[:sent]
        if not conn.out:
            if conn.closing:
                self._drop(conn)
            elif conn.events != _READ:
                conn.events = _READ
                self._selector.modify(conn.sock, _READ, conn)

    def _process(self, conn: _Conn) -> None:
        if conn.handshake is not None and not self._authenticate(conn):
            return
        buf = conn.inbuf
        while conn.waiter is None and not conn.closing and len(buf) >= 4:
            (length,) = U32.unpack_from(buf, 0)
            if length > MAX_MESSAGE_BYTES:
                log.debug("store on port %d: dropping %s: a message of %d bytes exceeds the limit of %d",
                          self.port, conn.peer, length, MAX_MESSAGE_BYTES)
                self._drop(conn)
                return
            if len(buf) < 4 + length:
                return
            body = bytes(buf[4 : 4 + length])
            del buf[: 4 + length]
            try:
                code, args = unpack(body)
            except ValueError as exc:
                log.debug("store on port %d: dropping %s: %s", self.port, conn.peer, exc)
                self._drop(conn)
                return
            self._execute(conn, code, args)

    def _authenticate(self, conn: _Conn) -> bool:
        """Advance the handshake; return whether the connection is now an authenticated client."""
        assert conn.handshake is not None
        try:
            reply = conn.handshake.feed(conn.inbuf)
        except AuthenticationError as exc:
            self._refusals.note(str(exc))
            self._drop(conn)
            return False
        if reply:
            self._send(conn, reply)
        if conn.handshake.outcome is None:
            return False
        self._unauthenticated.pop(conn, None)
        if conn.handshake.outcome != "accepted":
            self._refusals.note(f"refused {conn.peer}: it does not hold the job secret (FERRO_SECRET differs)")
            conn.handshake = None
            self._clients += 1  # counted down again by _drop
            conn.closing = True
            self._flush(conn)
            return False
        conn.handshake = None
        self._clients += 1
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return True

    # --- requests ------------------------------------------------------------------------------------------------

    def _execute(self, conn: _Conn, code: int, args: list[bytes]) -> None:
        error = arity_error(code, args)
        if error is not None:
            self._send(conn, pack(Status.FAILED, [error.encode()]))
            return
        if code in (Op.GET, Op.WAIT, Op.MULTI_GET, Op.QUEUE_POP):
            self._wait(conn, code, args[1:], int(args[0]) / 1000.0)
            return
        status, results = self._apply(code, args)
        self._send(conn, pack(status, results))

    def _apply(self, code: int, args: list[bytes]) -> tuple[int, list[bytes]]:
        data = self._data
        if code == Op.SET:
            self._put(args[0], args[1])
            return Status.OK, []
        if code == Op.MULTI_SET:
            for i in range(0, len(args), 2):
                self._put(args[i], args[i + 1])
            return Status.OK, []
        if code == Op.APPEND:
            self._put(args[0], data.get(args[0], b"") + args[1])
            return Status.OK, []
        if code == Op.ADD:
            current = data.get(args[0], b"0")
            try:
                value = str(int(current) + int(args[1])).encode()
            except ValueError:
                return Status.FAILED, [b"add: the key holds " + current[:64] + b", not an integer"]
            self._put(args[0], value)
            return Status.OK, [value]
        if code == Op.COMPARE_SET:
            key, expected, desired = args
            current_or_none = data.get(key)
            if (current_or_none is None and expected == b"") or current_or_none == expected:
                self._put(key, desired)
                return Status.OK, [desired]
            return Status.OK, [expected if current_or_none is None else current_or_none]
        if code == Op.DELETE:
            return Status.OK, [b"1" if data.pop(args[0], None) is not None else b"0"]
        if code == Op.CHECK:
            return Status.OK, [b"1" if all(k in data for k in args) else b"0"]
        if code == Op.PRESENT:
            return Status.OK, [bytes(k in data for k in args)]
        if code == Op.NUM_KEYS:
            return Status.OK, [str(len(data)).encode()]
        if code == Op.QUEUE_PUSH:
            self._queues.setdefault(args[0], collections.deque()).append(args[1])
            self._serve_pops(args[0])
            return Status.OK, []
        if code == Op.QUEUE_LEN:
            return Status.OK, [str(len(self._queues.get(args[0], ()))).encode()]
        return Status.FAILED, [f"unknown store operation {code}".encode()]

    def _put(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        waiters = self._key_waiters.pop(key, None)
        if waiters:
            for waiter in waiters:
                waiter.filed_under = None
                self._advance(waiter)

    def _wait(self, conn: _Conn, code: int, keys: list[bytes], seconds: float) -> None:
        waiter = _Waiter(conn, code, keys, time.monotonic() + seconds)
        conn.waiter = waiter
        if code == Op.QUEUE_POP:
            if self._queues.get(keys[0]):
                self._finish(waiter, Status.OK, [self._queues[keys[0]].popleft()])
                return
            waiter.filed_under = keys[0]
            self._pop_waiters.setdefault(keys[0], {})[waiter] = None
        elif not self._advance(waiter):
            return
        if waiter.done:
            return
        heapq.heappush(self._timers, (waiter.deadline, next(self._timer_ids), waiter))

    def _advance(self, waiter: _Waiter) -> bool:
        """File a key waiter under the first key it still misses, or answer it; return whether it still waits."""
        missing = next((k for k in waiter.keys if k not in self._data), None)
        if missing is None:
            values = ([] if waiter.code == Op.WAIT else
                      [self._data[waiter.keys[0]]] if waiter.code == Op.GET else [self._data[k] for k in waiter.keys])
            self._finish(waiter, Status.OK, values)
            return False
        waiter.filed_under = missing
        self._key_waiters.setdefault(missing, {})[waiter] = None
        return True

    def _serve_pops(self, key: bytes) -> None:
        queue, waiters = self._queues.get(key), self._pop_waiters.get(key)
        while queue and waiters:
            waiter = next(iter(waiters))
            del waiters[waiter]
            waiter.filed_under = None
            self._finish(waiter, Status.OK, [queue.popleft()])
        if waiters is not None and not waiters:
            del self._pop_waiters[key]

    def _finish(self, waiter: _Waiter, status: int, results: list[bytes]) -> None:
        waiter.done = True
        conn = waiter.conn
        conn.waiter = None
        self._send(conn, pack(status, results))
        if conn.inbuf and conn.sock.fileno() >= 0:
            self._process(conn)  # requests that arrived behind this one

    def _forget(self, waiter: _Waiter) -> None:
        waiter.done = True
        waiter.conn.waiter = None
        if waiter.filed_under is not None:
            table = self._pop_waiters if waiter.code == Op.QUEUE_POP else self._key_waiters
            filed = table.get(waiter.filed_under)
            if filed is not None:
                filed.pop(waiter, None)
                if not filed:
                    del table[waiter.filed_under]
            waiter.filed_under = None

    def _time_out(self, waiter: _Waiter) -> None:
        if waiter.done:
            return
        self._forget(waiter)
        missing = [k for k in waiter.keys if k not in self._data] if waiter.code != Op.QUEUE_POP else waiter.keys
        self._finish(waiter, Status.TIMED_OUT, missing)

    def _expire(self, now: float) -> None:
        while self._timers and (self._timers[0][0] <= now or self._timers[0][2].done):
            self._time_out(heapq.heappop(self._timers)[2])
        while self._unauthenticated:
            conn, deadline = next(iter(self._unauthenticated.items()))
            if deadline > now:
                break
            self._refusals.note(f"{conn.peer}: did not authenticate within {PRE_AUTH_SECONDS:g} s")
            self._drop(conn)
        if self._listening_again_at is not None and now >= self._listening_again_at:
            self._listening_again_at = None
            self._selector.register(self._listener, _READ, "listener")
