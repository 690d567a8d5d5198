"""Per-call latency of a small allreduce beside compute threads: the distribution, not only the mean.

``ferro bench`` reports the mean of a window of calls. Beside compute threads a
window either meets no descheduled peer or meets a whole time slice, so the
means jump between modes; what a waiting policy changes shows in the
distribution. This script times every call of ``--rounds`` x ``--calls``
in-place float32 SUM allreduces on 2 local ranks and prints the mean, the median
of the rounds' means and the 50th, 90th, 99th and 99.9th percentiles, for
ferro's TCP and shared-memory groups and for Open MPI (mpi4py, over TCP and with
its defaults), with ``--load`` NumPy matmul threads in every rank (``ferro bench
--load``'s). The libraries run one after another, ``--repeats`` times interleaved.
``FERRO_SPIN_US`` and the like pass through to ferro's ranks: DESIGN.md's "Busy
cores" compares waiting policies with it.

Run: ``python bench/bench_wait_latency.py [--load 1] [--bytes 4] [--repeats 3]
[--libraries ferro-tcp,ferro-shm,mpi,mpi-sm]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from ferro.tools.bench.load import single_threaded_blas

LIBRARIES = ("ferro-tcp", "ferro-shm", "mpi", "mpi-sm")


def rank_main(library: str, load: int, nbytes: int, rounds: int, calls: int, out: str) -> None:
    """One rank: time every call; rank 0 writes the per-call times (us) and the rounds' means to ``out``."""
    import numpy as np

    from ferro.tools.bench.load import ComputeLoad

    buffer = np.ones(max(nbytes // 4, 1), np.float32)
    if library.startswith("mpi"):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.rank

        def call() -> None:
            comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
    else:
        import ferro

        group = ferro.init_process_group(backend=library.removeprefix("ferro-"))
        rank = group.rank

        def call() -> None:
            ferro.allreduce(buffer, group=group)
    times, means = [], []
    with ComputeLoad(load):
        for _ in range(100):
            call()
        for _ in range(rounds):
            began = time.perf_counter()
            for _ in range(calls):
                start = time.perf_counter()
                call()
                times.append((time.perf_counter() - start) * 1e6)
            means.append((time.perf_counter() - began) / calls * 1e6)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "means": means}, f)


def run(library: str, args: argparse.Namespace, out: str) -> dict | None:
    rank = [sys.executable, __file__, "--rank", library, "--load", str(args.load), "--bytes", str(args.bytes),
            "--rounds", str(args.rounds), "--calls", str(args.calls), "--out", out]
    env = dict(os.environ)
    if library.startswith("mpi"):
        from ferro.backend.mpi.launch import find_mpirun, mpirun_command, mpirun_environment

        if find_mpirun() is None:
            return None
        command = mpirun_command(2, rank, ["btl", "self,tcp"] if library == "mpi" else [])
        env = dict(mpirun_environment())
    else:
        command = [sys.executable, "-m", "ferro", "run", "--nproc-per-node", "2", "--no-prefix", *rank[1:]]
    single_threaded_blas(env)  # ferro bench --load's rule: N matmul threads are N busy threads
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not os.path.exists(out):
        print(f"# {library} failed: {done.stderr[-800:]}", file=sys.stderr)
        return None
    with open(out) as f:
        return dict(json.load(f))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--load", type=int, default=1, help="matmul threads per rank (default 1)")
    parser.add_argument("--bytes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rank", help=argparse.SUPPRESS)  # the script as one rank
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        rank_main(args.rank, args.load, args.bytes, args.rounds, args.calls, args.out)
        return 0
    import numpy as np

    libraries = [name for name in args.libraries.split(",") if name]
    unknown = [name for name in libraries if name not in LIBRARIES]
    if unknown:
        parser.error(f"--libraries takes {', '.join(LIBRARIES)}; got {unknown[0]!r}")
    print(f"# {args.bytes} B allreduce, 2 ranks beside {args.load} matmul thread(s) each, {args.rounds} x "
          f"{args.calls} timed calls per sitting; us per call")
    print(f"{'library':<12}{'mean':>9}{'median of rounds':>18}{'p50':>8}{'p90':>8}{'p99':>9}{'p99.9':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for library in libraries:
                found = run(library, args, os.path.join(tmp, f"{library}-{repeat}.json"))
                if found is None:
                    print(f"{library:<12}  (not run)")
                    continue
                times = np.array(found["times"])
                p50, p90, p99, p999 = np.percentile(times, [50, 90, 99, 99.9])
                print(f"{library:<12}{times.mean():>9.1f}{float(np.median(found['means'])):>18.1f}{p50:>8.1f}"
                      f"{p90:>8.1f}{p99:>9.1f}{p999:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
