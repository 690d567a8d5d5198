"""What the ``"ferro"`` torch process group returns: a ``torch.distributed.Work`` over ferro's handles."""

from __future__ import annotations

import concurrent.futures
import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ferro.collective.work import PendingCollective
from ferro.errors import DistributedTimeoutError

__all__ = ["HANDLES", "FerroWork"]

#: What ferro's async calls return, and a work waits on.
HANDLES = (PendingCollective, concurrent.futures.Future)


class _Failed:
    """What the settling future holds when the call failed: the error, for :func:`_outcome` to raise."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _outcome(settled: Any) -> Any:
    """Turn the settling future's value into the torch future's: the output tensors, or a raised error."""
    value = settled.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class FerroWork(dist.Work):
    """One torch call in flight on a ferro group: torch's ``Work``, whose future holds the output tensors.

    It completes when the last of its ferro calls does (a group completes its
    calls in order); the future's callbacks (DDP's) run on the group's worker.

    A failed call must fail the future in C++, not only in Python.
    ``torch.futures.Future.set_exception`` does not: it completes the C++
    future *successfully*, with the exception object as its value, and leaves
    the raise to Python's ``wait()``. DDP's reducer reads the value in C++,
    finds no tensors in it and indexes past the end (a segfault in the middle
    of backward when a peer dies). So the worker completes a private settling
    future, and the future torch sees is its ``then``: a callback that raises
    makes torch mark that future failed (``setError``), which C++ callers see
    as an error and Python callers as the ferro exception itself.

    Example::

        work = dist.all_reduce(t, async_op=True)   # on a "ferro" group
        work.wait()                                 # t holds the sum
    """

    def __init__(self, what: str, pendings: Sequence[PendingCollective | concurrent.futures.Future], value: Any,
                 finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._what = what
        self._pendings = tuple(pendings)
        self._value = value
        self._finish = finish
        self._settled: Any = torch.futures.Future()
        self._future: Any = self._settled.then(_outcome)
        self._done = threading.Event()
        self._error: BaseException | None = None
        #: A receive from any source: the future of its sender's rank (see :meth:`_source_rank`).
        self.source: concurrent.futures.Future | None = None
        if self._pendings:
            self._pendings[-1].add_done_callback(self._complete)
        else:
            self._complete(None)

    def _complete(self, _: Any) -> None:
        try:
            for pending in self._pendings:  # raises the first failure; all are done once the last is
                if isinstance(pending, concurrent.futures.Future):
                    pending.result(0)
                else:
                    pending.wait(0)
            if self._finish is not None:
                self._finish()
        except BaseException as exc:  # handed to the waiter, through wait() and the future
            self._error = exc
            self._settled.set_result(_Failed(exc))
        else:
            self._settled.set_result(self._value)
        finally:
            self._pendings, self._finish = (), None  # the buffers they hold are free to go
            self._done.set()

    def wait(self, timeout: Any = None) -> bool:
        """Block until the call completes; raise its error, if any.

        Args:
            timeout: A ``timedelta`` or seconds; None or zero waits for the call's own timeout.

        Raises:
            DistributedTimeoutError: Not complete within ``timeout`` (the call goes on).

        """
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if not self._done.wait(seconds if seconds else None):
            raise DistributedTimeoutError(f"{self._what} has not completed after {seconds:g} s")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Any:
        """Return the ``torch.futures.Future`` completed with the call's output tensors."""
        return self._future

    def is_completed(self) -> bool:
        """Whether the call has finished, successfully or not."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """Whether the call has finished without an error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """Return the call's error (None while running or after success)."""
        return self._error

    def result(self) -> Any:
        """Return the output tensors (after :meth:`wait`)."""
        return self._value

    def _source_rank(self) -> int:
        """Return the sender's group rank, for a completed receive from any source (torch's ``dist.recv`` asks)."""
        if self.source is None:
            raise ValueError(f"{self._what}: only a receive from any source has a source rank")
        if not self._done.is_set():
            raise ValueError(f"{self._what}: the receive has not completed; wait() first")
        if self._error is not None:
            raise self._error
        return int(self.source.result(0))

    def synchronize(self) -> None:
        """Do nothing: CPU tensors need no stream synchronisation."""

    def __repr__(self) -> str:
        return f"<FerroWork {self._what} {'completed' if self.is_completed() else 'pending'}>"
