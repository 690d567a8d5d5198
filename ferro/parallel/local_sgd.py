"""Local SGD and DiLoCo: train apart for ``H`` steps, then agree, for links too slow to average every step.

Each rank runs its own optimizer (the *inner* one) on its own data for
``sync_every`` steps without communicating. Then the ranks average their
*pseudo-gradient*, the change since the last agreement (``global - local``),
and an *outer* optimizer applies it to the agreed (global) parameters, which
every rank then trains from. With SGD of rate 1 as the outer optimizer this is
local SGD (the average of the ranks' parameters); with SGD and Nesterov momentum
(rate 0.7, momentum 0.9) it is DiLoCo (Douillard et al., arXiv 2311.08105).
One allreduce of the model every ``H`` steps replaces one per step.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) splits the parameters
into ``fragments`` synchronised at staggered steps, so the traffic is spread
out, and with ``overlap_steps`` lets a fragment's allreduce run on the group's
worker (GIL-free, in ferro's core) while the next inner steps compute; when it
lands, the fragment's trained-on values are mixed with the new global ones
(``mixing``: the weight kept of the local values).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferro.backend.base import Backend
from ferro.collective import ReduceOp, allreduce, broadcast
from ferro.collective.work import PendingCollective
from ferro.errors import ConfigurationError
from ferro.parallel._model import Model, TorchModel, model_adapter

__all__ = ["DiLoCo", "LocalSGD", "nesterov_outer_optimizer"]

OuterOptimizerFactory = Callable[[list[Any]], Any]


def nesterov_outer_optimizer(lr: float = 0.7, momentum: float = 0.9) -> OuterOptimizerFactory:
    """Return DiLoCo's outer optimizer, SGD with Nesterov momentum, for ferro.nn or torch parameters.

    Args:
        lr: The outer learning rate (DiLoCo's 0.7).
        momentum: The outer momentum (DiLoCo's 0.9).

    """

    def make(params: list[Any]) -> Any:
        if params and not isinstance(params[0], np.ndarray) and type(params[0]).__module__.startswith("torch"):
            import torch

            return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)
        from ferro.nn.optim import SGD

        return SGD(params, lr=lr, momentum=momentum, nesterov=True)

    return make


@dataclass
class _Slice:
    """One dtype's parameters within a fragment, with the flat buffers its allreduce and outer step use."""

    locals: list[np.ndarray]
    offsets: list[int]
    global_flat: np.ndarray
    delta_flat: np.ndarray
    outer_params: list[Any] = field(default_factory=list)
    outer_grads: list[Any] = field(default_factory=list)


@dataclass
class _Fragment:
    index: int
    shift: int
    slices: list[_Slice]
    pending: list[PendingCollective] = field(default_factory=list)
    launched_at: int | None = None  # the inner step of the allreduce in flight, if any
    last_launch: int = -1           # the inner step of the latest allreduce, in flight or finished


class DiLoCo:
    """Inner steps apart, an outer step on the averaged parameter change every ``sync_every`` steps.

    Call :meth:`step` after each inner optimizer step. Every rank must call it
    the same number of times. The model's parameters are copied from rank 0
    when it is wrapped.

    Args:
        module: A ``ferro.nn`` module or a CPU ``torch.nn.Module`` (float32 or
            float64 parameters).
        sync_every: ``H``, the inner steps between agreements.
        outer_optimizer: Builds the outer optimizer from a list of parameters
            (ferro.nn ``Parameter`` or torch tensors, whichever the model uses);
            default :func:`nesterov_outer_optimizer` ``(0.7, 0.9)``.
        group: The process group (default: the default group).
        fragments: Parameter groups synchronised at staggered steps (streaming
            DiLoCo; 1: all at once).
        overlap_steps: Inner steps a fragment's allreduce may run behind
            (0: wait for it at once). Must be below ``sync_every``.
        mixing: With overlap, the weight of the local values when the new
            global ones land (streaming DiLoCo's alpha; 0 takes the global ones).
        broadcast_parameters: Copy rank 0's parameters to every rank now.

    Example::

        inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
        diloco = ferro.parallel.DiLoCo(model, sync_every=50)
        for x, y in batches:                    # this rank's own data
            inner.zero_grad()
            loss_fn(model(x), y).backward()
            inner.step()
            diloco.step()                       # every 50th call: one allreduce of the model's change
        diloco.sync()                           # agree now, before evaluating or saving

    Raises:
        ConfigurationError: No group and no default group, no trainable
            parameters, or a parameter dtype other than float32/float64.
        ValueError: ``sync_every`` below 1, ``fragments`` outside 1..parameters,
            ``overlap_steps`` outside 0..sync_every-1, ``mixing`` outside 0..1.

    """

    _averaging = False  # LocalSGD: the outer step is the average itself, with no optimizer

    def __init__(self, module: Any, sync_every: int, outer_optimizer: OuterOptimizerFactory | None = None,
                 group: Backend | None = None, fragments: int = 1, overlap_steps: int = 0, mixing: float = 0.5,
                 broadcast_parameters: bool = True) -> None:
        from ferro.collective.resolve import resolve_group

        name = type(self).__name__
        self.group = resolve_group(group, name)
        self.module = module
        self._model: Model = model_adapter(module)
        params = self._model.trainable()
        if not params:
            raise ConfigurationError(f"{name}: the module has no trainable parameters")
        if sync_every < 1:
            raise ValueError(f"{name}: sync_every must be at least 1, got {sync_every}")
        if not 1 <= fragments <= len(params):
            raise ValueError(f"{name}: fragments must be between 1 and the {len(params)} parameters, got {fragments}")
        if not 0 <= overlap_steps < sync_every:
            raise ValueError(f"{name}: overlap_steps must be between 0 and sync_every - 1 = {sync_every - 1}, "
                             f"got {overlap_steps}")
        if not 0.0 <= mixing <= 1.0:
            raise ValueError(f"{name}: mixing must be between 0 and 1, got {mixing}")
        self.sync_every, self.overlap_steps, self.mixing = sync_every, overlap_steps, mixing
        self.inner_steps = 0
        self.outer_steps = 0
        if broadcast_parameters:
            for array in self._model.every_array():
                broadcast(array, root=0, group=self.group)
        self._fragments = [
            _Fragment(index, index * sync_every // fragments, self._slices(members))
            for index, members in enumerate(_split_evenly(params, fragments, self._model.size))]
        outer = [p for fragment in self._fragments for s in fragment.slices for p in s.outer_params]
        self.outer_optimizer = None if self._averaging else (outer_optimizer or nesterov_outer_optimizer())(outer)

    # --- building ---------------------------------------------------------------------

    def _slices(self, params: list[Any]) -> list[_Slice]:
        by_dtype: dict[str, list[np.ndarray]] = {}
        for param in params:
            array = self._values(param)
            by_dtype.setdefault(str(array.dtype), []).append(array)
        slices = []
        for arrays in by_dtype.values():
            offsets = list(np.cumsum([0] + [a.size for a in arrays[:-1]]))
            global_flat = np.concatenate([a.reshape(-1) for a in arrays])
            piece = _Slice(arrays, [int(o) for o in offsets], global_flat, np.zeros_like(global_flat))
            for array, offset in zip(arrays, piece.offsets, strict=True):
                stop = offset + array.size
                piece.outer_params.append(self._outer_param(global_flat[offset:stop].reshape(array.shape)))
                piece.outer_grads.append(self._outer_grad(piece.delta_flat[offset:stop].reshape(array.shape)))
            slices.append(piece)
        return slices

    def _values(self, param: Any) -> np.ndarray:
        array = param.detach().numpy() if isinstance(self._model, TorchModel) else param.data
        if array.dtype not in (np.float32, np.float64) or not array.flags.c_contiguous:
            raise ConfigurationError(f"{type(self).__name__}: parameters must be C-contiguous float32 or float64 "
                                     f"on the CPU, got a {array.dtype} one of shape {array.shape}")
        return array

    def _outer_param(self, view: np.ndarray) -> Any:
        if isinstance(self._model, TorchModel):
            return self._model.torch.nn.Parameter(self._model.torch.from_numpy(view))
        from ferro.nn.module import Parameter

        return Parameter(view)

    def _outer_grad(self, view: np.ndarray) -> Any:
        return self._model.torch.from_numpy(view) if isinstance(self._model, TorchModel) else view

    # --- the schedule -----------------------------------------------------------------

    def step(self) -> None:
        """Count one inner step; launch and finish the synchronisations due at it."""
        self.inner_steps += 1
        t = self.inner_steps
        for fragment in self._fragments:
            if fragment.launched_at is not None and t - fragment.launched_at >= self.overlap_steps:
                self._finish(fragment)
        for fragment in self._fragments:
            if t % self.sync_every == fragment.shift:
                self._launch(fragment)
                if self.overlap_steps == 0:
                    self._finish(fragment)

    def sync(self) -> None:
        """Finish every allreduce in flight, then agree on every fragment now (an outer step on each).

        A fragment that agreed at this very inner step (its synchronisation was
        due now and nothing overlaps it) is left alone: another outer step
        would move it by the outer optimizer's momentum alone.
        """
        for fragment in self._fragments:
            if fragment.launched_at is not None:
                self._finish(fragment)
        for fragment in self._fragments:
            if self.overlap_steps == 0 and fragment.last_launch == self.inner_steps:
                continue
            self._launch(fragment)
            self._finish(fragment, mix=False)

    def _launch(self, fragment: _Fragment) -> None:
        for piece in fragment.slices:
            for local, offset in zip(piece.locals, piece.offsets, strict=True):
                np.subtract(piece.global_flat[offset:offset + local.size], local.reshape(-1),
                            out=piece.delta_flat[offset:offset + local.size])
            fragment.pending.append(allreduce(piece.delta_flat, ReduceOp.MEAN, group=self.group, async_op=True))
        fragment.launched_at = fragment.last_launch = self.inner_steps

    def _finish(self, fragment: _Fragment, mix: bool = True) -> None:
        pending, fragment.pending, fragment.launched_at = fragment.pending, [], None
        for handle in pending:
            handle.wait()
        self._outer_step(fragment)
        keep = self.mixing if mix and self.overlap_steps else 0.0
        for piece in fragment.slices:
            for local, offset in zip(piece.locals, piece.offsets, strict=True):
                agreed = piece.global_flat[offset:offset + local.size].reshape(local.shape)
                if keep:
                    local *= keep
                    local += (1 - keep) * agreed
                else:
                    local[...] = agreed
        self.outer_steps += 1

    def _outer_step(self, fragment: _Fragment) -> None:
        if self.outer_optimizer is None:
            for piece in fragment.slices:
                piece.global_flat -= piece.delta_flat  # local SGD: the global values become the ranks' average
            return
        everyone = [p for f in self._fragments for s in f.slices for p in s.outer_params]
        for param in everyone:
            param.grad = None  # only this fragment's parameters step (optimizers skip a missing gradient)
        for piece in fragment.slices:
            for param, grad in zip(piece.outer_params, piece.outer_grads, strict=True):
                param.grad = grad
        if isinstance(self._model, TorchModel):
            with self._model.torch.no_grad():
                self.outer_optimizer.step()
        else:
            self.outer_optimizer.step()
        for param in everyone:
            param.grad = None


class LocalSGD(DiLoCo):
    """Local SGD: every ``sync_every`` inner steps, every rank takes the average of the ranks' parameters.

    It is :class:`DiLoCo` with an outer SGD step of rate 1 and no momentum,
    computed as the average itself.

    Example::

        local_sgd = ferro.parallel.LocalSGD(model, sync_every=8)
        for x, y in batches:
            ...; optimizer.step()
            local_sgd.step()

    """

    _averaging = True

    def __init__(self, module: Any, sync_every: int, group: Backend | None = None, fragments: int = 1,
                 overlap_steps: int = 0, mixing: float = 0.5, broadcast_parameters: bool = True) -> None:
        super().__init__(module, sync_every, None, group, fragments, overlap_steps, mixing, broadcast_parameters)


def _split_evenly(params: list[Any], parts: int, size: Callable[[Any], int]) -> list[list[Any]]:
    """Split ``params`` in order into ``parts`` non-empty runs of about equal element counts."""
    runs: list[list[Any]] = [[] for _ in range(parts)]
    total, seen, part = sum(size(p) for p in params), 0, 0
    for position, param in enumerate(params):
        later_parts, params_left = parts - part - 1, len(params) - position
        if runs[part] and later_parts and (seen * parts >= total * (part + 1) or params_left <= later_parts):
            part += 1
        runs[part].append(param)
        seen += size(param)
    return runs
