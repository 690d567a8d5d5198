"""Optimizers with PyTorch's update rules, changing parameters in place."""

from __future__ import annotations

import abc
from collections.abc import Iterable

import numpy as np

from ferro.nn.module import Parameter

__all__ = ["SGD", "Adam", "Optimizer"]


class Optimizer(abc.ABC):
    """Base: the trainable parameters, :meth:`zero_grad` and :meth:`step`."""

    def __init__(self, params: Iterable[Parameter], lr: float) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not lr > 0:
            raise ValueError(f"learning rate must be positive, got {lr}")
        self.lr = lr

    def zero_grad(self) -> None:
        """Zero every gradient in place (DDP's gradients are views into its buckets)."""
        for param in self.params:
            if param.grad is not None:
                param.grad[...] = 0

    @abc.abstractmethod
    def step(self) -> None:
        """Update every parameter from its gradient."""


class SGD(Optimizer):
    """Stochastic gradient descent with momentum and weight decay, as ``torch.optim.SGD`` computes them.

    ``d = grad + weight_decay * p``; ``buf = momentum * buf + d`` (``buf = d`` on the
    first step); ``p -= lr * buf``.
    """

    def __init__(self, params: Iterable[Parameter], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        self.momentum, self.weight_decay = momentum, weight_decay
        self._buffers: dict[int, np.ndarray] = {}

    def step(self) -> None:
        """Apply one update."""
        for param in self.params:
            if param.grad is None:
                continue
            d = param.grad + self.weight_decay * param.data if self.weight_decay else param.grad
            if self.momentum:
                buf = self._buffers.get(id(param))
                if buf is None:
                    buf = self._buffers[id(param)] = np.array(d, copy=True)
                else:
                    buf *= self.momentum
                    buf += d
                d = buf
            param.data -= (self.lr * d).astype(param.data.dtype, copy=False)


class Adam(Optimizer):
    """Adam with bias correction and (L2) weight decay, as ``torch.optim.Adam`` computes them."""

    def __init__(self, params: Iterable[Parameter], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self._state: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._steps = 0

    def step(self) -> None:
        """Apply one update."""
        self._steps += 1
        correction1 = 1 - self.beta1**self._steps
        correction2 = 1 - self.beta2**self._steps
        for param in self.params:
            if param.grad is None:
                continue
            grad = param.grad + self.weight_decay * param.data if self.weight_decay else param.grad
            m, v = self._state.setdefault(id(param), (np.zeros_like(param.data), np.zeros_like(param.data)))
            m *= self.beta1
            m += (1 - self.beta1) * grad
            v *= self.beta2
            v += (1 - self.beta2) * grad * grad
            denominator = np.sqrt(v / correction2) + self.eps
            param.data -= (self.lr / correction1 * m / denominator).astype(param.data.dtype, copy=False)
