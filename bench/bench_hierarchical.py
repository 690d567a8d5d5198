"""Hierarchical allreduce across two "hosts" (network namespaces) beside a flat TCP mesh.

Creates two network namespaces joined by a veth pair (needs root and iproute2's
``ip``), puts half of the ranks in each, and times allreduce on
``HierarchicalBackend`` (shared memory inside each namespace, TCP between the two
leaders) and on ``TcpBackend`` over the same ranks. Rounds are interleaved and the
table gives the median of the rounds. float32 SUM, in place; busbw uses
nccl-tests' 2(n-1)/n.

Run: ``python bench/bench_hierarchical.py [--ranks 4] [--repeats 3] [--max-bytes 67108864]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


def sizes(max_bytes: int) -> list[int]:
    out, size = [], 4
    while size <= max_bytes:
        out.append(size)
        size *= 16
    return out


def rank_main(rank: int, world_size: int, names: list[str], master: str, backend: str,
              max_bytes: int) -> dict[int, float]:
    import ferro
    from ferro.testing.netns import enter_namespace

    enter_namespace(names[0 if rank < world_size // 2 else 1])
    os.environ["MASTER_ADDR"] = master
    ferro.init_process_group(backend=backend, timeout=300)
    results = {}
    try:
        for nbytes in sizes(max_bytes):
            buf = np.ones(max(nbytes // 4, 1), np.float32)
            timed = int(min(500, max(5, 4e8 / max(nbytes, 16_384) / 10)))
            for _ in range(max(2, timed // 10)):
                ferro.allreduce(buf)
            ferro.barrier()
            start = time.perf_counter()
            for _ in range(timed):
                ferro.allreduce(buf)
            results[nbytes] = (time.perf_counter() - start) / timed
        return results
    finally:
        ferro.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-bytes", type=int, default=64 * 1024 * 1024)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_hierarchical: creating network namespaces needs root", file=sys.stderr)
        return 2
    from ferro.testing import run_processes
    from ferro.testing.netns import two_hosts

    rounds: dict[str, list[dict[int, float]]] = {"hierarchical": [], "tcp": []}
    with two_hosts() as (names, master):
        for _ in range(args.repeats):
            for backend in rounds:
                results = run_processes(rank_main, args.ranks, args=(names, master, backend, args.max_bytes),
                                        backend=None, timeout=1800)
                rounds[backend].append(results[0])
    factor = 2 * (args.ranks - 1) / args.ranks
    print(f"# allreduce, {args.ranks} ranks on 2 namespace-hosts, float32 SUM in place, median of {args.repeats}")
    print(f"{'bytes':>11}{'hierarchical us':>17}{'busbw':>8}{'flat tcp us':>13}{'busbw':>8}{'tcp / hier':>12}")
    for n in sizes(args.max_bytes):
        h = statistics.median(r[n] for r in rounds["hierarchical"])
        t = statistics.median(r[n] for r in rounds["tcp"])
        print(f"{n:>11}{h * 1e6:>17.1f}{n * factor / h / 1e9:>8.2f}{t * 1e6:>13.1f}{n * factor / t / 1e9:>8.2f}"
              f"{t / h:>11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
