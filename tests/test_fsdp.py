"""FSDP trains exactly as one process does on the whole batch, with the collective schedule it promises."""

import numpy as np
import pytest

import ferro
from ferro import nn

torch = pytest.importorskip("torch")

STEPS = 5
BATCH = 12  # divisible by 2, 3 and 4: every rank's share is equal, so the mean of means is the mean
SIZES = [7, 5, 3, 2]  # no layer size divisible by the world size: padding and empty shares happen
LR, WEIGHT_DECAY = 0.05, 0.1
STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"]


def batches(seed=3):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, SIZES[0])), rng.standard_normal((BATCH, SIZES[-1]))) for _ in range(STEPS)]


def numpy_model(seed=0):
    rng = np.random.default_rng(seed)
    layers = []
    for i, (n_in, n_out) in enumerate(zip(SIZES, SIZES[1:])):
        layers.append(nn.Linear(n_in, n_out, rng=rng, dtype=np.float64))
        if i < len(SIZES) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def torch_model(seed=0):
    """The same layers and initial values as :func:`numpy_model` (torch's global RNG is shared by threads)."""
    layers = []
    for i, (n_in, n_out) in enumerate(zip(SIZES, SIZES[1:])):
        layers.append(torch.nn.Linear(n_in, n_out, dtype=torch.float64))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.Tanh())
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for name, value in numpy_model(seed).state_dict().items():
            model.get_parameter(name).copy_(torch.from_numpy(value))
    return model


def linear_policy(module):
    return isinstance(module, (nn.Linear, torch.nn.Linear))


def all_but_middle_policy(module):
    """Units for the first and last Linear: the middle one's parameters stay with the root unit."""
    return linear_policy(module) and module.weight.shape[0] != SIZES[2]


def as_numpy(value):
    return value.detach().numpy().copy() if isinstance(value, torch.Tensor) else np.array(value)


def train_reference(framework):
    """Single process, whole batch: what every FSDP run must reproduce."""
    model = numpy_model() if framework == "numpy" else torch_model()
    if framework == "numpy":
        optimizer = nn.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        criterion = nn.MSELoss()
        for x, y in batches():
            optimizer.zero_grad()
            criterion(model(x), y)
            model.backward(criterion.backward())
            optimizer.step()
        states = {name: {k: np.array(v) for k, v in optimizer.state[p].items()}
                  for name, p in model.named_parameters()}
        return {k: v.copy() for k, v in model.state_dict().items()}, states
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for x, y in batches():
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        optimizer.step()
    states = {name: {k: as_numpy(v) for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()}
    return {k: as_numpy(v) for k, v in model.state_dict().items()}, states


def rank_train(group, framework, strategy, policy, prefetch=True):
    mesh = None
    if strategy == "hybrid_shard":
        mesh = ferro.init_device_mesh((2, group.world_size // 2), ("replicate", "shard"), group=group)
    # Every rank builds its own random init: FSDP starts all from rank 0's (the reference's seed).
    model = numpy_model(seed=group.rank) if framework == "numpy" else torch_model(seed=group.rank)
    fsdp = ferro.FSDP(model, group=group, device_mesh=mesh, sharding_strategy=strategy, auto_wrap_policy=policy,
                      forward_prefetch=prefetch)
    shards = fsdp.parameters()
    if framework == "numpy":
        optimizer = nn.Adam(shards, lr=LR, weight_decay=WEIGHT_DECAY)
        criterion = nn.MSELoss()
    else:
        optimizer = torch.optim.Adam(shards, lr=LR, weight_decay=WEIGHT_DECAY)
    stats = []
    for x, y in batches():
        x, y = np.array_split(x, group.world_size)[group.rank], np.array_split(y, group.world_size)[group.rank]
        group.reset_stats()
        optimizer.zero_grad()
        if framework == "numpy":
            criterion(fsdp(x), y)
            fsdp.backward(criterion.backward())
        else:
            torch.nn.functional.mse_loss(fsdp(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        stats.append({op: entry["calls"] for op, entry in group.stats().items()})
        optimizer.step()
    same_objects = all(a is b for a, b in zip(shards, fsdp.parameters(), strict=True)) and len(shards) == len(
        fsdp.parameters())
    full = {k: as_numpy(v) for k, v in fsdp.full_state_dict().items()}
    optim = fsdp.full_optim_state_dict(optimizer)
    optim_state = {name: {k: as_numpy(v) for k, v in entry.items()} for name, entry in optim["state"].items()}
    return {"full": full, "optim": optim_state, "stats": stats, "same_objects": same_objects,
            "units": len(fsdp.units), "comm": fsdp.comm_stats()}


def check_against_reference(results, framework):
    expected, expected_optim = train_reference(framework)
    for result in results:
        assert result["same_objects"]
        assert list(result["full"]) == list(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(result["full"][name], value, rtol=0, atol=1e-12, err_msg=name)
        assert set(result["optim"]) == set(expected_optim)
        for name, entry in expected_optim.items():
            for key, value in entry.items():
                np.testing.assert_allclose(result["optim"][name][key], value, rtol=0, atol=1e-12,
                                           err_msg=f"{name} {key}")


CASES = [(s, w) for s in STRATEGIES for w in (2, 3, 4) if s != "hybrid_shard"] + [("hybrid_shard", 4)]


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize(("strategy", "world_size"), CASES, ids=[f"{s}-{w}" for s, w in CASES])
def test_training_equals_single_process(framework, strategy, world_size):
    results = ferro.testing.run_threads(rank_train, world_size, args=(framework, strategy, linear_policy),
                                        timeout=120)
    check_against_reference(results, framework)
    units = 3
    for result in results:
        assert result["units"] == units
        for calls in result["stats"]:
            if strategy == "full_shard":
                assert calls == {"all_gather": 2 * units, "reduce_scatter": units}
            elif strategy == "shard_grad_op":
                assert calls == {"all_gather": units, "reduce_scatter": units}
            elif strategy == "no_shard":
                assert calls == {"allreduce": units}
        assert result["comm"]["peak_unsharded_units"] <= (2 if strategy in ("full_shard", "hybrid_shard") else 3)
