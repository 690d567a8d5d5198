"""torch's arguments to a process group, turned into ferro's: ops, options, flat views, split sizes."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ferro.errors import InvalidBufferError
from ferro.types import ReduceOp

__all__ = ["as_list", "copy_parts", "even_splits", "factor_value", "flat_view", "is_async", "product", "scaled",
           "timeout_of", "torch_reduce_op"]

_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM, dist.ReduceOp.AVG: ReduceOp.MEAN, dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    dist.ReduceOp.MIN: ReduceOp.MIN, dist.ReduceOp.MAX: ReduceOp.MAX, dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BOR: ReduceOp.BOR, dist.ReduceOp.BXOR: ReduceOp.BXOR,
}


def torch_reduce_op(op: Any, name: str) -> tuple[ReduceOp, Any]:
    """Return ferro's op for torch's, and PREMUL_SUM's factor (None for the others)."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.PREMUL_SUM:
        return ReduceOp.SUM, op.factor
    try:
        return _OPS[kind], None
    except (KeyError, TypeError):
        raise ValueError(f"{name}: torch's reduce op {kind} has no ferro equivalent") from None


def is_async(options: Any) -> bool:
    """Whether torch will hand the work back to its caller (``async_op=True``, DDP's buckets).

    torch's own blocking calls say ``asyncOp=False`` and wait at once: those run on
    the calling thread, through ferro's direct paths, and return a completed work.
    """
    return bool(getattr(options, "asyncOp", True))


def timeout_of(options: Any) -> float | None:
    """Return the seconds torch's options carry, or None for the group's own (torch's unset is negative)."""
    value = getattr(options, "timeout", None)
    if isinstance(value, datetime.timedelta) and value.total_seconds() > 0:
        return value.total_seconds()
    return None


def flat_view(tensor: Any, name: str) -> Any:
    """Return a detached, flat view of a CPU tensor (torch's collectives ignore autograd; so does this)."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidBufferError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise InvalidBufferError(
            f"{name}: the tensor lives on {tensor.device}; the 'ferro' backend moves CPU tensors (reduce GPU "
            f"tensors on a group of torch's 'nccl' backend, or move them with .cpu())")
    if not tensor.is_contiguous():
        raise InvalidBufferError(f"{name}: the tensor is not contiguous; pass tensor.contiguous()")
    return tensor.detach().view(-1)


def factor_value(factor: Any) -> float:
    """Return PREMUL_SUM's factor (a number, or a one-element tensor) as a number."""
    return float(factor.to(device="cpu").reshape(()).item()) if isinstance(factor, torch.Tensor) else float(factor)


def scaled(tensor: Any, factor: Any) -> Any:
    """Return ``tensor * factor`` as a new tensor of its dtype (PREMUL_SUM's input)."""
    return tensor.mul(factor_value(factor))


def as_list(tensors: Any) -> list[Any]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def even_splits(rows: int, n: int, which: str) -> list[int]:
    if rows % n:
        raise InvalidBufferError(f"all_to_all: the {which}'s {rows} rows do not split evenly among {n} ranks; "
                                 f"pass split sizes")
    return [rows // n] * n


def product(shape: Sequence[int]) -> int:
    total = 1
    for extent in shape:
        total *= int(extent)
    return total


def copy_parts(source: Any, parts: Sequence[Any]) -> None:
    """Copy consecutive slices of flat ``source`` into each tensor of ``parts``."""
    flat = source.reshape(-1)
    offset = 0
    for part in parts:
        size = part.numel()
        part.detach().view(-1).copy_(flat[offset:offset + size])
        offset += size
