"""Pipeline parallelism: schedules train exactly like one process, hold what they promise, fail together."""

import json
import re

import numpy as np
import pytest
from _pipeline_check import check_actions

import ferro
from ferro import nn
from ferro.parallel.pipeline.actions import schedule_actions
from ferro.pipeline import (
    ActionKind,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
    write_chrome_trace,
)
from ferro.testing import run_processes, run_threads

torch = pytest.importorskip("torch")

WIDTH, OUT, BATCH, MICROBATCHES = 16, 3, 32, 8
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zb": ScheduleZeroBubble,
             "interleaved": ScheduleInterleaved1F1B}


def stage_module(framework, index, num_stages):
    """Stage ``index``: Linear(16, 16) + Tanh, the last one with a Linear(16, 3) head; seeded by index.

    The torch stage copies the ferro.nn stage's values (torch's global generator is
    not safe to seed from simulated ranks, which are threads).
    """
    rng = np.random.default_rng(100 + index)
    layers = [nn.Linear(WIDTH, WIDTH, rng=rng, dtype=np.float64), nn.Tanh()]
    if index == num_stages - 1:
        layers.append(nn.Linear(WIDTH, OUT, rng=rng, dtype=np.float64))
    if framework == "numpy":
        return nn.Sequential(*layers)
    torch_layers = []
    for layer in layers:
        if isinstance(layer, nn.Linear):
            linear = torch.nn.Linear(layer.weight.shape[1], layer.weight.shape[0], dtype=torch.float64)
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(layer.weight.data))
                linear.bias.copy_(torch.from_numpy(layer.bias.data))
            torch_layers.append(linear)
        else:
            torch_layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*torch_layers)


def batch(framework):
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal((BATCH, WIDTH)), rng.standard_normal((BATCH, OUT))
    return (torch.from_numpy(x), torch.from_numpy(y)) if framework == "torch" else (x, y)


def loss_fn(framework):
    return torch.nn.functional.mse_loss if framework == "torch" else nn.MSELoss()


def grads_of(framework, module):
    if framework == "torch":
        return [p.grad.numpy().copy() for p in module.parameters()]
    return [p.grad.copy() for p in module.parameters()]


def reference(framework, num_stages):
    """One process, whole batch: the loss and every stage's gradients."""
    modules = [stage_module(framework, s, num_stages) for s in range(num_stages)]
    x, y = batch(framework)
    if framework == "torch":
        loss = torch.nn.functional.mse_loss(torch.nn.Sequential(*modules)(x), y)
        loss.backward()
        value = float(loss.detach())
    else:
        model, criterion = nn.Sequential(*modules), nn.MSELoss()
        value = criterion(model(x), y)
        model.backward(criterion.backward())
    return value, {s: grads_of(framework, m) for s, m in enumerate(modules)}


def rank_pipeline(group, framework, kind, num_stages, steps=1):
    world = group.world_size
    stages = [PipelineStage(stage_module(framework, s, num_stages), s, num_stages, group=group)
              for s in range(group.rank, num_stages, world)]
    schedule_cls = SCHEDULES[kind]
    schedule = schedule_cls(stages if kind == "interleaved" else stages[0], MICROBATCHES, loss_fn(framework))
    x, y = batch(framework)
    losses, output = [], None
    for _ in range(steps):
        for stage in stages:
            for p in stage.parameters():
                p.grad = None
        args = (x,) if group.rank == 0 else ()
        kwargs = {"target": y, "losses": losses} if (num_stages - 1) % world == group.rank else {}
        output = schedule.step(*args, **kwargs)
    return {
        "losses": losses,
        "output_shape": None if output is None else tuple(output.shape),
        "grads": {s.stage_index: grads_of(framework, s.submodule) for s in stages},
        "peak": {s.stage_index: s.peak_activations_held for s in stages},
        "held": {s.stage_index: s.activations_held for s in stages},
        "ran": [str(e.action) for e in schedule.trace()[group.rank]],
        "planned": [str(a) for a in schedule.actions()],
    }


