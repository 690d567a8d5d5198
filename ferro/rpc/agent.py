"""The RPC agent: an authenticated full mesh of its own, a reader per peer, a bounded pool of workers.

Each worker process has one agent. Its connections are built by the same
rendezvous as process groups (:func:`ferro.rendezvous.connect.build_mesh`, a
prefix of their own), so RPC traffic never shares a socket with collectives, and
every connection has proven the job secret before it carries a request.

* A **reader thread per peer** receives messages. Requests go to the pool of
  ``num_worker_threads`` threads; responses complete the caller's future. A
  handler may itself call other workers (or this one): it waits on a future,
  never on a socket, so nested calls cannot block a reader.
* A **call's deadline** is the caller's: past it the future fails with
  :class:`~ferro.DistributedTimeoutError` and a late answer is dropped, so the
  agent stays usable.
* A **lost peer** (closed connection, killed process) fails every future waiting
  on it with :class:`~ferro.PeerLostError` naming it, and later calls to it fail
  at once.
* **Graceful shutdown** waits for this worker's own calls, tells every peer it is
  done, and serves requests until every peer has said the same: then no request
  can still come, and the connections close.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ferro.errors import (
    BackendClosedError,
    DistributedError,
    DistributedTimeoutError,
    InvalidRankError,
    PeerLostError,
    RemoteError,
)
from ferro.rpc.owned import OwnerTable
from ferro.rpc.wire import Kind, Receiver, decode, encode, send_message

__all__ = ["Future", "RpcAgent", "WorkerInfo"]

log = logging.getLogger("ferro.rpc")


@dataclass(frozen=True)
class WorkerInfo:
    """A worker of the RPC job.

    Attributes:
        name: The name it gave ``init_rpc``.
        id: Its rank.

    """

    name: str
    id: int


class Future(concurrent.futures.Future):
    """The result of :func:`ferro.rpc.rpc_async`: ``wait()``, ``result()``, ``done()``, ``then()``."""

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the call completes and return its value (or raise its exception)."""
        return self.result(timeout)

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """Return a future of ``callback(self)``, run once this one completes (on the thread that completes it)."""
        chained = Future()

        def run(done: concurrent.futures.Future) -> None:
            try:
                chained.set_result(callback(self))
            except BaseException as exc:  # noqa: BLE001 - handed to the chained future
                chained.set_exception(exc)

        self.add_done_callback(run)
        return chained


