"""FSDP's state dicts: full (gathered), sharded (this rank's ranges) and the optimizer's, by parameter name.

:func:`ferro.checkpoint.get_state_dict` is the front door: it lays out every
model alike (FSDP, DDP, a plain module) and takes FSDP's layout from here; the
``FSDP.*state_dict`` methods are these functions under torch's FSDP names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ferro.collective import all_gather, gather
from ferro.dtensor import DTensor, Replicate, from_sharded_entries
from ferro.parallel.fsdp._tensors import named_param_groups
from ferro.parallel.fsdp.flat import ShardedEntry
from ferro.parallel.fsdp.unit import Unit

if TYPE_CHECKING:
    from ferro.parallel.fsdp.api import FSDP

__all__ = ["full_optim_state_dict", "full_state_dict", "load_full_optim_state_dict", "load_full_state_dict",
           "load_sharded_optim_state_dict", "sharded_optim_state_dict", "sharded_state_dict", "dtype_of"]


def full_state_dict(model: FSDP, rank0_only: bool = False) -> dict[str, Any]:
    """Run :meth:`ferro.FSDP.full_state_dict`, which documents it."""
    model._step.require_idle("full_state_dict")
    values: dict[str, Any] = {}
    for unit in model.units:
        for group in unit.groups:
            full = _gather_shards(model, unit, model._tensors.shard_array(group.shard), rank0_only)
            if full is None:
                continue
            dtype = dtype_of(group.shard)
            for slot in group.slots:
                values[slot.fqn] = model._tensors.wrap(
                    full[slot.offset:slot.offset + slot.numel].reshape(slot.shape).copy(), dtype)
    if rank0_only and model.group.rank != 0:
        return {}
    ordered = {fqn: values[fqn] for fqn in model._fqns}
    if model._torch:
        for name, buffer in model.module.named_buffers():
            ordered[name] = buffer.detach().clone()
    return ordered

def _gather_shards(model: FSDP, unit: Unit, shard: np.ndarray, rank0_only: bool) -> np.ndarray | None:
    """Every shard of one flat vector, concatenated (None on ranks that do not receive it)."""
    group = model.shard_group
    if group is None or group.world_size == 1:
        return shard
    with model._step.naming(unit, "state dict"):
        if rank0_only:
            return gather(shard, dst=0, group=group)
        return all_gather(shard, group=group)

def load_full_state_dict(model: FSDP, state: dict[str, Any]) -> None:
    """Run :meth:`ferro.FSDP.load_full_state_dict`, which documents it."""
    model._step.require_idle("load_full_state_dict")
    tensors = model._tensors
    for unit in model.units:
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
    if model._torch:
        torch = model._torch
        with torch.no_grad():
            for name, buffer in model.module.named_buffers():
                if name in state:
                    buffer.copy_(state[name])

def sharded_state_dict(model: FSDP, *, as_dtensor: bool = False, timeout: float | None = None) -> dict[str, Any]:
    """Run :meth:`ferro.FSDP.sharded_state_dict`, which documents it."""
    model._step.require_idle("sharded_state_dict")
    entries: dict[str, ShardedEntry] = {}
    for unit in model.units:
        for group in unit.groups:
            for slot in group.slots:
                lo, hi, position = group.local(slot)
                entries[slot.fqn] = ShardedEntry(
                    model._tensors.shard_slice(group.shard, position, position + hi - lo), slot.shape, lo, hi)
    state: dict[str, Any] = {fqn: entries[fqn] for fqn in model._fqns}
    if as_dtensor and model.shard_group is not None:
        state = from_sharded_entries(state, model.shard_group, timeout=timeout)
    elif as_dtensor:  # NO_SHARD: every rank holds every parameter whole
        state = {fqn: DTensor.from_local(entry.local.reshape(entry.global_shape), model.group, [Replicate()],
                                         shape=entry.global_shape) for fqn, entry in state.items()}
    if model._torch:
        state.update(model.module.named_buffers())
    return state

def full_optim_state_dict(model: FSDP, optimizer: Any, rank0_only: bool = False) -> dict[str, Any]:
    """Run :meth:`ferro.FSDP.full_optim_state_dict`, which documents it."""
    model._step.require_idle("full_optim_state_dict")
    per_param = model._tensors.optimizer_state(optimizer)
    state: dict[str, dict[str, Any]] = {}
    for unit in model.units:
        for group in unit.groups:
            entry = per_param.get(group.shard)
            if not entry:
                continue
            for key, value in entry.items():
                if _is_per_element(value, group.shard_len):
                    array = model._tensors.array_of(value)
                    full = _gather_shards(model, unit, array, rank0_only)
                    if full is None:
                        continue
                    for slot in group.slots:
                        part = full[slot.offset:slot.offset + slot.numel].reshape(slot.shape).copy()
                        state.setdefault(slot.fqn, {})[key] = model._tensors.wrap(part, dtype_of(value))
                else:
                    for slot in group.slots:
                        state.setdefault(slot.fqn, {})[key] = _copy_scalar(value)
    if rank0_only and model.group.rank != 0:
        return {}
    return {"state": {fqn: state[fqn] for fqn in model._fqns if fqn in state},
            "param_groups": _param_groups(model, optimizer)}

def sharded_optim_state_dict(model: FSDP, optimizer: Any) -> dict[str, Any]:
    """Run :meth:`ferro.FSDP.sharded_optim_state_dict`, which documents it."""
    model._step.require_idle("sharded_optim_state_dict")
    per_param = model._tensors.ensure_optimizer_state(optimizer, model.parameters())
    state: dict[str, dict[str, Any]] = {}
    for unit in model.units:
        for group in unit.groups:
            for key, value in (per_param.get(group.shard) or {}).items():
                for slot in group.slots:
                    lo, hi, position = group.local(slot)
                    if _is_per_element(value, group.shard_len):
                        value_part = value[position:position + hi - lo]
                        state.setdefault(slot.fqn, {})[key] = ShardedEntry(value_part, slot.shape, lo, hi)
                    else:
                        state.setdefault(slot.fqn, {})[key] = value
    return {"state": {fqn: state[fqn] for fqn in model._fqns if fqn in state},
            "param_groups": _param_groups(model, optimizer)}

def load_sharded_optim_state_dict(model: FSDP, optimizer: Any, state: dict[str, Any]) -> None:
    """Run :meth:`ferro.FSDP.load_sharded_optim_state_dict`, which documents it."""
    model._step.require_idle("load_sharded_optim_state_dict")
    per_param = model._tensors.optimizer_state(optimizer)
    entries = state.get("state", state)
    for unit in model.units:
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

def _param_groups(model: FSDP, optimizer: Any) -> list[dict[str, Any]]:
    return named_param_groups(optimizer, {id(group.shard): [slot.fqn for slot in group.slots]
                                          for unit in model.units for group in unit.groups})

def load_full_optim_state_dict(model: FSDP, optimizer: Any, state: dict[str, Any]) -> None:
    """Run :meth:`ferro.FSDP.load_full_optim_state_dict`, which documents it."""
    model._step.require_idle("load_full_optim_state_dict")
    tensors = model._tensors
    per_param = tensors.optimizer_state(optimizer)
    entries = state.get("state", state)
    for unit in model.units:
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
                    new[key] = tensors.wrap(local, dtype_of(sample))
                else:
                    new[key] = _copy_scalar(sample)
            per_param[group.shard] = new


def dtype_of(value: Any) -> Any:
    """Return the dtype of an array, a tensor or a parameter (None for a Python scalar)."""
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
