"""The first room of a collective call: its arguments, checked once and resolved to what the call runs with.

A group (``None`` means the default one), a root rank, a timeout, a reduce op, a
tag, the caller's ``out`` array: each public call turns its arguments into these
here, before anything is queued or sent, so a bad argument raises on the rank
that passed it and leaves the group usable.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferro import environment
from ferro._buffers import Operand, operand
from ferro._core.reduce import has_kernel
from ferro.backend.base import Backend
from ferro.backend.cost_model import COST_MODEL_ENV, CostModel, load_cost_model
from ferro.collective.process_group import get_default_group
from ferro.errors import ConfigurationError, InvalidBufferError, InvalidRankError, SizeMismatchError
from ferro.rendezvous.settings import default_timeout
from ferro.types import MAX_TAG, DType, ReduceOp

__all__ = ["ALGORITHM_ALLREDUCE_ENV", "ALLREDUCE_ALGORITHM_NAMES", "OP_VALUES", "RECURSIVE_DOUBLING_BYTES",
           "RECURSIVE_DOUBLING_BYTES_MANY", "choose_allreduce", "chunk_bounds", "element_count", "gathered_shape",
           "is_backend_type", "no_device_out", "output", "parse_op", "resolve_allreduce_algorithm", "resolve_group",
           "resolve_op", "resolve_root", "resolve_tag", "resolve_timeout", "separate_output", "uneven_counts"]

# Looked up on every call: plain dictionaries beat enum attribute access.
OP_VALUES = {op: op.value for op in ReduceOp}


def resolve_group(group: Backend | None, name: str) -> Backend:
    """Return ``group``, or the default group for ``None``; refuse anything that is not a process group."""
    if group is None:
        return get_default_group()
    if not is_backend_type(type(group)):
        raise ConfigurationError(f"{name}: group must be a ferro Backend, got {type(group).__name__}")
    return group


@functools.cache  # isinstance against an ABC costs 0.2 us per call
def is_backend_type(cls: type) -> bool:
    """Whether instances of ``cls`` are process groups (memoised per class)."""
    return issubclass(cls, Backend)


def resolve_timeout(group: Backend, timeout: float | None) -> float:
    """Return the seconds a call may take: ``timeout``, else the group's."""
    return group.timeout if timeout is None else default_timeout(timeout)


def resolve_root(root: Any, group: Backend, name: str, what: str = "root") -> int:
    """Return ``root`` as a rank of ``group``, or raise :class:`~ferro.InvalidRankError` naming ``what``."""
    if isinstance(root, bool) or not hasattr(root, "__index__") or not 0 <= root.__index__() < group.world_size:
        raise InvalidRankError(f"rank {group.rank}: {name}: {what} {root!r} is outside the group's ranks "
                               f"[0, {group.world_size})")
    return int(root.__index__())


