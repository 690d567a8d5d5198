"""The shared-memory process group: ranks on one host exchange frames through rings in one segment."""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Sequence
from typing import Any

from ferro._buffers import as_buffer
from ferro._core.shm import Channel, Segment, segment_bytes
from ferro._core.transport import KIND_ABORT, KIND_BARRIER
from ferro.backend.base import default_spin_us, dissemination_barrier
from ferro.backend.joined import StoreBackend
from ferro.errors import ConfigurationError, DistributedError
from ferro.rendezvous import default_timeout, validate_rank_and_size
from ferro.store import Store

__all__ = ["ShmBackend"]

SHM_DIR = "/dev/shm"
RING_ENV = "FERRO_SHM_RING_BYTES"
DEFAULT_RING_BYTES = 4 * 1024 * 1024


def _sweep_stale_segments() -> None:
    """Remove segments whose creating process died before it could unlink them (killed during set-up).

    A segment's name carries its creator's pid; only this user's segments with
    a dead creator are removed, so a live job's segments are never touched.
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "ferro" or not parts[1].isdigit():
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except OSError:
            continue


def _ring_bytes(ring_bytes: int | None) -> int:
    if ring_bytes is None:
        raw = os.environ.get(RING_ENV)
        ring_bytes = int(raw) if raw else DEFAULT_RING_BYTES
    if ring_bytes < 4096:
        raise ConfigurationError(f"shared-memory rings need at least 4096 bytes, got {ring_bytes}")
    return ring_bytes


class ShmBackend(StoreBackend):
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
        spin_us: Microseconds to spin before yielding the CPU while waiting (default
            ``$FERRO_SPIN_US``, else 50, or 0 when ranks outnumber the cores).
        close_store: Close a given ``store`` with the group (it becomes the group's own).

    Raises:
        ConfigurationError, InvalidRankError, InvalidWorldSizeError, DistributedTimeoutError,
        AuthenticationError: As :class:`~ferro.TcpBackend`.

    """

    store_namespace = "shm"

    def __init__(self, rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500, *,
                 timeout: float | None = None, secret: bytes | str | None = None, store: Store | None = None,
                 ring_bytes: int | None = None, spin_us: float | None = None, close_store: bool = False) -> None:
        validate_rank_and_size(rank, world_size)  # before anything uses them
        ring = _ring_bytes(ring_bytes)
        spin = default_spin_us(spin_us, world_size)
        self._join(rank, world_size, master_addr, master_port, timeout, secret, store, close_store,
                   lambda: self._attach(ring, spin))

    def _attach(self, ring_bytes: int, spin_us: float) -> None:
        rank, world_size, store, prefix, timeout = (self._rank, self._world_size, self._store, self._prefix,
                                                    self._timeout)
        size = segment_bytes(world_size, ring_bytes)
        path = None
        if rank == 0:
            _sweep_stale_segments()
            path = os.path.join(SHM_DIR, f"ferro-{os.getpid()}-{secrets.token_hex(8)}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)  # sized before anyone learns the name
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            path = store.get(f"{prefix}/segment", timeout=timeout).decode()
            fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if rank == 0:
            store.set(f"{prefix}/segment", path)
        segment = Segment(mapping, world_size, ring_bytes)
        segment.register(rank, os.getpid())
        # A rank's report is its last use of the store: rank 0 waits for every report, so it can
        # never close the store (with its group) while another rank still needs it.
        store.set(f"{prefix}/mapped/{rank}", b"1")
        if rank == 0:
            try:
                store.wait([f"{prefix}/mapped/{r}" for r in range(world_size)], timeout=timeout)
            finally:
                os.unlink(path)  # every rank has it mapped (or the job failed): no name left behind
        self._ring_bytes, self._spin_us = ring_bytes, spin_us
        self._mapping, self._segment = mapping, segment
        self._links = {peer: Channel(segment, rank, peer, spin_us) for peer in range(world_size) if peer != rank}

    def sendrecv_tagged(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, kind: int, fingerprint: int,
                        timeout: float | None = None) -> None:
        """Write to ``dst`` and read from ``src`` in one loop, so rings of any size never deadlock."""
        self._usable("sendrecv")
        dst = self.check_peer(dst, "sendrecv")
        src = self.check_peer(src, "sendrecv")
        self._links[dst].exchange(as_buffer(send_buf, "sendrecv"), as_buffer(recv_buf, "sendrecv"), kind=kind,
                                     fingerprint=fingerprint, timeout=self._seconds(timeout),
                                     op="sendrecv", receive_from=self._links[src])

    def barrier(self, *, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier (dissemination algorithm)."""
        self._usable("barrier")
        seconds = self._seconds(timeout)
        sink = bytearray(0)
        dissemination_barrier(
            self._rank, self._world_size,
            lambda dst, src: self._links[dst].exchange(b"", sink, kind=KIND_BARRIER, fingerprint=0,
                                                          timeout=seconds, op="barrier",
                                                          receive_from=self._links[src]))

    def abort_peers(self, payload: bytes) -> None:
        """Leave an abort notice in every peer's ring (one second each at most)."""
        for channel in self._links.values():
            try:
                channel.send(payload, kind=KIND_ABORT, fingerprint=0, timeout=1.0, op="abort")
            except DistributedError:
                pass  # that peer is gone or its ring is full; it learns by its own timeout

    def split(self, ranks: Sequence[int], *, timeout: float | None = None) -> ShmBackend:
        """Create a segment of their own for ``ranks`` through this group's store (see :meth:`Backend.split`)."""
        self._usable("new_group")
        members = tuple(ranks)
        child = ShmBackend.__new__(ShmBackend)
        child._init_state(members.index(self._rank), len(members), self._store, False, self._split_prefix(members),
                          self._secret, self._timeout if timeout is None else default_timeout(timeout))
        child._attach(self._ring_bytes, self._spin_us)
        return child

    def _release(self) -> None:
        self._segment.mark_closed(self._rank)
        for channel in self._links.values():
            channel.close()
        self._segment.release()
        self._mapping.close()
