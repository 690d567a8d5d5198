"""Pipeline schedules: GPipe, 1F1B, interleaved 1F1B and zero bubble (ZB-H1), and the runtime they share.

Every schedule is an action list per rank (:mod:`ferro.parallel.pipeline.actions`);
``step`` executes this rank's list as written. Compute runs on the calling
thread; sends and receives run on per-direction channel groups
(:mod:`ferro.parallel.pipeline._channels`), so a receive is posted before the
action that needs it and a send never holds up the compute. A rank that fails
part-way tells its neighbours, who tell theirs: every rank raises, naming it.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ferro._core.status import ABORT_OTHER
from ferro._core.transport import abort_payload
from ferro.collective import all_gather_object
from ferro.collective.resolve import resolve_timeout
from ferro.collective.work import PendingCollective
from ferro.errors import ConfigurationError, DistributedError, RankFailedError
from ferro.parallel.pipeline._channels import ACTIVATIONS, GRADIENTS, MAX_MICROBATCHES, Channel, make_channels
from ferro.parallel.pipeline.actions import (
    Action,
    ActionKind,
    schedule_actions,
    stages_of_rank,
)
from ferro.parallel.pipeline.stage import PipelineStage, TorchRunner

__all__ = ["Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleZeroBubble", "TraceEvent"]

POLL_SECONDS = 0.05  # how often a rank waiting on one transfer looks at the others for a failure
NOTICE_GRACE_SECONDS = 1.0  # how long a failed send waits for the abort notice that explains it
NOTICE_LINGER_SECONDS = 0.2  # how long a rank that gives up keeps its channels open for its notices to be read
_CULPRIT = re.compile(r"pipeline: rank (\d+) failed")


@dataclass(frozen=True)
class TraceEvent:
    """One action of one rank in the last step: wall-clock ``start`` and ``end`` in seconds.

    Compute actions last as long as they ran; a receive, as long as the rank
    waited for it; a send is the instant it was queued.
    """

    rank: int
    action: Action
    start: float
    end: float


class _PipelineSchedule:
    """What every schedule shares: validation, the channels, the runtime, the trace."""

    name = "pipeline"
    kind = ""  # the action-list generator (ferro.parallel.pipeline.actions.schedule_actions)

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Any) -> None:
        if not stages:
            raise ValueError(f"{self.name}: no stages given")
        self._stages = {stage.stage_index: stage for stage in stages}
        first = stages[0]
        self.group = first.group
        self.num_stages = first.num_stages
        rank, world = self.group.rank, self.group.world_size
        if any(stage.group is not self.group or stage.num_stages != self.num_stages for stage in stages):
            raise ValueError(f"rank {rank}: {self.name}: the stages disagree on their group or num_stages")
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or not (
                1 <= n_microbatches < MAX_MICROBATCHES):
            raise ValueError(f"rank {rank}: {self.name}: n_microbatches must be an integer in "
                             f"[1, {MAX_MICROBATCHES}), got {n_microbatches!r}")
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self._validate(rank, world)
        mine = list(stages_of_rank(rank, world, self.num_stages))
        if sorted(self._stages) != mine:
            raise ValueError(f"rank {rank}: {self.name}: this rank runs stages {mine} of {self.num_stages} "
                             f"(stage k on rank k % {world}) but was given {sorted(self._stages)}")
        last = self._stages.get(self.num_stages - 1)
        if last is not None and loss_fn is None:
            raise ValueError(f"rank {rank}: {self.name}: the last stage needs a loss_fn")
        if last is not None and not isinstance(last.runner, TorchRunner) and not hasattr(loss_fn, "backward"):
            raise ValueError(f"rank {rank}: {self.name}: a ferro.nn last stage needs a loss_fn with backward() "
                             f"(ferro.nn.MSELoss, ferro.nn.CrossEntropyLoss)")
        self._actions = schedule_actions(self.kind, world, self.num_stages, n_microbatches)
        self._channels: dict[tuple[str, int, int], Channel] | None = None
        self._broken: str | None = None
        self._trace: list[TraceEvent] = []

    # --- what each schedule defines -----------------------------------------------------

    def _validate(self, rank: int, world: int) -> None:
        if self.num_stages != world:
            raise ValueError(f"rank {rank}: {self.name}: one stage per rank: num_stages={self.num_stages} but the "
                             f"group has {world} ranks (ScheduleInterleaved1F1B runs several stages per rank)")

    # --- public -------------------------------------------------------------------------

    def actions(self, rank: int | None = None) -> list[Action]:
        """Return the ordered actions of ``rank`` (default: this rank), sends and receives included."""
        rank = self.group.rank if rank is None else rank
        if not 0 <= rank < self.group.world_size:
            raise ValueError(f"{self.name}: rank {rank} is outside [0, {self.group.world_size})")
        return list(self._actions[rank])

    def trace(self, gather: bool = False) -> dict[int, list[TraceEvent]]:
        """Return the last step's actions with their start and end times, by rank.

        Args:
            gather: Collect every rank's (a collective: every rank calls it);
                else only this rank's.

        """
        if not gather:
            return {self.group.rank: list(self._trace)}
        every = all_gather_object(self._trace, group=self.group)
        return {rank: list(events) for rank, events in enumerate(every)}

    def step(self, *inputs: Any, target: Any = None, losses: list[Any] | None = None,
             timeout: float | None = None) -> Any:
        """Run one training step of the whole batch: forward and backward of every microbatch.

        The first stage's rank passes the batch (each input is split along dim 0
        into ``n_microbatches``, as ``numpy.array_split``); the last stage's rank
        passes ``target`` (split the same way) and may pass ``losses``, a list
        that receives each microbatch's loss. Other ranks call ``step()``.
        Gradients accumulate into the parameters' ``.grad`` over the microbatches,
        scaled by ``1 / n_microbatches``: the step equals one process on the whole
        batch with the mean of the microbatch losses. The optimizer step is yours.

        Example::

            # rank 0 (stage 0)
            schedule.step(x)
            # rank 3 (last stage)
            losses = []
            schedule.step(target=y, losses=losses)
            # ranks 1, 2
            schedule.step()

        Returns:
            On the last stage's rank, its outputs of the whole batch; else None.

        Raises:
            ValueError: Inputs missing on the first stage, or a target on the last.
            RankFailedError: Another rank failed part-way (it is named).
            Whatever this rank's own model raised (its peers learn of it).

        """
        rank = self.group.rank
        if self._broken is not None:
            raise RankFailedError(f"rank {rank}: {self.name}: the pipeline is unusable after a failed step "
                                  f"({self._broken}); build a new group, stages and schedule", None)
        seconds = resolve_timeout(self.group, timeout)
        if self._channels is None:
            self._channels = self._connect(seconds)
        try:
            batches = self._split_inputs(inputs, target)
        except ValueError as exc:  # the other ranks would wait for this one: tell them
            self._abort(rank, f"pipeline: rank {rank} failed: ValueError: {exc}")
            raise
        for stage in self._stages.values():
            stage.activations_held = stage.peak_activations_held = 0
        run = _StepRun(self, batches, seconds)
        replicated = [stage.ddp for stage in self._stages.values() if stage.ddp is not None]
        try:
            with contextlib.ExitStack() as stack:  # a DDP stage accumulates locally; averaged once, below
                for ddp in replicated:
                    stack.enter_context(ddp.no_sync())
                outputs = run.execute(self.actions())
        finally:
            self._trace = run.trace
        for ddp in replicated:
            ddp.sync_gradients()
        if losses is not None:
            losses.extend(run.losses[mb] for mb in sorted(run.losses))
        if outputs is None:
            return None
        return self._stages[self.num_stages - 1].runner.concatenate(outputs)

    # --- internals ----------------------------------------------------------------------

    def _split_inputs(self, inputs: tuple[Any, ...], target: Any) -> dict[str, list[Any]]:
        rank, m = self.group.rank, self.n_microbatches
        batches: dict[str, list[Any]] = {}
        first = self._stages.get(0)
        if first is not None:
            if not inputs:
                raise ValueError(f"rank {rank}: {self.name}.step: this rank runs stage 0 and must pass the batch")
            columns = [self._split(first, x, "input") for x in inputs]
            batches["inputs"] = [tuple(column[mb] for column in columns) for mb in range(m)]
        elif inputs:
            raise ValueError(f"rank {rank}: {self.name}.step: only stage 0's rank passes inputs "
                             f"(this rank runs stages {sorted(self._stages)})")
        last = self._stages.get(self.num_stages - 1)
        if last is not None:
            if target is None:
                raise ValueError(f"rank {rank}: {self.name}.step: this rank runs the last stage and must pass "
                                 f"target")
            batches["targets"] = self._split(last, target, "target")
        elif target is not None:
            raise ValueError(f"rank {rank}: {self.name}.step: only the last stage's rank passes target")
        return batches

    def _split(self, stage: PipelineStage, value: Any, what: str) -> list[Any]:
        rows = len(value)
        if rows < self.n_microbatches:
            raise ValueError(f"rank {self.group.rank}: {self.name}.step: the {what} has {rows} rows, fewer than "
                             f"n_microbatches={self.n_microbatches}")
        return stage.runner.split(value, self.n_microbatches)

    def _connect(self, seconds: float) -> dict[tuple[str, int, int], Channel]:
        """Check that every rank built the same pipeline, then make the channels (collective)."""
        group, world = self.group, self.group.world_size
        mine = (self.name, self.num_stages, self.n_microbatches, sorted(self._stages))
        every = all_gather_object(mine, group=group, timeout=seconds)
        differ = [r for r, theirs in enumerate(every) if theirs[:3] != mine[:3]]
        if differ:
            described = "; ".join(f"rank {r}: {every[r][0]} with {every[r][1]} stages and {every[r][2]} "
                                  f"microbatches" for r in range(world))
            raise ConfigurationError(f"rank {group.rank}: the ranks built different pipelines ({described}); "
                                     f"ranks {differ} differ from this one")
        pairs = sorted({(stage % world, (stage + 1) % world) for stage in range(self.num_stages - 1)
                        if stage % world != (stage + 1) % world})
        return make_channels(group, pairs, seconds)

    def _abort(self, culprit: int, message: str) -> None:
        """Tell every neighbour why the step ended, then close the channels (which wakes their transfers)."""
        self._broken = message
        payload = abort_payload(ABORT_OTHER, culprit, message)
        for channel in (self._channels or {}).values():
            channel.group.mark_failed(message)
            channel.group.abort_peers(payload)
        # Closing at once could reset a connection before the peer has read the notice (unread data in a
        # closed socket turns into a reset that discards it): give the notices a moment first.
        time.sleep(NOTICE_LINGER_SECONDS if self._channels else 0.0)
        for channel in (self._channels or {}).values():
            channel.group.close()


class _StepRun:
    """One step of one rank: executes the action list, keeps per-microbatch state and the trace."""

    def __init__(self, schedule: _PipelineSchedule, batches: dict[str, list[Any]], seconds: float) -> None:
        self.schedule = schedule
        self.seconds = seconds
        self.rank = schedule.group.rank
        self.inputs: dict[tuple[int, int], tuple[Any, ...]] = {}  # (stage, mb) -> that stage's inputs
        for mb, values in enumerate(batches.get("inputs", [])):
            self.inputs[(0, mb)] = values
        self.targets = batches.get("targets", [])
        self.output_grads: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.contexts: dict[tuple[int, int], dict[str, Any]] = {}
        self.outbox: dict[tuple[ActionKind, int, int], tuple[Any, ...]] = {}
        self.losses: dict[int, float] = {}
        self.last_outputs: dict[int, Any] = {}
        self.sends: list[tuple[Channel, PendingCollective]] = []
        self.posted: dict[tuple[str, int, int], deque[tuple[Action, PendingCollective | None]]] = {}
        self.trace: list[TraceEvent] = []

    # --- the loop -----------------------------------------------------------------------

    def execute(self, actions: list[Action]) -> list[Any] | None:
        schedule = self.schedule
        self._plan_receives(actions)
        current: Action | None = None
        try:
            for current in actions:
                start = time.time()
                self._do(current)
                self.trace.append(TraceEvent(self.rank, current, start, time.time()))
            for channel, handle in self.sends:
                self._wait(handle, channel)
        except BaseException as exc:
            self._fail(exc, current)
        if schedule.num_stages - 1 not in schedule._stages:
            return None
        return [self.last_outputs[mb] for mb in range(schedule.n_microbatches)]

    def _do(self, action: Action) -> None:
        kind, stage_index, mb = action.kind, action.stage, action.microbatch
        schedule = self.schedule
        key = (stage_index, mb)
        if kind is ActionKind.RECV_F:
            self.inputs[key] = self._receive(ACTIVATIONS, action)
        elif kind is ActionKind.RECV_B:
            self.output_grads[key] = self._receive(GRADIENTS, action)
        elif kind is ActionKind.SEND_F or kind is ActionKind.SEND_B:
            self._send(action)
        elif kind is ActionKind.FORWARD:
            stage = schedule._stages[stage_index]
            outputs, ctx = stage.runner.forward(self.inputs.pop(key))
            stage._hold(+1)
            self.contexts[key] = ctx
            if stage.is_last:
                self.losses[mb] = stage.runner.loss(ctx, schedule.loss_fn, self.targets[mb],
                                                    1.0 / schedule.n_microbatches)
                self.last_outputs[mb] = outputs[0] if len(outputs) == 1 else outputs
            elif (stage_index + 1) in schedule._stages:
                self.inputs[(stage_index + 1, mb)] = outputs  # the next stage is here too
            else:
                self.outbox[(ActionKind.SEND_F, stage_index, mb)] = outputs
        elif kind is ActionKind.BACKWARD or kind is ActionKind.BACKWARD_INPUT:
            stage = schedule._stages[stage_index]
            grads = None if stage.is_last else self.output_grads.pop(key)
            if kind is ActionKind.BACKWARD:
                input_grads = stage.runner.backward(self.contexts.pop(key), grads)
                stage._hold(-1)
            else:
                input_grads = stage.runner.backward_input(self.contexts[key], grads)
            if stage_index > 0:
                if (stage_index - 1) in schedule._stages:
                    self.output_grads[(stage_index - 1, mb)] = input_grads
                else:
                    self.outbox[(ActionKind.SEND_B, stage_index, mb)] = input_grads
        elif kind is ActionKind.BACKWARD_WEIGHT:
            stage = schedule._stages[stage_index]
            stage.runner.backward_weight(self.contexts.pop(key))
            stage._hold(-1)

    # --- transfers ----------------------------------------------------------------------

    def _channel(self, kind: str, action: Action) -> Channel:
        channels = self.schedule._channels
        assert channels is not None and action.peer is not None
        incoming = action.kind in (ActionKind.RECV_F, ActionKind.RECV_B)
        src, dst = (action.peer, self.rank) if incoming else (self.rank, action.peer)
        return channels[(kind, src, dst)]

    def _plan_receives(self, actions: list[Action]) -> None:
        """Queue every receive per channel in order; post the first of each now."""
        for action in actions:
            if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                kind = ACTIVATIONS if action.kind is ActionKind.RECV_F else GRADIENTS
                assert action.peer is not None
                self.posted.setdefault((kind, action.peer, self.rank), deque()).append((action, None))
        for queue in self.posted.values():
            self._post_head(queue)

    def _post_head(self, queue: deque[tuple[Action, PendingCollective | None]]) -> None:
        if queue and queue[0][1] is None:
            action, _ = queue[0]
            kind = ACTIVATIONS if action.kind is ActionKind.RECV_F else GRADIENTS
            # What a RECV_F of stage k receives was sent by stage k - 1 (and a RECV_B's by stage k + 1).
            sender_stage = action.stage - 1 if kind == ACTIVATIONS else action.stage + 1
            handle = self._channel(kind, action).recv(sender_stage, action.microbatch, self.seconds)
            queue[0] = (action, handle)

    def _receive(self, kind: str, action: Action) -> tuple[Any, ...]:
        channel = self._channel(kind, action)
        queue = self.posted[(kind, channel.src, channel.dst)]
        planned, handle = queue.popleft()
        assert planned == action and handle is not None
        self._post_head(queue)  # the next one is posted before this one is used
        return self._wait(handle, channel)

    def _send(self, action: Action) -> None:
        kind = ACTIVATIONS if action.kind is ActionKind.SEND_F else GRADIENTS
        outbound = ActionKind.SEND_F if kind == ACTIVATIONS else ActionKind.SEND_B
        items = self.outbox.pop((outbound, action.stage, action.microbatch))
        channel = self._channel(kind, action)
        self.sends.append((channel, channel.send(items, action.stage, action.microbatch, self.seconds)))
        for done_channel, handle in [(c, h) for c, h in self.sends if h.is_completed()]:
            _result(handle, done_channel, 0)  # raises if that send failed
        self.sends = [(c, h) for c, h in self.sends if not h.is_completed()]

    def _wait(self, handle: PendingCollective, channel: Channel) -> Any:
        """Wait for one transfer, watching every other one: a failure anywhere ends the wait."""
        deadline = time.monotonic() + self.seconds + 10.0
        while not handle.is_completed():
            try:
                return _result(handle, channel, POLL_SECONDS)
            except _StillRunning:
                pass
            for other_channel, other in self._others():
                if other.is_completed():
                    _result(other, other_channel, 0)  # raises if that transfer failed
            if time.monotonic() > deadline:  # pragma: no cover - the transfer's own timeout ends it first
                raise _ChannelError(channel, DistributedError(f"{channel!r} did not finish"))
        return _result(handle, channel, 0)

    def _others(self) -> list[tuple[Channel, PendingCollective]]:
        channels = self.schedule._channels or {}
        out = list(self.sends)
        for key, queue in self.posted.items():
            if queue and queue[0][1] is not None:
                out.append((channels[key], queue[0][1]))
        return out

    # --- failure ------------------------------------------------------------------------

    def _fail(self, exc: BaseException, action: Action | None) -> NoReturn:
        schedule, rank = self.schedule, self.rank
        where = f" at {action}" if action is not None else ""
        if isinstance(exc, _ChannelError):
            cause = exc.cause
            found = _CULPRIT.search(str(cause))
            if found is None:
                # A send to a neighbour that gave up fails on its closed connection, while the notice naming
                # the rank that failed first arrives on a receive: give that notice a moment to land.
                cause = self._notice_among_receives(NOTICE_GRACE_SECONDS) or cause
                found = _CULPRIT.search(str(cause))
            if found:
                culprit, message = int(found.group(1)), str(cause)[found.start():]
            else:
                culprit = exc.channel.dst if exc.channel.src == rank else exc.channel.src
                message = f"pipeline: rank {culprit} failed: rank {rank} lost it{where}: {cause}"
            schedule._abort(culprit, message)
            raise RankFailedError(f"rank {rank}: {schedule.name} step aborted{where}: {message}", culprit) from cause
        message = f"pipeline: rank {rank} failed{where}: {type(exc).__name__}: {exc}"
        schedule._abort(rank, message)
        raise exc


    def _notice_among_receives(self, seconds: float) -> BaseException | None:
        """Return the error of a posted receive that carries another rank's abort notice, waiting up to ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            for queue in self.posted.values():
                handle = queue[0][1] if queue else None
                if handle is not None and handle.is_completed():
                    try:
                        handle.wait(0)
                    except BaseException as error:  # noqa: BLE001 - looking for the notice, whatever wraps it
                        if _CULPRIT.search(str(error)):
                            return error
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)


