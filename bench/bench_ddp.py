"""DDP: gradient sync against a raw allreduce, overlap of communication with backward, and torch DDP beside it.

A 4-layer MLP of about 10 million float32 parameters (1600x1600 layers) at
world size 2 on loopback, each rank with one BLAS thread (two ranks share this
machine's two cores). Measured, median over steps and rounds:

* ``raw allreduce``: one ferro.allreduce of a buffer as large as all gradients;
* ``sync_gradients``: DDP averaging gradients already computed (no overlap),
  whose target is to be within 10% of the raw allreduce;
* ``compute``: forward + backward of the model alone, no communication;
* ``DDP step``: forward + backward with DDP, buckets reduced during backward;
  ``hidden`` = (compute + raw allreduce - DDP step) / raw allreduce is the
  fraction of communication that overlapped with compute;
* the same with the model in PyTorch: ferro.DDP on it, and torch's own
  DistributedDataParallel over gloo, in the same run.

Run: ``python bench/bench_ddp.py [--rounds 3] [--steps 8] [--load N]`` (``--load``: N matmul
threads in every rank beside the training, as on a busy cluster; ``bench/bench_busy_ddp.py``
measures DDP with torch itself on every core, beside gloo and Open MPI).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before NumPy loads: one core per rank
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from ferro.tools.bench.load import ComputeLoad  # noqa: E402

WIDTH, LAYERS, BATCH = 1600, 4, 64


def _median_time(fn, steps: int, barrier) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rank_ferro(group, steps: int, load: int = 0) -> dict[str, float]:
    with ComputeLoad(load):  # --load: matmul threads beside the training, as on a busy cluster
        return _rank_ferro(group, steps)


def _rank_ferro(group, steps: int) -> dict[str, float]:
    import torch

    import ferro
    from ferro import nn

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    grad_out = rng.standard_normal((BATCH, WIDTH)).astype(np.float32) / BATCH

    def mlp():
        layers = []
        for i in range(LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH, rng=np.random.default_rng(i))] + ([nn.ReLU()] if i < LAYERS - 1 else [])
        return nn.Sequential(*layers)

    plain, model = mlp(), mlp()
    ddp = ferro.DDP(model, group=group)
    n_params = sum(p.data.size for p in model.parameters())
    raw = np.ones(n_params, np.float32)
    results = {"params": float(n_params)}
    results["raw allreduce"] = _median_time(lambda: ferro.allreduce(raw, group=group), steps, group.barrier)
    results["sync_gradients"] = _median_time(ddp.sync_gradients, steps, group.barrier)

    def compute():
        plain(x)
        plain.backward(grad_out)

    def ddp_step():
        ddp(x)
        ddp.backward(grad_out)

    results["compute"] = _median_time(compute, steps, group.barrier)
    results["DDP step"] = _median_time(ddp_step, steps, group.barrier)

    def torch_mlp():
        torch.manual_seed(0)
        layers = []
        for i in range(LAYERS):
            layers += [torch.nn.Linear(WIDTH, WIDTH)] + ([torch.nn.ReLU()] if i < LAYERS - 1 else [])
        return torch.nn.Sequential(*layers)

    tx, tg = torch.from_numpy(x), torch.from_numpy(grad_out)
    tplain, tmodel = torch_mlp(), torch_mlp()
    tddp = ferro.DDP(tmodel, group=group)

    def torch_compute():
        tplain.zero_grad(set_to_none=False)
        tplain(tx).backward(tg)

    def torch_ferro_step():
        tmodel.zero_grad(set_to_none=False)
        tddp(tx).backward(tg)

    results["torch compute"] = _median_time(torch_compute, steps, group.barrier)
    results["torch model, ferro.DDP step"] = _median_time(torch_ferro_step, steps, group.barrier)
    return results


def rank_torch_ddp(rank: int, world_size: int, steps: int, load: int = 0) -> dict[str, float]:
    with ComputeLoad(load):
        return _rank_torch_ddp(rank, world_size, steps)


def _rank_torch_ddp(rank: int, world_size: int, steps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    try:
        torch.manual_seed(0)
        layers = []
        for i in range(LAYERS):
            layers += [torch.nn.Linear(WIDTH, WIDTH)] + ([torch.nn.ReLU()] if i < LAYERS - 1 else [])
        model = DistributedDataParallel(torch.nn.Sequential(*layers))
        rng = np.random.default_rng(0)
        tx = torch.from_numpy(rng.standard_normal((BATCH, WIDTH)).astype(np.float32))
        tg = torch.from_numpy(rng.standard_normal((BATCH, WIDTH)).astype(np.float32) / BATCH)
        n_params = sum(p.numel() for p in model.parameters())
        raw = torch.ones(n_params)

        def step():
            model.zero_grad(set_to_none=False)
            model(tx).backward(tg)

        return {"torch DDP (gloo) step": _median_time(step, steps, dist.barrier),
                "gloo raw allreduce": _median_time(lambda: dist.all_reduce(raw), steps, dist.barrier)}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from ferro.testing import run_processes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--load", type=int, default=0, help="matmul threads per rank beside training (busy cores)")
    args = parser.parse_args(argv)
    rounds: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        ours = run_processes(rank_ferro, 2, args=(args.steps, args.load), timeout=900, group_timeout=300)[0]
        theirs = run_processes(rank_torch_ddp, 2, args=(args.steps, args.load), backend=None, timeout=900)[0]
        for key, value in {**ours, **theirs}.items():
            rounds.setdefault(key, []).append(value)
    m = {key: statistics.median(values) for key, values in rounds.items()}
    raw, sync = m["raw allreduce"], m["sync_gradients"]
    hidden = (m["compute"] + raw - m["DDP step"]) / raw
    torch_hidden = (m["torch compute"] + raw - m["torch model, ferro.DDP step"]) / raw
    print(f"# DDP, {m['params'] / 1e6:.1f} M float32 parameters ({m['params'] * 4 / 1e6:.0f} MB of gradients), "
          f"2 ranks on loopback, median of {args.rounds} rounds x {args.steps} steps"
          + (f", beside {args.load} matmul thread(s) per rank" if args.load else ""))
    for key in ["raw allreduce", "sync_gradients", "compute", "DDP step", "torch compute",
                "torch model, ferro.DDP step", "torch DDP (gloo) step", "gloo raw allreduce"]:
        print(f"{key:<30}{m[key] * 1e3:>10.1f} ms")
    print(f"sync_gradients / raw allreduce: {sync / raw:.3f} (target: within 1.10)")
    print(f"communication hidden behind backward: ferro.nn {max(0.0, min(1.0, hidden)):.0%}, "
          f"torch model {max(0.0, min(1.0, torch_hidden)):.0%}")
    print(f"torch DDP (gloo) step / ferro.DDP step on the torch model: "
          f"{m['torch DDP (gloo) step'] / m['torch model, ferro.DDP step']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
