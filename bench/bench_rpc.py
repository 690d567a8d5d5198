"""ferro.rpc beside torch.distributed.rpc (TensorPipe): round-trip latency and 1 MiB argument throughput.

Two processes on this machine; each joins both RPC systems (ferro's store on its
own port). Worker 0 calls worker 1:

* ``empty``: ``rpc_sync(1, noop)``, no arguments, returns None: the round trip;
* ``1 MiB``: ``rpc_sync(1, consume, (x,))`` with a 1 MiB float32 argument
  (a torch tensor for both; for ferro also a NumPy array), returning None: one
  way of data per call, reported in MB/s.

Rounds alternate which system goes first; each figure is the median over rounds
of each round's median per call. Run: ``python bench/bench_rpc.py [--rounds 5] [--calls 200]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

MIB = 1024 * 1024


def noop() -> None:
    """Do nothing (the callee of the round-trip measurement)."""


def consume(x: object) -> None:
    """Receive an argument and drop it."""


def _median_call(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rank_main(rank: int, world_size: int, rounds: int, calls: int, torch_port: int) -> dict:
    import numpy as np
    import torch
    import torch.distributed.rpc as trpc

    from ferro import rpc

    torch.set_num_threads(1)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
    options = trpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{torch_port}", num_worker_threads=16,
                                               rpc_timeout=120)
    trpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    found: dict[str, list[float]] = {}
    if rank == 0:
        tensor = torch.ones(MIB // 4)
        array = np.ones(MIB // 4, np.float32)
        cases = {
            "empty": {"ferro": lambda: rpc.rpc_sync(1, noop), "torch": lambda: trpc.rpc_sync(1, noop)},
            "1 MiB": {"ferro": lambda: rpc.rpc_sync(1, consume, (tensor,)),
                      "ferro (NumPy)": lambda: rpc.rpc_sync(1, consume, (array,)),
                      "torch": lambda: trpc.rpc_sync(1, consume, (tensor,))},
        }
        for round_ in range(rounds):
            for case, systems in cases.items():
                names = list(systems) if round_ % 2 == 0 else list(reversed(systems))
                for name in names:
                    for _ in range(10):
                        systems[name]()  # warm up
                    found.setdefault(f"{case}|{name}", []).append(_median_call(systems[name], calls))
    trpc.shutdown()
    rpc.shutdown()
    return found


def main(argv: list[str] | None = None) -> int:
    from ferro.rendezvous.settings import free_port
    from ferro.testing import run_processes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    found = run_processes(rank_main, 2, args=(args.rounds, args.calls, free_port()), backend=None, timeout=1800,
                          env={"FERRO_RPC_PORT": str(free_port())})[0]
    print(f"# RPC between 2 processes on this machine; median of {args.rounds} rounds x {args.calls} calls")
    print(f"{'':<24}{'us per call':>14}{'MB/s':>10}{'torch / this':>14}")
    for case in ("empty", "1 MiB"):
        torch_time = statistics.median(found[f"{case}|torch"])
        for name in ("ferro", "ferro (NumPy)", "torch"):
            key = f"{case}|{name}"
            if key not in found:
                continue
            seconds = statistics.median(found[key])
            rate = f"{MIB / seconds / 1e6:10.0f}" if case != "empty" else f"{'':>10}"
            print(f"{case + ', ' + name:<24}{seconds * 1e6:14.1f}{rate}{torch_time / seconds:14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