class _StillRunning(Exception):
    pass


class _ChannelError(Exception):
    """A transfer failed: which channel, and why."""

    def __init__(self, channel: Channel, cause: BaseException) -> None:
        super().__init__(f"{channel!r}: {cause}")
        self.channel, self.cause = channel, cause


def _result(handle: PendingCollective, channel: Channel, seconds: float) -> Any:
    """Return the transfer's result; raise _StillRunning if not done within ``seconds``, or its error, wrapped."""
    if not handle.is_completed():
        try:
            handle.wait(seconds)
        except BaseException:  # noqa: BLE001 - read below, once the handle is known to be complete
            if not handle.is_completed():
                raise _StillRunning from None
    try:
        return handle.wait(0)  # complete: its result, or the transfer's own error
    except BaseException as exc:
        raise _ChannelError(channel, exc) from exc


class ScheduleGPipe(_PipelineSchedule):
    """GPipe: every microbatch's forward, then every backward. Holds all ``n_microbatches`` activations.

    Args:
        stage: This rank's :class:`PipelineStage` (one stage per rank).
        n_microbatches: How many microbatches a step splits the batch into.
        loss_fn: On the last stage, ``loss_fn(output, target)``: a ``ferro.nn``
            loss (with ``backward()``) or a torch function returning a scalar.

    Example::

        stage = PipelineStage(part, stage_index=rank, num_stages=world)
        schedule = ScheduleGPipe(stage, n_microbatches=8, loss_fn=nn.MSELoss())
        schedule.step(x) / schedule.step() / schedule.step(target=y, losses=losses)

    Raises:
        ValueError: num_stages differs from the world size, no loss_fn on the last stage.

    """

    name = "ScheduleGPipe"
    kind = "gpipe"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Any = None) -> None:
        super().__init__([stage], n_microbatches, loss_fn)



