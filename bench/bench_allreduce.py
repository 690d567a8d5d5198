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

Time is per allreduce on rank 0 (float32, SUM, in place), averaged over many
calls per size. Bus bandwidth uses nccl-tests' factor for allreduce,
2(n-1)/n, with GB = 1e9 bytes. ``memcpy`` is one core copying the same number of
bytes once (NumPy ``copyto``, median of 5): the physical reference.

Run: ``python bench/bench_allreduce.py [--peers ferro,gloo,mpi] [--worlds 2] [--repeats 3]
[--max-bytes 268435456] [--json out.json]``. ``bench/bench_shm.py`` runs the shared-memory
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
import time

import numpy as np

from ferro.rendezvous.settings import free_port
from ferro.tools.bench.reference import memcpy_seconds

PEERS = ["ferro", "ferro-tcp", "ferro-shm", "ferro-mpi", "gloo", "mpi", "mpi-sm"]
# Started by mpirun: raw mpi4py, and ferro's MPI backend over the same Open MPI (its default transport).
MPI_LAUNCHED = ("mpi", "mpi-sm", "ferro-mpi")


def sizes(max_bytes: int) -> list[int]:
    out, size = [], 4
    while size <= max_bytes:
        out.append(size)
        size *= 4
    return out


def iterations(nbytes: int) -> tuple[int, int]:
    """(warm-up, timed) calls for a message size: many for small messages, few for large."""
    timed = int(min(1000, max(5, 4e8 / max(nbytes, 16_384) / 10)))
    return max(2, timed // 10), timed


def _measure(allreduce, barrier, rank: int, max_bytes: int) -> dict[int, float]:
    results = {}
    for nbytes in sizes(max_bytes):
        buf = np.ones(max(nbytes // 4, 1), np.float32)
        warmup, timed = iterations(nbytes)
        for _ in range(warmup):
            allreduce(buf)
        barrier()
        start = time.perf_counter()
        for _ in range(timed):
            allreduce(buf)
        elapsed = (time.perf_counter() - start) / timed
        if rank == 0:
            results[nbytes] = elapsed
    return results


def worker_ferro(rank: int, world: int, port: int, max_bytes: int, backend: str = "tcp") -> dict[int, float]:
    import ferro

    kind = ferro.ShmBackend if backend == "shm" else ferro.TcpBackend
    with kind(rank, world, "127.0.0.1", port, secret="bench", timeout=300) as group:
        return _measure(lambda b: ferro.allreduce(b, group=group), group.barrier, rank, max_bytes)


def worker_gloo(rank: int, world: int, port: int, max_bytes: int) -> dict[int, float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        return _measure(lambda b: dist.all_reduce(torch.from_numpy(b)), dist.barrier, rank, max_bytes)
    finally:
        dist.destroy_process_group()


def worker_mpi(max_bytes: int) -> tuple[int, dict[int, float]]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return comm.Get_rank(), _measure(lambda b: comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM), comm.Barrier,
                                     comm.Get_rank(), max_bytes)


def worker_ferro_mpi(max_bytes: int) -> tuple[int, dict[int, float]]:
    import ferro

    group = ferro.init_process_group(backend="mpi", timeout=300)
    try:
        return group.rank, _measure(lambda b: ferro.allreduce(b), ferro.barrier, group.rank, max_bytes)
    finally:
        ferro.destroy_process_group()


def run_peer(peer: str, world: int, max_bytes: int, out: str) -> bool:
    script = os.path.abspath(__file__)
    if peer in MPI_LAUNCHED:
        from ferro.backend.mpi.launch import find_mpirun, mpirun_command, mpirun_environment

        if find_mpirun() is None:
            return False
        transport = ["btl", "self,tcp"] if peer == "mpi" else []
        worker = "ferro-mpi" if peer == "ferro-mpi" else "mpi"
        command = mpirun_command(world, [sys.executable, script, "--worker", worker, "--max-bytes", str(max_bytes),
                                         "--out", out], transport)
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=mpirun_environment())
        if done.returncode != 0:
            print(f"# mpi run failed: {done.stderr[-500:]}", file=sys.stderr)
        return done.returncode == 0
    port = free_port()
    procs = [subprocess.Popen([sys.executable, script, "--worker", peer, "--rank", str(r), "--world", str(world),
                               "--port", str(port), "--max-bytes", str(max_bytes), "--out", out])
             for r in range(world)]
    codes = [p.wait(timeout=1800) for p in procs]
    return all(c == 0 for c in codes)


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


def _worker(args: argparse.Namespace) -> int:
    if args.worker == "mpi":
        rank, results = worker_mpi(args.max_bytes)
    elif args.worker == "ferro-mpi":
        rank, results = worker_ferro_mpi(args.max_bytes)
    elif args.worker == "gloo":
        rank, results = args.rank, worker_gloo(args.rank, args.world, args.port, args.max_bytes)
    else:
        backend = "shm" if args.worker == "ferro-shm" else "tcp"
        rank, results = args.rank, worker_ferro(args.rank, args.world, args.port, args.max_bytes, backend)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f)
    return 0


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
    parser.add_argument("--worker", choices=PEERS)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--worlds", default="", help="comma-separated world sizes (default: --world)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-bytes", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--peers", default="ferro,gloo,mpi", help="the subject first, then its peers")
    parser.add_argument("--json", help="write every round's raw times here")
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)

    worlds = [int(w) for w in args.worlds.split(",") if w] or [args.world]
    peers = [p for p in args.peers.split(",") if p]
    skipped = [p for p in peers if not available(p)]
    peers = [p for p in peers if p not in skipped]
    rounds: dict[tuple[int, str], list[dict[int, float]]] = {(w, p): [] for w in worlds for p in peers}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for world in worlds:
                for peer in peers:
                    out = os.path.join(tmp, f"{peer}-{world}-{repeat}.json")
                    if run_peer(peer, world, args.max_bytes, out):
                        with open(out) as f:
                            rounds[world, peer].append({int(k): v for k, v in json.load(f).items()})
                    print(f"# round {repeat + 1}/{args.repeats}: {peer} x{world} done", file=sys.stderr, flush=True)
    copy = {n: memcpy_seconds(n) for n in sizes(args.max_bytes)}
    print(f"# allreduce, float32 SUM in place, median of {args.repeats} rounds; "
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
