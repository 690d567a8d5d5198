"""FSDP trains exactly as one process does on the whole batch, with the collective schedule it promises."""

import numpy as np
import pytest

import ferro
from ferro import nn
from ferro.dtensor import Replicate, Shard
from ferro.testing import run_processes, run_threads

torch = pytest.importorskip("torch")

STEPS = 5
BATCH = 12  # divisible by 2, 3 and 4: every rank's share is equal, so the mean of means is the mean
SIZES = [7, 5, 3, 2]  # no layer size divisible by the world size: padding and empty shares happen
LR, WEIGHT_DECAY = 0.05, 0.1
STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"]


def batches(seed=3, sizes=SIZES, steps=STEPS):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, sizes[0])), rng.standard_normal((BATCH, sizes[-1]))) for _ in range(steps)]


def numpy_model(seed=0, sizes=SIZES):
    rng = np.random.default_rng(seed)
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(n_in, n_out, rng=rng, dtype=np.float64))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def torch_model(seed=0, sizes=SIZES, dtype=torch.float64):
    """The same layers and initial values as :func:`numpy_model` (torch's global RNG is shared by threads)."""
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(torch.nn.Linear(n_in, n_out, dtype=dtype))
        if i < len(sizes) - 2:
            layers.append(torch.nn.Tanh())
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for name, value in numpy_model(seed, sizes).state_dict().items():
            model.get_parameter(name).copy_(torch.from_numpy(value))
    return model


def make_model(framework, seed=0, sizes=SIZES):
    return numpy_model(seed, sizes) if framework == "numpy" else torch_model(seed, sizes)


def linear_policy(module):
    return isinstance(module, (nn.Linear, torch.nn.Linear))


def all_but_middle_policy(module):
    """Units for the first and last Linear: the middle one's parameters stay with the root unit."""
    return linear_policy(module) and module.weight.shape[0] != SIZES[2]


def as_numpy(value):
    return value.detach().numpy().copy() if isinstance(value, torch.Tensor) else np.array(value)


