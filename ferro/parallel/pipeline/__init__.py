"""Pipeline parallelism: stages on ranks, GPipe, 1F1B, interleaved 1F1B and zero-bubble schedules.

Public as ``ferro.pipeline``. Example (4 ranks, one stage each)::

    stage = ferro.pipeline.PipelineStage(parts[rank], stage_index=rank, num_stages=4)
    schedule = ferro.pipeline.Schedule1F1B(stage, n_microbatches=8, loss_fn=nn.MSELoss())
    optimizer = nn.SGD(stage.parameters(), lr=0.1)
    optimizer.zero_grad()
    if rank == 0:
        schedule.step(x)
    elif rank == 3:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    optimizer.step()
"""

from ferro.parallel.pipeline.actions import Action, ActionKind
from ferro.parallel.pipeline.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
    TraceEvent,
)
from ferro.parallel.pipeline.stage import PipelineStage
from ferro.parallel.pipeline.trace import write_chrome_trace

__all__ = ["Action", "ActionKind", "PipelineStage", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B",
           "ScheduleZeroBubble", "TraceEvent", "write_chrome_trace"]