class Schedule1F1B(_PipelineSchedule):
    """1F1B: after a warm-up, one forward and one backward in turn; stage ``s`` holds at most ``p - s`` activations.

    Args:
        stage: This rank's :class:`PipelineStage`.
        n_microbatches: At least the number of stages.
        loss_fn: As for :class:`ScheduleGPipe`.

    Raises:
        ValueError: Fewer microbatches than stages (and as :class:`ScheduleGPipe`).

    """

    name = "Schedule1F1B"
    kind = "1f1b"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Any = None) -> None:
        super().__init__([stage], n_microbatches, loss_fn)

    def _validate(self, rank: int, world: int) -> None:
        super()._validate(rank, world)
        if self.n_microbatches < self.num_stages:
            raise ValueError(f"rank {rank}: {self.name} needs at least as many microbatches as stages: "
                             f"n_microbatches={self.n_microbatches} < num_stages={self.num_stages}")



class ScheduleInterleaved1F1B(_PipelineSchedule):
    """Interleaved 1F1B: ``v`` stages per rank (stage ``k`` on rank ``k % p``); the bubble shrinks by ``v``.

    Args:
        stages: This rank's stages (``rank, rank + p, ...``).
        n_microbatches: At least the world size.
        loss_fn: As for :class:`ScheduleGPipe`.

    Raises:
        ValueError: num_stages not divisible by the world size, fewer microbatches
            than ranks, or stages that are not this rank's.

    """

    name = "ScheduleInterleaved1F1B"
    kind = "interleaved"

    def __init__(self, stages: Sequence[PipelineStage] | PipelineStage, n_microbatches: int,
                 loss_fn: Any = None) -> None:
        super().__init__([stages] if isinstance(stages, PipelineStage) else list(stages), n_microbatches, loss_fn)

    def _validate(self, rank: int, world: int) -> None:
        if self.num_stages % world:
            raise ValueError(f"rank {rank}: {self.name}: num_stages={self.num_stages} is not divisible by the "
                             f"world size {world}")
        if self.n_microbatches < world:
            raise ValueError(f"rank {rank}: {self.name} needs at least as many microbatches as ranks: "
                             f"n_microbatches={self.n_microbatches} < world size {world}")