def train_reference(framework, sizes=SIZES):
    """Single process, whole batch: what every FSDP run must reproduce."""
    model = make_model(framework, sizes=sizes)
    if framework == "numpy":
        optimizer = nn.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        criterion = nn.MSELoss()
        for x, y in batches(sizes=sizes):
            optimizer.zero_grad()
            criterion(model(x), y)
            model.backward(criterion.backward())
            optimizer.step()
        states = {name: {k: np.array(v) for k, v in optimizer.state[p].items()}
                  for name, p in model.named_parameters()}
        return {k: v.copy() for k, v in model.state_dict().items()}, states
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for x, y in batches(sizes=sizes):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        optimizer.step()
    states = {name: {k: as_numpy(v) for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()}
    return {k: as_numpy(v) for k, v in model.state_dict().items()}, states


def make_optimizer(framework, params):
    if framework == "numpy":
        return nn.Adam(params, lr=LR, weight_decay=WEIGHT_DECAY)
    return torch.optim.Adam(params, lr=LR, weight_decay=WEIGHT_DECAY)


def train_steps(group, framework, fsdp, optimizer, data):
    """Run FSDP steps on this rank's share of each batch; return each step's collective calls."""
    stats = []
    for x, y in data:
        x, y = np.array_split(x, group.world_size)[group.rank], np.array_split(y, group.world_size)[group.rank]
        group.reset_stats()
        optimizer.zero_grad()
        if framework == "numpy":
            criterion = nn.MSELoss()
            criterion(fsdp(x), y)
            fsdp.backward(criterion.backward())
        else:
            torch.nn.functional.mse_loss(fsdp(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        stats.append({op: entry["calls"] for op, entry in group.stats().items()})
        optimizer.step()
    return stats


def rank_train(group, framework, strategy, policy, prefetch=True, sizes=SIZES):
    mesh = None
    if strategy == "hybrid_shard":
        mesh = ferro.init_device_mesh((2, group.world_size // 2), ("replicate", "shard"), group=group)
    # Every rank builds its own random init: FSDP starts all from rank 0's (the reference's seed).
    model = make_model(framework, seed=group.rank, sizes=sizes)
    fsdp = ferro.FSDP(model, group=group, device_mesh=mesh, sharding_strategy=strategy, auto_wrap_policy=policy,
                      forward_prefetch=prefetch)
    shards = fsdp.parameters()
    optimizer = make_optimizer(framework, shards)
    stats = train_steps(group, framework, fsdp, optimizer, batches(sizes=sizes))
    same_objects = all(a is b for a, b in zip(shards, fsdp.parameters(), strict=True)) and len(shards) == len(
        fsdp.parameters())
    full = {k: as_numpy(v) for k, v in fsdp.full_state_dict().items()}
    optim = fsdp.full_optim_state_dict(optimizer)
    optim_state = {name: {k: as_numpy(v) for k, v in entry.items()} for name, entry in optim["state"].items()}
    return {"full": full, "optim": optim_state, "stats": stats, "same_objects": same_objects,
            "units": len(fsdp.units), "comm": fsdp.comm_stats()}


def check_against_reference(results, framework, sizes=SIZES):
    expected, expected_optim = train_reference(framework, sizes)
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
    results = run_threads(rank_train, world_size, args=(framework, strategy, linear_policy),
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


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_root_unit_holds_what_no_other_unit_takes(framework, prefetch):
    """The middle Linear stays with the root: U = 3 units still, and the root gathers like the others."""
    results = run_threads(rank_train, 3, args=(framework, "full_shard", all_but_middle_policy, prefetch),
                                        timeout=120)
    check_against_reference(results, framework)
    for result in results:
        assert result["units"] == 3
        assert all(calls == {"all_gather": 6, "reduce_scatter": 3} for calls in result["stats"])


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_ranks_with_an_empty_share_train_too(framework):
    """Linear(1, 1) holds two elements: at world size 4 two ranks hold only padding."""
    sizes = [3, 1, 1, 2]
    results = run_threads(rank_train, 4, args=(framework, "full_shard", linear_policy, True, sizes),
                                        timeout=120)
    check_against_reference(results, framework, sizes)


@pytest.mark.parametrize(("framework", "strategy", "world_size", "harness"),
                         [("torch", "full_shard", 3, "tcp"), ("numpy", "hybrid_shard", 4, "shm"),
                          ("numpy", "shard_grad_op", 2, "tcp")])
def test_training_over_real_processes(framework, strategy, world_size, harness):
    results = run_processes(rank_train, world_size, args=(framework, strategy, linear_policy),
                                          backend=harness, timeout=180)
    check_against_reference(results, framework)


# --- state dicts ---------------------------------------------------------------------------------


def rank_state(group, framework, strategy):
    mesh = None
    if strategy == "hybrid_shard":
        mesh = ferro.init_device_mesh((2, group.world_size // 2), ("replicate", "shard"), group=group)
    fsdp = ferro.FSDP(make_model(framework, seed=group.rank), group=group, device_mesh=mesh,
                      sharding_strategy=strategy, auto_wrap_policy=linear_policy)
    initial = {k: as_numpy(v) for k, v in fsdp.full_state_dict().items()}
    rank0 = {k: as_numpy(v) for k, v in fsdp.full_state_dict(rank0_only=True).items()}
    sharded = {name: (as_numpy(e.local), e.global_shape, e.start, e.stop)
               for name, e in fsdp.sharded_state_dict().items()}
    as_dtensors = {name: (d.placements, as_numpy(d.to_local()), as_numpy(d.full_tensor()), type(d.to_local()))
                   for name, d in fsdp.sharded_state_dict(as_dtensor=True).items()}
    optimizer = make_optimizer(framework, fsdp.parameters())
    other = make_model(framework, seed=99).state_dict()
    fsdp.load_full_state_dict(other)
    loaded = {k: as_numpy(v) for k, v in fsdp.full_state_dict().items()}
    train_steps(group, framework, fsdp, optimizer, batches()[:1])  # the optimizer made before loading still works
    return {"initial": initial, "rank0": rank0, "sharded": sharded, "loaded": loaded, "dtensors": as_dtensors,
            "same_objects": all(a is b for a, b in zip(optimizer_params(optimizer), fsdp.parameters(), strict=True))}


def optimizer_params(optimizer):
    return optimizer.params if isinstance(optimizer, nn.Optimizer) else optimizer.param_groups[0]["params"]


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dicts_are_bit_exact(framework, strategy):
    world_size = 4 if strategy == "hybrid_shard" else 3
    results = run_threads(rank_state, world_size, args=(framework, strategy), timeout=120)
    single = {k: as_numpy(v) for k, v in make_model(framework, seed=0).state_dict().items()}
    other = {k: as_numpy(v) for k, v in make_model(framework, seed=99).state_dict().items()}
    for rank, result in enumerate(results):
        assert list(result["initial"]) == list(single)
        for name, value in single.items():
            assert np.array_equal(result["initial"][name], value), name  # rank 0's init, bit for bit
            assert np.array_equal(result["loaded"][name], other[name]), name
        assert result["rank0"].keys() == (single.keys() if rank == 0 else set())
        assert result["same_objects"]
    # The sharded entries of the ranks of one replica tile every parameter exactly once.
    replica = results[:2] if strategy == "hybrid_shard" else results[:1] if strategy == "no_shard" else results
    for name, value in single.items():
        flat = np.full(value.size, np.nan)
        for result in replica:
            local, shape, start, stop = result["sharded"][name]
            assert shape == value.shape and local.shape == (stop - start,)
            assert np.isnan(flat[start:stop]).all()
            flat[start:stop] = local
        assert np.array_equal(flat.reshape(value.shape), value), name
    # As DTensors (torch fully_shard's layout): Shard(0) rows by torch.chunk over the shard group.
    shard_size = {"no_shard": 1, "hybrid_shard": 2}.get(strategy, world_size)
    for rank, result in enumerate(results):
        for name, value in single.items():
            placements, local, full, kind = result["dtensors"][name]
            assert placements == ((Replicate(),) if strategy == "no_shard" else (Shard(0),))
            assert kind is (np.ndarray if framework == "numpy" else torch.Tensor)
            rows = torch.arange(value.shape[0]).chunk(shard_size)
            mine = rows[rank % shard_size].numpy() if rank % shard_size < len(rows) else np.array([], np.int64)
            assert np.array_equal(local, value[mine]) and np.array_equal(full, value), name


def rank_resume(group, framework, saved, first_steps):
    """Load a full model and optimizer state saved at another world size, and train on."""
    fsdp = ferro.FSDP(make_model(framework, seed=group.rank), group=group, auto_wrap_policy=linear_policy)
    optimizer = make_optimizer(framework, fsdp.parameters())
    if saved is not None:
        model_state, optim_state = saved
        if framework == "torch":
            model_state = {k: torch.from_numpy(v) for k, v in model_state.items()}
            optim_state = {"state": {n: {k: torch.from_numpy(np.array(v)) for k, v in e.items()}
                                     for n, e in optim_state["state"].items()}}
        fsdp.load_full_state_dict(model_state)
        fsdp.load_full_optim_state_dict(optimizer, optim_state)
    data = batches()
    train_steps(group, framework, fsdp, optimizer, data[:first_steps] if saved is None else data[first_steps:])
    full = {k: as_numpy(v) for k, v in fsdp.full_state_dict().items()}
    optim = fsdp.full_optim_state_dict(optimizer)
    return full, {"state": {n: {k: as_numpy(v) for k, v in e.items()} for n, e in optim["state"].items()}}


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_full_state_resumes_at_another_world_size(framework):
    """2 steps on 2 ranks, save full state, load on 3 ranks, 3 more steps: equals 5 single-process steps."""
    saved = run_threads(rank_resume, 2, args=(framework, None, 2), timeout=120)[0]
    results = run_threads(rank_resume, 3, args=(framework, saved, 2), timeout=120)
    expected, expected_optim = train_reference(framework)
    for full, optim in results:
        for name, value in expected.items():
            np.testing.assert_allclose(full[name], value, rtol=0, atol=1e-12, err_msg=name)
        for name, entry in expected_optim.items():
            for key, value in entry.items():
                np.testing.assert_allclose(optim["state"][name][key], value, rtol=0, atol=1e-12)


# --- mixed precision ----------------------------------------------------------------------------


def rank_mixed(group, param_dtype_name, reduce_dtype_name):
    dtype = getattr(torch, param_dtype_name) if param_dtype_name else None
    reduce_dtype = getattr(torch, reduce_dtype_name) if reduce_dtype_name else None
    model = torch_model(seed=group.rank)
    model.float()
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append((module.weight.dtype, out.dtype)))
    fsdp = ferro.FSDP(model, group=group, auto_wrap_policy=linear_policy,
                      mixed_precision=ferro.MixedPrecision(param_dtype=dtype, reduce_dtype=reduce_dtype))
    optimizer = torch.optim.Adam(fsdp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    data = [(x.astype(np.float32), y.astype(np.float32)) for x, y in batches()]
    group.reset_stats()
    train_steps(group, "torch", fsdp, optimizer, data)
    stats = group.stats()
    return ({k: as_numpy(v) for k, v in fsdp.full_state_dict().items()}, seen[0],
            [str(p.dtype) for p in fsdp.parameters()], stats["all_gather"]["bytes_sent"],
            stats["reduce_scatter"]["bytes_sent"])


def test_mixed_precision_computes_narrow_and_keeps_float32_shards():
    full32, seen32, shards32, gathered32, reduced32 = run_threads(
        rank_mixed, 2, args=(None, None), timeout=120)[0]
    full16, seen16, shards16, gathered16, reduced16 = run_threads(
        rank_mixed, 2, args=("bfloat16", "float32"), timeout=120)[0]
    assert seen32 == (torch.float32, torch.float32) and seen16 == (torch.bfloat16, torch.bfloat16)
    assert shards32 == shards16 == ["torch.float32"] * 3
    assert gathered16 * 2 == gathered32  # parameters travel in 16 bits
    assert reduced16 == reduced32  # gradients are reduced in float32
    expected, _ = train_reference("torch")
    for name, value in expected.items():
        # bfloat16 keeps 8 bits of mantissa: close to float64 training, and visibly not float32 training
        np.testing.assert_allclose(full16[name], value, atol=0.05)
        np.testing.assert_allclose(full32[name], value, atol=1e-5)
    assert max(np.abs(full16[n] - full32[n]).max() for n in expected) > 1e-4


# --- ranks that disagree ------------------------------------------------------------------------


class Branchy(nn.Module):
    """a, b, c, d: b and c have the same shape, so only FSDP's tags tell their gathers apart."""

    def __init__(self, mode):
        super().__init__()
        rng = np.random.default_rng(0)
        self.a, self.b = nn.Linear(7, 5, rng=rng, dtype=np.float64), nn.Linear(5, 5, rng=rng, dtype=np.float64)
        self.c, self.d = nn.Linear(5, 5, rng=rng, dtype=np.float64), nn.Linear(5, 2, rng=rng, dtype=np.float64)
        self.mode = mode

    def order(self):
        return {"skip": [self.a, self.c, self.d], "swap": [self.a, self.c, self.b, self.d]}.get(
            self.mode, [self.a, self.b, self.c, self.d])

    def forward(self, x):
        for layer in self.order():
            x = layer(x)
        return x

    def backward(self, grad):
        for layer in reversed(self.order()):
            grad = layer.backward(grad)
        return grad


class TorchBranchy(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.a, self.b = torch.nn.Linear(7, 5), torch.nn.Linear(5, 5)
        self.c, self.d = torch.nn.Linear(5, 5), torch.nn.Linear(5, 2)
        self.mode = mode

    def forward(self, x):
        order = {"skip": [self.a, self.c, self.d], "swap": [self.a, self.c, self.b, self.d]}.get(
            self.mode, [self.a, self.b, self.c, self.d])
        for layer in order:
            x = layer(x)
        return x


def rank_disagree(group, framework, mode, odd_rank):
    model_type = Branchy if framework == "numpy" else TorchBranchy
    fsdp = ferro.FSDP(model_type(mode if group.rank == odd_rank else "plain"), group=group,
                      auto_wrap_policy=linear_policy)
    x = np.ones((2, 7))
    try:
        for _ in range(2):
            if framework == "numpy":
                fsdp.backward(np.ones((2, 2)) * fsdp(x).sum())
            else:
                fsdp(torch.from_numpy(x).float()).sum().backward()
    except ferro.DistributedError as exc:
        return type(exc).__name__, str(exc)
    return None, "no error"


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("mode", ["skip", "swap"])
@pytest.mark.parametrize("harness", ["simulated", "tcp"])
def test_ranks_that_run_other_units_all_raise_naming_them(framework, mode, harness):
    world_size, odd_rank = 3, 1
    if harness == "simulated":
        results = run_threads(rank_disagree, world_size, args=(framework, mode, odd_rank), timeout=60,
                                            group_timeout=20)
    else:
        results = run_processes(rank_disagree, world_size, args=(framework, mode, odd_rank),
                                              timeout=90, group_timeout=20)
    for rank, (kind, message) in enumerate(results):
        assert kind is not None, f"rank {rank} finished without an error"
        assert kind == "CollectiveMismatchError", (rank, message)
        assert "FSDP" in message and "all_gather" in message, message
        assert "'c'" in message and ("'b'" in message), message  # both units the ranks were at
        assert f"rank {odd_rank}" in message, message


# --- options and the mesh ---------------------------------------------------------------------------


def test_bad_options_are_refused_clearly():
    group = ferro.SimulatedBackend.create_group(1)[0]
    with pytest.raises(ValueError, match="unknown sharding_strategy 'everything'"):
        ferro.FSDP(numpy_model(), group=group, sharding_strategy="everything")
    with pytest.raises(ferro.ConfigurationError, match="HYBRID_SHARD needs a 2-d device_mesh"):
        ferro.FSDP(numpy_model(), group=group, sharding_strategy="hybrid_shard")
    with pytest.raises(ferro.ConfigurationError, match="no parameters"):
        ferro.FSDP(nn.Sequential(nn.Tanh()), group=group)
    with pytest.raises(ferro.ConfigurationError, match="not a torch.dtype"):
        ferro.FSDP(torch_model(), group=group, mixed_precision=ferro.MixedPrecision(param_dtype=np.float16))
    with pytest.raises(ferro.ConfigurationError, match="FSDP.backward is for ferro.nn"):
        ferro.FSDP(torch_model(), group=group).backward(None)
    assert ferro.ShardingStrategy.of("SHARD_GRAD_OP") is ferro.ShardingStrategy.SHARD_GRAD_OP
    with pytest.raises(ValueError, match="positive int"):
        ferro.size_based_policy(0)


def test_size_based_policy_wraps_the_smallest_big_enough_modules():
    model = nn.Sequential(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2)), nn.Linear(2, 1))
    policy = ferro.size_based_policy(100)
    inner, big, small = model._modules["0"], model._modules["0"]._modules["0"], model._modules["1"]
    assert policy(big) and not policy(inner) and not policy(small) and not policy(model)
    group = ferro.SimulatedBackend.create_group(1)[0]
    fsdp = ferro.FSDP(model, group=group, auto_wrap_policy=policy)
    assert [unit.name for unit in fsdp.units] == ["", "0.0"]


class Boxed:
    """An output container FSDP cannot look into."""

    def __init__(self, tensor):
        self.tensor = tensor


class BoxingLinear(torch.nn.Linear):
    def forward(self, x):
        return Boxed(super().forward(x.tensor if isinstance(x, Boxed) else x))


class BoxedModel(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        reference = torch_model(seed)
        self.layers = torch.nn.ModuleList()
        for layer in reference:
            if isinstance(layer, torch.nn.Linear):
                boxed = BoxingLinear(layer.in_features, layer.out_features, dtype=torch.float64)
                boxed.load_state_dict(layer.state_dict())
                self.layers.append(boxed)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = Boxed(torch.tanh(x.tensor))
        return x.tensor


def rank_boxed(group):
    fsdp = ferro.FSDP(BoxedModel(group.rank), group=group, auto_wrap_policy=lambda m: isinstance(m, BoxingLinear))
    optimizer = make_optimizer("torch", fsdp.parameters())
    train_steps(group, "torch", fsdp, optimizer, batches())
    return {k.replace("layers.", ""): as_numpy(v) for k, v in fsdp.full_state_dict().items()}


def test_units_whose_outputs_cannot_be_hooked_stay_gathered_and_train_right():
    expected, _ = train_reference("torch")
    for full in run_threads(rank_boxed, 2, timeout=120):
        for name, value in expected.items():
            layer, param = name.split(".")
            np.testing.assert_allclose(full[f"{int(layer) // 2}.{param}"], value, rtol=0, atol=1e-12)


def rank_numpy_mixed(group, narrow):
    mixed = ferro.MixedPrecision(param_dtype=np.float32) if narrow else None
    model, seen = numpy_model(group.rank), []
    first = model._modules["0"]
    forward = first.forward  # what the layer computes with, seen from inside FSDP's gather and cast
    first.forward = lambda x: (seen.append((first.weight.data.dtype, x.dtype)), forward(x))[1]
    fsdp = ferro.FSDP(model, group=group, auto_wrap_policy=linear_policy, mixed_precision=mixed)
    optimizer = make_optimizer("numpy", fsdp.parameters())
    group.reset_stats()
    train_steps(group, "numpy", fsdp, optimizer, batches())
    gathered = group.stats()["all_gather"]["bytes_sent"]  # before the state dict's own (float64) gathers
    return fsdp.full_state_dict(), seen[0], [str(p.data.dtype) for p in fsdp.parameters()], gathered


def test_numpy_mixed_precision_gathers_narrow_and_keeps_wide_shards():
    wide, seen_wide, shards_wide, bytes_wide = run_threads(rank_numpy_mixed, 2, args=(False,), timeout=120)[0]
    narrow, seen_narrow, shards_narrow, bytes_narrow = run_threads(rank_numpy_mixed, 2, args=(True,), timeout=120)[0]
    assert seen_wide == (np.float64, np.float64) and seen_narrow == (np.float32, np.float32)
    assert shards_wide == shards_narrow == ["float64"] * 3
    assert bytes_narrow * 2 == bytes_wide
    expected, _ = train_reference("numpy")
    for name, value in expected.items():
        np.testing.assert_allclose(wide[name], value, rtol=0, atol=1e-12)
        np.testing.assert_allclose(narrow[name], value, rtol=0, atol=1e-5)
    assert max(np.abs(narrow[n] - wide[n]).max() for n in expected) > 1e-12  # it really computed in float32


# --- memory: what FULL_SHARD keeps between steps ----------------------------------------------------------------

def _live_tensor_bytes():
    """Bytes of every distinct CPU tensor storage reachable now (what the process keeps, not sizes multiplied)."""
    import gc
    import warnings

    gc.collect()
    storages = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr():
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())


def _kept_after_step(group, strategy):
    torch.manual_seed(0)
    x, y = torch.randn(8, 512), torch.randn(8, 512)
    baseline = _live_tensor_bytes()
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()) for _ in range(4)])
    model = ferro.FSDP(net, group=group, sharding_strategy=strategy,
                       auto_wrap_policy=lambda m: isinstance(m, torch.nn.Sequential) and len(m) == 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    del net
    kept = []
    for _ in range(3):
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()  # as training does between steps: gradients go
        kept.append(_live_tensor_bytes() - baseline)
    return kept


def test_full_shard_keeps_a_quarter_of_no_shard_between_steps_at_four_ranks():
    """Four 512x512 float32 layers with Adam: parameters and Adam's two moments, sharded; nothing gathered is kept."""
    full = run_processes(_kept_after_step, 4, args=("full_shard",), timeout=240)
    whole = run_processes(_kept_after_step, 4, args=("no_shard",), timeout=240)
    parameters = 4 * (512 * 512 + 512) * 4  # bytes of one whole copy
    for rank in range(4):
        assert full[rank][0] == full[rank][-1] and whole[rank][0] == whole[rank][-1]  # no growth step to step
        # Adam's step counters are a few bytes per parameter tensor; everything else is the model's own arithmetic.
        assert 3 * parameters <= whole[rank][-1] <= 3 * parameters + 4096, whole[rank]
        assert 3 * parameters / 4 <= full[rank][-1] <= 3 * parameters / 4 + 4096, full[rank]
