"""DDP with every core computing: the step of a CPU cluster in training, beside gloo and Open MPI.

Each rank trains the same torch MLP (6 layers of 1024, 6.3 M float32 parameters,
25 MB of gradients, batch 128) with torch's intra-op threads on its share of the
cores (``--threads``, default: this host's cores / ranks, so every core computes),
and its gradients averaged while backward runs:

* ``torch DDP / ferro``: torch's own DistributedDataParallel over the "ferro"
  backend (``init_process_group("ferro")``, ferro's TCP or shared memory: ``--backend``);
* ``torch DDP / gloo``: the same over gloo;
* ``ferro.DDP``: ferro's DDP wrapping the torch model;
* ``mpi4py``: Open MPI under mpirun (torch's "mpi" backend is not in the PyPI wheels): each
  gradient's ``Iallreduce`` starts from a post-accumulate hook during backward and
  all complete before the step ends, the DDP pattern by hand.

Per library, in the same processes: the step without communication (``compute``),
then the DDP step; ``waiting`` = (step - compute) / step is the share of the step
spent on communication that backward did not hide. Medians over steps, then over
``--rounds`` interleaved rounds. Run: ``python bench/bench_busy_ddp.py [--rounds 3]
[--steps 10] [--backend tcp] [--threads N] [-n 2] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LAYERS, WIDTH, BATCH = 6, 1024, 128
LIBRARIES = ("torch DDP / ferro", "torch DDP / gloo", "ferro.DDP", "mpi4py")


def _model():  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(0)
    layers: list = []
    for i in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH)] + ([torch.nn.ReLU()] if i < LAYERS - 1 else [])
    return torch.nn.Sequential(*layers)


def _data(rank: int):  # type: ignore[no-untyped-def]
    import torch

    generator = torch.Generator().manual_seed(rank)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)


def _median_step(step, steps: int, barrier) -> float:  # type: ignore[no-untyped-def]
    step()  # warm-up: buckets, buffers, connections
    times = []
    for _ in range(steps):
        barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(model, wrapped, rank: int, steps: int, barrier) -> dict[str, float]:  # type: ignore[no-untyped-def]
    import torch

    x, y = _data(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    plain = _model()
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=1e-3)

    def compute() -> None:
        plain_optimizer.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(plain(x), y).backward()
        plain_optimizer.step()

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        if hasattr(wrapped, "finish"):
            wrapped.finish()
        optimizer.step()

    return {"compute": _median_step(compute, steps, barrier), "step": _median_step(step, steps, barrier)}


def rank_torch(rank: int, world_size: int, library: str, steps: int, threads: int) -> dict[str, float]:
    """torch's DDP over "ferro" or "gloo" (``run_processes`` with backend=None)."""
    import torch
    import torch.distributed as dist

    import ferro.interop.torch  # noqa: F401 - registers "ferro"

    torch.set_num_threads(threads)
    dist.init_process_group(library, timeout=datetime.timedelta(seconds=600))
    try:
        model = _model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return _measure(model, ddp, rank, steps, dist.barrier)
    finally:
        dist.destroy_process_group()


def rank_ferro_ddp(group, steps: int, threads: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """ferro.DDP around the torch model (``run_processes`` with a ferro backend)."""
    import torch

    import ferro

    torch.set_num_threads(threads)
    model = _model()
    return _measure(model, ferro.DDP(model, group=group), group.rank, steps, group.barrier)


class _MpiDdp:
    """Each gradient's Iallreduce starts as backward accumulates it; ``finish`` waits for all and averages."""

    def __init__(self, model, comm) -> None:  # type: ignore[no-untyped-def]
        from mpi4py import MPI

        self.model, self.comm, self.requests, self.mpi = model, comm, [], MPI
        for parameter in model.parameters():
            parameter.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, parameter) -> None:  # type: ignore[no-untyped-def]
        self.requests.append(self.comm.Iallreduce(self.mpi.IN_PLACE, parameter.grad.numpy(), op=self.mpi.SUM))

    def __call__(self, x):  # type: ignore[no-untyped-def]
        return self.model(x)

    def finish(self) -> None:
        self.mpi.Request.Waitall(self.requests)
        self.requests.clear()
        for parameter in self.model.parameters():
            parameter.grad.div_(self.comm.size)


