"""GPU buffers on any group: :func:`gpu_allreduce` and :func:`gpu_broadcast`.

On a group with NCCL these are :func:`ferro.allreduce` and :func:`ferro.broadcast`
(which route GPU buffers to :mod:`ferro.backend.nccl.routing` themselves). They
also serve groups without NCCL through a host round trip (copy to host, the
group's CPU collective, copy back), but only when ``FERRO_ENABLE_GPU_FALLBACK=1``
says so: it is much slower, and a silent fallback would hide a missing NCCL.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from ferro import environment
from ferro._buffers import is_device_array, is_torch_tensor
from ferro.backend.base import Backend
from ferro.backend.nccl.buffers import describe
from ferro.backend.nccl.cuda import require_gpu
from ferro.backend.nccl.routing import FALLBACK_ENV
from ferro.collective.movement import broadcast
from ferro.collective.reductions import allreduce
from ferro.collective.resolve import resolve_group
from ferro.errors import BackendUnavailableError
from ferro.types import ReduceOp

__all__ = ["FALLBACK_ENV", "gpu_allreduce", "gpu_broadcast"]


def gpu_allreduce(x: Any, op: ReduceOp = ReduceOp.SUM, *, group: Backend | None = None,
                  timeout: float | None = None) -> Any:
    """Allreduce a GPU buffer in place: through NCCL, or through host memory when explicitly enabled.

    On a group with NCCL (``backend="nccl"`` or ``"hybrid"``) this is
    :func:`ferro.allreduce`. On any other group it copies ``x`` to host memory,
    runs the group's CPU allreduce and copies the result back, but only with
    ``FERRO_ENABLE_GPU_FALLBACK=1`` set: that round trip costs two copies over
    PCIe and a synchronisation, and a silent fallback would hide a missing NCCL.

    Args:
        x: A CUDA tensor or an object with ``__cuda_array_interface__`` (a host array is allreduced as usual).
        op: The reduction.
        group: The process group.
        timeout: Seconds.

    Returns:
        ``x``.

    Raises:
        BackendUnavailableError: The group has no NCCL and the fallback is not enabled.

    Example::

        # rank 0: x = torch.tensor([1.], device="cuda")   rank 1: x = torch.tensor([2.], device="cuda")
        ferro.gpu_allreduce(x)   # both: x == [3.]

    """
    g = resolve_group(group, "gpu_allreduce")
    return _nccl_or_host(x, g, "gpu_allreduce", lambda y: allreduce(y, op, group=g, timeout=timeout))


def gpu_broadcast(x: Any, root: int = 0, *, group: Backend | None = None, timeout: float | None = None) -> Any:
    """Broadcast a GPU buffer in place from ``root``: through NCCL, or the host round trip (see :func:`gpu_allreduce`).

    Example::

        # rank 0: x = torch.arange(3., device="cuda")   rank 1: x = torch.zeros(3, device="cuda")
        ferro.gpu_broadcast(x, root=0)   # both: x == [0., 1., 2.]

    """
    g = resolve_group(group, "gpu_broadcast")
    return _nccl_or_host(x, g, "gpu_broadcast", lambda y: broadcast(y, root, group=g, timeout=timeout))


def _nccl_or_host(x: Any, g: Backend, call: str, run: Callable[[Any], Any]) -> Any:
    """Run ``run(x)`` where the group can (NCCL, or a host buffer), else ``run`` on a host copy of ``x``."""
    if not is_device_array(x) or g.device_collectives is not None:
        return run(x)
    host = _to_host(x, g, call)
    run(host)
    _from_host(x, host)
    return x


def _to_host(x: Any, g: Backend, call: str) -> Any:
    if environment.get(FALLBACK_ENV) != "1":
        raise BackendUnavailableError(
            f"rank {g.rank}: {call}: this group ({type(g).__name__}) has no NCCL communicator (backend='nccl' or "
            f"'hybrid' has one; pip install nvidia-nccl-cu12). To copy through host memory instead, set "
            f"{FALLBACK_ENV}=1 (two PCIe copies and a synchronisation per call)")
    if is_torch_tensor(x):
        return x.detach().cpu()  # waits for the current stream's work on x
    array = describe(x, call, writable=True)
    driver = require_gpu()
    host = np.empty(array.shape, np.dtype(array.dtype))
    driver.synchronize(array.stream)
    driver.to_host(host.ctypes.data, array.pointer, array.nbytes)
    return host


def _from_host(x: Any, host: Any) -> None:
    if is_torch_tensor(x):
        import torch

        with torch.no_grad():
            x.copy_(host)
        return
    array = describe(x, "gpu copy back", writable=True)
    require_gpu().to_device(array.pointer, ctypes.c_void_p(host.ctypes.data).value or 0, array.nbytes)
