"""torch's point-to-point calls on a ferro group: a TCP mesh of their own, a thread per peer and direction.

torch code posts receives before sends freely (``batch_isend_irecv([irecv, isend])``
on both ranks of a pair), and gloo lets every send and receive progress on its
own. A ferro group runs one operation at a time, so a receive posted first would
hold the send queued behind it on both ranks, and neither message would move.
Point-to-point traffic of a torch group therefore travels on a separate TCP
group (joined with the collectives' group, through the same store), where each
peer has a send thread and a receive thread: a pair's messages move in call
order per direction, independently of other peers, of the other direction and
of the collectives.

Messages carry torch's tag, dtype and element count in their fingerprint. A
receive meets the next message its peer sent; if that message's tag, dtype or
count differ from the receive's, the receive raises
:class:`~ferro.CollectiveMismatchError` naming both and the message stays
queued. (gloo matches tags out of order; here a pair's tags must be received in
the order they were sent.)

A receive from any source runs on a thread of its own: it waits until some
peer's next frame has begun to arrive, then receives it on that peer's receive
thread, behind the receives already posted for that peer, so posting order
per peer is kept. A peer whose next frame carries another tag, dtype or count
is passed over (its frame stays for the receive it matches).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

from ferro._buffers import operand
from ferro._core.transport import KIND_DATA
from ferro.backend.base import Backend
from ferro.errors import CollectiveMismatchError, DistributedTimeoutError
from ferro.types import fingerprint

__all__ = ["PeerLinks"]

# monitored_barrier's one-byte token: a barrier's fingerprint, which no point-to-point message carries.
_TOKEN_FINGERPRINT = fingerprint("barrier", root=1)


class PeerLinks:
    """Sends and receives of one torch group, each on its peer's thread for that direction.

    Args:
        group: The TCP group the messages travel on (this object closes it).
        timeout: Default seconds for a send or receive.

    """

    def __init__(self, group: Backend, timeout: float) -> None:
        self._group = group
        self._timeout = timeout
        self._lock = threading.Lock()
        self._threads: dict[tuple[str, int], concurrent.futures.ThreadPoolExecutor] = {}

    def _thread(self, direction: str, peer: int) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            executor = self._threads.get((direction, peer))
            if executor is None:
                executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"ferro-torch-{direction}-rank{peer}")
                self._threads[(direction, peer)] = executor
            return executor

    def _frame(self, tensor: Any, peer: int | None, tag: int, name: str, writable: bool) -> tuple[Any, int, int]:
        data = operand(tensor, name, writable=writable)
        peer = -1 if peer is None else self._group.check_peer(peer, name)
        if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
            raise ValueError(f"rank {self._group.rank}: {name}: tag must be a non-negative int, got {tag!r}")
        # torch's tag rides in the root field (10 bits); the element count and dtype travel too.
        return data.array.reshape(-1).view("u1"), peer, fingerprint("p2p", data.dtype.code, 0, tag & 0x3FF,
                                                                    data.array.size)

    def send(self, tensor: Any, peer: int, tag: int, timeout: float | None = None) -> concurrent.futures.Future:
        """Queue ``tensor`` for ``peer``; the future completes once its bytes are handed to the transport."""
        payload, peer, print_ = self._frame(tensor, peer, tag, "send", writable=False)
        seconds = self._timeout if timeout is None else timeout
        return self._thread("send", peer).submit(
            self._group.send_tagged, payload, peer, kind=KIND_DATA, fingerprint=print_, timeout=seconds)

    def recv(self, tensor: Any, peer: int, tag: int, timeout: float | None = None) -> concurrent.futures.Future:
        """Queue a receive of ``peer``'s next message into ``tensor``."""
        payload, peer, print_ = self._frame(tensor, peer, tag, "recv", writable=True)
        seconds = self._timeout if timeout is None else timeout
        return self._thread("recv", peer).submit(
            self._group.recv_tagged, payload, peer, kind=KIND_DATA, fingerprint=print_, timeout=seconds)

    def send_token(self, peer: int, timeout: float) -> concurrent.futures.Future:
        """Queue monitored_barrier's token for ``peer``."""
        return self._thread("send", peer).submit(self._group.send_tagged, bytearray(1), peer, kind=KIND_DATA,
                                                 fingerprint=_TOKEN_FINGERPRINT, timeout=timeout)

    def recv_token(self, peer: int, timeout: float) -> concurrent.futures.Future:
        """Queue a receive of monitored_barrier's token from ``peer``."""
        return self._thread("recv", peer).submit(self._group.recv_tagged, bytearray(1), peer, kind=KIND_DATA,
                                                 fingerprint=_TOKEN_FINGERPRINT, timeout=timeout)

    def recv_any(self, tensor: Any, tag: int, timeout: float | None = None) -> concurrent.futures.Future:
        """Queue a receive of the next matching message from any peer into ``tensor``; the future gives its sender."""
        payload, _, print_ = self._frame(tensor, None, tag, "recv", writable=True)
        seconds = self._timeout if timeout is None else timeout
        return self._thread("recv", -1).submit(self._receive_any, payload, print_, tag, seconds)

    def _receive_any(self, payload: Any, print_: int, tag: int, seconds: float) -> int:
        group = self._group
        deadline, nap = time.monotonic() + seconds, 20e-6
        passed_over: set[int] = set()
        while True:
            listening = [peer for peer in range(group.world_size) if peer != group.rank and peer not in passed_over]
            for peer in group.frames_waiting(listening):
                taken = self._thread("recv", peer).submit(self._receive_if_waiting, payload, peer, print_, deadline)
                try:
                    if taken.result():
                        return peer
                except CollectiveMismatchError:  # its next message is another tag, dtype or size: not this one's
                    passed_over.add(peer)
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistributedTimeoutError(f"rank {group.rank}: recv from any source timed out after {seconds:g} "
                                              f"s: no rank sent a message with tag {tag} of this dtype and size")
            time.sleep(min(nap, left))
            nap = min(nap * 2, 1e-3)

    def _receive_if_waiting(self, payload: Any, peer: int, print_: int, deadline: float) -> bool:
        # On the peer's receive thread, behind the receives posted for it: one of them may have taken the frame.
        if not self._group.frames_waiting([peer]):
            return False
        self._group.recv_tagged(payload, peer, kind=KIND_DATA, fingerprint=print_,
                                timeout=max(deadline - time.monotonic(), 0.001))
        return True

    def close(self) -> None:
        """Close the group (calls in flight fail at once) and let the threads go."""
        self._group.close()
        with self._lock:
            executors, self._threads = list(self._threads.values()), {}
        for executor in executors:
            executor.shutdown(wait=False, cancel_futures=True)
