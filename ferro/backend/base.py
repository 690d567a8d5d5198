"""The process-group interface every backend implements."""

from __future__ import annotations

import abc
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ferro import environment
from ferro._core.state import GroupState
from ferro._core.transport import KIND_DATA
from ferro.backend.native import NativeCollectives
from ferro.errors import (
    BackendClosedError,
    BackendUnavailableError,
    ConfigurationError,
    InvalidRankError,
    SelfSendError,
)
from ferro.rendezvous.hosts import usable_cpus
from ferro.types import COLLECTIVE_IDS, collective_name

__all__ = ["Backend", "FramedBackend", "KeptIdentity", "Support", "add_counters", "default_spin_us",
           "default_yield_us", "dissemination_barrier", "usable_cpus"]

SPIN_ENV = "FERRO_SPIN_US"
YIELD_ENV = "FERRO_YIELD_US"
_P2P = COLLECTIVE_IDS["p2p"]
DEFAULT_SPIN_US = 50.0
DEFAULT_YIELD_US = 200.0
#: A shared-memory wait's yield window (the arena's, a channel's): a peer sharing this core answers once it runs.
SHM_YIELD_US = 1000.0
#: Past this many ranks a core, a rank that does not spin stops yielding too (see :func:`default_yield_us`).
YIELD_RANKS_PER_CORE = 4

_Group = TypeVar("_Group", bound="Backend")


_ALL_DTYPES = ("reductions: float16, bfloat16, float32, float64, int8-int64, uint8-uint64; data movement "
               "(broadcast, gathers, all_to_all, p2p): any dtype")


@dataclass(frozen=True)
class Support:
    """What a backend supports, as it declares it: the reference's backend table is generated from these.

    Which collectives run in the backend's own engine is not declared here: the
    table reads it from the :class:`~ferro.backend.native.NativeCollectives`
    methods the class overrides.

    Attributes:
        devices: Where the buffers it moves live.
        dtypes: The dtypes its collectives take.
        engine_kind: What its own engine is (for the collectives it runs natively).
        asynchronous: Its async calls (``async_op=True``) and how they run.
        point_to_point: Its send and receive, and their tags.
        receive_any: Whether ``recv_any`` (a receive from whichever rank sends first) works, or why not.
        sub_groups: How ``new_group`` / ``split`` makes a group of some of its ranks.
        engine: Overrides the "own engine" cell (a backend whose engine is not NativeCollectives).
        generic: Overrides the "other collectives" cell.

    """

    devices: str = "CPU"
    dtypes: str = _ALL_DTYPES
    engine_kind: str = "compiled, without the GIL"
    asynchronous: str = "yes, in order on the group's worker"
    point_to_point: str = "yes, with tags"
    receive_any: str = "yes"
    sub_groups: str = "yes"
    engine: str = ""
    generic: str = ""


