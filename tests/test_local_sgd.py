"""Local SGD and DiLoCo: H=1 is DDP; longer H, fragments and overlap against a one-process simulation of the ranks."""

import threading

import numpy as np
import pytest

import ferro
from ferro import nn
from ferro.parallel import DiLoCo, LocalSGD
from ferro.testing import run_threads

BATCH = 12
FEATURES, CLASSES = 6, 3


def model(seed=100):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(FEATURES, 10, rng=rng, dtype=np.float64), nn.Tanh(),
                         nn.Linear(10, CLASSES, rng=rng, dtype=np.float64))


def batches(steps, seed=7):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, FEATURES)), rng.integers(0, CLASSES, BATCH)) for _ in range(steps)]


def inner_step(net, optimizer, criterion, x, y):
    optimizer.zero_grad()
    criterion(net(x), y)
    net.backward(criterion.backward())
    optimizer.step()


def shard(x, y, rank, world_size):
    return np.array_split(x, world_size)[rank], np.array_split(y, world_size)[rank]


def rank_diloco(group, steps, options):
    net = model(seed=group.rank + 100)  # rank 0's initial values win
    options = dict(options)  # threads of a simulated group share the argument
    kind = options.pop("kind")
    if kind == "local_sgd":
        wrapper = LocalSGD(net, group=group, **options)
    else:
        lr, momentum, nesterov = options.pop("outer")
        wrapper = DiLoCo(net, group=group, **options,
                         outer_optimizer=lambda ps: nn.SGD(ps, lr=lr, momentum=momentum, nesterov=nesterov))
    optimizer = nn.SGD(net.parameters(), lr=0.1, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    for x, y in batches(steps):
        inner_step(net, optimizer, criterion, *shard(x, y, group.rank, group.world_size))
        wrapper.step()
    after_steps = [p.data.copy() for p in net.parameters()]
    wrapper.sync()
    return after_steps, [p.data.copy() for p in net.parameters()], wrapper.outer_steps


def single_process(steps):
    net = model()
    optimizer = nn.SGD(net.parameters(), lr=0.1, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    for x, y in batches(steps):
        inner_step(net, optimizer, criterion, x, y)
    return [p.data.copy() for p in net.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_diloco_with_h_1_and_an_outer_sgd_of_rate_1_is_ddp(run, world_size):
    # The inner momentum is linear in the gradient, so averaging the ranks' steps averages their gradients.
    results = run(rank_diloco, world_size, args=(4, {"kind": "diloco", "sync_every": 1, "outer": (1.0, 0.0, False)}))
    expected = single_process(4)
    for after_steps, _, outer_steps in results:
        assert outer_steps == 4  # one per step; sync() right after one takes none
        for got, want in zip(after_steps, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def simulate(world_size, steps, sync_every, fragments, overlap, mixing, outer):
    """Every rank's inner training on one process, and streaming DiLoCo's schedule written out step by step."""
    replicas = [model() for _ in range(world_size)]
    optimizers = [nn.SGD(r.parameters(), lr=0.1, momentum=0.9) for r in replicas]
    criterion = nn.CrossEntropyLoss()
    params = [list(r.parameters()) for r in replicas]
    count = len(params[0])
    # Fragments: runs of parameters by element count (weights and biases here: 60, 10, 30, 3 elements).
    sizes = [p.data.size for p in params[0]]
    members, part, seen = [[] for _ in range(fragments)], 0, 0
    for i, size in enumerate(sizes):
        if members[part] and part < fragments - 1 and (seen * fragments >= sum(sizes) * (part + 1)
                                                       or count - i <= fragments - part - 1):
            part += 1
        members[part].append(i)
        seen += size
    agreed = [p.data.copy() for p in params[0]]
    momentum = {}  # torch's SGD: the buffer starts as the first gradient
    lr, mu, nesterov = outer
    in_flight = {}

    def outer_step(fragment, delta):
        for i in members[fragment]:
            d = delta[i]
            if mu:
                momentum[i] = mu * momentum[i] + d if i in momentum else d.copy()
                d = d + mu * momentum[i] if nesterov else momentum[i]
            agreed[i] -= lr * d

    def finish(fragment, keep):
        delta = in_flight.pop(fragment)
        outer_step(fragment, delta)
        for replica in params:
            for i in members[fragment]:
                replica[i].data[...] = keep * replica[i].data + (1 - keep) * agreed[i] if keep else agreed[i]

    for t, (x, y) in enumerate(batches(steps), start=1):
        for rank in range(world_size):
            inner_step(replicas[rank], optimizers[rank], criterion, *shard(x, y, rank, world_size))
        for fragment in range(fragments):
            if fragment in in_flight and t - in_flight[fragment][-1] >= overlap:
                in_flight[fragment] = in_flight[fragment][0]
                finish(fragment, mixing if overlap else 0.0)
        for fragment in range(fragments):
            if t % sync_every == fragment * sync_every // fragments:
                delta = {i: np.mean([agreed[i] - replica[i].data for replica in params], axis=0)
                         for i in members[fragment]}
                in_flight[fragment] = (delta, t)
                if overlap == 0:
                    in_flight[fragment] = delta
                    finish(fragment, 0.0)
    return [[p.data.copy() for p in replica] for replica in params]


@pytest.mark.parametrize("options", [
    {"kind": "local_sgd", "sync_every": 3},
    {"kind": "diloco", "sync_every": 4, "outer": (0.7, 0.9, True)},
    {"kind": "diloco", "sync_every": 4, "outer": (0.7, 0.9, True), "fragments": 2},
    {"kind": "diloco", "sync_every": 4, "outer": (0.7, 0.9, True), "fragments": 2, "overlap_steps": 1, "mixing": 0.5},
], ids=["local_sgd", "diloco", "streaming", "streaming_overlapped"])
def test_local_sgd_and_diloco_match_a_simulation_of_every_rank(run, options):
    world_size, steps = 2, 10
    results = run(rank_diloco, world_size, args=(steps, dict(options)))
    outer = options.get("outer", (1.0, 0.0, False))
    expected = simulate(world_size, steps, options["sync_every"], options.get("fragments", 1),
                        options.get("overlap_steps", 0), options.get("mixing", 0.5), outer)
    for rank, (after_steps, synced, _) in enumerate(results):
        for got, want in zip(after_steps, expected[rank], strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        for got, want in zip(synced, results[0][1], strict=True):
            np.testing.assert_array_equal(got, want)  # sync() leaves every rank with the same bits
    if options["kind"] == "local_sgd" or options.get("fragments", 1) == 1:
        # After the last synchronisation (step 9 or 8) the ranks trained apart: they differ, as they should.
        assert not np.allclose(results[0][0][0], results[1][0][0])


def test_sync_right_after_a_synchronisation_leaves_the_model_alone():
    """With outer momentum a second outer step would move the model on a zero change; sync() must not take one."""
    options = {"kind": "diloco", "sync_every": 4, "outer": (0.7, 0.9, True)}
    results = run_threads(rank_diloco, 2, args=(8, options))  # step 8 synchronised
    for after_steps, synced, outer_steps in results:
        assert outer_steps == 2
        for before, after in zip(after_steps, synced, strict=True):
            assert before.tobytes() == after.tobytes()
    results = run_threads(rank_diloco, 2, args=(7, options))  # three steps since: sync() takes an outer step
    for after_steps, synced, outer_steps in results:
        assert outer_steps == 2 and not np.array_equal(after_steps[0], synced[0])


_TORCH_INIT = threading.Lock()


def torch_net():
    import torch

    # The ranks of a simulated group are threads sharing torch's global generator: seed and draw under a lock,
    # or one rank's draws continue from another's.
    with _TORCH_INIT:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 10), torch.nn.Tanh(),
                                   torch.nn.Linear(10, CLASSES)).double()


def rank_torch_diloco(group):
    import torch

    net = torch_net()
    diloco = DiLoCo(net, sync_every=1, group=group, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(3):
        x, y = shard(x, y, group.rank, group.world_size)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        optimizer.step()
        diloco.step()
    return [p.detach().numpy().copy() for p in net.parameters()]


def test_diloco_wraps_a_torch_module_and_h_1_is_one_process_training(run):
    torch = pytest.importorskip("torch")
    results = run(rank_torch_diloco, 2)
    net = torch_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        optimizer.step()
    for params in results:
        for got, want in zip(params, net.parameters(), strict=True):
            np.testing.assert_allclose(got, want.detach().numpy(), rtol=0, atol=1e-12)


def rank_bad_options(group):
    errors = []
    for kwargs in ({"sync_every": 0}, {"sync_every": 4, "fragments": 5}, {"sync_every": 4, "overlap_steps": 4},
                   {"sync_every": 4, "overlap_steps": 1, "mixing": 1.5}):
        try:
            LocalSGD(model(), group=group, **kwargs)
        except ValueError as exc:
            errors.append(str(exc).split(":")[1].split()[0])
    half = nn.Sequential(nn.Linear(2, 2, dtype=np.float16))
    try:
        DiLoCo(half, sync_every=2, group=group)
    except ferro.ConfigurationError as exc:
        errors.append("float16" in str(exc))
    return errors


def test_bad_options_are_refused_naming_the_option():
    from ferro.testing import run_threads

    for errors in run_threads(rank_bad_options, 2):
        assert errors == ["sync_every", "fragments", "overlap_steps", "mixing", True]
