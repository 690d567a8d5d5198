"""NCCL on a real GPU: every collective and dtype against torch, several ranks, the hybrid group, and the abort
of a killed rank. Skipped, with the reason, where there is no CUDA GPU, no CUDA build of torch, or no libnccl.
"""

import os
import time

import numpy as np
import pytest

import ferro
from ferro.errors import BackendUnavailableError, DistributedError
from ferro.testing import run_processes


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU (or a CPU build of torch)"
    try:
        from ferro.backend.nccl import require_nccl

        require_nccl("nccl")
    except BackendUnavailableError as exc:
        return str(exc)
    return None


REASON = _gpu_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs a GPU with NCCL: {REASON}")

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]


def _every_collective(group, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    n, r = group.world_size, group.rank
    device = torch.device("cuda", group.device_collectives.device)
    base = torch.arange(8 * n, device=device).to(dtype)
    failures = []

    def expect(name, got, want):
        if not torch.equal(got.cpu(), want.cpu()):
            failures.append(f"{name}: {got.cpu().tolist()} != {want.cpu().tolist()}")

    x = base + r
    ferro.allreduce(x, group=group)
    expect("allreduce", x, sum(base + k for k in range(n)))
    if dtype.is_floating_point:
        x = base + r
        ferro.allreduce(x, ferro.ReduceOp.MEAN, group=group)
        expect("allreduce mean", x, sum((base + k).double() for k in range(n)).div(n).to(dtype))
    x = base + r
    ferro.allreduce(x, ferro.ReduceOp.MAX, group=group)
    expect("allreduce max", x, base + (n - 1))
    x = base + r
    ferro.broadcast(x, root=n - 1, group=group)
    expect("broadcast", x, base + (n - 1))
    x = base + r
    ferro.reduce(x, dst=0, group=group)
    if r == 0:
        expect("reduce", x, sum(base + k for k in range(n)))
    expect("all_gather", ferro.all_gather(base + r, group=group), torch.cat([base + k for k in range(n)]))
    rows = (base + r).reshape(n, 8)
    reduced = sum((base + k).reshape(n, 8) for k in range(n))
    expect("reduce_scatter", ferro.reduce_scatter(rows, group=group), reduced[r:r + 1])
    blocks = torch.stack([(base + k).reshape(n, 8)[r] for k in range(n)])
    expect("all_to_all", ferro.all_to_all(rows, group=group), blocks)
    work = ferro.allreduce(base + r, group=group, async_op=True)
    expect("async allreduce", work.wait(), sum(base + k for k in range(n)))
    if n > 1:
        mine, theirs = base + r, torch.empty_like(base)
        if r == 0:
            ferro.send(mine, dst=1, group=group)
        elif r == 1:
            ferro.recv_into(theirs, src=0, group=group)
            expect("send/recv", theirs, base)
    ferro.barrier(group=group)
    torch.cuda.synchronize()
    return failures


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_collective_on_one_rank(dtype):
    assert run_processes(_every_collective, 1, backend="nccl", args=(dtype,), timeout=180) == [[]]


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def test_every_collective_on_two_ranks():
    from ferro.backend.nccl import nccl_version

    env = {}
    if _gpu_count() < 2:
        if nccl_version() < (2, 30, 0):
            pytest.skip(f"one GPU, and NCCL {nccl_version()} refuses two ranks on one GPU (Duplicate GPU detected; "
                        f"NCCL 2.30 and newer accept it with NCCL_MULTI_RANK_GPU_ENABLE=1)")
        env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "CUDA_VISIBLE_DEVICES": "0"}
    assert run_processes(_every_collective, 2, backend="nccl", args=("float32",), env=env, timeout=180) == [[], []]


def _hybrid(group):
    import torch

    host = np.full(3, group.rank + 1.0)
    ferro.allreduce(host, group=group)
    gpu = torch.full((3,), group.rank + 1.0, device="cuda")
    ferro.allreduce(gpu, group=group)
    torch.cuda.synchronize()
    return host.tolist(), gpu.cpu().tolist()


def test_hybrid_group_on_the_gpu():
    if _gpu_count() < 2:
        pytest.skip("the hybrid test runs two ranks: it needs two GPUs")
    assert run_processes(_hybrid, 2, backend="hybrid", timeout=180) == [([3.0] * 3, [3.0] * 3)] * 2


def _killed_peer(group):
    import torch

    if group.rank == 1:
        os._exit(9)
    time.sleep(2)
    x = torch.ones(1 << 20, device="cuda")
    try:
        ferro.allreduce(x, group=group, async_op=True, timeout=5).synchronize()
    except DistributedError as exc:
        return type(exc).__name__, str(exc)
    return "completed", ""


def test_a_killed_rank_aborts_the_communicator_and_is_named():
    if _gpu_count() < 2:
        pytest.skip("needs two GPUs for two ranks")
    kind, message = run_processes(_killed_peer, 2, backend="nccl", timeout=180, allow_exit=[1],
                                  env={"FERRO_NCCL_HEARTBEAT_S": "0.3"})[0]
    assert kind != "completed" and "rank 1" in message, message
