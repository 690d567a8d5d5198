"""The torch side of SyncBatchNorm: a CPU ``nn.Module`` with an autograd function over ferro's collectives.

Imported only by :func:`ferro.parallel.sync_batch_norm.convert_sync_batchnorm`
(it imports torch). Statistics are combined exactly as ferro.nn's layers combine
them (:mod:`ferro.nn.batch_norm`); the per-element passes are torch's kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ferro import collective
from ferro.backend.base import Backend
from ferro.nn import batch_norm as bn

__all__ = ["TorchSyncBatchNorm", "convert"]

class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward: one all_gather of the moments; backward: one allreduce of the gradient sums.

    The per-element work is torch's own fused CPU kernels:
    ``batch_norm_update_stats`` for this rank's moments, ``batch_norm`` in evaluation form with the group's mean and
    variance, ``native_batch_norm_backward`` for the two per-channel sums, and
    ``dx = dy * k1 + x * k2 + k3`` (per-channel constants) in two ``addcmul``
    passes. The small per-channel arithmetic is :mod:`ferro.nn.batch_norm`'s.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                layer: TorchSyncBatchNorm) -> torch.Tensor:
        channels = x.shape[1]
        count_here = x.numel() // channels if channels else 0
        if count_here:
            # This rank's mean and biased variance in one fused pass (torch's CPU Welford kernel).
            mean, var = torch.batch_norm_update_stats(x.detach(), None, None, 0.0)
            moments = bn.moments_row(count_here, mean.double().numpy() * count_here,
                                     var.double().numpy() * count_here)
        else:
            moments = bn.moments_row(0, np.zeros(channels), np.zeros(channels))
        rows = collective.all_gather(moments, group=layer.group, timeout=layer.timeout).reshape(-1, moments.size)
        count, mean64, m2 = bn.combine_moments(rows)
        if count <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel when training, got "
                             f"{int(count)} over the group (this rank's input: {tuple(x.shape)})")
        if layer.track_running_stats:
            with torch.no_grad():
                bn.update_running(layer.buffer("running_mean").numpy(), layer.buffer("running_var").numpy(),
                                  layer.buffer("num_batches_tracked").numpy(), layer.momentum, count, mean64, m2)
        var64 = m2 / count
        stat_dtype = x.dtype if x.dtype == torch.float64 else torch.float32
        mean_t, var_t = torch.from_numpy(mean64).to(stat_dtype), torch.from_numpy(var64).to(stat_dtype)
        invstd = torch.from_numpy(1.0 / np.sqrt(var64 + layer.eps)).to(stat_dtype)
        ctx.save_for_backward(x, weight)
        ctx.stats = (mean_t, invstd, count, layer)
        if count_here == 0:  # torch's CPU kernels divide by the batch size (SIGFPE on an empty one)
            return x.detach().clone()
        y = torch.nn.functional.batch_norm(x.detach(), mean_t, var_t, None if weight is None else weight.detach(),
                                           None if bias is None else bias.detach(), False, 0.0, layer.eps)
        return y

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        mean, invstd, count, layer = ctx.stats
        dy = grad_output.contiguous()
        channels = x.shape[1]
        if x.numel():
            # Sum dy and sum dy * x_hat over this rank's batch, in one fused pass.
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, weight, None, None, mean, invstd, True, layer.eps, [False, True, True])
        else:
            sum_dy_xhat = sum_dy = torch.zeros(channels, dtype=mean.dtype)
        local = np.concatenate([sum_dy.double().numpy(), sum_dy_xhat.double().numpy()])
        total = local.copy()
        collective.allreduce(total, group=layer.group, timeout=layer.timeout)
        mean_dy = torch.from_numpy(total[:channels] / count).to(mean.dtype)
        mean_dy_xhat = torch.from_numpy(total[channels:] / count).to(mean.dtype)
        # dx = w * invstd * (dy - mean_dy - x_hat * mean_dy_xhat) = dy * k1 + x * k2 + k3, per channel.
        k1 = invstd if weight is None else invstd * weight.detach().to(invstd.dtype)
        k2 = -k1 * invstd * mean_dy_xhat
        k3 = -k1 * mean_dy - k2 * mean
        shape = (1, channels) + (1,) * (x.dim() - 2)
        grad_x = torch.addcmul(k3.reshape(shape).to(x.dtype), x, k2.reshape(shape).to(x.dtype))
        grad_x.addcmul_(dy, k1.reshape(shape).to(x.dtype))
        if weight is None:
            return grad_x, None, None, None
        return grad_x, sum_dy_xhat.to(weight.dtype), sum_dy.to(weight.dtype), None


class TorchSyncBatchNorm(torch.nn.Module):
    """Synchronised batch normalisation for CPU torch modules; made by ``ferro.convert_sync_batchnorm``.

    In training mode it normalises with the statistics of every rank's batch
    (one ``all_gather`` forward, one ``allreduce`` backward); in evaluation mode
    with the running statistics, communicating nothing (or, without running
    statistics, with this rank's batch alone, as torch's ``SyncBatchNorm`` does).

    Attributes:
        group: The process group (None: the default group).
        timeout: Seconds for each collective (None: the group's).

    """

    def __init__(self, source: torch.nn.modules.batchnorm._BatchNorm, group: Backend | None,
                 timeout: float | None) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum = source.num_features, source.eps, source.momentum
        self.affine, self.track_running_stats = source.affine, source.track_running_stats
        self.weight, self.bias = source.weight, source.bias  # the same Parameters: optimizers keep them
        self.register_buffer("running_mean", source.running_mean)
        self.register_buffer("running_var", source.running_var)
        self.register_buffer("num_batches_tracked", source.num_batches_tracked)
        self.group, self.timeout = group, timeout
        self.train(source.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` of shape ``(N, C, ...)`` per channel (see the class)."""
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm: expected an (N, {self.num_features}, ...) input, got shape "
                             f"{tuple(x.shape)}")
        if x.device.type != "cpu":
            raise ValueError(f"SyncBatchNorm: ferro's layer computes on CPU tensors; this input is on {x.device} "
                             f"(for GPU tensors use torch.nn.SyncBatchNorm over NCCL)")
        if not self.training:
            use_batch = not self.track_running_stats
            running = (None, None) if use_batch else (self.buffer("running_mean"), self.buffer("running_var"))
            return torch.nn.functional.batch_norm(x, running[0], running[1], self.weight, self.bias, use_batch, 0.0,
                                                  self.eps)
        result: torch.Tensor = _SyncBatchNormFunction.apply(x, self.weight, self.bias, self)
        return result

    def buffer(self, name: str) -> torch.Tensor:
        """Return the running-statistics buffer ``name``."""
        value = self._buffers[name]
        assert value is not None, f"{name} is tracked only with track_running_stats=True"
        return value

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


def convert(module: torch.nn.Module, group: Backend | None, timeout: float | None) -> torch.nn.Module:
    """Replace torch batch-norm layers (torch's SyncBatchNorm included) with :class:`TorchSyncBatchNorm`."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"convert_sync_batchnorm: expected a torch.nn.Module or a ferro.nn.Module, got "
                        f"{type(module).__name__}")
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        return TorchSyncBatchNorm(module, group, timeout)
    for name, child in module.named_children():
        converted = convert(child, group, timeout)
        if converted is not child:
            setattr(module, name, converted)
    return module
