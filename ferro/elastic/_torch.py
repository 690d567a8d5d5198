"""torch's own ``DistributedDataParallel`` through membership changes: one DDP object, a new reducer per epoch.

torch offers ``DistributedDataParallel._update_process_group`` to shrink and
grow a DDP, but it keeps each rank's bucket layout: a rank that trained has
its buckets rebuilt in gradient-ready order after its first step, while a
replacement's new DDP starts from the construction order. Their first step
together would then add up different parameters' gradients, element for
element, with no error. So at every change each rank rebuilds the reducer as
DDP's constructor does (same parameters, options and comm hooks, the new
group): every rank starts the epoch from the same layout and rebuilds its
buckets after the same step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rebind_torch_ddp"]


def rebind_torch_ddp(ddp: Any, process_group: Any) -> None:
    """Give ``ddp`` a fresh reducer over ``process_group``: the layout of a DDP just built, on every rank.

    Args:
        ddp: A ``torch.nn.parallel.DistributedDataParallel`` (torch 2.13, whose private
            construction steps this repeats).
        process_group: The new epoch's torch process group.

    """
    import torch.distributed as dist

    ddp.process_group = process_group
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    static = bool(ddp.static_graph)
    ddp.static_graph = False
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, False)
    ddp._has_rebuilt_buckets = False
    if static:
        ddp._set_static_graph()
    for hook, state in ddp._comm_hooks:  # the user's hooks, on the new reducer (their state is theirs)
        dist._register_comm_hook(ddp.reducer, state, hook)
