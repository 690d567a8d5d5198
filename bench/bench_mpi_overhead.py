"""What ferro's MPI backend adds to a raw mpi4py call: the two, alternated in one process, on one communicator.

Run under mpirun (``mpirun -n 2 python bench/bench_mpi_overhead.py``; as root add
``--allow-run-as-root``). Every round times a block of raw
``comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)`` calls on the group's own
communicator, then a block of ``ferro.allreduce(x)`` calls on the same array (or
the other way round, alternating), so both see the same machine, cache and
algorithm choices; the table gives the median of the rounds and the median of
the per-round differences. Separate-process comparisons (``bench_allreduce.py
--peers ferro-mpi,mpi-sm``) include more of the shared machine's noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,65536,16777216,67108864", help="bytes, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    from mpi4py import MPI

    import ferro

    group = ferro.init_process_group(backend="mpi", timeout=600)
    comm = group.comm
    rank = group.rank
    if rank == 0:
        library = MPI.Get_library_version().splitlines()[0]
        print(f"# allreduce float32 SUM in place, {group.world_size} ranks, {library}")
        print(f"# median of {args.rounds} rounds, raw and ferro alternated in each; us per call")
        print(f"{'bytes':>10}{'raw mpi4py':>12}{'ferro':>10}{'ferro - raw':>13}{'ratio':>8}")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = np.ones(max(nbytes // 4, 1), np.float32)
        calls = int(min(20000, max(3, 2e8 / max(nbytes, 4096) / 20)))
        raw_call = lambda x=x: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)  # noqa: E731
        ferro_call = lambda x=x: ferro.allreduce(x)  # noqa: E731
        times: dict[str, list[float]] = {"raw": [], "ferro": []}
        for round_ in range(args.rounds + 1):
            order = [("raw", raw_call), ("ferro", ferro_call)]
            for name, call in order if round_ % 2 else order[::-1]:
                for _ in range(max(2, calls // 10)):
                    call()
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                elapsed = (time.perf_counter() - start) / calls
                slowest = comm.allreduce(elapsed, op=MPI.MAX)
                if round_:  # round 0 warms up
                    times[name].append(slowest * 1e6)
        if rank == 0:
            raw, mine = statistics.median(times["raw"]), statistics.median(times["ferro"])
            diff = statistics.median(f - r for f, r in zip(times["ferro"], times["raw"], strict=True))
            print(f"{nbytes:>10}{raw:>12.2f}{mine:>10.2f}{diff:>13.2f}{mine / raw:>7.3f}x")
    ferro.destroy_process_group()


if __name__ == "__main__":
    main()
