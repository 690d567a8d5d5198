"""Collectives on GPU buffers, routed to the group's NCCL communicator.

The collectives hand a call here, its arguments already resolved, when its
buffer lives on a GPU (a CUDA tensor, or an object with
``__cuda_array_interface__``). The group's NCCL communicator (``backend="nccl"``
or ``"hybrid"``) runs it on the caller's current stream; ``async_op=True``
returns a :class:`~ferro.backend.nccl.communicator.DeviceWork` whose ``wait()``
orders the caller's stream after it. Results ferro allocates (``all_gather``,
``reduce_scatter``, ``all_to_all``) are tensors on the input's device (CuPy
arrays for CuPy input). NCCL carries no description of a message, so a GPU
receive needs its buffer: :func:`ferro.recv_into`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from ferro._buffers import is_torch_tensor
from ferro.backend.base import Backend
from ferro.backend.nccl.buffers import describe
from ferro.backend.nccl.types import reduction
from ferro.errors import InvalidBufferError, SizeMismatchError
from ferro.types import ReduceOp

__all__ = ["FALLBACK_ENV", "device_all_gather", "device_all_to_all", "device_allreduce", "device_broadcast",
           "device_recv_into", "device_reduce", "device_reduce_scatter", "device_send", "device_sendrecv"]

#: Set to 1 to let ferro.gpu_allreduce/gpu_broadcast copy GPU buffers through host memory
#: on groups without NCCL (:mod:`ferro.collective.gpu`).
FALLBACK_ENV = "FERRO_ENABLE_GPU_FALLBACK"
_BYTES = 1  # ncclUint8: what data-moving calls carry


def _communicator(g: Backend, call: str) -> Any:
    comm = g.device_collectives
    if comm is None:
        raise InvalidBufferError(
            f"rank {g.rank}: {call}: the buffer is in GPU memory, but this group ({type(g).__name__}) moves host "
            f"memory only: use backend='nccl' or 'hybrid', or copy it to the host (tensor.cpu()); "
            f"ferro.gpu_allreduce/gpu_broadcast do that for you with {FALLBACK_ENV}=1")
    return comm


def _label(call: str, array: Any) -> str:
    return f"{call} {array.dtype}{list(array.shape)}"


def _empty(like: Any, shape: tuple[int, ...], call: str) -> Any:
    """Allocate a result on ``like``'s device, of its dtype."""
    if is_torch_tensor(like):
        import torch

        return torch.empty(shape, dtype=like.dtype, device=like.device)
    cupy = sys.modules.get("cupy")
    if cupy is not None and type(like).__module__.startswith("cupy"):
        with cupy.cuda.Device(like.device.id):
            return cupy.empty(shape, like.dtype)
    raise InvalidBufferError(f"{call}: ferro allocates GPU results for PyTorch tensors and CuPy arrays only; "
                             f"got {type(like).__name__}")


def _finish(work: Any, async_op: bool, result: Any) -> Any:
    return work if async_op else result


def device_allreduce(g: Backend, x: Any, op: ReduceOp, timeout: float | None, async_op: bool) -> Any:
    """Run :func:`ferro.allreduce` on a GPU buffer (in place)."""
    comm = _communicator(g, "allreduce")
    array = describe(x, "allreduce", writable=True)
    dtype, nccl_op, per_item = reduction(array.dtype, op, "allreduce", comm.lib.version)
    count = array.size * per_item

    def enqueue(lib: Any, handle: int, stream: int) -> None:
        if count:
            comm.settle(lib.ncclAllReduce(array.pointer, array.pointer, count, dtype, nccl_op, handle, stream),
                        "ncclAllReduce")

    return _finish(comm.launch(_label("allreduce", array), (array,), async_op, timeout, enqueue, x), async_op, x)


