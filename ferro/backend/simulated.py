"""In-process ranks on threads: the same semantics and errors as TCP, without sockets.

For fast tests of code built on ferro, ferro's own and users' alike.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ferro._buffers import byte_view
from ferro._core.status import KIND_ABORT, KIND_BARRIER, abort_error, mismatch_error, size_error
from ferro.backend.base import FramedBackend, Support, dissemination_barrier
from ferro.errors import BackendClosedError, DistributedTimeoutError, PeerLostError
from ferro.rendezvous.settings import default_timeout, validate_rank_and_size

__all__ = ["SimulatedBackend"]


@dataclass
class _Message:
    kind: int
    fingerprint: int
    payload: bytes
    seq: int


class _World:
    """The shared state of one simulated group: a FIFO per ordered pair of ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.cond = threading.Condition()
        pairs = [(s, d) for s in range(world_size) for d in range(world_size) if s != d]
        self.queues: dict[tuple[int, int], deque[_Message]] = {pair: deque() for pair in pairs}
        self.next_seq = {pair: 0 for pair in self.queues}
        self.closed = [False] * world_size
        self.children: dict[tuple[tuple[int, ...], int], _World] = {}

    def abort(self) -> None:
        """Close every rank at once, waking all waiters (used when one rank fails)."""
        with self.cond:
            self.closed = [True] * self.world_size
            self.cond.notify_all()
            children = list(self.children.values())
        for child in children:
            child.abort()


