"""Ranks on several hosts: shared memory inside each host, TCP between one leader per host."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferro._core.reduce import divide
from ferro.backend.base import FramedBackend, default_spin_us
from ferro.backend.shm import ShmBackend
from ferro.backend.tcp import TcpBackend
from ferro.errors import DistributedError
from ferro.rendezvous import RendezvousConfig, default_timeout, validate_rank_and_size
from ferro.store import Store

__all__ = ["HOST_ID_ENV", "HierarchicalBackend", "exchange_host_identities", "host_identity", "machine_identity"]

HOST_ID_ENV = "FERRO_HOST_ID"


def host_identity() -> str:
    """Return what ranks compare to know they share a host and its shared memory.

    The hostname and kernel boot id name the machine. The device and inode of
    ``/dev/shm`` tell containers that share a kernel but not shared memory
    apart, and the inode of the network namespace tells apart ranks that cannot
    reach each other over loopback (separate network namespaces are separate
    hosts to the network, so ferro treats them as such). ``$FERRO_HOST_ID``
    replaces all of it, to declare hosts explicitly.
    """
    explicit = os.environ.get(HOST_ID_ENV)
    if explicit:
        return f"explicit:{explicit}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        info = os.stat("/dev/shm")
        shm = f"{info.st_dev}:{info.st_ino}"
    except OSError:
        return f"no-shm:{os.getpid()}"  # no shared memory here: never counts as shared
    try:
        net = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        net = "unknown-netns"
    return f"{socket.gethostname()}|{boot}|{shm}|{net}"


def machine_identity() -> str:
    """Return what ranks compare to know they share one machine's cores: the kernel's boot id.

    Unlike :func:`host_identity` it ignores namespaces and ``$FERRO_HOST_ID``:
    ranks in separate network namespaces of one machine compete for its cores.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"unknown-machine:{socket.gethostname()}"


def exchange_host_identities(store: Any, rank: int, world_size: int, timeout: float) -> list[tuple[str, str]]:
    """Publish this rank's host and machine identities through ``store``; return every rank's, in rank order.

    Each rank counts its own exchanges in the store, so a job that does this more
    than once (a launcher's store, a re-created group) never reads stale answers.
    """
    generation = store.add(f"ferro/host-joins/{rank}", 1)
    prefix = f"ferro/hosts/{generation}"
    store.set(f"{prefix}/{rank}", f"{host_identity()}\n{machine_identity()}")
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.wait(keys, timeout=timeout)
    found = [store.get(key, timeout=timeout).decode().split("\n", 1) for key in keys]
    return [(parts[0], parts[1] if len(parts) > 1 else parts[0]) for parts in found]


