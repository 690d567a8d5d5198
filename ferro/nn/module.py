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

    What forward keeps for backward goes through :meth:`save_for_backward` and
    :meth:`saved`, not plain attributes: a pipeline keeps several microbatches in
    flight and swaps that state per microbatch (:meth:`stash_saved`,
    :meth:`restore_saved`). Layers with parameters may also split backward in two
    (:meth:`backward_input` now, :meth:`backward_weight` later), which is what
    zero-bubble pipeline schedules need.
    """

    _parameters: dict[str, Parameter]
    _buffers: dict[str, np.ndarray]
    _modules: dict[str, Module]
    _saved: dict[str, Any]
    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_saved", {})
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

    # --- what forward keeps for backward -------------------------------------------------

    def save_for_backward(self, **values: Any) -> None:
        """Keep arrays that backward will need (the input, a mask), by name."""
        self._saved.update(values)

    def saved(self, name: str) -> Any:
        """Return what forward (or :meth:`backward_input`) kept under ``name``.

        Raises:
            RuntimeError: Nothing was kept: backward before forward.

        """
        try:
            return self._saved[name]
        except KeyError:
            raise RuntimeError(f"{type(self).__name__}: backward called before forward (nothing saved as "
                               f"{name!r})") from None

    def stash_saved(self) -> dict[Module, dict[str, Any]]:
        """Take what this module and its descendants keep for backward, leaving them empty.

        Returns:
            The state, to give back to :meth:`restore_saved` before this forward's backward.

        """
        state = {}
        for module in self.modules():
            state[module] = module._saved
            object.__setattr__(module, "_saved", {})
        return state

    def restore_saved(self, state: dict[Module, dict[str, Any]]) -> None:
        """Put back what :meth:`stash_saved` took, so backward sees that forward's arrays."""
        for module, saved in state.items():
            object.__setattr__(module, "_saved", saved)

    # --- split backward (zero-bubble pipelines) --------------------------------------

    @property
    def splits_backward(self) -> bool:
        """Whether :meth:`backward_input` and :meth:`backward_weight` work here.

        True by default for modules without parameters (their backward is all
        input gradient); layers with parameters say so by overriding both methods.
        """
        return next(self.parameters(), None) is None

    def backward_input(self, grad_output: np.ndarray) -> np.ndarray:
        """Return the gradient with respect to the input only; keep what :meth:`backward_weight` needs.

        Raises:
            NotImplementedError: The module has parameters and does not split its backward.

        """
        if not self.splits_backward:
            raise NotImplementedError(
                f"{type(self).__name__} has parameters and does not split its backward: define backward_input "
                f"and backward_weight (see ferro.nn.Linear), or use a schedule without zero bubble")
        return self.backward(grad_output)

    def backward_weight(self) -> None:
        """Add the parameters' gradients of the forward whose :meth:`backward_input` ran last.

        Raises:
            NotImplementedError: The module has parameters and does not split its backward.

        """
        if not self.splits_backward:
            raise NotImplementedError(f"{type(self).__name__} has parameters and does not split its backward")

    def modules(self) -> Iterator[Module]:
        """Yield this module, then every descendant, depth first."""
        yield self
        for child in self.children():
            yield from child.modules()

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """Yield ``(dotted name, parameter)`` for this module's parameters, then its children's."""
        for name, param in self._parameters.items():
            yield prefix + name, param
        for name, module in self._modules.items():
            yield from module.named_parameters(f"{prefix}{name}.")

    def register_buffer(self, name: str, value: np.ndarray) -> np.ndarray:
        """Keep an array that is state but not trained (running statistics): saved in :meth:`state_dict`.

        Returns:
            ``value``, which the module updates in place.

        """
        self._buffers[name] = value
        object.__setattr__(self, name, value)
        return value

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(dotted name, array)`` for this module's buffers, then its children's."""
        for name, value in self._buffers.items():
            yield prefix + name, value
        for name, module in self._modules.items():
            yield from module.named_buffers(f"{prefix}{name}.")

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
        """Return copies of every parameter's values, then every buffer's, by dotted name."""
        state = {name: param.data.copy() for name, param in self.named_parameters()}
        state.update((name, value.copy()) for name, value in self.named_buffers())
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Copy values into the existing parameters and buffers in place.

        Raises:
            KeyError: A parameter or buffer is missing from ``state``.
            ValueError: A shape differs.

        """
        targets = [(name, param.data) for name, param in self.named_parameters()] + list(self.named_buffers())
        for name, target in targets:
            value = np.asarray(state[name])
            if value.shape != target.shape:
                raise ValueError(f"load_state_dict: {name} has shape {target.shape}, the state has {value.shape}")
            target[...] = value
