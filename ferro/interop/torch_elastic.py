"""torch's own ``DistributedDataParallel`` under :class:`ferro.elastic.Manager`: one DDP, a reducer per epoch.

Each membership change gives the DDP a new ``"ferro"`` process group over the
epoch's group (a torch ``ProcessGroup``'s rank and size are fixed at
construction). torch offers ``DistributedDataParallel._update_process_group``
to shrink and grow a DDP, but it keeps each rank's bucket layout: a rank that
trained has its buckets rebuilt in gradient-ready order after its first step,
while a replacement's new DDP starts from the construction order, and their
first step together adds up different parameters' gradients element for
element, with no error. So at every change each rank rebuilds the reducer as
DDP's constructor does (same parameters, options and comm hooks, the new
group): every rank starts the epoch from one layout and rebuilds its buckets
after the same step.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ferro.backend.base import Backend
from ferro.errors import ConfigurationError
from ferro.interop.torch import ProcessGroupFerro

__all__ = ["elastic_ddp", "rebind_ddp"]


def rebind_ddp(ddp: DistributedDataParallel, group: Backend, name: str = "ferro-elastic") -> None:
    """Give ``ddp`` a fresh reducer over ``group``: the layout of a DDP just built, on every rank.

    Args:
        ddp: The DDP (torch 2.13, whose private construction steps this repeats).
        group: The new epoch's ferro group.
        name: torch's name for the new process group.

    """
    ddp.process_group = ProcessGroupFerro(group, name)
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


class _Follower:
    """What the manager re-points at each new group: one DDP."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp, self.epochs = ddp, 0

    def rebind(self, group: Backend) -> None:
        self.epochs += 1
        rebind_ddp(self.ddp, group, f"ferro-elastic-{self.epochs}")


def elastic_ddp(manager: Any, module: Any, **options: Any) -> DistributedDataParallel:
    """Return torch's own ``DistributedDataParallel`` of ``module`` on ferro, following ``manager``'s changes.

    One DDP serves the whole run: at each membership change every rank gives
    it a fresh reducer over the new epoch's group, so ``loss.backward()``
    averages over the ranks of the step being trained. Parameters are not
    broadcast here: the manager's first step makes every rank's state the
    healthy ranks'.

    Args:
        manager: The :class:`ferro.elastic.Manager`.
        module: A CPU ``torch.nn.Module``.
        **options: DDP's own (``bucket_cap_mb``, ``find_unused_parameters``, ...), except
            ``process_group``, ``device_mesh`` and ``init_sync``, which are set here.

    Raises:
        ConfigurationError: One of the options set here.

    Example::

        from ferro.interop.torch_elastic import elastic_ddp

        manager = ferro.elastic.Manager()
        model = elastic_ddp(manager, net)
        manager.register(model=net, optimizer=optimizer)      # a torch.optim optimizer
        for step in manager.steps(200, sampler):
            with step:
                optimizer.zero_grad()
                loss = loss_fn(model(x[step.shard.indices]), y[step.shard.indices]) * step.shard.loss_weight
                loss.backward()
                optimizer.step()

    """
    taken = sorted({"process_group", "device_mesh", "init_sync"} & set(options))
    if taken:
        raise ConfigurationError(f"elastic_ddp: {', '.join(taken)} are set here (the manager's group, no init sync)")
    ddp = DistributedDataParallel(module, process_group=ProcessGroupFerro(manager.group, "ferro-elastic-0"),
                                  init_sync=False, **options)
    manager.track(_Follower(ddp))
    return ddp
