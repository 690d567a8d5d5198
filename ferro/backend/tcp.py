"""The TCP process group on the compiled transport: connections made as its algorithms first need them."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ferro import environment
from ferro._buffers import as_buffer
from ferro._core import collectives as native
from ferro._core.collectives import Mesh
from ferro._core.transport import KIND_ABORT, Connection, sendrecv
from ferro.backend.base import Support, default_spin_us, default_yield_us
from ferro.backend.cost_model import force_plans, load_cost_model
from ferro.backend.joined import JoinSpec, StoreBackend
from ferro.backend.native import NativeCollectives
from ferro.errors import ConfigurationError, DistributedError, PeerLostError
from ferro.rendezvous.connect import local_address_towards
from ferro.rendezvous.limits import descriptor_limits, ensure_descriptors, raise_descriptor_limit
from ferro.rendezvous.peers import PeerConnector
from ferro.rendezvous.settings import BIND_ADDR_ENV, RendezvousConfig, default_timeout, validate_rank_and_size
from ferro.rendezvous.store import Store
from ferro.types import DType, ReduceOp

__all__ = ["TcpBackend"]

SOCKET_BUFFER_ENV = "FERRO_SOCKET_BUFFER_BYTES"
# TCP's congestion control for the connections between ranks (unset: the kernel's default). On
# 32x1@100mbit, whose kernel defaults to BBR, the 4 MiB all_to_all's sixteen flows into each host dropped
# 30,565 packets and timed out 17 times in seven calls (699 ms); with reno in every host 66 drops, none
# (507 ms). See DESIGN.md, "TCP's congestion control".
CONGESTION_ENV = "FERRO_TCP_CONGESTION"
# Measured on loopback (bench/, DESIGN.md): fixed 4 MiB buffers take a 1 MiB allreduce
# from ~565 to ~350 us, where autotuning starts too small; 0 restores autotuning.
DEFAULT_SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
# How long closing a group that sent abort notices waits for its peers to close too (see TcpBackend._release).
ABORT_LINGER_SECONDS = 2.0


def _size_socket_buffers(sock: socket.socket) -> None:
    raw = environment.get(SOCKET_BUFFER_ENV)
    try:
        size = DEFAULT_SOCKET_BUFFER_BYTES if raw is None else int(raw)
    except ValueError:
        raise ConfigurationError(f"{SOCKET_BUFFER_ENV}={raw!r} is not a number of bytes") from None
    if size <= 0:
        return  # the kernel's autotuning
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


def _congestion_control() -> bytes | None:
    """Return the congestion control ``FERRO_TCP_CONGESTION`` names for the connections (None: the kernel's).

    Checked on a throwaway socket when the group starts, so a name the kernel refuses fails there, not on the
    first collective that connects a peer.

    Raises:
        ConfigurationError: Not Linux, or a name this kernel does not allow.

    """
    raw = environment.get(CONGESTION_ENV)
    if not raw:
        return None
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        raise ConfigurationError(f"{CONGESTION_ENV}={raw!r}: choosing TCP's congestion control needs Linux")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.setsockopt(socket.IPPROTO_TCP, option, raw.encode())
        except OSError as exc:
            allowed = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"
            try:
                with open(allowed) as f:
                    names = f.read().split()
            except OSError:
                names = []
            raise ConfigurationError(
                f"{CONGESTION_ENV}={raw!r}: the kernel refuses it ({exc.strerror}); allowed here: "
                f"{', '.join(names) or 'unknown'} ({allowed})") from None
    return raw.encode()


def _divisor(op: ReduceOp, world_size: int) -> float:
    return float(world_size) if op is ReduceOp.MEAN else 0.0


class _Links(dict[int, Connection]):
    """The connections made so far, by peer; looking up a missing one makes it (``make(peer)``)."""

    def __init__(self, make: Callable[[int], Connection]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, peer: int) -> Connection:
        return self._make(peer)


class TcpBackend(StoreBackend, NativeCollectives):
    """A process group whose ranks talk over TCP, each pair connected the first time an algorithm needs it.

    A rank joins with a few store requests whatever the group's size, and holds
    the connections its collectives use: about 2 log2(N) (ring neighbours, tree
    and recursive-doubling partners; all_to_all, and p2p to far ranks, add theirs).

    Rank 0 serves the rendezvous :class:`~ferro.Store` on ``master_addr:master_port``
    unless a ``store`` is given. Every connection is authenticated with the job
    secret. Data moves through ferro's compiled transport with the GIL released.

    Args:
        rank: This process's rank.
        world_size: Number of ranks.
        master_addr: Address of the store (rank 0's host).
        master_port: Port of the store.
        timeout: Default seconds for every blocking operation, rendezvous included
            (default ``$FERRO_TIMEOUT`` or 60).
        secret: The job secret (default ``$FERRO_SECRET``); required.
        bind_addr: Address to listen on for peers (default ``$FERRO_BIND_ADDR``, else
            this host's address on the route to ``master_addr``).
        store: An existing store client to rendezvous through (a launcher's);
            it is not closed with the group.
        spin_us: Microseconds to spin on a quiet socket before sleeping (default
            ``$FERRO_SPIN_US``, else 50, or 0 when this host's ranks outnumber its cores: the
            ranks a launcher started here, ``$LOCAL_WORLD_SIZE``, else the whole group).
        close_store: Close a given ``store`` with the group (it becomes the group's own).
        yield_us: Without a spin, microseconds to keep trying between ``sched_yield()`` calls before
            sleeping (default ``$FERRO_YIELD_US``, else 200, or 0 past four of this host's ranks a core).

    Raises:
        ConfigurationError: No secret, or an address that cannot be used.
        InvalidRankError, InvalidWorldSizeError: Bad rank or size.
        DistributedTimeoutError: Rendezvous did not complete in time.
        AuthenticationError: A peer does not hold the job secret.

    Example::

        # on every rank, with FERRO_SECRET set alike everywhere
        group = TcpBackend(rank, 2, "10.0.0.1", 29500)
        if group.rank == 0:
            group.send(numpy.arange(4.0), dst=1)
        else:
            buf = numpy.empty(4); group.recv(buf, src=0)   # buf == [0, 1, 2, 3]

    """

    SUPPORT: ClassVar[Support] = Support()

    store_namespace = "tcp"

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        *,
        timeout: float | None = None,
        secret: bytes | str | None = None,
        bind_addr: str | None = None,
        store: Store | None = None,
        spin_us: float | None = None,
        close_store: bool = False,
        yield_us: float | None = None,
    ) -> None:
        validate_rank_and_size(rank, world_size)  # before anything uses them
        bind = bind_addr or environment.get(BIND_ADDR_ENV) or local_address_towards(master_addr)
        # Spinning pays while this host's ranks each have a core; the launcher says how many it started here.
        here = _ranks_on_this_host(default=world_size)
        spin, yielding = default_spin_us(spin_us, here), default_yield_us(yield_us, here)
        self._join(rank, world_size, master_addr, master_port, timeout, secret, store, close_store,
                   lambda: self._connect(bind, spin, yielding))

    @classmethod
    def join(cls, spec: JoinSpec) -> TcpBackend:
        """Join the job described by ``spec`` (the backend registry's entry point)."""
        return cls(spec.rank, spec.world_size, spec.master_addr, spec.master_port, timeout=spec.timeout,
                   secret=spec.secret, store=spec.store, bind_addr=spec.bind_addr, close_store=spec.close_store)

    @classmethod
    def from_env(cls, **kwargs: Any) -> TcpBackend:
        """Build the group from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``FERRO_SECRET``.

        Keyword arguments override the environment and are passed on.

        Raises:
            ConfigurationError: Naming the variable that is missing or malformed.

        """
        config = RendezvousConfig.resolve(
            rank=kwargs.pop("rank", None), world_size=kwargs.pop("world_size", None),
            master_addr=kwargs.pop("master_addr", None), master_port=kwargs.pop("master_port", None),
            secret=kwargs.pop("secret", None))
        return cls(config.rank, config.world_size, config.master_addr, config.master_port, secret=config.secret,
                   **kwargs)

    def _connect(self, bind_addr: str, spin_us: float, yield_us: float) -> None:
        raise_descriptor_limit()  # the soft limit is often 1,024; a big job's ranks may need more
        self._congestion = _congestion_control()
        self._bind_addr = bind_addr
        self._spin_us = spin_us
        self._yield_us = yield_us
        self._aborted = False
        self._links = _Links(self._link)
        self._link_lock = threading.Lock()
        self._peers = PeerConnector(self._store, self._rank, self._world_size, prefix=self._prefix,
                                    secret=self._secret, bind_addr=bind_addr, deadline=self._deadline)
        # Indexed by rank, for the native collectives and the direct paths; each connection made on first use.
        self._mesh = Mesh([None] * self._world_size, self._rank, connector=self._link)
        model = self._model = load_cost_model()  # $FERRO_COST_MODEL: the link's numbers choose the plans, ...
        if model is not None:
            self._mesh.latency_bytes, self._mesh.copy_ratio, self._mesh.partner_ratio = model.link_numbers()
            self._mesh.set_partner_curve(model.partner_curve())
            self._mesh.segment_bytes = model.segment_bytes()
            self._mesh.piece_bytes = model.piece_bytes()
            self._mesh.line_pace = model.line_rate  # 0 where the model does not know the line: unpaced
            # The ranks a launcher started on this host share its link (ferro run and torchrun say how many).
            self.share_link(_ranks_on_this_host())
            self._mesh.measured = True
        try:
            force_plans(self._mesh, self._rank)  # $FERRO_ALGORITHM_BROADCAST and the like
            self._peers.join(self._deadline, prefetch=self._mesh.near_peers, settings=self._mesh.plan_settings())
        except BaseException:
            self._peers.close()
            raise

    def _link(self, peer: int, timeout: float | None = None) -> Connection:
        """Return the connection to ``peer``, connecting (or waiting for the peer to) the first time."""
        with self._link_lock:  # one connection per peer, whichever thread asks first
            link = self._links.get(peer)
            if link is not None:
                return link
            if len(self._links) + 64 > descriptor_limits()[0] >= 0:
                ensure_descriptors(len(self._links) + 64, f"rank {self._rank}'s connections to {len(self._links) + 1} "
                                                          f"peers of a group of {self._world_size}")
            sock = self._peers.connect(peer, self._seconds(timeout))
            _size_socket_buffers(sock)
            if self._congestion is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, self._congestion)
            link = Connection(sock, self._rank, peer, spin_us=self._spin_us, group_state=self.state,
                              yield_us=self._yield_us)
            dict.__setitem__(self._links, peer, link)
            self._mesh.attach(peer, link)
            return link

    @property
    def connected_peers(self) -> list[int]:
        """The peers this rank has connected to so far (connections are made when first needed)."""
        return sorted(self._links)

    def frames_waiting(self, sources: Sequence[int]) -> list[int]:
        """Return the sources whose next frame has begun to arrive; a peer not connected yet has sent nothing."""
        self._usable("recv")
        waiting, accepted = [], set(self._peers.waiting_peers())
        for src in sources:
            link = self._links.get(src)
            if link is None and (src < self._rank or src in accepted):
                link = self._link(src)  # dialling a lower rank, or taking a connection already accepted: no wait
            elif link is None:
                self._peers.check_alive(src)  # a peer that died before connecting left no socket to break
            if link is not None and link.frame_waiting():
                waiting.append(src)
        return waiting

    def connection(self, peer: int) -> Connection:
        """Return the compiled connection to ``peer`` (for ferro's own algorithms), connecting on first use."""
        return self._links[self.check_peer(peer, "connection")]

    def sendrecv_tagged(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, kind: int, fingerprint: int,
                        timeout: float | None = None) -> None:
        """Full-duplex exchange of tagged frames in one compiled progress loop (see :meth:`Backend.sendrecv_tagged`)."""
        self._usable("sendrecv")
        dst = self.check_peer(dst, "sendrecv")
        src = self.check_peer(src, "sendrecv")
        try:
            sendrecv(self._links[dst], as_buffer(send_buf, "sendrecv"), self._links[src],
                     as_buffer(recv_buf, "sendrecv", writable=True), kind=kind, fingerprint=fingerprint,
                     timeout=self._seconds(timeout), op="sendrecv")
        except PeerLostError as exc:
            raise self._why_lost(exc) from exc

    def send_tagged(self, buf: Any, dst: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Send one frame (see :meth:`Backend.send_tagged`); a lost peer's abort notice says why it left."""
        try:
            super().send_tagged(buf, dst, kind=kind, fingerprint=fingerprint, timeout=timeout)
        except PeerLostError as exc:
            raise self._why_lost(exc) from exc

    def recv_tagged(self, buf: Any, src: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Receive one frame (see :meth:`Backend.recv_tagged`); a lost peer's abort notice says why it left."""
        try:
            super().recv_tagged(buf, src, kind=kind, fingerprint=fingerprint, timeout=timeout)
        except PeerLostError as exc:
            raise self._why_lost(exc) from exc

    def _why_lost(self, exc: PeerLostError) -> BaseException:
        """Return the peer's abort notice from the store, when it left one before it closed (else ``exc``).

        A peer that gives up while this rank's connection to it is still being
        accepted closes that connection without a notice on it; the store has it.
        """
        posted = self._peers.posted_abort(exc.peer) if exc.peer is not None else None
        return posted if posted is not None else exc

    # --- native collectives (ferro.backend.native), each one compiled call ------------------

    @property
    def direct_mesh(self) -> Mesh:
        """The compiled mesh behind the direct paths (every collective of ferro.collective.direct)."""
        return self._mesh

    def native_allreduce(self, flat: Any, dtype: DType, op: ReduceOp, fingerprint: int, timeout: float,
                         algorithm: str) -> bool:
        """Run recursive doubling, halving-doubling or a segmented ring; MEAN divides inside, each chunk once."""
        self._usable("allreduce")
        code = native.ALGORITHMS[algorithm]
        native.allreduce(self._mesh, flat, dtype.code, op.kernel_code, dtype.itemsize,
                         fingerprint, timeout, code, 0, _divisor(op, self._world_size))
        return True

    def native_reduce(self, flat: Any, root: int, dtype: DType, op: ReduceOp, fingerprint: int,
                      timeout: float) -> bool:
        """Run the binomial tree (small) or the ring's reduce-scatter and a gather (large); MEAN divides inside."""
        self._usable("reduce")
        native.reduce(self._mesh, flat, root, dtype.code, op.kernel_code, dtype.itemsize, fingerprint, timeout,
                      _divisor(op, self._world_size))
        return True

    def native_reduce_scatter(self, flat: Any, bounds: list[int], dtype: DType, op: ReduceOp, fingerprint: int,
                              timeout: float) -> bool:
        """Run the ring's reduce-scatter half in place (the ring given ``flat`` as its own source)."""
        return self.native_reduce_scatter_from(flat, flat, bounds, dtype, op, fingerprint, timeout)

    def native_reduce_scatter_from(self, source: Any, flat: Any, bounds: list[int], dtype: DType, op: ReduceOp,
                                   fingerprint: int, timeout: float) -> bool:
        """Run the ring's reduce-scatter half reading ``source``: no up-front copy into ``flat``.

        The first step sends straight from the input, and each segment that
        arrives is reduced into a copy of the input's made just then (on 4 hosts
        at 1 Gbit, the whole copy before a 64 MiB ring took a tenth of the call).
        """
        self._usable("reduce_scatter")
        native.ring(self._mesh, flat, bounds, dtype.code, op.kernel_code, dtype.itemsize,
                    fingerprint, timeout, True, False, 0, _divisor(op, self._world_size),
                    source=source)
        return True

    def ring_pieces(self, flat: Any, starts: Sequence[int], ends: Sequence[int], *, dtype: DType,
                    op: ReduceOp | None, fingerprint: int, timeout: float) -> None:
        """Reduce-scatter (``op`` given) or all-gather rank ``i``'s piece ``flat[starts[i]:ends[i]]`` over the ring.

        The pieces may have gaps between them: a pipelined hierarchical
        collective passes one slice of each host's block at a time. ``op`` is
        applied as is (MEAN's division is the caller's).
        """
        self._usable("reduce_scatter" if op is not None else "all_gather")
        native.ring(self._mesh, flat, list(starts), dtype.code, 0 if op is None else op.kernel_code, dtype.itemsize,
                    fingerprint, timeout, op is not None, op is None, 0, 0.0, list(ends))

    def native_all_gather(self, flat: Any, bounds: list[int], fingerprint: int, timeout: float) -> bool:
        """Gather equal byte parts: Bruck's log2(n) rounds when small, else the ring's all-gather half.

        The compiled call chooses, as it does for the direct path, so ranks on either path agree frame for frame.
        """
        self._usable("all_gather")
        native.all_gather(self._mesh, flat, bounds[1], fingerprint, timeout)
        return True

    def native_broadcast(self, flat: Any, root: int, fingerprint: int, timeout: float) -> bool:
        """Run a binomial tree for small messages (and two ranks), a pipelined chain for large ones."""
        self._usable("broadcast")
        native.broadcast(self._mesh, flat, root, fingerprint, timeout)
        return True

    def native_all_to_all(self, send: Any, send_offsets: list[int], recv: Any, recv_offsets: list[int],
                          fingerprint: int, timeout: float, even: bool = False) -> bool:
        """Exchange byte blocks: Bruck's rounds for small equal ones, else the pairwise exchange."""
        self._usable("all_to_all")
        native.all_to_all(self._mesh, send, send_offsets, recv, recv_offsets, fingerprint, timeout, even)
        return True

    def cut_peer(self, peer: int) -> bool:
        """Close the connection to ``peer`` (safe from another thread: a waiter on it wakes and raises)."""
        link = self._links.get(peer)
        if link is None:
            self._peers.cut(peer)  # not connected (yet): a wait for it ends now
            return True
        link.close()
        return True

    def abort_peers(self, payload: bytes) -> None:
        """Send an abort notice to every connected peer (1 s each at most); leave it in the store for the rest."""
        self._aborted = True  # closing lingers, so that the notices arrive (see _release)
        for peer in self._peers.waiting_peers():
            self._link(peer)  # a peer that connected to this rank, which never took it: it wants to hear
        if len(self._links) < self._world_size - 1:
            self._peers.post_abort(payload)  # the peers never connected to read it in the store
        for conn in self._links.values():
            if conn.broken is None and not conn.closed:
                try:
                    conn.send(payload, kind=KIND_ABORT, timeout=1.0, op="abort")
                except DistributedError:
                    pass  # that peer is gone or wedged; it learns by its own timeout

    def barrier(self, *, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier (dissemination algorithm)."""
        self._usable("barrier")
        native.barrier(self._mesh, self._seconds(timeout))

    def share_link(self, ranks_per_host: int) -> None:
        """Pace this group's all_to_all as one of ``ranks_per_host`` ranks sending off each host at once.

        Only on a link a cost model describes (``FERRO_COST_MODEL``); the default is ``$LOCAL_WORLD_SIZE``. A
        group of one rank per host (the hierarchical backend's leaders) has the whole link.
        """
        if self._model is not None:
            self._mesh.pace_bytes = self._model.pace_bytes(ranks_per_host, self._world_size)

    def split(self, ranks: Sequence[int], *, timeout: float | None = None) -> TcpBackend:
        """Connect a new mesh among ``ranks`` through this group's store (see :meth:`Backend.split`)."""
        self._usable("new_group")
        members = tuple(ranks)
        child = type(self).__new__(type(self))  # a subclass (the hybrid group) splits into its own kind
        child._init_state(members.index(self._rank), len(members), self._store, False, self._split_prefix(members),
                          self._secret, self._timeout if timeout is None else default_timeout(timeout))
        child._connect(self._bind_addr, self._spin_us, self._yield_us)
        return child

    def _release(self) -> None:
        if self._aborted:
            # A plain close with the peers' frames unread would reset the connections and drop notices still
            # queued here; ranks that are not waiting on this one would then report it lost instead of the cause.
            deadline = time.monotonic() + ABORT_LINGER_SECONDS
            for conn in self._links.values():
                conn.stop_sending()
            for conn in self._links.values():
                conn.linger(deadline)
        for conn in self._links.values():
            conn.close()
        self._peers.close()


def _ranks_on_this_host(default: int = 1) -> int:
    """Return how many ranks a launcher started on this host (``$LOCAL_WORLD_SIZE``: ferro run, torchrun).

    Without one (unset, or not a positive count) ``default``: 1 where the count splits the link (a rank alone
    has all of it), the group's size where it decides spinning (the cautious guess: all on this host).
    """
    try:
        count = int(os.environ.get("LOCAL_WORLD_SIZE", "") or 0)
    except ValueError:
        count = 0
    return count if count > 0 else default
