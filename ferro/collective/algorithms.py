"""Collective algorithms written over a group's tagged send/recv, so every backend runs every collective.

It also holds the size thresholds that choose among them (:func:`choose_allreduce`,
:func:`broadcast`), so a choice and the algorithms it chooses from live together.

Each function works on flat NumPy arrays and a :class:`Link` (the group, the
call's fingerprint and its timeout). The data moves through the backend's
compiled transport and reductions run in C kernels, both without the GIL; the
Python here only sequences the steps.

Results are identical on every rank, bit for bit: each element is reduced
along one fixed order of ranks and then copied (ring), or combined by
symmetric kernels from the same partial results (recursive doubling).
"""

from __future__ import annotations

import numpy as np

from ferro._core.reduce import reduce_into
from ferro._core.transport import KIND_COLLECTIVE
from ferro.backend.base import Backend
from ferro.collective.resolve import (  # the choice rule is argument resolution; named here too
    RECURSIVE_DOUBLING_BYTES,
    RECURSIVE_DOUBLING_BYTES_MANY,
    choose_allreduce,
    chunk_bounds,
)
from ferro.types import DType

__all__ = [
    "Link",
    "BROADCAST_SEGMENT_BYTES",
    "RECURSIVE_DOUBLING_BYTES",
    "RECURSIVE_DOUBLING_BYTES_MANY",
    "SMALL_MESSAGE_BYTES",
    "allreduce",
    "broadcast",
    "choose_allreduce",
    "all_gather_ring",
    "all_to_all_pairwise",
    "allreduce_recursive_doubling",
    "allreduce_ring",
    "broadcast_chain",
    "broadcast_tree",
    "gather_direct",
    "reduce_scatter_ring",
    "reduce_tree",
    "scatter_direct",
]


class Link:
    """One collective call's view of its group: every frame carries the call's fingerprint."""

    __slots__ = ("fingerprint", "group", "timeout")

    def __init__(self, group: Backend, fingerprint: int, timeout: float) -> None:
        self.group = group
        self.fingerprint = fingerprint
        self.timeout = timeout

    @property
    def rank(self) -> int:
        """The calling rank."""
        return self.group.rank

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self.group.world_size

    def send(self, buf: np.ndarray, dst: int) -> None:
        """Send one frame of this call."""
        self.group.send_tagged(buf, dst, kind=KIND_COLLECTIVE, fingerprint=self.fingerprint, timeout=self.timeout)

    def recv(self, buf: np.ndarray, src: int) -> None:
        """Receive one frame of this call."""
        self.group.recv_tagged(buf, src, kind=KIND_COLLECTIVE, fingerprint=self.fingerprint, timeout=self.timeout)

    def sendrecv(self, send_buf: np.ndarray, dst: int, recv_buf: np.ndarray, src: int) -> None:
        """Exchange one frame each way, full duplex."""
        self.group.sendrecv_tagged(send_buf, dst, recv_buf, src, kind=KIND_COLLECTIVE, fingerprint=self.fingerprint,
                                   timeout=self.timeout)


# --- choosing an algorithm by size ---------------------------------------------------------------------------

# Generic broadcasts up to this size use a binomial tree (latency-optimal); larger ones a
# pipelined chain (bandwidth-optimal).
SMALL_MESSAGE_BYTES = 64 * 1024
BROADCAST_SEGMENT_BYTES = 1024 * 1024


def allreduce(link: Link, flat: np.ndarray, dtype: DType, op_code: int, algorithm: str) -> None:
    """Allreduce over send/recv: the ring (it also stands in for halving-doubling), or recursive doubling.

    Recursive doubling also serves arrays of fewer elements than ranks, which the
    ring cannot split.
    """
    if algorithm != "recursive_doubling" and flat.size >= link.size:
        allreduce_ring(link, flat, dtype, op_code)
    else:
        allreduce_recursive_doubling(link, flat, dtype, op_code)


