"""Point-to-point messages that carry their dtype and shape, with tags.

A message is two frames: a fixed-size description (tag, dtype, shape) and the
data. The receiver needs no prior knowledge of what comes. Tags keep
independent streams between two ranks apart: a message that arrives for
another tag is set aside for the receive that asks for it, in arrival order.

Point-to-point calls are ordered with the group's collectives: they wait for
the group's pending async collectives, as a synchronous collective does.
Messages come from authenticated peers of the job only; the receiver allocates
what the sender describes (``max_bytes`` puts a ceiling on it).

GPU buffers on an NCCL group (:mod:`ferro.backend.nccl.routing`) travel as NCCL sends and
receives, which carry no description: the receiver passes a buffer of the
message's size (:func:`recv_into`), and tags must be 0.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ferro._buffers import Operand, is_device_array, operand, wrap_like
from ferro._core.transport import KIND_DATA
from ferro.backend.base import Backend
from ferro.backend.nccl import routing
from ferro.collective.meta import META_BYTES, array_from_meta, decode_meta, encode_meta
from ferro.collective.resolve import resolve_group, resolve_timeout
from ferro.collective.work import PendingCollective, worker_of
from ferro.errors import CollectiveMismatchError, DistributedTimeoutError, SizeMismatchError
from ferro.types import COLLECTIVE_IDS, fingerprint

__all__ = ["irecv", "irecv_any", "isend", "recv", "recv_any", "recv_into", "send", "sendrecv"]

_META_FP = fingerprint("p2p", root=1)
_DATA_FP = fingerprint("p2p", root=2)
MAX_TAG = 2**31 - 1
_P2P = COLLECTIVE_IDS["p2p"]
_SEND, _RECV, _SENDRECV = 1, 2, 3  # a point-to-point record's kind (ferro._core.recorder.h)


def _tag(tag: Any) -> int:
    if isinstance(tag, bool) or not hasattr(tag, "__index__") or not 0 <= tag.__index__() <= MAX_TAG:
        raise ValueError(f"tag must be an integer in [0, {MAX_TAG}], got {tag!r}")
    return int(tag.__index__())


def _recorded(g: Backend, body: Callable[[], Any], kind: int, peer: int, nbytes: int) -> Callable[[], Any]:
    """Count the call and give it a flight-recorder entry, queued now; the returned body marks it run and ended."""
    state = g.state
    state.count_call(_P2P)
    record = state.record_call(_P2P, 0, nbytes, peer, False, kind)

    def recorded() -> Any:
        state.record_start(record)
        try:
            result = body()
        except BaseException:
            state.record_end(record, False)
            raise
        state.record_end(record, True)
        return result

    return recorded


def _state(group: Backend) -> tuple[dict[tuple[int, int], deque[Operand]], dict[int, dict[str, Any]]]:
    """Per-group receive state: messages set aside by (source, tag), and descriptions whose data is still due."""
    state = group.state.p2p
    return state if state is not None else group.state.adopt_p2p(({}, {}))


def send(x: Any, dst: int, *, tag: int = 0, group: Backend | None = None, timeout: float | None = None) -> None:
    """Send an array (or CPU tensor) to ``dst``, with its dtype and shape.

    Example::

        # rank 0
        ferro.p2p.send(np.arange(3.0), dst=1, tag=7, group=g)
        # rank 1
        y = ferro.p2p.recv(src=0, tag=7, group=g)   # array([0., 1., 2.])

    Raises:
        InvalidRankError: ``dst`` is not a rank of the group.
        SelfSendError: ``dst`` is this rank.
        InvalidBufferError: ``x`` is not C-contiguous, or a tensor off the CPU.
        PeerLostError: ``dst`` died or closed its connection.
        DistributedTimeoutError: ``dst`` did not take the message within ``timeout``.

    """
    if type(x) is not np.ndarray and is_device_array(x):
        routing.device_send(resolve_group(group, "send"), x, dst, tag, timeout, False)
        return
    g, body = _sender(x, dst, tag, group, timeout, "send")
    worker_of(g).run(body, "send", (x,))


def isend(x: Any, dst: int, *, tag: int = 0, group: Backend | None = None,
          timeout: float | None = None) -> PendingCollective:
    """Start sending ``x`` to ``dst`` and return at once; ``wait()`` on the handle returns when it is sent.

    The send runs on the group's worker, in call order with the group's other
    operations; do not modify ``x`` before the handle completes. A group runs one
    operation at a time, so a send queued behind a receive waits for it: keep
    traffic that must flow both ways at once on separate groups.

    Example::

        # rank 0
        handle = ferro.p2p.isend(np.arange(3.0), dst=1, group=g)
        ...                                   # compute meanwhile
        handle.wait()
        # rank 1
        y = ferro.p2p.irecv(src=0, group=g).wait()   # array([0., 1., 2.])

    Raises:
        DistributedError: As :func:`send`: validation errors at once, transfer errors from ``wait()``.

    """
    if type(x) is not np.ndarray and is_device_array(x):
        return routing.device_send(resolve_group(group, "isend"), x, dst, tag, timeout, True)
    g, body = _sender(x, dst, tag, group, timeout, "isend")
    return worker_of(g).submit(body, f"isend to rank {dst} on rank {g.rank}", (x,))


def _sender(x: Any, dst: int, tag: int, group: Backend | None, timeout: float | None,
            name: str) -> tuple[Backend, Callable[[], None]]:
    """Validate a send and return its group and the body that sends the description, then the data."""
    g = resolve_group(group, name)
    seconds = resolve_timeout(g, timeout)
    data = operand(x, name, writable=False)
    dst = g.check_peer(dst, name)
    meta = encode_meta(data, {"tag": _tag(tag)})

    def body() -> None:
        g.send_tagged(meta, dst, kind=KIND_DATA, fingerprint=_META_FP, timeout=seconds)
        g.send_tagged(data.array.reshape(-1).view(np.uint8), dst, kind=KIND_DATA, fingerprint=_DATA_FP,
                      timeout=seconds)

    return g, _recorded(g, body, _SEND, dst, data.array.nbytes)


def _next_message(g: Backend, src: int, seconds: float, max_bytes: int | None) -> tuple[int, Operand]:
    """Receive the next message from ``src``, whatever its tag."""
    _, due = _state(g)
    fields = due.pop(src, None)
    if fields is None:
        meta = np.empty(META_BYTES, np.uint8)
        g.recv_tagged(meta, src, kind=KIND_DATA, fingerprint=_META_FP, timeout=seconds)
        fields = decode_meta(meta)
    try:
        message = array_from_meta(fields, max_bytes, f"rank {g.rank}: recv from rank {src}")
    except SizeMismatchError:
        due[src] = fields  # the data frame is still on its way; a later receive takes it
        raise
    try:
        g.recv_tagged(message.array.reshape(-1).view(np.uint8), src, kind=KIND_DATA, fingerprint=_DATA_FP,
                      timeout=seconds)
    except BaseException:
        due[src] = fields
        raise
    return int(fields["tag"]), message


def _take(g: Backend, src: int, tag: int, seconds: float, max_bytes: int | None) -> Operand:
    stash, _ = _state(g)
    queue = stash.get((src, tag))
    if queue:
        return queue.popleft()
    while True:
        got_tag, message = _next_message(g, src, seconds, max_bytes)
        if got_tag == tag:
            return message
        stash.setdefault((src, got_tag), deque()).append(message)


def recv(src: int, *, tag: int = 0, group: Backend | None = None, timeout: float | None = None,
         max_bytes: int | None = None) -> Any:
    """Receive the next message with ``tag`` from ``src``; dtype and shape come with it.

    Args:
        src: Source rank.
        tag: Only a message sent with this tag is returned; others from ``src``
            are set aside for the receives that ask for their tags.
        group: The process group.
        timeout: Seconds (default: the group's).
        max_bytes: Refuse (and keep for a later receive) a message larger than this.

    Returns:
        A new array (a tensor if a tensor was sent).

    Raises:
        SizeMismatchError: Larger than ``max_bytes``; nothing is lost.
        InvalidRankError: ``src`` is not a rank of the group.
        SelfSendError: ``src`` is this rank.
        PeerLostError: ``src`` died or closed its connection.
        DistributedTimeoutError: Nothing arrived within ``timeout``.
        CollectiveMismatchError: ``src`` sent something other than a point-to-point message.

    """
    g, body = _receiver(src, tag, group, timeout, max_bytes, "recv")
    return worker_of(g).run(body, "recv", ())


def irecv(src: int, *, tag: int = 0, group: Backend | None = None, timeout: float | None = None,
          max_bytes: int | None = None) -> PendingCollective:
    """Post a receive of the next message with ``tag`` from ``src``; ``wait()`` returns the array.

    Runs on the group's worker in call order (see :func:`isend`).

    Raises:
        DistributedError: As :func:`recv`: validation errors at once, transfer errors from ``wait()``.

    """
    g, body = _receiver(src, tag, group, timeout, max_bytes, "irecv")
    return worker_of(g).submit(body, f"irecv from rank {src} on rank {g.rank}", ())


def _receiver(src: int, tag: int, group: Backend | None, timeout: float | None, max_bytes: int | None,
              name: str) -> tuple[Backend, Callable[[], Any]]:
    g = resolve_group(group, name)
    src = g.check_peer(src, name)
    wanted, seconds = _tag(tag), resolve_timeout(g, timeout)

    def body() -> Any:
        message = _take(g, src, wanted, seconds, max_bytes)
        return wrap_like(message.array, message)

    return g, _recorded(g, body, _RECV, src, 0)


# How long a receive from any source sleeps between looks at its peers: short at first (a message often comes at
# once), then up to a millisecond, so a long wait costs little CPU.
_FIRST_NAP, _LONGEST_NAP = 20e-6, 1e-3


def _take_any(g: Backend, tag: int, seconds: float, max_bytes: int | None) -> tuple[int, Operand]:
    """Return the first message with ``tag`` from any peer, and its sender.

    Messages already set aside come first (lowest rank first), then whichever
    peer's next message arrives; one with another tag is set aside for the
    receive that asks for it, exactly as a receive from a named rank would. A
    peer whose next frame belongs to a collective (it is in a barrier, say) has
    sent nothing for this receive: it is passed over, its frame left in place.
    """
    stash, due = _state(g)
    sources = [rank for rank in range(g.world_size) if rank != g.rank]
    in_other_calls: dict[int, str] = {}
    deadline, nap = time.monotonic() + seconds, _FIRST_NAP
    while True:
        for src in sources:
            queue = stash.get((src, tag))
            if queue:
                return src, queue.popleft()
        listening = [src for src in sources if src not in in_other_calls]
        ready = [src for src in listening if src in due] or g.frames_waiting(listening)
        for src in ready:
            try:
                got_tag, message = _next_message(g, src, max(deadline - time.monotonic(), 0.0), max_bytes)
            except CollectiveMismatchError as exc:  # not consumed: the collective that frame is for takes it
                in_other_calls[src] = str(exc)
                continue
            if got_tag == tag:
                return src, message
            stash.setdefault((src, got_tag), deque()).append(message)
        if ready:
            nap = _FIRST_NAP
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            others = "".join(f"; rank {src} is in another call ({why})" for src, why in in_other_calls.items())
            raise DistributedTimeoutError(f"rank {g.rank}: recv from any source timed out after {seconds:g} s: no "
                                          f"rank sent a message with tag {tag}{others}")
        time.sleep(min(nap, left))
        nap = min(nap * 2, _LONGEST_NAP)


def recv_any(*, tag: int = 0, group: Backend | None = None, timeout: float | None = None,
             max_bytes: int | None = None) -> tuple[int, Any]:
    """Receive the next message with ``tag`` from whichever rank sends one; return its sender and the array.

    Messages from one sender arrive in the order it sent them; between senders,
    the first to arrive is taken (messages already set aside first, lowest rank
    first). Works on every host backend; an NCCL group refuses it, as NCCL has
    no receive from any source.

    Example::

        # ranks 1 and 2
        ferro.p2p.send(np.full(2, float(rank)), dst=0)
        # rank 0
        src, x = ferro.p2p.recv_any()   # e.g. (2, array([2., 2.])), then (1, array([1., 1.]))

    Returns:
        ``(sender's rank, a new array)`` (a tensor if a tensor was sent).

    Raises:
        DistributedTimeoutError: No message with ``tag`` came within ``timeout``.
        PeerLostError: A peer is gone (named) while this waits.
        SizeMismatchError, CollectiveMismatchError: As :func:`recv`.

    """
    g, body = _any_receiver(tag, group, timeout, max_bytes, "recv_any")
    return worker_of(g).run(body, "recv_any", ())


def irecv_any(*, tag: int = 0, group: Backend | None = None, timeout: float | None = None,
              max_bytes: int | None = None) -> PendingCollective:
    """Post a receive from any source; ``wait()`` returns ``(sender's rank, array)`` (see :func:`recv_any`)."""
    g, body = _any_receiver(tag, group, timeout, max_bytes, "irecv_any")
    return worker_of(g).submit(body, f"irecv from any source on rank {g.rank}", ())


def _any_receiver(tag: int, group: Backend | None, timeout: float | None, max_bytes: int | None,
                  name: str) -> tuple[Backend, Callable[[], tuple[int, Any]]]:
    g = resolve_group(group, name)
    wanted, seconds = _tag(tag), resolve_timeout(g, timeout)

    def body() -> tuple[int, Any]:
        src, message = _take_any(g, wanted, seconds, max_bytes)
        return src, wrap_like(message.array, message)

    return g, _recorded(g, body, _RECV, -1, 0)


def recv_into(out: Any, src: int, *, tag: int = 0, group: Backend | None = None, timeout: float | None = None) -> Any:
    """Receive the next message with ``tag`` from ``src`` into ``out`` (same dtype and element count).

    Returns:
        ``out``.

    Raises:
        SizeMismatchError: The message has another dtype or size; it is kept, and
            :func:`recv` with the same tag returns it.

    """
    g = resolve_group(group, "recv_into")
    if type(out) is not np.ndarray and is_device_array(out):
        return routing.device_recv_into(g, out, src, tag, timeout, False)
    target = operand(out, "recv_into", writable=True)
    src = g.check_peer(src, "recv_into")
    wanted, seconds = _tag(tag), resolve_timeout(g, timeout)

    def body() -> Any:
        message = _take(g, src, wanted, seconds, None)
        array = message.array
        if array.dtype != target.array.dtype or array.size != target.array.size:
            stash, _ = _state(g)
            stash.setdefault((src, wanted), deque()).appendleft(message)
            raise SizeMismatchError(
                f"rank {g.rank}: recv_into from rank {src}: the message is {array.dtype} of shape {array.shape}, "
                f"out is {target.array.dtype} of shape {target.array.shape}; the message was kept "
                f"(receive it with recv)", expected=target.array.nbytes, actual=array.nbytes)
        target.array.reshape(-1)[:] = array.reshape(-1)
        return out

    return worker_of(g).run(_recorded(g, body, _RECV, src, target.array.nbytes), "recv_into", (out,))


def sendrecv(x: Any, peer: int, *, tag: int = 0, group: Backend | None = None, timeout: float | None = None,
             max_bytes: int | None = None) -> Any:
    """Send ``x`` to ``peer`` and receive ``peer``'s message with ``tag``, both at once.

    Example::

        # rank 0: theirs = sendrecv(np.zeros(2), peer=1, group=g)  -> rank 1's array
        # rank 1: theirs = sendrecv(np.ones(3), peer=0, group=g)   -> rank 0's array

    Raises:
        DistributedError: As :func:`send` and :func:`recv`.

    """
    g = resolve_group(group, "sendrecv")
    if type(x) is not np.ndarray and is_device_array(x):
        return routing.device_sendrecv(g, x, peer, tag, timeout)
    data = operand(x, "sendrecv", writable=False)
    peer = g.check_peer(peer, "sendrecv")
    wanted, seconds = _tag(tag), resolve_timeout(g, timeout)
    meta = encode_meta(data, {"tag": wanted})

    def body() -> Any:
        stash, due = _state(g)
        if stash.get((peer, wanted)) or peer in due:
            # Something from the peer is already set aside: keep the order simple.
            g.send_tagged(meta, peer, kind=KIND_DATA, fingerprint=_META_FP, timeout=seconds)
            g.send_tagged(data.array.reshape(-1).view(np.uint8), peer, kind=KIND_DATA, fingerprint=_DATA_FP,
                          timeout=seconds)
            message = _take(g, peer, wanted, seconds, max_bytes)
        else:
            # Full duplex: descriptions first, then the data both ways at once.
            their_meta = np.empty(META_BYTES, np.uint8)
            g.sendrecv_tagged(meta, peer, their_meta, peer, kind=KIND_DATA, fingerprint=_META_FP, timeout=seconds)
            fields = decode_meta(their_meta)
            try:
                message = array_from_meta(fields, max_bytes, f"rank {g.rank}: sendrecv with rank {peer}")
            except SizeMismatchError:
                due[peer] = fields
                g.send_tagged(data.array.reshape(-1).view(np.uint8), peer, kind=KIND_DATA, fingerprint=_DATA_FP,
                              timeout=seconds)
                raise
            g.sendrecv_tagged(data.array.reshape(-1).view(np.uint8), peer, message.array.reshape(-1).view(np.uint8),
                              peer, kind=KIND_DATA, fingerprint=_DATA_FP, timeout=seconds)
            if int(fields["tag"]) != wanted:
                stash.setdefault((peer, int(fields["tag"])), deque()).append(message)
                message = _take(g, peer, wanted, seconds, max_bytes)
        return wrap_like(message.array, message)

    return worker_of(g).run(_recorded(g, body, _SENDRECV, peer, data.array.nbytes), "sendrecv", (x,))