class HierarchicalBackend(FramedBackend):
    """A process group over several hosts, each with one or more ranks.

    Three groups work together:

    * a TCP mesh over every rank, for point-to-point messages and the
      collectives that gain nothing from the hierarchy (reduce-scatter,
      all-gather, all-to-all, gather, scatter);
    * a shared-memory group among the ranks of each host;
    * a TCP mesh among the *leaders*, the lowest rank of each host.

    ``allreduce`` reduces inside each host through shared memory onto the
    leader, allreduces among the leaders over TCP, and broadcasts back inside
    each host; ``broadcast`` and ``barrier`` take the same three steps. Every
    rank gets the same bits. Hosts are told apart by :func:`host_identity`
    (``$FERRO_HOST_ID`` to declare them).

    Args:
        rank: This process's rank.
        world_size: Number of ranks, on all hosts.
        master_addr: Address of the rendezvous store.
        master_port: Port of the rendezvous store.
        timeout: Default seconds for blocking operations.
        secret: The job secret (default ``$FERRO_SECRET``).
        store: An existing store client to rendezvous through.
        bind_addr: Address the TCP meshes listen on (see :class:`~ferro.TcpBackend`).
        close_store: Close a given ``store`` with the group.

    Raises:
        As :class:`~ferro.TcpBackend` and :class:`~ferro.ShmBackend`.

    Example::

        # 2 hosts x 2 ranks; on every rank, with FERRO_SECRET set alike everywhere
        group = HierarchicalBackend(rank, 4, "10.0.0.1", 29500)
        x = numpy.full(4, float(rank))
        ferro.allreduce(x, group=group)          # x == [6., 6., 6., 6.] on every rank

    """

    def __init__(self, rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500, *,
                 timeout: float | None = None, secret: bytes | str | None = None, store: Store | None = None,
                 bind_addr: str | None = None, close_store: bool = False) -> None:
        validate_rank_and_size(rank, world_size)
        config = RendezvousConfig.resolve(rank=rank, world_size=world_size, master_addr=master_addr,
                                          master_port=master_port, secret=secret)
        seconds = default_timeout(timeout)
        if store is None:
            store = Store(master_addr, master_port, secret=config.secret, timeout=seconds, serve=(rank == 0))
            close_store = True
        try:
            identities = exchange_host_identities(store, rank, world_size, seconds)
            self._plan(rank, [host for host, _ in identities])
            # Spinning pays only while the ranks on this machine each have a core. Count the machine's
            # ranks, not the host's: namespaces or declared hosts may share one machine's cores.
            machine = identities[rank][1]
            spin = default_spin_us(None, sum(1 for _, other in identities if other == machine))
            self._world = TcpBackend(rank, world_size, master_addr, master_port, timeout=seconds,
                                     secret=config.secret, store=store, bind_addr=bind_addr, spin_us=spin,
                                     close_store=close_store)
        except BaseException:
            if close_store:
                store.close()  # idempotent: the TCP group may have closed it already
            raise
        self._local: ShmBackend | None = None
        self._leaders: TcpBackend | None = None
        try:
            if len(self._members) > 1:
                self._local = ShmBackend.split_from(self._world, self._members, spin_us=spin)
            if len(self._leader_ranks) > 1 and rank in self._leader_ranks:
                self._leaders = self._world.split(self._leader_ranks)
        except BaseException:
            self.close()
            raise

    def _plan(self, rank: int, hosts: Sequence[str]) -> None:
        by_host: dict[str, list[int]] = {}
        for r, host in enumerate(hosts):
            by_host.setdefault(host, []).append(r)
        groups = sorted(by_host.values())  # by lowest rank: the same order on every rank
        self._host_of = {r: index for index, members in enumerate(groups) for r in members}
        self._hosts = [tuple(members) for members in groups]
        self._members = self._hosts[self._host_of[rank]]
        self._leader_ranks = tuple(members[0] for members in groups)

    # --- what the group is ------------------------------------------------------------

    @property
    def rank(self) -> int:
        """The calling process's rank."""
        return self._world.rank

    @property
    def world_size(self) -> int:
        """The number of ranks, on all hosts."""
        return self._world.world_size

    @property
    def timeout(self) -> float:
        """Default seconds for blocking operations."""
        return self._world.timeout

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._world.closed

    @property
    def hosts(self) -> list[tuple[int, ...]]:
        """The ranks of each host, hosts ordered by their lowest rank."""
        return list(self._hosts)

    @property
    def is_leader(self) -> bool:
        """Whether this rank speaks for its host among the leaders."""
        return self.rank == self._members[0]

    # --- point-to-point: the TCP mesh ------------------------------------------------------

    def send_tagged(self, buf: Any, dst: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Send one frame to ``dst`` over the TCP mesh (see :meth:`Backend.send_tagged`)."""
        self._world.send_tagged(buf, dst, kind=kind, fingerprint=fingerprint, timeout=timeout)

    def recv_tagged(self, buf: Any, src: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Receive one frame from ``src`` over the TCP mesh (see :meth:`Backend.recv_tagged`)."""
        self._world.recv_tagged(buf, src, kind=kind, fingerprint=fingerprint, timeout=timeout)

    def sendrecv_tagged(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, kind: int, fingerprint: int,
                        timeout: float | None = None) -> None:
        """Exchange frames over the TCP mesh (see :meth:`Backend.sendrecv_tagged`)."""
        self._world.sendrecv_tagged(send_buf, dst, recv_buf, src, kind=kind, fingerprint=fingerprint,
                                    timeout=timeout)

    # --- collectives: host, leaders, host ----------------------------------------------

    def native_allreduce(self, flat: Any, dtype: Any, op_code: int, fingerprint: int, timeout: float,
                         algorithm: str, divisor: float = 0.0) -> None:
        """Reduce onto each host's leader (shared memory), allreduce among leaders (TCP), broadcast back."""
        self._world._usable("allreduce")
        if self._local is not None:
            self._local.native_reduce(flat, 0, dtype.code, op_code, dtype.itemsize, fingerprint, timeout)
        if self._leaders is not None:
            self._leaders.native_allreduce(flat, dtype, op_code, fingerprint, timeout, algorithm)
        if self._local is not None:
            self._local.native_broadcast(flat.view(np.uint8), 0, fingerprint, timeout, False)
        if divisor:
            # Every rank divides the same bits the same way, so the results stay identical.
            divide(flat, dtype.code, divisor, dtype.itemsize)

    def native_broadcast(self, flat: Any, root: int, fingerprint: int, timeout: float, chain: bool) -> None:
        """Broadcast inside the root's host, then among leaders, then inside every other host."""
        self._world._usable("broadcast")
        root_host = self._host_of[root]
        mine = self._host_of[self._world.rank]
        if mine == root_host and self._local is not None:
            self._local.native_broadcast(flat, self._members.index(root), fingerprint, timeout, chain)
        if self._leaders is not None:
            self._leaders.native_broadcast(flat, root_host, fingerprint, timeout, chain)
        if mine != root_host and self._local is not None:
            self._local.native_broadcast(flat, 0, fingerprint, timeout, chain)

    def native_ring(self, flat: Any, bounds: list[int], dtype_code: int, op_code: int, itemsize: int,
                    fingerprint: int, timeout: float, reduce_scatter: bool, all_gather: bool) -> None:
        """Reduce-scatter and/or all-gather over the TCP mesh's ring (every rank's part crosses hosts anyway)."""
        self._world.native_ring(flat, bounds, dtype_code, op_code, itemsize, fingerprint, timeout,
                                reduce_scatter, all_gather)

    def native_all_to_all(self, send: Any, send_offsets: list[int], recv: Any, recv_offsets: list[int],
                          fingerprint: int, timeout: float) -> None:
        """All-to-all over the TCP mesh."""
        self._world.native_all_to_all(send, send_offsets, recv, recv_offsets, fingerprint, timeout)

    def barrier(self, *, timeout: float | None = None) -> None:
        """Block until every rank on every host has entered the barrier."""
        self._world._usable("barrier")
        if self._local is not None:
            self._local.barrier(timeout=timeout)
        if self._leaders is not None:
            self._leaders.barrier(timeout=timeout)
        if self._local is not None:
            self._local.barrier(timeout=timeout)

    def abort_peers(self, payload: bytes) -> None:
        """Tell every peer, through each of the three groups, why this rank gave up."""
        for part in (self._local, self._leaders, self._world):
            if part is not None and not part.closed:
                try:
                    part.abort_peers(payload)
                except DistributedError:
                    pass

    def split(self, ranks: Sequence[int], *, timeout: float | None = None) -> TcpBackend:
        """Sub-groups of a hierarchical group are TCP meshes among their members (see :meth:`Backend.split`)."""
        return self._world.split(ranks, timeout=timeout)

    def close(self) -> None:
        """Close the three groups (and the store if this rank serves it). Idempotent."""
        for part in (self._leaders, self._local, self._world):
            if part is not None:
                part.close()
