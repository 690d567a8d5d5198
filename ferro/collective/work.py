"""Async collectives: each group runs its collectives one at a time, in call order, on a worker of its own.

The thread rule. A group's calls are matched across ranks in the order each
rank issues them. Calls issued by different threads carry different thread
tags (a hash of the thread's name, :func:`ferro.types.thread_tag`), and a call
never matches a call of another tag: when two threads race to use one group,
the ranks' orders may differ, and instead of meeting the wrong partner (and
returning a wrong sum) the calls fail with :class:`~ferro.CollectiveMismatchError`
naming both calls. So: several threads may use a group one after another, with
threads of the same name on every rank issuing the same calls; threads that run
collectives *at the same time* need a group each (``ferro.new_group``). An async
call and whatever its task issues on the worker keep the tag of the thread that
made the call.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ferro._core.state import GroupState
from ferro.errors import DistributedTimeoutError
from ferro.types import thread_tag

__all__ = ["GroupWorker", "PendingCollective", "issuer_tag", "worker_of"]

log = logging.getLogger("ferro.collective.work")

class _Issuing(threading.local):
    """Per thread: the tag of the call a worker thread is running (while it runs), and the thread's own tag."""

    task_tag: int | None = None  # class defaults: reading them raises nothing when unset (a hot path)
    name: str | None = None
    name_tag = 0


_issuing = _Issuing()


def issuer_tag() -> int:
    """Return the thread tag of calls issued now: the task's on a worker, else the current thread's."""
    issuing = _issuing
    if issuing.task_tag is not None:
        return issuing.task_tag
    name = threading.current_thread().name
    if name is not issuing.name:  # first call on this thread, or the thread was renamed
        issuing.name, issuing.name_tag = name, thread_tag(name)
    return issuing.name_tag


# A worker with nothing to do for this long ends; the next async call starts another.
IDLE_SECONDS = 10.0


