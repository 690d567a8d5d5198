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

import contextlib
import enum
import re
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferro.backend.base import Backend
from ferro.collective import ReduceOp, all_gather, allreduce, broadcast, gather, reduce_scatter
from ferro.collective.work import PendingCollective, worker_of
from ferro.dtensor import DTensor, Replicate, from_sharded_entries
from ferro.errors import CollectiveMismatchError, ConfigurationError, DistributedError
from ferro.parallel.fsdp._tensors import Tensors, TorchTensors, named_param_groups, tensors_for
from ferro.parallel.fsdp.flat import FlatGroup, ShardedEntry, Slot
from ferro.parallel.fsdp.options import MixedPrecision, ShardingStrategy
from ferro.types import MAX_TAG

__all__ = ["FSDP"]

FORWARD, BACKWARD, REDUCE = 0, 1, 2
_PHASE_NAMES = {FORWARD: "forward all_gather", BACKWARD: "backward all_gather", REDUCE: "reduce_scatter"}


class _State(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


@dataclass(eq=False)
class Unit:
    """One wrapped module: its flat parameter groups and where it is in the step."""

    index: int
    name: str
    module: Any
    groups: list[FlatGroup]
    state: _State = _State.SHARDED
    pending: PendingCollective | None = None
    backward_started: bool = False
    reduced: bool = False
    grads_waiting: int = 0
    backward_tag: int = 0
    keeps_gathered: bool = False  # its gathered vectors are its shards (one shard, no cast): nothing to free

    @property
    def label(self) -> str:
        """How messages name the unit."""
        return repr(self.name) if self.name else "<root>"


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
        self.units = self._build_units(auto_wrap_policy, sync_module_states)
        if not self.units:
            raise ConfigurationError("FSDP: the module has no parameters to shard")
        self._comm = self.shard_group if self._shard_size > 1 else self.replicate_group
        self._forward_order: list[Unit] = []
        self._last_order: list[Unit] = []
        self._position = 0
        self._backward_position = 0
        self._in_step = False
        self._finish_queued = False
        self._reduces: list[tuple[Unit, Callable[[], list[Any]]]] = []  # each unit's wait for its reduced grads
        self._stats = {"all_gather_seconds": 0.0, "all_gather_wait_seconds": 0.0, "all_gathers": 0,
                       "peak_unsharded_units": 0}
        self._unit_of = {id(group): unit for unit in self.units for group in unit.groups}
        self._install_hooks()

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
                    self._tensors.same_dtype(g.compute_dtype, _dtype_of(g.shard)) for g in groups)
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
            tensors.prepare(group, self._on_grad)
            tensors.uninstall(group)
            groups.append(group)
        return groups

    def _install_hooks(self) -> None:
        for unit in self.units:
            if self._torch:
                unit.module.register_forward_pre_hook(self._torch_pre_forward(unit))
                unit.module.register_forward_hook(self._torch_post_forward(unit))
            else:
                self._wrap_numpy_unit(unit)

    def _wrap_numpy_unit(self, unit: Unit) -> None:
        module = unit.module
        forward, backward = module.forward, module.backward

        def wrapped_forward(*inputs: Any) -> Any:
            inputs = self._pre_forward(unit, inputs)
            output = forward(*inputs)
            self._post_forward(unit, bool(module.training))
            return output

        def wrapped_backward(grad_output: Any) -> Any:
            self._pre_backward(unit)
            grad_input = backward(grad_output)
            self._post_backward(unit)
            return grad_input

        object.__setattr__(module, "forward", wrapped_forward)
        object.__setattr__(module, "backward", wrapped_backward)

    def _torch_pre_forward(self, unit: Unit) -> Callable[..., Any]:
        def hook(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return self._pre_forward(unit, args)
        return hook

    def _torch_post_forward(self, unit: Unit) -> Callable[..., Any]:
        torch = self._torch

        def hook(_module: Any, _args: Any, output: Any) -> None:
            grad = torch.is_grad_enabled()
            hooked = grad and self._hook_outputs(output, lambda: self._pre_backward(unit))
            if grad and not hooked and any(group.requires_grad for group in unit.groups):
                # No output we can hook (a custom container?): nothing would re-gather the unit before its
                # backward reads the saved views, so it stays gathered until its gradients are reduced.
                return
            self._post_forward(unit, grad)
        return hook

    def _hook_outputs(self, output: Any, fn: Callable[[], None]) -> bool:
        """Call ``fn`` when the gradient of any tensor in ``output`` is ready; return whether any was hooked."""
        torch = self._torch

        def on_grad(_grad: Any) -> None:
            fn()

        hooked = False
        for tensor in _tensors_in(output, torch.Tensor):
            if tensor.requires_grad:
                tensor.register_hook(on_grad)
                hooked = True
        return hooked

    # --- the step -----------------------------------------------------------------------

    def _tag(self, unit: Unit, position: int, phase: int) -> int:
        return zlib.crc32(f"{unit.index}/{position}/{phase}".encode()) & MAX_TAG

    def _begin_step(self) -> None:
        if self._in_step:
            self._settle()  # the last forward had no backward (evaluation): put everything back first
        self._in_step = True
        self._position = self._backward_position = 0
        self._forward_order = []

    def _pre_forward(self, unit: Unit, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self._in_step:
            self._begin_step()
        position = self._position
        self._position += 1
        self._forward_order.append(unit)
        if unit.state is _State.SHARDED and unit.pending is None:
            self._issue_gather(unit, self._tag(unit, position, FORWARD))
        if self.forward_prefetch:
            upcoming = self._predict(position + 1)
            if upcoming is not None and upcoming is not unit:
                self._prefetch(upcoming, self._tag(upcoming, position + 1, FORWARD))
        self._wait_gather(unit, "forward")
        for group in unit.groups:
            self._tensors.install(group)
        if self.mixed_precision.param_dtype is not None:
            inputs = self._tensors.cast_inputs(inputs, unit.groups[0].compute_dtype)
        return inputs

    def _predict(self, position: int) -> Unit | None:
        order = self._last_order
        return order[position] if position < len(order) else None

    def _post_forward(self, unit: Unit, backward_follows: bool) -> None:
        if self._reshard_after_forward or not backward_follows:
            self._reshard(unit)

    def _pre_backward(self, unit: Unit) -> None:
        if unit.backward_started:
            return
        unit.backward_started = True
        if self._torch and not self._finish_queued:
            self._finish_queued = True
            self._torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        position = self._backward_position
        self._backward_position += 1
        unit.backward_tag = self._tag(unit, position, BACKWARD)
        if unit.state is _State.SHARDED and unit.pending is None:
            self._issue_gather(unit, unit.backward_tag)
        if self.forward_prefetch:
            earlier = self._earlier_in_forward(unit)
            if earlier is not None:
                self._prefetch(earlier, self._tag(earlier, position + 1, BACKWARD))
        self._wait_gather(unit, "backward")
        if not self._torch:
            for group in unit.groups:
                self._tensors.install(group)
        unit.grads_waiting = 0
        for group in unit.groups:
            self._tensors.begin_backward(group)
            unit.grads_waiting += group.requires_grad

    def _earlier_in_forward(self, unit: Unit) -> Unit | None:
        order = self._forward_order
        if unit not in order:
            return None
        index = order.index(unit)
        for candidate in reversed(order[:index]):
            if not candidate.backward_started:
                return candidate
        return None

    def _on_grad(self, group: FlatGroup) -> None:
        """torch: one group's gathered gradient is complete (its leaf's post-accumulate hook)."""
        unit = self._unit_of[id(group)]
        if not unit.backward_started:  # its outputs could not be hooked: it stayed gathered (see post-forward)
            self._pre_backward(unit)
        unit.grads_waiting -= 1
        if unit.grads_waiting <= 0:
            self._post_backward(unit)

    def _post_backward(self, unit: Unit) -> None:
        if unit.reduced:
            return
        unit.reduced = True
        grads = [self._tensors.take_grad(group) for group in unit.groups]
        if any(grad is not None for grad in grads) and self._comm is not None:
            shard_group, replicate_group, tag = self.shard_group, self.replicate_group, unit.backward_tag
            shards = self._shard_size

            def reduce() -> list[Any]:
                results = []
                for grad in grads:
                    if grad is not None:
                        if shards > 1:
                            grad = reduce_scatter(grad, ReduceOp.MEAN, group=shard_group, tag=tag)
                        if replicate_group is not None and replicate_group.world_size > 1:
                            allreduce(grad, ReduceOp.MEAN, group=replicate_group)
                    results.append(grad)
                return results

            pending = worker_of(self._comm).submit(reduce, f"FSDP reduce of unit {unit.label}", tuple(grads))
            self._reduces.append((unit, pending.wait))
        elif any(grad is not None for grad in grads):  # one rank, nothing to average
            self._reduces.append((unit, lambda: grads))
        self._reshard(unit)

    def _finish_backward(self) -> None:
        self._finish_queued = False
        try:
            for unit in reversed(self._forward_order):
                if unit.backward_started and not unit.reduced:
                    self._post_backward(unit)  # some of its parameters got no gradient this step
            for unit, wait in self._reduces:
                with self._naming(unit, "reduce_scatter"):
                    results = wait()
                for group, reduced in zip(unit.groups, results, strict=True):
                    if reduced is not None:
                        self._tensors.add_grad(group.shard, reduced)
        finally:
            self._reduces = []
            self._settle()

    def _settle(self) -> None:
        """End a step: wait for stray prefetches and reshard every unit (keeping those that alias their shards)."""
        try:
            for unit in self.units:
                if unit.pending is not None:
                    self._wait_gather(unit, "a prefetch nobody used")
                self._reshard(unit)
        finally:
            for unit in self.units:
                unit.backward_started = unit.reduced = False
            if self._forward_order:
                self._last_order = self._forward_order
            self._in_step = False

    # --- gathering and freeing ---------------------------------------------------------

    def _prefetch(self, unit: Unit, tag: int) -> None:
        if unit.state is _State.SHARDED and unit.pending is None:
            self._issue_gather(unit, tag)

    def _issue_gather(self, unit: Unit, tag: int) -> None:
        transfers = []
        for group in unit.groups:
            if group.shard_size == 1:
                self._tensors.alias(group)
            else:
                transfers.append(self._tensors.gather_buffers(group))
        unit.state = _State.GATHERING
        self._count_unsharded()
        if not transfers:
            unit.state = _State.UNSHARDED
            return
        shard_group, stats = self.shard_group, self._stats

        def gather_all() -> None:
            began = time.perf_counter()
            for source, out in transfers:
                all_gather(source, out=out, group=shard_group, tag=tag)
            stats["all_gather_seconds"] += time.perf_counter() - began

        stats["all_gathers"] += 1
        assert shard_group is not None
        unit.pending = worker_of(shard_group).submit(gather_all, f"FSDP all_gather of unit {unit.label}",
                                                     tuple(b for pair in transfers for b in pair))

    def _wait_gather(self, unit: Unit, phase: str) -> None:
        pending = unit.pending
        if pending is not None:
            began = time.perf_counter()
            try:
                with self._naming(unit, f"{phase} all_gather"):
                    pending.wait()
            finally:
                self._stats["all_gather_wait_seconds"] += time.perf_counter() - began
                unit.pending = None
        unit.state = _State.UNSHARDED

    def _reshard(self, unit: Unit) -> None:
        if unit.state is _State.SHARDED:
            return
        if unit.pending is not None:
            self._wait_gather(unit, "reshard")  # never free memory a collective is still writing
        if unit.keeps_gathered:
            return
        for group in unit.groups:
            self._tensors.uninstall(group)
            self._tensors.free(group)
        unit.state = _State.SHARDED

    def _count_unsharded(self) -> None:
        gathered = sum(unit.state is not _State.SHARDED for unit in self.units)
        self._stats["peak_unsharded_units"] = max(self._stats["peak_unsharded_units"], gathered)

    # --- errors -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _naming(self, unit: Unit, what: str) -> Iterator[None]:
        """Re-raise a collective mismatch with the FSDP units its tags stand for."""
        try:
            yield
        except CollectiveMismatchError as exc:
            raise CollectiveMismatchError(
                f"FSDP: rank {self.group.rank} was at unit {unit.label} ({what}) when the ranks' calls differed "
                f"-- {exc}{self._legend(str(exc))}", exc.peer, exc.expected, exc.actual) from exc
        except DistributedError as exc:
            if exc.args and isinstance(exc.args[0], str):  # keep the type (and its fields), say where FSDP was
                exc.args = (f"{exc.args[0]} [FSDP: rank {self.group.rank} was at unit {unit.label} ({what})]",
                            *exc.args[1:])
            raise

    def _legend(self, message: str) -> str:
        tags = sorted({int(t) for t in re.findall(r"(?<!thread )\btag (\d+)", message)})
        if not tags:
            return ""
        limit = 2 * len(self.units) + 2
        names = []
        for tag in tags:
            hits = [f"{unit.label} as {_PHASE_NAMES[phase]} #{position + 1} of the step"
                    for unit in self.units for position in range(limit) for phase in (FORWARD, BACKWARD)
                    if self._tag(unit, position, phase) == tag]
            names.append(f"tag {tag} = {' or '.join(hits) if hits else 'no FSDP unit of this model'}")
        return ". FSDP tags: " + "; ".join(names) + (
            ". The ranks ran different units, or the same units in a different order: every rank must run "
            "the same forward")

    # --- public -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's forward (gathering each unit as it runs)."""
        self._begin_step()
        output = self.module(*args, **kwargs)
        if self._torch and self._torch.is_grad_enabled():
            self._hook_outputs(output, self._queue_finish)
        return output

    forward = __call__

    def _queue_finish(self) -> None:
        if not self._finish_queued:
            self._finish_queued = True
            self._torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

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
            self._reduces = []
            self._settle()
            raise
        self._finish_backward()
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
        stats = dict(self._stats)
        spent = stats["all_gather_seconds"]
        stats["hidden_fraction"] = max(0.0, 1.0 - stats["all_gather_wait_seconds"] / spent) if spent else 0.0
        return stats

    def reset_comm_stats(self) -> None:
        """Zero :meth:`comm_stats`."""
        for key in self._stats:
            self._stats[key] = 0.0 if key.endswith("seconds") else 0

    # --- state ----------------------------------------------------------------------------

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, Any]:
        """Return every parameter's full value (a copy), by its name in the unwrapped module.

        Collective: every rank must call it. torch modules' buffers are included.

        Args:
            rank0_only: Gather to rank 0 only; the other ranks get ``{}``.

        Returns:
            ``{name: array or tensor}`` in the module's parameter order.

        """
        self._require_idle("full_state_dict")
        values: dict[str, Any] = {}
        for unit in self.units:
            for group in unit.groups:
                full = self._gather_shards(unit, self._tensors.shard_array(group.shard), rank0_only)
                if full is None:
                    continue
                dtype = _dtype_of(group.shard)
                for slot in group.slots:
                    values[slot.fqn] = self._tensors.wrap(
                        full[slot.offset:slot.offset + slot.numel].reshape(slot.shape).copy(), dtype)
        if rank0_only and self.group.rank != 0:
            return {}
        ordered = {fqn: values[fqn] for fqn in self._fqns}
        if self._torch:
            for name, buffer in self.module.named_buffers():
                ordered[name] = buffer.detach().clone()
        return ordered

    state_dict = full_state_dict

    def _gather_shards(self, unit: Unit, shard: np.ndarray, rank0_only: bool) -> np.ndarray | None:
        """Every shard of one flat vector, concatenated (None on ranks that do not receive it)."""
        group = self.shard_group
        if group is None or group.world_size == 1:
            return shard
        with self._naming(unit, "state dict"):
            if rank0_only:
                return gather(shard, dst=0, group=group)
            return all_gather(shard, group=group)

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Copy full parameter values into this rank's shards in place (no communication).

        The shard objects stay the same, so an optimizer made earlier stays valid.

        Raises:
            KeyError: A parameter is missing from ``state``.
            ValueError: A value's shape differs from its parameter's.

        """
        self._require_idle("load_full_state_dict")
        tensors = self._tensors
        for unit in self.units:
            for group in unit.groups:
                shard = tensors.shard_array(group.shard)
                for slot in group.slots:
                    if slot.fqn not in state:
                        raise KeyError(f"load_full_state_dict: {slot.fqn!r} is missing from the state dict")
                    value = tensors.array_of(state[slot.fqn])
                    if tuple(value.shape) != slot.shape:
                        raise ValueError(f"load_full_state_dict: {slot.fqn!r} has shape {slot.shape}, the state "
                                         f"has {tuple(value.shape)}")
                    lo, hi, position = group.local(slot)
                    shard[position:position + hi - lo] = value.reshape(-1)[lo:hi]
        if self._torch:
            torch = self._torch
            with torch.no_grad():
                for name, buffer in self.module.named_buffers():
                    if name in state:
                        buffer.copy_(state[name])

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
        self._require_idle("sharded_state_dict")
        entries: dict[str, ShardedEntry] = {}
        for unit in self.units:
            for group in unit.groups:
                for slot in group.slots:
                    lo, hi, position = group.local(slot)
                    entries[slot.fqn] = ShardedEntry(
                        self._tensors.shard_slice(group.shard, position, position + hi - lo), slot.shape, lo, hi)
        state: dict[str, Any] = {fqn: entries[fqn] for fqn in self._fqns}
        if as_dtensor and self.shard_group is not None:
            state = from_sharded_entries(state, self.shard_group, timeout=timeout)
        elif as_dtensor:  # NO_SHARD: every rank holds every parameter whole
            state = {fqn: DTensor.from_local(entry.local.reshape(entry.global_shape), self.group, [Replicate()],
                                             shape=entry.global_shape) for fqn, entry in state.items()}
        if self._torch:
            state.update(self.module.named_buffers())
        return state

    def full_optim_state_dict(self, optimizer: Any, rank0_only: bool = False) -> dict[str, Any]:
        """Return the optimizer's state per full parameter, by parameter name (collective).

        Returns:
            ``{"state": {name: {"exp_avg": full array, "step": ...}}, "param_groups": [...]}``:
            per-element state gathered to the parameter's shape, scalars as they are;
            ``param_groups`` lists each optimizer group's settings and parameter names.
            With ``rank0_only``, other ranks get ``{}``.

        """
        self._require_idle("full_optim_state_dict")
        per_param = self._tensors.optimizer_state(optimizer)
        state: dict[str, dict[str, Any]] = {}
        for unit in self.units:
            for group in unit.groups:
                entry = per_param.get(group.shard)
                if not entry:
                    continue
                for key, value in entry.items():
                    if _is_per_element(value, group.shard_len):
                        array = self._tensors.array_of(value)
                        full = self._gather_shards(unit, array, rank0_only)
                        if full is None:
                            continue
                        for slot in group.slots:
                            part = full[slot.offset:slot.offset + slot.numel].reshape(slot.shape).copy()
                            state.setdefault(slot.fqn, {})[key] = self._tensors.wrap(part, _dtype_of(value))
                    else:
                        for slot in group.slots:
                            state.setdefault(slot.fqn, {})[key] = _copy_scalar(value)
        if rank0_only and self.group.rank != 0:
            return {}
        return {"state": {fqn: state[fqn] for fqn in self._fqns if fqn in state},
                "param_groups": self._param_groups(optimizer)}

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
        self._require_idle("sharded_optim_state_dict")
        per_param = self._tensors.ensure_optimizer_state(optimizer, self.parameters())
        state: dict[str, dict[str, Any]] = {}
        for unit in self.units:
            for group in unit.groups:
                for key, value in (per_param.get(group.shard) or {}).items():
                    for slot in group.slots:
                        lo, hi, position = group.local(slot)
                        if _is_per_element(value, group.shard_len):
                            value_part = value[position:position + hi - lo]
                            state.setdefault(slot.fqn, {})[key] = ShardedEntry(value_part, slot.shape, lo, hi)
                        else:
                            state.setdefault(slot.fqn, {})[key] = value
        return {"state": {fqn: state[fqn] for fqn in self._fqns if fqn in state},
                "param_groups": self._param_groups(optimizer)}

    def load_sharded_optim_state_dict(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Give the optimizer the state in ``state``, laid out as :meth:`sharded_optim_state_dict` gives it.

        After ``ferro.checkpoint.load`` has filled a dict from :meth:`sharded_optim_state_dict`,
        the per-element state is already in place; this sets what could not be filled in
        place (scalars such as ``step``) and copies entries that are not views of the
        optimizer's arrays. No communication.

        Raises:
            KeyError: A parameter with optimizer state has no entry in ``state``.

        """
        self._require_idle("load_sharded_optim_state_dict")
        per_param = self._tensors.optimizer_state(optimizer)
        entries = state.get("state", state)
        for unit in self.units:
            for group in unit.groups:
                current = per_param.get(group.shard)
                if not current:
                    continue
                for slot in group.slots:
                    if slot.fqn not in entries:
                        raise KeyError(f"load_sharded_optim_state_dict: no state for {slot.fqn!r}")
                    for key, value in entries[slot.fqn].items():
                        if isinstance(value, ShardedEntry):
                            lo, hi, position = group.local(slot)
                            _copy_into(current[key][position:position + hi - lo], value.local)
                        elif slot is group.slots[0]:
                            current[key] = _same_or_copy(current.get(key), value)

    def _param_groups(self, optimizer: Any) -> list[dict[str, Any]]:
        return named_param_groups(optimizer, {id(group.shard): [slot.fqn for slot in group.slots]
                                              for unit in self.units for group in unit.groups})

    def load_full_optim_state_dict(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Give the optimizer its state for this rank's shards, cut from a full optimizer state dict.

        No communication: every rank passes the whole dict (as :meth:`full_optim_state_dict` returns it)
        and keeps its own part. The optimizer's settings (learning rate, ...) stay its own.
        """
        self._require_idle("load_full_optim_state_dict")
        tensors = self._tensors
        per_param = tensors.optimizer_state(optimizer)
        entries = state.get("state", state)
        for unit in self.units:
            for group in unit.groups:
                found = [entries.get(slot.fqn) for slot in group.slots]
                present = [e for e in found if e]
                if not present:
                    continue
                if len(present) != len(found):
                    missing = [s.fqn for s, e in zip(group.slots, found, strict=True) if not e]
                    raise KeyError(f"load_full_optim_state_dict: no state for {missing} (the rest of unit "
                                   f"{unit.label}'s parameters have some)")
                new: dict[str, Any] = {}
                for key, sample in present[0].items():
                    if _ndim(sample) >= 1:
                        local = None
                        for slot, entry in zip(group.slots, found, strict=True):
                            value = tensors.array_of(entry[key])
                            if local is None:
                                local = np.zeros(group.shard_len, value.dtype)
                            lo, hi, position = group.local(slot)
                            local[position:position + hi - lo] = value.reshape(-1)[lo:hi]
                        assert local is not None
                        new[key] = tensors.wrap(local, _dtype_of(sample))
                    else:
                        new[key] = _copy_scalar(sample)
                per_param[group.shard] = new

    def _require_idle(self, what: str) -> None:
        if self._in_step:
            self._settle()  # a forward without backward: nothing of the step is left to use
        if self._reduces:
            raise RuntimeError(f"FSDP.{what}: called during backward")

    def __getattr__(self, name: str) -> Any:
        if name == "module":
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        units = ", ".join(unit.label for unit in self.units)
        return (f"FSDP({self.sharding_strategy.name}, {self._shard_size} shards, units [{units}], "
                f"module={type(self.module).__name__})")


def _tensors_in(value: Any, tensor_type: type) -> Iterator[Any]:
    if isinstance(value, tensor_type):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, tensor_type)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, tensor_type)


def _dtype_of(value: Any) -> Any:
    data = getattr(value, "data", value)
    return getattr(data, "dtype", None)


def _ndim(value: Any) -> int:
    return int(getattr(value, "ndim", 0))


def _is_per_element(value: Any, shard_len: int) -> bool:
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) == 1 and int(shape[0]) == shard_len


def _copy_scalar(value: Any) -> Any:
    clone = getattr(value, "clone", None)
    if callable(clone):
        return clone()
    copy = getattr(value, "copy", None)
    return copy() if callable(copy) else value


def _copy_into(target: Any, source: Any) -> None:
    """Copy ``source`` into ``target`` (arrays or tensors of one shape) unless they are the same memory."""
    if _address(target) == _address(source):
        return
    if hasattr(target, "copy_"):
        import torch  # a tensor is in hand: torch is loaded

        with torch.no_grad():
            target.copy_(source)
    else:
        target[...] = source


def _address(value: Any) -> int:
    pointer = getattr(value, "data_ptr", None)
    return int(pointer()) if callable(pointer) else int(value.__array_interface__["data"][0])


def _same_or_copy(current: Any, value: Any) -> Any:
    """Keep ``current`` when ``value`` is it (a tensor filled in place); else a copy of ``value``."""
    return current if current is value else _copy_scalar(value)
