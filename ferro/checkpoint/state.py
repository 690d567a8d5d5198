"""The front door of state dicts: one layout for every way a model is held: FSDP, DDP, or a plain module.

FSDP's part of the layout (its shards' ranges) comes from
:mod:`ferro.parallel.fsdp.state_dict`; DDP and plain modules (ferro.nn or torch)
are laid out here.

:func:`get_state_dict` returns ``{"model": ..., "optim": ...}`` keyed by parameter
name, whatever wraps the model: FSDP gives this rank's ranges
(:class:`~ferro.parallel.fsdp.ShardedEntry`), the others whole arrays. The
values are the model's and optimizer's own memory, so :func:`ferro.checkpoint.load`
fills them in place; :func:`set_state_dict` then applies what cannot be filled
in place (the optimizer's step counts). Because every layout names and shapes
its entries the same way, a checkpoint saved from one loads into any other.
"""

from __future__ import annotations

from typing import Any

from ferro.parallel.ddp import DDP
from ferro.parallel.fsdp import FSDP
from ferro.parallel.fsdp import state_dict as fsdp_layout
from ferro.parallel.fsdp._tensors import named_param_groups, tensors_for

__all__ = ["get_state_dict", "set_state_dict"]


def _unwrap(model: Any) -> Any:
    return model.module if isinstance(model, DDP) else model


def get_state_dict(model: Any, optimizer: Any = None) -> dict[str, Any]:
    """Return the model's (and optimizer's) state by parameter name, as views to save from or load into.

    Args:
        model: An :class:`~ferro.parallel.fsdp.FSDP` or :class:`~ferro.parallel.ddp.DDP` model, or a
            ``ferro.nn`` or CPU torch module.
        optimizer: Its optimizer. One without state yet gets it from a step at learning rate 0
            (the parameters do not change), so a fresh optimizer can be loaded into.

    Returns:
        ``{"model": {name: array, tensor or ShardedEntry}}``, plus ``"optim": {"state": {name:
        {key: value}}, "param_groups": [...]}`` when an optimizer is given. torch modules'
        buffers are included under their names.

    """
    state: dict[str, Any] = {"model": _model_state(model)}
    if optimizer is not None:
        state["optim"] = _optim_state(model, optimizer)
    return state


def set_state_dict(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Apply what :func:`ferro.checkpoint.load` could not fill in place (optimizer step counts).

    Call it after loading into a dict from :func:`get_state_dict` of the same model and optimizer.
    """
    if optimizer is None or "optim" not in state:
        return
    if isinstance(model, FSDP):
        fsdp_layout.load_sharded_optim_state_dict(model, optimizer, state["optim"])
        return
    names = {id(param): name for name, param in _unwrap(model).named_parameters()}
    per_param = tensors_for(_unwrap(model)).optimizer_state(optimizer)
    entries = state["optim"]["state"]
    for param, current in per_param.items():
        name = names.get(id(param))
        if name is None or name not in entries:
            continue
        for key, value in entries[name].items():
            if current.get(key) is not value:
                current[key] = value


def _model_state(model: Any) -> dict[str, Any]:
    if isinstance(model, FSDP):
        return fsdp_layout.sharded_state_dict(model)
    module = _unwrap(model)
    state = {name: getattr(param, "data", param) if not hasattr(param, "detach") else param
             for name, param in module.named_parameters()}
    if hasattr(module, "named_buffers"):
        state.update((name, buffer) for name, buffer in module.named_buffers())
    return state


def _optim_state(model: Any, optimizer: Any) -> dict[str, Any]:
    if isinstance(model, FSDP):
        return fsdp_layout.sharded_optim_state_dict(model, optimizer)
    module = _unwrap(model)
    named = list(module.named_parameters())
    per_param = tensors_for(module).ensure_optimizer_state(optimizer, [param for _, param in named])
    return {"state": {name: dict(per_param[param]) for name, param in named if per_param.get(param)},
            "param_groups": named_param_groups(optimizer, {id(param): [name] for name, param in named})}