def broadcast(link: Link, flat: np.ndarray, root: int) -> None:
    """Broadcast bytes over send/recv: a binomial tree when small or between two ranks, else a pipelined chain."""
    if flat.nbytes > SMALL_MESSAGE_BYTES and link.size > 2:
        broadcast_chain(link, flat, root, BROADCAST_SEGMENT_BYTES)
    else:
        broadcast_tree(link, flat, root)


# --- the algorithms ------------------------------------------------------------------------------------------


def combine(dst: np.ndarray, src: np.ndarray, dtype: DType, op_code: int) -> None:
    """``dst = dst OP src`` element-wise, in place, in C."""
    reduce_into(dst, src, dtype.code, op_code, dtype.itemsize)


def _ring_reduce_scatter_steps(link: Link, flat: np.ndarray, bounds: list[int], dtype: DType, op_code: int) -> None:
    """Reduce-scatter in place over a ring: afterwards chunk ``rank`` of ``flat`` holds the full reduction."""
    n, r = link.size, link.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    scratch = np.empty(max(bounds[i + 1] - bounds[i] for i in range(n)), flat.dtype)
    for step in range(n - 1):
        send_idx, recv_idx = (r - step - 1) % n, (r - step - 2) % n
        incoming = scratch[: bounds[recv_idx + 1] - bounds[recv_idx]]
        link.sendrecv(flat[bounds[send_idx]:bounds[send_idx + 1]], nxt, incoming, prv)
        combine(flat[bounds[recv_idx]:bounds[recv_idx + 1]], incoming, dtype, op_code)


def _ring_all_gather_steps(link: Link, flat: np.ndarray, bounds: list[int]) -> None:
    """All-gather in place over a ring, starting from each rank owning chunk ``rank``."""
    n, r = link.size, link.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_idx, recv_idx = (r - step) % n, (r - step - 1) % n
        link.sendrecv(flat[bounds[send_idx]:bounds[send_idx + 1]], nxt, flat[bounds[recv_idx]:bounds[recv_idx + 1]],
                      prv)


def allreduce_ring(link: Link, flat: np.ndarray, dtype: DType, op_code: int) -> None:
    """Bandwidth-optimal allreduce: ring reduce-scatter, then ring all-gather (2(n-1)/n of the data each way)."""
    bounds = chunk_bounds(flat.size, link.size)
    _ring_reduce_scatter_steps(link, flat, bounds, dtype, op_code)
    _ring_all_gather_steps(link, flat, bounds)


def allreduce_recursive_doubling(link: Link, flat: np.ndarray, dtype: DType, op_code: int) -> None:
    """Latency-optimal allreduce: log2(n) exchanges of the whole message.

    For a world size that is not a power of two, the first ``2 * extra`` ranks
    pair up first: the even one hands its data to the odd one, sits out, and
    receives the result at the end.
    """
    n, r = link.size, link.rank
    power = 1 << (n.bit_length() - 1)
    extra = n - power
    scratch = np.empty_like(flat)
    if r < 2 * extra:
        if r % 2 == 0:
            link.send(flat, r + 1)
            link.recv(flat, r + 1)
            return
        link.recv(scratch, r - 1)
        combine(flat, scratch, dtype, op_code)
        virtual = r // 2
    else:
        virtual = r - extra
    mask = 1
    while mask < power:
        partner_virtual = virtual ^ mask
        partner = partner_virtual * 2 + 1 if partner_virtual < extra else partner_virtual + extra
        link.sendrecv(flat, partner, scratch, partner)
        combine(flat, scratch, dtype, op_code)
        mask <<= 1
    if r < 2 * extra:
        link.send(flat, r - 1)


def reduce_scatter_ring(link: Link, flat: np.ndarray, bounds: list[int], dtype: DType, op_code: int) -> None:
    """Ring reduce-scatter in place on ``flat`` (a scratch copy): chunk ``rank`` ends fully reduced."""
    _ring_reduce_scatter_steps(link, flat, bounds, dtype, op_code)