class PendingCollective:
    """A collective started with ``async_op=True``.

    It keeps references to its input and output arrays until it completes, so
    they stay alive; do not modify them before :meth:`wait` returns. Collectives
    of one group complete in the order they were called, on every rank.

    Example::

        pending = ferro.allreduce(grads, group=g, async_op=True)
        ...                                   # compute while the allreduce runs
        grads = pending.wait()                # the reduced array (or the error)
    """

    def __init__(self, description: str, buffers: tuple[Any, ...]) -> None:
        self._description = description
        self._buffers: tuple[Any, ...] | None = buffers  # owned until completion
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[PendingCollective], None]] | None = None

    def is_completed(self) -> bool:
        """Whether the collective has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective finishes and return its result.

        Args:
            timeout: Seconds to wait; ``None`` waits for the collective's own
                timeout to decide.

        Raises:
            DistributedTimeoutError: Still running after ``timeout`` (it keeps running).
            DistributedError: Whatever the collective raised (a subclass, naming the rank and the peer).

        """
        if not self._done.wait(timeout):
            raise DistributedTimeoutError(f"{self._description} has not completed after {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[[PendingCollective], None]) -> None:
        """Call ``fn(self)`` once the collective finishes (at once, on this thread, if it has).

        Callbacks run on the thread that completes the collective (the group's
        worker), in the order they were added, after :meth:`wait` has been
        released and before the worker takes the group's next queued call; one
        that raises is logged and the others still run.
        This is how an adapter completes a future of its own (torch's, in
        :mod:`ferro.interop.torch`) without a thread of its own waiting.
        """
        with _callbacks_lock:
            if not self._done.is_set():
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _call_back(fn, self)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._buffers = None
        with _callbacks_lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            _call_back(fn, self)

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<PendingCollective {self._description} {state}>"


# Guards the hand-over of callbacks between add_done_callback and _finish (held for a few instructions).
_callbacks_lock = threading.Lock()


def _call_back(fn: Callable[[PendingCollective], None], pending: PendingCollective) -> None:
    try:
        fn(pending)
    except Exception:  # a callback's bug must not kill the worker or skip the callbacks after it
        log.exception("a done-callback of %s raised", pending._description)


class GroupWorker:
    """Runs one group's collectives in call order; synchronous calls wait behind pending async ones.

    It keeps the group state's ``busy`` and ``queued`` up to date (under its lock):
    the direct paths (:class:`ferro._core.direct.DirectCall`) read them without a
    lock and step aside while either is set; they mark the group busy while they
    run and :meth:`wake` the worker after, if something queued meanwhile.
    """

    def __init__(self, name: str, state: GroupState) -> None:
        self._name = name
        self._state = state
        self._cond = threading.Condition(threading.Lock())  # not the default RLock: cheaper, never re-entered
        self._queue: deque[tuple[Callable[[], Any], PendingCollective, int]] = deque()
        self._owner: int | None = None  # the thread running the group's current operation
        self._thread: threading.Thread | None = None
        self._calling_back: int | None = None  # the worker thread while it runs a finished call's callbacks

    def submit(self, fn: Callable[[], Any], description: str, buffers: tuple[Any, ...]) -> PendingCollective:
        """Queue ``fn`` behind the group's earlier calls and return its handle."""
        pending = PendingCollective(description, buffers)
        with self._cond:
            self._queue.append((fn, pending, issuer_tag()))
            self._state.queued = len(self._queue)
            if self._calling_back == threading.get_ident():
                # A done-callback issues a call (torch's PowerSGD chains futures this way) and may wait on it:
                # a fresh thread serves the queue from here, and this one ends when its callbacks return.
                self._calling_back, self._thread = None, None
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"ferro-worker-{self._name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return pending

    def wake(self) -> None:
        """Tell the worker the group is free: a direct path (which marks the group busy while it runs) ended."""
        with self._cond:
            self._cond.notify_all()

    def run(self, fn: Callable[[], Any], description: str, buffers: tuple[Any, ...]) -> Any:
        """Run ``fn`` now if nothing is queued, else after everything queued; return its result.

        Called from the thread that is running the group's current operation (a
        collective inside an async task or inside another collective's callback,
        such as a DDP communication hook), ``fn`` runs at once: it is part of
        that operation.
        """
        me = threading.get_ident()
        if self._owner == me:
            return fn()
        state = self._state
        with self._cond:
            if self._queue or state.busy:
                inline = False
            else:
                state.busy = True
                self._owner = me
                inline = True
        if not inline:
            return self.submit(fn, description, buffers).wait()
        try:
            return fn()
        finally:
            with self._cond:
                state.busy = False
                self._owner = None
                if self._thread is not None:  # only the worker ever waits on the condition
                    self._cond.notify_all()

    def _loop(self) -> None:
        state = self._state
        while True:
            with self._cond:
                while not self._queue or state.busy:
                    if not self._cond.wait(IDLE_SECONDS) and not self._queue and not state.busy:
                        self._thread = None
                        return
                fn, pending, tag = self._queue.popleft()
                # Busy before the queue looks shorter: the direct path must never see both clear.
                state.busy = True
                state.queued = len(self._queue)
                self._owner = threading.get_ident()
            _issuing.task_tag = tag  # what the task issues is its caller's
            try:
                result, error = fn(), None
            except BaseException as exc:  # handed to the caller through the handle
                result, error = None, exc
            finally:
                _issuing.task_tag = None
                with self._cond:
                    state.busy = False
                    self._owner = None
                    self._cond.notify_all()
            # No lock for the hand-off's bookkeeping: _calling_back is written only by the worker thread (here, or
            # in submit from one of its callbacks), and a hand-off happens only on this thread, so this thread
            # sees its own writes in order.
            me = threading.current_thread()
            self._calling_back = me.ident
            _issuing.task_tag = tag  # what a callback issues is its call's issuer's, as the task's own calls are
            try:
                pending._finish(result, error)
            finally:
                _issuing.task_tag = None
            if self._thread is not me:
                return  # a callback handed the queue to a new worker thread (see submit)
            self._calling_back = None
            # Drop the task: its closure may hold large buffers, and this frame lives until the next task.
            fn = pending = result = error = None  # type: ignore[assignment]


def worker_of(group: Any) -> GroupWorker:
    """Return the group's worker, created on first use and kept in the group's state."""
    state = group.state
    worker = state.worker
    if worker is None:
        # A losing candidate of a race has started no thread and is simply dropped.
        worker = state.adopt_worker(GroupWorker(f"rank{group.rank}", state))
    return worker
