"""The links between neighbouring ranks of a pipeline: one sub-group per direction and kind of traffic.

A group runs one operation at a time, so a receive posted early would hold up
every send queued behind it. Each kind of traffic between two ranks therefore
gets a 2-rank group of its own (activations ``a -> b``; gradients ``b -> a``):
on each of them one rank only sends and the other only receives, in order, so
receives can be posted ahead and sends never wait behind them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro.backend.base import Backend
from ferro.backend.sub import SubBackend
from ferro.collective import p2p
from ferro.collective.process_group import new_group
from ferro.collective.work import PendingCollective, worker_of

__all__ = ["Channel", "make_channels"]

ACTIVATIONS, GRADIENTS = "activations", "gradients"
MAX_MICROBATCHES = 1 << 16  # a message's tag is stage * MAX_MICROBATCHES + microbatch


class Channel:
    """One direction of one kind of traffic between two ranks of the pipeline group."""

    def __init__(self, group: SubBackend, kind: str, src: int, dst: int, me: int) -> None:
        self.group, self.kind, self.src, self.dst = group, kind, src, dst
        self._peer_local = group.local_rank(dst if me == src else src)

    def send(self, items: tuple[Any, ...], stage: int, microbatch: int, timeout: float) -> PendingCollective:
        """Queue a bundle (a header saying which items exist, then each item) and return its handle."""
        tag = stage * MAX_MICROBATCHES + microbatch
        present = [x for x in items if x is not None]
        header = np.array([len(items)] + [0 if x is None else 1 for x in items], np.int64)
        group, peer = self.group, self._peer_local

        def body() -> None:
            p2p.send(header, peer, tag=tag, group=group, timeout=timeout)
            for item in present:
                p2p.send(item, peer, tag=tag, group=group, timeout=timeout)

        what = f"{self.kind} of stage {stage} microbatch {microbatch} to rank {self.dst}"
        return worker_of(group).submit(body, what, tuple(present))

    def recv(self, stage: int, microbatch: int, timeout: float) -> PendingCollective:
        """Post the receive of a bundle; ``wait()`` returns its items (None where the sender had none)."""
        tag = stage * MAX_MICROBATCHES + microbatch
        group, peer = self.group, self._peer_local

        def body() -> tuple[Any, ...]:
            header = p2p.recv(peer, tag=tag, group=group, timeout=timeout, max_bytes=8 * 4096)
            return tuple(p2p.recv(peer, tag=tag, group=group, timeout=timeout) if flag else None
                         for flag in header[1:1 + int(header[0])])

        what = f"{self.kind} of stage {stage} microbatch {microbatch} from rank {self.src}"
        return worker_of(group).submit(body, what, ())

    def __repr__(self) -> str:
        return f"<Channel {self.kind} {self.src}->{self.dst}>"


def make_channels(group: Backend, pairs: list[tuple[int, int]], timeout: float) -> dict[tuple[str, int, int], Channel]:
    """Create, collectively, the channels for traffic ``src -> dst`` of each pair (activations) and back (gradients).

    Every rank of ``group`` calls this with the same ``pairs`` in the same order.

    Returns:
        This rank's channels by ``(kind, src, dst)``.

    """
    me = group.rank
    channels: dict[tuple[str, int, int], Channel] = {}
    for a, b in pairs:
        for kind, src, dst in ((ACTIVATIONS, a, b), (GRADIENTS, b, a)):
            sub = new_group(sorted((src, dst)), group=group, timeout=timeout)
            if sub is not None:
                channels[(kind, src, dst)] = Channel(sub, kind, src, dst, me)
    return channels
