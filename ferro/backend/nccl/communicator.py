"""An NCCL communicator: its creation through ferro's store, its operations, and how it fails.

A :class:`Communicator` is created non-blocking (``ncclCommInitRankConfig``
with ``blocking = 0``) and polled under ferro's timeout, so a rank that never
arrives is an error naming it, not a hang: ranks first report their GPU
through the store (which also names ranks that never came, and two ranks on
one GPU), then rank 0's ``ncclUniqueId`` travels through the store.

Operations are enqueued on the caller's current stream (or, with
``async_op=True``, on the communicator's own stream after it waited for the
caller's, so the caller's later work overlaps the transfer). An event recorded
after each operation lets the :class:`~ferro.backend.nccl.watchdog.Watchdog`
see it complete; buffers stay referenced until then. When an operation
outlives its timeout or NCCL reports an error, the communicator is aborted
(``ncclCommAbort``, which also ends kernels stuck waiting for a dead peer), the
group is marked failed, and every later call raises the error, which names the
ranks to blame.

After an abort, the contents of buffers that the unfinished operations were
writing are unspecified: the error is raised by the next call, by
:meth:`DeviceWork.wait` and by :meth:`DeviceWork.synchronize`, and logged at
once, since a synchronous call may already have returned.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ferro.backend.nccl.buffers import DeviceArray
from ferro.backend.nccl.cuda import CudaDriver, require_gpu
from ferro.backend.nccl.library import SPLIT_NOCOLOR, Config, NcclLibrary, UniqueId, load_library
from ferro.backend.nccl.results import IN_PROGRESS, SUCCESS, check, nccl_error
from ferro.backend.nccl.watchdog import Progress, Watchdog, blame, progress_key
from ferro.errors import (
    BackendClosedError,
    ConfigurationError,
    DistributedError,
    DistributedTimeoutError,
    InvalidBufferError,
)
from ferro.rendezvous.connect import time_left, wait_before_closing, wait_for_ranks
from ferro.rendezvous.hosts import host_identity

__all__ = ["Communicator", "DeviceWork", "MULTI_RANK_GPU_ENV", "choose_device"]

log = logging.getLogger("ferro.nccl")

MULTI_RANK_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
_FIRST_POLL_SECONDS = 1e-4
_LONGEST_POLL_SECONDS = 0.01
# How long the rank serving the store waits, before refusing the GPUs, for the others to read them.
REFUSAL_GRACE_SECONDS = 10.0


def choose_device(driver: CudaDriver, device: int | None, rank: int) -> int:
    """Return the GPU this rank uses.

    In order: ``device`` when given; the device of the thread's current context
    (``torch.cuda.set_device`` makes one); ``LOCAL_RANK`` modulo the number of
    GPUs (``ferro run``, torchrun); this rank modulo the number of GPUs.

    Raises:
        ConfigurationError: ``device`` is not a visible GPU.

    """
    count = driver.device_count()
    if device is not None:
        if not 0 <= device < count:
            raise ConfigurationError(f"rank {rank}: device_id={device}, but this process sees {count} GPU(s)")
        return device
    current = driver.current_device()
    if current is not None:
        return current
    local = os.environ.get("LOCAL_RANK")
    return (int(local) if local and local.isdigit() else rank) % count


def _wait_ready(lib: NcclLibrary, comm: int, result: int, call: str, rank: int, deadline: float, doing: str,
                poll_comm: int | None = None) -> None:
    """Poll a non-blocking call until NCCL says it finished; abort nothing (the caller does)."""
    if result == SUCCESS:
        return
    if result != IN_PROGRESS:
        raise nccl_error(lib, result, call, rank, comm or None)
    target = poll_comm if poll_comm is not None else comm
    state = ctypes.c_int(IN_PROGRESS)
    delay = _FIRST_POLL_SECONDS
    while True:
        check(lib, lib.ncclCommGetAsyncError(target, ctypes.byref(state)), "ncclCommGetAsyncError", rank, target)
        if state.value == SUCCESS:
            return
        if state.value != IN_PROGRESS:
            raise nccl_error(lib, state.value, call, rank, target)
        if time.monotonic() >= deadline:
            raise DistributedTimeoutError(
                f"rank {rank}: {doing} did not finish in time: NCCL was still connecting (every rank reached it; "
                f"NCCL_DEBUG=INFO shows where it waits; NCCL_SOCKET_IFNAME picks the network)")
        time.sleep(delay)
        delay = min(delay * 2, _LONGEST_POLL_SECONDS)


class DeviceWork:
    """An NCCL operation enqueued on the GPU: the handle ``async_op=True`` returns.

    Attributes:
        seq: Its number among the communicator's operations (1, 2, ...), as error messages count them.
        name: What it is, e.g. ``"allreduce float32[1024]"``.

    """

    def __init__(self, comm: Communicator, seq: int, name: str, event: int, caller_stream: int, result: Any,
                 keep: tuple[Any, ...], deadline: float) -> None:
        self._comm, self.seq, self.name = comm, seq, name
        self._event, self._caller_stream, self._result = event, caller_stream, result
        self._keep: tuple[Any, ...] | None = keep
        self.deadline = deadline
        # A flag, and an event only for a host that waits (synchronize): an event per operation would cost
        # every call microseconds that almost no caller uses.
        self._done = False
        self._waiter: threading.Event | None = None

    def is_completed(self) -> bool:
        """Whether the GPU finished it (or the communicator failed)."""
        if not self._done:
            self._comm.poll()  # retires whatever the GPU finished, without waiting for the watchdog's next look
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Order the caller's stream after this operation and return its result; the host does not wait.

        Work the caller enqueues on its current stream afterwards sees the result,
        as with ``torch.distributed``'s NCCL handles. Use :meth:`synchronize` to
        block the host.

        Args:
            timeout: Accepted for the common handle interface; the host does not block here.

        Raises:
            The communicator's failure, if it failed.

        """
        self._comm.raise_if_failed(self.name, self)
        if not self._done:
            self._comm.order_after(self._caller_stream, self._event)
        return self._result

    def synchronize(self, timeout: float | None = None) -> Any:
        """Block the host until the operation completed; return its result.

        Raises:
            DistributedTimeoutError: Not done within ``timeout`` (default: the operation's own deadline);
                the communicator is then aborted and the message names the ranks to blame.
            The communicator's failure, if it failed.

        """
        deadline = self.deadline if timeout is None else time.monotonic() + timeout
        delay = _FIRST_POLL_SECONDS
        if self._waiter is None:
            self._waiter = threading.Event()  # made before the flag is read again: _finish sets one or the other
        while not self._done:
            self._comm.poll()
            if self._done:
                break
            if time.monotonic() >= deadline:
                self._comm.time_out(self)
                break
            self._waiter.wait(delay)
            delay = min(delay * 2, _LONGEST_POLL_SECONDS)
        self._comm.raise_if_failed(self.name, self)
        return self._result

    def _finish(self) -> None:
        self._keep = None  # NCCL no longer uses the memory
        self._done = True
        if self._waiter is not None:  # read after the flag is set: a waiter made before is woken
            self._waiter.set()

    def __repr__(self) -> str:
        return f"<DeviceWork #{self.seq} {self.name} {'done' if self._done else 'pending'}>"


