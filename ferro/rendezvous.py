"""Rendezvous: where a job's settings come from, and how ranks find and connect to each other.

Settings come from explicit arguments first, then from the torchrun-style
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and
``FERRO_SECRET``. A full mesh is built through the :class:`~ferro.store.Store`:
every rank listens on the interface that faces the master, publishes its
address, connects to every lower rank and accepts every higher one. Each
connection is authenticated with the job secret before it carries a frame.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ferro.auth import accept_handshake, connect_handshake, secret_from_env
from ferro.errors import (
    AuthenticationError,
    ConfigurationError,
    DistributedError,
    DistributedTimeoutError,
    InvalidRankError,
    InvalidWorldSizeError,
    PeerLostError,
)
from ferro.store import Store

__all__ = [
    "RendezvousConfig",
    "build_mesh",
    "default_timeout",
    "local_address_towards",
    "validate_rank_and_size",
]

log = logging.getLogger("ferro.rendezvous")

TIMEOUT_ENV = "FERRO_TIMEOUT"
BIND_ADDR_ENV = "FERRO_BIND_ADDR"
DEFAULT_TIMEOUT_SECONDS = 60.0
# A stray connection may stall the accept loop this long at most.
HANDSHAKE_TIMEOUT = 10.0


def default_timeout(timeout: float | None = None) -> float:
    """Return ``timeout`` if given, else ``$FERRO_TIMEOUT``, else 60 seconds.

    Raises:
        ConfigurationError: The value is not a positive number.

    """
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT_SECONDS
        try:
            timeout = float(raw)
        except ValueError:
            raise ConfigurationError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not timeout > 0:
        raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def validate_rank_and_size(rank: object, world_size: object) -> tuple[int, int]:
    """Check that ``world_size`` is a positive integer and ``0 <= rank < world_size``.

    Raises:
        InvalidWorldSizeError, InvalidRankError.

    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidWorldSizeError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidRankError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    return rank, world_size


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


@dataclass(frozen=True)
class RendezvousConfig:
    """Everything a rank needs to join a job.

    Attributes:
        rank: This process's rank.
        world_size: Number of ranks.
        master_addr: Address of the store (rank 0's host, or the launcher's).
        master_port: Port of the store.
        secret: The job secret shared by every rank.

    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    secret: bytes

    @classmethod
    def resolve(
        cls,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        secret: bytes | str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> RendezvousConfig:
        """Fill unset fields from the environment and validate them all.

        Raises:
            ConfigurationError: A setting is missing or malformed; the message
                names the variable to set.
            InvalidRankError, InvalidWorldSizeError: Out-of-range values.

        """
        env = os.environ if environ is None else environ
        rank_value = rank if rank is not None else _int_from(env, "RANK", "rank")
        size_value = world_size if world_size is not None else _int_from(env, "WORLD_SIZE", "world_size")
        addr = master_addr if master_addr is not None else env.get("MASTER_ADDR")
        if not addr:
            raise ConfigurationError("no master address: set MASTER_ADDR (or pass master_addr=)")
        port = master_port if master_port is not None else _int_from(env, "MASTER_PORT", "master_port")
        if not 0 < port < 65536:
            raise ConfigurationError(f"MASTER_PORT must be in 1..65535, got {port}")
        secret_bytes = secret_from_env(secret) if secret is not None else secret_from_env(env.get("FERRO_SECRET"))
        if secret_bytes is None:
            raise ConfigurationError(
                "no job secret: set FERRO_SECRET to the same random string on every rank "
                "(`ferro run` does this for you), or pass secret=")
        validate_rank_and_size(rank_value, size_value)
        return cls(rank_value, size_value, addr, port, secret_bytes)


def _int_from(env: Mapping[str, str], name: str, argument: str) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        raise ConfigurationError(f"{argument} is not set: set {name} (or pass {argument}=)")
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not an integer") from None


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
    delay = 0.01
    while True:
        remaining = _remaining(deadline, rank, f"connecting to {where}")
        try:
            sock = socket.create_connection((host, port), timeout=min(remaining, 5.0))
            break
        except OSError as exc:
            log.debug("rank %d: connecting to %s failed (%s); retrying", rank, where, exc)
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.5)
    try:
        connect_handshake(sock, secret, context, min(HANDSHAKE_TIMEOUT, remaining), where)
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
