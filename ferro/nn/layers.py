"""Layers, losses and containers, each with an exact backward."""

from __future__ import annotations

from typing import Any

import numpy as np

from ferro.nn.module import Module, Parameter

__all__ = ["CrossEntropyLoss", "Linear", "MSELoss", "ReLU", "Sequential", "Tanh"]


class Linear(Module):
    """``y = x @ weight.T + bias``, initialised as PyTorch does (uniform in ±1/sqrt(in_features)).

    Args:
        in_features: Input width.
        out_features: Output width.
        bias: Whether to add a bias.
        rng: Random generator for the initial values (seed it for reproducible runs).
        dtype: Parameter dtype.

    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 rng: np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        super().__init__()
        rng = rng or np.random.default_rng()
        bound = 1.0 / np.sqrt(in_features)
        self.weight = Parameter(rng.uniform(-bound, bound, (out_features, in_features)).astype(dtype))
        self.bias = Parameter(rng.uniform(-bound, bound, out_features).astype(dtype)) if bias else None

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Apply the affine map to a batch ``(N, in_features)``."""
        self.save_for_backward(input=x)
        y = x @ self.weight.data.T
        return y + self.bias.data if self.bias is not None else y

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        """Add dL/dW and dL/db; return dL/dx."""
        self.saved("input")
        grad_input = grad_output @ self.weight.data
        self._add_weight_grads(grad_output)
        return grad_input

    @property
    def splits_backward(self) -> bool:
        """Always: dL/dx and dL/dW are separate products."""
        return True

    def backward_input(self, grad_output: np.ndarray) -> np.ndarray:
        """Return dL/dx; keep ``grad_output`` for :meth:`backward_weight`."""
        self.saved("input")
        self.save_for_backward(grad_output=grad_output)
        return grad_output @ self.weight.data

    def backward_weight(self) -> None:
        """Add dL/dW and dL/db from the gradient :meth:`backward_input` kept."""
        self._add_weight_grads(self.saved("grad_output"))

    def _add_weight_grads(self, grad_output: np.ndarray) -> None:
        # Bias first: backward produces gradients in reverse definition order.
        if self.bias is not None:
            self.bias.accumulate_grad(grad_output.sum(axis=0))
        self.weight.accumulate_grad(grad_output.T @ self.saved("input"))


class ReLU(Module):
    """``max(x, 0)``."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Zero the negative entries."""
        mask = x > 0
        self.save_for_backward(mask=mask)
        return x * mask

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        """Pass the gradient where the input was positive."""
        return grad_output * self.saved("mask")


class Tanh(Module):
    """Hyperbolic tangent."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Apply tanh element-wise."""
        output = np.tanh(x)
        self.save_for_backward(output=output)
        return output

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        """Multiply by 1 - tanh(x)^2."""
        return grad_output * (1 - self.saved("output") ** 2)


class Sequential(Module):
    """Modules applied in order; backward runs them in reverse."""

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, module in enumerate(modules):
            setattr(self, str(i), module)

    def forward(self, x: Any) -> Any:
        """Feed ``x`` through every module."""
        for module in self.children():
            x = module(x)
        return x

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        """Feed the gradient back through every module, last first."""
        for module in reversed(list(self.children())):
            grad_output = module.backward(grad_output)
        return grad_output

    @property
    def splits_backward(self) -> bool:
        """When every module in it does."""
        return all(module.splits_backward for module in self.children())

    def backward_input(self, grad_output: np.ndarray) -> np.ndarray:
        """Feed the input gradient back through every module, last first (weights wait)."""
        for module in reversed(list(self.children())):
            grad_output = module.backward_input(grad_output)
        return grad_output

    def backward_weight(self) -> None:
        """Add every module's weight gradients, last first (the order backward would)."""
        for module in reversed(list(self.children())):
            module.backward_weight()


class MSELoss:
    """Mean squared error over every element; ``backward()`` returns dL/dprediction."""

    def __init__(self) -> None:
        self._diff: np.ndarray | None = None

    def __call__(self, prediction: np.ndarray, target: np.ndarray) -> float:
        """Return the loss (and keep what backward needs)."""
        self._diff = prediction - target
        return float(np.mean(self._diff**2))

    def backward(self) -> np.ndarray:
        """Return the gradient of the last loss with respect to the prediction."""
        diff = self._diff
        if diff is None:
            raise RuntimeError("MSELoss.backward called before the loss")
        return (2.0 / diff.size) * diff


class CrossEntropyLoss:
    """Softmax cross-entropy of logits ``(N, C)`` against integer classes ``(N,)``, averaged over the batch."""

    def __init__(self) -> None:
        self._probabilities: np.ndarray | None = None
        self._targets: np.ndarray | None = None

    def __call__(self, logits: np.ndarray, targets: np.ndarray) -> float:
        """Return the loss (and keep what backward needs)."""
        shifted = logits - logits.max(axis=1, keepdims=True)  # for numerical safety
        log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        self._probabilities = np.exp(log_probabilities)
        self._targets = np.asarray(targets)
        return float(-log_probabilities[np.arange(len(self._targets)), self._targets].mean())

    def backward(self) -> np.ndarray:
        """Return the gradient of the last loss with respect to the logits: (softmax - one-hot) / N."""
        if self._probabilities is None or self._targets is None:
            raise RuntimeError("CrossEntropyLoss.backward called before the loss")
        grad = self._probabilities.copy()
        grad[np.arange(len(self._targets)), self._targets] -= 1
        return grad / len(self._targets)
