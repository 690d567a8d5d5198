"""Batch normalisation as torch computes it, in NumPy: the layers, and the math the synchronised ones share.

Training normalises with the batch's mean and *biased* variance, and moves the
running statistics towards the batch's mean and *unbiased* variance (by
``momentum``, or by a cumulative average when ``momentum`` is None); evaluation
normalises with the running statistics. A layer without running statistics uses
the batch's in evaluation too.

The statistics go through one place, :meth:`_BatchNorm.combine`, as per-part
``[count, sum, M2]`` rows (M2: the sum of squared deviations from the part's own
mean). One part is a local batch; :class:`ferro.SyncBatchNorm` gathers one row
per rank and combines them with Chan's parallel formula, which weights parts by
their counts (uneven and empty local batches) and never subtracts nearly equal
sums of squares.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro.nn.module import Module, Parameter

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "batch_moments", "combine_moments", "gradient_sums",
           "input_gradient", "moments_row", "normalize", "update_running"]


def batch_moments(x: np.ndarray) -> np.ndarray:
    """Return ``[count, sum per channel, M2 per channel]`` (float64) of a batch ``(N, C, ...)``."""
    channels = x.shape[1]
    axes = (0, *range(2, x.ndim))
    count = x.size // channels if channels else 0
    total = x.sum(axis=axes, dtype=np.float64)
    mean = total / max(count, 1)
    deviation = x - mean.astype(x.dtype).reshape(_channel_shape(x.ndim, channels))
    m2 = np.square(deviation, dtype=np.float64).sum(axis=axes) if count else np.zeros(channels)
    return moments_row(count, total, m2)


def moments_row(count: int, total: np.ndarray, m2: np.ndarray) -> np.ndarray:
    """Return the ``[count, sum, M2]`` row (float64) that :func:`combine_moments` combines."""
    return np.concatenate([[float(count)], np.asarray(total, np.float64), np.asarray(m2, np.float64)])


def combine_moments(rows: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Combine parts' ``[count, sum, M2]`` rows into the whole batch's ``(count, mean, M2)`` (Chan et al.)."""
    channels = (rows.shape[1] - 1) // 2
    counts, sums, m2s = rows[:, 0], rows[:, 1:1 + channels], rows[:, 1 + channels:]
    count = float(counts.sum())
    mean = sums.sum(axis=0) / max(count, 1.0)
    part_means = sums / np.maximum(counts, 1.0)[:, None]
    m2 = m2s.sum(axis=0) + (counts[:, None] * np.square(part_means - mean)).sum(axis=0)
    return count, mean, m2


def update_running(running_mean: np.ndarray, running_var: np.ndarray, batches: np.ndarray, momentum: float | None,
                   count: float, mean: np.ndarray, m2: np.ndarray) -> None:
    """Move the running statistics towards this batch's, in place (unbiased variance, as torch does)."""
    batches += 1
    factor = momentum if momentum is not None else 1.0 / float(batches)
    running_mean *= 1.0 - factor
    running_mean += factor * mean
    running_var *= 1.0 - factor
    running_var += factor * (m2 / (count - 1.0))