def check_equal_to_reference(results, framework, num_stages):
    value, expected = reference(framework, num_stages)
    last = results[(num_stages - 1) % len(results)]
    assert len(last["losses"]) == MICROBATCHES
    assert abs(np.mean(last["losses"]) - value) < 1e-12
    assert last["output_shape"] == (BATCH, OUT)
    seen = set()
    for result in results:
        for stage, grads in result["grads"].items():
            seen.add(stage)
            assert len(grads) == len(expected[stage])
            for got, want in zip(grads, expected[stage], strict=True):
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
            assert result["held"][stage] == 0
    assert seen == set(range(num_stages))
    for result in results:
        assert result["ran"] == result["planned"]  # the trace is the action list, executed as written


CASES = [("gpipe", 4, 4), ("1f1b", 4, 4), ("zb", 4, 4), ("interleaved", 2, 4)]


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize(("kind", "world", "num_stages"), CASES)
def test_training_equals_single_process(framework, kind, world, num_stages):
    results = run_threads(rank_pipeline, world, args=(framework, kind, num_stages))
    check_equal_to_reference(results, framework, num_stages)
    peaks = {stage: peak for result in results for stage, peak in result["peak"].items()}
    if kind == "1f1b":  # counted while running: 1F1B's promise
        assert peaks == {s: num_stages - s for s in range(num_stages)}
    elif kind == "gpipe":
        assert peaks == {s: MICROBATCHES for s in range(num_stages)}
    elif kind == "zb":
        assert max(peaks.values()) <= num_stages


def test_trace_covers_every_action_and_writes_a_chrome_trace(tmp_path):
    def rank_fn(group):
        stage = PipelineStage(stage_module("numpy", group.rank, 4), group.rank, 4, group=group)
        schedule = Schedule1F1B(stage, MICROBATCHES, nn.MSELoss())
        x, y = batch("numpy")
        schedule.step(*((x,) if group.rank == 0 else ()), **({"target": y} if group.rank == 3 else {}))
        traces = schedule.trace(gather=True)
        if group.rank == 0:
            write_chrome_trace(traces, tmp_path / "trace.json")
        return {r: [(str(e.action), e.start, e.end) for e in events] for r, events in traces.items()}

    traces = run_threads(rank_fn, 4)[0]
    assert sorted(traces) == [0, 1, 2, 3]
    document = json.loads((tmp_path / "trace.json").read_text())
    boxes = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == sum(len(events) for events in traces.values())
    for rank, events in traces.items():
        assert all(start <= end for _, start, end in events)
        assert all(events[i][2] <= events[i + 1][1] for i in range(len(events) - 1))  # one after another
        names = [name for name, _, _ in events]
        assert sum(re.fullmatch(r"\dF\d+", name) is not None for name in names) == MICROBATCHES
        assert {e["name"] for e in boxes if e["tid"] == rank} == set(names)


@pytest.mark.parametrize(("framework", "kind"), [("numpy", "1f1b"), ("torch", "zb"), ("numpy", "interleaved")])
def test_training_over_real_processes(framework, kind):
    world, num_stages = (2, 4) if kind == "interleaved" else (4, 4)
    results = run_processes(rank_pipeline, world, args=(framework, kind, num_stages), timeout=120)
    check_equal_to_reference(results, framework, num_stages)


# --- the action lists ---------------------------------------------------------------------

KINDS = {"gpipe": "gpipe", "1f1b": "1f1b", "zb": "zero_bubble", "interleaved": "interleaved"}


def all_actions(kind, world, num_stages, m):
    return schedule_actions(KINDS[kind], world, num_stages, m)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb", "interleaved"])
def test_action_lists_meet_every_dependency_and_never_deadlock(kind):
    for p in range(2, 9):
        for m in range(p, 4 * p + 1):
            for v in ((2, 3) if kind == "interleaved" else (1,)):
                lists = all_actions(kind, p, p * v, m)
                peak = check_actions(lists, p * v, m)
                if kind == "1f1b":
                    assert peak == {s: min(p - s, m) for s in range(p)}, (p, m, peak)
                elif kind == "gpipe":
                    assert peak == {s: m for s in range(p)}
                elif kind == "zb":
                    assert max(peak.values()) <= p, (p, m, peak)
                    kinds = {a.kind for actions in lists for a in actions}
                    assert ActionKind.BACKWARD not in kinds and ActionKind.BACKWARD_WEIGHT in kinds


