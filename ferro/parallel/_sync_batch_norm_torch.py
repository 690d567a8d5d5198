"""The torch side of SyncBatchNorm: a CPU ``nn.Module`` whose autograd function runs ferro's batch-norm math.

Imported only by :func:`ferro.parallel.sync_batch_norm.convert_sync_batchnorm`
(it imports torch). The math is :mod:`ferro.nn.batch_norm`'s, on zero-copy
NumPy views of the CPU tensors (float16 and bfloat16 are computed in float32),
so ferro.nn and torch layers normalise identically.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ferro import collective
from ferro.backend.base import Backend
from ferro.nn import batch_norm as bn

__all__ = ["TorchSyncBatchNorm", "convert"]

_NUMPY_NATIVE = (torch.float32, torch.float64)


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.dtype not in _NUMPY_NATIVE:
        tensor = tensor.float()
    return tensor.contiguous().numpy()


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward: one all_gather of the moments; backward: one allreduce of the gradient sums."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                layer: TorchSyncBatchNorm) -> torch.Tensor:
        data = _as_numpy(x)
        moments = bn.batch_moments(data)
        rows = collective.all_gather(moments, group=layer.group, timeout=layer.timeout).reshape(-1, moments.size)
        count, mean, m2 = bn.combine_moments(rows)
        if count <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel when training, got "
                             f"{int(count)} over the group (this rank's input: {tuple(x.shape)})")
        if layer.track_running_stats:
            with torch.no_grad():
                bn.update_running(layer.buffer("running_mean").numpy(), layer.buffer("running_var").numpy(),
                                  layer.buffer("num_batches_tracked").numpy(), layer.momentum, count, mean, m2)
        w = _as_numpy(weight) if weight is not None else None
        b = _as_numpy(bias) if bias is not None else None
        y, x_hat, invstd = bn.normalize(data, mean, m2 / count, layer.eps, w, b)
        ctx.saved = (x_hat, invstd, w, count, layer)
        ctx.dtypes = (x.dtype, None if weight is None else weight.dtype)
        return torch.from_numpy(np.ascontiguousarray(y)).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        x_hat, invstd, w, count, layer = ctx.saved
        dy = _as_numpy(grad_output).astype(x_hat.dtype, copy=False)
        local = bn.gradient_sums(dy, x_hat)
        total = local.copy()
        collective.allreduce(total, group=layer.group, timeout=layer.timeout)
        dx = bn.input_gradient(dy, x_hat, invstd, w, count, total)
        x_dtype, w_dtype = ctx.dtypes
        grad_x = torch.from_numpy(np.ascontiguousarray(dx)).to(x_dtype)
        if w is None:
            return grad_x, None, None, None
        channels = local.size // 2
        return (grad_x, torch.from_numpy(local[channels:]).to(w_dtype), torch.from_numpy(local[:channels]).to(w_dtype),
                None)


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