class ScheduleZeroBubble(_PipelineSchedule):
    """ZB-H1: backward split into input-gradient (I) and weight-gradient (W) steps; W fills the bubbles.

    Peak memory per stage is 1F1B's largest (``p`` microbatches held); the
    bubble shrinks from ``(p - 1)(tF + tB)`` to about ``(p - 1)(tF + tI - tW)``.
    Needs stages whose backward can be split: ``ferro.nn`` layers with
    ``backward_input``/``backward_weight`` (Linear, Sequential of them), or torch
    modules whose parameters each belong to one module that runs once and
    returns one tensor.

    Args:
        stage: This rank's :class:`PipelineStage`.
        n_microbatches: How many microbatches a step splits the batch into.
        loss_fn: As for :class:`ScheduleGPipe`.

    Raises:
        ValueError: The stage's backward cannot be split (the reason is given).

    """

    name = "ScheduleZeroBubble"
    kind = "zero_bubble"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Any = None) -> None:
        problem = stage.runner.split_problem()
        if problem is not None:
            raise ValueError(f"rank {stage.group.rank}: {self.name}: stage {stage.stage_index}'s backward cannot "
                             f"be split: {problem}; use Schedule1F1B")
        if isinstance(stage.runner, TorchRunner):
            stage.runner.enable_split()
        super().__init__([stage], n_microbatches, loss_fn)

