"""Chrome/Perfetto traces of a pipeline step: one row per rank, one box per action, the bubbles visible."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ferro.parallel.pipeline.actions import ActionKind

__all__ = ["write_chrome_trace"]

_COLOURS = {  # Chrome's reserved colour names, so the kinds read at a glance
    ActionKind.FORWARD: "thread_state_running",
    ActionKind.BACKWARD: "rail_response",
    ActionKind.BACKWARD_INPUT: "rail_response",
    ActionKind.BACKWARD_WEIGHT: "rail_animation",
    ActionKind.RECV_F: "grey",
    ActionKind.RECV_B: "grey",
    ActionKind.SEND_F: "white",
    ActionKind.SEND_B: "white",
}


def write_chrome_trace(traces: Mapping[int, Iterable[Any]], path: str | os.PathLike[str]) -> None:
    """Write per-rank traces (``schedule.trace(gather=True)``) as a Chrome trace-event JSON file.

    Open it in ``chrome://tracing`` or https://ui.perfetto.dev: each rank is a row,
    each action a box named like ``"1F3"`` (stage 1, forward, microbatch 3);
    receives show how long the rank waited; the gaps are the bubble.

    Args:
        traces: Rank to its :class:`~ferro.pipeline.TraceEvent` list.
        path: Where to write.

    """
    events = [(rank, event) for rank, items in traces.items() for event in items]
    origin = min((event.start for _, event in events), default=0.0)
    out: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
        for rank in sorted(traces)]
    for rank, event in events:
        action = event.action
        out.append({
            "name": str(action), "cat": action.kind.name.lower(), "ph": "X", "pid": 0, "tid": rank,
            "ts": (event.start - origin) * 1e6, "dur": max(event.end - event.start, 0.0) * 1e6,
            "cname": _COLOURS[action.kind],
            "args": {"stage": action.stage, "microbatch": action.microbatch, "peer": action.peer},
        })
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)