def normalize(x: np.ndarray, mean: np.ndarray, var: np.ndarray, eps: float, weight: np.ndarray | None,
              bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(y, x_hat, invstd)``: ``x_hat = (x - mean) / sqrt(var + eps)``, ``y = x_hat * weight + bias``."""
    shape = _channel_shape(x.ndim, x.shape[1])
    invstd = 1.0 / np.sqrt(var + eps)
    x_hat = (x - mean.astype(x.dtype).reshape(shape)) * invstd.astype(x.dtype).reshape(shape)
    y = x_hat
    if weight is not None:
        y = x_hat * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y, x_hat, invstd


def gradient_sums(grad_output: np.ndarray, x_hat: np.ndarray) -> np.ndarray:
    """Return ``[sum dy, sum dy * x_hat]`` per channel (float64): the backward's statistics."""
    axes = (0, *range(2, grad_output.ndim))
    return np.concatenate([grad_output.sum(axis=axes, dtype=np.float64),
                           (grad_output * x_hat).sum(axis=axes, dtype=np.float64)])


def input_gradient(grad_output: np.ndarray, x_hat: np.ndarray, invstd: np.ndarray, weight: np.ndarray | None,
                   count: float | None, sums: np.ndarray | None) -> np.ndarray:
    """Return dL/dx.

    With batch statistics, ``sums`` are :func:`gradient_sums` over the whole
    batch (all ranks) and ``count`` its size: ``dx = w * invstd * (dy - mean(dy)
    - x_hat * mean(dy * x_hat))``. With running statistics (``count`` None) the
    normalisation is affine: ``dx = w * invstd * dy``.
    """
    channels = grad_output.shape[1]
    shape = _channel_shape(grad_output.ndim, channels)
    scale = invstd if weight is None else invstd * weight
    scale = scale.astype(grad_output.dtype).reshape(shape)
    if count is None or sums is None:
        return grad_output * scale
    mean_dy = (sums[:channels] / count).astype(grad_output.dtype).reshape(shape)
    mean_dy_xhat = (sums[channels:] / count).astype(grad_output.dtype).reshape(shape)
    return scale * (grad_output - mean_dy - x_hat * mean_dy_xhat)


def _channel_shape(ndim: int, channels: int) -> tuple[int, ...]:
    return (1, channels) + (1,) * (ndim - 2)


class _BatchNorm(Module):
    """Batch normalisation over the channel dimension (1) of ``(N, C, ...)`` inputs."""

    _input_ndims: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, dtype: Any = np.float32) -> None:
        super().__init__()
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"{type(self).__name__}: num_features must be a positive int, got {num_features!r}")
        self.num_features, self.eps, self.momentum = num_features, float(eps), momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        if affine:
            self.weight = Parameter(np.ones(num_features, dtype))
            self.bias = Parameter(np.zeros(num_features, dtype))
        self.running_mean: np.ndarray | None = None
        self.running_var: np.ndarray | None = None
        self.num_batches_tracked: np.ndarray | None = None
        if track_running_stats:
            self.running_mean = self.register_buffer("running_mean", np.zeros(num_features, dtype))
            self.running_var = self.register_buffer("running_var", np.ones(num_features, dtype))
            self.num_batches_tracked = self.register_buffer("num_batches_tracked", np.zeros((), np.int64))

    # --- the hooks a synchronised layer overrides --------------------------------------------------

    def combine(self, moments: np.ndarray) -> np.ndarray:
        """Return the ``[count, sum, M2]`` rows of every part of the batch; here, this one."""
        return moments[None, :]

    def reduce_gradient_sums(self, sums: np.ndarray) -> np.ndarray:
        """Return the backward's sums over the whole batch; here, this part's."""
        return sums

    # --- forward and backward ------------------------------------------------------------------

    def _uses_batch_stats(self) -> bool:
        return self.training or not self.track_running_stats

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Normalise ``x`` of shape ``(N, C, ...)`` per channel.

        Raises:
            ValueError: Wrong number of dimensions or channels, or a training batch
                with at most one value per channel (over every rank, when synchronised).

        """
        x = np.asarray(x)
        name = type(self).__name__
        if (self._input_ndims and x.ndim not in self._input_ndims) or x.ndim < 2:
            expected = " or ".join(f"{n}-d" for n in self._input_ndims) or "at least 2-d"
            raise ValueError(f"{name}: expected a {expected} input (N, C, ...), got shape {x.shape}")
        if x.shape[1] != self.num_features:
            raise ValueError(f"{name}: expected {self.num_features} channels (dimension 1), got shape {x.shape}")
        weight = self.weight.data if self.affine else None
        bias = self.bias.data if self.affine else None
        count = None
        if self._uses_batch_stats():
            rows = self.combine(batch_moments(x)) if self.training else batch_moments(x)[None, :]
            count, mean, m2 = combine_moments(rows)
            if self.training and count <= 1:
                raise ValueError(f"{name}: expected more than 1 value per channel when training, got {int(count)} "
                                 f"(input shape {x.shape}{' on this rank' if rows.shape[0] > 1 else ''})")
            var = m2 / count
            if self.training and self.track_running_stats:
                assert self.running_mean is not None and self.running_var is not None
                assert self.num_batches_tracked is not None
                update_running(self.running_mean, self.running_var, self.num_batches_tracked, self.momentum, count,
                               mean, m2)
        else:
            assert self.running_mean is not None and self.running_var is not None
            mean, var = self.running_mean.astype(np.float64), self.running_var.astype(np.float64)
        y, x_hat, invstd = normalize(x, mean, var, self.eps, weight, bias)
        self.save_for_backward(x_hat=x_hat, invstd=invstd, count=count, synced=self.training)
        return y

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        """Add dL/dweight and dL/dbias (this batch's part); return dL/dx."""
        x_hat, count = self.saved("x_hat"), self.saved("count")
        sums = None
        if count is not None:
            local = gradient_sums(grad_output, x_hat)
            sums = self.reduce_gradient_sums(local) if self.saved("synced") else local
            self._add_affine_grads(local)
        elif self.affine:
            self._add_affine_grads(gradient_sums(grad_output, x_hat))
        weight = self.weight.data if self.affine else None
        return input_gradient(grad_output, x_hat, self.saved("invstd"), weight, count, sums)

    def _add_affine_grads(self, local: np.ndarray) -> None:
        if self.affine:
            channels = self.num_features
            self.bias.accumulate_grad(local[:channels].astype(self.bias.dtype))  # bias first: reverse order
            self.weight.accumulate_grad(local[channels:].astype(self.weight.dtype))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats})")


class BatchNorm1d(_BatchNorm):
    """Batch normalisation of ``(N, C)`` or ``(N, C, L)`` inputs (torch's ``BatchNorm1d``).

    Args:
        num_features: C.
        eps: Added to the variance.
        momentum: Weight of the new batch in the running statistics; None for a cumulative average.
        affine: Learn a per-channel weight (ones) and bias (zeros).
        track_running_stats: Keep running statistics for evaluation.
        dtype: Parameter and running-statistics dtype.

    """

    _input_ndims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation of ``(N, C, H, W)`` inputs (torch's ``BatchNorm2d``); arguments as :class:`BatchNorm1d`."""

    _input_ndims = (4,)


class BatchNorm3d(_BatchNorm):
    """Batch normalisation of ``(N, C, D, H, W)`` inputs (torch's ``BatchNorm3d``); arguments as ``BatchNorm1d``."""

    _input_ndims = (5,)