class Backend(abc.ABC):
    """A process group: ``world_size`` ranks that exchange bytes point to point.

    A backend moves the raw bytes of C-contiguous buffers (NumPy arrays,
    ``bytes``/``bytearray``/``memoryview``, PyTorch CPU tensors). Between two
    ranks, messages arrive in the order they were sent. Collectives are built on
    top of these operations (or provided natively by a backend).

    Contract after a failure:

    * A receive that raises :class:`~ferro.SizeMismatchError` or
      :class:`~ferro.CollectiveMismatchError` has not consumed the message and
      has not written the buffer; the same receive with a fitting buffer gets it.
    * After any other failure the receive buffer's contents are unspecified
      (partly written); a send buffer is never modified.
    * A timeout or interrupt in the middle of a message leaves that peer's
      connection unusable; later operations with that peer raise
      :class:`~ferro.ConnectionBrokenError`. A timeout before a message started
      leaves it usable.
    * After :meth:`close`, every operation raises :class:`~ferro.BackendClosedError`;
      peers waiting on this rank raise :class:`~ferro.PeerLostError`.

    Backends are context managers: ``with TcpBackend(...) as group: ...`` closes
    the group on exit.

    Each backend class declares what it supports in ``SUPPORT`` (a :class:`Support`),
    from which the reference's backend table is generated.

    Every group owns one :class:`~ferro._core.state.GroupState` (:attr:`state`):
    its failure, the worker that orders its operations, and the counters behind
    :meth:`stats`. A backend that runs some collectives in its own engine mixes
    in :class:`~ferro.backend.native.NativeCollectives` (see :attr:`native`).
    """

    _group_state: GroupState  # created on first use of ``state``: subclasses need not call an __init__
    _is_native: bool = False  # set per class: does it implement NativeCollectives?
    #: Whether collectives carry the issuing thread's tag, so calls racing from several threads
    #: fail instead of meeting the wrong partner (the thread rule of :mod:`ferro.collective.work`).
    tags_threads: bool = True
    #: Whether the group moves host memory (NumPy arrays, CPU tensors). NCCL groups move GPU memory only.
    host_memory: bool = True
    #: Whether making a sub-group is collective over every rank of this group (NCCL's ``ncclCommSplit``):
    #: then :func:`ferro.new_group` calls :meth:`split_excluded` on the ranks left out.
    splits_collectively: bool = False
    #: Whether ``async_op=True`` starts the backend's own nonblocking calls (MPI's ``Iallreduce``, ...)
    #: through :meth:`issue_nonblocking`, instead of running the collective on the group's worker thread.
    nonblocking_collectives: bool = False

    #: The job's names for this group's ranks, as the flight recorder and ``ferro doctor`` show them (None:
    #: the group's own ranks, or its parent's for a sub-group). Set through :meth:`name_members`.
    member_ranks: tuple[int, ...] | None = None
    #: What the flight recorder calls this group (None: its members' ranks). Set through :meth:`name_members`.
    label: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._is_native = issubclass(cls, NativeCollectives)

    def name_members(self, job_ranks: Sequence[int], label: str) -> None:
        """Say which job rank each of this group's ranks is, and what to call the group, for dumps and verdicts.

        A group formed apart from the job's launch order (an elastic epoch, where
        group rank 1 may be launch rank 3) is otherwise described by its own ranks,
        which the other groups' records and the launcher do not use.

        Args:
            job_ranks: For each rank of this group, in order, its rank in the job.
            label: The group's name in dumps, e.g. ``"epoch 2"``.

        Raises:
            ValueError: ``job_ranks`` does not have one entry per rank.

        """
        if len(job_ranks) != self.world_size:
            raise ValueError(f"name_members: {len(job_ranks)} job ranks for a group of {self.world_size}")
        self.member_ranks, self.label = tuple(int(r) for r in job_ranks), label

    @property
    def state(self) -> GroupState:
        """The group's shared state (failure, worker, counters), read by the compiled core too."""
        try:
            return self._group_state
        except AttributeError:
            # setdefault is atomic under the GIL: racing first uses agree on one state.
            state = self.__dict__.setdefault("_group_state", GroupState())
            if state.owner is None:  # the flight recorder's dump describes the group through it
                state.owner = weakref.ref(self)
            return state

    @property
    def native(self) -> NativeCollectives | None:
        """The group's native collectives (usually the group itself), or None when it has none."""
        return self if self._is_native else None  # type: ignore[return-value]

    @property
    def device_collectives(self) -> Any:
        """The group's NCCL communicator (:class:`~ferro.backend.nccl.communicator.Communicator`), or None.

        Collectives on GPU buffers (:mod:`ferro.collective.gpu`) run on it; a group without one
        refuses them with a message saying which backends have one.
        """
        return None

    def stats(self) -> dict[str, dict[str, int]]:
        """Communication counters of this rank: per operation, its calls and the payload bytes moved.

        Counted where the bytes move (in C on TCP and shared memory). Frame headers
        are not counted. On shared memory a rank "sends" what it copies into its
        own slot for the others and "receives" what it reads from theirs. Point-to-point
        messages count under ``"p2p"``.

        Returns:
            ``{"allreduce": {"calls": 3, "bytes_sent": 96, "bytes_received": 96}, ...}``,
            only for operations that ran since the group began or since :meth:`reset_stats`.

        Example::

            ferro.allreduce(np.ones(256, np.float32), group=g)   # 2 ranks over TCP, a ring
            g.stats()["allreduce"]   # {"calls": 1, "bytes_sent": 1024, "bytes_received": 1024}

        """
        return _stats_by_name(self._counters())

    def reset_stats(self) -> None:
        """Zero this rank's communication counters."""
        self.state.reset_counters()

    def _counters(self) -> dict[int, tuple[int, int, int]]:
        """Counters by collective id; groups built from several groups add theirs up."""
        return self.state.counters()

    def count_call(self, operation: str) -> None:
        """Count one call of ``operation`` (a name of :data:`ferro.types.COLLECTIVE_IDS`) in :meth:`stats`."""
        self.state.count_call(COLLECTIVE_IDS[operation])

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """The calling process's rank in the group, in ``[0, world_size)``."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """The number of ranks in the group."""

    @property
    @abc.abstractmethod
    def timeout(self) -> float:
        """Default seconds any blocking operation may take before it raises."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""

    @abc.abstractmethod
    def send(self, buf: Any, dst: int, *, timeout: float | None = None) -> None:
        """Send the bytes of ``buf`` to rank ``dst``.

        Returns once the bytes are handed to the transport; ``buf`` may be
        reused at once.

        Args:
            buf: A C-contiguous buffer.
            dst: Destination rank (not this rank).
            timeout: Seconds; ``None`` uses :attr:`timeout`.

        Raises:
            InvalidRankError: ``dst`` is not a rank of the group.
            SelfSendError: ``dst`` is this rank.
            InvalidBufferError: ``buf`` is not C-contiguous.
            PeerLostError: ``dst`` died or closed its connection.
            DistributedTimeoutError: ``dst`` did not take the message within the timeout.
            ConnectionBrokenError: The connection failed mid-message.
            BackendClosedError: The group is closed.

        """

    @abc.abstractmethod
    def recv(self, buf: Any, src: int, *, timeout: float | None = None) -> None:
        """Receive the next message from rank ``src`` into ``buf``, which it must fill exactly.

        Args:
            buf: A writable C-contiguous buffer of exactly the message's size.
            src: Source rank (not this rank).
            timeout: Seconds; ``None`` uses :attr:`timeout`.

        Raises:
            SizeMismatchError: The message has another size; it stays queued.
            InvalidRankError: ``src`` is not a rank of the group.
            SelfSendError: ``src`` is this rank.
            InvalidBufferError: ``buf`` is not writable and C-contiguous.
            PeerLostError: ``src`` died or closed its connection.
            DistributedTimeoutError: Nothing arrived within the timeout.
            CollectiveMismatchError: ``src`` sent a frame of another call.
            ConnectionBrokenError: The connection failed mid-message.
            BackendClosedError: The group is closed.

        """

    def recv_timeout(self, buf: Any, src: int, timeout: float) -> None:
        """Receive like :meth:`recv` with an explicit timeout in seconds."""
        self.recv(buf, src, timeout=timeout)

    def sendrecv(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, timeout: float | None = None) -> None:
        """Send ``send_buf`` to ``dst`` while receiving from ``src`` into ``recv_buf``.

        Both directions progress together, so every rank of a ring may call this
        at once with any message size. This default runs the send on a helper
        thread; backends override it with a native full-duplex exchange.

        Raises:
            DistributedError: The errors of :meth:`send` and :meth:`recv`; when both
                fail, the receive's error is raised.

        """
        send_error: list[BaseException] = []

        def run_send() -> None:
            try:
                self.send(send_buf, dst, timeout=timeout)
            except BaseException as exc:  # re-raised in the caller's thread
                send_error.append(exc)

        sender = threading.Thread(target=run_send, name=f"ferro-sendrecv-{self.rank}", daemon=True)
        sender.start()
        try:
            self.recv(recv_buf, src, timeout=timeout)
        finally:
            sender.join()
        if send_error:
            raise send_error[0]

    def send_tagged(self, buf: Any, dst: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Send one message that carries a frame kind and a call fingerprint.

        The receiver's :meth:`recv_tagged` refuses a message whose kind or
        fingerprint differs from its own call (:class:`~ferro.CollectiveMismatchError`),
        which is how collectives catch ranks that called different things.
        This default drops the tags (for backends without framing) and calls :meth:`send`.
        """
        self.send(buf, dst, timeout=timeout)

    def recv_tagged(self, buf: Any, src: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Receive a message sent by :meth:`send_tagged`, checking its kind and fingerprint (see there)."""
        self.recv(buf, src, timeout=timeout)

    def sendrecv_tagged(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, kind: int, fingerprint: int,
                        timeout: float | None = None) -> None:
        """:meth:`sendrecv` with tagged messages (see :meth:`send_tagged`)."""
        self.sendrecv(send_buf, dst, recv_buf, src, timeout=timeout)

    def frames_waiting(self, sources: Sequence[int]) -> list[int]:
        """Return those of ``sources`` whose next message to this rank has begun to arrive, without blocking.

        A receive from any source (:func:`ferro.p2p.recv_any`) polls this, then
        receives from a rank it returns. A rank that is gone counts as waiting:
        the receive from it then raises :class:`~ferro.PeerLostError`.

        Raises:
            BackendUnavailableError: This backend cannot tell (the default).

        """
        raise BackendUnavailableError(f"rank {self.rank}: {type(self).__name__} cannot receive from any source")

    def abort_peers(self, payload: bytes) -> None:  # noqa: B027 - optional hook, deliberately a no-op
        """Tell every peer, best effort, that this rank gave up on the current collective.

        ``payload`` is an abort notice (``ferro._core.transport.abort_payload``); a
        peer waiting on this rank raises the error it describes instead of
        waiting for its timeout. This default does nothing (peers then time out).
        """

    def cut_peer(self, peer: int) -> bool:
        """Break this rank's connection to ``peer`` from any thread: a call waiting on it fails at once.

        For a peer known to be gone while its connection stays open (a lost
        node, a frozen host): :mod:`ferro.elastic` cuts it when the launcher
        records the peer dead. The group is unusable afterwards.

        Returns:
            Whether this backend could (the default cannot, and returns False).

        """
        return False

    @property
    def failure(self) -> str | None:
        """Why the group is unusable after a failed collective, or None while it is healthy."""
        return self.state.failure

    def mark_failed(self, reason: str) -> None:
        """Record that a collective failed part-way.

        Its frames may still be in flight, so every later collective on this
        group raises instead of risking reading them.
        """
        state = self.state
        if state.failure is None:
            state.failure = reason

    @abc.abstractmethod
    def barrier(self, *, timeout: float | None = None) -> None:
        """Block until every rank of the group has entered the barrier.

        Raises:
            PeerLostError: A rank died or closed its connection.
            DistributedTimeoutError: A rank did not arrive within the timeout.
            CollectiveMismatchError: A peer made another call.
            BackendClosedError: The group is closed.

        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the group's connections. Idempotent; never raises for a lost peer."""

    def split(self, ranks: Sequence[int], *, timeout: float | None = None) -> Backend:
        """Create a new group among ``ranks`` whose traffic is separate from this one's.

        Every member calls it with the same ranks, in the same order relative to
        its other ``split`` calls. Used by :func:`ferro.new_group`; the returned
        backend's ranks are positions in ``ranks``.

        Raises:
            BackendUnavailableError: This backend cannot create sub-groups.

        """
        raise BackendUnavailableError(f"{type(self).__name__} cannot create sub-groups (it does not implement split)")

    def issue_nonblocking(self, body: Callable[[], Any], call: str, description: str,
                          buffers: tuple[Any, ...]) -> Any:
        """Run a collective's ``body`` so that its calls start nonblocking; return its pending handle.

        Only for backends with :attr:`nonblocking_collectives`; the handle is a
        :class:`~ferro.PendingCollective` that completes the calls in ``wait()``.
        """
        raise NotImplementedError(f"{type(self).__name__} runs async collectives on its worker")

    def split_excluded(self, *, timeout: float | None = None) -> None:  # noqa: B027 - a no-op unless collective
        """Take part in a sub-group's creation as a rank left out of it (see :attr:`splits_collectively`)."""

    def check_peer(self, peer: object, op: str) -> int:
        """Validate a peer rank for a point-to-point operation and return it.

        Raises:
            InvalidRankError: Not an integer in ``[0, world_size)``.
            SelfSendError: The calling rank itself.

        """
        if type(peer) is int and 0 <= peer < self.world_size and peer != self.rank:
            return peer  # the common case, kept cheap: this runs on every message
        if isinstance(peer, bool) or not hasattr(peer, "__index__"):
            raise InvalidRankError(f"rank {self.rank}: {op}: the peer rank must be an integer, got {peer!r}")
        index = peer.__index__()
        if not 0 <= index < self.world_size:
            raise InvalidRankError(
                f"rank {self.rank}: {op}: peer rank {index} is outside the group's ranks [0, {self.world_size})")
        if index == self.rank:
            raise SelfSendError(f"rank {self.rank}: {op} with itself: a rank cannot be its own peer")
        return index

    def __enter__(self: _Group) -> _Group:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<{type(self).__name__} rank={self.rank} world_size={self.world_size} {state}>"


class FramedBackend(Backend):
    """A backend whose every message is a frame carrying a kind and a call fingerprint.

    Plain :meth:`send`, :meth:`recv` and :meth:`sendrecv` are data frames with
    fingerprint 0; implementations provide the tagged operations.
    """

    def send(self, buf: Any, dst: int, *, timeout: float | None = None) -> None:
        """Send ``buf``'s bytes to ``dst`` as a data frame (see :meth:`Backend.send`)."""
        self.state.count_call(_P2P)
        self.send_tagged(buf, dst, kind=KIND_DATA, fingerprint=0, timeout=timeout)

    def recv(self, buf: Any, src: int, *, timeout: float | None = None) -> None:
        """Receive the next data frame from ``src`` into ``buf`` (see :meth:`Backend.recv`)."""
        self.state.count_call(_P2P)
        self.recv_tagged(buf, src, kind=KIND_DATA, fingerprint=0, timeout=timeout)

    def sendrecv(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, timeout: float | None = None) -> None:
        """Exchange data frames, both directions at once (see :meth:`Backend.sendrecv`)."""
        self.state.count_call(_P2P)
        self.sendrecv_tagged(send_buf, dst, recv_buf, src, kind=KIND_DATA, fingerprint=0, timeout=timeout)

    @abc.abstractmethod
    def send_tagged(self, buf: Any, dst: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Send one frame with this kind and fingerprint (see :meth:`Backend.send_tagged`)."""

    @abc.abstractmethod
    def recv_tagged(self, buf: Any, src: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Receive one frame, refusing another kind or fingerprint (see :meth:`Backend.recv_tagged`)."""

    @abc.abstractmethod
    def sendrecv_tagged(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, kind: int, fingerprint: int,
                        timeout: float | None = None) -> None:
        """Exchange tagged frames, both directions at once (see :meth:`Backend.sendrecv_tagged`)."""


class KeptIdentity:
    """A group that keeps its rank, size, timeout and closed flag in attributes (``_rank``, ...), as most do.

    Mixed in before :class:`Backend`, its properties stand for the abstract ones.
    """

    _rank: int
    _world_size: int
    _timeout: float
    _closed: bool

    @property
    def rank(self) -> int:
        """The calling process's rank in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return self._world_size

    @property
    def timeout(self) -> float:
        """Default seconds for blocking operations."""
        return self._timeout

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _usable(self, op: str) -> None:
        if self._closed:
            raise BackendClosedError(f"rank {self._rank}: {op}: this process group was closed")


def _stats_by_name(counters: dict[int, tuple[int, int, int]]) -> dict[str, dict[str, int]]:
    found: dict[str, dict[str, int]] = {}
    for ident, (calls, sent, received) in sorted(counters.items()):
        entry = found.setdefault(collective_name(ident), {"calls": 0, "bytes_sent": 0, "bytes_received": 0})
        entry["calls"] += calls
        entry["bytes_sent"] += sent
        entry["bytes_received"] += received
    return found


def add_counters(*parts: dict[int, tuple[int, int, int]]) -> dict[int, tuple[int, int, int]]:
    """Add up counters by collective id (for groups built from several groups)."""
    total: dict[int, tuple[int, int, int]] = {}
    for part in parts:
        for ident, values in part.items():
            before = total.get(ident, (0, 0, 0))
            total[ident] = (before[0] + values[0], before[1] + values[1], before[2] + values[2])
    return total


def dissemination_barrier(rank: int, world_size: int, exchange: Callable[[int, int], object]) -> None:
    """Run a dissemination barrier: ceil(log2 n) rounds of one empty message each way.

    In round k every rank signals rank ``+2**k`` and waits for rank ``-2**k``;
    after the last round every rank has heard, directly or not, from all others.

    Args:
        rank: This rank.
        world_size: Number of ranks.
        exchange: ``exchange(dst, src)`` sends an empty barrier message to
            ``dst`` and waits for one from ``src``.

    """
    distance = 1
    while distance < world_size:
        exchange((rank + distance) % world_size, (rank - distance) % world_size)
        distance *= 2


def _microseconds_given(value: float | None, variable: str) -> float | None:
    """Return the caller's ``value``, else ``$variable`` as microseconds, else None."""
    if value is not None:
        return float(value)
    raw = environment.get(variable)
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError(f"{variable}={raw!r} is not a number of microseconds") from None


def default_spin_us(spin_us: float | None, world_size: int) -> float:
    """Return how long a waiting rank spins before it sleeps, in microseconds."""
    given = _microseconds_given(spin_us, SPIN_ENV)
    if given is not None:
        return given
    # Spinning pays only while every rank has a core of its own; with more ranks
    # than cores a spinning rank steals the core its peer needs to answer (two TCP
    # ranks confined to one core by `taskset`: 4 KiB allreduce 110-140 us spinning,
    # 40-47 us not, on the 2-core VM).
    return DEFAULT_SPIN_US if world_size <= usable_cpus() else 0.0


def default_yield_us(yield_us: float | None, ranks_here: int, window: float = DEFAULT_YIELD_US) -> float:
    """Return how long a rank that does not spin keeps trying between ``sched_yield()`` calls before it sleeps.

    In microseconds: the caller's ``yield_us``, else ``$FERRO_YIELD_US``, else ``window`` (TCP's 200, shared
    memory's :data:`SHM_YIELD_US`) while the ranks sharing this host's cores (``ranks_here``) are at most four a
    core, and 0 past that.
    """
    given = _microseconds_given(yield_us, YIELD_ENV)
    if given is not None:
        return given
    # A yield hands the core to the peer that must answer when that peer is runnable here; with many ranks a
    # core, the yielders churn through the run queue and hold off the ones with work and the kernel's
    # network processing. Measured on the 2-core VM, two rounds each, 200 us window against none: loopback
    # 4 B-16 KiB allreduce at 8 ranks 151-259 against 212-316 us, at 16 ranks 662-878 against 512-612;
    # emulated 16x1@100mbit 4 KiB allreduce 3.2-5.6 against 1.6-1.9 ms and 4 MiB all_gather 351-370 against
    # 340-342 ms; 32x1 4 KiB 9-13 against 2.9-3.9 ms.
    return window if ranks_here <= YIELD_RANKS_PER_CORE * usable_cpus() else 0.0
