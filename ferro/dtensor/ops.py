"""What operations on DTensors produce: the placement rules, applied to local pieces.

Each rule takes :class:`Piece` tuples (a DTensor's local piece, placements,
global shape and mesh) and returns the result's ``(local, placements, shape)``.
No rule communicates: where the placements do not allow computing locally, the
rule raises and names the operation, and the caller redistributes first.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ferro.dtensor import _arrays as xp
from ferro.dtensor.device_mesh import DeviceMesh
from ferro.dtensor.placements import LINEAR_OPS, Partial, Placement, Shard, matmul_placements

__all__ = ["Piece", "elementwise", "tracks_grad", "matmul", "matmul_placements", "reduce_sum", "transpose"]

Result = tuple[Any, tuple[Placement, ...], tuple[int, ...]]


class Piece(NamedTuple):
    """A DTensor's parts, as the rules see them."""

    local: Any
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    mesh: DeviceMesh


_OPERATORS: dict[str, Callable[..., Any]] = {
    "add": operator.add, "subtract": operator.sub, "multiply": operator.mul, "divide": operator.truediv,
    "power": operator.pow, "greater": operator.gt, "greater_equal": operator.ge, "less": operator.lt,
    "less_equal": operator.le, "negative": operator.neg,
}
# Ops under which a pending SUM/AVG stays pending: sums of terms, and scaling by a plain number.
_LINEAR_IN_ALL = {"add", "subtract", "negative", "positive"}
_LINEAR_IN_ONE = {"multiply": (0, 1), "divide": (0,)}  # which argument may be the Partial one


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float, bool, np.generic)) or (isinstance(x, np.ndarray) and x.ndim == 0)


def elementwise(name: str, args: Sequence[Any], ufunc: Any = None) -> Result:
    """Apply an elementwise operation to DTensor pieces (and plain numbers).

    Rules: every DTensor argument has the same mesh and, once shapes are aligned
    from the right as broadcasting aligns them, the same placements, and no
    sharded dimension is broadcast. A ``Partial`` (SUM or AVG) survives sums and
    differences of Partials and scaling by a number; any other operation on one
    raises, because it would act on the terms instead of on the value.

    Raises:
        TypeError: A plain array or tensor mixed with a DTensor (distribute it first).
        NotImplementedError: Placements that differ, a broadcast sharded dimension,
            or a Partial under a non-linear operation; the message names the operation.

    """
    pieces = [a for a in args if isinstance(a, Piece)]
    for a in args:
        if not isinstance(a, Piece) and not _is_scalar(a):
            raise TypeError(f"DTensor: {name} of a DTensor and a {type(a).__name__}: make the other operand a "
                            f"DTensor first (ferro.dtensor.distribute_tensor) or pass a plain number")
    first = pieces[0]
    if any(p.mesh is not first.mesh for p in pieces):
        raise NotImplementedError(f"DTensor: {name} of DTensors on different meshes")
    try:
        shape = tuple(int(n) for n in np.broadcast_shapes(*(p.shape for p in pieces)))
    except ValueError:
        raise ValueError(f"DTensor: {name} of shapes {[p.shape for p in pieces]} that do not broadcast") from None
    placements = _aligned(pieces[0], shape)
    for p in pieces:
        mine = _aligned(p, shape)
        if mine != placements:
            raise NotImplementedError(
                f"DTensor: {name} of DTensors placed {list(placements)} and {list(mine)} (aligned to shape "
                f"{shape}); redistribute one to the other's placements first")
        for placement in mine:
            if isinstance(placement, Shard) and p.shape[placement.dim - (len(shape) - len(p.shape))] != shape[
                    placement.dim]:
                raise NotImplementedError(f"DTensor: {name} broadcasts sharded dimension {placement.dim}; "
                                          f"replicate that operand first")
    partial = [p for p in placements if isinstance(p, Partial)]
    if partial:
        linear = name in _LINEAR_IN_ALL and all(isinstance(a, Piece) for a in args)
        if name in _LINEAR_IN_ONE and len(pieces) == 1:
            linear = any(isinstance(args[i], Piece) for i in _LINEAR_IN_ONE[name] if i < len(args))
        if not linear or any(p.reduce_op not in LINEAR_OPS for p in partial):
            raise NotImplementedError(
                f"DTensor: {name} on a Partial ({partial[0]!r}) DTensor would act on the pending terms, not on "
                f"the value; redistribute to Replicate or Shard first")
    locals_ = [a.local if isinstance(a, Piece) else a for a in args]
    if ufunc is not None:
        if any(xp.is_torch(x) for x in locals_):
            raise NotImplementedError(f"DTensor: numpy.{name} on a torch-held DTensor; use its operators")
        result = ufunc(*locals_)
    elif name in _OPERATORS:
        result = _OPERATORS[name](*locals_)
    else:
        raise NotImplementedError(f"DTensor: elementwise {name} is not supported")
    return result, placements, shape