def test_the_checker_catches_a_deadlock_and_a_missing_input():
    lists = all_actions("1f1b", 2, 2, 4)
    swapped = list(lists[1])
    first_recv = next(i for i, a in enumerate(swapped) if a.kind is ActionKind.SEND_B)
    # Rank 1 waiting for an activation it only gets after sending a gradient it cannot compute yet.
    swapped.insert(0, swapped.pop(first_recv))
    with pytest.raises(AssertionError):
        check_actions([lists[0], swapped], 2, 4)
    no_recv = [a for a in lists[1] if a.kind is not ActionKind.RECV_F]
    with pytest.raises(AssertionError, match="without its input"):
        check_actions([lists[0], no_recv], 2, 4)


def test_1f1b_orders_forward_and_backward_in_turn():
    ranks = all_actions("1f1b", 4, 4, 8)
    compute = [str(a) for a in ranks[1] if a.kind.is_compute]
    assert compute[:6] == ["1F0", "1F1", "1F2", "1B0", "1F3", "1B1"]
    assert [str(a) for a in ranks[3][:4]] == ["3RECV_F0<-2", "3F0", "3B0", "3SEND_B0->2"]


# --- errors -------------------------------------------------------------------------------

def rank_construct(group, case):
    try:
        if case == "stage_out_of_range":
            PipelineStage(stage_module("numpy", 0, 4), 5 if group.rank == 1 else group.rank, 4, group=group)
        elif case == "1f1b_too_few_microbatches":
            Schedule1F1B(PipelineStage(stage_module("numpy", group.rank, 4), group.rank, 4, group=group), 3,
                         nn.MSELoss())
        elif case == "interleaved_not_divisible":
            stages = [PipelineStage(stage_module("numpy", s, 3), s, 3, group=group) for s in range(group.rank, 3, 2)]
            ScheduleInterleaved1F1B(stages, 4, nn.MSELoss())
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(("case", "world", "expected"), [
    ("stage_out_of_range", 4, "stage_index 5 is outside [0, 4) (num_stages=4)"),
    ("1f1b_too_few_microbatches", 4, "n_microbatches=3 < num_stages=4"),
    ("interleaved_not_divisible", 2, "num_stages=3 is not divisible by the world size 2"),
])
def test_invalid_pipelines_raise_on_every_rank(case, world, expected):
    messages = run_threads(rank_construct, world, args=(case,))
    if case == "stage_out_of_range":
        assert expected in messages[1] and messages[0] is None
    else:
        assert all(expected in message for message in messages), messages


class FailsAt(nn.Module):
    """Runs ``inner``; raises (or kills the process) on forward number ``at``."""

    def __init__(self, inner, at, how):
        super().__init__()
        self.inner, self.at, self.how, self.calls = inner, at, how, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            if self.how == "exit":
                import os

                os._exit(3)
            raise ValueError("stage 2 cannot take microbatch 3")
        return self.inner(x)

    def backward(self, grad_output):
        return self.inner.backward(grad_output)


def rank_failing(group, kind, how):
    module = stage_module("numpy", group.rank, 4)
    if group.rank == 2:
        module = FailsAt(module, 4, how)
    stage = PipelineStage(module, group.rank, 4, group=group)
    schedule = SCHEDULES[kind](stage, MICROBATCHES, nn.MSELoss())
    x, y = batch("numpy")
    try:
        schedule.step(*((x,) if group.rank == 0 else ()), **({"target": y} if group.rank == 3 else {}), timeout=60)
    except ferro.RankFailedError as exc:
        again = None
        try:
            schedule.step(*((x,) if group.rank == 0 else ()), **({"target": y} if group.rank == 3 else {}))
        except ferro.RankFailedError as second:
            again = str(second)
        return ("RankFailedError", exc.rank, str(exc), again)
    except ValueError as exc:
        return ("ValueError", None, str(exc), None)
    return None


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("harness", ["threads", "processes"])
def test_a_rank_failing_mid_step_makes_every_rank_raise_naming_it(kind, harness):
    runner = run_threads if harness == "threads" else run_processes
    results = runner(rank_failing, 4, args=(kind, "raise"), timeout=120)
    assert results[2][0] == "ValueError" and "microbatch 3" in results[2][2]
    for rank in (0, 1, 3):
        name, culprit, message, again = results[rank]
        assert (name, culprit) == ("RankFailedError", 2), results[rank]
        assert "rank 2 failed" in message and "ValueError: stage 2 cannot take microbatch 3" in message
        assert "unusable after a failed step" in again


