"""Pipeline schedules: measured step time beside the textbook formulas and torch.distributed.pipelining.

Every stage sleeps instead of computing (forward ``tF`` = 20 ms, backward
``tB`` = 40 ms per rank and microbatch; tensors of shape (microbatch, 16) still
flow between the stages, and gradients back), so the step time is the schedule's:
its bubbles and its communication. World size 4, 8 microbatches.

* GPipe and 1F1B: formula ``(m + p - 1)(tF + tB)``.
* Interleaved 1F1B, ``v = 2`` stages per rank, each sleeping half as long:
  ``(m + (p - 1) / v)(tF + tB)``.
* Zero bubble (ZB-H1), backward split into input gradient ``tI`` = 20 ms and
  weight gradient ``tW`` = 20 ms: ``m (tF + tB) + (p - 1)(tF + tI - tW)``.

torch runs its own ``pipelining`` schedules over gloo on the same sleeping stages
(its sleep sits in an autograd Function's backward, which torch cannot split, so
torch has no zero-bubble row here). A step is timed on rank 0 from a barrier
before it to a barrier after it; medians over steps and rounds, after one
warm-up step. ``--trace-svg PATH`` draws ferro's 1F1B and zero-bubble steps.
Run: ``python bench/bench_pipeline.py [--rounds 3] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

WORLD, MICROBATCHES, ROWS, WIDTH = 4, 8, 32, 16
T_FORWARD, T_BACKWARD = 0.020, 0.040
VIRTUAL = 2  # stages per rank for the interleaved schedule

CONFIGS = {  # label: (schedule kind, stages per rank, formula in seconds)
    "GPipe": ("gpipe", 1, (MICROBATCHES + WORLD - 1) * (T_FORWARD + T_BACKWARD)),
    "1F1B": ("1f1b", 1, (MICROBATCHES + WORLD - 1) * (T_FORWARD + T_BACKWARD)),
    "Interleaved 1F1B (v=2)": ("interleaved", VIRTUAL,
                               (MICROBATCHES + (WORLD - 1) / VIRTUAL) * (T_FORWARD + T_BACKWARD)),
    "Zero bubble (ZB-H1)": ("zb", 1, MICROBATCHES * (T_FORWARD + T_BACKWARD)
                            + (WORLD - 1) * (T_FORWARD + T_BACKWARD / 2 - T_BACKWARD / 2)),
}


def ferro_sleeper(forward_s: float, backward_s: float):
    from ferro import nn

    class Sleeper(nn.Module):
        """Sleeps for its compute; passes the activation (a copy) forward and the gradient back."""

        def forward(self, x):
            time.sleep(forward_s)
            self.save_for_backward(x=x)
            return x * 1.0

        def backward(self, grad_output):
            self.saved("x")
            time.sleep(backward_s)
            return grad_output * 1.0

        @property
        def splits_backward(self) -> bool:
            return True

        def backward_input(self, grad_output):
            time.sleep(backward_s / 2)
            return grad_output * 1.0

        def backward_weight(self) -> None:
            time.sleep(backward_s / 2)

    return Sleeper()


def batch():
    rng = np.random.default_rng(0)
    return rng.standard_normal((ROWS, WIDTH)), rng.standard_normal((ROWS, WIDTH))


def rank_ferro(group, kind: str, per_rank: int, steps: int) -> dict[str, object]:
    import ferro
    from ferro import nn
    from ferro.pipeline import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZeroBubble,
    )

    num_stages = WORLD * per_rank
    stages = [PipelineStage(ferro_sleeper(T_FORWARD / per_rank, T_BACKWARD / per_rank), s, num_stages, group=group)
              for s in range(group.rank, num_stages, group.world_size)]
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
           "zb": ScheduleZeroBubble}[kind]
    schedule = cls(stages if kind == "interleaved" else stages[0], MICROBATCHES, nn.MSELoss())
    x, y = batch()
    times = []
    for step in range(steps + 1):
        ferro.barrier(group=group)
        start = time.perf_counter()
        if group.rank == 0:
            schedule.step(x)
        elif (num_stages - 1) % group.world_size == group.rank:
            schedule.step(target=y)
        else:
            schedule.step()
        ferro.barrier(group=group)
        if step:
            times.append(time.perf_counter() - start)
    return {"times": times, "trace": schedule.trace(gather=True)}


def rank_torch(rank: int, world_size: int, kind: str, per_rank: int, steps: int) -> list[float]:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    try:
        class Sleep(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, forward_s, backward_s):  # type: ignore[override]
                time.sleep(forward_s)
                ctx.backward_s = backward_s
                return x * 1.0

            @staticmethod
            def backward(ctx, grad):  # type: ignore[override]
                time.sleep(ctx.backward_s)
                return grad * 1.0, None, None

        class Sleeper(torch.nn.Module):
            def __init__(self, forward_s: float, backward_s: float) -> None:
                super().__init__()
                self.forward_s, self.backward_s = forward_s, backward_s
                # A parameter, so that every stage (the first too) has a backward for torch to run.
                self.scale = torch.nn.Parameter(torch.ones((), dtype=torch.float64))

            def forward(self, x):
                return Sleep.apply(x * self.scale, self.forward_s, self.backward_s)

        num_stages = world_size * per_rank
        def example(requires_grad: bool):
            return torch.zeros(ROWS // MICROBATCHES, WIDTH, dtype=torch.float64, requires_grad=requires_grad)

        # Later stages' inputs take gradients: torch reads that from the example inputs.
        stages = [pipelining.PipelineStage(Sleeper(T_FORWARD / per_rank, T_BACKWARD / per_rank), s, num_stages,
                                           torch.device("cpu"), input_args=(example(s > 0),),
                                           output_args=(example(True),))
                  for s in range(rank, num_stages, world_size)]
        loss_fn = torch.nn.functional.mse_loss
        if kind == "interleaved":
            schedule = pipelining.ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=loss_fn)
        else:
            cls = pipelining.ScheduleGPipe if kind == "gpipe" else pipelining.Schedule1F1B
            schedule = cls(stages[0], MICROBATCHES, loss_fn=loss_fn)
        x, y = (torch.from_numpy(a) for a in batch())
        times = []
        for step in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                schedule.step(x)
            elif (num_stages - 1) % world_size == rank:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            dist.barrier()
            if step:
                times.append(time.perf_counter() - start)
        return times
    finally:
        dist.destroy_process_group()


def write_svg(traces_by_label: dict[str, dict], path: str) -> None:
    """Draw one timeline per schedule: a row per rank, a box per compute action (F blue, B/I orange, W green)."""
    colours = {"F": "#4c72b0", "B": "#dd8452", "I": "#dd8452", "W": "#55a868"}
    row, gap, scale, left = 18, 34, 1000.0, 60  # px per rank, between panels; px per second; label margin
    parts, y = [], 10
    width = left + int(max(max(e.end for events in t.values() for e in events)
                           - min(e.start for events in t.values() for e in events)
                           for t in traces_by_label.values()) * scale) + 20
    for label, traces in traces_by_label.items():
        origin = min(e.start for events in traces.values() for e in events)
        parts.append(f'<text x="4" y="{y + 12}" font-size="13" font-weight="bold">{label}</text>')
        y += 18
        for rank in sorted(traces):
            parts.append(f'<text x="4" y="{y + 13}" font-size="11">rank {rank}</text>')
            for event in traces[rank]:
                kind = event.action.kind.value
                if kind not in colours:
                    continue
                x0 = left + (event.start - origin) * scale
                w = max((event.end - event.start) * scale, 0.5)
                parts.append(f'<rect x="{x0:.1f}" y="{y}" width="{w:.1f}" height="{row - 2}" fill="{colours[kind]}" '
                             f'stroke="white" stroke-width="0.5"><title>{event.action}</title></rect>')
                if w > 14:
                    parts.append(f'<text x="{x0 + 2:.1f}" y="{y + 12}" font-size="9" fill="white">'
                                 f'{kind}{event.action.microbatch}</text>')
            y += row
        y += gap - 18
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" font-family="sans-serif">'
           f'<rect width="100%" height="100%" fill="white"/>{"".join(parts)}</svg>\n')
    with open(path, "w", encoding="utf-8") as f:
        f.write(svg)


def main(argv: list[str] | None = None) -> int:
    from ferro.testing import run_processes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trace-svg", default=None)
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args(argv)
    ferro_times: dict[str, list[float]] = {}
    torch_times: dict[str, list[float]] = {}
    traces: dict[str, dict] = {}
    for _ in range(args.rounds):
        for label, (kind, per_rank, _) in CONFIGS.items():
            ranks = run_processes(rank_ferro, WORLD, args=(kind, per_rank, args.steps), timeout=600)
            ferro_times.setdefault(label, []).extend(ranks[0]["times"])
            traces[label] = ranks[0]["trace"]
            if kind != "zb" and not args.no_torch:
                ranks = run_processes(rank_torch, WORLD, args=(kind, per_rank, args.steps), backend=None,
                                      timeout=600)
                torch_times.setdefault(label, []).extend(ranks[0])
    print(f"# pipeline step, {WORLD} ranks, {MICROBATCHES} microbatches, sleeping stages (tF = "
          f"{T_FORWARD * 1e3:.0f} ms, tB = {T_BACKWARD * 1e3:.0f} ms per rank and microbatch); median of "
          f"{args.rounds} rounds x {args.steps} steps; ferro over TCP, torch.distributed.pipelining over gloo")
    print(f"{'schedule':<26}{'formula ms':>11}{'ferro ms':>10}{'ferro/formula':>15}{'torch ms':>10}"
          f"{'torch/ferro':>13}")
    for label, (_, _, formula) in CONFIGS.items():
        ferro_ms = statistics.median(ferro_times[label]) * 1e3
        line = f"{label:<26}{formula * 1e3:>11.0f}{ferro_ms:>10.1f}{ferro_ms / (formula * 1e3):>15.3f}"
        if label in torch_times:
            torch_ms = statistics.median(torch_times[label]) * 1e3
            line += f"{torch_ms:>10.1f}{torch_ms / ferro_ms:>13.2f}"
        else:
            line += f"{'-':>10}{'-':>13}"
        print(line)
    if args.trace_svg:
        write_svg({label: traces[label] for label in ("1F1B", "Zero bubble (ZB-H1)")}, args.trace_svg)
        print(f"trace of the last 1F1B and zero-bubble steps: {args.trace_svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
