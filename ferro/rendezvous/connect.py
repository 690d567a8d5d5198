"""How ranks connect: one dial-with-backoff loop, and the authenticated TCP full mesh built through the store.

A full mesh is built through the :class:`~ferro.rendezvous.store.Store`: every
rank listens on the interface that faces the master, publishes its address,
connects to every lower rank and accepts every higher one. Each connection is
authenticated with the job secret before it carries a frame.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from ferro.errors import (
    AuthenticationError,
    ConfigurationError,
    DistributedError,
    DistributedTimeoutError,
    InvalidWorldSizeError,
    PeerLostError,
    StoreKeyTimeoutError,
)
from ferro.rendezvous.auth import (
    PRE_AUTH_SECONDS,
    Admission,
    RefusalLog,
    accept_handshake,
    connect_handshake,
)
from ferro.rendezvous.settings import BIND_ADDR_ENV

__all__ = ["HANDSHAKE_TIMEOUT", "KeyValueStore", "build_mesh", "claim_rank", "dial", "local_address_towards",
           "release_rank", "time_left", "wait_before_closing", "wait_for_ranks"]

log = logging.getLogger("ferro.rendezvous")

# How long this rank's own handshake with a peer it dialled may take.
HANDSHAKE_TIMEOUT = 10.0
# Backoff between dialling attempts: from the first delay, doubling, up to the last.
_FIRST_DELAY, _LONGEST_DELAY = 0.01, 0.5


class KeyValueStore(Protocol):
    """What connecting ranks need of a store: :class:`~ferro.rendezvous.store.Store` and ``FileStore`` have it.

    Taken as a protocol so that this module, which the store itself uses to dial,
    never imports the store.
    """

    def set(self, key: str, value: bytes | str, timeout: float | None = None) -> None:
        """Set ``key`` to ``value``."""

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return ``key``'s value, waiting until it is set."""

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key is set; raise :class:`~ferro.errors.StoreKeyTimeoutError` naming the others."""

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str, timeout: float | None = None) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return the value it holds after."""

    def add(self, key: str, amount: int, timeout: float | None = None) -> int:
        """Add ``amount`` to the integer at ``key`` and return the new value."""


def dial(host: str, port: int, deadline: float, timed_out: str, *, gone: tuple[str, int] | None = None
         ) -> socket.socket:
    """Connect to ``host:port``, retrying with exponential backoff until ``deadline`` (monotonic seconds).

    The listener may not be up yet (ranks start in any order), so a refused or
    unreachable address is retried rather than reported; unless ``gone`` is given
    (a listener known to have been up, whose refusal means its process exited).

    Raises:
        DistributedTimeoutError: ``timed_out`` plus the last error, once the deadline passes.
        PeerLostError: ``gone``'s message and rank, when the address refuses the connection.

    """
    delay = _FIRST_DELAY
    last_error: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistributedTimeoutError(f"{timed_out} (last attempt: {last_error})")
        try:
            return socket.create_connection((host, port), timeout=min(remaining, 5.0))
        except OSError as exc:
            if gone is not None and isinstance(exc, ConnectionRefusedError):
                raise PeerLostError(gone[0], gone[1]) from exc
            last_error = exc
            log.debug("connecting to %s:%d failed (%s); retrying", host, port, exc)
            time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
            delay = min(delay * 2, _LONGEST_DELAY)


