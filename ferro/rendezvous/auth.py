"""Mutual authentication of a new connection with the job secret (HMAC challenge-response).

Both sides prove that they hold the secret without sending it: each side sends a
fresh random nonce and answers the other's with an HMAC-SHA256 over both nonces,
the role and the context (what the connection is for, and the connecting rank).
A process without the secret is refused, and learns so from a clear error; the
accepting side reports the refusal to its caller, who decides whether to keep
waiting for the real peer.

Messages (all fixed-size, so nothing is sized by the peer):
    client -> server: MAGIC, client nonce, context length (u16) + context
    server -> client: server nonce, server MAC
    client -> server: client MAC
    server -> client: one status byte (ACCEPTED or REFUSED)
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

from ferro.errors import AuthenticationError, ConfigurationError, DistributedTimeoutError, PeerLostError

__all__ = ["MAX_HANDSHAKES", "PRE_AUTH_SECONDS", "Admission", "HandshakeAcceptor", "RefusalLog", "accept_handshake",
           "connect_handshake", "rejection", "shutdown_quietly"]

# How long a connection we accepted may take to prove it holds the secret. A rank answers within
# milliseconds even on a loaded host; anything slower is stray or hostile, and is cut off.
PRE_AUTH_SECONDS = 5.0
# Connections allowed to be authenticating at once on one listener; another evicts the oldest.
MAX_HANDSHAKES = 64
# After accept() fails for lack of file descriptors or memory, retry after this long.
ACCEPT_RETRY_SECONDS = 0.05
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
MAGIC = b"FERROAU1"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_CONTEXT_BYTES = 1024
ACCEPTED = b"\x01"
REFUSED = b"\x00"
# Sent instead of the challenge by a server that cannot take the connection (out of descriptors), followed by a
# u16 length and the reason, so that the client says why rather than "the connection closed".
REJECTED = b"FERROERR"
_GREETING_BYTES = len(MAGIC) + NONCE_BYTES + 2


class RefusalLog:
    """Keeps the latest refused connections and logs them without flooding.

    A fuzzer or a port scanner may knock thousands of times. The first refusal
    is logged at WARNING at once; after it, at most one line per ``interval``
    seconds, saying how many were refused since the last line.

    Args:
        logger: Where the lines go.
        where: What refused them, for the lines ("store on port 29500", "rank 3").
        keep: How many descriptions :attr:`latest` keeps.
        interval: Seconds between two WARNING lines.

    """

    def __init__(self, logger: logging.Logger, where: str, keep: int = 8, interval: float = 10.0) -> None:
        self._logger, self._where, self._keep, self._interval = logger, where, keep, interval
        self._lock = threading.Lock()
        self._latest: list[str] = []
        self._unlogged = 0
        self._last_logged = -float("inf")
        self.total = 0

    @property
    def latest(self) -> tuple[str, ...]:
        """The latest descriptions, oldest first."""
        with self._lock:
            return tuple(self._latest)

    def summary(self) -> str:
        """Return " (refused N connection(s) that failed authentication; the latest: ...)", or "" when none were."""
        latest = self.latest
        if not latest:
            return ""
        return f" (refused {self.total} connection(s) that failed authentication; the latest: {latest[-1]})"

    def note(self, description: str) -> None:
        """Record one refusal; log it, or count it towards the next line."""
        now = time.monotonic()
        with self._lock:
            self.total += 1
            self._latest = [*self._latest[-(self._keep - 1):], description]
            self._unlogged += 1
            if now - self._last_logged < self._interval:
                return
            count, self._unlogged, self._last_logged = self._unlogged, 0, now
        if count == 1:
            self._logger.warning("%s: refused a connection: %s", self._where, description)
        else:
            self._logger.warning("%s: refused %d connections since the last report; the latest: %s",
                                 self._where, count, description)


def shutdown_quietly(sock: socket.socket) -> None:
    """Shut both directions of ``sock`` down (waking a thread blocked on it); an error means it is gone already."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Admission:
    """Accepts connections on a listening socket and hands each to ``handle(sock, address)`` on a thread of its own.

    What hostile or broken clients cannot do to it: at most ``MAX_HANDSHAKES``
    connections are unsettled (still authenticating) at once, and another evicts
    the oldest, so idle connections cannot starve the real ones, whose handshakes
    take microseconds; ``accept()`` failing for lack of descriptors or memory
    pauses and retries instead of ending the loop (the connection waits in the
    kernel's backlog). ``handle`` calls :meth:`settled` once authentication is
    over, either way. Accepting begins at :meth:`start`, which the owner calls
    once it has stored this object, since ``handle`` reaches it through the owner.

    Args:
        listener: A bound, listening socket (closed by the owner, after :meth:`stop`).
        handle: Runs one connection, on its thread.
        refusals: Where failures to accept are noted.
        name: Names the threads.

    """

    def __init__(self, listener: socket.socket, handle: Callable[[socket.socket, tuple[str, int]], None],
                 refusals: RefusalLog, name: str) -> None:
        self._listener, self._handle, self._refusals, self._name = listener, handle, refusals, name
        self._lock = threading.Lock()
        self._unsettled: dict[socket.socket, None] = {}  # insertion-ordered: the oldest first
        self._stopped = False
        listener.settimeout(None)
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)

    def start(self) -> None:
        """Begin accepting connections (once ``handle`` can reach this object)."""
        self._thread.start()

    @property
    def unsettled(self) -> int:
        """Connections still authenticating."""
        with self._lock:
            return len(self._unsettled)

    def settled(self, sock: socket.socket) -> None:
        """Say that ``sock``'s authentication is over (it no longer counts against the limit)."""
        with self._lock:
            self._unsettled.pop(sock, None)

    def stop(self) -> None:
        """Stop accepting and cut short every connection still authenticating. Idempotent."""
        with self._lock:
            self._stopped = True
            unsettled, self._unsettled = list(self._unsettled), {}
        shutdown_quietly(self._listener)  # wakes the blocked accept() (EINVAL), so the thread ends now
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        for sock in unsettled:
            shutdown_quietly(sock)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except OSError as exc:
                if self._stopped or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # stopped or closed
                if exc.errno in _OUT_OF_RESOURCES:
                    self._refusals.note(f"cannot accept a connection: {exc.strerror}; retrying")
                    time.sleep(ACCEPT_RETRY_SECONDS)
                continue  # ECONNABORTED and the like: that client gave up
            with self._lock:
                if self._stopped:
                    sock.close()
                    return
                if len(self._unsettled) >= MAX_HANDSHAKES:
                    oldest = next(iter(self._unsettled))
                    del self._unsettled[oldest]
                    shutdown_quietly(oldest)  # its thread fails its read, and ends
                self._unsettled[sock] = None
            try:
                threading.Thread(target=self._handle, args=(sock, address), name=f"{self._name}-conn",
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had: drop this one, keep serving the others
                self.settled(sock)
                sock.close()
                self._refusals.note(f"no thread for {address[0]}:{address[1]}")


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes, context: bytes) -> bytes:
    return hmac.new(secret, role + b"\0" + first + second + context, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        try:
            chunk = sock.recv(n - len(chunks))
        except TimeoutError as exc:
            raise DistributedTimeoutError(f"authentication: timed out waiting for {what}") from exc
        except OSError as exc:
            raise PeerLostError(f"authentication: connection lost while waiting for {what}: {exc}") from exc
        if not chunk:
            raise PeerLostError(f"authentication: the other side closed the connection before sending {what}")
        chunks += chunk
    return bytes(chunks)


def _send_all(sock: socket.socket, data: bytes, what: str) -> None:
    try:
        sock.sendall(data)
    except TimeoutError as exc:
        raise DistributedTimeoutError(f"authentication: timed out sending {what}") from exc
    except OSError as exc:
        raise PeerLostError(f"authentication: connection lost while sending {what}: {exc}") from exc


def connect_handshake(sock: socket.socket, secret: bytes, context: bytes, timeout: float, peer: str) -> None:
    """Authenticate a connection we opened. Both sides must pass the same ``context``.

    Args:
        sock: A freshly connected socket; left in blocking mode afterwards.
        secret: The job secret.
        context: What the connection is for and who opens it (bound into the MACs).
        timeout: Seconds for the whole exchange.
        peer: Description of the other side for messages ("rank 0 at host:port").

    Raises:
        AuthenticationError: The other side does not hold the secret, or refused ours.
        DistributedTimeoutError, PeerLostError: The exchange did not complete.

    """
    if len(context) > MAX_CONTEXT_BYTES:
        raise ValueError("authentication context too long")
    sock.settimeout(timeout)
    try:
        client_nonce = os.urandom(NONCE_BYTES)
        _send_all(sock, MAGIC + client_nonce + struct.pack("<H", len(context)) + context, "the greeting")
        reply = _recv_exact(sock, len(REJECTED), f"the challenge from {peer}")
        if reply == REJECTED:
            (length,) = struct.unpack("<H", _recv_exact(sock, 2, f"the reason from {peer}"))
            reason = _recv_exact(sock, length, f"the reason from {peer}").decode(errors="replace")
            raise ConfigurationError(f"{peer} cannot take this connection: {reason}")
        reply += _recv_exact(sock, NONCE_BYTES + MAC_BYTES - len(REJECTED), f"the challenge from {peer}")
        server_nonce, server_mac = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        if not hmac.compare_digest(server_mac, _mac(secret, b"server", client_nonce, server_nonce, context)):
            raise AuthenticationError(
                f"{peer} does not hold this job's secret (FERRO_SECRET differs, or another job owns that "
                f"address); refusing to talk to it")
        _send_all(sock, _mac(secret, b"client", server_nonce, client_nonce, context), "the response")
        status = _recv_exact(sock, 1, f"the verdict from {peer}")
        if status != ACCEPTED:
            raise AuthenticationError(f"{peer} refused this process: the job secret (FERRO_SECRET) differs")
    finally:
        sock.settimeout(None)


def accept_handshake(sock: socket.socket, secret: bytes, timeout: float, peer: str) -> bytes:
    """Authenticate a connection we accepted and return the context the client sent.

    Raises:
        AuthenticationError: The client does not hold the secret (it was told so
            and the socket should be closed), or it did not speak ferro's protocol.
        DistributedTimeoutError, PeerLostError: The exchange did not complete.

    """
    sock.settimeout(timeout)
    try:
        greeting = _recv_exact(sock, len(MAGIC) + NONCE_BYTES + 2, f"the greeting from {peer}")
        if greeting[: len(MAGIC)] != MAGIC:
            raise AuthenticationError(f"{peer} does not speak ferro's handshake (it sent {greeting[:8]!r})")
        client_nonce = greeting[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
        (context_len,) = struct.unpack("<H", greeting[-2:])
        if context_len > MAX_CONTEXT_BYTES:
            raise AuthenticationError(f"{peer} sent an oversized handshake context ({context_len} bytes)")
        context = _recv_exact(sock, context_len, f"the context from {peer}")
        server_nonce = os.urandom(NONCE_BYTES)
        _send_all(sock, server_nonce + _mac(secret, b"server", client_nonce, server_nonce, context), "the challenge")
        try:
            client_mac = _recv_exact(sock, MAC_BYTES, f"the response from {peer}")
        except PeerLostError as exc:
            # A client without the secret hangs up once it sees our MAC is wrong for it.
            raise AuthenticationError(f"{peer} hung up during authentication: it does not hold the job secret") from exc
        if not hmac.compare_digest(client_mac, _mac(secret, b"client", server_nonce, client_nonce, context)):
            _send_all(sock, REFUSED, "the verdict")
            raise AuthenticationError(f"refused {peer}: it does not hold the job secret (FERRO_SECRET differs)")
        _send_all(sock, ACCEPTED, "the verdict")
        return context
    finally:
        sock.settimeout(None)


def rejection(reason: str) -> bytes:
    """Return what a server sends instead of its challenge when it cannot take a connection (:data:`REJECTED`)."""
    text = reason.encode()[:MAX_CONTEXT_BYTES]
    return REJECTED + struct.pack("<H", len(text)) + text


class HandshakeAcceptor:
    """The accepting side of :func:`accept_handshake`, fed bytes as they arrive: for an event loop.

    Call :meth:`feed` with the connection's input buffer whenever bytes arrive; it
    consumes what it uses and returns what to send. :attr:`outcome` becomes
    ``"accepted"`` (then :attr:`context` is what the client sent) or ``"refused"``
    (send the returned bytes, then close).

    Raises:
        AuthenticationError: From :meth:`feed`: the client does not speak ferro's handshake.

    """

    def __init__(self, secret: bytes, peer: str) -> None:
        self._secret, self._peer = secret, peer
        self._stage = 0
        self._client_nonce = self._server_nonce = b""
        self._context_len = 0
        self.context = b""
        self.outcome: str | None = None

    @property
    def challenged(self) -> bool:
        """Whether the challenge went out and the client's answer is awaited (a hang-up now means no secret)."""
        return self._stage == 2

    def feed(self, buf: bytearray) -> bytes:
        """Consume what the handshake needs from ``buf``; return the bytes to send (maybe none)."""
        if self._stage == 0:
            if len(buf) < _GREETING_BYTES:
                return b""
            greeting = bytes(buf[:_GREETING_BYTES])
            del buf[:_GREETING_BYTES]
            if greeting[: len(MAGIC)] != MAGIC:
                raise AuthenticationError(f"{self._peer} does not speak ferro's handshake (it sent {greeting[:8]!r})")
            self._client_nonce = greeting[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
            (self._context_len,) = struct.unpack("<H", greeting[-2:])
            if self._context_len > MAX_CONTEXT_BYTES:
                raise AuthenticationError(
                    f"{self._peer} sent an oversized handshake context ({self._context_len} bytes)")
            self._stage = 1
        if self._stage == 1:
            if len(buf) < self._context_len:
                return b""
            self.context = bytes(buf[: self._context_len])
            del buf[: self._context_len]
            self._server_nonce = os.urandom(NONCE_BYTES)
            self._stage = 2
            return self._server_nonce + _mac(self._secret, b"server", self._client_nonce, self._server_nonce,
                                             self.context)
        if self._stage == 2 and len(buf) >= MAC_BYTES:
            client_mac = bytes(buf[:MAC_BYTES])
            del buf[:MAC_BYTES]
            self._stage = 3
            expected = _mac(self._secret, b"client", self._server_nonce, self._client_nonce, self.context)
            self.outcome = "accepted" if hmac.compare_digest(client_mac, expected) else "refused"
            return ACCEPTED if self.outcome == "accepted" else REFUSED
        return b""