def device_reduce(g: Backend, x: Any, root: int, op: ReduceOp, timeout: float | None, async_op: bool) -> Any:
    """Run :func:`ferro.reduce` on a GPU buffer (the result in place on ``dst``)."""
    comm = _communicator(g, "reduce")
    array = describe(x, "reduce", writable=g.rank == root)
    dtype, nccl_op, per_item = reduction(array.dtype, op, "reduce", comm.lib.version)
    count = array.size * per_item

    def enqueue(lib: Any, handle: int, stream: int) -> None:
        if count:
            comm.settle(lib.ncclReduce(array.pointer, array.pointer, count, dtype, nccl_op, root, handle, stream),
                        "ncclReduce")

    return _finish(comm.launch(_label("reduce", array), (array,), async_op, timeout, enqueue, x), async_op, x)


def device_broadcast(g: Backend, x: Any, source: int, timeout: float | None, async_op: bool) -> Any:
    """Run :func:`ferro.broadcast` on a GPU buffer (in place), moving its bytes."""
    comm = _communicator(g, "broadcast")
    array = describe(x, "broadcast", writable=g.rank != source)

    def enqueue(lib: Any, handle: int, stream: int) -> None:
        if array.nbytes:
            comm.settle(lib.ncclBroadcast(array.pointer, array.pointer, array.nbytes, _BYTES, source, handle,
                                          stream), "ncclBroadcast")

    return _finish(comm.launch(_label("broadcast", array), (array,), async_op, timeout, enqueue, x), async_op, x)


def device_all_gather(g: Backend, x: Any, out: Any, timeout: float | None, async_op: bool) -> Any:
    """Run :func:`ferro.all_gather` on a GPU buffer."""
    comm = _communicator(g, "all_gather")
    array = describe(x, "all_gather", writable=False)
    n = g.world_size
    shape = (n,) if not array.shape else (n * array.shape[0], *array.shape[1:])
    result = out if out is not None else _empty(x, shape, "all_gather")
    target = describe(result, "all_gather", writable=True)
    if target.shape != shape or target.dtype != array.dtype:
        raise SizeMismatchError(f"all_gather: out has shape {target.shape} and dtype {target.dtype}; it needs shape "
                                f"{shape} and dtype {array.dtype}")

    def enqueue(lib: Any, handle: int, stream: int) -> None:
        if array.nbytes:
            comm.settle(lib.ncclAllGather(array.pointer, target.pointer, array.nbytes, _BYTES, handle, stream),
                        "ncclAllGather")

    work = comm.launch(_label("all_gather", array), (array, target), async_op, timeout, enqueue, result)
    return _finish(work, async_op, result)


