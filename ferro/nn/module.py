"""Parameters and modules: the small, exact NumPy model layer ferro's parallelism is tested with."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["Module", "Parameter"]


class Parameter:
    """A trainable array.

    Attributes:
        data: The values (a C-contiguous NumPy array), updated in place by optimizers.
        grad: The accumulated gradient, or None before the first backward.
            Backward adds into it in place, so it may be a view into a larger
            buffer (DDP keeps every gradient inside its bucket buffers).
        requires_grad: False freezes the parameter: no gradient, no update.

    """

    def __init__(self, data: Any, requires_grad: bool = True) -> None:
        self.data = np.ascontiguousarray(data)
        self.grad: np.ndarray | None = None
        self.requires_grad = requires_grad
        self._grad_hooks: list[Callable[[Parameter], None]] = []

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        """The array's dtype."""
        return self.data.dtype

    def accumulate_grad(self, grad: np.ndarray) -> None:
        """Add ``grad`` to :attr:`grad` in place, then run the gradient-ready hooks."""
        if not self.requires_grad:
            return
        if self.grad is None:
            self.grad = np.zeros_like(self.data)
        self.grad += grad
        for hook in self._grad_hooks:
            hook(self)

    def register_grad_ready_hook(self, hook: Callable[[Parameter], None]) -> Callable[[], None]:
        """Call ``hook(param)`` each time backward has added this parameter's gradient.

        Returns:
            A function that removes the hook.

        """
        self._grad_hooks.append(hook)
        return lambda: self._grad_hooks.remove(hook)

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"


class Module:
    """A layer or a model: parameters, sub-modules, forward and backward.

    Subclasses set parameters and sub-modules as attributes (the order of
    assignment is their order), implement :meth:`forward`, and implement
    :meth:`backward`, which takes the gradient of the loss with respect to the
    output, adds into every parameter's gradient, and returns the gradient with
    respect to the input.
    """

    _parameters: dict[str, Parameter]
    _modules: dict[str, Module]
    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def forward(self, *inputs: Any) -> Any:
        """Compute the output (and keep what backward needs)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        """Add into the parameters' gradients; return the gradient with respect to the input."""
        raise NotImplementedError(f"{type(self).__name__} does not implement backward")

    def __call__(self, *inputs: Any) -> Any:
        """Run :meth:`forward`."""
        return self.forward(*inputs)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """Yield ``(dotted name, parameter)`` for this module's parameters, then its children's."""
        for name, param in self._parameters.items():
            yield prefix + name, param
        for name, module in self._modules.items():
            yield from module.named_parameters(f"{prefix}{name}.")

    def parameters(self) -> Iterator[Parameter]:
        """Yield every parameter, in definition order."""
        for _, param in self.named_parameters():
            yield param

    def children(self) -> Iterator[Module]:
        """Yield the direct sub-modules."""
        yield from self._modules.values()

    def train(self, mode: bool = True) -> Module:
        """Set training mode here and in every sub-module; return self."""
        object.__setattr__(self, "training", mode)
        for child in self.children():
            child.train(mode)
        return self

    def eval(self) -> Module:
        """Set evaluation mode; return self."""
        return self.train(False)

    def zero_grad(self) -> None:
        """Zero every gradient in place (views into other buffers stay views)."""
        for param in self.parameters():
            if param.grad is not None:
                param.grad[...] = 0

    def state_dict(self) -> dict[str, np.ndarray]:
        """Return copies of every parameter's values by dotted name."""
        return {name: param.data.copy() for name, param in self.named_parameters()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Copy values into the existing parameters in place.

        Raises:
            KeyError: A parameter is missing from ``state``.
            ValueError: A shape differs.

        """
        for name, param in self.named_parameters():
            value = np.asarray(state[name])
            if value.shape != param.shape:
                raise ValueError(f"load_state_dict: {name} has shape {param.shape}, the state has {value.shape}")
            param.data[...] = value