def test_a_rank_dying_mid_step_is_named_by_every_other_rank():
    results = run_processes(rank_failing, 4, args=("1f1b", "exit"), timeout=120, allow_exit=[2])
    assert results[2].exitcode == 3
    for rank in (0, 1, 3):
        name, culprit, message, _ = results[rank]
        assert (name, culprit) == ("RankFailedError", 2), results[rank]
        assert "rank 2 failed" in message


def rank_disagreeing(group):
    stage = PipelineStage(stage_module("numpy", group.rank, 4), group.rank, 4, group=group)
    schedule = Schedule1F1B(stage, 4 if group.rank == 1 else MICROBATCHES, nn.MSELoss())
    x, y = batch("numpy")
    try:
        schedule.step(*((x,) if group.rank == 0 else ()), **({"target": y} if group.rank == 3 else {}))
    except ferro.ConfigurationError as exc:
        return str(exc)
    return None


def test_ranks_that_build_different_pipelines_all_raise():
    for message in run_threads(rank_disagreeing, 4):
        assert "built different pipelines" in message and "rank 1: Schedule1F1B with 4 stages and 4 microbatches" \
            in message


class Scale(nn.Module):
    """A parameter without a split backward."""

    def __init__(self):
        super().__init__()
        self.factor = nn.Parameter(np.ones(1))

    def forward(self, x):
        self.save_for_backward(x=x)
        return x * self.factor.data

    def backward(self, grad_output):
        self.factor.accumulate_grad(np.array([np.sum(grad_output * self.saved("x"))]))
        return grad_output * self.factor.data


def test_zero_bubble_refuses_a_backward_it_cannot_split():
    def rank_fn(group):
        try:
            ScheduleZeroBubble(PipelineStage(nn.Sequential(nn.Linear(2, 2), Scale()), group.rank, 2, group=group),
                               4, nn.MSELoss())
        except ValueError as exc:
            return str(exc)
        return None

    for message in run_threads(rank_fn, 2):
        assert "cannot be split" in message and "Scale" in message

    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    second.weight = first.weight

    def rank_torch(group, module):
        schedule = None
        try:
            schedule = ScheduleZeroBubble(PipelineStage(module, group.rank, 1, group=group), 1,
                                          torch.nn.functional.mse_loss)
            schedule.step(torch.ones(2, 2), target=torch.zeros(2, 2))
        except (ValueError, TypeError) as exc:
            return str(exc)
        return None

    shared_parameter = run_threads(rank_torch, 1, args=(torch.nn.Sequential(first, second),))[0]
    assert "cannot be split" in shared_parameter and "shared by Linear and Linear" in shared_parameter
    reused = run_threads(rank_torch, 1, args=(torch.nn.Sequential(first, torch.nn.Tanh(), first),))[0]
    assert "ran twice in one forward" in reused


# --- composed with data parallelism -------------------------------------------------------

