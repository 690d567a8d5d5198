"""The shared-memory process group: ranks on one host exchange frames through rings in one segment."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from ferro import environment
from ferro._buffers import as_buffer
from ferro._core.arena import Arena, arena_bytes
from ferro._core.shm import SEGMENT_HEADER_BYTES, Channel, Segment, segment_bytes
from ferro._core.transport import KIND_ABORT, KIND_BARRIER
from ferro.backend.base import SHM_YIELD_US, Support, default_spin_us, default_yield_us, usable_cpus
from ferro.backend.joined import JoinSpec, StoreBackend
from ferro.backend.native import NativeCollectives
from ferro.errors import ConfigurationError, DistributedError, DistributedTimeoutError, PeerLostError
from ferro.rendezvous.connect import time_left, wait_for_ranks
from ferro.rendezvous.settings import default_timeout, validate_rank_and_size
from ferro.rendezvous.store import Store
from ferro.types import DType, ReduceOp, describe_fingerprint

__all__ = ["SEGMENT_PREFIX", "ShmBackend", "process_alive", "remove_segments_of"]

SHM_DIR = "/dev/shm"
# Segments are named ferro-<creator pid>-<random hex>: the pid tells a stale one from a live one.
SEGMENT_PREFIX = "ferro"
RING_ENV = "FERRO_SHM_RING_BYTES"
DEFAULT_RING_BYTES = 4 * 1024 * 1024
BUFFER_ENV = "FERRO_SHM_BUFFER_BYTES"
# Each rank's slot holds two buffers of this size: the chunk of large collectives. Measured on a
# 2-core EPYC VM (DESIGN.md, "Shared memory"): with 2 ranks, 64 KiB to 512 KiB perform alike (256 KiB:
# 16 MiB in ~2.0 ms, 64 MiB in ~8.2 ms). When ranks outnumber cores every phase costs a context
# switch, so fewer, longer phases pay: with 4 ranks on 2 cores 1 MiB beat 256 KiB by ~10% at 64 MiB.
DEFAULT_BUFFER_BYTES = 256 * 1024
OVERSUBSCRIBED_BUFFER_BYTES = 1024 * 1024
# Up to this size an allreduce takes one phase (every rank reduces every slot) instead of two.
SMALL_ALLREDUCE_BYTES = 16 * 1024
PAGE = 4096


def _sweep_stale_segments() -> None:
    """Remove segments whose creating process died before it could unlink them (killed during set-up).

    A segment's name carries its creator's pid; only this user's segments with
    a dead creator are removed, so a live job's segments are never touched.
    """
    _remove_segments(lambda creator: not process_alive(creator))


def remove_segments_of(pid: int) -> list[str]:
    """Remove this user's segments that process ``pid`` created (a launcher calls this once that rank has ended).

    Returns:
        The paths removed.

    """
    return _remove_segments(lambda creator: creator == pid)


def _remove_segments(created_by: Callable[[int], bool]) -> list[str]:
    """Unlink this user's ``ferro-<pid>-<hex>`` segments whose creator's pid passes ``created_by``."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != SEGMENT_PREFIX or not parts[1].isdigit():
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid == os.getuid() and created_by(int(parts[1])):
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue  # gone meanwhile
    return removed


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts: it is alive, just not ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


@contextlib.contextmanager
def _unlinked_on_exit(path: str) -> Iterator[None]:
    """Unlink ``path`` when the block ends, however it ends: by an exception, or by SIGTERM or SIGHUP.

    A signal that would end the process (its default action) first unlinks the
    path and then ends it as it would have; a handler the program installed
    still runs, after the unlink. Handlers can only be installed from the main
    thread; elsewhere a killed rank's segment is removed by the next group set
    up on this host, or by ``ferro run`` once the rank has ended.
    """
    previous: dict[int, Any] = {}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        previous.clear()

    def on_signal(signum: int, frame: Any) -> None:
        _unlink_quietly(path)
        handler = previous.get(signum, signal.SIG_DFL)
        restore()
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # end the process as the signal would have

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, on_signal)
    try:
        yield
    finally:
        _unlink_quietly(path)
        restore()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _size_setting(value: int | None, env: str, default: int, what: str) -> int:
    if value is None:
        raw = environment.get(env)
        try:
            value = int(raw) if raw else default
        except ValueError:
            raise ConfigurationError(f"${env} must be a number of bytes, got {raw!r}") from None
    if value < PAGE:
        raise ConfigurationError(f"shared-memory {what} need at least {PAGE} bytes, got {value}")
    return value


