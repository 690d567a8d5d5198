"""Fully sharded data parallelism: each rank keeps 1/N of the model state and gathers a unit only to compute.

A *unit* is the root module or a submodule the ``auto_wrap_policy`` selected;
it owns the parameters registered on it and on descendants no deeper unit
owns. Per unit and dtype its parameters lie end to end in one flat vector,
padded so every rank's shard has the same length (:mod:`.flat`). A rank keeps
only its shard: the persistent parameter the optimizer sees.

One step of ``FULL_SHARD`` with U units: forward all-gathers each unit just
before it runs and frees it after (U all-gathers); backward gathers it again
just before its gradients are computed (U more), then reduce-scatters the
gradient onto the shards' ``.grad`` (U reduce-scatters) and frees it. With
``forward_prefetch``, the next unit's all-gather is issued (async, on the
group's worker) before the current unit computes, in backward the previous
unit's, so communication hides behind compute with at most two units gathered.

Every gather carries a tag made of the unit and its position in the step
(``ferro.all_gather(..., tag=)``): a rank that skips a unit, or runs units in
another order, meets a different tag and every rank raises
:class:`~ferro.CollectiveMismatchError` naming the units, never pairing the
wrong bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ferro.backend.base import Backend
from ferro.collective import broadcast
from ferro.errors import ConfigurationError
from ferro.parallel.fsdp import state_dict as layout
from ferro.parallel.fsdp._tensors import Tensors, TorchTensors, tensors_for
from ferro.parallel.fsdp.flat import FlatGroup, Slot
from ferro.parallel.fsdp.options import MixedPrecision, ShardingStrategy
from ferro.parallel.fsdp.state_dict import dtype_of
from ferro.parallel.fsdp.step import StepHooks
from ferro.parallel.fsdp.unit import Unit

__all__ = ["FSDP"]

class FSDP:
    """Fully sharded data parallelism for ``ferro.nn`` modules and ``torch.nn.Module`` (CPU).

    Each rank keeps only its shard of every parameter, gradient and optimizer
    state; a unit's full parameters exist only while it computes. Build the
    optimizer on :meth:`parameters` after wrapping: it sees the shards (flat
    1-d parameters), and they stay the same objects for the life of the wrapper.

    Args:
        module: The model. Its parameters are moved into FSDP's shards; read the
            full values with :meth:`full_state_dict`.
        group: The process group (default: the default group). Ignored when
            ``device_mesh`` is given.
        device_mesh: A 1-d mesh to shard over, or for ``HYBRID_SHARD`` a 2-d mesh
            with dimensions ``(replicate, shard)``.
        sharding_strategy: A :class:`ShardingStrategy` or its name (``"full_shard"``).
        auto_wrap_policy: ``policy(module) -> bool`` selecting the submodules that
            become units (see :func:`size_based_policy`); None: the root is the only unit.
        reshard_after_forward: Free gathered parameters after a unit's forward
            (``FULL_SHARD`` and ``HYBRID_SHARD``); False keeps them until backward.
        forward_prefetch: Issue the next unit's all-gather before the current one
            computes (and in backward, the previous unit's).
        mixed_precision: Compute and reduce in narrower dtypes (:class:`MixedPrecision`).
        sync_module_states: Start every rank from rank 0's parameter values.

    Example::

        model = ferro.FSDP(torch_model, auto_wrap_policy=lambda m: isinstance(m, torch.nn.Linear))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        loss = criterion(model(x), y)          # x, y: this rank's share of the batch
        optimizer.zero_grad()
        loss.backward()                        # reduce-scatters each unit's gradients as they are ready
        optimizer.step()                       # updates this rank's shards
        # ferro.nn: model.backward(criterion.backward()) in place of loss.backward()

    Raises:
        ConfigurationError: No group, a mesh of the wrong shape for the strategy, a
            module without parameters, or a torch parameter off the CPU.
        ValueError: An unknown strategy.

    """

    def __init__(self, module: Any, group: Backend | None = None, *, device_mesh: Any = None,
                 sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
                 auto_wrap_policy: Callable[[Any], bool] | None = None, reshard_after_forward: bool = True,
                 forward_prefetch: bool = True, mixed_precision: MixedPrecision | None = None,
                 sync_module_states: bool = True) -> None:
        self.module = module
        self.sharding_strategy = ShardingStrategy.of(sharding_strategy)
        self.forward_prefetch = bool(forward_prefetch)
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.group, self.shard_group, self.replicate_group = self._groups(group, device_mesh)
        self._reshard_after_forward = (self.sharding_strategy in (ShardingStrategy.FULL_SHARD,
                                                                  ShardingStrategy.HYBRID_SHARD)
                                       and bool(reshard_after_forward))
        self._tensors: Tensors = tensors_for(module)
        self._torch: Any = self._tensors.torch if isinstance(self._tensors, TorchTensors) else None  # or None
        self._step = StepHooks(self)  # before the units: their gradients report to it
        self.units = self._build_units(auto_wrap_policy, sync_module_states)
        if not self.units:
            raise ConfigurationError("FSDP: the module has no parameters to shard")
        self._comm = self.shard_group if self._shard_size > 1 else self.replicate_group
        self._unit_of = {id(group): unit for unit in self.units for group in unit.groups}
        self._step.install()

    # --- set-up ---------------------------------------------------------------------------

    def _groups(self, group: Backend | None, mesh: Any) -> tuple[Backend, Backend | None, Backend | None]:
        from ferro.collective.resolve import resolve_group

        strategy = self.sharding_strategy
        if strategy is ShardingStrategy.HYBRID_SHARD:
            if mesh is None or mesh.ndim != 2:
                raise ConfigurationError("FSDP: HYBRID_SHARD needs a 2-d device_mesh with dimensions "
                                         "(replicate, shard): ferro.init_device_mesh((replicas, shards))")
            return mesh.group, mesh.get_group(1), mesh.get_group(0)
        if mesh is not None:
            if mesh.ndim != 1:
                raise ConfigurationError(f"FSDP: a {mesh.ndim}-d device_mesh needs sharding_strategy=HYBRID_SHARD; "
                                         f"{strategy.name} shards over a 1-d mesh")
            base = mesh.get_group(0)
        else:
            base = resolve_group(group, "FSDP")
        if strategy is ShardingStrategy.NO_SHARD:
            return base, None, base
        return base, base, None

    @property
    def _shard_size(self) -> int:
        return self.shard_group.world_size if self.shard_group is not None else 1

    def _build_units(self, policy: Callable[[Any], bool] | None, sync: bool) -> list[Unit]:
        tensors = self._tensors
        named = tensors.named_modules(self.module)
        selected = [name for name, module in named[1:] if policy is not None and policy(module)]
        # The owner of a module's parameters: the deepest selected module containing it.
        def owner(name: str) -> str:
            best = ""
            for unit_name in selected:
                if (name == unit_name or name.startswith(unit_name + ".")) and len(unit_name) > len(best):
                    best = unit_name
            return best

        slots_of: dict[str, list[tuple[Slot, Any]]] = {name: [] for name in [""] + selected}
        seen: dict[int, Slot] = {}
        for module_name, module in named:
            for attr, param in tensors.direct_params(module):
                if id(param) in seen:  # shared: one slot, installed in every place
                    seen[id(param)].places.append((module, attr))
                    continue
                fqn = f"{module_name}.{attr}" if module_name else attr
                slot = Slot(fqn, [(module, attr)], tensors.describe(param)[2], 0)
                seen[id(param)] = slot
                slots_of[owner(module_name)].append((slot, param))
        self._fqns = [slot.fqn for slot in seen.values()]
        modules = dict(named)
        units: list[Unit] = []
        for name in [""] + selected:
            groups = self._flat_groups(slots_of[name], sync)
            if groups:
                keeps = self._shard_size == 1 and all(
                    self._tensors.same_dtype(g.compute_dtype, dtype_of(g.shard)) for g in groups)
                units.append(Unit(len(units), name, modules[name], groups, keeps_gathered=keeps))
        return units

    def _flat_groups(self, members: list[tuple[Slot, Any]], sync: bool) -> list[FlatGroup]:
        tensors = self._tensors
        by_key: dict[tuple[str, bool], list[tuple[Slot, Any]]] = {}
        for slot, param in members:
            dtype, requires_grad, _ = tensors.describe(param)
            by_key.setdefault((str(dtype), requires_grad), []).append((slot, param))
        shard_rank = self.shard_group.rank if self.shard_group is not None else 0
        groups = []
        for (_, requires_grad), entries in by_key.items():
            offset = 0
            for slot, _param in entries:
                slot.offset = offset
                offset += slot.numel
            dtype = tensors.describe(entries[0][1])[0]
            group = FlatGroup([slot for slot, _ in entries], self._shard_size, shard_rank, requires_grad)
            values = [tensors.values(param) for _, param in entries]
            flat = np.zeros(group.padded, values[0].dtype)
            for slot, value in zip(group.slots, values, strict=True):
                flat[slot.offset:slot.offset + slot.numel] = value.reshape(-1)
            if sync and self.group.world_size > 1:
                broadcast(flat, root=0, group=self.group)
            group.shard = tensors.make_shard(flat[group.start:group.start + group.shard_len], dtype, requires_grad)
            group.compute_dtype = tensors.resolve_dtype(self.mixed_precision.param_dtype, dtype)
            group.reduce_dtype = tensors.resolve_dtype(self.mixed_precision.reduce_dtype, group.compute_dtype)
            for slot, param in entries:
                for module, attr in slot.places:
                    tensors.unregister(module, attr, param)
            tensors.prepare(group, self._step.on_grad)
            tensors.uninstall(group)
            groups.append(group)
        return groups

    # --- public -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's forward (gathering each unit as it runs)."""
        self._step.begin()
        output = self.module(*args, **kwargs)
        if self._torch and self._torch.is_grad_enabled():
            self._step.hook_outputs(output, self._step.queue_finish)
        return output

    forward = __call__

    def backward(self, grad_output: Any) -> Any:
        """ferro.nn: run the module's backward, reduce-scatter every unit's gradients, and wait for them.

        Returns:
            The gradient with respect to the module's input.

        Raises:
            ConfigurationError: A torch module (call ``loss.backward()``).

        """
        if self._torch:
            raise ConfigurationError("FSDP.backward is for ferro.nn modules; with torch, call loss.backward()")
        try:
            grad_input = self.module.backward(grad_output)
        except BaseException:
            self._step.reduces = []
            self._step.settle()
            raise
        self._step.finish_backward()
        return grad_input

    def parameters(self) -> list[Any]:
        """Return this rank's shards: one flat 1-d parameter per unit and dtype (give these to the optimizer)."""
        return [group.shard for unit in self.units for group in unit.groups]

    def named_parameters(self) -> list[tuple[str, Any]]:
        """Return ``(name, shard)`` pairs, named ``"<unit>.flat_param.<i>"``."""
        return [(f"{unit.name + '.' if unit.name else ''}flat_param.{i}", group.shard)
                for unit in self.units for i, group in enumerate(unit.groups)]

    def train(self, mode: bool = True) -> FSDP:
        """Set the wrapped module's training mode; return self."""
        self.module.train(mode)
        return self

    def eval(self) -> FSDP:
        """Set the wrapped module to evaluation mode; return self."""
        return self.train(False)

    def comm_stats(self) -> dict[str, float]:
        """Return FSDP's communication timing since it was made.

        ``all_gather_seconds``: time the worker spent in unit all-gathers;
        ``all_gather_wait_seconds``: time computation stood waiting for them;
        ``hidden_fraction``: the share of all-gather time that overlapped compute;
        ``all_gathers``: unit gathers issued; ``peak_unsharded_units``: most units
        gathered at once.
        """
        stats = dict(self._step.stats)
        spent = stats["all_gather_seconds"]
        stats["hidden_fraction"] = max(0.0, 1.0 - stats["all_gather_wait_seconds"] / spent) if spent else 0.0
        return stats

    def reset_comm_stats(self) -> None:
        """Zero :meth:`comm_stats`."""
        stats = self._step.stats
        for key in stats:
            stats[key] = 0.0 if key.endswith("seconds") else 0

    # --- membership changes (ferro.elastic) ------------------------------------------------

    def rebind(self, device_mesh: Any = None, group: Backend | None = None) -> None:
        """Run on new groups from the next step: the same layout over new connections (``ferro.elastic``).

        The shard dimension must keep its size and this rank its place in it
        (its shards stay valid); the replicate dimension may grow or shrink.
        A step that failed part-way is forgotten first: every unit goes back
        to its shard and partial gradients are dropped.

        Args:
            device_mesh: The new mesh (as given to the constructor), or None with ``group``.
            group: The new group, when the wrapper was made without a mesh.

        Raises:
            ConfigurationError: The new groups shard differently (size or this rank's place).

        """
        self._step.reset()
        whole, shard, replicate = self._groups(group, device_mesh)
        size = shard.world_size if shard is not None else 1
        place = shard.rank if shard is not None else 0
        old_place = self.shard_group.rank if self.shard_group is not None else 0
        if size != self._shard_size or place != old_place:
            raise ConfigurationError(
                f"FSDP.rebind: the new groups shard {size} ways with this rank at shard {place}; the model is "
                f"sharded {self._shard_size} ways with this rank at shard {old_place}: only the replicate dimension "
                f"may change")
        self.group, self.shard_group, self.replicate_group = whole, shard, replicate
        self._comm = self.shard_group if self._shard_size > 1 else self.replicate_group

    def local_state_dict(self) -> dict[str, Any]:
        """Return this rank's shards by :meth:`named_parameters` name: views, no communication.

        What a rank at the same shard place of another replica loads with
        :meth:`load_local_state_dict` (``ferro.elastic`` heals a replica this way).
        """
        return {name: self._shard_view(shard) for name, shard in self.named_parameters()}

    def _shard_view(self, shard: Any) -> np.ndarray:
        """Return a shard's elements as a writable NumPy view (torch: of the same memory)."""
        return self._tensors.array_of(shard.detach()) if self._torch else self._tensors.values(shard)

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Copy shards saved by :meth:`local_state_dict` (same shard place) into this rank's, in place.

        Raises:
            KeyError: A shard is missing.
            ValueError: A shard's size differs (another sharding or another model).

        """
        for name, shard in self.named_parameters():
            if name not in state:
                raise KeyError(f"FSDP.load_local_state_dict: no value for {name!r}")
            target = self._shard_view(shard)
            value = self._tensors.array_of(state[name]).reshape(-1)
            if value.size != target.size:
                raise ValueError(f"FSDP.load_local_state_dict: {name!r} holds {value.size} elements; this rank's "
                                 f"shard holds {target.size}")
            target[...] = value

    # --- state ----------------------------------------------------------------------------

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, Any]:
        """Return every parameter's full value (a copy), by its name in the unwrapped module.

        Collective: every rank must call it. torch modules' buffers are included.

        Args:
            rank0_only: Gather to rank 0 only; the other ranks get ``{}``.

        Returns:
            ``{name: array or tensor}`` in the module's parameter order.

        """
        return layout.full_state_dict(self, rank0_only)

    state_dict = full_state_dict

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Copy full parameter values into this rank's shards in place (no communication).

        The shard objects stay the same, so an optimizer made earlier stays valid.

        Raises:
            KeyError: A parameter is missing from ``state``.
            ValueError: A value's shape differs from its parameter's.

        """
        return layout.load_full_state_dict(self, state)

    def sharded_state_dict(self, *, as_dtensor: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """Return each parameter's part held by this rank, with its global shape and offsets.

        Every parameter has a :class:`ShardedEntry`; where this rank holds none of it,
        ``local`` is empty. torch modules' buffers follow, whole (every rank has them).

        Args:
            as_dtensor: Return each parameter as a ``Shard(0)`` :class:`~ferro.dtensor.DTensor`
                over the shard group instead (torch ``fully_shard``'s layout): collective, one
                all_to_all per parameter (:func:`ferro.dtensor.from_sharded_entries`).
                Without a shard group (NO_SHARD) the DTensors are ``Replicate()`` over the group.
            timeout: Seconds for that communication.

        """
        return layout.sharded_state_dict(self, as_dtensor=as_dtensor, timeout=timeout)

    def full_optim_state_dict(self, optimizer: Any, rank0_only: bool = False) -> dict[str, Any]:
        """Return the optimizer's state per full parameter, by parameter name (collective).

        Returns:
            ``{"state": {name: {"exp_avg": full array, "step": ...}}, "param_groups": [...]}``:
            per-element state gathered to the parameter's shape, scalars as they are;
            ``param_groups`` lists each optimizer group's settings and parameter names.
            With ``rank0_only``, other ranks get ``{}``.

        """
        return layout.full_optim_state_dict(self, optimizer, rank0_only)

    def sharded_optim_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """Return the optimizer's state for this rank's shards, by parameter name (no communication).

        Per-element state (Adam's ``exp_avg``, ``exp_avg_sq``, SGD's momentum) comes as
        :class:`ShardedEntry` views of the optimizer's own arrays, with the same ranges as
        :meth:`sharded_state_dict`; scalars (``step``) as they are. This is what
        :func:`ferro.checkpoint.save` stores and :func:`ferro.checkpoint.load` fills in place.
        An optimizer that has no state yet gets it first, from a step at learning rate 0
        (zero gradients; the parameters do not change), as torch's DCP does, so a fresh
        optimizer can be loaded into.

        Returns:
            ``{"state": {name: {"exp_avg": ShardedEntry, "step": ...}}, "param_groups": [...]}``.

        """
        return layout.sharded_optim_state_dict(self, optimizer)

    def load_sharded_optim_state_dict(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Give the optimizer the state in ``state``, laid out as :meth:`sharded_optim_state_dict` gives it.

        After ``ferro.checkpoint.load`` has filled a dict from :meth:`sharded_optim_state_dict`,
        the per-element state is already in place; this sets what could not be filled in
        place (scalars such as ``step``) and copies entries that are not views of the
        optimizer's arrays. No communication.

        Raises:
            KeyError: A parameter with optimizer state has no entry in ``state``.

        """
        return layout.load_sharded_optim_state_dict(self, optimizer, state)

    def load_full_optim_state_dict(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Give the optimizer its state for this rank's shards, cut from a full optimizer state dict.

        No communication: every rank passes the whole dict (as :meth:`full_optim_state_dict` returns it)
        and keeps its own part. The optimizer's settings (learning rate, ...) stay its own.
        """
        return layout.load_full_optim_state_dict(self, optimizer, state)

    def __getattr__(self, name: str) -> Any:
        if name == "module":
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        units = ", ".join(unit.label for unit in self.units)
        return (f"FSDP({self.sharding_strategy.name}, {self._shard_size} shards, units [{units}], "
                f"module={type(self.module).__name__})")
