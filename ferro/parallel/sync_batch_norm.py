"""Synchronised batch normalisation: statistics over every rank's batch, for ferro.nn and for torch on CPU.

torch 2.13's ``SyncBatchNorm`` refuses CPU tensors; this one is made for them.

Per training step a layer runs **one collective in forward** (an ``all_gather``
of each rank's ``[count, sum, M2]`` per channel, combined with Chan's formula so
uneven and empty local batches weigh what they hold) and **one in backward** (an
``allreduce`` of ``[sum dy, sum dy * x_hat]``). Evaluation with running
statistics communicates nothing. Weight and bias gradients stay this rank's
part, as torch's do: data parallelism (DDP) sums or averages them like any other
gradient. Every rank of the group must run forward and backward of every
synchronised layer, in the same order, in training mode; a rank with an empty
batch takes part with a zero-size input.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro import collective
from ferro.backend.base import Backend
from ferro.nn.batch_norm import _BatchNorm
from ferro.nn.module import Module

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation of ``(N, C, ...)`` inputs with statistics over the whole group's batch (ferro.nn).

    Args:
        num_features: C.
        eps: Added to the variance.
        momentum: Weight of the new batch in the running statistics; None for a cumulative average.
        affine: Learn a per-channel weight and bias.
        track_running_stats: Keep running statistics (then evaluation communicates nothing).
        group: The process group (default: the default group, looked up at each call).
        timeout: Seconds for each collective (default: the group's).
        dtype: Parameter and running-statistics dtype.

    Example::

        # 3 ranks with local batches of 5, 3 and 0 rows: normalised as one batch of 8
        bn = ferro.SyncBatchNorm(16, group=world)
        y = bn(x_local)                  # one all_gather
        dx = bn.backward(dy_local)       # one allreduce

    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, group: Backend | None = None, *, timeout: float | None = None,
                 dtype: Any = np.float32) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, dtype)
        self.group, self.timeout = group, timeout

    def combine(self, moments: np.ndarray) -> np.ndarray:
        """All-gather every rank's ``[count, sum, M2]`` row."""
        rows = collective.all_gather(moments, group=self.group, timeout=self.timeout)
        return rows.reshape(-1, moments.size)

    def reduce_gradient_sums(self, sums: np.ndarray) -> np.ndarray:
        """Allreduce the backward's sums."""
        total = sums.copy()
        collective.allreduce(total, group=self.group, timeout=self.timeout)
        return total


def convert_sync_batchnorm(module: Any, group: Backend | None = None, *, timeout: float | None = None) -> Any:
    """Replace every batch-norm layer in ``module`` with a synchronised one over ``group``; return the result.

    torch modules: ``BatchNorm1d/2d/3d`` (and torch's own ``SyncBatchNorm``) become
    ferro's CPU layer, keeping the same ``weight`` and ``bias`` parameters (an
    optimizer made before still updates them) and the running-statistics
    buffers. ferro.nn modules: ``BatchNorm1d/2d/3d`` become :class:`SyncBatchNorm`
    sharing the parameters and buffers.

    Args:
        module: A torch ``nn.Module`` or a ferro.nn :class:`~ferro.nn.Module` (changed in place).
        group: The process group (default: the default group, looked up at each call).
        timeout: Seconds for each collective (default: the group's).

    Returns:
        ``module``, or the replacement when ``module`` itself is a batch-norm layer.

    Example::

        model = torchvision.models.resnet18()
        model = ferro.convert_sync_batchnorm(model, group=world)

    """
    if isinstance(module, Module):
        return _convert_ferro(module, group, timeout)
    from ferro.parallel import _sync_batch_norm_torch

    return _sync_batch_norm_torch.convert(module, group, timeout)


def _convert_ferro(module: Module, group: Backend | None, timeout: float | None) -> Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        dtype = module.weight.dtype if module.affine else (
            module.running_mean.dtype if module.running_mean is not None else np.float32)
        sync = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats, group, timeout=timeout, dtype=dtype)
        if module.affine:
            sync.weight, sync.bias = module.weight, module.bias
        for name, value in module._buffers.items():
            sync.register_buffer(name, value)
        sync.train(module.training)
        return sync
    for name, child in list(module._modules.items()):
        setattr(module, name, _convert_ferro(child, group, timeout))
    return module
