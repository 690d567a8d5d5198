"""ferro's DDP communication hooks, for torch's own ``DistributedDataParallel`` over the "ferro" backend.

torch's DDP calls a hook as ``hook(state, grad_bucket)`` and waits on the
``torch.futures.Future`` it returns; :func:`comm_hook` makes one of that shape
from any ferro hook (:mod:`ferro.parallel.comm_hooks`), so the int8 and
PowerSGD hooks, and the 16-bit ones reduced natively in bfloat16 or float16,
run on the ferro group under torch's DDP. The hook runs on the group's worker
thread, so the bucket's exchange overlaps the rest of backward, as torch's own
hooks' collectives do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ferro.backend.base import Backend
from ferro.collective.work import worker_of
from ferro.errors import ConfigurationError
from ferro.parallel.comm_hooks import Bucket, CommHook

__all__ = ["comm_hook", "ferro_group_of"]

TorchHook = Callable[[Any, Any], torch.futures.Future]


def ferro_group_of(process_group: Any = None) -> Backend:
    """Return the ferro group under a torch process group (None: torch's default group).

    Raises:
        ConfigurationError: The group does not run on the "ferro" backend.

    """
    group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    ferro_group = getattr(group, "ferro_group", None)
    if not isinstance(ferro_group, Backend):
        raise ConfigurationError(
            f"ferro's communication hooks run on a torch group of the \"ferro\" backend, and {group!r} is not one: "
            f"init_process_group(\"ferro\") or new_group(backend=\"ferro\")")
    return ferro_group


def comm_hook(hook: CommHook) -> TorchHook:
    """Return ``hook`` as a torch DDP communication hook; its ``state`` is the torch group (None: the default).

    Args:
        hook: A ferro hook, ``hook(group, bucket)``, such as
            :class:`ferro.parallel.Int8CompressHook` or :class:`ferro.parallel.PowerSGDHook`.

    Returns:
        ``torch_hook(state, bucket) -> Future``, for ``DistributedDataParallel.register_comm_hook``.
        torch's own ``bf16_compress_hook`` is refused by torch's DDP without CUDA;
        ``comm_hook(ferro.parallel.bf16_compress_hook)`` reduces bfloat16 on the CPU.

    Example::

        torch.distributed.init_process_group("ferro")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, ferro.interop.torch.comm_hook(ferro.parallel.Int8CompressHook()))

    """

    def torch_hook(state: Any, bucket: Any) -> torch.futures.Future:
        group = ferro_group_of(state)
        grad_bucket = bucket
        gradients = grad_bucket.gradients()
        offsets, at = [], 0
        for gradient in gradients:
            offsets.append(at)
            at += gradient.numel()
        buffer = grad_bucket.buffer()
        ours = Bucket(grad_bucket.index(), buffer, list(grad_bucket.parameters()), offsets)
        future: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                hook(group, ours)
            except BaseException as exc:
                future.set_exception(exc)
                raise
            future.set_result(buffer)

        worker_of(group).submit(run, f"torch DDP bucket {ours.index}", (buffer,))
        return future

    # torch's DDP inspects a hook's annotations and accepts only these objects (this module's are strings).
    torch_hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                                  "return": torch.futures.Future[torch.Tensor]}
    # Named apart from torch's own hooks: torch refuses one called bf16_compress_hook without CUDA and NCCL.
    torch_hook.__name__ = f"ferro_{getattr(hook, '__name__', type(hook).__name__)}"
    return torch_hook