def _aligned(piece: Piece, shape: tuple[int, ...]) -> tuple[Placement, ...]:
    shift = len(shape) - len(piece.shape)
    return tuple(Shard(p.dim + shift) if isinstance(p, Shard) else p for p in piece.placements)


def matmul(a: Any, b: Any) -> Result:
    """Return ``a @ b`` for 2-d DTensors with a rule (:func:`matmul_placements`) on every mesh dimension.

    With torch pieces that require grad, the product is differentiable, and a
    gradient the rule leaves Partial for a Replicate operand is allreduced in
    backward (see :mod:`ferro.dtensor._autograd`).

    Raises:
        TypeError: An operand is not a DTensor.
        ValueError: Not 2-d, or the inner dimensions differ.
        NotImplementedError: No rule for the placements on some mesh dimension (named).

    """
    if not (isinstance(a, Piece) and isinstance(b, Piece)):
        raise TypeError("DTensor: matmul needs two DTensors; distribute the plain operand first")
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise ValueError(f"DTensor: matmul supports 2-d operands, got shapes {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"DTensor: matmul of shapes {a.shape} and {b.shape}: inner dimensions differ")
    if a.mesh is not b.mesh:
        raise NotImplementedError("DTensor: matmul of DTensors on different meshes")
    placements = []
    for mesh_dim, (left, right) in enumerate(zip(a.placements, b.placements, strict=True)):
        made = matmul_placements(left, right)
        if made is None:
            raise NotImplementedError(
                f"DTensor: matmul has no rule for {left!r} @ {right!r} on mesh dimension {mesh_dim} (rules: "
                f"R@R, R@Shard(1), Shard(0)@R, Shard(1)@Shard(0), Partial@R, R@Partial); redistribute first")
        placements.append(made)
    if tracks_grad(a.local) or tracks_grad(b.local):
        from ferro.dtensor import _autograd

        return _autograd.matmul(a, b, tuple(placements)), tuple(placements), (a.shape[0], b.shape[1])
    return a.local @ b.local, tuple(placements), (a.shape[0], b.shape[1])


def tracks_grad(local: Any) -> bool:
    """Whether autograd records operations on this torch piece (False for NumPy)."""
    if not xp.is_torch(local) or not local.requires_grad:
        return False
    import torch

    return bool(torch.is_grad_enabled())


def transpose(a: Piece) -> Result:
    """Return the transpose of a 1-d or 2-d DTensor (its local piece's ``.T``, a view)."""
    if len(a.shape) > 2:
        raise NotImplementedError(f"DTensor: .T of a {len(a.shape)}-d DTensor; only 1-d and 2-d")
    placements = tuple(Shard(1 - p.dim) if isinstance(p, Shard) and len(a.shape) == 2 else p for p in a.placements)
    return a.local.T, placements, tuple(reversed(a.shape))


def reduce_sum(a: Piece, dim: int | Sequence[int] | None, keepdim: bool, mean: bool) -> Result:
    """Sum (or mean) over ``dim``; each mesh dimension that shards a summed dimension becomes ``Partial(sum)``.

    Raises:
        NotImplementedError: The DTensor is Partial with MAX or MIN (a sum of maxima is not the maximum's sum).
        ValueError: A dimension outside the tensor.

    """
    ndim = len(a.shape)
    dims = list(range(ndim)) if dim is None else [dim] if isinstance(dim, int) else list(dim)
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or not -ndim <= d < ndim:
            raise ValueError(f"DTensor: sum over dimension {d!r} of a {ndim}-d tensor")
    summed = sorted({d % ndim for d in dims})
    name = "mean" if mean else "sum"
    placements: list[Placement] = []
    for p in a.placements:
        if isinstance(p, Partial) and p.reduce_op not in LINEAR_OPS:
            raise NotImplementedError(f"DTensor: {name} of a {p!r} DTensor; redistribute to Replicate first")
        if isinstance(p, Shard):
            if p.dim in summed:
                placements.append(Partial())
            else:
                placements.append(p if keepdim else Shard(p.dim - sum(d < p.dim for d in summed)))
        else:
            placements.append(p)
    local = a.local
    if summed:
        local = (local.sum(dim=tuple(summed), keepdim=keepdim) if xp.is_torch(local)
                 else local.sum(axis=tuple(summed), keepdims=keepdim))
    shape = tuple(1 if d in summed else n for d, n in enumerate(a.shape) if keepdim or d not in summed)
    if mean:
        count = int(np.prod([a.shape[d] for d in summed], dtype=np.int64))
        local = local / count
    return local, tuple(placements), shape
