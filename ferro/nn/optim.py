"""Optimizers with PyTorch's update rules, changing parameters in place."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any

import numpy as np

from ferro.nn.module import Parameter

__all__ = ["SGD", "Adam", "Optimizer"]


class Optimizer(abc.ABC):
    """Base: the trainable parameters, :meth:`zero_grad` and :meth:`step`.

    Attributes:
        params: The parameters it updates.
        lr: The learning rate.
        state: Per parameter, the optimizer's running values by name (as
            ``torch.optim`` keeps them: ``state[param]["exp_avg"]``).

    """

    def __init__(self, params: Iterable[Parameter], lr: float) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not lr > 0:
            raise ValueError(f"learning rate must be positive, got {lr}")
        self.lr = lr
        self.state: dict[Parameter, dict[str, Any]] = {}

    def zero_grad(self) -> None:
        """Zero every gradient in place (DDP's gradients are views into its buckets)."""
        for param in self.params:
            if param.grad is not None:
                param.grad[...] = 0

    @abc.abstractmethod
    def step(self) -> None:
        """Update every parameter from its gradient."""

    def state_dict(self) -> dict[str, Any]:
        """Return the learning rate and copies of the running values, keyed by parameter index (as torch does)."""
        index = {id(param): i for i, param in enumerate(self.params)}
        state = {index[id(param)]: {name: np.array(value, copy=True) if isinstance(value, np.ndarray) else value
                                    for name, value in values.items()}
                 for param, values in self.state.items()}
        return {"lr": self.lr, "state": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a :meth:`state_dict` of an optimizer over parameters of the same shapes, in the same order.

        Raises:
            ValueError: A parameter index outside this optimizer, or a running value's shape differs.

        """
        loaded: dict[Parameter, dict[str, Any]] = {}
        for position, values in state["state"].items():
            if not 0 <= int(position) < len(self.params):
                raise ValueError(f"load_state_dict: parameter {position} is not one of this optimizer's "
                                 f"{len(self.params)}")
            param = self.params[int(position)]
            for name, value in values.items():
                if isinstance(value, np.ndarray) and value.shape != param.data.shape:
                    raise ValueError(f"load_state_dict: {name} of parameter {position} has shape {value.shape}, "
                                     f"the parameter {param.data.shape}")
            loaded[param] = {name: np.array(value, copy=True) if isinstance(value, np.ndarray) else value
                             for name, value in values.items()}
        self.lr = float(state["lr"])
        self.state = loaded


class SGD(Optimizer):
    """Stochastic gradient descent with momentum and weight decay, as ``torch.optim.SGD`` computes them.

    ``d = grad + weight_decay * p``; ``buf = momentum * buf + d`` (``buf = d`` on the
    first step); ``p -= lr * buf``, or with Nesterov momentum ``p -= lr * (d + momentum * buf)``.
    The buffer is ``state[param]["momentum_buffer"]``.

    Raises:
        ValueError: Nesterov momentum without momentum.

    """

    def __init__(self, params: Iterable[Parameter], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(params, lr)
        if nesterov and momentum <= 0:
            raise ValueError("SGD: Nesterov momentum needs a momentum above 0")
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov

    def step(self) -> None:
        """Apply one update."""
        for param in self.params:
            if param.grad is None:
                continue
            d = param.grad + self.weight_decay * param.data if self.weight_decay else param.grad
            if self.momentum:
                state = self.state.setdefault(param, {})
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = np.array(d, copy=True)
                else:
                    buf *= self.momentum
                    buf += d
                d = d + self.momentum * buf if self.nesterov else buf
            param.data -= (self.lr * d).astype(param.data.dtype, copy=False)


class Adam(Optimizer):
    """Adam with bias correction and (L2) weight decay, as ``torch.optim.Adam`` computes them.

    Per parameter, ``state[param]`` holds ``step`` (its own count of updates, as
    torch keeps it), ``exp_avg`` and ``exp_avg_sq``.
    """

    def __init__(self, params: Iterable[Parameter], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay

    def step(self) -> None:
        """Apply one update."""
        for param in self.params:
            if param.grad is None:
                continue
            grad = param.grad + self.weight_decay * param.data if self.weight_decay else param.grad
            state = self.state.get(param)
            if state is None:
                state = self.state[param] = {"step": 0, "exp_avg": np.zeros_like(param.data),
                                             "exp_avg_sq": np.zeros_like(param.data)}
            state["step"] += 1
            correction1 = 1 - self.beta1 ** state["step"]
            correction2 = 1 - self.beta2 ** state["step"]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m *= self.beta1
            m += (1 - self.beta1) * grad
            v *= self.beta2
            v += (1 - self.beta2) * grad * grad
            denominator = np.sqrt(v / correction2) + self.eps
            param.data -= (self.lr / correction1 * m / denominator).astype(param.data.dtype, copy=False)
