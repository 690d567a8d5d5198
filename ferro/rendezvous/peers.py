"""One rank's connections to its group's peers, made the first time an algorithm needs each.

A full mesh costs N-1 sockets per rank and N(N-1)/2 handshakes at start, for
collectives that talk to about 2 log2(N) peers (ring neighbours, tree parents
and children, recursive-doubling partners). Here a rank joins by publishing
its listen address and counting itself in: four store requests, whatever N
(see :meth:`PeerConnector.join`). A connection is made when a collective or a
p2p call first needs it: the higher rank dials, the lower one's listener
accepts in the background, so both ends may ask at once, in any order, without
deadlock. Each connection is authenticated with the job secret, as everywhere.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable

from ferro._core.status import abort_error
from ferro.errors import (
    ConfigurationError,
    DistributedError,
    DistributedTimeoutError,
    InvalidWorldSizeError,
    PeerLostError,
    StoreKeyTimeoutError,
)
from ferro.rendezvous.auth import PRE_AUTH_SECONDS, Admission, RefusalLog
from ferro.rendezvous.connect import KeyValueStore, _accept_peer, _connect_peer, _mesh_context, _tune, time_left
from ferro.rendezvous.scoped import present_or_values

__all__ = ["PeerConnector"]

log = logging.getLogger("ferro.rendezvous")

# How often a rank waiting for a higher peer to connect knocks on that peer's listener (and reads the store for
# its abort notice) to see that it still lives: from this, doubling up to the longest.
PROBE_SECONDS = 0.5
LONGEST_PROBE_SECONDS = 8.0
# How long a timed-out rendezvous gives the store to say which ranks never published their address.
MISSING_QUERY_SECONDS = 1.0


class PeerConnector:
    """Listens for this rank's higher peers and dials its lower ones, on demand.

    Args:
        store: The group's store.
        rank: This rank in the group.
        world_size: The group's size.
        prefix: The group's store prefix (unique per group and generation).
        secret: The job secret.
        bind_addr: Where to listen.
        deadline: Monotonic deadline of the set-up (publishing the address).

    Raises:
        ConfigurationError: ``bind_addr`` cannot be listened on.

    """

    def __init__(self, store: KeyValueStore, rank: int, world_size: int, *, prefix: str, secret: bytes,
                 bind_addr: str, deadline: float) -> None:
        self._store, self._rank, self._world_size = store, rank, world_size
        self._prefix, self._secret = prefix, secret
        self._cond = threading.Condition()
        self._accepted: dict[int, socket.socket] = {}
        self._expected = set(range(rank + 1, world_size))
        self._failure: BaseException | None = None
        self._closed = False
        self._addresses: dict[int, tuple[str, int]] = {}
        self._probes: dict[int, tuple[float, float]] = {}  # peer -> (last knock, interval before the next)
        self._cut: set[int] = set()  # peers given up on before they connected
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.bind((bind_addr, 0))
        except OSError as exc:
            self._listener.close()
            raise ConfigurationError(f"rank {rank}: cannot listen on {bind_addr}: {exc.strerror}") from exc
        self._listener.listen(128)
        self.refusals = RefusalLog(log, f"rank {rank}")
        self._admission = Admission(self._listener, self._authenticate, self.refusals, f"ferro-peers-accept-{rank}")
        self._admission.start()
        host, port = self._listener.getsockname()[:2]
        try:
            store.set(f"{prefix}/addr/{rank}", f"{host}:{port}",
                      timeout=time_left(deadline, rank, "publishing this rank's address"))
        except BaseException:
            self.close()
            raise

    def join(self, deadline: float, prefetch: Iterable[int] = (), settings: str = "") -> None:
        """Return once every rank of the group has published its address: a counter and one flag in the store.

        Rank 0 publishes the world size and ``settings`` (what decides the
        collectives' plans), which every other rank checks against its own in the
        same read. The addresses of ``prefetch`` (the lower peers the first
        collective will dial) are read in the same breath, in one request.

        Raises:
            DistributedTimeoutError: Naming the ranks that never published their address.
            InvalidWorldSizeError: Rank 0 was started with another world size.
            ConfigurationError: Rank 0's ``settings`` differ from this rank's.

        """
        store, rank, prefix = self._store, self._rank, self._prefix
        mine = f"{self._world_size}|{settings}"
        if rank == 0:
            store.set(f"{prefix}/size", mine, timeout=time_left(deadline, rank, "publishing the size"))
        else:
            theirs = store.get(f"{prefix}/size", timeout=time_left(deadline, rank, "waiting for rank 0")).decode()
            size, _, their_settings = theirs.partition("|")
            if size != str(self._world_size):
                raise InvalidWorldSizeError(
                    f"rank {rank}: rank 0 was started with world_size={size}, this rank with {self._world_size}")
            if their_settings != settings:
                raise ConfigurationError(
                    f"rank {rank}: its collectives would choose their plans otherwise than rank 0's, and ranks that "
                    f"run different plans wait on each other: rank 0 has {their_settings}, this rank {settings}; "
                    f"give every rank the same FERRO_COST_MODEL and forced plans (FERRO_ALGORITHM_BROADCAST and "
                    f"the like)")
        if store.add(f"{prefix}/joined", 1, timeout=time_left(deadline, rank, "counting in")) == self._world_size:
            store.set(f"{prefix}/all-joined", "1", timeout=time_left(deadline, rank, "saying all joined"))
        seconds = time_left(deadline, rank, "waiting for every rank to publish its address")
        try:
            store.wait([f"{prefix}/all-joined"], timeout=seconds)
        except StoreKeyTimeoutError:
            missing = self._missing()
            raise DistributedTimeoutError(
                f"rank {rank}: rendezvous timed out: rank(s) {missing} did not publish their address within "
                f"{seconds:.3g} s: they were never started (check WORLD_SIZE and the launcher), or died or froze "
                f"during rendezvous") from None
        lower = sorted(p for p in prefetch if p < rank and p not in self._addresses)
        if lower:
            keys = [f"{prefix}/addr/{p}" for p in lower]
            seconds = time_left(deadline, rank, "reading the peers' addresses")
            many = getattr(store, "multi_get", None)  # ferro's store; a file or torch's store reads one by one
            values = many(keys, timeout=seconds) if many else [store.get(key, timeout=seconds) for key in keys]
            for peer, value in zip(lower, values, strict=True):
                self._addresses[peer] = _address(value)

    def _missing(self) -> list[int]:
        """Return the ranks whose address is not in the store, asked without waiting for them.

        One ``present`` request (key by key on a store without it), given a second to answer: a wait of a few
        milliseconds for the keys, as this was, timed out in the client on a loaded machine before the store's
        answer came, and the timeout then named no rank at all.
        """
        keys = [f"{self._prefix}/addr/{r}" for r in range(self._world_size)]
        try:
            there = present_or_values(self._store, "present", keys, MISSING_QUERY_SECONDS)
        except Exception:  # the store is gone: say what we can
            return []
        return [r for r, found in enumerate(there) if not found]

    def connect(self, peer: int, timeout: float) -> socket.socket:
        """Return a new authenticated connection to ``peer``: dialled (a lower rank) or accepted (a higher one).

        Raises:
            DistributedTimeoutError: The peer did not connect within ``timeout`` seconds (named).
            AuthenticationError: The peer does not hold the job secret.
            InvalidWorldSizeError: A peer was started with another world size.

        """
        deadline = time.monotonic() + timeout
        if peer < self._rank:
            host, port = self._address(peer, deadline)
            context = _mesh_context(self._prefix, self._world_size, self._rank, peer)
            try:
                sock = _connect_peer(host, port, self._secret, context, deadline, self._rank, peer, listened=True)
            except PeerLostError as exc:
                posted = self.posted_abort(peer)
                if posted is not None:
                    raise posted from exc
                raise
        else:
            sock = self._take_accepted(peer, deadline, timeout)
        _tune(sock)
        return sock

    def cut(self, peer: int) -> None:
        """Give up on ``peer`` before it connected: a wait for it raises ``PeerLostError`` now (from any thread)."""
        with self._cond:
            self._cut.add(peer)
            self._cond.notify_all()

    def waiting_peers(self) -> list[int]:
        """Return the higher peers whose connections were accepted and wait to be taken."""
        with self._cond:
            return sorted(self._accepted)

    def _address(self, peer: int, deadline: float) -> tuple[str, int]:
        if peer not in self._addresses:
            value = self._store.get(f"{self._prefix}/addr/{peer}",
                                    timeout=time_left(deadline, self._rank, f"reading rank {peer}'s address"))
            self._addresses[peer] = _address(value)
        return self._addresses[peer]

    def _take_accepted(self, peer: int, deadline: float, timeout: float) -> socket.socket:
        with self._cond:
            self._probes.setdefault(peer, (time.monotonic(), PROBE_SECONDS / 2))  # first knock after 0.25 s
            while peer not in self._accepted:
                if self._failure is not None:
                    raise self._failure
                if peer in self._cut:
                    raise PeerLostError(f"rank {self._rank}: rank {peer} was cut off before it connected (recorded "
                                        f"dead)", peer)
                remaining = deadline - time.monotonic()
                last, interval = self._probes.get(peer, (0.0, 0.0))
                if last + interval <= time.monotonic():
                    self._cond.release()  # probing takes a moment: the acceptor may deliver meanwhile
                    try:
                        self.check_alive(peer)
                    finally:
                        self._cond.acquire()
                    continue
                if remaining <= 0 or self._closed:
                    raise DistributedTimeoutError(
                        f"rank {self._rank}: rank {peer} did not connect within {timeout:.3g} s (it has not reached "
                        f"this call, or died or froze){self.refusals.summary()}")
                self._cond.wait(min(remaining, PROBE_SECONDS))
            return self._accepted.pop(peer)

    def check_alive(self, peer: int) -> None:
        """Knock on ``peer``'s listener (at most every ``PROBE_SECONDS``): a refusal means it exited.

        A peer that never connected shows no broken socket when it dies; its
        closed listener does. A knock that is answered, or not answered in time
        (a slow host), says nothing and is left at that.

        Raises:
            PeerLostError: Naming the peer, when its listener refuses the connection.

        """
        now = time.monotonic()
        last, interval = self._probes.get(peer, (0.0, PROBE_SECONDS / 2))
        if last + interval > now:
            return
        interval = min(interval * 2, LONGEST_PROBE_SECONDS)  # few knocks (and store requests) on a long wait
        self._probes[peer] = (now, interval)
        posted = self.posted_abort(peer)
        if posted is not None:
            raise posted
        try:
            host, port = self._address(peer, now + PROBE_SECONDS)
            socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
        except ConnectionRefusedError:
            if self._arrived(peer):
                return  # it connected, then closed its listener: what it sent waits in the accepted connection
            posted = self.posted_abort(peer)  # it may have said why just before it exited
            if posted is not None:
                raise posted from None
            raise PeerLostError(f"rank {self._rank}: rank {peer} is gone: its listener at {host}:{port} refuses "
                                f"connections (it exited before connecting to this rank)", peer) from None
        except (OSError, DistributedError):
            pass

    def _arrived(self, peer: int) -> bool:
        """Whether ``peer``'s connection was accepted, once the handshakes in progress settled (5 s at most)."""
        deadline = time.monotonic() + PRE_AUTH_SECONDS
        while self._admission.unsettled and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._cond:
            return peer in self._accepted

    def post_abort(self, payload: bytes) -> None:
        """Leave this rank's abort notice in the store, for peers it never connected to (quietly; 1 s at most)."""
        try:
            self._store.set(f"{self._prefix}/abort/{self._rank}", payload, timeout=1.0)
        except DistributedError:
            pass  # the store is gone: those peers learn by their own probe or timeout

    def posted_abort(self, peer: int) -> Exception | None:
        """Return the error that ``peer``'s abort notice in the store stands for, if it left one."""
        key = f"{self._prefix}/abort/{peer}"
        try:
            check = getattr(self._store, "check", None)
            if check is not None and not check([key], timeout=1.0):
                return None
            payload = self._store.get(key, timeout=1.0 if check is not None else 0.05)
        except DistributedError:
            return None
        return abort_error(bytes(payload), peer, f"rank {self._rank}: waiting for rank {peer} to connect")

    def _authenticate(self, sock: socket.socket, address: tuple[str, int]) -> None:
        try:
            with self._cond:
                expected = set(self._expected)
            src = _accept_peer(sock, address, self._secret, self._prefix, self._world_size, self._rank, expected,
                               self.refusals)
        except BaseException as exc:  # a peer with another world size: the waiting call raises it
            sock.close()
            with self._cond:
                self._failure = exc
                self._cond.notify_all()
            return
        finally:
            self._admission.settled(sock)
        if src is None:
            return
        with self._cond:
            keep = not self._closed and src in self._expected
            self._expected.discard(src)
            if keep:
                self._accepted[src] = sock
                self._cond.notify_all()
                return
        self.refusals.note(f"{address[0]}:{address[1]}: a second connection claiming rank {src}")
        sock.close()

    def close(self) -> None:
        """Stop listening; close connections accepted but never taken. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            leftover, self._accepted = list(self._accepted.values()), {}
            self._cond.notify_all()
        self._admission.stop()
        self._listener.close()
        for sock in leftover:
            sock.close()


def _address(value: bytes) -> tuple[str, int]:
    host, port = value.decode().rsplit(":", 1)
    return host, int(port)