class SimulatedBackend(FramedBackend):
    """One rank of a group whose ranks are threads of this process.

    Messages are copied at send time (the sender may reuse its buffer at once)
    and queued per pair of ranks; a receive checks kind and size before it
    takes a message, so a refused message stays queued, exactly as on TCP.
    When a rank closes, its peers still receive what it had sent, then raise
    :class:`~ferro.PeerLostError`.

    Create the ranks together with :meth:`create_group` and give each to its own thread.

    Example::

        group = SimulatedBackend.create_group(2)
        def rank_main(g):
            if g.rank == 0:
                g.send(numpy.ones(3), dst=1)
            else:
                out = numpy.empty(3); g.recv(out, src=0)   # out == [1, 1, 1]
        threads = [threading.Thread(target=rank_main, args=(g,)) for g in group]
    """

    SUPPORT: ClassVar[Support] = Support(
        devices="CPU, every rank a thread of one process",
        asynchronous="yes, in order on the group's worker")

    # Its ranks are threads by construction (named differently, or not at all): calls are matched
    # per rank, as one stream each, without thread tags.
    tags_threads = False


    def __init__(self, world: _World, rank: int, timeout: float) -> None:
        self._world = world
        self._rank = rank
        self._timeout = timeout
        self._split_counts: dict[tuple[int, ...], int] = {}

    @classmethod
    def create_group(cls, world_size: int, *, timeout: float | None = None) -> list[SimulatedBackend]:
        """Create the ``world_size`` ranks of a new simulated group, in rank order.

        Raises:
            InvalidWorldSizeError: ``world_size`` is not a positive integer.

        """
        validate_rank_and_size(0, world_size)
        world = _World(world_size)
        seconds = default_timeout(timeout)
        return [cls(world, rank, seconds) for rank in range(world_size)]

    @property
    def rank(self) -> int:
        """The rank this object plays."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self._world.world_size

    @property
    def timeout(self) -> float:
        """Default seconds for blocking operations."""
        return self._timeout

    @property
    def closed(self) -> bool:
        """Whether this rank was closed (by itself, or by an abort of the group)."""
        return self._world.closed[self._rank]

    def abort(self) -> None:
        """Close every rank of the group at once (the test harness does this when a rank fails)."""
        self._world.abort()

    def _usable(self, op: str) -> None:
        if self._world.closed[self._rank]:
            raise BackendClosedError(f"rank {self._rank}: {op}: this process group was closed")

    def _post(self, payload: bytes, dst: int, kind: int, op: str, fingerprint: int = 0) -> None:
        world = self._world
        with world.cond:
            if world.closed[dst]:
                # A peer that gave up first may have told us why before closing: that is the cause to report
                # (over TCP the notice arrives ahead of the close on the same stream).
                notice = self._queued_abort(f"rank {self._rank}: {op} to rank {dst}")
                if notice is not None:
                    raise notice
                raise PeerLostError(
                    f"rank {self._rank}: {op} to rank {dst}: rank {dst} closed the connection "
                    f"(it exited, crashed or closed its group)", dst)
            pair = (self._rank, dst)
            world.queues[pair].append(_Message(kind, fingerprint, payload, world.next_seq[pair]))
            world.next_seq[pair] += 1
            world.cond.notify_all()
        self.state.count_bytes(kind, fingerprint, len(payload), 0)

    def _queued_abort(self, where: str) -> BaseException | None:
        """Return the error of the first abort notice waiting for this rank (call with the world's lock held)."""
        for src in range(self.world_size):
            queue = self._world.queues.get((src, self._rank)) if src != self._rank else None
            for message in queue or ():
                if message.kind == KIND_ABORT:
                    queue.remove(message)  # type: ignore[union-attr]
                    return abort_error(message.payload, src, where)
        return None

    def _take(self, out: memoryview, src: int, kind: int, timeout: float, op: str, fingerprint: int = 0) -> None:
        world = self._world
        queue = world.queues[(src, self._rank)]
        where = f"rank {self._rank}: {op} from rank {src}"
        deadline = time.monotonic() + timeout
        with world.cond:
            while not queue:
                if world.closed[self._rank]:
                    raise BackendClosedError(f"{where}: this process group was closed")
                if world.closed[src]:
                    notice = self._queued_abort(where)
                    if notice is not None:
                        raise notice
                    raise PeerLostError(
                        f"{where}: rank {src} closed the connection (it exited, crashed or closed its group)", src)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DistributedTimeoutError(
                        f"{where} timed out after {timeout:g} s; no message was consumed", src)
                world.cond.wait(remaining)
            message = queue[0]
            if message.kind == KIND_ABORT and kind != KIND_ABORT:
                queue.popleft()
                raise abort_error(message.payload, src, where)
            if message.kind != kind or message.fingerprint != fingerprint:
                raise mismatch_error(where, src, kind, fingerprint, message.kind, message.fingerprint, message.seq)
            if len(message.payload) != out.nbytes:
                raise size_error(where, src, len(message.payload), out.nbytes, True, message.seq)
            queue.popleft()
        out[:] = message.payload
        self.state.count_bytes(kind, fingerprint, 0, len(message.payload))

    def frames_waiting(self, sources: Sequence[int]) -> list[int]:
        """Return the sources with a message queued for this rank, or closed (see :meth:`Backend.frames_waiting`)."""
        self._usable("recv")
        world = self._world
        with world.cond:
            return [src for src in sources if world.queues[(src, self._rank)] or world.closed[src]]

    def send_tagged(self, buf: Any, dst: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Queue a tagged copy of ``buf`` (see :meth:`Backend.send_tagged`)."""
        self._usable("send")
        dst = self.check_peer(dst, "send")
        self._post(byte_view(buf, "send", writable=False).tobytes(), dst, kind, "send", fingerprint)

    def recv_tagged(self, buf: Any, src: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Take the next message, refusing another kind or fingerprint (see :meth:`Backend.recv_tagged`)."""
        self._usable("recv")
        src = self.check_peer(src, "recv")
        out = byte_view(buf, "recv", writable=True)
        self._take(out, src, kind, self._timeout if timeout is None else timeout, "recv", fingerprint)

    def sendrecv_tagged(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, kind: int, fingerprint: int,
                        timeout: float | None = None) -> None:
        """Post the send, then take the receive: sends never block here, so no helper thread is needed."""
        self._usable("sendrecv")
        dst = self.check_peer(dst, "sendrecv")
        src = self.check_peer(src, "sendrecv")
        out = byte_view(recv_buf, "sendrecv", writable=True)
        self._post(byte_view(send_buf, "sendrecv", writable=False).tobytes(), dst, kind, "sendrecv", fingerprint)
        self._take(out, src, kind, self._timeout if timeout is None else timeout, "sendrecv", fingerprint)

    def abort_peers(self, payload: bytes) -> None:
        """Queue an abort notice for every peer that is still open."""
        for peer in range(self.world_size):
            if peer != self._rank and not self._world.closed[peer]:
                self._post(payload, peer, KIND_ABORT, "abort")

    def barrier(self, *, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier (dissemination algorithm)."""
        self._usable("barrier")
        seconds = self._timeout if timeout is None else timeout
        sink = memoryview(bytearray(0))

        def exchange(dst: int, src: int) -> None:
            self._post(b"", dst, KIND_BARRIER, "barrier")
            self._take(sink, src, KIND_BARRIER, seconds, "barrier")

        dissemination_barrier(self._rank, self.world_size, exchange)

    def split(self, ranks: Sequence[int], *, timeout: float | None = None) -> SimulatedBackend:
        """Create (or join) the simulated group among ``ranks`` (see :meth:`Backend.split`)."""
        self._usable("new_group")
        members = tuple(ranks)
        count = self._split_counts.get(members, 0) + 1
        self._split_counts[members] = count
        world = self._world
        with world.cond:
            child = world.children.setdefault((members, count), _World(len(members)))
        return SimulatedBackend(child, members.index(self._rank), self._timeout if timeout is None else timeout)

    def close(self) -> None:
        """Close this rank; peers waiting on it raise PeerLostError once its queued messages are read."""
        world = self._world
        with world.cond:
            world.closed[self._rank] = True
            world.cond.notify_all()