class _RemoteTraceback(Exception):
    """The traceback of an exception raised on another worker (shown as the cause of the re-raised one)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.text}\"\"\""


@dataclass
class _Pending:
    """A call waiting for its answer; its description is made only when an error needs it."""

    future: Future
    peer: int
    peer_name: str
    fn: Any

    @property
    def what(self) -> str:
        return _describe(self.peer_name, self.fn)


class RpcAgent:
    """One worker's RPC endpoint; made by :func:`ferro.rpc.init_rpc` (usable directly as well).

    Attributes:
        name: This worker's name.
        rank: This worker's rank.
        world_size: The number of workers.
        timeout: Default seconds for a call.

    """

    def __init__(self, name: str, rank: int, names: list[str], sockets: dict[int, socket.socket], timeout: float,
                 num_worker_threads: int) -> None:
        self.name, self.rank, self.world_size, self.timeout = name, rank, len(names), timeout
        self._names = names
        self._ranks = {n: r for r, n in enumerate(names)}
        self._sockets = sockets
        self._send_locks = {peer: threading.Lock() for peer in sockets}
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._lost: dict[int, str] = {}
        self._done_peers: set[int] = set()
        self._done_changed = threading.Condition(self._lock)
        self._closed = False
        self.owned = OwnerTable()  # values this worker owns for RRefs
        self._store: Any = None  # the rendezvous store, closed at shutdown (rank 0 serves it)
        self._deadlines = _Deadlines(f"ferro-rpc-{name}-deadlines", self._expire)
        self._pool = concurrent.futures.ThreadPoolExecutor(num_worker_threads, thread_name_prefix=f"ferro-rpc-{name}")
        self._readers = [threading.Thread(target=self._read, args=(peer,), name=f"ferro-rpc-{name}-from-{peer}",
                                          daemon=True) for peer in sockets]
        for reader in self._readers:
            reader.start()

    # --- who is who ------------------------------------------------------------------------------------

    def worker_info(self, to: str | int | WorkerInfo | None = None) -> WorkerInfo:
        """Return the :class:`WorkerInfo` of a worker given by name, rank or info (this worker by default).

        Raises:
            InvalidRankError: No worker has that name or rank.

        """
        if to is None:
            return WorkerInfo(self.name, self.rank)
        if isinstance(to, WorkerInfo):
            to = to.id
        if isinstance(to, str):
            if to not in self._ranks:
                raise InvalidRankError(f"rpc: no worker is named {to!r} (workers: {', '.join(self._names)})")
            return WorkerInfo(to, self._ranks[to])
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self.world_size:
            raise InvalidRankError(f"rpc: no worker has rank {to!r} (ranks 0..{self.world_size - 1})")
        return WorkerInfo(self._names[to], to)

    def worker_infos(self) -> list[WorkerInfo]:
        """Return every worker's info, by rank."""
        return [WorkerInfo(n, r) for r, n in enumerate(self._names)]

    # --- calls -------------------------------------------------------------------------------------------

    def rpc_async(self, to: str | int | WorkerInfo, fn: Callable[..., Any], args: tuple[Any, ...] = (),
                  kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> Future:
        """Call ``fn(*args, **kwargs)`` on worker ``to``; return a :class:`Future` of its result.

        Raises:
            InvalidRankError: No such worker.
            BackendClosedError: This agent was shut down.
            PeerLostError: That worker is gone (also set on the future when it goes during the call).

        """
        peer = to if type(to) is int and 0 <= to < self.world_size else self.worker_info(to).id
        pending = _Pending(Future(), peer, self._names[peer], fn)
        if self._closed:
            raise BackendClosedError(f"{pending.what}: this worker's RPC agent was shut down")
        if peer == self.rank:  # a call to this worker runs in its own pool, without the network
            self._pool.submit(self._run_local, pending.future, fn, args, kwargs or {})
            return self._with_deadline(pending, None, timeout)
        with self._lock:
            if peer in self._lost:
                raise PeerLostError(f"{pending.what}: worker {pending.peer_name} is gone ({self._lost[peer]})", peer)
            call_id = next(self._ids)
            self._pending[call_id] = pending
        try:
            parts = encode(Kind.REQUEST, call_id, (fn, tuple(args), kwargs or {}))
            send_message(self._sockets[peer], self._send_locks[peer], parts)
        except (OSError, DistributedError) as exc:
            self._forget(call_id)
            raise PeerLostError(f"{pending.what}: cannot send: {exc}", peer) from exc
        except Exception:
            self._forget(call_id)  # the arguments did not pickle: nothing was sent
            raise
        return self._with_deadline(pending, call_id, timeout)

    def rpc_sync(self, to: str | int | WorkerInfo, fn: Callable[..., Any], args: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` on worker ``to`` and return its result (see :meth:`rpc_async`)."""
        return self.rpc_async(to, fn, args, kwargs, timeout).wait()

    def notify(self, to: int, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> None:
        """Run ``fn(*args)`` on worker ``to`` without waiting or an answer (errors are logged there).

        Used for messages whose loss is harmless, such as dropping a remote reference.
        """
        if self._closed or to in self._lost:
            return
        if to == self.rank:
            self._pool.submit(_logged, fn, args)
            return
        try:
            send_message(self._sockets[to], self._send_locks[to], encode(Kind.REQUEST, 0, (fn, tuple(args), {})))
        except OSError as exc:
            log.debug("rpc %s: could not notify %s: %s", self.name, self._names[to], exc)

    def _with_deadline(self, pending: _Pending, call_id: int | None, timeout: float | None) -> Future:
        seconds = self.timeout if timeout is None else timeout
        future = pending.future
        if seconds > 0 and not future.done():
            self._deadlines.add(time.monotonic() + seconds, future, (call_id, seconds, pending.peer_name, pending.fn))
        return future

    def _expire(self, future: Future, call_id: int | None, seconds: float, peer_name: str, fn: Any) -> None:
        if call_id is not None:
            self._forget(call_id)
        _settle(future, exception=DistributedTimeoutError(f"{_describe(peer_name, fn)}: no answer within "
                                                          f"{seconds:g} s"))

    def _forget(self, call_id: int) -> _Pending | None:
        with self._lock:
            return self._pending.pop(call_id, None)

    def _run_local(self, future: Future, fn: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> None:
        try:
            _settle(future, result=fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            _settle(future, exception=exc)

    # --- serving -------------------------------------------------------------------------------------------

    def _read(self, peer: int) -> None:
        receiver = Receiver(self._sockets[peer])
        try:
            while True:
                kind, call_id, body, buffers = receiver.receive()
                if kind == Kind.REQUEST:
                    self._pool.submit(self._serve, peer, call_id, body, buffers)
                elif kind == Kind.DONE:
                    with self._lock:
                        self._done_peers.add(peer)
                        self._done_changed.notify_all()
                else:
                    self._answer(peer, kind, call_id, body, buffers)
        except (OSError, DistributedError) as exc:
            reason = "its connection closed" if isinstance(exc, PeerLostError) else str(exc)
            self._peer_lost(peer, reason)
        except RuntimeError as exc:  # the pool refused work: this agent is shutting down
            if not self._closed:
                self._peer_lost(peer, str(exc))

    def _serve(self, peer: int, call_id: int, body: bytes, buffers: list[bytearray]) -> None:
        try:
            fn, args, kwargs = decode(Kind.REQUEST, call_id, body, buffers).body
            if call_id == 0:  # a notification: nobody waits for an answer
                _logged(fn, args)
                return
            parts = encode(Kind.RESPONSE, call_id, fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - sent back to the caller
            if call_id == 0:
                log.warning("rpc %s: a notification from %s failed: %s", self.name, self._names[peer], exc)
                return
            parts = _error_parts(call_id, exc, self.name)
        try:
            send_message(self._sockets[peer], self._send_locks[peer], parts)
        except OSError as exc:
            log.debug("rpc %s: could not answer %s: %s", self.name, self._names[peer], exc)

    def _answer(self, peer: int, kind: int, call_id: int, body: bytes, buffers: list[bytearray]) -> None:
        pending = self._forget(call_id)
        if pending is None:
            return  # the caller gave up on it (timeout): a late answer is dropped
        try:
            message = decode(kind, call_id, body, buffers)
        except Exception as exc:  # noqa: BLE001 - the result did not unpickle here
            _settle(pending.future, exception=RemoteError(f"{pending.what}: the result could not be read here: "
                                                          f"{type(exc).__name__}: {exc}", self._names[peer]))
            return
        if message.kind == Kind.RESPONSE:
            _settle(pending.future, result=message.body)
        else:
            _settle(pending.future, exception=_remote_exception(message.body, pending.what))

    def lost_ranks(self) -> set[int]:
        """Return the ranks of the workers this one has lost (closing the agent loses them all)."""
        with self._lock:
            return set(self._lost)

    def _peer_lost(self, peer: int, reason: str) -> None:
        with self._lock:
            if peer in self._lost:
                return
            finished = peer in self._done_peers  # it said goodbye first: closing is not a loss
            self._lost[peer] = "it shut down" if finished else reason
            self._done_peers.add(peer)  # a lost worker will send nothing more: it counts as done
            self._done_changed.notify_all()
            failed = [self._pending.pop(i) for i in [i for i, p in self._pending.items() if p.peer == peer]]
        if not self._closed and not finished:
            log.warning("rpc %s: worker %s is gone: %s", self.name, self._names[peer], reason)
        for pending in failed:
            _settle(pending.future, exception=PeerLostError(
                f"{pending.what}: worker {self._names[peer]} (rank {peer}) is gone: {reason}", peer))

    # --- the end -----------------------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Close the agent.

        Graceful (collective: every worker calls it): wait for this worker's
        outstanding calls, tell every peer this worker is done, keep serving until
        every peer is done too, then close. Not graceful: fail every pending
        future at once and close.

        Raises:
            DistributedTimeoutError: Graceful, and some workers did not finish
                within ``timeout`` (named); the agent is closed all the same.

        """
        if self._closed:
            return
        seconds = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        late: list[str] = []
        if graceful:
            with self._lock:
                waiting = [p.future for p in self._pending.values()]
            concurrent.futures.wait(waiting, timeout=max(deadline - time.monotonic(), 0))
            for peer in self._sockets:
                try:
                    send_message(self._sockets[peer], self._send_locks[peer], encode(Kind.DONE, 0, None))
                except OSError:
                    pass  # a lost peer counts as done
            with self._lock:
                while len(self._done_peers) < len(self._sockets):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        late = [self._names[p] for p in self._sockets if p not in self._done_peers]
                        break
                    self._done_changed.wait(left)
        self._closed = True
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for entry in pending:
            _settle(entry.future, exception=BackendClosedError(f"{entry.what}: the RPC agent was shut down"))
        for sock in self._sockets.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for reader in self._readers:
            reader.join(timeout=5)
        self._pool.shutdown(wait=graceful, cancel_futures=not graceful)
        self._deadlines.stop()
        if late:
            raise DistributedTimeoutError(f"rpc shutdown on {self.name}: workers {', '.join(late)} did not finish "
                                          f"their calls within {seconds:g} s")


def _logged(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - nobody waits for a notification
        log.warning("rpc: a notification (%s) failed: %s", _qualified(fn), exc)


class _Deadlines:
    """One thread that fails each call still pending at its deadline (a timer thread per call cost ~50 us a call).

    Futures are held weakly: a completed call's future (and its result, which may
    be an RRef whose lifetime counts) must not live until its deadline. A call still
    waiting is held by the agent's pending calls, or by its caller.
    """

    def __init__(self, name: str, expire: Callable[..., None]) -> None:
        self._heap: list[tuple[float, int, weakref.ref[Future], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self._expire = expire
        self._changed = threading.Condition()
        self._stopped = False
        self._compact_at = 4096
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def add(self, deadline: float, future: Future, info: tuple[Any, ...]) -> None:
        """Call ``expire(future, *info)`` at ``deadline`` unless the future completed by then."""
        with self._changed:
            order = next(self._order)
            heapq.heappush(self._heap, (deadline, order, weakref.ref(future), info))
            if len(self._heap) > self._compact_at:  # drop calls that completed long before their deadline
                self._heap = [e for e in self._heap if (f := e[2]()) is not None and not f.done()]
                heapq.heapify(self._heap)
                self._compact_at = max(4096, 2 * len(self._heap))
            if self._heap[0][1] == order:  # the earliest deadline changed: the thread sleeps less
                self._changed.notify()

    def stop(self) -> None:
        """End the thread."""
        with self._changed:
            self._stopped = True
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._changed.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stopped:
                    return
                _, _, ref, info = heapq.heappop(self._heap)
            future = ref()
            if future is not None and not future.done():
                self._expire(future, *info)


def _settle(future: Future, *, result: Any = None, exception: BaseException | None = None) -> None:
    """Complete ``future`` unless it already completed (a timeout and an answer may race)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _describe(peer_name: str, fn: Any) -> str:
    return f"rpc to {peer_name} ({_qualified(fn)})"


def _qualified(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _error_parts(call_id: int, exc: BaseException, worker: str) -> list[Any]:
    text = "".join(traceback.format_exception(exc))
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    try:
        return encode(Kind.ERROR, call_id, (exc, text, kind, worker))
    except Exception:  # noqa: BLE001 - the exception does not pickle: send its text
        return encode(Kind.ERROR, call_id, (None, text, kind, worker))


def _remote_exception(body: Any, what: str) -> BaseException:
    exc, text, kind, worker = body
    if exc is None:
        return RemoteError(f"{what}: raised {kind} on worker {worker}:\n{text}", worker, kind, text)
    exc.__cause__ = _RemoteTraceback(text)
    exc.add_note(f"(raised on RPC worker {worker}; {what})")
    return exc
