"""What the TCP and shared-memory groups share: joining the job through its rendezvous store."""

from __future__ import annotations

import abc
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ferro._buffers import as_buffer
from ferro.backend.base import FramedBackend, KeptIdentity
from ferro.errors import DistributedTimeoutError
from ferro.rendezvous.connect import claim_rank, release_rank, time_left
from ferro.rendezvous.settings import RendezvousConfig, default_timeout
from ferro.rendezvous.store import Store

__all__ = ["JoinSpec", "StoreBackend"]


@dataclass(frozen=True)
class JoinSpec:
    """How a rank joins a job: what every backend of the registry is created from.

    Attributes:
        rank: This process's rank.
        world_size: Number of ranks.
        master_addr: Address of the rendezvous store.
        master_port: Port of the rendezvous store.
        timeout: Default seconds for blocking operations (None: ``$FERRO_TIMEOUT`` or 60).
        secret: The job secret (None: ``$FERRO_SECRET``).
        store: An existing store to rendezvous through (a :class:`~ferro.rendezvous.store.Store`
            or :class:`~ferro.rendezvous.file_store.FileStore`), or None to use rank 0's.
        bind_addr: Address TCP listeners bind (None: the route towards the master).
        close_store: Close ``store`` with the group (it becomes the group's own).
        device_id: The GPU of an NCCL group (None: the current device, else ``LOCAL_RANK``).

    """

    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout: float | None = None
    secret: bytes | str | None = None
    store: Any = None
    bind_addr: str | None = None
    close_store: bool = False
    device_id: int | None = None


class StoreBackend(KeptIdentity, FramedBackend):
    """A framed backend whose ranks meet through the job's store.

    Rank 0 serves the store unless one is given. Each rank counts its own joins
    in the store, so a job that re-creates its group on a long-lived store never
    meets the previous group's keys. Subclasses attach their transport (a mesh
    of sockets, a shared segment) under the prefix this class hands them, and
    keep one link per peer in ``_links``: an object with ``send`` and
    ``recv_into`` taking ``kind``, ``fingerprint``, ``timeout`` and ``op``.
    """

    _links: dict[int, Any]
    _rank_mark: str | None  # the claim of _join (a sub-group holds none)

    #: Names this kind of group in the store's keys.
    store_namespace = ""

    def _join(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout: float | None,
              secret: bytes | str | None, store: Store | None, close_store: bool,
              attach: Callable[[], None]) -> None:
        config = RendezvousConfig.resolve(
            rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, secret=secret)
        seconds = default_timeout(timeout)
        deadline = time.monotonic() + seconds  # the whole join, store requests included
        owns_store = store is None or close_store
        if store is None:
            store = Store(master_addr, master_port, secret=config.secret, timeout=seconds, serve=(rank == 0))
        mark = None
        try:
            mark = claim_rank(store, self.store_namespace, rank, time_left(deadline, rank, "claiming this rank"))
            generation = store.add(f"ferro/{self.store_namespace}-joins/{rank}", 1,
                                   timeout=time_left(deadline, rank, "counting this rank's joins"))
            self._init_state(rank, world_size, store, owns_store, f"ferro/{self.store_namespace}/{generation}",
                             config.secret, seconds, deadline)
            attach()
            self._rank_mark = mark  # held while the group lives: a second process as this rank is refused
        except BaseException as exc:
            if mark is not None:
                release_rank(store, mark)
            if owns_store:
                store.close()
            refused = store.refused
            if isinstance(exc, DistributedTimeoutError) and refused:
                raise DistributedTimeoutError(
                    f"{exc}; meanwhile the store refused {len(refused)} connection(s): {refused[-1]}") from exc
            raise

    def _init_state(self, rank: int, world_size: int, store: Store, owns_store: bool, prefix: str, secret: bytes,
                    timeout: float, deadline: float | None = None) -> None:
        """Record who this rank is; ``deadline`` (monotonic; default ``timeout`` from now) bounds the set-up."""
        self._rank, self._world_size, self._timeout = rank, world_size, timeout
        self._deadline = time.monotonic() + timeout if deadline is None else deadline
        self._rank_mark = None
        self._store, self._owns_store, self._prefix, self._secret = store, owns_store, prefix, secret
        self._closed = False
        self._split_counts: dict[tuple[int, ...], int] = {}

    def _split_prefix(self, members: Sequence[int]) -> str:
        """Return the store prefix of the next sub-group made of ``members`` (the same on every member)."""
        key = tuple(members)
        count = self._split_counts.get(key, 0) + 1
        self._split_counts[key] = count
        digest = hashlib.sha1(",".join(map(str, key)).encode()).hexdigest()[:16]
        return f"{self._prefix}/sub/{digest}/{count}"

    @property
    def store(self) -> Store:
        """The rendezvous store this group was built through."""
        return self._store

    def _seconds(self, timeout: float | None) -> float:
        return self._timeout if timeout is None else timeout

    def send_tagged(self, buf: Any, dst: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Send one frame with ``kind`` and ``fingerprint`` in its header (see :meth:`Backend.send_tagged`)."""
        self._usable("send")
        dst = self.check_peer(dst, "send")
        self._links[dst].send(as_buffer(buf, "send"), kind=kind, fingerprint=fingerprint,
                              timeout=self._seconds(timeout), op="send")

    def recv_tagged(self, buf: Any, src: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Receive one frame, refusing another kind or fingerprint (see :meth:`Backend.recv_tagged`)."""
        self._usable("recv")
        src = self.check_peer(src, "recv")
        self._links[src].recv_into(as_buffer(buf, "recv", writable=True), kind=kind, fingerprint=fingerprint,
                                   timeout=self._seconds(timeout), op="recv")

    def frames_waiting(self, sources: Sequence[int]) -> list[int]:
        """Return the sources whose next frame has begun to arrive (see :meth:`Backend.frames_waiting`)."""
        self._usable("recv")
        return [src for src in sources if self._links[src].frame_waiting()]

    @abc.abstractmethod
    def _release(self) -> None:
        """Let go of the transport (sockets, mappings)."""

    def close(self) -> None:
        """Release the transport, and the store if this rank serves it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.state.set_direct(None)  # the full path, which refuses a closed group
        self._release()
        if self._rank_mark is not None:
            release_rank(self._store, self._rank_mark)
        if self._owns_store:
            self._store.close()