class Communicator:
    """One NCCL communicator of a group, on one GPU, with its own stream and watchdog.

    Create it with :meth:`create` (or :meth:`split` from another). Its operations
    take :class:`~ferro.backend.nccl.buffers.DeviceArray` descriptions already
    validated by :mod:`ferro.collective.gpu`.

    Attributes:
        rank: This rank in the communicator.
        world_size: Its number of ranks.
        device: The CUDA device index.
        timeout: Default seconds per operation.
        lib: The loaded NCCL.
        driver: The CUDA driver.

    """

    def __init__(self, lib: NcclLibrary, driver: CudaDriver, handle: int, rank: int, world_size: int, device: int,
                 store: Any, prefix: str, timeout: float, on_failure: Callable[[str], None] | None = None) -> None:
        self.lib, self.driver = lib, driver
        self._handle = handle
        self.rank, self.world_size, self.device, self.timeout = rank, world_size, device, timeout
        self._store, self._prefix = store, prefix
        # The watchdog's own store connection: the main thread may sit in a long store call.
        clone = getattr(store, "clone", None)
        self._watch_store = clone() if clone is not None else store
        self.on_failure = on_failure
        self._lock = threading.RLock()
        self._failure: DistributedError | None = None
        self._closed = False
        self._issued = 0
        self._completed = 0
        self._last = ""
        self._pending: deque[DeviceWork] = deque()
        self._spare_events: list[int] = []
        self._split_counts: dict[tuple[int, ...], int] = {}
        driver.use_device(device)
        self._stream = driver.new_stream()
        self._ready = driver.new_event()
        self._scratch = driver.alloc(4)  # the barrier's one int32
        self.publish_progress()  # a record from the start: a rank that dies at once is seen to stop
        self.watchdog = Watchdog(self)

    # --- creation --------------------------------------------------------------------------------

    @classmethod
    def create(cls, store: Any, prefix: str, rank: int, world_size: int, timeout: float, deadline: float,
               device: int | None = None, on_failure: Callable[[str], None] | None = None) -> Communicator:
        """Create the communicator of ``world_size`` ranks meeting under ``prefix`` in ``store``.

        Raises:
            BackendUnavailableError: No driver, GPU or libnccl (the message says which and how to get it).
            ConfigurationError: Two ranks on one GPU (named), or a bad ``device``.
            DistributedTimeoutError: Ranks that never arrived (named), or NCCL's set-up outlived the deadline.

        """
        driver = require_gpu()
        lib = load_library()
        device = choose_device(driver, device, rank)
        driver.use_device(device)
        _check_gpus(store, prefix, rank, world_size, driver, device, deadline, lib.version)
        unique_id = UniqueId()
        key = f"{prefix}/unique-id"
        if rank == 0:
            check(lib, lib.ncclGetUniqueId(ctypes.byref(unique_id)), "ncclGetUniqueId", rank)
            store.set(key, ctypes.string_at(ctypes.addressof(unique_id), ctypes.sizeof(unique_id)),
                      timeout=time_left(deadline, rank, "publishing NCCL's unique id"))
        else:
            wait_for_ranks(store, {0: key}, deadline, rank, "publish NCCL's unique id")
            raw = store.get(key, timeout=time_left(deadline, rank, "reading NCCL's unique id"))
            ctypes.memmove(ctypes.addressof(unique_id), raw, ctypes.sizeof(unique_id))
        handle = ctypes.c_void_p()
        config = Config.non_blocking()
        result = lib.ncclCommInitRankConfig(ctypes.byref(handle), world_size, unique_id, rank, ctypes.byref(config))
        comm = handle.value or 0
        try:
            _wait_ready(lib, comm, result, "ncclCommInitRankConfig", rank, deadline,
                        f"creating the NCCL communicator of {world_size} ranks")
        except BaseException:
            if comm:
                lib.ncclCommAbort(comm)
            raise
        return cls(lib, driver, comm, rank, world_size, device, store, prefix, timeout, on_failure)

    def split(self, ranks: Sequence[int] | None, timeout: float | None = None) -> Communicator | None:
        """Split off the communicator of ``ranks`` (``ncclCommSplit``); collective over every rank of this one.

        Members pass the same ``ranks``; every other rank passes None and gets None.
        """
        seconds = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        with self._lock:
            self.raise_if_failed("new_group")
            self.driver.use_device(self.device)
            members: tuple[int, ...] = ()
            if ranks is None:
                color, key = SPLIT_NOCOLOR, 0
            else:
                members = tuple(ranks)
                color, key = _color(members), members.index(self.rank)
            handle = ctypes.c_void_p()
            config = Config.non_blocking()
            result = self.lib.ncclCommSplit(self._handle, color, key, ctypes.byref(handle), ctypes.byref(config))
            child = handle.value or 0
            try:
                _wait_ready(self.lib, self._handle, result, "ncclCommSplit", self.rank, deadline,
                            "splitting the NCCL communicator (every rank of the parent group must call new_group)",
                            poll_comm=child or self._handle)
            except BaseException:
                if child:
                    self.lib.ncclCommAbort(child)
                raise
            if not members:
                return None
            count = self._split_counts.get(members, 0) + 1
            self._split_counts[members] = count
            return Communicator(self.lib, self.driver, child, key, len(members), self.device, self._store,
                                f"{self._prefix}/split/{color}/{count}", seconds, self.on_failure)

    # --- operations ------------------------------------------------------------------------------

    @property
    def stream(self) -> int:
        """The communicator's own CUDA stream (``async_op=True`` work runs on it)."""
        return self._stream

    @property
    def busy(self) -> bool:
        """Whether operations are pending (the watchdog polls faster then)."""
        return bool(self._pending)

    @property
    def failure(self) -> DistributedError | None:
        """The error that failed the communicator, or None while it is healthy."""
        return self._failure

    def raise_if_failed(self, call: str, work: DeviceWork | None = None) -> None:
        """Raise the communicator's failure (or that it is closed) for ``call``.

        For ``work`` that was pending when the communicator failed, the failure itself is raised.
        """
        if self._failure is not None and work is not None and work.seq > self._completed:
            raise self._failure.with_traceback(None)
        if self._failure is not None:
            raise type(self._failure)(f"rank {self.rank}: {call}: the NCCL communicator was aborted after an "
                                      f"earlier failure; create a new group. The failure: {self._failure}")
        if self._closed:
            raise BackendClosedError(f"rank {self.rank}: {call}: this NCCL group was closed")

    def launch(self, name: str, arrays: Sequence[DeviceArray], async_op: bool, timeout: float | None,
               enqueue: Callable[[Any, int, int], None], result: Any) -> DeviceWork:
        """Enqueue one operation and track it.

        Args:
            name: What it is, for messages.
            arrays: Its GPU buffers (checked to be on this communicator's device; kept alive until done).
            async_op: Run it on the communicator's stream (see the module docstring).
            timeout: Seconds it may take (default: the communicator's).
            enqueue: ``enqueue(lib, comm, stream)`` makes the NCCL calls, each result through :meth:`settle`.
            result: What :meth:`DeviceWork.wait` returns.

        """
        seconds = self.timeout if timeout is None else timeout
        with self._lock:
            self.raise_if_failed(name)
            driver = self.driver
            driver.use_device(self.device)
            for array in arrays:
                device = array.device if array.device is not None else driver.pointer_device(array.pointer)
                if device != self.device:
                    raise InvalidBufferError(f"rank {self.rank}: {name}: a buffer lives on cuda:{device}, but this "
                                             f"group's NCCL communicator is on cuda:{self.device}")
            caller = arrays[0].stream if arrays else 0
            stream = caller
            if async_op:
                driver.record(self._ready, caller)
                driver.stream_wait(self._stream, self._ready)
                stream = self._stream
            enqueue(self.lib, self._handle, stream)
            event = self._spare_events.pop() if self._spare_events else driver.new_event()
            driver.record(event, stream)
            self._issued += 1
            self._last = name
            work = DeviceWork(self, self._issued, name, event, caller, result, tuple([a.obj for a in arrays]),
                              time.monotonic() + seconds)
            self._pending.append(work)
        # The watchdog is not woken: it finds new work within its idle wait (0.1 s), far inside any timeout, and
        # waking it on every call cost the caller more than the launch (its poll contends for the GIL and lock).
        return work

    def settle(self, result: int, call: str) -> None:
        """Check one NCCL call's result; wait out ``ncclInProgress`` (non-blocking communicators return it)."""
        if result == SUCCESS:
            return
        try:
            _wait_ready(self.lib, self._handle, result, call, self.rank, time.monotonic() + self.timeout,
                        f"NCCL {call}")
        except DistributedError as exc:
            self.fail(exc)
            raise

    def order_after(self, stream: int, event: int) -> None:
        """Make ``stream`` wait for ``event``."""
        with self._lock:
            self.driver.use_device(self.device)
            self.driver.stream_wait(stream, event)

    def barrier(self, timeout: float | None = None) -> None:
        """Block until every rank reached it: an allreduce of one int32 on the GPU, waited for on the host."""
        work = self.launch("barrier", (), True, timeout,
                           lambda lib, comm, stream: self.settle(
                               lib.ncclAllReduce(self._scratch, self._scratch, 1, 2, 0, comm, stream),
                               "ncclAllReduce"), None)
        work.synchronize()

    def poll(self) -> None:
        """Retire completed work; fail on NCCL's asynchronous errors and on work past its deadline."""
        if self._failure is not None or self._closed:
            return
        with self._lock:
            if self._failure is not None or self._closed:
                return
            state = ctypes.c_int(SUCCESS)
            self.lib.ncclCommGetAsyncError(self._handle, ctypes.byref(state))
            if state.value not in (SUCCESS, IN_PROGRESS):
                self.fail(nccl_error(self.lib, state.value, "(asynchronously)", self.rank, self._handle))
                return
            if not self._pending:
                return
            self.driver.use_device(self.device)
            while self._pending and self.driver.event_done(self._pending[0]._event):
                work = self._pending.popleft()
                self._spare_events.append(work._event)
                self._completed = work.seq
                work._finish()
            if self._pending and time.monotonic() >= self._pending[0].deadline:
                self.time_out(self._pending[0])

    def time_out(self, work: DeviceWork) -> None:
        """Fail the communicator because ``work`` outlived its deadline, naming the ranks to blame."""
        with self._lock:
            if self._failure is not None or work._done:
                return
            self.publish_progress()
            culprits = blame(self._watch_store, self._prefix, self.rank, self.world_size, work.seq, work.name,
                             self.watchdog.heartbeat)
            self.fail(DistributedTimeoutError(
                f"rank {self.rank}: NCCL operation #{work.seq} ({work.name}) did not complete within its timeout: "
                f"{culprits}"))

    def fail(self, error: DistributedError) -> None:
        """Record ``error``, abort the communicator, release every pending operation, and tell the group."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
            log.error("ferro: %s; the NCCL communicator is aborted", error)
            self.lib.ncclCommAbort(self._handle)
            while self._pending:
                self._pending.popleft()._finish()
        if self.on_failure is not None:
            self.on_failure(str(error))

    def publish_progress(self) -> None:
        """Write this rank's progress record to the store (the watchdog's heartbeat)."""
        record = Progress(self._issued, self._completed, self._last, time.time())
        try:
            self._watch_store.set(progress_key(self._prefix, self.rank), record.encode(), timeout=1.0)
        except DistributedError:
            pass  # the store is gone (rank 0 died); the next timeout says so

    def close(self) -> None:
        """Finish the communicator: wait for pending work (bounded by its deadlines), then release everything."""
        if self._closed:
            return
        self.watchdog.stop()
        with self._lock:
            healthy = self._failure is None
            if healthy and self._pending:
                try:
                    self._pending[-1].synchronize()
                except DistributedError:
                    healthy = False
            self._closed = True
            self.driver.use_device(self.device)
            if healthy:
                try:
                    self.settle(self.lib.ncclCommFinalize(self._handle), "ncclCommFinalize")
                    check(self.lib, self.lib.ncclCommDestroy(self._handle), "ncclCommDestroy", self.rank)
                except DistributedError:
                    self.lib.ncclCommAbort(self._handle)
            for event in (*self._spare_events, self._ready):
                self.driver.destroy_event(event)
            self.driver.destroy_stream(self._stream)
            self.driver.free(self._scratch)
            if self._watch_store is not self._store:
                self._watch_store.close()

    def __repr__(self) -> str:
        state = "failed" if self._failure else "closed" if self._closed else "open"
        return f"<NCCL communicator rank={self.rank} of {self.world_size} on cuda:{self.device} {state}>"


def _color(members: tuple[int, ...]) -> int:
    """Return the split color of a member list: equal lists agree, and it is a non-negative int32."""
    value = 0
    for rank in members:
        value = (value * 1_000_003 + rank + 1) % (2**31 - 1)
    return value


def _check_gpus(store: Any, prefix: str, rank: int, world_size: int, driver: CudaDriver, device: int,
                deadline: float, version: tuple[int, int, int]) -> None:
    """Exchange every rank's host and GPU through the store; refuse two ranks on one GPU, naming them."""
    store.set(f"{prefix}/gpu/{rank}", f"{host_identity()}\n{driver.pci_bus_id(device)}\n{device}",
              timeout=time_left(deadline, rank, "publishing this rank's GPU"))
    keys = {r: f"{prefix}/gpu/{r}" for r in range(world_size)}
    wait_for_ranks(store, keys, deadline, rank, "join the NCCL group (report their GPU)")
    owners: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for r, key in keys.items():
        host, their_bus, their_device = store.get(key, timeout=time_left(deadline, rank, "reading the GPUs")
                                                  ).decode().split("\n")
        owners.setdefault((host, their_bus), []).append((r, their_device))
    shared = [(bus_id, found) for (_, bus_id), found in owners.items() if len(found) > 1]
    if not shared or (version >= (2, 30, 0) and os.environ.get(MULTI_RANK_GPU_ENV) == "1"):
        return
    # Every rank reaches this refusal. The one serving the store closes it as it raises: it first lets the others
    # finish reading the reports, or they would report the store lost instead (seen under load, rank 1 of 2).
    try:
        store.set(f"{prefix}/gpus-read/{rank}", "1", timeout=time_left(deadline, rank, "marking the GPUs read"))
    except DistributedError:
        pass  # the refusal below is this rank's outcome either way
    wait_before_closing(store, [f"{prefix}/gpus-read/{r}" for r in range(world_size) if r != rank],
                        min(max(deadline - time.monotonic(), 0.0), REFUSAL_GRACE_SECONDS))
    bus_id, ranks = shared[0]
    names = " and ".join(f"rank {r} (cuda:{d})" for r, d in ranks)
    raise ConfigurationError(
        f"rank {rank}: {names} use the same GPU (PCI {bus_id}) on one host; NCCL {'.'.join(map(str, version))} "
        f"needs a GPU per rank (its 'Duplicate GPU detected'). Give each rank its own: "
        f"torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group, or "
        f"init_process_group(..., device_id=local_rank); NCCL 2.30 and newer also accept {MULTI_RANK_GPU_ENV}=1")
