"""How FSDP handles one framework's arrays: ferro.nn (NumPy) or torch (CPU tensors).

FSDP's schedule (:mod:`ferro.parallel.fsdp.api`) is framework-free; everything
that allocates, casts, frees or installs a parameter goes through an adapter
here. Collectives see NumPy arrays (for torch, raw views of tensor storage: a
gathered buffer must not go through ``Tensor.numpy()``, which pins the storage
and would forbid freeing it, nor through torch's in-place ops, which would bump
the version counter that autograd checks on the views saved for backward).
"""

from __future__ import annotations

import abc
import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from ferro._buffers import torch_view
from ferro.errors import ConfigurationError
from ferro.parallel.fsdp.flat import FlatGroup

__all__ = ["NumpyTensors", "Tensors", "TorchTensors", "tensors_for"]


class Tensors(abc.ABC):
    """One framework's side of FSDP."""

    # --- the module tree ----------------------------------------------------------------

    @abc.abstractmethod
    def named_modules(self, root: Any) -> list[tuple[str, Any]]:
        """Return ``(dotted name, module)`` for the root and every descendant, parents first."""

    @abc.abstractmethod
    def direct_params(self, module: Any) -> list[tuple[str, Any]]:
        """Return the parameters registered on ``module`` itself, as ``(attribute, parameter)``."""

    @abc.abstractmethod
    def describe(self, param: Any) -> tuple[Any, bool, tuple[int, ...]]:
        """Return the parameter's ``(dtype, requires_grad, shape)``."""

    @abc.abstractmethod
    def values(self, param: Any) -> np.ndarray:
        """Return the parameter's values as a NumPy array (a view where possible)."""

    @abc.abstractmethod
    def array_of(self, value: Any) -> np.ndarray:
        """Return a state-dict value (an array or a tensor) as a NumPy array, zero-copy where possible."""

    @abc.abstractmethod
    def unregister(self, module: Any, attr: str, param: Any) -> None:
        """Take the parameter off the module: from now on FSDP installs its values there."""

    # --- shards ---------------------------------------------------------------------

    @abc.abstractmethod
    def make_shard(self, values: np.ndarray, dtype: Any, requires_grad: bool) -> Any:
        """Return the persistent shard parameter of ``dtype`` holding a copy of ``values``."""

    @abc.abstractmethod
    def shard_array(self, shard: Any) -> np.ndarray:
        """Return a NumPy view of the shard's values (valid while the shard lives)."""

    @abc.abstractmethod
    def shard_slice(self, shard: Any, start: int, stop: int) -> Any:
        """Return a view of the shard's elements ``[start, stop)`` in the framework's type."""

    @abc.abstractmethod
    def wrap(self, array: np.ndarray, dtype: Any) -> Any:
        """Return ``array`` (as :meth:`values` gives them for ``dtype``) in the framework's type, zero-copy."""

    @abc.abstractmethod
    def resolve_dtype(self, dtype: Any, default: Any) -> Any:
        """Return the framework's dtype for a :class:`~ferro.MixedPrecision` field (None: ``default``)."""

    @abc.abstractmethod
    def same_dtype(self, a: Any, b: Any) -> bool:
        """Whether two dtypes of this framework are the same."""

    # --- the gathered vector --------------------------------------------------------

    @abc.abstractmethod
    def prepare(self, group: FlatGroup, on_grad: Callable[[FlatGroup], None]) -> None:
        """Set the group up once (torch: the autograd leaf whose gradient is the gathered gradient)."""

    @abc.abstractmethod
    def gather_buffers(self, group: FlatGroup) -> tuple[np.ndarray, np.ndarray]:
        """Allocate the gathered vector; return ``(this shard in the compute dtype, the vector)`` as bytes."""

    @abc.abstractmethod
    def alias(self, group: FlatGroup) -> None:
        """Unshard without communication (a group of one shard): the vector is the shard, cast if needed."""

    @abc.abstractmethod
    def free(self, group: FlatGroup) -> None:
        """Release the gathered vector's memory."""

    @abc.abstractmethod
    def install(self, group: FlatGroup) -> None:
        """Point every parameter's place in the module at its part of the gathered vector."""

    @abc.abstractmethod
    def uninstall(self, group: FlatGroup) -> None:
        """Put empty placeholders where the parameters were (their memory is about to go)."""

    # --- gradients ------------------------------------------------------------------

    @abc.abstractmethod
    def begin_backward(self, group: FlatGroup) -> None:
        """Get the group ready to receive gradients (ferro.nn: a zeroed buffer the parameters' grads view)."""

    @abc.abstractmethod
    def take_grad(self, group: FlatGroup) -> Any:
        """Return the gathered gradient in the reduce dtype (or None) and let go of the group's reference."""

    @abc.abstractmethod
    def add_grad(self, shard: Any, reduced: Any) -> None:
        """Add the reduced gradient (this shard's part) into the shard's ``.grad``, in the shard's dtype."""

    @abc.abstractmethod
    def cast_inputs(self, args: tuple[Any, ...], dtype: Any) -> tuple[Any, ...]:
        """Cast floating-point arrays in ``args`` to ``dtype``."""

    @abc.abstractmethod
    def optimizer_state(self, optimizer: Any) -> dict[Any, dict[str, Any]]:
        """Return the optimizer's per-parameter state: ``{parameter: {name: value}}``."""

    @abc.abstractmethod
    def init_optimizer_state(self, optimizer: Any, params: list[Any]) -> None:
        """Make the optimizer create its state for ``params`` without changing them (a step at learning rate 0)."""

    def ensure_optimizer_state(self, optimizer: Any, params: list[Any]) -> dict[Any, dict[str, Any]]:
        """Return the optimizer's per-parameter state, creating it first if none of ``params`` has any.

        A fresh optimizer gets its state from one step at learning rate 0, as torch's DCP does, so a
        checkpoint can be loaded into it.
        """
        state = self.optimizer_state(optimizer)
        if not any(state.get(param) for param in params):
            self.init_optimizer_state(optimizer, params)
            state = self.optimizer_state(optimizer)
        return state



