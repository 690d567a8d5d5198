"""The two-rank demonstration behind ``ferro demo``: a round trip and a bulk exchange over TCP.

:func:`launch` starts two ranks as separate processes with the torchrun-style
environment, exactly as a real job's ranks would be started. The module is also
a rank program of its own: ``ferro run --nproc-per-node 2 -m ferro.tools.demo``.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import statistics
import sys
import time

import numpy as np

from ferro.backend.tcp import TcpBackend
from ferro.errors import ConfigurationError
from ferro.rendezvous.settings import free_port

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
    """Run one rank of the demonstration; rank 0 prints the report.

    Raises:
        ConfigurationError: Not exactly two ranks.

    """
    with TcpBackend.from_env() as group:
        if group.world_size != 2:
            raise ConfigurationError(f"the demo pairs two ranks; start it with 2, not {group.world_size}")
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


def _rank_process(rank: int, env: dict[str, str], size_mb: int, round_trips: int, exchanges: int) -> None:
    os.environ.update(env, RANK=str(rank))
    rank_main(size_mb, round_trips, exchanges)


def launch(size_mb: int = 64, round_trips: int = 2000, exchanges: int = 5, timeout: float = 120.0) -> int:
    """Start two ranks of the demonstration as processes and wait for them; return the exit status.

    The ranks are spawned by multiprocessing, so they import the same ferro as
    this process (a ``python -m`` child would put the current directory first on
    its path and could pick up an unbuilt source checkout instead).
    """
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "FERRO_SECRET": secrets.token_hex(16)}
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_rank_process, args=(r, env, size_mb, round_trips, exchanges),
                             name=f"ferro-demo-rank-{r}") for r in range(2)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout
    status = 0
    for process in ranks:
        process.join(max(deadline - time.monotonic(), 0.1))
        if process.exitcode is None:
            print(f"ferro demo: the ranks did not finish within {timeout:g} s", file=sys.stderr)
            status = 1
        elif process.exitcode != 0:
            status = status or 1
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    return status


def main(argv: list[str] | None = None) -> int:
    """Run as one rank under a launcher: ``ferro run --nproc-per-node 2 -m ferro.tools.demo [--size-mb N]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ferro.tools.demo")
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument("--exchanges", type=int, default=5)
    args = parser.parse_args(argv)
    rank_main(args.size_mb, args.round_trips, args.exchanges)
    return 0


if __name__ == "__main__":
    sys.exit(main())
