"""The TCP mesh's size thresholds: each collective with one algorithm, then the other, in one run.

For every world size, one set of ranks runs two meshes over the same connections,
differing only in a threshold, and alternates them round by round:

* ``all_gather``: the ring's n - 1 rounds (``bruck_bytes=0``) against Bruck's
  ceil(log2 n) (``bruck_bytes`` unbounded), by total bytes gathered;
* ``broadcast``: the pipelined chain (``chain_bytes=0``) against the binomial tree
  (``chain_bytes`` unbounded). The root steps back by one each call, so the new root
  is the rank the chain reaches last and every call waits for the one before: this
  is latency, not the throughput of back-to-back broadcasts from one root.

Time is per call on rank 0, the median of ``--repeats`` rounds. The defaults these
figures chose (``DEFAULT_BRUCK_BYTES``, ``DEFAULT_CHAIN_BYTES`` in
``ferro/_core/collectives.pyx``) are in DESIGN.md, "Choosing by size".

Run: ``python bench/bench_algorithms.py [--worlds 3,4,8] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

import ferro
from ferro._core.collectives import Mesh
from ferro._core.state import UNSET
from ferro.testing import run_processes

UNBOUNDED = 1 << 62
GATHER_TOTALS = [1024, 16 * 1024, 64 * 1024, 128 * 1024, 256 * 1024, 1024 * 1024]
BROADCAST_SIZES = [4, 1024, 16 * 1024, 64 * 1024, 256 * 1024]


def _use(group: Any, mesh: Mesh) -> None:
    """Run the group's next calls on ``mesh`` (its direct paths rebuilt on the next call)."""
    group._mesh = mesh
    group.state.set_direct(UNSET, UNSET, UNSET, UNSET)


def _per_call(fn: Any, total_bytes: int, group: Any) -> float:
    iterations = max(20, min(2000, int(2e7 // max(total_bytes, 1))))
    for i in range(5):
        fn(i)
    ferro.barrier(group=group)
    start = time.perf_counter()
    for i in range(iterations):
        fn(i)
    ferro.barrier(group=group)
    return (time.perf_counter() - start) / iterations


def _rank(group: Any, repeats: int) -> dict[str, float]:
    n, base = group.world_size, group._mesh
    meshes = {
        "gather ring": Mesh(base.connections, base.rank, base.chain_bytes, 0),
        "gather bruck": Mesh(base.connections, base.rank, base.chain_bytes, UNBOUNDED),
        "broadcast chain": Mesh(base.connections, base.rank, 0, base.bruck_bytes),
        "broadcast tree": Mesh(base.connections, base.rank, UNBOUNDED, base.bruck_bytes),
    }
    times: dict[str, list[float]] = {}
    try:
        for round_ in range(repeats):
            order = list(meshes) if round_ % 2 == 0 else list(meshes)[::-1]
            for name in order:
                _use(group, meshes[name])
                if name.startswith("gather"):
                    for total in GATHER_TOTALS:
                        part = np.ones(max(total // 4 // n, 1), np.float32)
                        out = np.empty(part.size * n, np.float32)
                        seconds = _per_call(lambda i, part=part, out=out: ferro.all_gather(part, out, group=group),
                                            total, group)
                        times.setdefault(f"{name} {total}", []).append(seconds)
                else:
                    for size in BROADCAST_SIZES:
                        data = np.ones(size // 4, np.float32)
                        seconds = _per_call(lambda i, data=data: ferro.broadcast(data, (-i) % n, group=group),
                                            size, group)
                        times.setdefault(f"{name} {size}", []).append(seconds)
    finally:
        _use(group, base)
    return {key: statistics.median(values) for key, values in times.items()}


def _table(world: int, medians: dict[str, float]) -> str:
    lines = [f"\n{world} ranks (us per call, median)",
             "| collective | bytes | first | second | second / first |", "| --- | ---: | ---: | ---: | ---: |"]
    for what, first, second, sizes in (("all_gather ring / Bruck", "gather ring", "gather bruck", GATHER_TOTALS),
                                       ("broadcast chain / tree", "broadcast chain", "broadcast tree",
                                        BROADCAST_SIZES)):
        for size in sizes:
            a, b = medians[f"{first} {size}"], medians[f"{second} {size}"]
            lines.append(f"| {what} | {size} | {a * 1e6:.1f} | {b * 1e6:.1f} | {b / a:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="3,4,8", help="comma-separated world sizes")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for world in (int(w) for w in args.worlds.split(",")):
        medians = run_processes(_rank, world, args=(args.repeats,), timeout=1800)[0]
        print(_table(world, medians), flush=True)


if __name__ == "__main__":
    main()
