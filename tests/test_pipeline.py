"""Pipeline parallelism: schedules train exactly like one process, hold what they promise, fail together."""

import json

import numpy as np
import pytest
from _pipeline_check import check_actions

import ferro
from ferro import nn
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
        "kinds": sorted({e.action.kind.value for e in schedule.trace()[group.rank]}),
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


CASES = [("gpipe", 4, 4), ("1f1b", 4, 4), ("zb", 4, 4), ("interleaved", 2, 4)]


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize(("kind", "world", "num_stages"), CASES)
def test_training_equals_single_process(framework, kind, world, num_stages):
    results = run_threads(rank_pipeline, world, args=(framework, kind, num_stages))
    check_equal_to_reference(results, framework, num_stages)


@pytest.mark.parametrize(("framework", "kind"), [("numpy", "1f1b"), ("torch", "zb"), ("numpy", "interleaved")])
def test_training_over_real_processes(framework, kind):
    world, num_stages = (2, 4) if kind == "interleaved" else (4, 4)
    results = run_processes(rank_pipeline, world, args=(framework, kind, num_stages), timeout=120)
    check_equal_to_reference(results, framework, num_stages)
