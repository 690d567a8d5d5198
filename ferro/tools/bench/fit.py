"""``ferro bench --fit``: a cost model of the network from timed allreduces, and the machine's CPU costs.

Each allreduce algorithm is timed at every size (forced, one row each); :func:`fit_model` fits each one's cost
per message and per byte to its closed form (:meth:`ferro.backend.cost_model.CostModel.allreduce`), keeps the
timings allreduce chooses from inside the sizes timed, fits the machine's CPU costs (:func:`fit_cpu`), and writes
the model ``FERRO_COST_MODEL`` reads.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import TYPE_CHECKING

from ferro.collective.resolve import ALLREDUCE_ALGORITHM_NAMES
from ferro.tools.bench.table import Row
from ferro.tools.bench.worker import timed_calls
from ferro.tools.emulate import parse_emulation, payload_rate

if TYPE_CHECKING:
    import numpy as np

__all__ = ["FIT_ALGORITHMS", "FORM_MIN_BYTES", "fit_cpu", "fit_model", "never_faster_when_larger", "nonnegative_fit"]

#: The algorithms ``--fit`` times: every allreduce algorithm a TCP group runs.
FIT_ALGORITHMS = ALLREDUCE_ALGORITHM_NAMES
# A fit whose per-byte cost makes less than this share of the ring's fitted time at the largest size measured
# no bandwidth (the sizes were too small for the noise), and writes no model.
MIN_PER_BYTE_SHARE = 0.05
#: The smallest size whose rows the time forms are fitted on (when at least two sizes reach it; all rows otherwise).
#: Below it a call's bytes are microseconds of any link from 1 Gbit up, so its time is the cost of its messages
#: alone, and on a machine whose ranks share its cores (an emulated cluster) that is the CPU's, which the CPU
#: fit takes (:func:`fit_cpu`), not the link's. Fitted from 4 B at 16x1 the ring's link came out 39 us and 12.1
#: MB/s against 78 us and 13.6 MB/s from 4 KiB, and ferro then chose slower broadcasts (the 256 KiB one 1.9x).
#: Every row still enters the timed table, from which allreduce chooses inside the sizes timed.
FORM_MIN_BYTES = 4096


def fit_model(args: argparse.Namespace, rows: list[Row]) -> int:
    """Fit alpha and beta to each algorithm's rows (least squares weighted by 1/t), write the model, show it.

    The times are first made non-decreasing in size (:func:`never_faster_when_larger`), and the costs fitted
    no lower than zero (:func:`nonnegative_fit`), on the rows from :data:`FORM_MIN_BYTES` up; the machine's CPU
    costs (:func:`fit_cpu`) on every row, the cost per message from the smallest size's.
    """
    import numpy as np

    from ferro.backend.cost_model import CostModel, load_cost_model
    from ferro.collective.resolve import choose_allreduce
    from ferro.errors import ConfigurationError

    ours = [r for r in rows if r.library.startswith("ferro") and r.op == "allreduce" and r.size > 0]
    n = ours[0].world_size if ours else 0
    fitted: dict[str, tuple[float, float]] = {}
    if ours and not any(r.algorithm in FIT_ALGORITHMS for r in ours):
        print(f"ferro bench: --fit times the TCP backend's allreduce algorithms, but this run's allreduce was "
              f"{ours[0].library}'s ({ours[0].algorithm}); give --backend tcp", file=sys.stderr)
        return 1
    timed: dict[str, list[tuple[int, float]]] = {}
    for name in FIT_ALGORITHMS:
        mine = sorted((r for r in ours if r.algorithm == name), key=lambda row: row.size)
        if len(mine) < 2:
            print(f"ferro bench: --fit has {len(mine)} size(s) of {name}; give at least two (-b, -e, -f)",
                  file=sys.stderr)
            return 1
        seconds = never_faster_when_larger(np.array([r.time_us() for r in mine]) * 1e-6)
        timed[name] = [(r.size, float(t)) for r, t in zip(mine, seconds, strict=True)]
        formed = [i for i, r in enumerate(mine) if r.size >= FORM_MIN_BYTES]
        formed = formed if len(formed) >= 2 else list(range(len(mine)))
        # Each algorithm's closed form is alpha * A(size) + beta * B(size): A and B are its form with unit costs.
        per_message = np.array([CostModel(1.0, 0.0).allreduce(name, mine[i].size, n) for i in formed])
        per_byte = np.array([CostModel(0.0, 1.0).allreduce(name, mine[i].size, n) for i in formed])
        fitted[name] = nonnegative_fit(np.stack([per_message, per_byte], axis=1) / seconds[formed, None])
    largest = max(r.size for r in ours)
    ring_alpha, ring_beta = fitted["ring"]
    bytes_part = ring_beta * CostModel(0.0, 1.0).allreduce("ring", largest, n)
    if bytes_part < MIN_PER_BYTE_SHARE * (bytes_part + ring_alpha * CostModel(1.0, 0.0).allreduce("ring", largest, n)):
        # Without a per-byte cost the model cannot pace, segment or choose by size; an earlier model is worth more.
        print(f"ferro bench: --fit found no per-byte cost: the ring's time did not grow with size up to {largest} "
              f"bytes (noise larger than the transfer); give a larger -e (megabytes), more --iters, or a quieter "
              f"machine. {args.fit} is left as it was", file=sys.stderr)
        return 1
    where = f"--emulate {args.emulate}" if args.emulate else f"one host ({socket.gethostname()})"
    # Which kind of link this was, and the other kind's figures from an earlier fit into the same file.
    link = "between_hosts" if args.emulate and parse_emulation(args.emulate)[0] > 1 else "same_host"
    links: dict[str, tuple[float, float]] = {}
    line_rate = 0.0
    if os.path.exists(args.fit):
        try:
            earlier = load_cost_model(args.fit)
        except ConfigurationError:
            earlier = None  # not a model: overwritten
        links = dict(earlier.links) if earlier is not None else {}
        line_rate = earlier.line_rate if earlier is not None else 0.0  # a rate the user wrote in stays
    links[link] = (ring_alpha, ring_beta)
    if args.line_rate:  # the link's rate, which the fit cannot see through the links' buffers
        line_rate = payload_rate(args.line_rate)
    elif link == "between_hosts":  # the emulated links' rate
        line_rate = payload_rate(parse_emulation(args.emulate)[2])
    cpu = fit_cpu(ours, args)
    model = CostModel(ring_alpha, ring_beta, 0.0, f"{n} ranks, backend {ours[0].library}, {where}", fitted, n,
                      timed, link, links, line_rate, cpu)
    model.save(args.fit)
    print(f"# cost model written to {args.fit} ({model.fitted_on}); per algorithm, us per message and MB/s:")
    for name, (alpha, beta) in fitted.items():
        print(f"#   {name:>18}: alpha {alpha * 1e6:8.2f} us, beta {1 / beta / 1e6 if beta else float('inf'):8.1f} MB/s")
    if cpu[2]:
        print(f"#   the machine's CPU: {cpu[0] * 1e6:.2f} us per message, {cpu[1] * 1e9:.3f} ns per byte sent, "
              f"on {cpu[2]} cores")
    print(f"# {'size':>10} " + " ".join(f"{name:>18}" for name in FIT_ALGORITHMS)
          + f" {'chosen by the model':>20} {'by the rule':>20}   (measured us)")
    for size in sorted({r.size for r in ours}):
        measured = {r.algorithm: r.time_us() for r in ours if r.size == size}
        print(f"  {size:>10} " + " ".join(f"{measured.get(name, float('nan')):>18.1f}" for name in FIT_ALGORITHMS)
              + f" {model.choose_allreduce(size, n):>20} {choose_allreduce(size, n):>20}")
    return 0


def fit_cpu(rows: list[Row], args: argparse.Namespace) -> tuple[float, float, int]:
    """Return the machine's CPU seconds per message and per byte sent, and its cores, from the rows' CPU times.

    Each row's busy CPU per call (:attr:`Row.cpu_us`: every rank's and the kernel's) is shared out over the
    messages and bytes its plan moved on every rank (:func:`ferro.tools.bench.simulate.traffic`, the frames the
    mesh cut: a loaded model's, else the defaults), less what reducing took at the simulator's ``reduce_rate``.
    A least-squares fit of relative errors, as the times' fit (a row whose CPU is below the kernel's ticks, 10 ms
    on each core, over its calls is weighed as if it were that much: give ``--iters`` 20 or more), then the cost
    per message taken again from the smallest size's rows alone and the cost per byte refitted beside it.
    ``(0, 0, 0)`` where the rows have no CPU figures (off Linux) or the fit finds no cost.
    """
    import numpy as np

    from ferro._core import collectives as native
    from ferro.backend.cost_model import load_cost_model
    from ferro.tools.bench import simulate

    measured = [r for r in rows if r.cpu_us is not None and r.algorithm in simulate.ALGORITHMS]
    cores = os.cpu_count() or 1
    if len(measured) < 2:
        return 0.0, 0.0, 0
    n = measured[0].world_size
    hosts, per_host = parse_emulation(args.emulate)[:2] if args.emulate else (1, n)
    network = simulate.Network(hosts, per_host, 1.0)
    model = load_cost_model()  # the frames the ranks cut are the loaded model's
    segment, piece = (model.segment_bytes(), model.piece_bytes()) if model else (native.DEFAULT_SEGMENT_BYTES, 0)
    tick = cores / os.sysconf("SC_CLK_TCK")
    traffic, cpu, error = [], [], []
    for r in measured:
        messages, sent, reduced = simulate.traffic(network, r.algorithm, r.size, max(1, r.size // r.count),
                                                   segment=segment, piece=piece)
        if not messages:  # one rank: nothing moved to share the CPU out over
            return 0.0, 0.0, 0
        seconds = (r.cpu_us or 0.0) * 1e-6
        traffic.append((messages, sent))
        cpu.append(seconds - reduced / network.reduce_rate)
        error.append(max(tick / timed_calls(args.iters, r.size), seconds))
    counts, wanted, weight = np.array(traffic, dtype=float), np.array(cpu), 1 / np.array(error)
    per_message, per_byte = nonnegative_fit(counts * weight[:, None], wanted * weight)
    # One cost per message is an average: a message of a latency-bound call (its rank asleep until it lands)
    # costs more than one of a stream. The small calls are where the CPU sets the time, so their messages' cost
    # is taken from the smallest size timed, and the cost per byte refitted beside it.
    smallest = [i for i, r in enumerate(measured) if r.size == min(row.size for row in measured)]
    per_message = max(0.0, float(np.median([(wanted[i] - counts[i, 1] * per_byte) / counts[i, 0] for i in smallest])))
    per_byte = _one_cost(counts[:, 1] * weight, (wanted - counts[:, 0] * per_message) * weight)
    return (per_message, per_byte, cores) if per_message or per_byte else (0.0, 0.0, 0)


def never_faster_when_larger(seconds: np.ndarray) -> np.ndarray:
    """Return each size's time as the least of its own and every larger size's (``seconds`` by ascending size).

    One algorithm never takes less time for more bytes, and noise only adds time: a small size slower than a
    larger one was slowed (the other cores' work; on idle cores, two ranks waking each other from naps in turn:
    DESIGN.md, "Two sleepers in turn"), and the larger size's time is the tighter bound on it. In full test runs
    on the 2-core VM, one slow small size had pulled the fitted per-byte cost below zero.
    """
    import numpy as np

    return np.minimum.accumulate(seconds[::-1])[::-1]


def nonnegative_fit(design: np.ndarray, target: np.ndarray | None = None) -> tuple[float, float]:
    """Return the ``(alpha, beta) >= 0`` that best solve ``design @ (alpha, beta) = target`` in least squares.

    ``target`` defaults to ones: rows already divided by each size's time, so the fit weighs relative errors.
    Where the free fit makes one cost negative (noise at small sizes can), the best fit is on the boundary: the
    other cost alone, fitted again; clamping the negative one to zero instead would keep the other at a value
    fitted beside a negative partner.
    """
    import numpy as np

    wanted = np.ones(design.shape[0]) if target is None else target
    (alpha, beta), *_ = np.linalg.lstsq(design, wanted, rcond=None)
    if alpha >= 0 and beta >= 0:
        return float(alpha), float(beta)
    alpha_alone, beta_alone = _one_cost(design[:, 0], wanted), _one_cost(design[:, 1], wanted)
    candidates = [(0.0, 0.0), (alpha_alone, 0.0), (0.0, beta_alone)]
    return min(candidates, key=lambda pair: float(np.sum((design @ np.array(pair) - wanted) ** 2)))


def _one_cost(values: np.ndarray, wanted: np.ndarray) -> float:
    """Return the least-squares ``c >= 0`` of ``values * c = wanted`` (0 for a column of zeros)."""
    scale = float(values @ values)
    return max(0.0, float(values @ wanted) / scale) if scale > 0 else 0.0
