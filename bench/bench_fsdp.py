"""FSDP: per-rank memory and step time of ferro's strategies beside torch's own ``fully_shard`` over gloo.

A torch MLP of 16.8 M float32 parameters in 4 units (each unit is a block
``Linear(2048, 1024) -> ReLU -> Linear(1024, 2048)``), trained with Adam at
world size 4, each rank with one BLAS thread and its own batch of 16 rows.
Measured per rank, medians over steps and rounds:

* ``persistent MB``: every byte of tensor storage alive in the process right
  after ``optimizer.step()`` (parameters, gradients, Adam state, and whatever
  the wrapper keeps), found by walking the live objects, minus what was alive
  before the model was built. Measured, not computed from sizes;
* ``step ms``: forward + backward + optimizer step + zero_grad;
* for ferro ``FULL_SHARD``, the fraction of all-gather time that prefetch hid
  behind compute (1 - time the compute thread waited / time the gathers took),
  and the step time with prefetch off.

ferro's groups and torch's gloo both run over TCP on loopback (``--backend shm``
puts ferro on shared memory instead). Run: ``python bench/bench_fsdp.py
[--rounds 3] [--steps 6] [--world-size 4] [--load N]`` (``--load``: N matmul threads in every
rank beside the training, as on a busy cluster).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before NumPy loads: one core per rank
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from ferro.tools.bench.load import ComputeLoad  # noqa: E402

WIDTH, HIDDEN, UNITS, BATCH = 2048, 1024, 4, 16
FERRO_CONFIGS = [("ferro FULL_SHARD", "full_shard", True), ("ferro SHARD_GRAD_OP", "shard_grad_op", True),
                 ("ferro NO_SHARD", "no_shard", True), ("ferro FULL_SHARD, no prefetch", "full_shard", False)]
TORCH = "torch fully_shard (gloo)"


def make_model():
    import torch

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, WIDTH))
              for _ in range(UNITS)]
    return torch.nn.Sequential(*blocks)


def live_tensor_bytes() -> int:
    """Bytes of every distinct CPU tensor storage reachable from Python objects now."""
    import warnings

    import torch

    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated torch module attributes warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.device.type == "cpu"]
    for obj in tensors:
        try:
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses (DTensor) hold no storage themselves
            continue
        if pointer:
            storages[pointer] = max(storages.get(pointer, 0), storage.nbytes())
    return sum(storages.values())


def batch(rank: int):
    """This rank's input and target."""
    import torch

    rng = np.random.default_rng(rank)
    return [torch.from_numpy(rng.standard_normal((BATCH, WIDTH)).astype(np.float32)) for _ in range(2)]


def measure(model, optimizer, data, baseline: int, steps: int, barrier) -> tuple[float, int]:
    """Return the median time of a full training step and the persistent bytes above ``baseline``.

    The bytes are counted after one step's ``optimizer.step()``, with its gradients
    still held; ``zero_grad`` then drops them, as training does.
    """
    import torch

    x, y = data

    def step():
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    step()
    persistent = live_tensor_bytes() - baseline
    optimizer.zero_grad()
    if hasattr(model, "reset_comm_stats"):
        model.reset_comm_stats()  # ferro: time only the measured steps' gathers
    times = []
    for _ in range(steps):
        barrier()
        began = time.perf_counter()
        step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - began)
    return statistics.median(times), persistent


def rank_ferro(group, steps: int, strategy: str, prefetch: bool, load: int = 0) -> dict[str, float]:
    """One configuration in fresh processes, so nothing of another configuration is alive when memory is counted."""
    with ComputeLoad(load):  # --load: matmul threads beside the training, as on a busy cluster
        return _rank_ferro(group, steps, strategy, prefetch)


def _rank_ferro(group, steps: int, strategy: str, prefetch: bool) -> dict[str, float]:
    import torch

    import ferro

    torch.set_num_threads(1)
    data = batch(group.rank)
    baseline = live_tensor_bytes()
    model = ferro.FSDP(make_model(), group=group, sharding_strategy=strategy, forward_prefetch=prefetch,
                       auto_wrap_policy=lambda m: isinstance(m, torch.nn.Sequential) and len(m) == 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    elapsed, persistent = measure(model, optimizer, data, baseline, steps, group.barrier)
    stats = model.comm_stats()
    return {"step": elapsed, "memory": persistent, "hidden": stats["hidden_fraction"],
            "peak": stats["peak_unsharded_units"]}


def rank_torch(rank: int, world_size: int, steps: int, load: int = 0) -> dict[str, float]:
    with ComputeLoad(load):
        return _rank_torch(rank, world_size, steps)


def _rank_torch(rank: int, world_size: int, steps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    try:
        from torch.distributed.fsdp import fully_shard

        data = batch(rank)
        baseline = live_tensor_bytes()
        model = make_model()
        for block in model:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        elapsed, persistent = measure(model, optimizer, data, baseline, steps, dist.barrier)
        return {"step": elapsed, "memory": persistent}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from ferro.testing import run_processes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--backend", default="tcp", choices=["tcp", "shm"])
    parser.add_argument("--load", type=int, default=0, help="matmul threads per rank beside training (busy cores)")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {}
    memory: dict[str, list[float]] = {}
    hidden: list[float] = []
    peaks: list[float] = []
    for _ in range(args.rounds):
        for label, strategy, prefetch in FERRO_CONFIGS:
            ranks = run_processes(rank_ferro, args.world_size, args=(args.steps, strategy, prefetch, args.load),
                                  backend=args.backend, timeout=1800, group_timeout=600)
            if strategy == "full_shard" and prefetch:
                hidden += [r["hidden"] for r in ranks]
                peaks += [r["peak"] for r in ranks]
            times.setdefault(label, []).extend(r["step"] for r in ranks)
            memory.setdefault(label, []).extend(r["memory"] for r in ranks)
        ranks = run_processes(rank_torch, args.world_size, args=(args.steps, args.load), backend=None, timeout=1800)
        times.setdefault(TORCH, []).extend(r["step"] for r in ranks)
        memory.setdefault(TORCH, []).extend(r["memory"] for r in ranks)
    params = sum(p.numel() for p in make_model().parameters())
    print(f"# FSDP, {params / 1e6:.1f} M float32 parameters in {UNITS} units, world size {args.world_size}, "
          f"ferro over {args.backend}, torch over gloo; median of {args.rounds} rounds x {args.steps} steps "
          f"(step time: median over ranks and rounds; memory: the largest rank)"
          + (f"; beside {args.load} matmul thread(s) per rank" if args.load else ""))
    no_shard = max(memory["ferro NO_SHARD"])
    torch_step = statistics.median(times[TORCH])
    print(f"{'':<34}{'persistent MB/rank':>20}{'x NO_SHARD':>12}{'step ms':>10}{'torch / this':>14}")
    for key in [label for label, _, _ in FERRO_CONFIGS] + [TORCH]:
        step = statistics.median(times[key])
        print(f"{key:<34}{max(memory[key]) / 1e6:>20.1f}{max(memory[key]) / no_shard:>12.2f}{step * 1e3:>10.1f}"
              f"{torch_step / step:>14.2f}")
    print(f"all-gather time hidden by prefetch (FULL_SHARD): median {statistics.median(hidden):.0%} over ranks and "
          f"rounds; at most {max(peaks)} units gathered at once")
    return 0


if __name__ == "__main__":
    sys.exit(main())