def resolve_tag(tag: Any, group: Backend, name: str) -> int:
    """Return a collective's tag (see :func:`ferro.all_gather`), an int in ``[0, MAX_TAG]``."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise ValueError(f"rank {group.rank}: {name}: tag must be an int in [0, {MAX_TAG}], got {tag!r}")
    return tag


def parse_op(op: Any, name: str) -> ReduceOp:
    """Return ``op`` as a :class:`~ferro.ReduceOp` (its name in any case is accepted too)."""
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp[str(op).upper()]
    except KeyError:
        raise ValueError(f"{name}: unknown reduce op {op!r}; use ferro.ReduceOp") from None


@functools.lru_cache(maxsize=256)  # validated once per (op, dtype, collective)
def resolve_op(op: Any, dtype: DType, name: str) -> ReduceOp:
    """Return ``op`` parsed, after checking that it applies to host arrays of ``dtype``."""
    op = parse_op(op, name)
    if not dtype.reducible:
        raise InvalidBufferError(f"{name}: cannot reduce dtype {dtype.name}")
    if op is ReduceOp.MEAN and dtype.kind != "f":
        raise InvalidBufferError(
            f"{name}: MEAN of {dtype.name} would not be an integer; use SUM and divide, or a float dtype")
    if not has_kernel(dtype.code, op.kernel_code):
        raise InvalidBufferError(f"{name}: {op.name} does not apply to {dtype.name} (bitwise ops need integers)")
    return op


def element_count(shape: tuple[int, ...]) -> int:
    """Return the number of elements of an array of ``shape``."""
    return int(np.prod(shape, dtype=np.int64))


def gathered_shape(shape: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    """Return the shape of ``world_size`` arrays of ``shape`` joined along axis 0 (0-d inputs make a vector)."""
    if not shape:
        return (world_size,)
    return (world_size * shape[0],) + shape[1:]


def output(out: Any, shape: tuple[int, ...], like: Operand, name: str) -> Operand:
    """Return the caller's ``out`` checked against ``shape`` and ``like``'s dtype, or a new array for ``None``."""
    if out is None:
        return Operand(np.empty(shape, like.array.dtype), like.dtype, like.torch_dtype)
    result = operand(out, name, writable=True)
    if result.array.shape != shape or result.array.dtype != like.array.dtype:
        raise SizeMismatchError(
            f"{name}: out has shape {result.array.shape} and dtype {result.array.dtype}; it needs shape {shape} "
            f"and dtype {like.array.dtype}")
    return result


def separate_output(out: Any, shape: tuple[int, ...], like: Operand, name: str) -> Operand | None:
    """Return ``out`` checked as :func:`output` checks it and not overlapping the input (None if not given)."""
    if out is None:
        return None
    result = output(out, shape, like, name)
    if np.may_share_memory(result.array, like.array):
        raise InvalidBufferError(f"{name}: out overlaps the input; blocks would be overwritten before they are sent")
    return result


def no_device_out(out: Any, name: str) -> None:
    """Refuse ``out=`` for a GPU buffer: those calls allocate their result on the device."""
    if out is not None:
        raise InvalidBufferError(f"{name}: out= takes host arrays; for GPU arrays use the returned result")


def uneven_counts(counts: Sequence[int], n: int, name: str) -> list[int]:
    """Return the per-rank row counts of :func:`ferro.all_to_all_single_uneven`, checked."""
    values = [int(c) for c in counts]
    if len(values) != n or any(c < 0 for c in values):
        raise ValueError(f"all_to_all_single_uneven: {name} needs {n} non-negative counts, got {list(counts)}")
    return values


def chunk_bounds(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` as ``numpy.array_split`` does; return the ``parts + 1`` boundaries."""
    base, extra = divmod(total, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


# Recursive doubling moves the whole message log2(n) times, the ring and halving-doubling 2(n-1)/n
# times, in 2(n-1) and 2 log2(n) rounds: below this many bytes x log2(n), fewer rounds win. Measured on
# loopback (DESIGN.md, "Choosing the allreduce"): 1 MiB up to 3 ranks; from 4 ranks recursive doubling's
# extra bytes already lose at 64-256 KiB, so 128 KiB there. Above, halving-doubling where the ranks are a
# power of two (no fold: as fast as the ring for large messages, 1.1-1.7x faster for 64 KiB-1 MiB), else the ring.
RECURSIVE_DOUBLING_BYTES = 1024 * 1024
RECURSIVE_DOUBLING_BYTES_MANY = 128 * 1024


def choose_allreduce(nbytes: int, world_size: int) -> str:
    """Name the allreduce algorithm for ``nbytes`` among ``world_size`` ranks (every rank chooses alike).

    Recursive doubling while ``nbytes * ceil(log2(world_size))`` is within its limit;
    above, halving-doubling on a power of two of 4 ranks or more, else the ring.
    """
    rounds = max(1, (world_size - 1).bit_length())
    limit = RECURSIVE_DOUBLING_BYTES if world_size <= 3 else RECURSIVE_DOUBLING_BYTES_MANY
    if nbytes * rounds <= limit:
        return "recursive_doubling"
    if world_size >= 4 and world_size & (world_size - 1) == 0:
        return "halving_doubling"
    return "ring"


#: The allreduce algorithms by name, in the order of their codes (``ferro._core.collectives.ALGORITHMS``), which
#: the call's fingerprint carries: ranks that run different algorithms refuse each other's frames.
ALLREDUCE_ALGORITHM_NAMES = ("ring", "recursive_doubling", "halving_doubling")
#: Forces the allreduce algorithm of every call that does not pass ``algorithm=``.
ALGORITHM_ALLREDUCE_ENV = "FERRO_ALGORITHM_ALLREDUCE"


@functools.lru_cache(maxsize=8)
def _cost_model(path: str) -> CostModel | None:
    return load_cost_model(path)  # read once per file: the choice runs on every call


def resolve_allreduce_algorithm(nbytes: int, world_size: int, forced: str | None = None) -> str:
    """Return the allreduce algorithm a call runs.

    ``forced``, else ``$FERRO_ALGORITHM_ALLREDUCE``, else the fastest by the cost model in ``$FERRO_COST_MODEL``
    (``ferro bench --fit`` writes one), else the rule measured on loopback (:func:`choose_allreduce`).

    Raises:
        ValueError: ``forced`` or the variable names no algorithm.
        ConfigurationError: ``$FERRO_COST_MODEL`` names no readable model.

    """
    source = "algorithm"
    if forced is None:
        forced, source = environment.get(ALGORITHM_ALLREDUCE_ENV) or None, ALGORITHM_ALLREDUCE_ENV
    if forced is None:
        model_path = environment.get(COST_MODEL_ENV)
        model = _cost_model(model_path) if model_path else None
        return model.choose_allreduce(nbytes, world_size) if model else choose_allreduce(nbytes, world_size)
    if forced not in ALLREDUCE_ALGORITHM_NAMES:
        raise ValueError(f"allreduce: unknown {source} {forced!r}; use one of {', '.join(ALLREDUCE_ALGORITHM_NAMES)}")
    return forced
