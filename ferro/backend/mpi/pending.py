"""What an async collective on an MPI group returns: the nonblocking calls it started, completed by ``wait()``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ferro.errors import DistributedTimeoutError

if TYPE_CHECKING:
    from ferro.backend.mpi.backend import MpiBackend

__all__ = ["Issued", "MpiPending", "count_spans"]


def count_spans(total: int, limit: int) -> list[tuple[int, int]]:
    """Split ``range(total)`` into consecutive spans of at most ``limit``."""
    return [(start, min(start + limit, total)) for start in range(0, total, limit)] or [(0, 0)]


class Issued:
    """What one nonblocking call started: its MPI requests, the steps to run after them, and its result."""

    __slots__ = ("finishers", "requests", "result", "timeout")

    def __init__(self, timeout: float) -> None:
        self.requests: list[Any] = []
        self.finishers: list[Callable[[], None]] = []
        self.result: Callable[[], Any] | None = None
        self.timeout = timeout  # the collective's, as its calls were given it


class MpiPending:
    """A collective started with ``async_op=True`` on an MPI group: MPI requests in flight.

    It behaves as :class:`~ferro.PendingCollective` does. :meth:`wait` completes
    the requests (``MPI_Waitall``, watched by the group's timeout), then finishes
    the call (MEAN's division, a part copied out) and returns its result.
    :meth:`is_completed` tests them, which also lets MPI progress them: MPI moves
    a nonblocking collective's data only inside MPI calls (unless the MPI library
    runs a progress thread), so a long computation between start and ``wait``
    overlaps little of a large one.

    Example::

        pending = ferro.allreduce(grads, group=mpi_group, async_op=True)   # MPI_Iallreduce
        ...                                   # compute meanwhile
        grads = pending.wait()                # MPI_Waitall, then the result
    """

    def __init__(self, group: MpiBackend, call: str, description: str, buffers: tuple[Any, ...], issued: Issued,
                 result: Any) -> None:
        self._group, self._call, self._description = group, call, description
        self._buffers: tuple[Any, ...] | None = buffers  # owned until completion
        self._issued, self._value = issued, result
        self._deadline = time.monotonic() + issued.timeout
        self._lock = threading.Lock()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        if not issued.requests:
            self._complete()

    def is_completed(self) -> bool:
        """Whether the collective has finished; tests (and so progresses) its MPI requests."""
        if not self._done:
            with self._lock:
                if not self._done:
                    try:
                        if self._group.test_all(self._issued.requests, self._call):
                            self._complete()
                    except BaseException as exc:
                        self._fail(exc)
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Complete the collective and return its result.

        Args:
            timeout: Seconds to wait; ``None`` waits up to the collective's own timeout,
                after which the group's watchdog ends the job (MPI cannot cancel it).

        Raises:
            DistributedTimeoutError: Still running after ``timeout`` (it keeps running).
            Whatever the collective raised.

        """
        if not self._done:
            with self._lock:
                if not self._done:
                    try:
                        if timeout is None:
                            self._group.wait_all(self._issued.requests, self._call,
                                                 max(self._deadline - time.monotonic(), 0.0))
                        elif not self._group.poll(lambda: self._group.test_all(self._issued.requests, self._call),
                                                  time.monotonic() + timeout):
                            raise DistributedTimeoutError(f"{self._description} has not completed after "
                                                          f"{timeout:g} s (it keeps running)")
                    except DistributedTimeoutError:
                        raise
                    except BaseException as exc:
                        self._fail(exc)
                    else:
                        self._complete()
        if self._error is not None:
            raise self._error
        return self._result

    def _fail(self, exc: BaseException) -> None:
        self._group.mark_failed(f"{self._call} failed: {exc}")
        self._finish(None, exc)

    def _complete(self) -> None:
        try:
            for step in self._issued.finishers:
                step()
            value = self._issued.result() if self._issued.result is not None else self._value
        except BaseException as exc:  # handed to the caller by wait()
            self._finish(None, exc)
        else:
            self._finish(value, None)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error, self._done = result, error, True
        self._buffers = None
        self._issued = Issued(0.0)  # drop the requests and steps: they hold the call's buffers

    def __repr__(self) -> str:
        return f"<MpiPending {self._description} {'completed' if self._done else 'pending'}>"