def rank_pipeline_and_data_parallel(group, framework):
    """2 pipeline stages x 2 replicas: mesh (dp, pp); DDP over the replica group; half the batch each."""
    mesh = ferro.init_device_mesh((2, 2), ("dp", "pp"), group=group)
    replica, stage_index = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    module = ferro.DDP(stage_module(framework, stage_index, 2), group=mesh.get_group("dp"))
    stage = PipelineStage(module, stage_index, 2, group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, 4, loss_fn(framework))
    x, y = batch(framework)
    rows = slice(replica * BATCH // 2, (replica + 1) * BATCH // 2)
    losses = []
    for _ in range(2):  # the second step checks that DDP's state resets between steps
        if framework == "numpy":
            module.module.zero_grad()  # in place: DDP keeps the gradients inside its buckets
        else:
            for p in module.parameters():
                p.grad = None
        losses.clear()
        if stage.is_first:
            schedule.step(x[rows])
        else:
            schedule.step(target=y[rows], losses=losses)
    return {"stage": stage_index, "losses": losses, "grads": grads_of(framework, module.module)}


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_two_stages_times_two_replicas_equal_single_process(framework):
    results = run_threads(rank_pipeline_and_data_parallel, 4, args=(framework,))
    value, expected = reference(framework, 2)
    last = [r for r in results if r["stage"] == 1]
    assert abs(np.mean([np.mean(r["losses"]) for r in last]) - value) < 1e-12
    for result in results:
        for got, want in zip(result["grads"], expected[result["stage"]], strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


# --- what travels between stages ------------------------------------------------------------

class Front(torch.nn.Module):
    """Returns a 3-d float activation and an int64 tensor, as a tuple."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, x):
        ids = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        return torch.tanh(self.linear(x)).reshape(-1, 2, 2, 4), ids


class Back(torch.nn.Module):
    """Takes both: flattens the activation, adds a row of a table the ints choose."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, OUT, dtype=torch.float64)
        self.table = torch.nn.Parameter(torch.linspace(-1, 1, 4 * OUT, dtype=torch.float64).reshape(4, OUT))

    def forward(self, h, ids):
        return self.linear(h.flatten(1)) + self.table[ids]


def rank_tuple_stages(group, kind):
    modules = two_part_model()
    stage = PipelineStage(modules[group.rank], group.rank, 2, group=group)
    schedule = SCHEDULES[kind](stage, MICROBATCHES, torch.nn.functional.mse_loss)
    x, y = batch("torch")
    losses = []
    schedule.step(*((x,) if group.rank == 0 else ()), **({"target": y, "losses": losses} if group.rank else {}))
    return losses, [p.grad.numpy().copy() for p in modules[group.rank].parameters()]


def two_part_model():
    front, back = Front(), Back()
    rng = np.random.default_rng(5)
    with torch.no_grad():
        for p in list(front.parameters()) + [back.linear.weight, back.linear.bias]:
            p.copy_(torch.from_numpy(rng.uniform(-0.3, 0.3, tuple(p.shape))))
    return [front, back]


@pytest.mark.parametrize("kind", ["1f1b", "zb"])
def test_tuples_of_any_ndim_and_ints_travel_between_stages(kind):
    results = run_threads(rank_tuple_stages, 2, args=(kind,))
    front, back = two_part_model()
    x, y = batch("torch")
    loss = torch.nn.functional.mse_loss(back(*front(x)), y)
    loss.backward()
    assert abs(np.mean(results[1][0]) - float(loss.detach())) < 1e-12
    for module, (_, grads) in zip((front, back), results, strict=True):
        for p, got in zip(module.parameters(), grads, strict=True):
            np.testing.assert_allclose(got, p.grad.numpy(), rtol=0, atol=1e-12)


def rank_forgets_the_batch(group):
    stage = PipelineStage(stage_module("numpy", group.rank, 2), group.rank, 2, group=group)
    schedule = ScheduleGPipe(stage, 4, nn.MSELoss())
    x, y = batch("numpy")
    try:
        schedule.step(**({"target": y} if group.rank == 1 else {}), timeout=60)  # rank 0 forgets x
    except ferro.RankFailedError as exc:
        return ("RankFailedError", exc.rank, str(exc))
    except ValueError as exc:
        return ("ValueError", None, str(exc))
    return None


def test_a_rank_called_without_its_batch_raises_and_the_other_names_it():
    mine, theirs = run_processes(rank_forgets_the_batch, 2, timeout=120)
    assert mine[0] == "ValueError" and "runs stage 0 and must pass the batch" in mine[2]
    assert theirs[:2] == ("RankFailedError", 0) and "must pass the batch" in theirs[2]
