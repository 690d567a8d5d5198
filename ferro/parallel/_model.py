"""How the parallel wrappers reach into a model, whatever framework it is written in.

DDP (and, later, FSDP, pipeline stages and SyncBatchNorm) never touch a model's
parameters directly: they go through a :class:`Model` adapter, one for
:mod:`ferro.nn` modules (NumPy) and one for ``torch.nn.Module``. An adapter says
which parameters train, allocates flat buffers of their dtype, points a
parameter's gradient into such a buffer, and registers gradient-ready hooks.
torch is imported only when the module is a torch module.
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Model", "NumpyModel", "TorchModel", "is_torch_module", "model_adapter"]


class Model(abc.ABC):
    """A model as the parallel wrappers see it."""

    module: Any

    @abc.abstractmethod
    def trainable(self) -> list[Any]:
        """Return the parameters that require gradients, in definition order."""

    @abc.abstractmethod
    def every_array(self) -> list[Any]:
        """Return every parameter's data and (torch) buffer: what ranks must hold alike."""

    @abc.abstractmethod
    def new_buffer(self, like: Any, count: int) -> Any:
        """Return a zeroed flat buffer of ``count`` elements of ``like``'s dtype."""

    @abc.abstractmethod
    def dtype_key(self, param: Any) -> str:
        """Return a key that groups parameters of one dtype."""

    @abc.abstractmethod
    def size(self, param: Any) -> int:
        """Return the parameter's number of elements."""

    @abc.abstractmethod
    def itemsize(self, param: Any) -> int:
        """Return the bytes per element of the parameter."""

    @abc.abstractmethod
    def attach(self, param: Any, buffer: Any, offset: int) -> None:
        """Make the parameter's gradient a view into ``buffer`` at ``offset`` (keeping its current value)."""

    @abc.abstractmethod
    def hook(self, param: Any, fn: Callable[[Any], None]) -> None:
        """Call ``fn(param)`` each time the parameter's gradient is ready."""


class NumpyModel(Model):
    """A ferro.nn module: NumPy parameters whose ``.grad`` may be a view into a flat buffer."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def trainable(self) -> list[Any]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def every_array(self) -> list[Any]:
        return [p.data for p in self.module.parameters()]

    def new_buffer(self, like: Any, count: int) -> Any:
        return np.zeros(count, like.data.dtype)

    def dtype_key(self, param: Any) -> str:
        return str(param.data.dtype)

    def size(self, param: Any) -> int:
        return int(param.data.size)

    def attach(self, param: Any, buffer: Any, offset: int) -> None:
        view = buffer[offset:offset + param.data.size].reshape(param.data.shape)
        if param.grad is not None:
            view[...] = param.grad
        param.grad = view

    def hook(self, param: Any, fn: Callable[[Any], None]) -> None:
        param.register_grad_ready_hook(fn)

    def itemsize(self, param: Any) -> int:
        return int(param.data.itemsize)


class TorchModel(Model):
    """A torch.nn.Module on the CPU (tensors reach the core zero-copy through NumPy)."""

    def __init__(self, module: Any) -> None:
        import torch

        self.module, self.torch = module, torch

    def trainable(self) -> list[Any]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def every_array(self) -> list[Any]:
        return [p.detach() for p in self.module.parameters()] + [b for b in self.module.buffers()]

    def new_buffer(self, like: Any, count: int) -> Any:
        return self.torch.zeros(count, dtype=like.dtype)

    def dtype_key(self, param: Any) -> str:
        return str(param.dtype)

    def size(self, param: Any) -> int:
        return int(param.numel())

    def attach(self, param: Any, buffer: Any, offset: int) -> None:
        view = buffer[offset:offset + param.numel()].view(param.shape)
        if param.grad is not None:
            view.copy_(param.grad)
        param.grad = view

    def hook(self, param: Any, fn: Callable[[Any], None]) -> None:
        param.register_post_accumulate_grad_hook(fn)

    def itemsize(self, param: Any) -> int:
        return int(param.element_size())


def model_adapter(module: Any) -> Model:
    """Return the adapter for ``module``: :class:`TorchModel` for a ``torch.nn.Module``, else :class:`NumpyModel`."""
    return TorchModel(module) if is_torch_module(module) else NumpyModel(module)


def is_torch_module(module: Any) -> bool:
    torch = sys.modules.get("torch")  # a torch module exists only if torch was imported
    return torch is not None and isinstance(module, torch.nn.Module)
