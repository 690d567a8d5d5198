"""The last room of a collective call: its link, its place in the group's order, and the guard around it.

:func:`make_link` gives the call the fingerprint every frame of it carries;
:func:`execute` runs (or queues) its body through the group's worker, which keeps
calls in order, inside a guard that tells the peers when it fails part-way
(:func:`fail_together`). Shared by the collectives, the object collectives and p2p.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ferro._buffers import Operand
from ferro._core.transport import (
    ABORT_MISMATCH,
    ABORT_OTHER,
    ABORT_PEER_LOST,
    ABORT_TIMEOUT,
    KIND_COLLECTIVE,
    abort_payload,
    kind_name,
)
from ferro.backend.base import Backend
from ferro.collective.algorithms import Link
from ferro.collective.flight_recorder import dump_on_failure
from ferro.collective.work import issuer_tag, worker_of
from ferro.errors import (
    BackendClosedError,
    CollectiveMismatchError,
    ConnectionBrokenError,
    DistributedError,
    DistributedTimeoutError,
    InvalidBufferError,
    PeerLostError,
)
from ferro.types import COLLECTIVE_IDS, THREAD_TAG_BITS, describe_fingerprint, fingerprint

__all__ = ["execute", "fail_together", "make_link", "make_link_fingerprint"]


def _describe_mismatch(exc: CollectiveMismatchError, group: Backend) -> str:
    if exc.expected is None or exc.actual is None:
        return str(exc)
    (my_kind, my_fp), (their_kind, their_fp) = exc.expected, exc.actual
    mine = describe_fingerprint(my_fp, their_fp) if my_kind == KIND_COLLECTIVE else kind_name(my_kind)
    theirs = (describe_fingerprint(their_fp, my_fp) if their_kind == KIND_COLLECTIVE
              else f"a {kind_name(their_kind)} call")
    message = f"rank {group.rank} called {mine} but rank {exc.peer} called {theirs}: the ranks' calls differ"
    if my_kind == their_kind == KIND_COLLECTIVE and (my_fp ^ their_fp) & THREAD_TAG_BITS:
        message += (f"; they were issued by threads of different names (this rank's: "
                    f"{threading.current_thread().name!r}): calls from several threads at once met each other "
                    f"in a different order on each rank. Give each thread that runs collectives concurrently a "
                    f"group of its own (ferro.new_group), and issue a group's calls from threads of the same name "
                    f"on every rank")
    return message


def _run_guarded(group: Backend, name: str, body: Callable[[], Any], record: int = 0, queued: bool = False) -> Any:
    """Run a collective; on a failure part-way, tell the peers and mark the group failed.

    ``record`` is the call's flight-recorder entry (0: none); ``queued``: it was
    recorded as queued and starts now. The entry is marked failed before the peers
    are told, so the dump the failure writes shows it so.
    """
    state = group.state
    if queued:
        state.record_start(record)
    if group.closed:
        state.record_end(record, False)
        raise BackendClosedError(f"rank {group.rank}: {name}: this process group was closed (destroy_process_group() "
                                 f"or close()); create a new one to go on")
    if group.failure is not None:
        state.record_end(record, False)
        raise ConnectionBrokenError(
            f"rank {group.rank}: {name}: this group is unusable after an earlier failed collective "
            f"({group.failure}); create a new group")
    try:
        result = body()
    except BaseException as exc:
        state.record_end(record, False)
        fail_together(group, name, exc)
        raise
    state.record_end(record, True)
    return result


def fail_together(group: Backend, name: str, exc: BaseException) -> None:
    """Tell the peers why this rank gave up on a collective and mark the group failed.

    Raises the clearer error for a mismatch (both calls decoded); otherwise returns
    and the caller re-raises ``exc``. Errors that are not a distributed failure
    (say, a bug in a communication hook) pass untouched.
    """
    if isinstance(exc, CollectiveMismatchError):
        message = _describe_mismatch(exc, group)
        _give_up(group, ABORT_MISMATCH, exc.peer, message)
        if exc.expected is not None:  # else a notice from a peer: it already says what differed
            raise CollectiveMismatchError(message, exc.peer, exc.expected, exc.actual) from exc
    elif isinstance(exc, PeerLostError):
        _give_up(group, ABORT_PEER_LOST, exc.peer, f"rank {exc.peer if exc.peer is not None else '?'} was lost")
    elif isinstance(exc, DistributedTimeoutError):
        _give_up(group, ABORT_TIMEOUT, exc.peer, f"rank {group.rank} timed out: {exc}")
    elif isinstance(exc, (DistributedError, KeyboardInterrupt)):
        _give_up(group, ABORT_OTHER, None, f"rank {group.rank}: {type(exc).__name__}: {exc}")


def _give_up(group: Backend, code: int, peer: int | None, message: str) -> None:
    group.mark_failed(message)
    group.abort_peers(abort_payload(code, -1 if peer is None else peer, message))
    dump_on_failure(message)  # after the peers were told: they need not wait for the file


def execute(group: Backend, name: str, body: Callable[[], Any], async_op: bool, buffers: tuple[Any, ...],
            link: Link | None = None) -> Any:
    """Run (or queue, with ``async_op``) one operation of the group, in call order.

    The call is counted in the group's stats and flight recorder (``link`` gives the recorder its fingerprint).
    """
    if not group.host_memory and name != "barrier":
        raise InvalidBufferError(
            f"rank {group.rank}: {name}: this {type(group).__name__} moves GPU memory only; for host arrays and "
            f"objects use backend='hybrid' (TCP for the host, NCCL for the GPU)")
    state = group.state
    collective = COLLECTIVE_IDS[name]
    state.count_call(collective)
    record = state.record_call(collective, link.fingerprint if link is not None else 0,
                               sum(getattr(b, "nbytes", 0) for b in buffers), -1, not async_op)
    worker = worker_of(group)
    guarded = lambda: _run_guarded(group, name, body, record, async_op)  # noqa: E731 - this call's closure
    if async_op:
        if group.nonblocking_collectives:  # MPI: the calls start now and complete in the handle's wait()
            return group.issue_nonblocking(guarded, name, f"{name} on rank {group.rank}", buffers)
        return worker.submit(guarded, f"{name} on rank {group.rank}", buffers)
    return worker.run(guarded, f"{name} on rank {group.rank}", buffers)


def make_link(group: Backend, name: str, seconds: float, operand_: Operand | None = None, op_code: int = 0,
              root: int = 0, count: int = 0, shape: tuple[int, ...] = ()) -> Link:
    """Return the call's :class:`~ferro.collective.algorithms.Link`: its group, fingerprint and timeout."""
    return Link(group, make_link_fingerprint(group, name, operand_, op_code, root, count, shape), seconds)


def make_link_fingerprint(group: Backend, name: str, operand_: Operand | None = None, op_code: int = 0, root: int = 0,
                          count: int = 0, shape: tuple[int, ...] = ()) -> int:
    """Return the fingerprint every frame of this call carries (see :func:`ferro.types.fingerprint`).

    It carries the issuing thread's tag where the group matches calls by thread
    (the thread rule of :mod:`ferro.collective.work`).
    """
    code = operand_.dtype.code if operand_ is not None else -1
    tag = issuer_tag() if group.tags_threads else 0
    return fingerprint(name, code, op_code, root, count, shape, tag)
