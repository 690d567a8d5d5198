"""Checkpoint throughput: ferro.checkpoint beside a raw write()/read() of the same bytes and torch's DCP over gloo.

The state is ``--mb`` MiB of float32 (default 1024) in 16 tensors, each sharded
flat over the ranks as FSDP shards it: ferro saves ``ShardedEntry`` pieces,
torch's ``torch.distributed.checkpoint`` saves DTensors (``Shard(0)`` on a CPU
mesh) holding the same local bytes. Per round and world size, in one run:

* raw write: each rank ``write()``s its bytes to one file and ``fsync``s it (what
  a durable checkpoint must do at least); raw read: ``readinto()`` a buffer;
* ferro ``save`` / ``load`` (checksums, metadata commit, fsyncs included);
* DCP ``save`` / ``load`` (its default FileSystemWriter, which fsyncs too);
* ferro ``async_save``: the blocking part (staging copy), and the time to commit.

Each figure is timed on rank 0 from a barrier before to a barrier after; the
table gives the median over rounds and GB/s of the whole state. Loads read
files just written (the page cache), for all three alike. Every load is checked
against the saved values after its timing.
Run: ``python bench/bench_checkpoint.py [--mb 1024] [--rounds 3] [--worlds 1 4]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

TENSORS = 16
LABELS = ["raw write+fsync", "ferro save", "DCP save", "ferro async_save (blocking)", "ferro async_save (commit)",
          "raw read", "ferro load", "DCP load"]


def timed(group, fn) -> float:
    import ferro

    ferro.barrier(group=group)
    start = time.perf_counter()
    fn()
    ferro.barrier(group=group)
    return time.perf_counter() - start


def rank_bench(group, mb: int, rounds: int, root: str, torch_port: int) -> dict[str, list[float]] | None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ferro
    from ferro.parallel.fsdp import ShardedEntry

    rank, world = group.rank, group.world_size
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{torch_port}")
    mesh = init_device_mesh("cpu", (world,))
    numel = mb * (1 << 20) // 4 // TENSORS
    share = numel // world
    rng = np.random.default_rng(rank)
    local = {f"layer{i}.weight": rng.standard_normal(share, dtype=np.float32) for i in range(TENSORS)}

    def ferro_state(arrays):
        return {"model": {k: ShardedEntry(v, (numel,), rank * share, (rank + 1) * share) for k, v in arrays.items()}}

    def dcp_state(arrays):
        return {"model": {k: DTensor.from_local(torch.from_numpy(v), mesh, [Shard(0)], run_check=False,
                                                shape=torch.Size([numel]), stride=(1,)) for k, v in arrays.items()}}

    times: dict[str, list[float]] = {label: [] for label in LABELS}
    for round_index in range(rounds):
        where = os.path.join(root, f"round{round_index}")
        one_round(group, where, local, ferro_state, dcp_state, times)
        ferro.barrier(group=group)
        if rank == 0:
            shutil.rmtree(where)
    dist.destroy_process_group()
    return times if rank == 0 else None


def one_round(group, where: str, local: dict[str, np.ndarray], ferro_state, dcp_state,
              times: dict[str, list[float]]) -> None:
    import torch.distributed.checkpoint as dcp

    import ferro
    from ferro import checkpoint

    rank = group.rank
    raw = os.path.join(where, "raw", f"rank{rank}.bin")
    os.makedirs(os.path.dirname(raw), exist_ok=True)

    def raw_write():
        with open(raw, "wb") as f:
            for array in local.values():
                f.write(memoryview(array))
            f.flush()
            os.fsync(f.fileno())

    times["raw write+fsync"].append(timed(group, raw_write))
    times["ferro save"].append(timed(group, lambda: checkpoint.save(ferro_state(local), f"{where}/ferro", group)))
    times["DCP save"].append(timed(group, lambda: dcp.save(dcp_state(local), checkpoint_id=f"{where}/dcp")))

    pending = []
    blocking = timed(group, lambda: pending.append(checkpoint.async_save(ferro_state(local), f"{where}/async", group)))
    start = time.perf_counter()
    pending[0].result()
    ferro.barrier(group=group)
    times["ferro async_save (blocking)"].append(blocking)
    times["ferro async_save (commit)"].append(blocking + time.perf_counter() - start)

    targets = {k: np.empty_like(v) for k, v in local.items()}

    def raw_read():
        with open(raw, "rb") as f:
            for array in targets.values():
                f.readinto(memoryview(array))

    times["raw read"].append(timed(group, raw_read))
    ferro_targets = {k: np.zeros_like(v) for k, v in local.items()}
    times["ferro load"].append(timed(group, lambda: checkpoint.load(ferro_state(ferro_targets), f"{where}/ferro",
                                                                    group)))
    dcp_targets = {k: np.zeros_like(v) for k, v in local.items()}
    times["DCP load"].append(timed(group, lambda: dcp.load(dcp_state(dcp_targets), checkpoint_id=f"{where}/dcp")))
    for name, value in local.items():
        assert np.array_equal(ferro_targets[name], value) and np.array_equal(dcp_targets[name], value), name


def main(argv: list[str] | None = None) -> int:
    from ferro.rendezvous.settings import free_port
    from ferro.testing import run_processes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1024, help="MiB of state (default 1024)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    gib = args.mb / 1024
    print(f"checkpoint of {args.mb} MiB float32 ({TENSORS} tensors, sharded flat over the ranks); median of "
          f"{args.rounds} rounds; ferro over TCP, DCP over gloo; {os.cpu_count()} cores")
    for world in args.worlds:
        root = tempfile.mkdtemp(prefix="ferro-ckpt-bench-", dir=args.dir)
        try:
            times = run_processes(rank_bench, world, args=(args.mb, args.rounds, root, free_port()),
                                  timeout=3600)[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(f"\n{world} rank{'s' if world > 1 else ''}")
        print(f"  {'':30s} {'seconds':>8s} {'GiB/s':>7s}  {'vs raw':>6s}  {'vs DCP':>6s}")
        medians = {label: statistics.median(values) for label, values in times.items()}
        for label in LABELS:
            seconds = medians[label]
            raw = medians["raw read" if "load" in label or "read" in label else "raw write+fsync"]
            dcp = medians["DCP load" if "load" in label or "read" in label else "DCP save"]
            print(f"  {label:30s} {seconds:8.3f} {gib / seconds:7.2f}  {raw / seconds:6.2f}  {dcp / seconds:6.2f}")
        print("  rounds: " + "; ".join(f"{label}: {', '.join(f'{v:.2f}' for v in values)}"
                                      for label, values in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
