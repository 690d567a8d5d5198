"""Ranks on several hosts: shared memory inside each host, TCP between one leader per host."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np

from ferro._core.reduce import divide
from ferro.backend.base import (
    SHM_YIELD_US,
    FramedBackend,
    Support,
    add_counters,
    default_spin_us,
    default_yield_us,
)
from ferro.backend.hierarchy_plan import (
    Relay,
    exchange_all,
    flat_below_bytes,
    leaders_call,
    pipeline_pieces,
    runs_flat,
)
from ferro.backend.joined import JoinSpec
from ferro.backend.native import NativeCollectives
from ferro.backend.shm import ShmBackend
from ferro.backend.tcp import TcpBackend
from ferro.errors import DistributedError
from ferro.rendezvous.hosts import crowded, exchange_host_identities
from ferro.rendezvous.settings import RendezvousConfig, default_timeout, validate_rank_and_size
from ferro.rendezvous.store import Store
from ferro.types import BYTES, DType, ReduceOp

__all__ = ["HierarchicalBackend"]



class HierarchicalBackend(FramedBackend, NativeCollectives):
    """A process group over several hosts, each with one or more ranks.

    Three groups work together:

    * a TCP mesh over every rank, for point-to-point messages and the
      collectives that gain nothing from the hierarchy (all-to-all, gather,
      scatter);
    * a shared-memory group among the ranks of each host;
    * a TCP mesh among the *leaders*, the lowest rank of each host.

    ``allreduce`` reduces inside each host through shared memory onto the
    leader, allreduces among the leaders over TCP, and broadcasts back inside
    each host; ``broadcast``, ``barrier``, ``reduce_scatter`` and ``all_gather``
    (the last two where every host holds the same number of consecutive ranks)
    take the same three steps, so only what another host needs crosses a link. Every
    rank gets the same bits. Hosts are told apart by :func:`~ferro.rendezvous.hosts.host_identity`
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
        DistributedError: As :class:`~ferro.TcpBackend` and :class:`~ferro.ShmBackend`.

    Example::

        # 2 hosts x 2 ranks; on every rank, with FERRO_SECRET set alike everywhere
        group = HierarchicalBackend(rank, 4, "10.0.0.1", 29500)
        x = numpy.full(4, float(rank))
        ferro.allreduce(x, group=group)          # x == [6., 6., 6., 6.] on every rank

    """

    SUPPORT: ClassVar[Support] = Support(
        engine_kind="shared memory inside each host, compiled TCP between the hosts' leaders",
        sub_groups="yes (a TCP mesh among the members)")

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
            self._plan(rank, [identity.host for identity in identities])
            # Where ranks outnumber a machine's cores, shared-memory waits cannot spin: small calls go flat.
            self._flat_below = flat_below_bytes(crowded(identities))
            # Spinning pays only while the ranks on this machine each have a core. Count the machine's
            # ranks, not the host's: namespaces or declared hosts may share one machine's cores.
            machine = identities[rank].machine
            here = sum(1 for identity in identities if identity.machine == machine)
            spin = default_spin_us(None, here)
            self._world = TcpBackend(rank, world_size, master_addr, master_port, timeout=seconds,
                                     secret=config.secret, store=store, bind_addr=bind_addr, spin_us=spin,
                                     close_store=close_store, yield_us=default_yield_us(None, here))
        except BaseException:
            if close_store:
                store.close()  # idempotent: the TCP group may have closed it already
            raise
        self._local: ShmBackend | None = None
        self._leaders: TcpBackend | None = None
        self._exchanger: ThreadPoolExecutor | None = None  # a leader's exchange thread, made on first use
        try:
            if len(self._members) > 1:
                self._local = ShmBackend.split_from(self._world, self._members, spin_us=spin,
                                                    yield_us=default_yield_us(None, here, SHM_YIELD_US))
            if len(self._leader_ranks) > 1 and rank in self._leader_ranks:
                self._leaders = self._world.split(self._leader_ranks)
                self._leaders.share_link(1)  # one rank per host sends between hosts: it has the whole link
        except BaseException:
            self.close()
            raise

    @classmethod
    def join(cls, spec: JoinSpec) -> HierarchicalBackend:
        """Join the job described by ``spec`` (the backend registry's entry point)."""
        return cls(spec.rank, spec.world_size, spec.master_addr, spec.master_port, timeout=spec.timeout,
                   secret=spec.secret, store=spec.store, bind_addr=spec.bind_addr, close_store=spec.close_store)

    def _plan(self, rank: int, hosts: Sequence[str]) -> None:
        by_host: dict[str, list[int]] = {}
        for r, host in enumerate(hosts):
            by_host.setdefault(host, []).append(r)
        groups = sorted(by_host.values())  # by lowest rank: the same order on every rank
        self._host_of = {r: index for index, members in enumerate(groups) for r in members}
        self._hosts = [tuple(members) for members in groups]
        self._members = self._hosts[self._host_of[rank]]
        self._leader_ranks = tuple(members[0] for members in groups)
        # The host-by-host reduce_scatter and all_gather need every host to hold the same number of consecutive
        # ranks (as `ferro run` numbers them), so that a host's parts are one block and the leaders' blocks equal.
        per_host = len(self._members)
        self._equal_runs = all(members == tuple(range(index * per_host, (index + 1) * per_host))
                               for index, members in enumerate(self._hosts))
        # Large collectives are cut into pieces so that the links carry one piece while shared memory reduces
        # the next; only worth it where some host has ranks to reduce. Every rank decides alike, from the hosts.
        self._pipelines = len(self._hosts) > 1 and any(len(members) > 1 for members in self._hosts)

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
    def local_group(self) -> ShmBackend | None:
        """The shared-memory group of this rank's host (None when the host has one rank)."""
        return self._local

    @property
    def leader_group(self) -> TcpBackend | None:
        """The TCP mesh among the hosts' leaders, on a leader of a multi-host group (else None).

        Algorithms that compress what crosses hosts (see
        :class:`ferro.parallel.Int8CompressHook`) reduce inside each host over
        :attr:`local_group`, exchange among the leaders here, and broadcast back.
        """
        return self._leaders

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

    def frames_waiting(self, sources: Sequence[int]) -> list[int]:
        """Return the sources whose next frame has begun to arrive on the mesh (see :meth:`Backend.frames_waiting`)."""
        return self._world.frames_waiting(sources)

    def sendrecv_tagged(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, kind: int, fingerprint: int,
                        timeout: float | None = None) -> None:
        """Exchange frames over the TCP mesh (see :meth:`Backend.sendrecv_tagged`)."""
        self._world.sendrecv_tagged(send_buf, dst, recv_buf, src, kind=kind, fingerprint=fingerprint,
                                    timeout=timeout)

    # --- collectives: host, leaders, host ----------------------------------------------

    def exchange_shape(self, nbytes: int, world_size: int) -> tuple[int, int]:
        """Return the leaders' exchange: a piece of the buffer (all of it below 2 MiB), among the hosts.

        So the algorithm is chosen for the group that runs it: among 8 hosts of 2 ranks, a 4 MiB allreduce's
        leaders run 512 KiB pieces among 8, not 4 MiB among 16.
        """
        if self.runs_flat("allreduce", nbytes):
            return nbytes, world_size
        return leaders_call("allreduce", nbytes, len(self._members), self._pipelines)[0], len(self._hosts)

    def native_allreduce(self, flat: Any, dtype: DType, op: ReduceOp, fingerprint: int, timeout: float,
                         algorithm: str) -> bool:
        """Reduce onto each host's leader (shared memory), allreduce among leaders (TCP), broadcast back.

        Large buffers go piece by piece (see :meth:`_pipeline`): while the
        leaders exchange one piece, shared memory reduces the next and
        broadcasts the one before.
        """
        self._world._usable("allreduce")
        if self.runs_flat("allreduce", flat.nbytes):
            return self._world.native_allreduce(flat, dtype, op, fingerprint, timeout, algorithm)
        combine = ReduceOp.SUM if op is ReduceOp.MEAN else op
        local, leaders = self._local, self._leaders
        pieces = self._pieces(flat.size, flat.nbytes)
        cuts = [flat.size * k // pieces for k in range(pieces + 1)]
        deadline = time.monotonic() + timeout

        def reduce_piece(k: int) -> None:
            if local is not None:
                local.native_reduce(flat[cuts[k]:cuts[k + 1]], 0, dtype, combine, fingerprint, _left(deadline))

        def exchange_piece(k: int) -> None:
            if leaders is not None:
                leaders.native_allreduce(flat[cuts[k]:cuts[k + 1]], dtype, combine, fingerprint, _left(deadline),
                                         algorithm)

        def broadcast_piece(k: int) -> None:
            if local is not None:
                local.native_broadcast(flat[cuts[k]:cuts[k + 1]].view(np.uint8), 0, fingerprint, _left(deadline))

        self._pipeline(pieces, reduce_piece, exchange_piece, broadcast_piece)
        if op is ReduceOp.MEAN:
            # Every rank divides the same bits the same way, so the results stay identical.
            divide(flat, dtype.code, float(self.world_size), dtype.itemsize)
        return True

    def _pieces(self, count: int, nbytes: int) -> int:
        """:func:`pipeline_pieces`, or one (no pipelining) where no host has ranks to reduce."""
        return pipeline_pieces(count, nbytes) if self._pipelines else 1

    def _pipeline(self, pieces: int, before: Callable[[int], None], exchange: Callable[[int], None],
                  after: Callable[[int], None]) -> None:
        """Run ``before(k)``, ``exchange(k)`` and ``after(k)`` for every piece, overlapping the leaders' exchanges.

        ``before`` and ``after`` are a host's shared-memory steps and every rank of the host calls them, in one
        order: ``before(0), before(1), after(0), before(2), after(1), ...``. A leader runs ``exchange(k)`` on its
        exchange thread meanwhile, from the end of ``before(k)`` to the start of ``after(k)``, so the link carries
        piece ``k`` while shared memory works on its neighbours: one job per call, going from piece to piece as
        each becomes ready (:class:`~ferro.backend.hierarchy_plan.Relay`). The compiled calls release the GIL, so
        the two threads run side by side. A failure is raised once the exchange in flight has finished (each
        call has its timeout), so the groups are never left mid-call.
        """
        if pieces == 1 or self._local is None:
            for k in range(pieces):  # no shared-memory steps to overlap with: the same calls, in order
                before(k)
                exchange(k)
                after(k)
            return
        relay, job = Relay(), None  # a host's other ranks mark pieces ready for nobody: no thread, no exchange
        if self._leaders is not None:  # a leader: its exchanges run on its thread, one job per call
            if self._exchanger is None:
                self._exchanger = ThreadPoolExecutor(1, thread_name_prefix=f"ferro-leaders-r{self.rank}")
            job = self._exchanger.submit(exchange_all, relay, pieces, exchange)
        try:
            for k in range(pieces + 1):
                if k < pieces:
                    before(k)
                    relay.ready(k)
                if k > 0:
                    if job is not None and not relay.wait_exchanged(k - 1):
                        job.result()  # the exchange failed: its error
                        # Never reached (the thread stops short only on an error); never broadcast a stale piece.
                        raise DistributedError(f"rank {self.rank}: the leaders' exchange stopped before piece {k - 1}")
                    after(k - 1)
        finally:
            if job is not None:
                relay.abandon()
                job.exception()  # wait for an exchange in flight; an error already raised here is the one reported

    def native_broadcast(self, flat: Any, root: int, fingerprint: int, timeout: float) -> bool:
        """Broadcast inside the root's host, then among leaders, then inside every other host."""
        self._world._usable("broadcast")
        if self.runs_flat("broadcast", flat.nbytes):
            return self._world.native_broadcast(flat, root, fingerprint, timeout)
        root_host = self._host_of[root]
        mine = self._host_of[self._world.rank]
        if mine == root_host and self._local is not None:
            self._local.native_broadcast(flat, self._members.index(root), fingerprint, timeout)
        if self._leaders is not None:
            self._leaders.native_broadcast(flat, root_host, fingerprint, timeout)
        if mine != root_host and self._local is not None:
            self._local.native_broadcast(flat, 0, fingerprint, timeout)
        return True

    def native_reduce(self, flat: Any, root: int, dtype: DType, op: ReduceOp, fingerprint: int,
                      timeout: float) -> bool:
        """Reduce inside every host onto its leader, among the leaders onto the root's host, then to the root.

        The leaders' reduce is the TCP mesh's (a binomial tree or the ring and a gather, by its cost forms), so
        each host's link carries one partial result instead of one per rank. When the root is not its host's
        leader, the leader hands the result over in shared memory (a broadcast inside that host). Not pipelined:
        the three steps run in turn.
        """
        self._world._usable("reduce")
        if self.runs_flat("reduce", flat.nbytes):
            return self._world.native_reduce(flat, root, dtype, op, fingerprint, timeout)
        combine = ReduceOp.SUM if op is ReduceOp.MEAN else op
        root_host, mine = self._host_of[root], self._host_of[self._world.rank]
        deadline = time.monotonic() + timeout
        if self._local is not None:
            self._local.native_reduce(flat, 0, dtype, combine, fingerprint, _left(deadline))
        if self._leaders is not None:
            self._leaders.native_reduce(flat, root_host, dtype, combine, fingerprint, _left(deadline))
        if mine == root_host and self._local is not None and root != self._members[0]:
            self._local.native_broadcast(flat.view(np.uint8), 0, fingerprint, _left(deadline))
        if op is ReduceOp.MEAN and self._world.rank == root:
            divide(flat, dtype.code, float(self.world_size), dtype.itemsize)
        return True

    def _host_blocks(self, bounds: list[int]) -> list[int] | None:
        """Offsets of each host's block of parts (from ``bounds``), or None when hosts do not hold equal runs."""
        if not self._equal_runs:
            return None
        per_host = len(self._members)
        return [bounds[index * per_host] for index in range(len(self._hosts) + 1)]

    def _host_slices(self, blocks: list[int], itemsize: int) -> list[tuple[list[int], list[int]]]:
        """Cut every host's block (``blocks``: their offsets) into as many slices as :meth:`_pieces` says.

        Returns, per piece ``k``, the starts and ends of slice ``k`` of each
        host's block: what the leaders' ring takes for that piece.
        """
        hosts = range(len(self._hosts))
        sizes = [blocks[h + 1] - blocks[h] for h in hosts]
        pieces = self._pieces(min(sizes) or 1, (blocks[-1] - blocks[0]) * itemsize)
        return [([blocks[h] + sizes[h] * k // pieces for h in hosts],
                 [blocks[h] + sizes[h] * (k + 1) // pieces for h in hosts]) for k in range(pieces)]

    def _leaders_ring(self, flat: Any, slices: list[tuple[list[int], list[int]]], dtype: DType,
                      op: ReduceOp | None, fingerprint: int, deadline: float) -> Callable[[int], None]:
        """Return the leaders' step of piece ``k``: their ring over slice ``k`` of every host's block (else a no-op)."""
        leaders = self._leaders

        def exchange_piece(k: int) -> None:
            if leaders is not None:
                starts, ends = slices[k]
                leaders.ring_pieces(flat, starts, ends, dtype=dtype, op=op, fingerprint=fingerprint,
                                    timeout=_left(deadline))

        return exchange_piece

    def _leaders_gather(self, flat: Any, blocks: list[int], fingerprint: int, deadline: float) -> Callable[[int], None]:
        """Return the leaders' step of an all_gather in one piece: their mesh's all_gather of the hosts' blocks.

        The mesh chooses by its cost forms: Bruck's ``ceil(log2 H)`` rounds while small, not the ring's ``H - 1``.
        """
        leaders = self._leaders

        def exchange_piece(k: int) -> None:
            if leaders is not None:
                leaders.native_all_gather(flat, blocks, fingerprint, _left(deadline))

        return exchange_piece

    def native_reduce_scatter(self, flat: Any, bounds: list[int], dtype: DType, op: ReduceOp, fingerprint: int,
                              timeout: float) -> bool:
        """Sum inside each host onto its leader, reduce-scatter host blocks among the leaders, hand each rank its part.

        Only the partial sums of other hosts' blocks cross the links, ``(H-1)/H`` of the buffer, where a ring over
        every rank sends ``(n-1)/n``. Large buffers go in pieces, a slice of every host's block at a time, the
        leaders' ring over one slice overlapping the host's sums of the next (see :meth:`_pipeline`). Hosts of
        unequal or interleaved ranks, and calls that go flat (:meth:`runs_flat`), take the TCP mesh's ring.
        """
        return self._reduce_scatter(None, flat, bounds, dtype, op, fingerprint, timeout)

    def native_reduce_scatter_from(self, source: Any, flat: Any, bounds: list[int], dtype: DType, op: ReduceOp,
                                   fingerprint: int, timeout: float) -> bool:
        """:meth:`native_reduce_scatter`, copying each slice of ``source`` into ``flat`` just before its piece's sums.

        The copy of a large input then runs behind the leaders' exchange of the
        piece before, instead of in front of the whole call (on 2 hosts x 2
        ranks at 1 Gbit, the up-front copy of 64 MiB took a tenth of the call).
        """
        return self._reduce_scatter(source, flat, bounds, dtype, op, fingerprint, timeout)

    def _reduce_scatter(self, source: Any, flat: Any, bounds: list[int], dtype: DType, op: ReduceOp,
                        fingerprint: int, timeout: float) -> bool:
        blocks = self._host_blocks(bounds)
        if blocks is None or (self._local is None and self._leaders is None) or self.runs_flat(
                "reduce_scatter", flat.nbytes):
            if source is None:
                return self._world.native_reduce_scatter(flat, bounds, dtype, op, fingerprint, timeout)
            return self._world.native_reduce_scatter_from(source, flat, bounds, dtype, op, fingerprint, timeout)
        self._world._usable("reduce_scatter")
        combine = ReduceOp.SUM if op is ReduceOp.MEAN else op
        local = self._local
        mine = self._host_of[self._world.rank]
        slices = self._host_slices(blocks, dtype.itemsize)
        deadline = time.monotonic() + timeout

        def reduce_piece(k: int) -> None:
            for start, end in zip(*slices[k], strict=True):
                if source is not None:
                    np.copyto(flat[start:end], source[start:end])
                if local is not None:
                    local.native_reduce(flat[start:end], 0, dtype, combine, fingerprint, _left(deadline))

        def broadcast_piece(k: int) -> None:
            if local is not None:
                starts, ends = slices[k]
                local.native_broadcast(flat[starts[mine]:ends[mine]].view(np.uint8), 0, fingerprint,
                                       _left(deadline))

        self._pipeline(len(slices), reduce_piece,
                       self._leaders_ring(flat, slices, dtype, combine, fingerprint, deadline), broadcast_piece)
        if op is ReduceOp.MEAN:
            part = flat[bounds[self._world.rank]:bounds[self._world.rank + 1]]
            divide(part, dtype.code, float(self.world_size), dtype.itemsize)
        return True

    def native_all_gather(self, flat: Any, bounds: list[int], fingerprint: int, timeout: float) -> bool:
        """Gather each host's block over shared memory, the blocks among the leaders, and hand them out in each host.

        Each host receives the ``(H-1)/H`` of the result held elsewhere once, where a ring over every rank passes
        ``(n-1)/n`` over each link. Large buffers go in pieces, as :meth:`native_reduce_scatter` does. Hosts of
        unequal or interleaved ranks, and calls that go flat, take the TCP mesh (Bruck's rounds or the ring).
        """
        blocks = self._host_blocks(bounds)
        if blocks is None or (self._local is None and self._leaders is None) or self.runs_flat(
                "all_gather", flat.nbytes):
            return self._world.native_all_gather(flat, bounds, fingerprint, timeout)
        self._world._usable("all_gather")
        local = self._local
        mine = self._host_of[self._world.rank]
        parts = [bounds[rank] for rank in (*self._members, self._members[-1] + 1)]  # this host's ranks' parts
        slices = self._host_slices(blocks, 1)
        deadline = time.monotonic() + timeout

        def gather_piece(k: int) -> None:
            if local is not None:
                starts, ends = slices[k]
                low, high = starts[mine], ends[mine]
                local_bounds = [min(max(offset, low), high) - low for offset in parts]
                local.native_all_gather(flat[low:high], local_bounds, fingerprint, _left(deadline))

        def broadcast_piece(k: int) -> None:
            if local is not None:
                for host, (start, end) in enumerate(zip(*slices[k], strict=True)):
                    if host != mine:
                        local.native_broadcast(flat[start:end], 0, fingerprint, _left(deadline))

        exchange = (self._leaders_ring(flat, slices, BYTES, None, fingerprint, deadline) if len(slices) > 1
                    else self._leaders_gather(flat, blocks, fingerprint, deadline))
        self._pipeline(len(slices), gather_piece, exchange, broadcast_piece)
        return True

    def native_all_to_all(self, send: Any, send_offsets: list[int], recv: Any, recv_offsets: list[int],
                          fingerprint: int, timeout: float, even: bool = False) -> bool:
        """All-to-all; for equal blocks in two levels: shared memory, the leaders, shared memory.

        Each host's sends meet over shared memory, the leaders exchange one message per pair of hosts, and each
        host hands the arrivals out over shared memory: ``H - 1`` messages per leader instead of ``R (n - R)``
        per host over the links, the same bytes between hosts. Where it runs, and why, is
        :func:`~ferro.backend.hierarchy_plan.two_level_all_to_all`'s; uneven calls and hosts of unequal or
        interleaved ranks take the mesh.
        """
        per_host = len(self._members)
        block = send_offsets[1] - send_offsets[0] if len(send_offsets) > 1 else 0
        local = self._local
        if not even or local is None or self.runs_flat("all_to_all", block * self.world_size):
            return self._world.native_all_to_all(send, send_offsets, recv, recv_offsets, fingerprint, timeout,
                                                 even=even)
        self._world._usable("all_to_all")
        n, hosts = self._world.world_size, len(self._hosts)
        mine, local_index = self._host_of[self._world.rank], self._members.index(self._world.rank)
        deadline = time.monotonic() + timeout
        # 1. Every rank of the host holds every local rank's sends: [source rank][destination host][its rank].
        sends = np.empty((per_host, hosts, per_host, block), np.uint8)
        sends[local_index] = np.frombuffer(send, np.uint8, n * block).reshape(hosts, per_host, block)
        local.native_all_gather(sends.reshape(-1), [i * n * block for i in range(per_host + 1)], fingerprint,
                                _left(deadline))
        # 2. The leaders swap, per pair of hosts, what the R ranks of one send the R of the other:
        #    arrived[source host][source rank][destination rank].
        arrived = np.empty((hosts, per_host, per_host, block), np.uint8)
        if self._leaders is not None:
            outgoing = np.ascontiguousarray(sends.transpose(1, 0, 2, 3))
            share = per_host * per_host * block
            offsets = [h * share for h in range(hosts + 1)]
            self._leaders.native_all_to_all(outgoing.reshape(-1), offsets, arrived.reshape(-1), offsets, fingerprint,
                                            _left(deadline), even=True)
        if hosts == 1:  # no leaders' exchange: every rank already holds its host's sends
            arrived[mine] = sends[:, mine]
        else:  # 3. The leader hands the arrivals to its host; each rank keeps the blocks bound for it.
            local.native_broadcast(arrived.reshape(-1), 0, fingerprint, _left(deadline))
        np.frombuffer(recv, np.uint8, n * block)[:] = arrived[:, :, local_index].reshape(-1)
        return True

    @property
    def direct_mesh(self) -> Any:
        """The TCP mesh over every rank: the direct paths run the calls that go flat (:meth:`direct_takes`)."""
        return self._world.direct_mesh

    def direct_takes(self, op: str, nbytes: int) -> bool:
        """Whether a direct path may run this call: one that goes flat (:meth:`runs_flat`); never the barrier."""
        return op != "barrier" and self.runs_flat(op, nbytes)

    def runs_flat(self, op: str, nbytes: int) -> bool:
        """Whether a call of ``op`` on ``nbytes`` runs on the TCP mesh over every rank rather than in two levels.

        :func:`~ferro.backend.hierarchy_plan.runs_flat`'s rules, with this job's hosts: below
        :func:`~ferro.backend.hierarchy_plan.flat_below_bytes` (where some machine's ranks outnumber its cores),
        and for broadcast and reduce, hosts of equal runs of ranks and the mesh's choice. ``nbytes`` as
        :meth:`plan_name` takes it; every rank decides alike.
        """
        if op in ("all_gather", "reduce_scatter", "all_to_all") and not self._equal_runs:
            return True  # a host's parts are not one block: the mesh's plans
        # The chain goes flat through equal runs of ranks only: through interleaved hosts it crosses links often.
        flat_plan = self._world.direct_mesh.choose(op, nbytes) if op in ("broadcast", "reduce") else ""
        return runs_flat(op, flat_plan if self._equal_runs else "", len(self._members), nbytes, self.world_size,
                         self._flat_below)

    def plan_name(self, op: str, nbytes: int) -> str:
        """Name the plan a call of ``op`` (not allreduce) on ``nbytes`` runs, as ``ferro bench`` prints it on its rows.

        ``"two-level X"``: inside the hosts over shared memory and ``X`` among the leaders (their plan, named as
        a TCP group names it; this rank's leader group decides, so a rank that is not a leader says
        ``"two-level"`` alone); else the TCP mesh's plan over every rank. ``nbytes`` is what ``ferro bench``
        sizes: the buffer, the all_gather's output, the all_to_all's bytes sent per rank.
        """
        if op == "allreduce":  # chosen by the collective layer, for exchange_shape()
            raise ValueError("name the allreduce's plan with resolve_allreduce_algorithm(*exchange_shape(...))")
        if self.runs_flat(op, nbytes):
            return "ring" if op == "reduce_scatter" else self._world.direct_mesh.choose(op, nbytes)
        leaders_bytes, ring = leaders_call(op, nbytes, len(self._members), self._pipelines)
        if ring:
            return "two-level ring"  # the leaders' ring over the hosts' blocks, a slice at a time (_leaders_ring)
        if self._leaders is None:
            return "two-level"
        return f"two-level {self._leaders.direct_mesh.choose(op, leaders_bytes)}"

    def _counters(self) -> dict[int, tuple[int, int, int]]:
        # Calls are counted on this group; the bytes by the three groups that move them.
        parts = [part.state.counters() for part in (self._world, self._local, self._leaders) if part is not None]
        return add_counters(self.state.counters(), *parts)

    def reset_stats(self) -> None:
        """Zero this rank's communication counters (and those of the groups inside)."""
        for part in (self, self._world, self._local, self._leaders):
            if part is not None:
                part.state.reset_counters()

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
        if self._exchanger is not None:
            # Without waiting: the groups' sockets are closed, which ends an exchange in flight at once.
            self._exchanger.shutdown(wait=False)


def _left(deadline: float) -> float:
    """Seconds left to a pipelined collective's deadline (a sliver once it has passed, so the next call times out)."""
    return max(deadline - time.monotonic(), 1e-3)