def local_address_towards(master_addr: str) -> str:
    """Return this host's address on the interface that routes to ``master_addr``.

    A connected UDP socket asks the kernel for the route without sending anything.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr, 9))
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ConfigurationError(
            f"cannot find a route from this host to MASTER_ADDR={master_addr!r} ({exc.strerror}); "
            f"set {BIND_ADDR_ENV} to the address this rank should listen on") from exc


def _mesh_context(prefix: str, world_size: int, src: int, dst: int) -> bytes:
    return f"mesh|{prefix}|{world_size}|{src}->{dst}".encode()


def build_mesh(
    store: KeyValueStore,
    rank: int,
    world_size: int,
    *,
    prefix: str,
    secret: bytes,
    bind_addr: str,
    timeout: float,
) -> dict[int, socket.socket]:
    """Connect this rank to every other rank of a group; return the sockets by peer rank.

    Every member calls this with the same ``prefix`` (unique per group and
    generation). Rank ``i`` connects to ranks ``< i`` and accepts ranks ``> i``;
    the order makes progress from rank 0 upward, so no rank waits on a rank
    that waits on it. Incoming connections authenticate concurrently, each
    within a short pre-authentication limit, so an idle or hostile connection
    delays no real peer; one that fails is refused and logged (rate-limited),
    and the rank keeps waiting for the real peer. Everything, store requests
    included, happens within ``timeout`` seconds.

    Raises:
        DistributedTimeoutError: Some peers did not connect in time (named).
        AuthenticationError: A peer we connected to does not hold the secret.
        InvalidWorldSizeError: A peer was started with another world size.

    """
    deadline = time.monotonic() + timeout
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    peers: dict[int, socket.socket] = {}
    acceptor: _Acceptor | None = None
    try:
        try:
            listener.bind((bind_addr, 0))
        except OSError as exc:
            raise ConfigurationError(f"rank {rank}: cannot listen on {bind_addr}: {exc.strerror}") from exc
        listener.listen(max(world_size, 128))
        host, port = listener.getsockname()[:2]
        expected = set(range(rank + 1, world_size))
        if expected:  # accept (and authenticate) from now on, while this rank dials the lower ones
            acceptor = _Acceptor(listener, secret, prefix, world_size, rank, expected)
        store.set(f"{prefix}/addr/{rank}", f"{host}:{port}",
                  timeout=time_left(deadline, rank, "publishing this rank's address"))
        lower = {j: f"{prefix}/addr/{j}" for j in range(rank)}
        wait_for_ranks(store, lower, deadline, rank, "publish their address")
        # Read every address before the first connection: once connected to rank 0 this rank must
        # not need the store any more, since rank 0 may then finish and close it.
        addresses = [store.get(key, timeout=time_left(deadline, rank, "reading the lower ranks' addresses"))
                     .decode().rsplit(":", 1) for key in lower.values()]
        for j, (peer_host, peer_port) in enumerate(addresses):
            peers[j] = _connect_peer(
                peer_host, int(peer_port), secret, _mesh_context(prefix, world_size, rank, j), deadline, rank, j)
        if acceptor is not None:
            peers.update(acceptor.collect(deadline))
    except BaseException:
        for sock in peers.values():
            sock.close()
        raise
    finally:
        if acceptor is not None:
            acceptor.stop()
        listener.close()
    for sock in peers.values():
        _tune(sock)
    return peers


def claim_rank(store: KeyValueStore, namespace: str, rank: int, timeout: float) -> str:
    """Mark ``rank`` as this process's in the store for the life of a group; return the key for :func:`release_rank`.

    Two processes given the same rank would otherwise each wait for a group that
    never forms and report a timeout; the second is told at once, whether the
    first is still joining or already in its group. One process may hold several
    groups as the same rank.

    Raises:
        ConfigurationError: Another process holds ``rank``.

    """
    key = f"ferro/{namespace}-member/{rank}"
    me = _process_identity()
    holder = store.compare_set(key, "", me, timeout=timeout).decode(errors="replace")
    if holder != me:
        raise ConfigurationError(
            f"rank {rank} joined twice: process {holder} (host/pid) already joined this job as rank {rank}; give "
            f"every process its own RANK (check the launcher's --nproc-per-node, --nnodes and --node-rank). (If that "
            f"process was killed without closing its group and this store outlived it, use a fresh store.)")
    return key


def release_rank(store: KeyValueStore, key: str) -> None:
    """Give back a mark of :func:`claim_rank` (quietly: the store may be gone with the job)."""
    try:
        store.compare_set(key, _process_identity(), "", timeout=1.0)
    except DistributedError:
        pass  # the store is gone or frozen: nobody will join through it again


def _process_identity() -> str:
    return f"{socket.gethostname()}/{os.getpid()}"


def wait_for_ranks(store: KeyValueStore, keys: dict[int, str], deadline: float, rank: int, doing: str) -> None:
    """Wait until every rank in ``keys`` has set its key; a timeout names the ranks that did not.

    Raises:
        DistributedTimeoutError: "rank 3: ranks [1, 2] did not publish their address within 60 s ...".

    """
    if not keys:
        return

    seconds = time_left(deadline, rank, f"waiting for ranks {sorted(keys)} to {doing}")
    try:
        store.wait(list(keys.values()), timeout=seconds)
    except StoreKeyTimeoutError as exc:
        missing = sorted(r for r, key in keys.items() if key in exc.missing)
        raise DistributedTimeoutError(
            f"rank {rank}: rendezvous timed out: rank(s) {missing} did not {doing} within {seconds:.3g} s: they were "
            f"never started (check WORLD_SIZE and the launcher), or died or froze during rendezvous") from None


def wait_before_closing(store: Any, keys: list[str], seconds: float) -> None:
    """On the rank serving ``store``, wait up to ``seconds`` until ``keys`` (the marks of ranks done with it) are set.

    Closing the store under a rank still using it turns that rank's own outcome
    (a refusal every rank reaches, a clean join) into "the store closed the
    connection". Quiet, and bounded: a rank that died leaves its mark unset, and
    the wait just ends. A store this rank does not serve outlives it anyway.
    """
    if getattr(store, "server", None) is None or not keys:  # a FileStore, or another rank's server
        return
    try:
        store.wait(keys, timeout=seconds)
    except DistributedError:
        pass


class _Acceptor:
    """Accepts and authenticates incoming mesh connections concurrently, through an :class:`Admission`.

    Each connection has PRE_AUTH_SECONDS to authenticate: one that sends nothing
    holds its own thread until then, never the real peers behind it.
    """

    def __init__(self, listener: socket.socket, secret: bytes, prefix: str, world_size: int, rank: int,
                 expected: set[int]) -> None:
        self._secret, self._prefix = secret, prefix
        self._world_size, self._rank = world_size, rank
        self._expected = set(expected)  # shrinks as peers authenticate (a second claim to a rank is refused)
        self._wanted = frozenset(expected)
        self._results: queue.Queue[tuple[int, socket.socket] | BaseException] = queue.Queue()
        self._lock = threading.Lock()
        self._stopped = False
        self.refusals = RefusalLog(log, f"rank {rank}")
        self._admission = Admission(listener, self._authenticate, self.refusals, f"ferro-mesh-accept-{rank}")
        self._admission.start()

    def _authenticate(self, sock: socket.socket, address: tuple[str, int]) -> None:
        try:
            src = _accept_peer(sock, address, self._secret, self._prefix, self._world_size, self._rank,
                               self._expected, self.refusals)
        except BaseException as exc:  # handed to the rank's thread, which raises it
            sock.close()
            self._results.put(exc)
            return
        finally:
            self._admission.settled(sock)
        if src is not None:
            with self._lock:
                keep = not self._stopped and src in self._expected
                self._expected.discard(src)
            if keep:
                self._results.put((src, sock))
                return
            self.refusals.note(f"{address[0]}:{address[1]}: a second connection claiming rank {src}")
            sock.close()

    def collect(self, deadline: float) -> dict[int, socket.socket]:
        """Return the authenticated peers once all expected ranks connected."""
        peers: dict[int, socket.socket] = {}
        want = set(self._wanted)  # not _expected: peers that authenticated already are waiting in the queue
        try:
            while want:
                waiting = (f"waiting for rank(s) {sorted(want)} to connect (never started, or died or froze during "
                           f"rendezvous?){self.refusals.summary()}")
                try:
                    item = self._results.get(timeout=time_left(deadline, self._rank, waiting))
                except queue.Empty:
                    continue  # _remaining raises on the next turn
                if isinstance(item, BaseException):
                    raise item
                src, sock = item
                peers[src] = sock
                want.discard(src)
        except BaseException:
            for sock in peers.values():
                sock.close()
            raise
        return peers

    def stop(self) -> None:
        """Stop accepting; drop connections still authenticating and results nobody took."""
        with self._lock:
            self._stopped = True
        self._admission.stop()
        while True:
            try:
                item = self._results.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, BaseException):
                item[1].close()


def time_left(deadline: float, rank: int, doing: str) -> float:
    """Return the seconds left until ``deadline`` (monotonic) for the next step of a set-up.

    Raises:
        DistributedTimeoutError: "rank 3: rendezvous timed out <doing>", once none are left.

    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DistributedTimeoutError(f"rank {rank}: rendezvous timed out {doing}")
    return remaining


