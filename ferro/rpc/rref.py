"""Remote references: a value that lives on its owner, with reference counts kept across workers.

``remote(to, fn)`` runs ``fn`` on worker ``to`` and leaves the result there; the
caller gets an :class:`RRef`. RRefs travel in arguments and results like any
value. The owner keeps the value while any RRef to it exists anywhere:

* the owner counts RRef objects, wherever they live (the creator's counts one);
* before an RRef is pickled to travel, the sender raises the owner's count for
  the copy that will exist at the other end, and waits for the owner to confirm
  (a local increment when the sender is the owner). The copy can therefore never
  drop its reference before the owner counted it, whatever the order in which
  messages from different workers arrive;
* an RRef object that is garbage-collected tells its owner (a notification; the
  owner's own objects decrement locally);
* the owner frees the value once its count is zero *and* the value exists (a
  count can reach zero before the creating call ran, and must not free then).

A message that carries an RRef and is never delivered (its call timed out, a
worker died) leaves its count raised: the value then lives until the owner exits.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

from ferro.errors import DistributedTimeoutError, RemoteError
from ferro.rpc import api
from ferro.rpc.agent import Future, RpcAgent, WorkerInfo
from ferro.rpc.owned import RRefId

__all__ = ["RRef", "owned_count", "remote"]


_serials = itertools.count(1)  # RRef ids made here; with the rank, unique in the job


def _agent(what: str) -> RpcAgent:
    return api._current(what)


# --- what runs on the owner ------------------------------------------------------------------------------

def _create(rref_id: RRefId, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    table = _agent("remote").owned
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:
        table.made(rref_id, error=_detached(exc))
        raise
    table.made(rref_id, value=value)


def _value(rref_id: RRefId, timeout: float | None) -> Any:
    entry = _agent("RRef").owned.entry(rref_id)
    if not entry.made.wait(timeout):
        raise DistributedTimeoutError(f"RRef {rref_id}: its value was not made within {timeout} s")
    if entry.error is not None:
        # A copy per raise: a raised exception's traceback holds the frames (and RRefs) it passed through, and
        # the stored one would keep them alive from the owner table.
        raise _detached(entry.error)
    return entry.value


def _detached(exc: BaseException) -> BaseException:
    """Return a copy of ``exc`` without a traceback (a RemoteError with its text if it cannot be copied)."""
    try:
        copied = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception type that cannot be rebuilt from its args
        copied = RemoteError(f"{type(exc).__qualname__}: {exc}")
    copied.__traceback__ = None
    copied.__context__ = copied.__cause__ = None
    return copied


def _incref(rref_id: RRefId) -> None:
    _agent("RRef").owned.add(rref_id, 1)


def _decref(rref_id: RRefId) -> None:
    _agent("RRef").owned.add(rref_id, -1)


def _call_method(rref_id: RRefId, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return getattr(_value(rref_id, None), name)(*args, **kwargs)


# --- the reference -----------------------------------------------------------------------------------------

class RRef:
    """A reference to a value that lives on its owner worker.

    Made by :func:`remote` (or passed in an argument or a result). The value stays
    on the owner until every RRef to it, on every worker, is gone.
    """

    def __init__(self, owner: int, rref_id: RRefId, agent: RpcAgent, created: Future | None = None) -> None:
        self._owner, self._id, self._agent, self._created = owner, rref_id, agent, created
        self._live = True

    def owner(self) -> WorkerInfo:
        """Return the owner's :class:`~ferro.rpc.WorkerInfo`."""
        return self._agent.worker_info(self._owner)

    def owner_name(self) -> str:
        """Return the owner's name."""
        return self.owner().name

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._owner == self._agent.rank

    def local_value(self) -> Any:
        """Return the value itself (on the owner only).

        Raises:
            RuntimeError: This worker is not the owner (use :meth:`to_here`).

        """
        if not self.is_owner():
            raise RuntimeError(f"RRef.local_value: the value lives on {self.owner_name()}, not here "
                               f"({self._agent.name}); use to_here()")
        return _value(self._id, self._agent.timeout)

    def to_here(self, timeout: float | None = None) -> Any:
        """Return a copy of the value, fetched from the owner (the value itself on the owner)."""
        seconds = self._agent.timeout if timeout is None else timeout
        if self.is_owner():
            return _value(self._id, seconds)
        return self._agent.rpc_sync(self._owner, _value, (self._id, seconds), timeout=seconds)

    def rpc_sync(self, timeout: float | None = None) -> Any:
        """Return a proxy whose method calls run on the owner and return their results: ``rref.rpc_sync().f(x)``."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float | None = None) -> Any:
        """Return a proxy whose method calls run on the owner and return futures."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float | None = None) -> Any:
        """Return a proxy whose method calls run on the owner and return RRefs to their results (owned there)."""
        return _Proxy(self, "remote", timeout)

    def __reduce__(self) -> tuple[Any, ...]:
        # The copy that will exist at the other end is counted before it can be dropped there.
        if self.is_owner():
            self._agent.owned.add(self._id, 1)
        else:
            self._agent.rpc_sync(self._owner, _incref, (self._id,))
        return _rebuild, (self._owner, self._id)

    def __del__(self) -> None:
        if not getattr(self, "_live", False):
            return
        self._live = False
        agent = self._agent
        if agent._closed:
            return
        if self._owner == agent.rank:
            agent.owned.add(self._id, -1)
        else:
            agent.notify(self._owner, _decref, (self._id,))

    def __repr__(self) -> str:
        return f"RRef(owner={self._owner}, id={self._id})"


def _rebuild(owner: int, rref_id: RRefId) -> RRef:
    return RRef(owner, rref_id, _agent("RRef"))


class _Proxy:
    def __init__(self, rref: RRef, how: str, timeout: float | None) -> None:
        self._rref, self._how, self._timeout = rref, how, timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        rref, how, timeout = self._rref, self._how, self._timeout

        def call(*args: Any, **kwargs: Any) -> Any:
            call_args = (rref._id, name, args, kwargs)
            if how == "remote":
                return remote(rref._owner, _call_method, call_args, timeout=timeout)
            return getattr(rref._agent, how)(rref._owner, _call_method, call_args, timeout=timeout)

        return call


def remote(to: str | int | WorkerInfo, func: Callable[..., Any], args: tuple[Any, ...] = (),
           kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> RRef:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and keep the result there; return an :class:`RRef` to it.

    Returns at once; ``to_here()`` waits for the value (and raises what ``func`` raised).

    Example::

        counter = ferro.rpc.remote("ps", Counter)          # a Counter object lives on "ps"
        counter.rpc_sync().increment(5)                    # runs on "ps"
        counter.to_here()                                  # a copy of it, here

    """
    agent = _agent("remote")
    owner = agent.worker_info(to).id
    rref_id = (agent.rank, next(_serials))
    created = agent.rpc_async(owner, _create, (rref_id, func, tuple(args), kwargs or {}), timeout=timeout)
    return RRef(owner, rref_id, agent, created)


def owned_count() -> int:
    """Return how many values this worker owns for RRefs (a debugging counter: 0 once every holder dropped them)."""
    return len(_agent("owned_count").owned)
