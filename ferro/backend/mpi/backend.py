"""The MPI process group (``backend="mpi"``): ferro's collectives as the calls of the cluster's own MPI.

Every collective runs as one MPI call (``Allreduce``, ``Bcast``, ``Reduce``,
``Allgather``, ``Reduce_scatter``, ``Alltoall(v)``, ``Gather``, ``Scatterv``,
``Barrier``), or as its nonblocking twin (``Iallreduce``, ...) with
``async_op=True``. Point-to-point messages are ``Isend``/``Irecv`` polled
against their timeout. Counts never exceed ``2**31 - 1``: larger messages go
in several calls, because mpi4py's counts are C ints wherever the MPI library
lacks MPI-4's large-count calls (Open MPI 5 reports MPI 3.1).

What MPI does not offer, and what ferro does instead:

* **Timeouts.** A blocking MPI call cannot be cancelled; the group's
  :class:`~ferro.backend.mpi.watchdog.Watchdog` ends the job with
  ``MPI_Abort`` when one outlives its timeout, naming the rank and the call.
* **Mismatched calls.** MPI does not check that ranks call the same
  collective with the same sizes. ``check_calls=True`` (or
  ``FERRO_MPI_CHECK_CALLS=1``) makes every collective first agree on its call
  fingerprint, one small ``Allreduce``, and raise
  :class:`~ferro.CollectiveMismatchError` naming the ranks that differ;
  it is off by default: a debugging mode, it takes every call off the direct path (about 100 us per small
  allreduce instead of 5 on the development VM).
  Point-to-point messages always carry their call in the MPI tag and are
  checked before they are received.
* **A rank that raises.** An uncaught exception on one rank would leave the
  others blocked in MPI forever; the group installs an exception hook that
  prints the traceback and calls ``MPI_Abort`` naming the rank (what
  ``python -m mpi4py`` does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from ferro import environment
from ferro._buffers import byte_view
from ferro._core.status import KIND_COLLECTIVE, kind_name
from ferro.backend.base import FramedBackend, KeptIdentity, Support
from ferro.backend.joined import JoinSpec
from ferro.backend.mpi.abort import install_abort_hook, remove_abort_hook
from ferro.backend.mpi.collectives import MpiCollectives
from ferro.backend.mpi.library import MpiTypes, load_mpi, mpi_error
from ferro.backend.mpi.pending import Issued, MpiPending, count_spans
from ferro.backend.mpi.watchdog import Watchdog
from ferro.errors import (
    CollectiveMismatchError,
    ConfigurationError,
    DistributedTimeoutError,
    SizeMismatchError,
)
from ferro.rendezvous.settings import default_timeout
from ferro.types import (
    COLLECTIVE_IDS,
    collective_name,
    describe_fingerprint,
)

__all__ = ["CHECK_CALLS_ENV", "MAX_COUNT_ENV", "MpiBackend", "MpiPending"]

CHECK_CALLS_ENV = "FERRO_MPI_CHECK_CALLS"
#: The largest count passed to one MPI call (elements, or bytes for data movement). Lowering it
#: is for tests: it makes small messages take the split path that messages over 2 GiB take.
MAX_COUNT_ENV = "FERRO_MPI_MAX_COUNT"
MAX_COUNT = 2**31 - 1
# Point-to-point waits spin this long on MPI's test calls, then sleep in growing steps up to the cap.
SPIN_SECONDS = 50e-6
MAX_SLEEP_SECONDS = 1e-3
# The MPI tag of a point-to-point message: its frame kind, its collective and a hash of the rest
# of its fingerprint, so a receiver names the call a mismatched message belongs to.
_TAG_KIND_SHIFT, _TAG_CALL_SHIFT, _TAG_HASH_BITS = 28, 22, 22


class MpiBackend(KeptIdentity, FramedBackend, MpiCollectives):
    """A process group over an MPI communicator, through mpi4py.

    Ranks and size are the communicator's. No store, address or job secret is
    involved: MPI's launcher (mpirun, srun) started and connected the ranks,
    and ferro's traffic runs on a duplicate of the communicator, apart from the
    program's own MPI messages.

    Args:
        comm: An mpi4py intracommunicator (default ``MPI.COMM_WORLD``). Every rank of it
            calls the constructor (``MPI_Comm_dup`` is collective).
        timeout: Default seconds for every blocking operation (default ``$FERRO_TIMEOUT`` or 60).
            A blocking MPI call still running after it ends the job (see the module).
        check_calls: Make every collective first check that all ranks made the same call
            (default ``$FERRO_MPI_CHECK_CALLS``, else off).
        abort_on_exception: Install the hook that calls ``MPI_Abort`` when this rank
            raises an uncaught exception (default on).

    Raises:
        BackendUnavailableError: mpi4py or an MPI library is missing (the message says how to get them).
        ConfigurationError: ``comm`` is not an mpi4py intracommunicator.

    Example::

        # mpirun -n 2 python train.py
        group = ferro.init_process_group(backend="mpi")   # or MpiBackend.from_comm(MPI.COMM_WORLD)
        x = np.ones(4)
        ferro.allreduce(x)            # x == [2, 2, 2, 2] on both ranks, one MPI_Allreduce

    """

    SUPPORT: ClassVar[Support] = Support(
        engine_kind="MPI's own calls, through mpi4py",
        asynchronous="yes, as MPI's nonblocking calls",
        receive_any="yes (MPI_Iprobe)",
        sub_groups="yes (MPI_Comm_split)")

    nonblocking_collectives = True

    def __init__(self, comm: Any = None, *, timeout: float | None = None, check_calls: bool | None = None,
                 abort_on_exception: bool = True) -> None:
        mpi = load_mpi()
        base = mpi.COMM_WORLD if comm is None else comm
        if not isinstance(base, mpi.Intracomm) or base == mpi.COMM_NULL:
            raise ConfigurationError(f"MpiBackend needs an mpi4py intracommunicator, got {base!r}")
        self._init(mpi, base.Dup(), timeout, check_calls)
        self._hook: Any = install_abort_hook(mpi, self._world_rank) if abort_on_exception else None

    def _init(self, mpi: Any, comm: Any, timeout: float | None, check_calls: bool | None) -> None:
        self._mpi, self._comm = mpi, comm
        self._rank, self._world_size = comm.Get_rank(), comm.Get_size()
        self._world_rank = mpi.COMM_WORLD.Get_rank()
        self._timeout = default_timeout(timeout)
        if check_calls is None:
            check_calls = environment.get(CHECK_CALLS_ENV, "0") not in ("", "0", "false", "no")
        self._check_calls = check_calls
        raw = environment.get(MAX_COUNT_ENV)
        try:
            self._max_count = MAX_COUNT if not raw else int(raw)
        except ValueError:
            raise ConfigurationError(f"{MAX_COUNT_ENV}={raw!r} is not a count") from None
        if not 1 <= self._max_count <= MAX_COUNT:
            raise ConfigurationError(f"{MAX_COUNT_ENV}={raw!r} must be in [1, {MAX_COUNT}]")
        self._types = MpiTypes(mpi)
        self._tag_ub = int(mpi.COMM_WORLD.Get_attr(mpi.TAG_UB))  # MPI attaches it to COMM_WORLD only
        self._closed = False
        # Set while an async call starts its requests, with the thread doing it: another thread's calls
        # meanwhile (against the thread rule of ferro.collective.work, but possible) stay blocking.
        self._issuing: Issued | None = None
        self._issuer = 0
        self._abandoned: list[Any] = []  # requests a timeout gave up on, with their buffers: MPI may still use them
        self._watchdog = Watchdog(self._describe, comm.Abort)
        self._hook = None
        self._splits: dict[tuple[int, ...], int] = {}

    @classmethod
    def from_comm(cls, comm: Any, **kwargs: Any) -> MpiBackend:
        """Wrap an mpi4py communicator (``COMM_WORLD``, or one made by ``Split``/``Create_group``).

        Every rank of ``comm`` calls it. Keyword arguments are the constructor's.

        Example::

            from mpi4py import MPI
            half = MPI.COMM_WORLD.Split(color=MPI.COMM_WORLD.rank % 2)
            group = MpiBackend.from_comm(half)
            ferro.allreduce(x, group=group)   # among the ranks of one parity

        """
        return cls(comm, **kwargs)

    @classmethod
    def join(cls, spec: JoinSpec) -> MpiBackend:
        """Join ``MPI.COMM_WORLD`` (the backend registry's entry point); ``spec``'s rank and size must be MPI's.

        Raises:
            ConfigurationError: The rank or size the job was given differ from MPI's
                (the ranks were not started by one mpirun/srun).

        """
        return cls.join_world(spec.rank, spec.world_size, spec.timeout)

    @classmethod
    def join_world(cls, rank: int | None = None, world_size: int | None = None,
                   timeout: float | None = None) -> MpiBackend:
        """Return the group of ``MPI_COMM_WORLD``, checking any rank and size given against MPI's.

        Raises:
            ConfigurationError: ``rank`` or ``world_size`` differ from MPI's.

        """
        group = cls(timeout=timeout)
        for name, given, actual in (("rank", rank, group.rank), ("world_size", world_size, group.world_size)):
            if given is not None and given != actual:
                group.close()
                raise ConfigurationError(
                    f"init_process_group(backend='mpi'): this process was given {name} {given} (arguments or the "
                    f"launcher's environment) but MPI says {actual}: start the ranks with mpirun or srun, or use "
                    f"another backend under ferro run")
        return group

    # --- what the group is ---------------------------------------------------------------

    @property
    def comm(self) -> Any:
        """The mpi4py communicator ferro's traffic runs on (a duplicate of the one given)."""
        return self._comm

    @property
    def check_calls(self) -> bool:
        """Whether collectives check that every rank made the same call."""
        return self._check_calls

    def _describe(self) -> str:
        return f"rank {self._rank} of an MPI group of {self._world_size} (MPI_COMM_WORLD rank {self._world_rank})"

    # --- blocking calls, watched; nonblocking ones, collected -------------------------------

    def _run(self, call: str, timeout: float, start: Callable[..., Any], *args: Any,
             finish: Callable[[], None] | None = None, **kwargs: Any) -> None:
        """Run one MPI call: blocking under the watchdog, or started and collected while an async call issues.

        ``start`` is the blocking call (``comm.Allreduce``); its nonblocking twin is
        the same name with an ``I`` (``comm.Iallreduce``). ``finish`` runs once the
        call's data is final.
        """
        issued = self._current_issue()
        try:
            if issued is not None:
                issued.timeout = timeout
                issued.requests.append(getattr(self._comm, "I" + start.__name__.lower())(*args, **kwargs))
                if finish is not None:
                    issued.finishers.append(finish)
                return
            watchdog = self._watchdog
            watchdog.arm(call, timeout)
            try:
                start(*args, **kwargs)
            finally:
                watchdog.disarm()
        except self._mpi.Exception as exc:
            raise mpi_error(exc, self._rank, call) from None
        if finish is not None:
            finish()

    def test_all(self, requests: list[Any], call: str) -> bool:
        """Test (and progress) ``requests``; whether all completed."""
        try:
            return bool(self._mpi.Request.Testall(requests))
        except self._mpi.Exception as exc:
            raise mpi_error(exc, self._rank, call) from None

    def wait_all(self, requests: list[Any], call: str, timeout: float) -> None:
        """Complete ``requests`` in ``MPI_Waitall`` under the watchdog."""
        self._watchdog.arm(call, timeout)
        try:
            self._mpi.Request.Waitall(requests)
        except self._mpi.Exception as exc:
            raise mpi_error(exc, self._rank, call) from None
        finally:
            self._watchdog.disarm()

    @staticmethod
    def poll(test: Callable[[], bool], deadline: float) -> bool:
        """Call ``test`` until it returns True (then True) or ``deadline`` passes (then False).

        It spins for :data:`SPIN_SECONDS`, then sleeps between tests in steps
        growing to :data:`MAX_SLEEP_SECONDS`: MPI progresses only inside its calls.
        """
        if test():
            return True
        spin_until = time.monotonic() + SPIN_SECONDS
        pause = 5e-6
        while True:
            if test():
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            if now > spin_until:
                time.sleep(pause)
                pause = min(pause * 2, MAX_SLEEP_SECONDS)

    def issue_nonblocking(self, body: Callable[[], Any], call: str, description: str,
                          buffers: tuple[Any, ...]) -> MpiPending:
        """Run ``body`` with every MPI call it makes started nonblocking; return the handle that completes them."""
        issued = Issued(self._timeout)
        self._issuing, self._issuer = issued, threading.get_ident()
        try:
            result = body()
        finally:
            self._issuing = None
        return MpiPending(self, call, description, buffers, issued, result)

    def _current_issue(self) -> Issued | None:
        """Return the async call this thread is starting, if any."""
        return self._issuing if self._issuing is not None and self._issuer == threading.get_ident() else None

    def when_complete(self, result: Callable[[], Any]) -> Any:
        """Return ``result()`` now, or from the handle once an async call's requests complete."""
        issued = self._current_issue()
        if issued is not None:
            issued.result = result
            return None
        return result()

    def _agree(self, call: str, fingerprint: int, timeout: float) -> None:
        """With ``check_calls``: check that every rank is making the call ``fingerprint`` describes."""
        if not self._check_calls:
            return
        signed = fingerprint - (1 << 63)
        bounds = np.array([signed, -signed - 1], np.int64)  # -x-1 never overflows int64
        checking = f"{call} (checking that every rank called it)"
        self._blocking(checking, timeout, self._comm.Allreduce, self._mpi.IN_PLACE, bounds, op=self._mpi.MAX)
        if bounds[0] == signed and bounds[1] == -signed - 1:
            return
        everyone = np.empty(self._world_size, np.int64)
        self._blocking(checking, timeout, self._comm.Allgather, np.array([signed], np.int64), everyone)
        calls: dict[int, list[int]] = {}
        for rank, value in enumerate(everyone.tolist()):
            calls.setdefault(value, []).append(rank)
        other = next(value for value in calls if value != signed)
        described = "; ".join(
            f"rank(s) {ranks} called "
            f"{describe_fingerprint(value + (1 << 63), (other if value == signed else signed) + (1 << 63))}"
            for value, ranks in calls.items())
        peer = calls[other][0]
        raise CollectiveMismatchError(f"rank {self._rank}: the ranks' calls differ: {described}", peer)

    def _blocking(self, call: str, timeout: float, start: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run one blocking MPI call under the watchdog, even while an async call issues (a size to agree on)."""
        watchdog = self._watchdog
        watchdog.arm(call, timeout)
        try:
            start(*args, **kwargs)
        except self._mpi.Exception as exc:
            raise mpi_error(exc, self._rank, call) from None
        finally:
            watchdog.disarm()

    def barrier(self, *, timeout: float | None = None) -> None:
        """``MPI_Barrier`` (``MPI_Ibarrier`` inside an async call)."""
        self._usable("barrier")
        seconds = self._timeout if timeout is None else timeout
        self._agree("barrier", COLLECTIVE_IDS["barrier"] << 58, seconds)
        self._run("barrier", seconds, self._comm.Barrier)

    # --- point to point: Isend/Irecv, the call in the tag, checked before receiving ---------

    def _tag(self, kind: int, fingerprint: int) -> int:
        folded = (fingerprint ^ (fingerprint >> _TAG_HASH_BITS) ^ (fingerprint >> 44)) & ((1 << _TAG_HASH_BITS) - 1)
        if self._tag_ub >= (1 << 31) - 1:
            return (kind & 0x7) << _TAG_KIND_SHIFT | ((fingerprint >> 58) & 0x3F) << _TAG_CALL_SHIFT | folded
        return (kind * 0x9E3779B1 ^ fingerprint ^ (fingerprint >> 32)) % (self._tag_ub + 1)

    def _tag_call(self, tag: int) -> str:
        if self._tag_ub < (1 << 31) - 1:
            return "another call"
        kind = tag >> _TAG_KIND_SHIFT
        if kind == KIND_COLLECTIVE:
            return f"a {collective_name((tag >> _TAG_CALL_SHIFT) & 0x3F)} call"
        return f"a {kind_name(kind)} call"

    def _complete(self, request: Any, deadline: float, call: str, peer: int, buffer: Any) -> None:
        """Complete a point-to-point request by ``deadline``, else abandon it, mark the group failed and raise."""
        if self.poll(lambda: self.test_all([request], call), deadline):
            return
        self._abandoned.append((request, buffer))  # MPI may still read or write it: never free it
        reason = (f"rank {self._rank}: {call} with rank {peer} did not complete before its timeout; MPI cannot "
                  f"withdraw a message half-way, so this group is unusable")
        self.mark_failed(reason)
        raise DistributedTimeoutError(reason, peer)

    def _start_sends(self, buf: Any, dst: int, kind: int, fingerprint: int, call: str) -> list[tuple[Any, Any]]:
        """Start ``buf`` to ``dst`` as ``MPI_Isend`` messages of at most the count limit, tagged with the call.

        Returns:
            ``(request, piece)`` per message, for :meth:`_complete`.

        """
        view = byte_view(buf, call, writable=False)
        tag = self._tag(kind, fingerprint)
        started = []
        for start, end in count_spans(len(view), self._max_count):
            piece = view[start:end]
            try:
                started.append((self._comm.Isend([piece, self._types.byte], dst, tag), piece))
            except self._mpi.Exception as exc:
                raise mpi_error(exc, self._rank, call) from None
        return started

    def send_tagged(self, buf: Any, dst: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Send ``buf`` as ``MPI_Isend`` messages, completed by the timeout (see :meth:`_start_sends`)."""
        self._usable("send")
        dst = self.check_peer(dst, "send")
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        for request, piece in self._start_sends(buf, dst, kind, fingerprint, "send"):
            self._complete(request, deadline, "send", dst, piece)

    def frames_waiting(self, sources: Sequence[int]) -> list[int]:
        """Return the sources with a message for this rank (``MPI_Iprobe``; see :meth:`Backend.frames_waiting`)."""
        self._usable("recv")
        return [src for src in sources if self._comm.Iprobe(src, self._mpi.ANY_TAG)]

    def recv_tagged(self, buf: Any, src: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Receive a message from ``src``: probed first, so another call's or size's message stays queued."""
        self._usable("recv")
        src = self.check_peer(src, "recv")
        view = byte_view(buf, "recv", writable=True)
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        tag = self._tag(kind, fingerprint)
        mpi = self._mpi
        status = mpi.Status()
        if not self.poll(lambda: bool(self._comm.Iprobe(src, mpi.ANY_TAG, status)), deadline):
            raise DistributedTimeoutError(f"rank {self._rank}: recv from rank {src}: no message within "
                                          f"{self._timeout if timeout is None else timeout:g} s", src)
        if status.Get_tag() != tag:
            mine = describe_fingerprint(fingerprint) if kind == KIND_COLLECTIVE else kind_name(kind)
            raise CollectiveMismatchError(
                f"rank {self._rank} called {mine} but rank {src}'s next message belongs to "
                f"{self._tag_call(status.Get_tag())}: the ranks' calls differ", src)
        spans = count_spans(len(view), self._max_count)
        first = status.Get_count(mpi.BYTE)
        if first != spans[0][1] - spans[0][0]:
            sent = first if len(spans) == 1 else None
            raise SizeMismatchError(f"rank {self._rank}: recv from rank {src}: the message does not fit the "
                                    f"{len(view)}-byte buffer", len(view), sent)
        for start, end in spans:
            piece = view[start:end]
            try:
                request = self._comm.Irecv([piece, mpi.BYTE], src, tag)
            except mpi.Exception as exc:
                raise mpi_error(exc, self._rank, "recv") from None
            self._complete(request, deadline, "recv", src, piece)

    def sendrecv_tagged(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, kind: int, fingerprint: int,
                        timeout: float | None = None) -> None:
        """Start the send, receive, then complete the send: both directions progress together."""
        self._usable("sendrecv")
        dst = self.check_peer(dst, "sendrecv")
        seconds = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        started = self._start_sends(send_buf, dst, kind, fingerprint, "sendrecv")
        try:
            self.recv_tagged(recv_buf, src, kind=kind, fingerprint=fingerprint, timeout=seconds)
        finally:
            for request, piece in started:
                self._complete(request, deadline, "sendrecv", dst, piece)

    def abort_peers(self, payload: bytes) -> None:
        """Do nothing: MPI cannot interrupt a peer's call short of ``MPI_Abort`` (see the module)."""

    # --- sub-groups and closing --------------------------------------------------------------

    def split(self, ranks: Sequence[int], *, timeout: float | None = None) -> MpiBackend:
        """``MPI_Comm_create_group`` among ``ranks`` (collective over them only, as :func:`ferro.new_group` is)."""
        self._usable("new_group")
        members = tuple(ranks)
        # Groups of the same members made one after another must not meet each other's creation.
        count = self._splits.get(members, 0)
        self._splits[members] = count + 1
        seconds = self._timeout if timeout is None else default_timeout(timeout)
        self._watchdog.arm("new_group (MPI_Comm_create_group)", seconds)
        try:
            group = self._comm.Get_group().Incl(list(members))
            comm = self._comm.Create_group(group, tag=count % (self._tag_ub + 1))
            group.Free()
        except self._mpi.Exception as exc:
            raise mpi_error(exc, self._rank, "new_group") from None
        finally:
            self._watchdog.disarm()
        child = type(self).__new__(type(self))
        child._init(self._mpi, comm, seconds, self._check_calls)
        return child

    def close(self) -> None:
        """Free the communicator and stop the watchdog. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.state.set_direct(None)  # the full path, which refuses a closed group
        self._watchdog.stop()
        if self._hook is not None:
            remove_abort_hook(self._hook)
            self._hook = None
        if not self._mpi.Is_finalized() and not self._abandoned:
            try:
                self._comm.Free()
            except self._mpi.Exception:
                pass  # a communicator MPI already considers broken: nothing more to release