def device_reduce_scatter(g: Backend, x: Any, op: ReduceOp, timeout: float | None, async_op: bool) -> Any:
    """Run :func:`ferro.reduce_scatter` on a GPU buffer; axis 0 must split evenly (NCCL's parts are equal)."""
    comm = _communicator(g, "reduce_scatter")
    array = describe(x, "reduce_scatter", writable=False)
    n = g.world_size
    if not array.shape or array.shape[0] % n:
        raise InvalidBufferError(
            f"reduce_scatter: on GPU buffers axis 0 must split into {n} equal parts (NCCL's parts are equal); "
            f"shape {array.shape} does not: pad it")
    dtype, nccl_op, per_item = reduction(array.dtype, op, "reduce_scatter", comm.lib.version)
    result = _empty(x, (array.shape[0] // n, *array.shape[1:]), "reduce_scatter")
    target = describe(result, "reduce_scatter", writable=True)
    count = target.size * per_item

    def enqueue(lib: Any, handle: int, stream: int) -> None:
        if count:
            comm.settle(lib.ncclReduceScatter(array.pointer, target.pointer, count, dtype, nccl_op, handle, stream),
                        "ncclReduceScatter")

    work = comm.launch(_label("reduce_scatter", array), (array, target), async_op, timeout, enqueue, result)
    return _finish(work, async_op, result)


def device_all_to_all(g: Backend, x: Any, timeout: float | None, async_op: bool) -> Any:
    """Run :func:`ferro.all_to_all` on a GPU buffer: one grouped send and receive per peer."""
    comm = _communicator(g, "all_to_all")
    array = describe(x, "all_to_all", writable=False)
    n = g.world_size
    if not array.shape or array.shape[0] % n:
        raise InvalidBufferError(f"all_to_all: axis 0 of shape {array.shape} must split into {n} equal blocks")
    result = _empty(x, array.shape, "all_to_all")
    target = describe(result, "all_to_all", writable=True)
    block = array.nbytes // n

    def enqueue(lib: Any, handle: int, stream: int) -> None:
        if not block:
            return
        calls: list[tuple[str, Callable[[], int]]] = []
        for peer in range(n):
            calls.append(("ncclSend", functools.partial(lib.ncclSend, array.pointer + peer * block, block, _BYTES,
                                                        peer, handle, stream)))
            calls.append(("ncclRecv", functools.partial(lib.ncclRecv, target.pointer + peer * block, block, _BYTES,
                                                        peer, handle, stream)))
        _grouped(comm, lib, calls)

    work = comm.launch(_label("all_to_all", array), (array, target), async_op, timeout, enqueue, result)
    return _finish(work, async_op, result)


def device_send(g: Backend, x: Any, dst: int, tag: int, timeout: float | None, async_op: bool) -> Any:
    """Send a GPU buffer's bytes to ``dst`` (``ncclSend``); the receiver passes a buffer of the same size."""
    return _point_to_point(g, x, dst, tag, timeout, async_op, receive=False)


def device_recv_into(g: Backend, out: Any, src: int, tag: int, timeout: float | None, async_op: bool) -> Any:
    """Receive ``out.nbytes`` bytes from ``src`` into a GPU buffer (``ncclRecv``)."""
    return _point_to_point(g, out, src, tag, timeout, async_op, receive=True)


def _point_to_point(g: Backend, x: Any, peer: int, tag: int, timeout: float | None, async_op: bool,
                    receive: bool) -> Any:
    call = "recv_into" if receive else "send"
    comm = _communicator(g, call)
    other = g.check_peer(peer, call)
    _no_tag(tag, call)
    array = describe(x, call, writable=receive)

    def enqueue(lib: Any, handle: int, stream: int) -> None:
        if receive:
            comm.settle(lib.ncclRecv(array.pointer, array.nbytes, _BYTES, other, handle, stream), "ncclRecv")
        else:
            comm.settle(lib.ncclSend(array.pointer, array.nbytes, _BYTES, other, handle, stream), "ncclSend")

    what = f"{'recv from' if receive else 'send to'} rank {other} ({array.dtype}{list(array.shape)})"
    result = x if receive else None
    return _finish(comm.launch(what, (array,), async_op, timeout, enqueue, result), async_op, result)


def _grouped(comm: Any, lib: Any, calls: list[tuple[str, Callable[[], int]]]) -> None:
    """Run NCCL calls between ``ncclGroupStart`` and ``ncclGroupEnd`` (sends and receives that pair up)."""
    comm.settle(lib.ncclGroupStart(), "ncclGroupStart")
    try:
        for name, call in calls:
            comm.settle(call(), name)
    finally:
        comm.settle(lib.ncclGroupEnd(), "ncclGroupEnd")


def device_sendrecv(g: Backend, x: Any, peer: int, tag: int, timeout: float | None) -> Any:
    """Exchange GPU buffers with ``peer``: the peer's message must have ``x``'s shape and dtype."""
    comm = _communicator(g, "sendrecv")
    other = g.check_peer(peer, "sendrecv")
    _no_tag(tag, "sendrecv")
    array = describe(x, "sendrecv", writable=False)
    result = _empty(x, array.shape, "sendrecv")
    target = describe(result, "sendrecv", writable=True)

    def enqueue(lib: Any, handle: int, stream: int) -> None:
        _grouped(comm, lib, [
            ("ncclSend", functools.partial(lib.ncclSend, array.pointer, array.nbytes, _BYTES, other, handle, stream)),
            ("ncclRecv", functools.partial(lib.ncclRecv, target.pointer, target.nbytes, _BYTES, other, handle,
                                           stream))])

    comm.launch(f"sendrecv with rank {other} ({_label('', array).strip()})", (array, target), False, timeout,
                enqueue, result)
    return result


def _no_tag(tag: Any, call: str) -> None:
    if tag != 0:
        raise ValueError(f"{call}: NCCL matches messages between two ranks in order, not by tag; pass tag=0 for "
                         f"GPU buffers (got {tag!r})")
