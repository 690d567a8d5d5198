"""Autograd through DTensor programs whose local pieces are torch tensors that require grad.

Local operations are torch operations on the pieces, so autograd follows them by
itself. Communication needs a rule for the way back, in two places:

* ``redistribute``: the gradient arrives placed like the output, with Partial
  read as Replicate (the value is the sum of the terms, so each term's gradient is
  the whole gradient), and is redistributed to the input's placements, again
  with Partial read as Replicate.
* ``@``: a gradient product whose rule gives ``Partial`` on a mesh dimension where
  the operand is ``Replicate`` (``x`` in ``x @ W`` with ``W`` column-wise) holds only
  this rank's share: it is allreduced over that dimension (Megatron's conjugate
  of the identity).

A gradient of a Replicate DTensor is thus the whole gradient on every rank, and
a sharded one's gradient is sharded the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from ferro import collective
from ferro.dtensor.placements import Partial, Placement, Replicate, Shard, matmul_placements
from ferro.dtensor.redistribute import plan_redistribute, run_plan

__all__ = ["grad_placements", "matmul", "redistribute"]


def grad_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Return where a gradient lies for a tensor placed so: Partial terms get the whole (Replicate) gradient."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, shape: tuple[int, ...], source: tuple[Placement, ...],
                target: tuple[Placement, ...], mesh: Any, timeout: float | None) -> Any:
        ctx.info = (shape, source, target, mesh, timeout)
        return run_plan(local, shape, source, plan_redistribute(source, target), mesh, timeout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        shape, source, target, mesh, timeout = ctx.info
        grad_from, grad_to = grad_placements(target), grad_placements(source)
        moved = run_plan(grad.contiguous(), shape, grad_from, plan_redistribute(grad_from, grad_to), mesh, timeout)
        return moved, None, None, None, None, None


def redistribute(local: torch.Tensor, shape: tuple[int, ...], source: tuple[Placement, ...],
                 target: tuple[Placement, ...], mesh: Any, timeout: float | None) -> Any:
    """Redistribute ``local`` differentiably."""
    return _Redistribute.apply(local, shape, source, target, mesh, timeout)


def _transposed(placement: Placement) -> Placement:
    return Shard(1 - placement.dim) if isinstance(placement, Shard) else placement


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, reduce_a: list[int], reduce_b: list[int], mesh: Any,
                timeout: float | None) -> Any:
        ctx.save_for_backward(a, b)
        ctx.info = (reduce_a, reduce_b, mesh, timeout)
        return a @ b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        a, b = ctx.saved_tensors
        reduce_a, reduce_b, mesh, timeout = ctx.info
        grad_a = grad @ b.T if ctx.needs_input_grad[0] else None
        grad_b = a.T @ grad if ctx.needs_input_grad[1] else None
        for dims, value in ((reduce_a, grad_a), (reduce_b, grad_b)):
            if value is not None:
                for mesh_dim in dims:
                    collective.allreduce(value, group=mesh.get_group(mesh_dim), timeout=timeout)
        return grad_a, grad_b, None, None, None, None


def matmul(a: Any, b: Any, output: tuple[Placement, ...], timeout: float | None = None) -> Any:
    """``a.local @ b.local`` with the gradient reductions the placements call for."""
    grad_out = grad_placements(output)
    reduce_a, reduce_b = [], []
    for mesh_dim, (pa, pb, pg) in enumerate(zip(a.placements, b.placements, grad_out, strict=True)):
        if matmul_placements(pg, _transposed(pb)) == Partial() and not isinstance(pa, Partial):
            reduce_a.append(mesh_dim)
        if matmul_placements(_transposed(pa), pg) == Partial() and not isinstance(pb, Partial):
            reduce_b.append(mesh_dim)
    return _Matmul.apply(a.local, b.local, reduce_a, reduce_b, a.mesh, timeout)