class NumpyTensors(Tensors):
    """ferro.nn: parameters are :class:`ferro.nn.Parameter` objects whose ``.data`` FSDP points at views."""

    def named_modules(self, root: Any) -> list[tuple[str, Any]]:
        found: list[tuple[str, Any]] = []

        def walk(module: Any, prefix: str) -> None:
            found.append((prefix, module))
            for name, child in module._modules.items():
                walk(child, f"{prefix}.{name}" if prefix else name)

        walk(root, "")
        return found

    def direct_params(self, module: Any) -> list[tuple[str, Any]]:
        return list(module._parameters.items())

    def describe(self, param: Any) -> tuple[Any, bool, tuple[int, ...]]:
        return param.data.dtype, bool(param.requires_grad), tuple(param.data.shape)

    def values(self, param: Any) -> np.ndarray:
        return param.data

    def array_of(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    def unregister(self, module: Any, attr: str, param: Any) -> None:
        pass  # the Parameter object stays; FSDP swaps its .data

    def make_shard(self, values: np.ndarray, dtype: Any, requires_grad: bool) -> Any:
        from ferro.nn import Parameter

        return Parameter(values.astype(dtype, copy=True), requires_grad=requires_grad)

    def shard_array(self, shard: Any) -> np.ndarray:
        return shard.data

    def shard_slice(self, shard: Any, start: int, stop: int) -> Any:
        return shard.data[start:stop]

    def wrap(self, array: np.ndarray, dtype: Any) -> Any:
        return array

    def resolve_dtype(self, dtype: Any, default: Any) -> Any:
        if dtype is None:
            return default
        if isinstance(dtype, str) and dtype == "bfloat16":
            try:
                import ml_dtypes
            except ImportError as exc:
                raise ConfigurationError("MixedPrecision: bfloat16 with ferro.nn needs ml_dtypes: "
                                         "pip install ml_dtypes") from exc
            return np.dtype(ml_dtypes.bfloat16)
        try:
            return np.dtype(dtype)
        except TypeError as exc:
            raise ConfigurationError(f"MixedPrecision: {dtype!r} is not a NumPy dtype (a ferro.nn model "
                                     f"computes in NumPy)") from exc

    def same_dtype(self, a: Any, b: Any) -> bool:
        return np.dtype(a) == np.dtype(b)

    def prepare(self, group: FlatGroup, on_grad: Callable[[FlatGroup], None]) -> None:
        pass  # ferro.nn's backward is explicit: FSDP calls the reduction itself

    def gather_buffers(self, group: FlatGroup) -> tuple[np.ndarray, np.ndarray]:
        group.full = np.empty(group.padded, group.compute_dtype)
        source = group.shard.data.astype(group.compute_dtype, copy=False)
        return source.view(np.uint8), group.full.view(np.uint8)

    def alias(self, group: FlatGroup) -> None:
        group.full = group.shard.data.astype(group.compute_dtype, copy=False)  # the shard itself when alike

    def free(self, group: FlatGroup) -> None:
        group.full = None

    def install(self, group: FlatGroup) -> None:
        full = group.full
        for slot in group.slots:
            view = full[slot.offset:slot.offset + slot.numel].reshape(slot.shape)
            for module, attr in slot.places:
                getattr(module, attr).data = view

    def uninstall(self, group: FlatGroup) -> None:
        empty = np.empty(0, group.compute_dtype)
        for slot in group.slots:
            for module, attr in slot.places:
                param = getattr(module, attr)
                param.data, param.grad = empty, None

    def begin_backward(self, group: FlatGroup) -> None:
        if not group.requires_grad or group.grad_full is not None:
            return
        group.grad_full = np.zeros(group.padded, group.compute_dtype)
        for slot in group.slots:
            view = group.grad_full[slot.offset:slot.offset + slot.numel].reshape(slot.shape)
            for module, attr in slot.places:
                getattr(module, attr).grad = view

    def take_grad(self, group: FlatGroup) -> Any:
        grad, group.grad_full = group.grad_full, None
        for slot in group.slots:
            for module, attr in slot.places:
                getattr(module, attr).grad = None
        return None if grad is None else grad.astype(group.reduce_dtype, copy=False)

    def add_grad(self, shard: Any, reduced: Any) -> None:
        values = np.asarray(reduced).reshape(-1).astype(shard.data.dtype, copy=False)
        if shard.grad is None:
            shard.grad = values.copy()
        else:
            shard.grad += values

    def cast_inputs(self, args: tuple[Any, ...], dtype: Any) -> tuple[Any, ...]:
        return tuple(a.astype(dtype, copy=False) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a
                     for a in args)

    def optimizer_state(self, optimizer: Any) -> dict[Any, dict[str, Any]]:
        state = getattr(optimizer, "state", None)
        if not isinstance(state, dict):
            raise ConfigurationError(f"FSDP: {type(optimizer).__name__} keeps no per-parameter `state` dict; "
                                     f"optimizer state dicts need one (ferro.nn.SGD and Adam have it)")
        return state

    def init_optimizer_state(self, optimizer: Any, params: list[Any]) -> None:
        missing = [p for p in params if p.grad is None]
        for param in missing:
            param.grad = np.zeros_like(param.data)
        lr = optimizer.lr
        optimizer.lr = 0.0  # every update is lr times something finite: the parameters stay as they are
        try:
            optimizer.step()
        finally:
            optimizer.lr = lr
            for param in missing:
                param.grad = None


def _raw_bytes(tensor: Any) -> np.ndarray:
    """Return a NumPy byte view of a tensor's elements that leaves its storage resizable and its version alone.

    Valid only while the storage keeps its current allocation: FSDP takes it just
    before a collective and keeps the storage until that collective has ended.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(tensor.data_ptr()), np.uint8)


class TorchTensors(Tensors):
    """torch: parameters become plain tensors, views of an autograd leaf that holds the gathered vector.

    Gradients of every view flow into that leaf; its post-accumulate hook is the
    unit's "gradients ready" signal. Resharding frees the leaf's storage in place
    (``resize_(0)``), so the views autograd saved for backward see the values
    again once backward gathers them back into the same storage.
    """

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def named_modules(self, root: Any) -> list[tuple[str, Any]]:
        return list(root.named_modules(remove_duplicate=False))

    def direct_params(self, module: Any) -> list[tuple[str, Any]]:
        return [(name, p) for name, p in module._parameters.items() if p is not None]

    def describe(self, param: Any) -> tuple[Any, bool, tuple[int, ...]]:
        if param.device.type != "cpu":
            raise ConfigurationError(f"FSDP: a parameter is on {param.device}; ferro's FSDP shards CPU tensors "
                                     f"(move the module to the CPU)")
        return param.dtype, bool(param.requires_grad), tuple(param.shape)

    def values(self, param: Any) -> np.ndarray:
        return self.array_of(param.detach().contiguous()).copy()

    def array_of(self, value: Any) -> np.ndarray:
        # bfloat16 comes back as same-width integers: FSDP only moves and slices these bytes.
        return torch_view(value, "FSDP")[0]

    def unregister(self, module: Any, attr: str, param: Any) -> None:
        del module._parameters[attr]
        setattr(module, attr, self.torch.empty(0, dtype=param.dtype))

    def make_shard(self, values: np.ndarray, dtype: Any, requires_grad: bool) -> Any:
        return self.torch.nn.Parameter(self.wrap(values.copy(), dtype), requires_grad=requires_grad)

    def shard_array(self, shard: Any) -> np.ndarray:
        return self.array_of(shard)  # shards are never resized, so pinning their storage is harmless

    def shard_slice(self, shard: Any, start: int, stop: int) -> Any:
        return shard.detach()[start:stop]

    def wrap(self, array: np.ndarray, dtype: Any) -> Any:
        tensor = self.torch.from_numpy(array)
        return tensor.view(dtype) if tensor.dtype != dtype else tensor  # bfloat16 travels as its bits

    def resolve_dtype(self, dtype: Any, default: Any) -> Any:
        if dtype is None:
            return default
        if not isinstance(dtype, self.torch.dtype):
            raise ConfigurationError(f"MixedPrecision: {dtype!r} is not a torch.dtype (a torch model computes "
                                     f"in torch: use torch.bfloat16, torch.float16, ...)")
        return dtype

    def same_dtype(self, a: Any, b: Any) -> bool:
        return bool(a == b)

    def prepare(self, group: FlatGroup, on_grad: Callable[[FlatGroup], None]) -> None:
        torch = self.torch
        aliased = group.shard_size == 1 and group.compute_dtype == group.shard.dtype
        leaf = group.shard.detach() if aliased else torch.empty(group.padded, dtype=group.compute_dtype)
        if not aliased:
            leaf.untyped_storage().resize_(0)  # allocated only while gathered
        leaf.requires_grad_(group.requires_grad)
        if group.requires_grad:
            leaf.register_post_accumulate_grad_hook(lambda _leaf: on_grad(group))
        group.extra["leaf"], group.extra["aliased"] = leaf, aliased

    def _allocate(self, group: FlatGroup) -> Any:
        leaf = group.extra["leaf"]
        storage = leaf.untyped_storage()
        needed = group.padded * leaf.element_size()
        if storage.nbytes() != needed:
            storage.resize_(needed)
        return leaf

    def gather_buffers(self, group: FlatGroup) -> tuple[np.ndarray, np.ndarray]:
        leaf = self._allocate(group)
        source = group.shard.detach()
        if source.dtype != group.compute_dtype:
            source = source.to(group.compute_dtype)
            group.extra["source"] = source  # the bytes below must outlive the collective
        group.full = leaf
        return _raw_bytes(source), _raw_bytes(leaf)

    def alias(self, group: FlatGroup) -> None:
        leaf = group.extra["leaf"]
        if not group.extra["aliased"]:
            self._allocate(group)
            with self.torch.no_grad():
                leaf.data.copy_(group.shard.detach())  # .data: no version bump on the leaf autograd sees
        group.full = leaf

    def free(self, group: FlatGroup) -> None:
        group.extra.pop("source", None)
        if not group.extra["aliased"]:
            group.extra["leaf"].untyped_storage().resize_(0)
        group.full = None

    def install(self, group: FlatGroup) -> None:
        leaf = group.extra["leaf"]
        for slot in group.slots:
            view = leaf[slot.offset:slot.offset + slot.numel].view(slot.shape)  # tracked: grads reach the leaf
            for module, attr in slot.places:
                setattr(module, attr, view)

    def uninstall(self, group: FlatGroup) -> None:
        empty = self.torch.empty(0, dtype=group.compute_dtype)
        for slot in group.slots:
            for module, attr in slot.places:
                setattr(module, attr, empty)

    def begin_backward(self, group: FlatGroup) -> None:
        pass  # autograd accumulates into the leaf's .grad

    def take_grad(self, group: FlatGroup) -> Any:
        leaf = group.extra["leaf"]
        grad, leaf.grad = leaf.grad, None
        if grad is None:
            return None
        return grad.to(group.reduce_dtype) if grad.dtype != group.reduce_dtype else grad

    def add_grad(self, shard: Any, reduced: Any) -> None:
        values = reduced.reshape(-1).to(shard.dtype)  # the reduction's own result: ours to keep
        if shard.grad is None:
            shard.grad = values
        else:
            shard.grad += values

    def cast_inputs(self, args: tuple[Any, ...], dtype: Any) -> tuple[Any, ...]:
        torch = self.torch
        return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)

    def optimizer_state(self, optimizer: Any) -> dict[Any, dict[str, Any]]:
        return optimizer.state

    def init_optimizer_state(self, optimizer: Any, params: list[Any]) -> None:
        torch = self.torch
        missing = [p for p in params if p.grad is None]
        for param in missing:
            param.grad = torch.zeros_like(param)
        rates = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = 0.0  # as torch.distributed.checkpoint initialises optimizer state
        try:
            optimizer.step()
        finally:
            for group, lr in zip(optimizer.param_groups, rates, strict=True):
                group["lr"] = lr
            for param in missing:
                param.grad = None


def tensors_for(module: Any) -> Tensors:
    """Return the adapter for ``module``: torch's for a ``torch.nn.Module``, else ferro.nn's."""
    from ferro.parallel._model import is_torch_module

    return TorchTensors() if is_torch_module(module) else NumpyTensors()


def named_param_groups(optimizer: Any, names: dict[int, list[str]]) -> list[dict[str, Any]]:
    """Return the optimizer's parameter groups with their settings and, for parameters, names.

    Args:
        optimizer: A torch optimizer (``param_groups``) or a ferro.nn one (one group, ``params``).
        names: Parameter names by ``id`` of the object the optimizer holds (an FSDP shard has several).

    """
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:  # ferro.nn: one group
        return [{"params": [name for p in getattr(optimizer, "params", []) for name in names.get(id(p), [])]}]
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [name for p in g["params"] for name in names.get(id(p), [])]} for g in groups]
