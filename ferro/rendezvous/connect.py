"""How ranks connect: one dial-with-backoff loop, and the authenticated TCP full mesh built through the store.

A full mesh is built through the :class:`~ferro.rendezvous.store.Store`: every
rank listens on the interface that faces the master, publishes its address,
connects to every lower rank and accepts every higher one. Each connection is
authenticated with the job secret before it carries a frame.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING

from ferro.errors import (
    AuthenticationError,
    ConfigurationError,
    DistributedError,
    DistributedTimeoutError,
    InvalidWorldSizeError,
    PeerLostError,
)
from ferro.rendezvous.auth import accept_handshake, connect_handshake
from ferro.rendezvous.settings import BIND_ADDR_ENV

if TYPE_CHECKING:
    from ferro.rendezvous.store import Store

__all__ = ["HANDSHAKE_TIMEOUT", "build_mesh", "dial", "local_address_towards"]

log = logging.getLogger("ferro.rendezvous")

# A stray connection may stall the accept loop this long at most.
HANDSHAKE_TIMEOUT = 10.0
# Backoff between dialling attempts: from the first delay, doubling, up to the last.
_FIRST_DELAY, _LONGEST_DELAY = 0.01, 0.5


def dial(host: str, port: int, deadline: float, timed_out: str) -> socket.socket:
    """Connect to ``host:port``, retrying with exponential backoff until ``deadline`` (monotonic seconds).

    The listener may not be up yet (ranks start in any order), so a refused or
    unreachable address is retried rather than reported.

    Raises:
        DistributedTimeoutError: ``timed_out`` plus the last error, once the deadline passes.

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
    store: Store,
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
    that waits on it. A connection that fails authentication is refused and
    logged, and the accept loop keeps waiting for the real peer.

    Raises:
        DistributedTimeoutError: Some peers did not connect in time (named).
        AuthenticationError: A peer we connected to does not hold the secret.
        InvalidWorldSizeError: A peer was started with another world size.

    """
    deadline = time.monotonic() + timeout
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    peers: dict[int, socket.socket] = {}
    refused: list[str] = []
    try:
        try:
            listener.bind((bind_addr, 0))
        except OSError as exc:
            raise ConfigurationError(f"rank {rank}: cannot listen on {bind_addr}: {exc.strerror}") from exc
        listener.listen(max(world_size, 8))
        host, port = listener.getsockname()[:2]
        store.set(f"{prefix}/addr/{rank}", f"{host}:{port}")
        lower = [f"{prefix}/addr/{j}" for j in range(rank)]
        if lower:
            store.wait(lower, timeout=_remaining(deadline, rank, "waiting for the lower ranks' addresses"))
        # Read every address before the first connection: once connected to rank 0 this rank must
        # not need the store any more, since rank 0 may then finish and close it.
        addresses = [store.get(key, timeout=1.0).decode().rsplit(":", 1) for key in lower]
        for j, (peer_host, peer_port) in enumerate(addresses):
            peers[j] = _connect_peer(
                peer_host, int(peer_port), secret, _mesh_context(prefix, world_size, rank, j), deadline, rank, j)
        expected = set(range(rank + 1, world_size))
        while expected:
            listener.settimeout(_remaining(deadline, rank, _waiting_text(expected, refused)))
            try:
                sock, address = listener.accept()
            except TimeoutError:
                continue  # _remaining raises on the next turn
            src = _accept_peer(sock, address, secret, prefix, world_size, rank, expected, refused)
            if src is not None:
                peers[src] = sock
                expected.discard(src)
    except BaseException:
        for sock in peers.values():
            sock.close()
        raise
    finally:
        listener.close()
    for sock in peers.values():
        _tune(sock)
    return peers


def _waiting_text(expected: set[int], refused: list[str]) -> str:
    text = f"waiting for ranks {sorted(expected)} to connect"
    if refused:
        text += f" (refused {len(refused)} connection(s) without the job secret: {'; '.join(refused[:3])})"
    return text


def _remaining(deadline: float, rank: int, doing: str) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DistributedTimeoutError(f"rank {rank}: rendezvous timed out {doing}")
    return remaining


def _connect_peer(host: str, port: int, secret: bytes, context: bytes, deadline: float, rank: int,
                  peer: int) -> socket.socket:
    where = f"rank {peer} at {host}:{port}"
    sock = dial(host, port, deadline, f"rank {rank}: rendezvous timed out connecting to {where}")
    try:
        seconds = min(HANDSHAKE_TIMEOUT, _remaining(deadline, rank, f"authenticating with {where}"))
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
                 rank: int, expected: set[int], refused: list[str]) -> int | None:
    where = f"{address[0]}:{address[1]}"
    try:
        context = accept_handshake(sock, secret, HANDSHAKE_TIMEOUT, f"the process at {where}")
        kind, their_prefix, their_size, link = context.decode().split("|")
        src_text, dst_text = link.split("->")
        src, dst = int(src_text), int(dst_text)
    except (DistributedError, ValueError, UnicodeDecodeError) as exc:
        log.warning("rank %d: refused a connection from %s: %s", rank, where, exc)
        refused.append(f"{where}: {exc}")
        sock.close()
        return None
    if int(their_size) != world_size and their_prefix == prefix:
        sock.close()
        raise InvalidWorldSizeError(
            f"rank {rank}: rank {src} was started with world_size={their_size}, this rank with {world_size}")
    if kind != "mesh" or their_prefix != prefix or dst != rank or src not in expected:
        log.warning("rank %d: refused a connection from %s meant for %s", rank, where, context.decode())
        refused.append(f"{where}: meant for {context.decode()}")
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