def rank_mpi(steps: int, threads: int, out: str) -> None:
    """One rank under mpirun; rank 0 writes its figures to ``out``."""
    import torch
    from mpi4py import MPI

    torch.set_num_threads(threads)
    comm = MPI.COMM_WORLD
    model = _model()
    found = _measure(model, _MpiDdp(model, comm), comm.rank, steps, comm.Barrier)
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)


def _run(library: str, ranks: int, steps: int, threads: int, backend: str) -> dict[str, float] | None:
    from ferro.testing import run_processes

    env = {"FERRO_BACKEND": backend}
    if library == "ferro.DDP":
        return run_processes(rank_ferro_ddp, ranks, args=(steps, threads), backend=backend, timeout=1800,
                             group_timeout=600, env=env)[0]
    if library.startswith("torch DDP"):
        name = library.rsplit("/ ", 1)[1]
        return run_processes(rank_torch, ranks, args=(name, steps, threads), backend=None, timeout=1800, env=env)[0]
    from ferro.backend.mpi.launch import find_mpirun, mpirun_command, mpirun_environment

    mpirun = find_mpirun()
    if mpirun is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "mpi.json")
        transport = ["btl", "self,tcp"] if backend == "tcp" else []  # like for like with ferro's transport
        command = mpirun_command(ranks, [sys.executable, __file__, "--mpi-rank", out, "--steps", str(steps),
                                         "--threads", str(threads)], transport)
        done = subprocess.run(command, env=mpirun_environment(), capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not os.path.exists(out):
            print(f"# mpi4py run failed: {done.stderr[-800:]}", file=sys.stderr)
            return None
        with open(out) as f:
            return dict(json.load(f))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("-n", "--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    parser.add_argument("--backend", default="tcp", choices=("tcp", "shm"), help="ferro's (and MPI's) transport")
    parser.add_argument("--libraries", default=",".join(LIBRARIES), help=f"any of {', '.join(LIBRARIES)}")
    parser.add_argument("--json", help="write every round's figures here")
    parser.add_argument("--mpi-rank", help=argparse.SUPPRESS)  # the script as an mpirun rank
    args = parser.parse_args(argv)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.ranks)
    if args.mpi_rank:
        rank_mpi(args.steps, threads, args.mpi_rank)
        return 0
    libraries = [name for name in args.libraries.split(",") if name]
    unknown = [name for name in libraries if name not in LIBRARIES]
    if unknown:
        parser.error(f"--libraries takes {', '.join(LIBRARIES)}; got {unknown[0]!r}")
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in libraries}
    for round_number in range(args.rounds):
        for name in libraries:
            found = _run(name, args.ranks, args.steps, threads, args.backend)
            if found is not None:
                rounds[name].append(found)
            print(f"# round {round_number + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
    print(f"# DDP step, {args.ranks} ranks x {threads} torch thread(s) on {os.cpu_count()} cores, "
          f"{LAYERS}x{WIDTH} MLP, batch {BATCH}, transport {args.backend}; median of {args.rounds} rounds x "
          f"{args.steps} steps")
    print(f"{'library':<20}{'step ms':>10}{'compute ms':>12}{'waiting':>9}{'step / ferro':>14}")
    reference = rounds.get("torch DDP / ferro") or rounds.get("ferro.DDP")
    ours = statistics.median(r["step"] for r in reference) if reference else None
    for name, found in rounds.items():
        if not found:
            print(f"{name:<20}{'(not run: not installed)':>35}")
            continue
        step = statistics.median(r["step"] for r in found)
        compute = statistics.median(r["compute"] for r in found)
        ratio = f"{step / ours:>13.2f}x" if ours else ""
        print(f"{name:<20}{step * 1e3:>10.1f}{compute * 1e3:>12.1f}{max(0.0, (step - compute) / step):>9.0%}{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
