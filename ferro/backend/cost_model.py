"""A latency-bandwidth cost model of the allreduce algorithms, fitted on the user's own network.

Each algorithm's time is the closed form of its schedule (``_core/schedule.h``) under the alpha-beta-gamma model:
``alpha`` seconds per message, ``beta`` seconds per byte moved, ``gamma`` seconds per byte reduced. For ``n`` ranks,
``p`` the largest power of two not above ``n`` and ``m`` bytes:

* ring: ``2 (n - 1) alpha + 2 (n - 1) / n m beta + (n - 1) / n m gamma``;
* recursive doubling: ``log2 p (alpha + m beta + m gamma)``, plus ``2 (alpha + m beta) + m gamma`` to fold and
  unfold the ranks beyond ``p``;
* halving-doubling: ``2 log2 p alpha + 2 (p - 1) / p m beta + (p - 1) / p m gamma``, plus the same fold.

The broadcast, all_gather and all_to_all choose by the closed forms in ``_core/schedule.h`` (tree or pipelined chain
and the chain's segment, Bruck or ring, Bruck or pairwise), which need two numbers of the link:
:meth:`CostModel.link_numbers` gives them to each TCP group's mesh.

``tests/test_schedule.py`` holds these forms to the simulator, which replays the schedules themselves, so the two
cannot drift apart. ``ferro bench --fit FILE`` times each algorithm at every size on the ranks it starts and fits
``alpha`` and ``beta`` to each one's own form (``per_algorithm``: what the link costs that algorithm, which the
shared costs do not always say), and writes them; ``FERRO_COST_MODEL=FILE`` makes every allreduce that is not
forced choose the algorithm the model predicts fastest. Every rank must read the same file (a rank that chose
otherwise fails with a mismatch that names both algorithms, see the call's fingerprint).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ferro import environment
from ferro.errors import ConfigurationError

__all__ = ["COPY_SECONDS_PER_BYTE", "COST_MODEL_ENV", "FORCED_PLAN_ENVS", "LINK_KINDS", "CostModel", "force_plans",
           "load_cost_model"]

#: A JSON file written by ``ferro bench --fit``: allreduce algorithms are chosen from it.
COST_MODEL_ENV = "FERRO_COST_MODEL"
_ALGORITHMS = ("ring", "recursive_doubling", "halving_doubling")
# A frame's size on a fitted link (CostModel.segment_bytes): loopback's best at most.
_SMALLEST_SEGMENT, _LARGEST_SEGMENT = 64 * 1024, 1024 * 1024
#: A streaming ring's frame is at least this many of the link's per-message costs (alpha / beta bytes) long.
PIECE_LATENCIES = 8
_SMALLEST_PIECE = 16 * 1024
#: The variables that force a TCP group's plan for an op (read when the group is made), by op.
FORCED_PLAN_ENVS = {"broadcast": "FERRO_ALGORITHM_BROADCAST", "reduce": "FERRO_ALGORITHM_REDUCE",
                    "all_gather": "FERRO_ALGORITHM_ALL_GATHER", "all_to_all": "FERRO_ALGORITHM_ALL_TO_ALL"}
#: The share of a fitted rate taken for the line when the line's rate is not known (CostModel.pace_bytes).
FITTED_PACE_SHARE = 0.95
#: The kinds of link a model holds costs for: ranks of one host, and ranks of different hosts.
LINK_KINDS = ("same_host", "between_hosts")
#: Seconds a rank spends copying one byte in memory (Bruck's rotations and packing): memcpy at about 3 GB/s, the
#: figure behind the mesh's default copy ratio (0.125 of a loopback link's 2.4 ns per byte).
COPY_SECONDS_PER_BYTE = 0.3e-9


@dataclass(frozen=True)
class CostModel:
    """The alpha-beta-gamma costs of one kind of link.

    Attributes:
        alpha: Seconds per message (latency and per-message overhead).
        beta: Seconds per byte sent.
        gamma: Seconds per byte reduced.
        fitted_on: What the figures were measured on (ranks, backend, host), for people.
        per_algorithm: ``{algorithm: (alpha, beta)}`` fitted to that algorithm's own runs, which replace the
            shared costs in its closed form (gamma then folded into beta). What one link costs is not all an
            algorithm pays: on an emulated 100 Mbit cluster halving-doubling, which sends and receives on one
            connection per step, ran 1.4-1.7x slower than the ring that the shared costs say it ties.
        world_size: The ranks ``measured`` was timed on (0: none).
        measured: ``{algorithm: [(bytes, seconds), ...]}`` as ``ferro bench --fit`` timed them (each the least of
            its own and every larger size's time: noise only adds time). At that world
            size and between the smallest and largest size timed, the choice reads these (interpolated on log
            scales) rather than the closed forms, which two costs cannot fit at every size; above them each
            form extrapolates from its largest timing; elsewhere the forms alone.
        link: The kind of link ``alpha`` and ``beta`` were measured on (:data:`LINK_KINDS`).
        links: ``{kind: (alpha, beta)}`` for every kind fitted so far (``ferro bench --fit`` keeps the other
            kind's figures when it refits one).
        line_rate: The most bytes of payload per second the link between hosts carries, where it is known
            (0: not known). ``ferro bench --fit --emulate`` records the emulated links' rate; on a real
            cluster, ``ferro bench --fit --line-rate 25gbit`` records the NIC's (``ethtool`` says it). A fit
            cannot see it: the links' buffers pass a short call faster than the line, and the fitted rate came
            out 9-10 % above it on every emulated cluster.
        cpu: ``(seconds per message, seconds per byte sent, cores)``: the CPU the fit's machine spent on the
            timed calls, every rank's and the kernel's (``/proc/stat``), shared out over the messages and bytes
            the plans moved; ``cores`` the machine's (0: not measured). Nothing chooses by it: the scale bench
            (``bench/bench_scale_collectives.py``) replays an emulated cluster's ranks' work on those cores,
            which is what sets small calls' time where many ranks share few cores.

    """

    alpha: float
    beta: float
    gamma: float = 0.0
    fitted_on: str = ""
    per_algorithm: dict[str, tuple[float, float]] = field(default_factory=dict)
    world_size: int = 0
    measured: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    link: str = "same_host"
    links: dict[str, tuple[float, float]] = field(default_factory=dict)
    line_rate: float = 0.0
    cpu: tuple[float, float, int] = (0.0, 0.0, 0)

    def link_numbers(self) -> tuple[float, float, float]:
        """Return ``(latency_bytes, copy_ratio, partner_ratio)`` for a TCP group's plans (``collectives.Mesh``).

        A flat group's broadcast, all_gather and all_to_all are as slow as their slowest links, so the link
        between hosts is taken when the model has one; else the one it has. ``latency_bytes`` is alpha / beta:
        the bytes one message's fixed cost is worth; ``copy_ratio`` a byte copied in memory in the link's bytes;
        ``partner_ratio`` what a byte costs in steps that each talk to a new partner against the ring's streaming
        to one: the last of :meth:`partner_curve` (its largest size's) where both were timed; else
        halving-doubling's fitted beta over the ring's (1 when the model has neither).
        """
        alpha, beta = self._slowest_link()
        partner_ratio = 1.0
        curve = self.partner_curve()
        if curve:
            partner_ratio = curve[-1][1]
        elif "ring" in self.per_algorithm and "halving_doubling" in self.per_algorithm:
            ring_beta, changing_beta = self.per_algorithm["ring"][1], self.per_algorithm["halving_doubling"][1]
            partner_ratio = max(1.0, changing_beta / ring_beta) if ring_beta > 0 else 1.0
        if beta <= 0:
            from ferro._core.collectives import DEFAULT_COPY_RATIO, DEFAULT_LATENCY_BYTES

            return DEFAULT_LATENCY_BYTES, DEFAULT_COPY_RATIO, partner_ratio
        return alpha / beta, COPY_SECONDS_PER_BYTE / beta, partner_ratio

    def partner_curve(self) -> list[tuple[int, float]]:
        """Return ``[(bytes, ratio), ...]``: what a byte sent to a new partner each step costs, by the call's size.

        At each size ``--fit`` timed both, halving-doubling's time over the ring's, no lower than 1 (where
        halving-doubling is faster its fewer messages win, which the forms count already). Both move the same
        bytes, the ring streaming to one neighbour and halving-doubling to a new partner each step, so the ratio
        is what the steps' partners cost: on the emulated clusters 1.0 to 64 KiB, and at 1 MiB 1.41 (8x1), 1.53
        (16x1), 2.33 (8x2); at 32x1 1.60 at 256 KiB. One ratio for all sizes (the fitted betas' 1.0-1.2, or the
        largest size's) either put Bruck's all_gather at 32x1 on 256 KiB-1 MiB (1.8-2.3x the ring's time) or
        the ring on 64 KiB (1.6x Bruck's). Empty when the model has not timed both at two sizes or more.
        """
        from ferro._core.collectives import PARTNER_CURVE_POINTS

        ring, changing = dict(self.measured.get("ring", [])), dict(self.measured.get("halving_doubling", []))
        both = sorted(size for size in set(ring) & set(changing) if size > 0 and ring[size] > 0)
        if len(both) > PARTNER_CURVE_POINTS:  # a mesh holds so many: every few sizes, the largest kept
            step = -(-len(both) // PARTNER_CURVE_POINTS)
            both = both[::-1][::step][::-1]
        return [(size, max(1.0, changing[size] / ring[size])) for size in both] if len(both) >= 2 else []

    def partner_ratio_at(self, nbytes: int) -> float:
        """Return the partner ratio a TCP group on this model chooses a call of ``nbytes`` with (``Mesh.partner``)."""
        from ferro._core.collectives import Mesh

        mesh = Mesh([None], 0, partner_ratio=self.link_numbers()[2])
        mesh.set_partner_curve(self.partner_curve())
        return float(mesh.partner_at(nbytes))

    def _slowest_link(self) -> tuple[float, float]:
        """Return ``(alpha, beta)`` of the link a flat group's large collectives wait on.

        The link between hosts when the model has it, else the one it has.
        """
        return self.links.get("between_hosts") or self.links.get(self.link) or (self.alpha, self.beta)

    def segment_bytes(self) -> int:
        """Return the largest frame a TCP group cuts its large messages into on this model's link.

        A frame leaves at line rate and waits in the bottleneck's queue: on the emulated 100 Mbit hosts (a 50 ms
        queue), 1 MiB frames overflowed it, and halving-doubling's 4 MiB allreduce among 16 hosts took 1.1-1.4 s
        with them, 0.79-0.83 s with 256 KiB and 0.74-0.77 s with 128 KiB ones (the ring's 16 MiB 5-10 % less with
        128 KiB). So a frame is kept to about 10 ms of the link: the power of two nearest that, between 64 KiB
        and loopback's 1 MiB (which a link of about 800 Mbit and up keeps).
        """
        beta = self._slowest_link()[1]
        if beta <= 0:
            return _LARGEST_SEGMENT
        within = 0.01 / beta
        return max(_SMALLEST_SEGMENT, min(_LARGEST_SEGMENT, 1 << max(0, round(math.log2(within)))))

    def piece_bytes(self) -> int:
        """Return the smallest frame the streaming ring cuts a chunk into on this model's link.

        A frame is worth cutting when its time on the wire is several times its fixed cost: ``PIECE_LATENCIES``
        times alpha / beta in whole pages, within 16 KiB and :meth:`segment_bytes`. Quarter-chunk frames took the
        1 MiB ring allreduce among 8 emulated hosts of 2 ranks (200 Mbit) from 85-99 ms to 83 ms; on loopback,
        where a frame's wake-up costs more than the link's time it saves, they made it slower, and the default
        mesh keeps whole chunks.
        """
        alpha, beta = self._slowest_link()
        if beta <= 0:
            return self.segment_bytes()
        piece = int(min(self.segment_bytes(), PIECE_LATENCIES * alpha / beta))
        return max(_SMALLEST_PIECE, piece - piece % 4096)  # whole pages

    def pace_bytes(self, ranks_per_host: int = 1, world_size: int = 0) -> float:
        """Return a rank's share of its host's link (bytes per second): what its all_to_all's flows may carry.

        The all_to_all holds its flows to a budget of this many bytes a second's ``FLIGHT_BUDGET_SECONDS``
        unacknowledged (``Mesh.pace_bytes``).

        The link's rate is :attr:`line_rate` where that is known (or the fitted rate, if lower), else
        ``FITTED_PACE_SHARE`` of the fitted rate, which overstates the line: the fit put the emulated 100 Mbit
        links at 13.2 MB/s, where TCP carries 11.96. A host's ranks share its link, so each gets
        ``1 / ranks_per_host`` of it; and of a rank's ``world_size - 1`` flows, the ``ranks_per_host - 1`` to its
        own host's ranks do not cross the link, so the whole is raised by ``(world_size - 1) / (world_size -
        ranks_per_host)`` for the others to fill the rank's share (exact where one window holds all the flows, up
        to 17 ranks; beyond, a window without the local flows runs that much over the share). 0 (no budget)
        without a rate.

        Measured when the share paced the flows (``SO_MAX_PACING_RATE``, before the budget replaced it; ``ferro
        bench all_to_all``, two or three rounds each, alternating): 16 hosts at 100 Mbit, 4 and
        16 MiB, paced to 95 % of the fit (1.04 of the line) 364-382 and 1,485-1,507 ms; to 95 % of the line
        355-360 and 1,425-1,433; to the line 344 and 1,340-1,345. 8 hosts of 2 ranks at 200 Mbit, 16 MiB:
        1,303-1,313 ms paced to 95 % of the fit, 1,407-1,418 to 95 % of the line without the local flows'
        correction, 1,329-1,363 to the line without it, 1,256-1,260 to the line with it (this rule).
        """
        beta = self._slowest_link()[1]
        if beta <= 0:
            return 0.0
        rate = min(1 / beta, self.line_rate) if self.line_rate > 0 else FITTED_PACE_SHARE / beta
        ranks_per_host = max(1, ranks_per_host)
        share = rate / ranks_per_host
        if world_size > ranks_per_host:
            share *= (world_size - 1) / (world_size - ranks_per_host)
        return share

    def allreduce(self, algorithm: str, nbytes: int, world_size: int) -> float:
        """Return the predicted seconds of an allreduce of ``nbytes`` over ``world_size`` ranks."""
        n, m = world_size, float(nbytes)
        if n < 2 or m == 0:
            return 0.0
        a, b, g = self.alpha, self.beta, self.gamma
        if algorithm in self.per_algorithm:
            (a, b), g = self.per_algorithm[algorithm], 0.0
        power = 1 << (n.bit_length() - 1)
        rounds = int(math.log2(power))
        fold = (2 * (a + m * b) + m * g) if n > power else 0.0
        if algorithm == "ring":
            # Streamed (collectives._stream_ring): a reduce-scatter step's frames are reduced while the next ones
            # arrive, so a step costs its chunk at the slower of link and reduction, plus one frame at the other.
            chunk = m / n
            frame = min(chunk, float(self.piece_bytes()))
            return (2 * (n - 1) * a + (n - 1) * (chunk * max(b, g) + frame * min(b, g))
                    + (n - 1) / n * m * b)
        if algorithm == "recursive_doubling":
            return rounds * (a + m * b + m * g) + fold
        if algorithm == "halving_doubling":
            return 2 * rounds * a + 2 * (power - 1) / power * m * b + (power - 1) / power * m * g + fold
        raise ValueError(f"no cost for allreduce algorithm {algorithm!r}; use one of {', '.join(_ALGORITHMS)}")

    def choose_allreduce(self, nbytes: int, world_size: int) -> str:
        """Return the algorithm predicted fastest (the first of ring, recursive doubling, halving-doubling on a tie).

        Inside the sizes timed at this world size, the timings decide (interpolated); above them, each timed
        algorithm's form scaled to its largest timing (:meth:`_extrapolated`); elsewhere the forms alone.
        """
        timed = None
        if world_size == self.world_size:
            timed = self._interpolated(nbytes) or self._extrapolated(nbytes)
        if timed:
            return min(timed, key=lambda name: timed[name])
        return min(_ALGORITHMS, key=lambda name: self.allreduce(name, nbytes, world_size))

    def _extrapolated(self, nbytes: int) -> dict[str, float] | None:
        """Each timed algorithm's seconds above its largest timing: its form times (timing / form) there.

        A least-squares form can miss the largest size by far when a schedule slows as its messages grow: at
        32x1@100mbit halving-doubling's form, fitted from 4 KiB to 256 KiB, read 44 ms at 256 KiB where it took
        69 ms, and chose it over the ring from 1 MiB, where it then ran 1.08-1.24 s against the ring's 0.69-0.72
        s at 4 MiB. Kept at its largest timing's ratio (1.59) the form reads 1.08 s there.
        """
        times: dict[str, float] = {}
        for name, points in self.measured.items():
            largest, seconds = max(points) if points else (0, 0.0)
            form = self.allreduce(name, largest, self.world_size)
            if not 0 < largest < nbytes or seconds <= 0 or form <= 0:
                return None
            times[name] = self.allreduce(name, nbytes, self.world_size) * seconds / form
        return times or None

    def _interpolated(self, nbytes: int) -> dict[str, float] | None:
        """Each timed algorithm's seconds at ``nbytes``, log-log interpolated; None outside the timed sizes."""
        times: dict[str, float] = {}
        for name, points in self.measured.items():
            points = sorted(points)
            if len(points) < 2 or not points[0][0] <= nbytes <= points[-1][0] or nbytes <= 0:
                return None
            for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
                if x0 <= nbytes <= x1:
                    if x1 == x0 or min(x0, y0, y1) <= 0:
                        times[name] = y0
                    else:
                        share = math.log(nbytes / x0) / math.log(x1 / x0)
                        times[name] = math.exp(math.log(y0) + share * math.log(y1 / y0))
                    break
        return times or None

    def save(self, path: str | Path) -> None:
        """Write the model as JSON."""
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


def load_cost_model(path: str | None = None) -> CostModel | None:
    """Return the model in ``path`` (default ``$FERRO_COST_MODEL``), or None when there is none.

    Raises:
        ConfigurationError: The file cannot be read or is not a model ``ferro bench --fit`` wrote.

    """
    path = path or environment.get(COST_MODEL_ENV)
    if not path:
        return None
    try:
        fields = json.loads(Path(path).read_text())
        per_algorithm = {str(name): (float(pair[0]), float(pair[1]))
                         for name, pair in dict(fields.get("per_algorithm", {})).items()}
        measured = {str(name): [(int(size), float(seconds)) for size, seconds in points]
                    for name, points in dict(fields.get("measured", {})).items()}
        links = {str(kind): (float(pair[0]), float(pair[1])) for kind, pair in dict(fields.get("links", {})).items()}
        model = CostModel(float(fields["alpha"]), float(fields["beta"]), float(fields.get("gamma", 0.0)),
                          str(fields.get("fitted_on", "")), per_algorithm, int(fields.get("world_size", 0)),
                          measured, str(fields.get("link", "same_host")), links,
                          float(fields.get("line_rate", 0.0)), _cpu_costs(fields.get("cpu", (0.0, 0.0, 0))))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigurationError(f"{COST_MODEL_ENV}={path}: not a cost model written by ferro bench --fit ({exc})"
                                 ) from None
    unknown = sorted((set(model.per_algorithm) | set(model.measured)) - set(_ALGORITHMS))
    if unknown:
        raise ConfigurationError(f"{COST_MODEL_ENV}={path}: no allreduce algorithm named {unknown[0]!r}")
    kinds = sorted({model.link, *model.links} - set(LINK_KINDS))
    if kinds:
        raise ConfigurationError(f"{COST_MODEL_ENV}={path}: no kind of link named {kinds[0]!r}; "
                                 f"use {' or '.join(LINK_KINDS)}")
    pairs = [*model.per_algorithm.values(), *model.links.values(), model.cpu]
    if min(model.alpha, model.beta, model.gamma, model.line_rate, *(c for pair in pairs for c in pair)) < 0:
        raise ConfigurationError(f"{COST_MODEL_ENV}={path}: costs must not be negative: {model}")
    return model


def _cpu_costs(value: Any) -> tuple[float, float, int]:
    per_message, per_byte, cores = value
    return float(per_message), float(per_byte), int(cores)


def force_plans(mesh: Any, rank: int) -> None:
    """Make ``mesh`` run the plans ``$FERRO_ALGORITHM_BROADCAST``, ``_REDUCE``, ``_ALL_GATHER``, ``_ALL_TO_ALL`` name.

    Raises:
        ConfigurationError: A variable names no plan of its op (the message lists the plans).

    """
    for op, variable in FORCED_PLAN_ENVS.items():
        name = environment.get(variable)
        if name:
            try:
                mesh.force(op, name)
            except ValueError as exc:
                raise ConfigurationError(f"rank {rank}: {variable}={name}: {exc}") from None
