"""What the flight recorder costs: a 4-byte allreduce with the recorder on and off, side by side.

Each rank runs rounds of ``--calls`` allreduces of one float32, alternating the
recorder on (``--size`` records) and off (size 0) from round to round, with the
order of the pair swapped every other round, in the same processes over the same
group. Each setting is warmed up first, the ring filled once (a job's first lap
of a new ring pays page faults that steady training does not). Each round's time
per call is the slowest rank's; the table gives the median over rounds of each
setting, their ratio, and the median of each round's own on/off ratio (the
figure to read: it cancels the machine's slow drifts).

    python bench/bench_flight_recorder.py --backend shm --backend tcp
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import ferro
from ferro.collective.flight_recorder import set_flight_recorder_size
from ferro.testing import run_processes


def _rank(group: ferro.Backend, rounds: int, calls: int, size: int) -> list[tuple[str, float]]:
    x = np.ones(1, np.float32)
    timings = []
    for i in range(rounds):
        order = [("on", size), ("off", 0)] if i % 2 == 0 else [("off", 0), ("on", size)]
        for label, records in order:
            set_flight_recorder_size(records)
            # Warm the plan and the caches in this setting, and fill the ring once: switching frees it, and the
            # first lap of a fresh one takes a page fault every 64 records (a cost a job pays once, not per call).
            for _ in range(200 + 2 * records):
                ferro.allreduce(x, group=group)
            ferro.barrier(group=group)
            start = time.perf_counter()
            for _ in range(calls):
                ferro.allreduce(x, group=group)
            elapsed = time.perf_counter() - start
            slowest = np.array([elapsed], np.float64)
            ferro.allreduce(slowest, ferro.ReduceOp.MAX, group=group)
            timings.append((label, float(slowest[0]) / calls))
    return timings


def measure(backend: str, ranks: int, rounds: int, calls: int, size: int) -> dict[str, float]:
    """Median seconds per call with the recorder on and off, and the median of each round's on/off ratio.

    A round times both settings back to back, so its ratio cancels the machine's slow drifts that the
    medians of each setting keep.
    """
    timings = run_processes(_rank, ranks, args=(rounds, calls, size), backend=backend, timeout=600)[0]
    result = {label: statistics.median(t for lab, t in timings if lab == label) for label in ("on", "off")}
    pairs = [dict(timings[i:i + 2]) for i in range(0, len(timings), 2)]
    result["ratio"] = statistics.median(pair["on"] / pair["off"] for pair in pairs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", help="shm, tcp (repeat; default both)")
    parser.add_argument("-n", "--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--size", type=int, default=2048, help="records per group when on")
    args = parser.parse_args()
    print(f"4-byte allreduce, {args.ranks} ranks, {args.rounds} rounds of {args.calls} calls per setting; "
          f"medians of the slowest rank's time per call; paired: the median of each round's on/off ratio")
    print(f"{'backend':<8} {'recorder off':>14} {'recorder on':>14} {'on / off':>9} {'paired':>8}")
    for backend in args.backend or ["shm", "tcp"]:
        result = measure(backend, args.ranks, args.rounds, args.calls, args.size)
        print(f"{backend:<8} {result['off'] * 1e6:>11.3f} us {result['on'] * 1e6:>11.3f} us "
              f"{result['on'] / result['off']:>9.4f} {result['ratio']:>8.4f}")


if __name__ == "__main__":
    main()