def _connect_peer(host: str, port: int, secret: bytes, context: bytes, deadline: float, rank: int,
                  peer: int, listened: bool = False) -> socket.socket:
    """Dial ``peer`` and authenticate; with ``listened`` its listener was up, and a refusal means it exited."""
    where = f"rank {peer} at {host}:{port}"
    gone = (f"rank {rank}: {where} refuses connections: its listener is closed (it exited)", peer) if listened else None
    sock = dial(host, port, deadline, f"rank {rank}: rendezvous timed out connecting to {where}", gone=gone)
    try:
        seconds = min(HANDSHAKE_TIMEOUT, time_left(deadline, rank, f"authenticating with {where}"))
        connect_handshake(sock, secret, context, seconds, where)
    except AuthenticationError as exc:
        sock.close()
        raise AuthenticationError(f"rank {rank}: {exc}") from None
    except PeerLostError as exc:
        sock.close()
        raise PeerLostError(
            f"rank {rank}: {where} dropped the connection during authentication: it refused this rank "
            f"(another job's secret or world size?) or exited ({exc})", peer) from None
    except BaseException:
        sock.close()
        raise
    return sock


def _accept_peer(sock: socket.socket, address: tuple[str, int], secret: bytes, prefix: str, world_size: int,
                 rank: int, expected: set[int], refusals: RefusalLog) -> int | None:
    where = f"{address[0]}:{address[1]}"
    try:
        sock.settimeout(PRE_AUTH_SECONDS)
        if not sock.recv(1, socket.MSG_PEEK):  # closed before a word: a peer checking that this rank lives
            sock.close()
            return None
        context = accept_handshake(sock, secret, PRE_AUTH_SECONDS, f"the process at {where}")
        kind, their_prefix, their_size, link = context.decode().split("|")
        src_text, dst_text = link.split("->")
        src, dst = int(src_text), int(dst_text)
    except (DistributedError, OSError, ValueError, UnicodeDecodeError) as exc:
        refusals.note(f"{where}: {exc}")
        sock.close()
        return None
    if their_prefix == prefix and their_size != str(world_size):
        sock.close()
        raise InvalidWorldSizeError(
            f"rank {rank}: rank {src} was started with world_size={their_size}, this rank with {world_size}")
    if kind != "mesh" or their_prefix != prefix or dst != rank or src not in expected:
        refusals.note(f"{where}: meant for {context.decode()}")
        sock.close()
        return None
    return src


def _tune(sock: socket.socket) -> None:
    # Small frames must leave at once; collectives are latency-bound at small sizes.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Keepalive notices a peer host that vanished without closing (cable, power),
    # which no FIN or RST would ever report.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