def _buffer_bytes(buffer_bytes: int | None, world_size: int) -> int:
    crowded = world_size > usable_cpus()
    default = OVERSUBSCRIBED_BUFFER_BYTES if crowded else DEFAULT_BUFFER_BYTES
    return _size_setting(buffer_bytes, BUFFER_ENV, default, "slot buffers")


def _layout(world_size: int, ring_bytes: int, buffer_bytes: int) -> tuple[int, int]:
    """Where the arena starts and how large the segment is."""
    arena_offset = -(-segment_bytes(world_size, ring_bytes) // PAGE) * PAGE
    return arena_offset, arena_offset + arena_bytes(world_size, buffer_bytes)


class ShmBackend(StoreBackend, NativeCollectives):
    """A process group whose ranks share one host and talk through shared memory.

    Rank 0 creates the segment with owner-only permissions, under a random name
    that only the job's authenticated store hands out; every rank maps it, and
    rank 0 unlinks it as soon as all have, so nothing is left in ``/dev/shm``
    however the ranks end. A rank that exits (or is killed) is noticed by its
    peers within a millisecond of waiting: they raise :class:`~ferro.PeerLostError`.

    Args:
        rank: This process's rank.
        world_size: Number of ranks (all on this host).
        master_addr: Address of the rendezvous store.
        master_port: Port of the rendezvous store.
        timeout: Default seconds for blocking operations.
        secret: The job secret (default ``$FERRO_SECRET``).
        store: An existing store client to rendezvous through.
        ring_bytes: Capacity of each rank-to-rank ring (default 4 MiB, ``$FERRO_SHM_RING_BYTES``).
        buffer_bytes: Size of each of the two buffers in a rank's collective slot (default 256 KiB, or
            1 MiB when ranks outnumber the cores; ``$FERRO_SHM_BUFFER_BYTES``): the chunk size of large
            collectives.
        spin_us: Microseconds to spin before yielding the CPU while waiting (default
            ``$FERRO_SPIN_US``, else 50, or 0 when ranks outnumber the cores).
        yield_us: Without a spin, microseconds a quiet wait keeps calling ``sched_yield()`` before it naps
            (default ``$FERRO_YIELD_US``, else 1000, or 0 past four ranks a core).
        close_store: Close a given ``store`` with the group (it becomes the group's own).

    Raises:
        ConfigurationError: As :class:`~ferro.TcpBackend`.
        InvalidRankError: As :class:`~ferro.TcpBackend`.
        InvalidWorldSizeError: As :class:`~ferro.TcpBackend`.
        DistributedTimeoutError: As :class:`~ferro.TcpBackend`.
        AuthenticationError: As :class:`~ferro.TcpBackend`.

    """

    SUPPORT: ClassVar[Support] = Support(engine_kind="a compiled shared-memory arena, without the GIL")

    store_namespace = "shm"

    def __init__(self, rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500, *,
                 timeout: float | None = None, secret: bytes | str | None = None, store: Store | None = None,
                 ring_bytes: int | None = None, buffer_bytes: int | None = None, spin_us: float | None = None,
                 close_store: bool = False, yield_us: float | None = None) -> None:
        validate_rank_and_size(rank, world_size)  # before anything uses them
        ring = _size_setting(ring_bytes, RING_ENV, DEFAULT_RING_BYTES, "rings")
        buffer = _buffer_bytes(buffer_bytes, world_size)
        spin = default_spin_us(spin_us, world_size)
        yielding = default_yield_us(yield_us, world_size, SHM_YIELD_US)
        self._join(rank, world_size, master_addr, master_port, timeout, secret, store, close_store,
                   lambda: self._attach(ring, buffer, spin, yielding))

    @classmethod
    def join(cls, spec: JoinSpec) -> ShmBackend:
        """Join the job described by ``spec`` (the backend registry's entry point; ``bind_addr`` is unused)."""
        return cls(spec.rank, spec.world_size, spec.master_addr, spec.master_port, timeout=spec.timeout,
                   secret=spec.secret, store=spec.store, close_store=spec.close_store)

    def _attach(self, ring_bytes: int, buffer_bytes: int, spin_us: float, yield_us: float) -> None:
        rank, world_size, store, prefix = self._rank, self._world_size, self._store, self._prefix
        deadline = self._deadline
        arena_offset, size = _layout(world_size, ring_bytes, buffer_bytes)
        if rank == 0:
            _sweep_stale_segments()
            path = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}-{os.getpid()}-{secrets.token_hex(8)}")
            with _unlinked_on_exit(path):  # even by SIGTERM/SIGHUP: the window until every rank has mapped it
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, size)  # sized before anyone learns the name
                    mapping = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
                store.set(f"{prefix}/segment", path, timeout=time_left(deadline, rank, "publishing the segment"))
                segment = Segment(mapping, world_size, ring_bytes)
                segment.register(rank, os.getpid())
                # Every rank reports once it has mapped the segment: the name may go once all have.
                wait_for_ranks(store, {r: f"{prefix}/mapped/{r}" for r in range(1, world_size)}, deadline, rank,
                               "map the shared-memory segment")
        else:
            path = store.get(f"{prefix}/segment", timeout=time_left(deadline, rank, "waiting for rank 0's segment")
                             ).decode()
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise PeerLostError(f"rank {rank}: rank 0 removed its shared-memory segment before this rank could "
                                    f"map it (rank 0 gave up or was stopped during set-up)", 0) from None
            try:
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            segment = Segment(mapping, world_size, ring_bytes)
            segment.register(rank, os.getpid())
            # This rank's last use of the store: rank 0 waits for every report, so it never closes
            # the store (with its group) while another rank still needs it.
            store.set(f"{prefix}/mapped/{rank}", b"1", timeout=time_left(deadline, rank, "reporting the mapping"))
        self._ring_bytes, self._buffer_bytes, self._spin_us = ring_bytes, buffer_bytes, spin_us
        self._yield_us = yield_us
        self._mapping, self._segment = mapping, segment
        state = self.state
        self._arena = Arena(mapping, world_size, rank, SEGMENT_HEADER_BYTES, arena_offset, buffer_bytes, spin_us,
                            state, yield_us)
        self._arena.default_timeout = self._timeout
        self._arena.small_limit = min(SMALL_ALLREDUCE_BYTES, buffer_bytes)
        self._links = {peer: Channel(segment, rank, peer, spin_us, state, yield_us) for peer in range(world_size)
                       if peer != rank}
        # No rank returns before every rank is in: a group with a missing rank is no group.
        try:
            self._arena.barrier(time_left(deadline, rank, "waiting for every rank to map the segment"))
        except DistributedError as exc:
            self._release()
            raise type(exc)(f"rank {rank}: setting up the shared-memory group failed: not every rank of "
                            f"{world_size} joined it ({exc})") from exc

    # --- native collectives through the arena (ferro.backend.native) -----------------------

    @property
    def direct_arena(self) -> Arena:
        """The arena behind ``ferro.allreduce``'s direct path: one compiled call per allreduce."""
        return self._arena

    def native_allreduce(self, flat: Any, dtype: DType, op: ReduceOp, fingerprint: int, timeout: float,
                         algorithm: str) -> bool:
        """Allreduce through the arena, which chooses by size (``algorithm`` is TCP's hint)."""
        self._usable("allreduce")
        self._arena.allreduce(flat, dtype.code, op.kernel_code, dtype.itemsize, fingerprint, timeout,
                              self._divisor(op))
        return True

    def native_reduce(self, flat: Any, root: int, dtype: DType, op: ReduceOp, fingerprint: int,
                      timeout: float) -> bool:
        """Each rank reduces one part; the root gathers the parts."""
        self._usable("reduce")
        self._arena.allreduce(flat, dtype.code, op.kernel_code, dtype.itemsize, fingerprint, timeout,
                              self._divisor(op), root)
        return True

    def native_reduce_scatter(self, flat: Any, bounds: list[int], dtype: DType, op: ReduceOp, fingerprint: int,
                              timeout: float) -> bool:
        """Each rank reduces its own part, reading it straight from its peers' slots."""
        self._usable("reduce_scatter")
        self._arena.ring(flat, bounds, dtype.code, op.kernel_code, dtype.itemsize, fingerprint, timeout, True, False,
                         self._divisor(op))
        return True

    def native_all_gather(self, flat: Any, bounds: list[int], fingerprint: int, timeout: float) -> bool:
        """Each rank publishes its part; every rank copies the others' out."""
        self._usable("all_gather")
        self._arena.ring(flat, bounds, -1, 0, 1, fingerprint, timeout, False, True)
        return True

    def native_broadcast(self, flat: Any, root: int, fingerprint: int, timeout: float) -> bool:
        """Through the root's slot, a buffer at a time."""
        self._usable("broadcast")
        self._arena.broadcast(flat, root, fingerprint, timeout)
        return True

    def _divisor(self, op: ReduceOp) -> float:
        return float(self._world_size) if op is ReduceOp.MEAN else 0.0

    def recv_tagged(self, buf: Any, src: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Receive one frame (see :meth:`Backend.recv_tagged`); a timeout says if ``src`` sits in a collective.

        Collectives here run in the arena, not through the rings, so a receive
        matched against a peer's barrier cannot see a refused frame: it times out,
        and the error then names the collective the peer is waiting in.
        """
        try:
            super().recv_tagged(buf, src, kind=kind, fingerprint=fingerprint, timeout=timeout)
        except DistributedTimeoutError as exc:
            # A peer that gave up (its abort notice is what ended this wait) is waiting in nothing.
            waiting = None if self._closed or self._arena.peer_gave_up(src) else self._arena.peer_call(src)
            if waiting is None:
                raise
            peer_kind, peer_fingerprint = waiting
            call = "a barrier" if peer_kind == KIND_BARRIER else describe_fingerprint(peer_fingerprint)
            raise DistributedTimeoutError(
                f"{exc}; rank {src} is waiting in {call}, which this rank has not called: the ranks' calls "
                f"differ") from exc  # no peer: src is not frozen, the ranks' calls differ

    def sendrecv_tagged(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, kind: int, fingerprint: int,
                        timeout: float | None = None) -> None:
        """Write to ``dst`` and read from ``src`` in one loop, so rings of any size never deadlock."""
        self._usable("sendrecv")
        dst = self.check_peer(dst, "sendrecv")
        src = self.check_peer(src, "sendrecv")
        self._links[dst].exchange(as_buffer(send_buf, "sendrecv"), as_buffer(recv_buf, "sendrecv", writable=True),
                                  kind=kind, fingerprint=fingerprint, timeout=self._seconds(timeout),
                                     op="sendrecv", receive_from=self._links[src])

    def barrier(self, *, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier (one phase in the arena)."""
        self._usable("barrier")
        self._arena.barrier(self._seconds(timeout))

    def abort_peers(self, payload: bytes) -> None:
        """Post an abort notice in the arena, and in every peer's ring (one second each at most)."""
        self._arena.post_abort(payload)
        for channel in self._links.values():
            try:
                channel.send(payload, kind=KIND_ABORT, fingerprint=0, timeout=1.0, op="abort")
            except DistributedError:
                pass  # that peer is gone or its ring is full; it learns by its own timeout

    def split(self, ranks: Sequence[int], *, timeout: float | None = None) -> ShmBackend:
        """Create a segment of their own for ``ranks`` through this group's store (see :meth:`Backend.split`)."""
        self._usable("new_group")
        return ShmBackend.split_from(self, ranks, timeout=timeout, ring_bytes=self._ring_bytes,
                                     buffer_bytes=self._buffer_bytes, spin_us=self._spin_us, yield_us=self._yield_us)

    @classmethod
    def split_from(cls, parent: StoreBackend, ranks: Sequence[int], *, timeout: float | None = None,
                   ring_bytes: int | None = None, buffer_bytes: int | None = None,
                   spin_us: float | None = None, yield_us: float | None = None) -> ShmBackend:
        """Create a shared-memory group of ``ranks`` (all on this host) through ``parent``'s store.

        Every member calls it with the same ``ranks``; other ranks of ``parent`` need not.
        Sizes and waits default as in the constructor.
        """
        members = tuple(ranks)
        child = cls.__new__(cls)
        child._init_state(members.index(parent.rank), len(members), parent.store, False,
                          parent._split_prefix(members), parent._secret,
                          parent.timeout if timeout is None else default_timeout(timeout))
        child._attach(_size_setting(ring_bytes, RING_ENV, DEFAULT_RING_BYTES, "rings"),
                      _buffer_bytes(buffer_bytes, len(members)), default_spin_us(spin_us, len(members)),
                      default_yield_us(yield_us, len(members), SHM_YIELD_US))
        return child

    def _release(self) -> None:
        self._segment.mark_closed(self._rank)
        for channel in self._links.values():
            channel.close()
        self._arena.release()
        # Let go of the mapping rather than unmap it here: a call still running on another thread
        # holds the channel, segment or arena it uses, and the last of them to go unmaps it.
        self._links = {}
        del self._mapping, self._segment
