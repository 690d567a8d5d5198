"""Allreduce: ferro beside torch.distributed's gloo and Open MPI (mpi4py), in one run.

Each library runs as its own set of processes on this host; the sweeps are
interleaved (subject, peer, peer, subject, ...) for ``--repeats`` rounds so the
noisy shared machine affects them alike, and the table reports the median of the
rounds, per world size. The first library named in ``--peers`` is the subject;
every other column's ratio is against it.

Libraries: ``ferro-tcp`` (alias ``ferro``) and ``ferro-shm``, ferro's TCP and
shared-memory backends; ``ferro-mpi``, ferro's MPI backend (``ferro.allreduce``
on ``init_process_group(backend="mpi")``, with Open MPI's default settings, as
``mpi-sm``); ``gloo``; ``mpi``, Open MPI restricted to its TCP path
(``--mca btl self,tcp``, the fair peer for a socket transport); ``mpi-sm``, Open
MPI with its default settings (its shared-memory transport on one host).

The ranks are ``ferro bench``'s own (``ferro.tools.bench.worker``, one adapter per
library): this script adds the interleaved rounds, the medians and a table with
several peers and Open MPI transports side by side. Time is per in-place
allreduce (float32, SUM), the slowest rank's, averaged over 1000 calls per size
up to 4 MB and fewer above. Bus bandwidth uses nccl-tests' factor for allreduce,
2(n-1)/n, with GB = 1e9 bytes. ``memcpy`` is one core copying the same number of
bytes once (NumPy ``copyto``, median of 5): the physical reference.

Run: ``python bench/bench_allreduce.py [--peers ferro,gloo,mpi] [--worlds 2] [--repeats 3]
[--max-bytes 268435456] [--load N] [--json out.json]``. ``--load N`` runs N compute threads (NumPy
or torch matrix products) in every rank of every library beside the sweep: the busy cores of a
cluster in training. ``bench/bench_shm.py`` runs the shared-memory
comparison. Missing peers are skipped and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ferro.rendezvous.settings import free_port
from ferro.tools.bench.load import LOAD_KINDS, single_threaded_blas
from ferro.tools.bench.reference import memcpy_seconds
from ferro.tools.bench.table import read_json

# Started by mpirun: raw mpi4py, and ferro's MPI backend over the same Open MPI (its default transport).
MPI_LAUNCHED = ("mpi", "mpi-sm", "ferro-mpi")


def sizes(max_bytes: int) -> list[int]:
    out, size = [], 4
    while size <= max_bytes:
        out.append(size)
        size *= 4
    return out


# The one measuring engine: ferro bench's rank program, one adapter per library. Each peer is a library
# of it and ferro's backend (MPI_LAUNCHED says which mpirun starts, and with which transport).
ENGINE = ["-m", "ferro.tools.bench.worker"]
LIBRARY = {"ferro": ("ferro", "tcp"), "ferro-tcp": ("ferro", "tcp"), "ferro-shm": ("ferro", "shm"),
           "ferro-mpi": ("ferro", "mpi"), "gloo": ("torch-gloo", "tcp"), "mpi": ("mpi", "tcp"),
           "mpi-sm": ("mpi", "tcp")}
# Timed calls per size: 1000 up to 4 MB, then fewer as ferro bench scales them (5 or more at 256 MiB).
ITERS, WARMUP = 1000, 100


def run_peer(peer: str, world: int, max_bytes: int, out: str, load: int = 0, load_kind: str = "numpy",
             iters: int = ITERS) -> bool:
    """Run one sweep of ``peer`` on ``world`` ranks; rank 0 writes its rows (ferro bench's JSON) to ``out``.

    ``load`` compute threads run in every rank beside the sweep (``ferro bench --load``).
    """
    library, backend = LIBRARY[peer]
    engine = [*ENGINE, "--library", library, "--backend", backend, "--ops", "allreduce",
              "--sizes", ",".join(map(str, sizes(max_bytes))), "--iters", str(iters),
              "--warmup", str(min(WARMUP, iters)), "--out", out, "--quiet", "--load", str(load),
              "--load-kind", load_kind]
    if peer in MPI_LAUNCHED:
        from ferro.backend.mpi.launch import find_mpirun, mpirun_command, mpirun_environment

        if find_mpirun() is None:
            return False
        transport = ["btl", "self,tcp"] if peer == "mpi" else []
        command = mpirun_command(world, [sys.executable, *engine], transport)
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=mpirun_environment())
        if done.returncode != 0:
            print(f"# {peer} run failed: {done.stderr[-500:]}", file=sys.stderr)
        return done.returncode == 0
    from ferro.launch.agent import LaunchConfig, run_job

    return run_job(LaunchConfig(target=engine, nproc_per_node=world, master_port=free_port(), prefix=False)) == 0


def seconds_by_size(out: str) -> dict[int, float]:
    """Rank 0's rows as {bytes: seconds per in-place allreduce} (the slowest rank's time)."""
    return {row.size: row.time_us() / 1e6 for row in read_json(out)}


def available(peer: str) -> bool:
    try:
        if peer == "gloo":
            import torch.distributed  # noqa: F401
        if peer in MPI_LAUNCHED:
            import mpi4py  # noqa: F401

            from ferro.backend.mpi.launch import find_mpirun

            return find_mpirun() is not None
    except ImportError:
        return False
    return True


def _table(world: int, peers: list[str], table: dict[str, dict[int, float]], copy: dict[int, float],
           max_bytes: int) -> None:
    subject = peers[0]
    factor = 2 * (world - 1) / world
    header = f"{'bytes':>11}{'memcpy us':>11}"
    for p in table:
        header += f"{p + ' us':>15}{'busbw':>8}"
    for p in table:
        if p != subject:
            header += f"{'vs ' + p:>13}"
    print(header)
    for n in sizes(max_bytes):
        row = f"{n:>11}{copy[n] * 1e6:>11.1f}"
        for p in table:
            t = table[p][n]
            row += f"{t * 1e6:>15.1f}{n * factor / t / 1e9:>8.2f}"
        for p in table:
            if p != subject and subject in table:
                row += f"{table[p][n] / table[subject][n]:>12.2f}x"
        print(row)
    print(f"# 'vs X' = X's time / {subject}'s time (above 1: {subject} is faster); busbw in GB/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--worlds", default="", help="comma-separated world sizes (default: --world)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-bytes", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--peers", default="ferro,gloo,mpi", help="the subject first, then its peers")
    parser.add_argument("--json", help="write every round's raw times here")
    parser.add_argument("--load", type=int, default=0, help="compute threads per rank beside the sweep")
    parser.add_argument("--load-kind", default="numpy", choices=LOAD_KINDS)
    parser.add_argument("--iters", type=int, default=ITERS, help=f"timed calls per size (default {ITERS})")
    args = parser.parse_args(argv)
    if args.load:
        single_threaded_blas(os.environ)  # N compute threads mean N busy threads in every library's ranks

    worlds = [int(w) for w in args.worlds.split(",") if w] or [args.world]
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in LIBRARY]
    if unknown:
        parser.error(f"--peers takes {', '.join(LIBRARY)}; got {unknown[0]!r}")
    skipped = [p for p in peers if not available(p)]
    peers = [p for p in peers if p not in skipped]
    rounds: dict[tuple[int, str], list[dict[int, float]]] = {(w, p): [] for w in worlds for p in peers}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for world in worlds:
                for peer in peers:
                    out = os.path.join(tmp, f"{peer}-{world}-{repeat}.json")
                    if run_peer(peer, world, args.max_bytes, out, args.load, args.load_kind, args.iters):
                        rounds[world, peer].append(seconds_by_size(out))
                    print(f"# round {repeat + 1}/{args.repeats}: {peer} x{world} done", file=sys.stderr, flush=True)
    copy = {n: memcpy_seconds(n) for n in sizes(args.max_bytes)}
    beside = f"beside {args.load} {args.load_kind} compute thread(s) per rank, " if args.load else ""
    print(f"# allreduce, float32 SUM in place, {beside}median of {args.repeats} rounds; "
          f"one core's memcpy at {sizes(args.max_bytes)[-1]} B: "
          f"{sizes(args.max_bytes)[-1] / copy[sizes(args.max_bytes)[-1]] / 1e9:.2f} GB/s")
    if skipped:
        print(f"# skipped (not installed): {', '.join(skipped)}")
    for world in worlds:
        table = {p: {n: statistics.median(r[n] for r in rounds[world, p]) for n in sizes(args.max_bytes)}
                 for p in peers if rounds[world, p]}
        print(f"#\n# world size {world}")
        _table(world, peers, table, copy, args.max_bytes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{p}@{w}": [{str(k): v for k, v in r.items()} for r in rs] for (w, p), rs in rounds.items()},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
