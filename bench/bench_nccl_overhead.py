"""The host's cost of one NCCL call: ferro's NCCL group beside torch.distributed's, on one GPU.

One rank, so NCCL's own work is a copy at most and what is left is each library's
path from the Python call to the kernel's launch: checking the buffer, finding the
stream, enqueuing, recording the completion. Each round times ``--calls`` calls
enqueued back to back and one ``torch.cuda.synchronize()``; the table gives the
median over rounds, in microseconds per call. ``--profile`` prints where ferro's
calls spend their time (cProfile, by own time).

Usage (needs a CUDA GPU, a CUDA build of torch and libnccl)::

    python bench/bench_nccl_overhead.py --rounds 7 --calls 2000 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import secrets
import statistics
import time
from collections.abc import Callable
from typing import Any

import ferro
from ferro.rendezvous.settings import free_port


def _per_call_us(torch: Any, call: Callable[[], Any], calls: int, rounds: int) -> float:
    for _ in range(min(calls, 200)):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    """Print ferro's and torch's microseconds per call, and ferro's profile with ``--profile``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    # One rank of its own: a secret of its own (ferro's groups refuse to start without one).
    group = ferro.NcclBackend(0, 1, master_port=free_port(), timeout=60, secret=secrets.token_hex(16))
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    x = torch.ones(256, device="cuda")
    calls: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "allreduce 1 KiB": (lambda: ferro.allreduce(x, group=group), lambda: dist.all_reduce(x)),
        "broadcast 1 KiB": (lambda: ferro.broadcast(x, root=0, group=group), lambda: dist.broadcast(x, src=0)),
        "allreduce async": (lambda: ferro.allreduce(x, group=group, async_op=True).wait(),
                            lambda: dist.all_reduce(x, async_op=True).wait()),
    }
    print(f"# one rank on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL "
          f"{'.'.join(map(str, torch.cuda.nccl.version()))}: microseconds per call, the median of {args.rounds} "
          f"rounds of {args.calls} calls")
    print(f"# {'call':<18}{'ferro':>10}{'torch':>10}{'torch/ferro':>13}")
    for name, (mine, theirs) in calls.items():
        ours_us = _per_call_us(torch, mine, args.calls, args.rounds)
        torch_us = _per_call_us(torch, theirs, args.calls, args.rounds)
        print(f"  {name:<18}{ours_us:>10.1f}{torch_us:>10.1f}{torch_us / ours_us:>12.2f}x")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            ferro.allreduce(x, group=group)
        torch.cuda.synchronize()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    group.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
