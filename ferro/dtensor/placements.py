"""How a DTensor lies over one mesh dimension: ``Shard(dim)``, ``Replicate()`` or ``Partial(op)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ferro.types import ReduceOp

__all__ = ["LINEAR_OPS", "PARTIAL_OPS", "Partial", "Placement", "Replicate", "Shard", "matmul_placements",
           "normalize_placements"]

# Reductions a Partial may wait for. Each has a partition (what Replicate -> Partial leaves on each rank) that
# the reduction undoes exactly: SUM keeps the value on coordinate 0 and zeros elsewhere (x + 0 + ... == x,
# bit for bit), MAX, MIN and AVG keep it everywhere.
PARTIAL_OPS = (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX, ReduceOp.MIN)
# Pending reductions that commute with a product or a sum: a Partial of these survives them.
LINEAR_OPS = (ReduceOp.SUM, ReduceOp.MEAN)


@dataclass(frozen=True)
class Shard:
    """Split tensor dimension ``dim`` over the mesh dimension, as ``torch.chunk`` splits it.

    Coordinate ``i`` of ``k`` holds elements ``[i*c, min((i+1)*c, n))`` with
    ``c = ceil(n / k)``: the last coordinates may hold fewer elements, or none
    (``n = 5`` over 4 ranks gives 2, 2, 1, 0), exactly as torch's DTensor shards.

    Attributes:
        dim: The tensor dimension (non-negative once a DTensor holds it).

    """

    dim: int

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every coordinate of the mesh dimension holds the whole (of what the other dimensions give it)."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    """Every coordinate holds a term; the value is their reduction with ``reduce_op``, not yet computed.

    Attributes:
        reduce_op: SUM (the default), AVG/MEAN, MAX or MIN, as a :class:`~ferro.ReduceOp` or its name.

    """

    reduce_op: ReduceOp = ReduceOp.SUM

    def __post_init__(self) -> None:
        op = self.reduce_op
        if not isinstance(op, ReduceOp):
            try:
                op = ReduceOp[str(op).upper()]
            except KeyError:
                raise ValueError(f"Partial: unknown reduce op {self.reduce_op!r}") from None
        if op not in PARTIAL_OPS:
            raise ValueError(f"Partial: {op.name} cannot be a pending reduction (use SUM, AVG, MAX or MIN)")
        object.__setattr__(self, "reduce_op", op)

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op.name.lower()})"


Placement = Shard | Replicate | Partial
"""How a tensor lies along one dimension of a device mesh: :class:`Shard`, :class:`Replicate` or :class:`Partial`."""


def normalize_placements(placements: Sequence[Any], mesh_ndim: int, tensor_ndim: int, where: str
                         ) -> tuple[Placement, ...]:
    """Check one placement per mesh dimension and make shard dimensions non-negative.

    Raises:
        ValueError: Not one placement per mesh dimension, not a placement, or a shard
            dimension outside the tensor.

    """
    if isinstance(placements, (Shard, Replicate, Partial)):
        placements = (placements,)
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(f"{where}: {len(placements)} placements for a {mesh_ndim}-d mesh; give one per mesh "
                         f"dimension")
    result: list[Placement] = []
    for placement in placements:
        if not isinstance(placement, (Shard, Replicate, Partial)):
            raise ValueError(f"{where}: {placement!r} is not a placement (use Shard(dim), Replicate(), Partial())")
        if isinstance(placement, Shard):
            dim = placement.dim
            if isinstance(dim, bool) or not isinstance(dim, int) or not -tensor_ndim <= dim < tensor_ndim:
                raise ValueError(f"{where}: {placement!r} names no dimension of a {tensor_ndim}-d tensor")
            placement = Shard(dim % tensor_ndim)
        result.append(placement)
    return tuple(result)


def matmul_placements(left: Placement, right: Placement) -> Placement | None:
    """Return the placement of ``a @ b`` on one mesh dimension, or None when no local rule exists.

    ============  ============  ==========  ==========================================
    ``a``         ``b``         ``a @ b``   the layout
    ============  ============  ==========  ==========================================
    Replicate     Replicate     Replicate
    Replicate     Shard(1)      Shard(1)    column-wise: the weight's columns split
    Shard(0)      Replicate     Shard(0)    rows of ``a`` split (data parallel)
    Shard(1)      Shard(0)      Partial     row-wise: the contraction split; sum pending
    Partial       Replicate     Partial     (SUM or AVG: the product is linear)
    Replicate     Partial       Partial
    ============  ============  ==========  ==========================================
    """
    rules: dict[tuple[Placement, Placement], Placement] = {
        (Replicate(), Replicate()): Replicate(),
        (Replicate(), Shard(1)): Shard(1),
        (Shard(0), Replicate()): Shard(0),
        (Shard(1), Shard(0)): Partial(),
    }
    if (left, right) in rules:
        return rules[(left, right)]
    for pending, other in ((left, right), (right, left)):
        if isinstance(pending, Partial) and pending.reduce_op in LINEAR_OPS and other == Replicate():
            return pending
    return None
