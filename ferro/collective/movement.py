"""The data movement collectives: broadcast, all_gather, gather, scatter, all_to_all and barrier.

Each call reads top to bottom as its three rooms, as the reductions do: resolve
(:mod:`ferro.collective.resolve`), route (GPU, direct path, native or generic
algorithm) and execute (:mod:`ferro.collective.execute`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ferro._buffers import Operand, is_device_array, operand, wrap_like
from ferro._core.state import UNSET
from ferro.backend.base import Backend
from ferro.backend.nccl import routing
from ferro.collective import algorithms as algo
from ferro.collective.direct import direct_path
from ferro.collective.execute import execute, make_link
from ferro.collective.meta import META_BYTES, array_from_meta, decode_meta, encode_meta
from ferro.collective.resolve import (
    gathered_shape,
    no_device_out,
    output,
    resolve_group,
    resolve_root,
    resolve_tag,
    resolve_timeout,
    separate_output,
    uneven_counts,
)
from ferro.collective.work import PendingCollective
from ferro.errors import InvalidBufferError, SizeMismatchError

__all__ = ["all_gather", "all_to_all", "all_to_all_single_uneven", "async_all_gather", "barrier", "broadcast",
           "gather", "scatter"]


def broadcast(x: Any, root: int = 0, *, group: Backend | None = None, timeout: float | None = None,
              async_op: bool = False) -> Any:
    """Copy ``x`` from rank ``root`` into ``x`` on every other rank, in place.

    Returns:
        ``x``.

    Raises:
        InvalidRankError: ``root`` outside the group.
        InvalidBufferError: Not contiguous, or read-only on a receiving rank.
        CollectiveMismatchError: Ranks disagree on size, dtype or root.

    Example::

        # rank 0: x = [1, 2]   rank 1: x = [0, 0]
        ferro.broadcast(x, root=0, group=g)
        # rank 0: x = [1, 2]   rank 1: x = [1, 2]

    """
    g = resolve_group(group, "broadcast")
    if not async_op:  # the direct path: one compiled call where the group has one (see ferro.collective.direct)
        direct = g.state.direct_broadcast
        if direct is UNSET:
            direct_path(g)
            direct = g.state.direct_broadcast
        if direct is not None and direct(x, root, timeout):
            return x
    if type(x) is not np.ndarray and is_device_array(x):
        return routing.device_broadcast(g, x, resolve_root(root, g, "broadcast"), timeout, async_op)
    root_rank = resolve_root(root, g, "broadcast")
    data = operand(x, "broadcast", writable=g.rank != root_rank)
    link = make_link(g, "broadcast", resolve_timeout(g, timeout), data, 0, root_rank, data.array.size, data.array.shape)

    def body() -> Any:
        flat = data.array.reshape(-1).view(np.uint8)
        if g.world_size > 1 and flat.size > 0:
            native = g.native
            if native is not None and native.native_broadcast(flat, root_rank, link.fingerprint, link.timeout):
                return x
            algo.broadcast(link, flat, root_rank)
        return x

    return execute(g, "broadcast", body, async_op, (x,), link)


def all_gather(x: Any, out: Any = None, *, group: Backend | None = None, timeout: float | None = None,
               async_op: bool = False, tag: int = 0) -> Any:
    """Concatenate every rank's ``x`` along axis 0, in rank order, on every rank.

    All ranks pass arrays of the same shape and dtype. A 0-d input gives a result
    of shape ``(world_size,)``.

    Args:
        x: This rank's contribution.
        out: Optional result array of the gathered shape and ``x``'s dtype.
        group: The process group.
        timeout: Seconds (default: the group's).
        async_op: Return a :class:`~ferro.PendingCollective` instead of waiting.
        tag: A number in ``[0, 1024)`` every rank passes alike, carried in the
            call's fingerprint: calls whose tags differ refuse each other with
            :class:`~ferro.CollectiveMismatchError` instead of pairing up. Libraries
            use it to say *what* they gather (FSDP tags each unit's gathers), so
            ranks that reach two equal-sized calls in different orders fail loudly.

    Returns:
        ``out``, or a new array (a tensor for tensor input).

    Raises:
        SizeMismatchError: ``out`` has the wrong shape or dtype.
        CollectiveMismatchError: Ranks disagree on shape or dtype.

    Example::

        # rank 0: x = [1, 2]   rank 1: x = [3, 4]
        y = ferro.all_gather(x, group=g)
        # both ranks: y = [1, 2, 3, 4]

    """
    g = resolve_group(group, "all_gather")
    if not async_op:  # the direct path (see ferro.collective.direct)
        direct = g.state.direct_all_gather
        if direct is UNSET:
            direct_path(g)
            direct = g.state.direct_all_gather
        if direct is not None:
            gathered = direct(x, out, tag, timeout)
            if gathered is not None:
                return gathered
    if type(x) is not np.ndarray and is_device_array(x):
        return routing.device_all_gather(g, x, out, timeout, async_op)
    data = operand(x, "all_gather", writable=False)
    shape = gathered_shape(data.array.shape, g.world_size)
    result = output(out, shape, data, "all_gather")
    link = make_link(g, "all_gather", resolve_timeout(g, timeout), data, 0, resolve_tag(tag, g, "all_gather"),
                     data.array.size, data.array.shape)

    def body() -> Any:
        flat_out = result.array.reshape(-1)
        size = data.array.size
        bounds = [i * size for i in range(g.world_size + 1)]
        flat_out[bounds[g.rank]:bounds[g.rank + 1]] = data.array.reshape(-1)
        if g.world_size > 1 and size > 0:
            byte_bounds = [b * data.dtype.itemsize for b in bounds]
            out_bytes = flat_out.view(np.uint8).reshape(-1)
            native = g.native
            if native is None or not native.native_all_gather(out_bytes, byte_bounds, link.fingerprint, link.timeout):
                algo.all_gather_ring(link, out_bytes, byte_bounds)
        return out if out is not None else wrap_like(result.array, data)

    return execute(g, "all_gather", body, async_op, (x, result.array), link)


def async_all_gather(x: Any, *, group: Backend | None = None, timeout: float | None = None) -> PendingCollective:
    """Start :func:`all_gather` and return its handle (the seed's name for ``async_op=True``)."""
    return all_gather(x, group=group, timeout=timeout, async_op=True)


def gather(x: Any, dst: int = 0, *, group: Backend | None = None, timeout: float | None = None,
           async_op: bool = False) -> Any:
    """Concatenate every rank's ``x`` along axis 0 on rank ``dst`` only.

    Returns:
        On ``dst``, a new array (as :func:`all_gather` returns); elsewhere ``None``.

    Example::

        # rank 0: x = [1]   rank 1: x = [2]   rank 2: x = [3]
        y = ferro.gather(x, dst=0, group=g)
        # rank 0: y = [1, 2, 3]   ranks 1, 2: y is None

    """
    g = resolve_group(group, "gather")
    root = resolve_root(dst, g, "gather", "dst")
    data = operand(x, "gather", writable=False)
    shape = gathered_shape(data.array.shape, g.world_size)
    link = make_link(g, "gather", resolve_timeout(g, timeout), data, 0, root, data.array.size, data.array.shape)

    def body() -> Any:
        out = np.empty(shape, data.array.dtype) if g.rank == root else None
        flat = data.array.reshape(-1)
        native = g.native
        if g.world_size == 1 or flat.size == 0:
            if out is not None:
                out.reshape(-1)[:] = flat
        elif native is None or not native.native_gather(
                flat.view(np.uint8), out.reshape(-1).view(np.uint8) if out is not None else None, root,
                link.fingerprint, link.timeout):
            algo.gather_direct(link, flat, out, root)
        return wrap_like(out, data) if out is not None else None

    return execute(g, "gather", body, async_op, (x,), link)


def scatter(chunks: Sequence[Any] | None, src: int = 0, *, group: Backend | None = None,
            timeout: float | None = None, async_op: bool = False) -> Any:
    """Send ``chunks[i]`` from rank ``src`` to rank ``i``.

    Receivers need no prior knowledge of the chunks: dtype and shape travel with them.

    Args:
        chunks: On ``src``, a sequence of ``world_size`` arrays (or tensors) of one
            dtype; ignored (pass ``None``) elsewhere.
        src: The sending rank.
        group: The process group.
        timeout: Seconds (default: the group's).
        async_op: Return a :class:`~ferro.PendingCollective` instead of waiting.

    Returns:
        This rank's chunk as a new array (a tensor if the source chunks were tensors).

    Raises:
        ValueError: On ``src``, a number of chunks other than the world size, or mixed dtypes.

    Example::

        # rank 0: chunks = [np.array([1, 2]), np.array([3, 4])]   rank 1: chunks = None
        mine = ferro.scatter(chunks, src=0, group=g)
        # rank 0: mine = [1, 2]   rank 1: mine = [3, 4]

    """
    g = resolve_group(group, "scatter")
    root = resolve_root(src, g, "scatter", "src")
    seconds = resolve_timeout(g, timeout)
    blocks: list[Operand] | None = None
    if g.rank == root:
        if chunks is None or len(chunks) != g.world_size:
            raise ValueError(f"scatter: rank {root} must pass {g.world_size} chunks, got "
                             f"{'None' if chunks is None else len(chunks)}")
        blocks = [operand(c, "scatter", writable=False) for c in chunks]
        if len({b.array.dtype for b in blocks}) > 1:
            raise ValueError("scatter: all chunks must have the same dtype")
    link = make_link(g, "scatter", seconds, None, 0, root)

    def body() -> Any:
        if g.rank == root:
            assert blocks is not None  # checked above on the root
            for dst, block in enumerate(blocks):
                if dst != root:
                    link.send(encode_meta(block), dst)
            out = np.empty_like(blocks[root].array)
            if not _native_scatter(g, link, [b.array for b in blocks], out, root):
                algo.scatter_direct(link, [b.array for b in blocks], out, root)
            return wrap_like(out, blocks[root])
        meta = np.empty(META_BYTES, np.uint8)
        link.recv(meta, root)
        incoming = array_from_meta(decode_meta(meta), None, f"rank {g.rank}: scatter")
        if not _native_scatter(g, link, None, incoming.array, root):
            algo.scatter_direct(link, None, incoming.array, root)
        return wrap_like(incoming.array, incoming)

    return execute(g, "scatter", body, async_op, tuple(chunks) if chunks is not None else (), link)


def _native_scatter(group: Backend, link: algo.Link, blocks: list[np.ndarray] | None, out: np.ndarray,
                    root: int) -> bool:
    """Run scatter's data step natively where the backend has it (the descriptions went first)."""
    native = group.native
    as_bytes = [b.reshape(-1).view(np.uint8) for b in blocks] if blocks is not None else None
    return native is not None and native.native_scatter(as_bytes, out.reshape(-1).view(np.uint8), root,
                                                        link.fingerprint, link.timeout)


def all_to_all(x: Any, *, group: Backend | None = None, timeout: float | None = None, async_op: bool = False,
               out: Any = None) -> Any:
    """Exchange equal blocks: block ``j`` of ``x`` on rank ``i`` becomes block ``i`` of the result on rank ``j``.

    ``x`` is split along axis 0 into ``world_size`` equal blocks. ``out``
    (optional, not ``x`` itself) receives the result: ``x``'s shape and dtype.

    Returns:
        ``out``, or a new array of ``x``'s shape.

    Raises:
        InvalidBufferError: ``x.shape[0]`` not divisible by the world size.
        SizeMismatchError: ``out`` has the wrong shape or dtype.

    Example::

        # rank 0: x = [1, 2]   rank 1: x = [3, 4]
        y = ferro.all_to_all(x, group=g)
        # rank 0: y = [1, 3]   rank 1: y = [2, 4]

    """
    g = resolve_group(group, "all_to_all")
    if not async_op:  # the direct path (see ferro.collective.direct)
        direct = g.state.direct_all_to_all
        if direct is UNSET:
            direct_path(g)
            direct = g.state.direct_all_to_all
        if direct is not None:
            result = direct(x, out, timeout)
            if result is not None:
                return result
    if type(x) is not np.ndarray and is_device_array(x):
        no_device_out(out, "all_to_all")
        return routing.device_all_to_all(g, x, timeout, async_op)
    data = operand(x, "all_to_all", writable=False)
    if data.array.ndim == 0 or data.array.shape[0] % g.world_size:
        raise InvalidBufferError(
            f"all_to_all: axis 0 of shape {data.array.shape} must split into {g.world_size} equal blocks; "
            f"use all_to_all_single_uneven for uneven blocks")
    given = separate_output(out, data.array.shape, data, "all_to_all")
    link = make_link(g, "all_to_all", resolve_timeout(g, timeout), data, 0, 0, data.array.size, data.array.shape)

    def body() -> Any:
        result = np.empty_like(data.array) if given is None else given.array
        block = data.array.nbytes // g.world_size
        offsets = [i * block for i in range(g.world_size + 1)]
        _exchange_blocks(g, link, data.array, offsets, result, offsets, even=True)
        return wrap_like(result, data) if given is None else out

    return execute(g, "all_to_all", body, async_op, (x,) if given is None else (x, given.array), link)


def all_to_all_single_uneven(x: Any, send_counts: Sequence[int], recv_counts: Sequence[int], *,
                             group: Backend | None = None, timeout: float | None = None,
                             async_op: bool = False, out: Any = None) -> Any:
    """Exchange blocks of any size: rows ``send_counts[j]`` of ``x`` go to rank ``j``.

    Args:
        x: This rank's rows, concatenated in destination order along axis 0.
        send_counts: Rows for each destination; they sum to ``x.shape[0]``.
        recv_counts: Rows expected from each source (each must equal that
            source's ``send_counts`` for this rank).
        group: The process group.
        timeout: Seconds (default: the group's).
        async_op: Return a :class:`~ferro.PendingCollective` instead of waiting.
        out: Optional result array (not ``x`` itself): ``sum(recv_counts)`` rows
            shaped like ``x``'s, of ``x``'s dtype.

    Returns:
        ``out``, or a new array of ``sum(recv_counts)`` rows, blocks in source order.

    Raises:
        ValueError: Counts of the wrong length, negative, or not summing to ``x.shape[0]``.
        SizeMismatchError: A source sends a block of another size than expected; ``out``
            of the wrong shape or dtype.

    Example::

        # rank 0: x = [1, 2, 3], send_counts = [1, 2], recv_counts = [1, 1]
        # rank 1: x = [4, 5],    send_counts = [1, 1], recv_counts = [2, 1]
        y = ferro.all_to_all_single_uneven(x, send_counts, recv_counts, group=g)
        # rank 0: y = [1, 4]   rank 1: y = [2, 3, 5]

    """
    g = resolve_group(group, "all_to_all_single_uneven")
    data = operand(x, "all_to_all_single_uneven", writable=False)
    n = g.world_size
    sends, recvs = uneven_counts(send_counts, n, "send_counts"), uneven_counts(recv_counts, n, "recv_counts")
    if data.array.ndim == 0 or sum(sends) != data.array.shape[0]:
        raise ValueError(f"all_to_all_single_uneven: send_counts sum to {sum(sends)} but x has "
                         f"{data.array.shape[0] if data.array.ndim else 'no'} rows")
    row_shape = data.array.shape[1:]
    link = make_link(g, "all_to_all_single_uneven", resolve_timeout(g, timeout), data, 0, 0, 0, row_shape)

    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * data.array.dtype.itemsize
    if recvs[g.rank] != sends[g.rank]:
        raise SizeMismatchError(f"all_to_all_single_uneven: rank {g.rank} sends itself {sends[g.rank]} rows "
                                f"but expects {recvs[g.rank]}", recvs[g.rank], sends[g.rank])
    out_shape = (sum(recvs),) + row_shape
    given = separate_output(out, out_shape, data, "all_to_all_single_uneven")

    def body() -> Any:
        result = np.empty(out_shape, data.array.dtype) if given is None else given.array
        send_offsets = [0, *np.cumsum(sends).tolist()]
        recv_offsets = [0, *np.cumsum(recvs).tolist()]
        _exchange_blocks(g, link, data.array, [o * row_bytes for o in send_offsets], result,
                         [o * row_bytes for o in recv_offsets])
        return wrap_like(result, data) if given is None else out

    return execute(g, "all_to_all_single_uneven", body, async_op, (x,) if given is None else (x, given.array), link)


def _exchange_blocks(group: Backend, link: algo.Link, send: np.ndarray, send_offsets: list[int], recv: np.ndarray,
                     recv_offsets: list[int], even: bool = False) -> None:
    """All-to-all of byte blocks: natively on backends that have it, else pairwise over tagged frames.

    ``even``: ``ferro.all_to_all``'s equal blocks, the same on every rank (the call's fingerprint holds the
    count), so the backend may take a plan for equal blocks; an uneven call's offsets may happen to be equal on
    one rank and not another, so it never does.
    """
    send_bytes, recv_bytes = send.reshape(-1).view(np.uint8), recv.reshape(-1).view(np.uint8)
    if group.world_size == 1:
        recv_bytes[:] = send_bytes
        return
    native = group.native
    if native is not None and native.native_all_to_all(send_bytes, send_offsets, recv_bytes, recv_offsets,
                                                       link.fingerprint, link.timeout, even=even):
        return
    n = group.world_size
    algo.all_to_all_pairwise(link, [send_bytes[send_offsets[i]:send_offsets[i + 1]] for i in range(n)],
                             [recv_bytes[recv_offsets[i]:recv_offsets[i + 1]] for i in range(n)])


def barrier(*, group: Backend | None = None, timeout: float | None = None, async_op: bool = False) -> Any:
    """Block until every rank of the group has called ``barrier``.

    Example::

        ferro.barrier(group=g)   # no rank passes until all have arrived
    """
    g = resolve_group(group, "barrier")
    if not async_op:  # the direct path (see ferro.collective.direct)
        direct = g.state.direct_barrier
        if direct is UNSET:
            direct_path(g)
            direct = g.state.direct_barrier
        if direct is not None and direct(timeout):
            return None
    seconds = resolve_timeout(g, timeout)
    return execute(g, "barrier", lambda: g.barrier(timeout=seconds), async_op, ())
