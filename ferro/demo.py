"""The two-rank demonstration behind ``ferro demo``: a round trip and a bulk exchange over TCP.

The launcher starts two copies of this module as separate processes with the
torchrun-style environment, exactly as a real job's ranks would be started.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import time

import numpy as np

from ferro.backend.tcp import TcpBackend
from ferro.testing import free_port

__all__ = ["launch", "rank_main"]

PING_BYTES = 8


def _round_trips(group: TcpBackend, iterations: int) -> list[float]:
    peer = 1 - group.rank
    ping = np.zeros(PING_BYTES, np.uint8)
    times = []
    for _ in range(iterations):
        if group.rank == 0:
            start = time.perf_counter()
            group.send(ping, peer)
            group.recv(ping, peer)
            times.append(time.perf_counter() - start)
        else:
            group.recv(ping, peer)
            group.send(ping, peer)
    return times


def _exchanges(group: TcpBackend, nbytes: int, iterations: int) -> tuple[list[float], bool]:
    peer = 1 - group.rank
    outgoing = np.arange(nbytes // 4, dtype=np.uint32) ^ np.uint32(group.rank + 1)
    incoming = np.empty_like(outgoing)
    times = []
    for _ in range(iterations):
        group.barrier()
        start = time.perf_counter()
        group.sendrecv(outgoing, peer, incoming, peer)
        times.append(time.perf_counter() - start)
    expected = np.arange(nbytes // 4, dtype=np.uint32) ^ np.uint32(peer + 1)
    return times, bool(np.array_equal(incoming, expected))


def rank_main(size_mb: int, round_trips: int, exchanges: int) -> None:
    """Run one rank of the demonstration; rank 0 prints the report."""
    with TcpBackend.from_env() as group:
        _round_trips(group, 200)  # warm-up: connections, caches, CPU frequency
        rtt = _round_trips(group, round_trips)
        exchange_times, intact = _exchanges(group, size_mb * 1024 * 1024, exchanges)
        if group.rank != 0:
            return
        micro = sorted(t * 1e6 for t in rtt)
        best = min(exchange_times)
        median = statistics.median(exchange_times)
        nbytes = size_mb * 1024 * 1024
        print(f"ferro demo: 2 ranks over TCP on {os.environ['MASTER_ADDR']}, authenticated with a per-run secret")
        print(f"  round trip of {PING_BYTES} bytes x {round_trips}: median {statistics.median(micro):.1f} us, "
              f"p99 {micro[int(len(micro) * 0.99) - 1]:.1f} us")
        print(f"  full-duplex exchange of {size_mb} MB each way x {exchanges}: median {median * 1e3:.1f} ms "
              f"= {nbytes / median / 1e9:.2f} GB/s per direction (best {nbytes / best / 1e9:.2f} GB/s); "
              f"data {'verified' if intact else 'CORRUPTED'}")
        if not intact:
            raise SystemExit(1)


def launch(size_mb: int = 64, round_trips: int = 2000, exchanges: int = 5, timeout: float = 120.0) -> int:
    """Start two ranks of the demonstration as processes and wait for them; return the exit status."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               FERRO_SECRET=secrets.token_hex(16))
    command = [sys.executable, "-m", "ferro.demo", "--rank-main", str(size_mb), str(round_trips), str(exchanges)]
    ranks = [subprocess.Popen(command, env=dict(env, RANK=str(r))) for r in range(2)]
    deadline = time.monotonic() + timeout
    status = 0
    try:
        for process in ranks:
            code = process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            status = status or code
    except subprocess.TimeoutExpired:
        print(f"ferro demo: the ranks did not finish within {timeout:g} s", file=sys.stderr)
        status = 1
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ferro.demo`` (a rank started by :func:`launch`)."""
    parser = argparse.ArgumentParser(prog="python -m ferro.demo")
    parser.add_argument("--rank-main", nargs=3, type=int, metavar=("SIZE_MB", "ROUND_TRIPS", "EXCHANGES"),
                        required=True)
    args = parser.parse_args(argv)
    rank_main(*args.rank_main)
    return 0


if __name__ == "__main__":
    sys.exit(main())
