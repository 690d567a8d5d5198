"""The hangs and slips of ferro doctor's tests (and bench/bench_hang.py), at 4 ranks: one injected per run.

    ferro run --nproc-per-node 4 --hang-timeout 3 tests/hangs/cases.py CASE [--torch]

CASE: ``skip`` (rank 2 skips one allreduce, then evaluates for an hour), ``spin``
(rank 1 spins in a Python loop before a collective), ``stop`` (rank 3 SIGSTOPs
itself), ``size`` (rank 0 calls allreduce with another size), ``slow`` (rank 3
is 5x slower than the others for 50 steps, then every rank dumps its record),
``evaluate`` (rank 0 computes for 7 s before a collective: busy, not hung),
``crash`` (rank 1 raises a TypeError before a collective), ``two`` (ranks 1 and 2
sleep for good before a collective, at two different lines).
With ``--torch`` the same runs on torch.distributed's gloo (run it under torchrun,
with TORCH_DISTRIBUTED_DEBUG=DETAIL to see what torch says).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

STEPS = {"slow": 50}
FAULT_STEP = 5


def spin_forever() -> None:
    """A rank stuck in user code: a busy loop that never returns."""
    while True:  # CULPRIT spin
        pass


def evaluate(seconds: float) -> float:
    """A long evaluation on one rank: matrix products for ``seconds``, one batch at a time."""
    weights, total = np.random.default_rng(0).standard_normal((96, 96)), 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        total += float(np.tanh(weights @ weights).sum())  # CULPRIT evaluate-batch
    return total


def main() -> None:
    case = sys.argv[1]
    torch_mode = "--torch" in sys.argv
    if torch_mode:
        import datetime

        import torch
        import torch.distributed as dist

        seconds = float(os.environ.get("CASE_TIMEOUT", "30"))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
        rank = dist.get_rank()
        allreduce = lambda values: dist.all_reduce(torch.from_numpy(values))  # noqa: E731
    else:
        import ferro

        rank = ferro.init_process_group().rank
        allreduce = ferro.allreduce  # called straight from the loop below: the call sites are its lines

    x = np.ones(1, np.float32)
    if case == "slow" and rank == 3:
        print("FAULT slow on rank 3", flush=True)
    for step in range(STEPS.get(case, 8)):
        if case == "slow":
            time.sleep(0.05 if rank == 3 else 0.01)
        if step == FAULT_STEP:
            if rank == {"skip": 2, "spin": 1, "stop": 3, "size": 0, "evaluate": 0, "crash": 1}.get(case):
                print(f"FAULT {case} on rank {rank}", flush=True)  # bench/bench_hang.py times from here
            if case == "skip" and rank == 2:
                continue  # CULPRIT skip
            if case == "spin" and rank == 1:
                spin_forever()
            if case == "stop" and rank == 3:
                os.kill(os.getpid(), signal.SIGSTOP)  # CULPRIT stop
            if case == "size" and rank == 0:
                allreduce(np.ones(2, np.float32))  # CULPRIT size
                continue
            if case == "evaluate" and rank == 0:
                evaluate(7.0)
            if case == "crash" and rank == 1:
                len(5)  # CULPRIT crash
            if case == "two" and rank == 1:
                time.sleep(3600)  # CULPRIT two-1
            if case == "two" and rank == 2:
                time.sleep(3600)  # CULPRIT two-2
        allreduce(x)  # WAIT
    if case == "slow" and not torch_mode:
        ferro.dump_flight_record("after 50 steps")
    if case == "skip":
        time.sleep(3600)  # CULPRIT evaluate
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
