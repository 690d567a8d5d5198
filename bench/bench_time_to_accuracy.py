"""Time to accuracy on a slow link: torch DDP over gloo beside ferro's DDP, its compression hooks and DiLoCo.

An MLP of about 25 M parameters (64-4096-4096-2048-10, float32: 102 MB of
gradients a step) learns scikit-learn's bundled digits on an emulated cluster
of 2 hosts x 2 ranks joined by 1 Gbit links (network namespaces, tbf; see
``ferro/tools/emulate.py``). Every method runs the same steps from the same
initial values on the same batches (a global batch of 4 x 32, each rank its
quarter), with SGD (momentum 0.9) as the optimizer (DiLoCo's inner one), and
rank 0 evaluates the test set every ``--eval-every`` steps, off the clock.

Methods: ``gloo`` (torch DDP over gloo), ``torch-ferro`` (torch DDP over the
"ferro" backend), ``ferro`` (ferro.DDP, exact), ``bf16``, ``int8``
(``Int8CompressHook``), ``powersgd`` (``PowerSGDHook``, rank 8, exact for the
first 10 steps), ``diloco`` (H inner steps, outer Nesterov SGD 0.7/0.9) and ``streaming`` (the same in 4
fragments at staggered steps, each allreduce overlapped with 2 inner steps); ``diloco-h20`` and the like
name their own H (else ``--sync-every``). ``alone`` trains each rank apart with no communication at all:
its time per step is the floor of every method's on this machine (rank 0's accuracy is its own model's, trained
on a quarter of the data).

Needs root (namespaces) and torch + scikit-learn. Run it on a quiet machine:
``python bench/bench_time_to_accuracy.py [--steps 300] [--target 0.95] [--methods gloo,ferro,...] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HIDDEN = (4096, 4096, 2048)
BATCH_PER_RANK = 32
METHODS = ("gloo", "torch-ferro", "ferro", "bf16", "int8", "powersgd", "diloco", "streaming", "alone")


def digits():
    """The digits, scaled to [0, 1], split 80/20 with a fixed seed."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = (data.data / 16.0).astype(np.float32), data.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    cut = int(0.8 * len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def mlp():
    import torch

    torch.manual_seed(0)
    layers, width = [], 64
    for hidden in HIDDEN:
        layers += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def rank_main(method: str, steps: int, out: str, eval_every: int, sync_every: int, lr: float) -> None:
    """One rank's training; rank 0 writes what it measured to ``out``."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import ferro
    import ferro.interop.torch  # noqa: F401 - registers "ferro" with torch
    from ferro.parallel import DiLoCo, Int8CompressHook, PowerSGDHook, bf16_compress_hook

    torch.set_num_threads(1)  # 4 ranks share the machine's cores
    name, (method, sync_every) = method, method_and_h(method, sync_every)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    x_train, y_train, x_test, y_test = digits()
    model = mlp()
    diloco = None
    if method == "gloo":
        address = f"tcp://{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
        net = torch.nn.parallel.DistributedDataParallel(model)
    elif method == "torch-ferro":
        address = f"tcp://{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
        dist.init_process_group("ferro", init_method=address, rank=rank, world_size=world)
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        ferro.init_process_group(timeout=600)
        hooks = {"ferro": None, "bf16": bf16_compress_hook, "int8": Int8CompressHook(),
                 "powersgd": PowerSGDHook(matrix_approximation_rank=8, start_powerSGD_iter=10)}
        if method == "alone":  # no communication at all: the floor every method's step time has on this machine
            net = model
        elif method == "diloco":
            net, diloco = model, DiLoCo(model, sync_every=sync_every)
        elif method == "streaming":  # streaming DiLoCo: 4 fragments at staggered steps, each allreduce overlapped
            net, diloco = model, DiLoCo(model, sync_every=sync_every, fragments=4, overlap_steps=2)
        else:
            net = ferro.DDP(model, comm_hook=hooks[method])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss()
    step_times, records, clock = [], [], 0.0
    for step in range(1, steps + 1):
        chosen = np.random.default_rng([1, step]).choice(len(y_train), BATCH_PER_RANK * world, replace=False)
        mine = chosen[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
        x, y = torch.from_numpy(x_train[mine]), torch.from_numpy(y_train[mine])
        start = time.perf_counter()
        optimizer.zero_grad()
        criterion(net(x), y).backward()
        optimizer.step()
        if diloco is not None:
            diloco.step()
            if step == steps:
                diloco.sync()  # finish the allreduces in flight and agree: the last figure is the agreed model's
        took = time.perf_counter() - start
        step_times.append(took)
        clock += took
        # DiLoCo's ranks agree only at a synchronisation: evaluate there (streaming: where every fragment has
        # landed, so rank 0's model is the agreed one up to the fragments' mixing).
        due = step % eval_every == 0 and (diloco is None or step % sync_every == 0)
        if rank == 0 and (due or step == steps):
            with torch.no_grad():
                accuracy = float((model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())
            records.append((step, clock, accuracy))
            print(f"[{name}] step {step}: {accuracy:.4f} after {clock:.1f} s", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"method": name, "steps": steps, "step_seconds": statistics.median(step_times),
                       "records": records}, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    if ferro.is_initialized():
        ferro.destroy_process_group()


def method_and_h(name: str, sync_every: int) -> tuple[str, int]:
    """``diloco-h20`` -> (``diloco``, 20): a DiLoCo method may name its own H; others take ``--sync-every``."""
    base, _, h = name.rpartition("-h")
    if base in ("diloco", "streaming") and h.isdigit():
        return base, int(h)
    return name, sync_every


def summary(results: list[dict], target: float) -> str:
    """The table: per method, time per step, time to ``target``, its speed-up on gloo, final accuracy."""
    reached = {r["method"]: next((t for _, t, a in r["records"] if a >= target), None) for r in results}
    gloo = reached.get("gloo")
    lines = [f"| method | s / step | to {target:.0%} (s) | vs gloo | final accuracy |", "|---|---:|---:|---:|---:|"]
    for r in results:
        t = reached[r["method"]]
        speedup = f"{gloo / t:.2f}x" if t and gloo else "-"
        lines.append(f"| {r['method']} | {r['step_seconds']:.3f} | {t:.1f} |" if t else
                     f"| {r['method']} | {r['step_seconds']:.3f} | not reached |")
        lines[-1] += f" {speedup} | {r['records'][-1][2]:.4f} |"
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--sync-every", type=int, default=10, help="DiLoCo's H")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--emulate", default="2x2@1gbit")
    parser.add_argument("--json", default=None, help="write every method's records here")
    parser.add_argument("--rank-main", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.rank_main, args.steps, args.out, args.eval_every, args.sync_every, args.lr)
        return 0
    from ferro.tools.emulate import EmulatedCluster, cluster_unavailable, parse_emulation

    reason = cluster_unavailable()
    if reason:
        print(f"bench_time_to_accuracy: {reason}", file=sys.stderr)
        return 2
    hosts, ranks, rate = parse_emulation(args.emulate)
    results = []
    with EmulatedCluster(hosts, rate) as cluster, tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            out = os.path.join(tmp, f"{method}.json")
            code = cluster.run_job(ranks, [os.path.abspath(__file__), "--rank-main", method, "--out", out,
                                           "--steps", str(args.steps), "--eval-every", str(args.eval_every),
                                           "--sync-every", str(args.sync_every), "--lr", str(args.lr)])
            if code or not os.path.exists(out):
                print(f"# {method}: failed (exit {code})", file=sys.stderr)
                continue
            with open(out) as f:
                results.append(json.load(f))
    widths = (64, *HIDDEN, 10)
    parameters = sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))
    print(f"# {args.emulate}: {parameters / 1e6:.1f} M parameters, {args.steps} steps of {hosts * ranks} x "
          f"{BATCH_PER_RANK}, SGD lr {args.lr} momentum 0.9; DiLoCo H={args.sync_every}")
    print(summary(results, args.target))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
