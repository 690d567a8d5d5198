"""Pipeline parallelism, public as ``ferro.pipeline`` (it lives in :mod:`ferro.parallel.pipeline`).

See :mod:`ferro.parallel.pipeline` for an example.
"""

from ferro.parallel.pipeline import (
    Action,
    ActionKind,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
    TraceEvent,
    write_chrome_trace,
)

__all__ = ["Action", "ActionKind", "PipelineStage", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B",
           "ScheduleZeroBubble", "TraceEvent", "write_chrome_trace"]
