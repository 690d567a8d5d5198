"""torch.distributed over "ferro" against torch.distributed over "gloo", in the same processes, same run.

Each rank joins the default group with ``init_process_group("ferro")`` and makes a
gloo group beside it (``new_group(backend="gloo")``). Measured at world size 2,
once with ferro on shared memory and once on TCP (``FERRO_BACKEND``):

* ``dist.all_reduce`` of float32 tensors at 4 B, 64 KiB and 16 MiB through each
  group, and ``ferro.allreduce`` of the same tensor on the ferro group underneath
  (the direct call, on the tensor's NumPy view), and ``ProcessGroupFerro.allreduce`` called as
  ``dist.all_reduce`` calls it (``pg call``): the wrapper's cost is the pg call minus the direct call, and
  ``dist.all_reduce`` adds torch's own Python layer on top (gloo pays that layer too);
* a torch ``DistributedDataParallel`` training step (forward, backward with
  buckets reduced during it, SGD step) of a 4-layer MLP of about 10.2 million
  float32 parameters (1600x1600 layers, batch 64), each rank on one thread.

Rounds alternate which group goes first; the table gives medians over rounds of
each round's median per call (or per step).

Run: ``python bench/bench_torch_backend.py [--rounds 5] [--steps 6] [--transports shm,tcp]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # two ranks share this machine's two cores

WIDTH, LAYERS, BATCH = 1600, 4, 64
# gloo's objects live until the process exits: torch 2.13 can deadlock destroying a gloo group or DDP reducer with
# the GIL held (its worker thread waits for the GIL to drop a finished work).
_KEEP_ALIVE: list = []
SIZES = (4, 64 * 1024, 16 * 1024 * 1024)


def _per_call(fn, calls: int, barrier) -> float:
    barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def rank_main(rank: int, world_size: int, rounds: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import ferro
    import ferro.interop.torch  # noqa: F401 - registers "ferro"

    torch.set_num_threads(1)
    dist.init_process_group("ferro", timeout=datetime.timedelta(seconds=600))
    gloo = dist.new_group(backend="gloo")
    ours = dist.distributed_c10d._get_default_group()
    group = ours.ferro_group
    barrier = lambda: dist.barrier(group=gloo)  # noqa: E731
    results: dict = {"backend": type(group).__name__, "allreduce": {}, "ddp": {}}
    for nbytes in SIZES:
        t = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        view = t.numpy()
        calls = int(min(4000, max(5, 2e8 / max(nbytes, 4096) / 20)))
        opts = dist.AllreduceOptions()
        opts.asyncOp = False  # as dist.all_reduce sets it for a blocking call
        cases = {"ferro": lambda t=t: dist.all_reduce(t),
                 "pg": lambda t=t, opts=opts: ours.allreduce([t], opts),
                 "gloo": lambda t=t: dist.all_reduce(t, group=gloo),
                 "direct": lambda x=view: ferro.allreduce(x, group=group)}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for round_ in range(rounds + 1):
            order = list(cases.items())
            for name, fn in order if round_ % 2 else order[::-1]:
                fn()  # warm-up (and the first round is a warm-up too)
                if round_:
                    times[name].append(_per_call(fn, calls, barrier))
        results["allreduce"][nbytes] = {name: statistics.median(v) for name, v in times.items()}

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(LAYERS):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)

    nets = {"ferro": torch.nn.parallel.DistributedDataParallel(model()),
            "gloo": torch.nn.parallel.DistributedDataParallel(model(), process_group=gloo)}
    results["parameters"] = sum(p.numel() for p in nets["ferro"].parameters())
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    step_times: dict[str, list[float]] = {name: [] for name in nets}
    for round_ in range(rounds + 1):
        order = list(nets.items())
        for name, net in order if round_ % 2 else order[::-1]:
            optimizer = torch.optim.SGD(net.parameters(), lr=1e-4)

            def step(net=net, optimizer=optimizer) -> None:
                optimizer.zero_grad()
                net(x).square().mean().backward()
                optimizer.step()

            step()
            if round_:
                step_times[name].append(statistics.median(_per_call(step, 1, barrier) for _ in range(steps)))
    results["ddp"] = {name: statistics.median(v) for name, v in step_times.items()}
    _KEEP_ALIVE.extend([gloo, nets])
    dist.destroy_process_group()
    return results


def _size(nbytes: int) -> str:
    return f"{nbytes // (1 << 20)} MiB" if nbytes >= 1 << 20 else f"{nbytes // 1024} KiB" if nbytes >= 1024 else \
        f"{nbytes} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--transports", default="shm,tcp")
    args = parser.parse_args(argv)
    from ferro.testing import run_processes

    for transport in args.transports.split(","):
        found = run_processes(rank_main, 2, args=(args.rounds, args.steps), backend=None, timeout=1800,
                              env={"FERRO_BACKEND": transport})[0]
        print(f"# torch.distributed over 'ferro' ({found['backend']}) vs 'gloo', 2 ranks, medians of {args.rounds} "
              f"rounds")
        print(f"{'all_reduce f32':>16}{'gloo us':>12}{'ferro us':>12}{'gloo/ferro':>12}{'direct us':>12}"
              f"{'pg call us':>12}{'wrapper us':>12}")
        for nbytes, t in found["allreduce"].items():
            print(f"{_size(nbytes):>16}{t['gloo'] * 1e6:>12.1f}{t['ferro'] * 1e6:>12.1f}{t['gloo'] / t['ferro']:>12.2f}"
                  f"{t['direct'] * 1e6:>12.1f}{t['pg'] * 1e6:>12.1f}{(t['pg'] - t['direct']) * 1e6:>12.1f}")
        ddp = found["ddp"]
        print(f"{'DDP step':>16}{ddp['gloo'] * 1e3:>10.1f}ms{ddp['ferro'] * 1e3:>10.1f}ms"
              f"{ddp['gloo'] / ddp['ferro']:>12.2f}   ({found['parameters'] / 1e6:.1f}M float32 parameters)")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
