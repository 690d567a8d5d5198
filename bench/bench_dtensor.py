"""DTensor redistribution beside the one collective it runs, and SyncBatchNorm beside local BatchNorm; same run.

At world size 2 (``--transports shm,tcp``), float32:

* ``redistribute``: ``DTensor.redistribute`` of a 1024 x 1024 tensor (4 MiB) and
  of an uneven 1023 x 1023 one, per change of placement, next to the bare ferro
  collective on the same bytes (``all_gather`` of the local piece, ``allreduce``
  in place, ``reduce_scatter`` of the whole, ``all_to_all_single_uneven`` of the
  flat piece). The difference is what redistribution adds: moving the sharded
  dimension to the front and back (copies), padding uneven chunks, and a copy
  of a Partial before it is reduced (the source DTensor keeps its terms).
* ``SyncBatchNorm``: forward + backward of a (16, 32, 16, 16) input per rank (a
  small CNN's activation), torch's local ``BatchNorm2d`` against ferro's
  synchronised layer (``convert_sync_batchnorm``), and ferro.nn's
  ``BatchNorm2d`` against ``ferro.SyncBatchNorm``.

Each figure is the median over rounds of each round's median per call;
rounds alternate which of a pair goes first. Run: ``python bench/bench_dtensor.py
[--rounds 5] [--calls 20] [--transports shm,tcp]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # two ranks share two cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

CASES = ["Shard(0) -> Replicate", "Shard(1) -> Replicate", "Partial -> Replicate", "Partial -> Shard(0)",
         "Shard(0) -> Shard(1)"]
SIDES = (1024, 1023)
BN_SHAPE = (16, 32, 16, 16)


def _median_call(fn, calls: int, group) -> float:
    import ferro

    ferro.barrier(group=group)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pairs(group, side: int):
    """For each case: (redistribute call, bare collective call) on the same data."""
    import ferro
    from ferro.dtensor import Partial, Replicate, Shard, distribute_tensor

    mesh = ferro.init_device_mesh((group.world_size,), group=group)
    full = np.random.default_rng(0).standard_normal((side, side)).astype(np.float32)
    s0, s1 = distribute_tensor(full, mesh, [Shard(0)]), distribute_tensor(full, mesh, [Shard(1)])
    partial = distribute_tensor(full, mesh, [Partial()])
    flat = s0.to_local().reshape(-1)
    chunk = -(-side // group.world_size)  # torch.chunk's rows per rank; the last rank may hold fewer
    rows = [min(chunk, side - i * chunk) for i in range(group.world_size)]
    columns = rows  # a square tensor: Shard(1) splits the columns the same way
    counts = [rows[group.rank] * c for c in columns]  # the blocks the all_to_all of Shard(0) -> Shard(1) moves
    receives = [r * columns[group.rank] for r in rows]
    padded_piece = np.zeros((chunk, side), np.float32)  # what all_gather moves once chunks are padded equal
    padded_full = np.zeros((chunk * group.world_size, side), np.float32)
    buffer = full.copy()
    return {
        "Shard(0) -> Replicate": (lambda: s0.redistribute([Replicate()]),
                                  lambda: ferro.all_gather(padded_piece, group=group)),
        "Shard(1) -> Replicate": (lambda: s1.redistribute([Replicate()]),
                                  lambda: ferro.all_gather(padded_piece, group=group)),
        "Partial -> Replicate": (lambda: partial.redistribute([Replicate()]),
                                 lambda: ferro.allreduce(buffer, group=group)),
        "Partial -> Shard(0)": (lambda: partial.redistribute([Shard(0)]),
                                lambda: ferro.reduce_scatter(padded_full, group=group)),
        "Shard(0) -> Shard(1)": (lambda: s0.redistribute([Shard(1)]),
                                 lambda: ferro.all_to_all_single_uneven(flat, counts, receives, group=group)),
    }


def _batch_norm_pairs(group):
    import torch

    import ferro
    from ferro import nn

    torch.manual_seed(group.rank)
    x = torch.randn(BN_SHAPE, requires_grad=True)
    dy = torch.randn(BN_SHAPE)
    local = torch.nn.BatchNorm2d(BN_SHAPE[1])
    synced = ferro.convert_sync_batchnorm(torch.nn.BatchNorm2d(BN_SHAPE[1]), group=group)

    def torch_step(layer):
        def step():
            layer(x).backward(dy)
        return step

    xn, dyn = x.detach().numpy().copy(), dy.numpy().copy()
    nn_local, nn_sync = nn.BatchNorm2d(BN_SHAPE[1]), ferro.SyncBatchNorm(BN_SHAPE[1], group=group)

    def ferro_step(layer):
        def step():
            layer(xn)
            layer.backward(dyn)
        return step

    return {"torch BatchNorm2d": (torch_step(synced), torch_step(local)),
            "ferro.nn BatchNorm2d": (ferro_step(nn_sync), ferro_step(nn_local))}


def rank_main(group, rounds: int, calls: int) -> dict:
    import torch

    torch.set_num_threads(1)
    pairs = {f"{case} {side}x{side}": pair for side in SIDES for case, pair in _pairs(group, side).items()}
    pairs.update(_batch_norm_pairs(group))
    found: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in pairs}
    for round_ in range(rounds):
        for name, (ours, bare) in pairs.items():
            order = [(0, ours), (1, bare)] if round_ % 2 == 0 else [(1, bare), (0, ours)]
            for slot, fn in order:
                fn()  # warm up
                found[name][slot].append(_median_call(fn, calls, group))
    return found


def main(argv: list[str] | None = None) -> int:
    from ferro.testing import run_processes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--transports", default="shm,tcp")
    args = parser.parse_args(argv)
    for transport in args.transports.split(","):
        ranks = run_processes(rank_main, 2, args=(args.rounds, args.calls), backend=transport, timeout=1800,
                              group_timeout=600)
        print(f"\n# world size 2 over {transport}, float32; median of {args.rounds} rounds x {args.calls} calls "
              f"(rank 0)")
        print(f"{'':<34}{'ferro ms':>10}{'bare ms':>10}{'ferro / bare':>14}")
        for name, (ours, bare) in ranks[0].items():
            a, b = statistics.median(ours) * 1e3, statistics.median(bare) * 1e3
            label = name if "BatchNorm" not in name else f"{name}: sync vs local"
            print(f"{label:<34}{a:>10.3f}{b:>10.3f}{a / b:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