def all_gather_ring(link: Link, out: np.ndarray, bounds: list[int]) -> None:
    """Ring all-gather in place on ``out``, whose chunk ``rank`` already holds this rank's data."""
    _ring_all_gather_steps(link, out, bounds)


def broadcast_tree(link: Link, flat: np.ndarray, root: int) -> None:
    """Binomial-tree broadcast: log2(n) rounds; best for small messages."""
    n, r = link.size, link.rank
    virtual = (r - root) % n
    mask = 1
    while mask < n:
        if virtual & mask:
            link.recv(flat, (virtual - mask + root) % n)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if virtual + mask < n:
            link.send(flat, (virtual + mask + root) % n)
        mask >>= 1


def broadcast_chain(link: Link, flat: np.ndarray, root: int, segment_elements: int) -> None:
    """Pipelined chain broadcast: the message flows root -> root+1 -> ... in segments.

    Every link carries the message once and all links work at the same time, so
    for large messages the time approaches that of one transfer.
    """
    n, r = link.size, link.rank
    virtual = (r - root) % n
    nxt, prv = (r + 1) % n, (r - 1) % n
    segments = [(i, min(i + segment_elements, flat.size)) for i in range(0, flat.size, segment_elements)]
    is_first, is_last = virtual == 0, virtual == n - 1
    if is_first:
        for start, stop in segments:
            link.send(flat[start:stop], nxt)
        return
    if is_last:
        for start, stop in segments:
            link.recv(flat[start:stop], prv)
        return
    # Forward segment i-1 while segment i arrives.
    link.recv(flat[segments[0][0]:segments[0][1]], prv)
    for i in range(1, len(segments)):
        (a, b), (c, d) = segments[i - 1], segments[i]
        link.sendrecv(flat[a:b], nxt, flat[c:d], prv)
    a, b = segments[-1]
    link.send(flat[a:b], nxt)


def reduce_tree(link: Link, accumulator: np.ndarray, root: int, dtype: DType, op_code: int) -> None:
    """Binomial-tree reduce into ``accumulator`` on ``root`` (other ranks' accumulators are scratch)."""
    n, r = link.size, link.rank
    virtual = (r - root) % n
    scratch = np.empty_like(accumulator)
    mask = 1
    while mask < n:
        if virtual & mask:
            link.send(accumulator, (virtual - mask + root) % n)
            return
        child = virtual + mask
        if child < n:
            link.recv(scratch, (child + root) % n)
            combine(accumulator, scratch, dtype, op_code)
        mask <<= 1


def gather_direct(link: Link, flat: np.ndarray, out: np.ndarray | None, root: int) -> None:
    """Every rank sends its block to ``root``, which receives them straight into ``out``."""
    n, r = link.size, link.rank
    if r != root:
        link.send(flat, root)
        return
    assert out is not None  # the caller allocates it on the root
    blocks = out.reshape(n, -1)
    for src in range(n):
        if src == root:
            blocks[src] = flat
        else:
            link.recv(blocks[src], src)


def scatter_direct(link: Link, blocks: list[np.ndarray] | None, out: np.ndarray, root: int) -> None:
    """``root`` sends block ``i`` to rank ``i``; each rank receives its block into ``out``."""
    n, r = link.size, link.rank
    if r != root:
        link.recv(out, root)
        return
    assert blocks is not None  # the root holds the blocks
    for dst in range(n):
        if dst == root:
            out[...] = blocks[dst]
        else:
            link.send(blocks[dst], dst)


def all_to_all_pairwise(link: Link, send_blocks: list[np.ndarray], recv_blocks: list[np.ndarray]) -> None:
    """Pairwise exchange: in step ``s`` rank ``r`` sends to ``r+s`` and receives from ``r-s``."""
    n, r = link.size, link.rank
    recv_blocks[r][...] = send_blocks[r]
    for step in range(1, n):
        dst, src = (r + step) % n, (r - step) % n
        link.sendrecv(send_blocks[dst], dst, recv_blocks[src], src)
