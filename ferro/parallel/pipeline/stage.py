"""One pipeline stage: a part of the model on this rank, run one microbatch at a time.

The stage turns a model's forward and backward into per-microbatch steps that a
schedule interleaves: what forward keeps for backward is stored per microbatch
(so several can be in flight), and backward can be split into its input-gradient
and weight-gradient halves for zero-bubble schedules. ``ferro.nn`` modules and
CPU ``torch.nn.Module`` s are both served, each by a runner of its own.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferro.backend.base import Backend
from ferro.collective.resolve import resolve_group
from ferro.parallel._model import is_torch_module
from ferro.parallel.ddp import DDP

__all__ = ["PipelineStage"]


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``: ``submodule`` on this rank.

    Stage ``k`` runs on rank ``k % world_size`` of ``group``: one stage per rank,
    or several per rank for :class:`~ferro.pipeline.ScheduleInterleaved1F1B`.
    Activations and gradients travel between neighbouring stages with their
    shapes and dtypes, so no shapes are declared. A stage whose submodule is a
    :class:`ferro.DDP` also averages its gradients over the DDP group once per
    step (pipeline and data parallelism composed).

    Args:
        submodule: This stage's part of the model: a ``ferro.nn`` module, a CPU
            ``torch.nn.Module``, or either wrapped in :class:`ferro.DDP`.
        stage_index: Which stage this is, in ``[0, num_stages)``.
        num_stages: How many stages the whole pipeline has.
        group: The pipeline's process group (default: the default group).

    Attributes:
        activations_held: Microbatches whose forward state this stage holds now.
        peak_activations_held: The most it held at once during the last step.

    Example::

        # rank r of 4: stage r of a 4-stage pipeline
        stage = ferro.pipeline.PipelineStage(layers[r], stage_index=r, num_stages=4)

    Raises:
        ValueError: ``stage_index`` outside ``[0, num_stages)``, or the stage
            belongs to another rank.

    """

    def __init__(self, submodule: Any, stage_index: int, num_stages: int, group: Backend | None = None) -> None:
        self.group = resolve_group(group, "PipelineStage")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"rank {self.group.rank}: PipelineStage: num_stages must be a positive integer, "
                             f"got {num_stages!r}")
        if isinstance(stage_index, bool) or not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"rank {self.group.rank}: PipelineStage: stage_index {stage_index!r} is outside "
                             f"[0, {num_stages}) (num_stages={num_stages})")
        owner = stage_index % self.group.world_size
        if owner != self.group.rank:
            raise ValueError(f"rank {self.group.rank}: PipelineStage: stage {stage_index} runs on rank {owner} "
                             f"(stage k on rank k % world_size, world size {self.group.world_size})")
        self.submodule = submodule
        self.stage_index, self.num_stages = stage_index, num_stages
        self.ddp: DDP | None = submodule if isinstance(submodule, DDP) else None
        module = self.ddp.module if self.ddp is not None else submodule
        self.runner: Runner = TorchRunner(module, stage_index) if is_torch_module(module) else NumpyRunner(module)
        self.activations_held = 0
        self.peak_activations_held = 0

    @property
    def is_first(self) -> bool:
        """Whether this stage takes the batch."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage computes the loss."""
        return self.stage_index == self.num_stages - 1

    def parameters(self) -> Any:
        """Return the stage's parameters (for its optimizer)."""
        return self.submodule.parameters()

    def _hold(self, change: int) -> None:
        self.activations_held += change
        self.peak_activations_held = max(self.peak_activations_held, self.activations_held)

    def __repr__(self) -> str:
        return f"<PipelineStage {self.stage_index}/{self.num_stages} on rank {self.group.rank}>"


