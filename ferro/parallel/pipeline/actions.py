"""What each rank does in a pipeline step, in order: the action lists every schedule is built from.

A schedule is a pure function of (number of ranks, stages, microbatches): for each
rank, the ordered compute actions (forward, backward, or backward split into its
input-gradient and weight-gradient halves), with the sends and receives that
connect neighbouring stages inserted around them. The runtime
(:mod:`ferro.parallel.pipeline.schedules`) executes a list as written, so what
``schedule.actions(rank)`` shows is what runs.

Stage ``k`` lives on rank ``k % world_size`` (one stage per rank, or several,
interleaved). ``SEND_F`` of stage ``k`` pairs with ``RECV_F`` of stage ``k + 1``
(the activation); ``SEND_B`` of stage ``k`` pairs with ``RECV_B`` of stage
``k - 1`` (the gradient of stage ``k``'s input).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Action", "ActionKind", "gpipe_order", "interleaved_order", "one_f_one_b_order", "schedule_actions",
           "with_communication", "zero_bubble_order"]


class ActionKind(enum.Enum):
    """What an action does. Compute: F, B (full backward), I (input gradient), W (weight gradient)."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        """Whether the action runs the stage's module (not a send or a receive)."""
        return self in _COMPUTE


_COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` on ``stage`` for ``microbatch`` (``peer``: the other rank of a transfer).

    ``str(action)`` reads like torch's notation: ``"2F5"`` is stage 2's forward of
    microbatch 5; ``"2SEND_F5->3"`` sends its activation to rank 3.
    """

    kind: ActionKind
    stage: int
    microbatch: int
    peer: int | None = None

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        if self.peer is None:
            return text
        arrow = "->" if self.kind in (ActionKind.SEND_F, ActionKind.SEND_B) else "<-"
        return f"{text}{arrow}{self.peer}"

    __repr__ = __str__


Order = list[tuple[ActionKind, int, int]]  # compute actions of one rank: (kind, stage, microbatch)

# The letters of the schedule literature (and of torch's notation).
F, B, I, W = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,  # noqa: E741
              ActionKind.BACKWARD_WEIGHT)


def gpipe_order(stage: int, n_microbatches: int) -> Order:
    """Every forward, then every backward: ``n_microbatches`` activations held at the peak."""
    return [(F, stage, i) for i in range(n_microbatches)] + [(B, stage, i) for i in range(n_microbatches)]


def one_f_one_b_order(stage: int, num_stages: int, n_microbatches: int) -> Order:
    """1F1B: ``num_stages - stage - 1`` warm-up forwards, then one forward and one backward in turn.

    At most ``num_stages - stage`` microbatches' activations are held at once.
    """
    warmup = min(num_stages - stage - 1, n_microbatches)
    order: Order = [(F, stage, i) for i in range(warmup)]
    for i in range(n_microbatches - warmup):
        order += [(F, stage, warmup + i), (B, stage, i)]
    order += [(B, stage, i) for i in range(n_microbatches - warmup, n_microbatches)]
    return order


def interleaved_order(rank: int, world_size: int, stages_per_rank: int, n_microbatches: int) -> Order:
    """Interleaved 1F1B (Megatron-LM's virtual stages): rank ``r`` holds stages ``r, r + p, r + 2p, ...``.

    Forwards visit the rank's stages round by round: microbatches go in groups of
    ``world_size``; each group passes through stage ``r``, then ``r + p``, and so
    on. Backwards visit them in the reverse stage order. After a warm-up of
    ``2 (p - r - 1) + (v - 1) p`` forwards, forwards and backwards alternate.
    When ``n_microbatches`` is not a multiple of ``p``, the order is the one of
    the next multiple with the missing microbatches left out.
    """
    p, v, m = world_size, stages_per_rank, n_microbatches
    # The textbook order needs whole groups of p microbatches: pad with microbatches that do not exist,
    # then drop them. Dropping every action of some microbatches from an order that cannot deadlock
    # leaves one that cannot either (what remains depends only on what remains).
    padded = -(-m // p) * p
    forwards = [(c * p + rank, i) for start in range(0, padded, p) for c in range(v) for i in range(start, start + p)]
    backwards = [(c * p + rank, i) for start in range(0, padded, p) for c in reversed(range(v))
                 for i in range(start, start + p)]
    total = len(forwards)
    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order: Order = [(F, s, i) for s, i in forwards[:warmup]]
    for k in range(total - warmup):
        order.append((F, *forwards[warmup + k]))
        order.append((B, *backwards[k]))
    order += [(B, s, i) for s, i in backwards[total - warmup:]]
    return [action for action in order if action[2] < m]


def zero_bubble_order(num_stages: int, n_microbatches: int) -> list[Order]:
    """ZB-H1: backward split into I (input gradient) and W (weight gradient); W fills the bubbles.

    Built by playing the pipeline forward in time with unit-cost F, I and W. A
    free stage runs, in this order of preference: a ready F, while fewer than
    ``num_stages - stage`` microbatches await their I (1F1B's warm-up) and fewer
    than ``num_stages`` are held (forward done, W not yet: ZB-H1's memory, 1F1B's
    peak on stage 0); else a ready I; else the oldest pending W. With equal
    F, I and W times this reaches ZB-H1's ``3m + p - 1`` units (1F1B: ``3(m + p - 1)``).
    The orders come from one feasible execution, so they cannot deadlock
    whatever the real durations.

    Returns:
        One order per stage (stage ``s`` on rank ``s``).

    """
    p, m = num_stages, n_microbatches
    orders: list[Order] = [[] for _ in range(p)]
    forward_done = [[-1.0] * m for _ in range(p)]  # when each (stage, microbatch) finished, or -1
    input_done = [[-1.0] * m for _ in range(p)]
    next_f, next_i, next_w = [0] * p, [0] * p, [0] * p
    free_at = [0.0] * p
    remaining = 3 * p * m
    clock = 0.0
    while remaining:
        progressed = False
        for s in range(p):
            if free_at[s] > clock:
                continue
            i_mb, f_mb = next_i[s], next_f[s]
            choice: tuple[ActionKind, int] | None = None
            forward_ready = f_mb < m and (s == 0 or 0 <= forward_done[s - 1][f_mb] <= clock)
            if forward_ready and f_mb - i_mb < p - s and f_mb - next_w[s] < p:
                choice = (F, f_mb)
            elif i_mb < m and 0 <= forward_done[s][i_mb] <= clock and (
                    s == p - 1 or 0 <= input_done[s + 1][i_mb] <= clock):
                choice = (I, i_mb)
            elif next_w[s] < i_mb:
                choice = (W, next_w[s])
            if choice is None:
                continue
            kind, mb = choice
            orders[s].append((kind, s, mb))
            free_at[s] = clock + 1.0
            if kind is F:
                next_f[s] += 1
                forward_done[s][mb] = clock + 1.0
            elif kind is I:
                next_i[s] += 1
                input_done[s][mb] = clock + 1.0
            else:
                next_w[s] += 1
            remaining -= 1
            progressed = True
        pending = [t for t in free_at if t > clock]
        if not progressed and not pending:  # pragma: no cover - the rules above always leave a ready action
            raise RuntimeError("zero-bubble order: no stage can move")
        clock = min(pending) if pending else clock
    return orders


def with_communication(order: Order, rank: int, num_stages: int, rank_of: Callable[[int], int]) -> list[Action]:
    """Insert the receive each compute action needs before it, and the send of what it made after it.

    Transfers between stages on the same rank are handed over in memory, without actions.
    """
    actions: list[Action] = []
    for kind, stage, mb in order:
        before = after = None
        if kind is F:
            if stage > 0 and rank_of(stage - 1) != rank:
                before = Action(ActionKind.RECV_F, stage, mb, rank_of(stage - 1))
            if stage < num_stages - 1 and rank_of(stage + 1) != rank:
                after = Action(ActionKind.SEND_F, stage, mb, rank_of(stage + 1))
        elif kind in (B, I):
            if stage < num_stages - 1 and rank_of(stage + 1) != rank:
                before = Action(ActionKind.RECV_B, stage, mb, rank_of(stage + 1))
            if stage > 0 and rank_of(stage - 1) != rank:
                after = Action(ActionKind.SEND_B, stage, mb, rank_of(stage - 1))
        if before is not None:
            actions.append(before)
        actions.append(Action(kind, stage, mb))
        if after is not None:
            actions.append(after)
    return actions


def schedule_actions(kind: str, world_size: int, num_stages: int, n_microbatches: int) -> list[list[Action]]:
    """Every rank's action list for a schedule: ``kind`` is gpipe, 1f1b, interleaved or zero_bubble.

    Pure: no group needed, so lists can be inspected (and checked) for any size.
    """
    p, m = world_size, n_microbatches
    if kind == "gpipe":
        orders = [gpipe_order(r, m) for r in range(p)]
    elif kind == "1f1b":
        orders = [one_f_one_b_order(r, num_stages, m) for r in range(p)]
    elif kind == "interleaved":
        orders = [interleaved_order(r, p, num_stages // p, m) for r in range(p)]
    elif kind == "zero_bubble":
        orders = zero_bubble_order(num_stages, m)
    else:
        raise ValueError(f"unknown schedule kind {kind!r} (gpipe, 1f1b, interleaved, zero_bubble)")
    return [with_communication(order, r, num_stages, lambda stage: stage % p) for r, order in enumerate(orders)]


def stages_of_rank(rank: int, world_size: int, num_stages: int) -> Sequence[int]:
    """Return the stages rank ``rank`` runs: ``rank, rank + world_size, ...``."""
    return range(rank, num_stages, world_size)