class Runner(abc.ABC):
    """Runs one microbatch's forward, loss and backward of a module; ``ctx`` is what one forward keeps."""

    @abc.abstractmethod
    def forward(self, inputs: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Return the outputs (detached, ready to send) and the microbatch's context."""

    @abc.abstractmethod
    def loss(self, ctx: dict[str, Any], loss_fn: Any, target: Any, scale: float) -> float:
        """Compute the loss of the context's outputs; its backward will seed ``scale`` times its gradient."""

    @abc.abstractmethod
    def backward(self, ctx: dict[str, Any], grads: tuple[Any, ...] | None) -> tuple[Any, ...]:
        """Full backward: add the parameters' gradients; return the inputs' gradients (None where none)."""

    @abc.abstractmethod
    def backward_input(self, ctx: dict[str, Any], grads: tuple[Any, ...] | None) -> tuple[Any, ...]:
        """Return the inputs' gradients only; keep in ``ctx`` what :meth:`backward_weight` needs."""

    @abc.abstractmethod
    def backward_weight(self, ctx: dict[str, Any]) -> None:
        """Add the parameters' gradients of this microbatch."""

    @abc.abstractmethod
    def split_problem(self) -> str | None:
        """Why backward cannot be split here, or None when it can."""

    @abc.abstractmethod
    def split(self, value: Any, n: int) -> list[Any]:
        """Split a batch into ``n`` microbatches along dim 0 (as ``numpy.array_split``)."""

    @abc.abstractmethod
    def concatenate(self, values: Sequence[Any]) -> Any:
        """Join microbatch outputs along dim 0."""


class NumpyRunner(Runner):
    """``ferro.nn`` modules: state per microbatch through ``stash_saved``/``restore_saved``."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def forward(self, inputs: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run forward and take the state it kept."""
        output = self.module(*inputs)
        if isinstance(output, tuple):
            raise TypeError(f"{type(self.module).__name__}: a ferro.nn stage returns one array (its backward "
                            f"takes one gradient), got a tuple of {len(output)}")
        return (np.asarray(output),), {"saved": self.module.stash_saved(), "outputs": (output,)}

    def loss(self, ctx: dict[str, Any], loss_fn: Any, target: Any, scale: float) -> float:
        """Call ``loss_fn(output, target)``; keep ``scale * loss_fn.backward()`` as the seed."""
        value = float(loss_fn(ctx["outputs"][0], target))
        ctx["seed"] = (np.asarray(loss_fn.backward()) * scale,)
        return value

    def backward(self, ctx: dict[str, Any], grads: tuple[Any, ...] | None) -> tuple[Any, ...]:
        """Run the module's backward on this microbatch's state."""
        grad = (grads or ctx["seed"])[0]
        self.module.restore_saved(ctx.pop("saved"))
        try:
            return (self.module.backward(grad),)
        finally:
            self.module.stash_saved()  # drop it: this microbatch is done

    def backward_input(self, ctx: dict[str, Any], grads: tuple[Any, ...] | None) -> tuple[Any, ...]:
        """Run ``backward_input``; keep the state (now with the output gradients) for the weights."""
        grad = (grads or ctx.pop("seed"))[0]
        self.module.restore_saved(ctx["saved"])
        try:
            return (self.module.backward_input(grad),)
        finally:
            ctx["saved"] = self.module.stash_saved()

    def backward_weight(self, ctx: dict[str, Any]) -> None:
        """Run ``backward_weight`` on this microbatch's state."""
        self.module.restore_saved(ctx.pop("saved"))
        try:
            self.module.backward_weight()
        finally:
            self.module.stash_saved()

    def split_problem(self) -> str | None:
        """Modules with parameters must define backward_input and backward_weight."""
        if self.module.splits_backward:
            return None
        culprits = [type(m).__name__ for m in self.module.modules()
                    if not m.splits_backward and not any(not c.splits_backward for c in m.children())]
        return (f"ferro.nn module(s) {', '.join(sorted(set(culprits))) or type(self.module).__name__} have "
                f"parameters but no backward_input/backward_weight")

    def split(self, value: Any, n: int) -> list[Any]:
        """``numpy.array_split`` along axis 0."""
        return np.array_split(np.asarray(value), n, axis=0)

    def concatenate(self, values: Sequence[Any]) -> Any:
        """``numpy.concatenate`` along axis 0."""
        return np.concatenate([np.asarray(v) for v in values], axis=0)


class TorchRunner(Runner):
    """CPU torch modules: autograd per microbatch; split backward through per-module output gradients.

    To split backward, forward hooks record the output ``y`` of every module that
    owns parameters. The input-gradient step asks autograd for the gradients of
    the stage's inputs *and* of every recorded ``y`` (keeping the graph); the
    weight step then pulls each module's parameter gradients from its own
    ``y``: ``autograd.backward(y, dL/dy, inputs=own parameters)``, which only
    walks that module's part of the graph. Exact when each parameter belongs to
    one module that runs once per forward and returns one tensor; anything else
    is refused with the reason.
    """

    def __init__(self, module: Any, stage_index: int) -> None:
        import torch

        self.torch = torch
        self.module = module
        self.stage_index = stage_index
        self._owners = [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]
        self._records: list[tuple[Any, Any]] | None = None  # (module, output) while a split forward runs
        self._hooks: list[Any] = []

    def _record(self, module: Any, _inputs: Any, output: Any) -> None:
        if self._records is None:
            return
        if not isinstance(output, self.torch.Tensor):
            raise TypeError(f"cannot split the backward of {type(module).__name__}: it owns parameters and returns "
                            f"{type(output).__name__}, not one tensor; use a schedule without zero bubble")
        if any(m is module for m, _ in self._records):
            raise TypeError(f"cannot split the backward of {type(module).__name__}: it ran twice in one forward; "
                            f"use a schedule without zero bubble")
        self._records.append((module, output))

    def enable_split(self) -> None:
        """Record parameter owners' outputs from now on (zero-bubble schedules call this once)."""
        if not self._hooks:
            self._hooks = [m.register_forward_hook(self._record) for m in self._owners]

    def forward(self, inputs: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run forward on leaves that collect the inputs' gradients."""
        torch = self.torch
        leaves = tuple(
            x.detach().requires_grad_(self.stage_index > 0 and x.is_floating_point())
            if isinstance(x, torch.Tensor) else x for x in inputs)
        self._records = [] if self._hooks else None
        try:
            output = self.module(*leaves)
        finally:
            records, self._records = self._records, None
        outputs = output if isinstance(output, tuple) else (output,)
        sendable = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
        return sendable, {"inputs": leaves, "outputs": outputs, "records": records}

    def loss(self, ctx: dict[str, Any], loss_fn: Any, target: Any, scale: float) -> float:
        """Call ``loss_fn(output, target)``; backward seeds ``scale``."""
        outputs = ctx["outputs"]
        value = loss_fn(outputs[0] if len(outputs) == 1 else outputs, target)
        ctx["loss"], ctx["scale"] = value, scale
        return float(value.detach())

    def _roots(self, ctx: dict[str, Any], grads: tuple[Any, ...] | None) -> tuple[list[Any], list[Any]]:
        torch = self.torch
        if grads is None:
            loss = ctx["loss"]
            return [loss], [torch.full_like(loss, ctx["scale"])]
        pairs = [(o, g) for o, g in zip(ctx["outputs"], grads, strict=True)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _input_grads(self, ctx: dict[str, Any]) -> tuple[Any, ...]:
        torch = self.torch
        return tuple(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in ctx["inputs"])

    def backward(self, ctx: dict[str, Any], grads: tuple[Any, ...] | None) -> tuple[Any, ...]:
        """``autograd.backward`` from the outputs (or the loss) into parameters and input leaves."""
        roots, seeds = self._roots(ctx, grads)
        if roots:
            self.torch.autograd.backward(roots, seeds)
        return self._input_grads(ctx)

    def backward_input(self, ctx: dict[str, Any], grads: tuple[Any, ...] | None) -> tuple[Any, ...]:
        """Gradients of the inputs and of each parameter owner's output, the graph kept for the weights."""
        torch = self.torch
        roots, seeds = self._roots(ctx, grads)
        inputs = [x for x in ctx["inputs"] if isinstance(x, torch.Tensor) and x.requires_grad]
        records = ctx["records"]
        targets = inputs + [y for _, y in records]
        found = torch.autograd.grad(roots, targets, seeds, retain_graph=True, allow_unused=True) if (
            roots and targets) else [None] * len(targets)
        ctx["owner_grads"] = list(found[len(inputs):])
        by_leaf = {id(x): g for x, g in zip(inputs, found[:len(inputs)], strict=True)}
        return tuple(by_leaf.get(id(x)) if isinstance(x, torch.Tensor) else None for x in ctx["inputs"])

    def backward_weight(self, ctx: dict[str, Any]) -> None:
        """Each owner's parameters from its own output gradient; then the graph is let go."""
        for (module, output), grad in zip(ctx["records"], ctx.pop("owner_grads"), strict=True):
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if grad is not None and params:
                self.torch.autograd.backward([output], [grad], inputs=params, retain_graph=True)
        ctx.clear()

    def split_problem(self) -> str | None:
        """Shared parameters cannot be split by owner."""
        seen: dict[int, str] = {}
        for module in self._owners:
            for param in module.parameters(recurse=False):
                if id(param) in seen:
                    return (f"parameter shared by {seen[id(param)]} and {type(module).__name__}: its gradient "
                            f"cannot be split by owner")
                seen[id(param)] = type(module).__name__
        return None

    def split(self, value: Any, n: int) -> list[Any]:
        """``torch.tensor_split`` along dim 0."""
        return list(self.torch.tensor_split(value, n, dim=0))

    def concatenate(self, values: Sequence[Any]) -> Any:
        """``torch.cat`` along dim 0."""
        return self.torch.cat(list(values), dim=0)
