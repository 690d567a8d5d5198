"""DDP ends where single-process training on the combined batch ends -- and where torch's own DDP ends."""

import numpy as np
import pytest

import ferro
from ferro import nn

STEPS = 4
BATCH = 12  # divisible by 2 and 3: every rank's share is equal, so the mean of means is the mean


def data(seed=7, features=6, classes=3):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, features)), rng.integers(0, classes, BATCH)) for _ in range(STEPS)]


def numpy_model(seed=0, dtype=np.float64, mixed=False):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(6, 10, rng=rng, dtype=dtype), nn.Tanh(),
                         nn.Linear(10, 3, rng=rng, dtype=np.float32 if mixed else dtype))


def train_numpy(model, batches, shard=None, ddp=None, accumulate=1, frozen=False):
    if frozen:
        model._modules["0"].bias.requires_grad = False
    net = ddp(model) if ddp else model
    optimizer = nn.SGD(net.parameters(), lr=0.1, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(batches):
        if shard is not None:
            x, y = np.array_split(x, shard[1])[shard[0]], np.array_split(y, shard[1])[shard[0]]
        if step % accumulate == 0:
            optimizer.zero_grad()
        last = step % accumulate == accumulate - 1
        criterion(net(x), y)
        backward = net.backward if isinstance(net, ferro.DDP) else net.backward
        if isinstance(net, ferro.DDP) and not last:
            with net.no_sync():
                backward(criterion.backward())
        else:
            backward(criterion.backward())
        if last:
            optimizer.step()
    return [p.data.copy() for p in model.parameters()]


def rank_numpy_ddp(group, options):
    model = numpy_model(seed=group.rank + 100, mixed=options.get("mixed", False))  # rank 0's init wins
    reference_init = numpy_model(seed=100, mixed=options.get("mixed", False))
    def make(m):
        return ferro.DDP(m, group=group, bucket_cap_mb=0.0005, first_bucket_mb=0.0001, comm_hook=options.get("hook"))

    return train_numpy(model, data(), (group.rank, group.world_size), make, options.get("accumulate", 1),
                       options.get("frozen", False)), [p.data.copy() for p in reference_init.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("options", [{}, {"accumulate": 2}, {"frozen": True}, {"mixed": True}],
                         ids=["plain", "no_sync", "frozen", "mixed_dtypes"])
def test_ferro_nn_ddp_equals_single_process_training(run, world_size, options):
    results = run(rank_numpy_ddp, world_size, args=(options,))
    expected = train_numpy(numpy_model(seed=100, mixed=options.get("mixed", False)), data(),
                           accumulate=options.get("accumulate", 1), frozen=options.get("frozen", False))
    for params, _ in results:
        for got, want in zip(params, expected, strict=True):
            tolerance = 1e-5 if got.dtype == np.float32 else 1e-10
            np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    if options.get("frozen"):
        np.testing.assert_array_equal(results[0][0][1], results[0][1][1])  # the frozen bias never moved


def torch_model(seed):
    import torch

    # Parameters from a NumPy generator of our own: torch's global RNG is shared by the threads
    # of a simulated group, so seeding it per rank would race.
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3)).double()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.from_numpy(rng.uniform(-0.4, 0.4, tuple(param.shape))))
    return model


def train_torch(model, batches, shard=None, wrap=None):
    import torch

    net = wrap(model) if wrap else model
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss()
    for x, y in batches:
        if shard is not None:
            x, y = np.array_split(x, shard[1])[shard[0]], np.array_split(y, shard[1])[shard[0]]
        optimizer.zero_grad()  # torch's default sets gradients to None: DDP must cope
        criterion(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        optimizer.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def rank_torch_ddp(group):
    model = torch_model(seed=group.rank + 5)
    return train_torch(model, data(), (group.rank, group.world_size),
                       lambda m: ferro.DDP(m, group=group, bucket_cap_mb=0.0005, first_bucket_mb=0.0001))


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_model_ddp_equals_single_process_training(run, world_size):
    expected = train_torch(torch_model(seed=5), data())
    for params in run(rank_torch_ddp, world_size):
        for got, want in zip(params, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def rank_torch_own_ddp(rank, world_size):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method="env://")
    try:
        return train_torch(torch_model(seed=rank + 5), data(), (rank, world_size), DistributedDataParallel)
    finally:
        dist.destroy_process_group()


def test_ferro_ddp_ends_where_torch_ddp_with_gloo_ends():
    from ferro.testing import run_processes

    theirs = run_processes(rank_torch_own_ddp, 2, backend=None)
    ours = run_processes(rank_torch_ddp, 2)
    for got, want in zip(ours[0], theirs[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def rank_broadcast_with_existing_optimizer(group):
    model = numpy_model(seed=group.rank + 100)
    optimizer = nn.SGD(model.parameters(), lr=0.1)  # created before DDP copies rank 0's values
    arrays_before = [p.data for p in model.parameters()]
    ddp = ferro.DDP(model, group=group)
    same_arrays = all(a is p.data for a, p in zip(arrays_before, model.parameters(), strict=True))
    criterion = nn.CrossEntropyLoss()
    x, y = data()[0]
    criterion(ddp(np.array_split(x, group.world_size)[group.rank]), np.array_split(y, group.world_size)[group.rank])
    optimizer.zero_grad()
    ddp.backward(criterion.backward())
    optimizer.step()
    return same_arrays, [p.data.copy() for p in model.parameters()]


def test_broadcast_parameters_keeps_an_existing_optimizer_working(run):
    results = run(rank_broadcast_with_existing_optimizer, 2)
    expected = numpy_model(seed=100)
    optimizer = nn.SGD(expected.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss()
    x, y = data()[0]
    criterion(expected(x), y)
    expected.backward(criterion.backward())
    optimizer.step()
    for same_arrays, params in results:
        assert same_arrays
        for got, want in zip(params, expected.parameters(), strict=True):
            np.testing.assert_allclose(got, want.data, rtol=1e-10, atol=1e-10)


def rank_compression(group, hook_name):
    hook = {"fp16": ferro.parallel.fp16_compress_hook, "bf16": ferro.parallel.bf16_compress_hook}[hook_name]
    model = numpy_model(seed=100, dtype=np.float32)
    ddp = ferro.DDP(model, group=group, comm_hook=hook)
    grads = [np.random.default_rng([group.rank, i]).standard_normal(p.shape).astype(np.float32)
             for i, p in enumerate(model.parameters())]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad[...] = g
    ddp.sync_gradients()
    return [p.grad.copy() for p in model.parameters()]


@pytest.mark.parametrize("hook_name, tolerance", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_compression_hooks_average_within_their_precision(run, hook_name, tolerance):
    results = run(rank_compression, 2, args=(hook_name,))
    model = numpy_model(seed=100, dtype=np.float32)
    for i, p in enumerate(model.parameters()):
        want = np.mean([np.random.default_rng([r, i]).standard_normal(p.shape).astype(np.float32) for r in range(2)],
                       axis=0)
        np.testing.assert_allclose(results[0][i], want, atol=tolerance * 4, rtol=tolerance)
        np.testing.assert_array_equal(results[0][i], results[1][i])  # identical on every rank
        assert not np.allclose(results[0][i], want, rtol=1e-7, atol=1e-9)  # it really was compressed


def rank_custom_hook_and_overlap(group):
    model = nn.Sequential(*[nn.Linear(8, 8, rng=np.random.default_rng(i), dtype=np.float64) for i in range(4)])
    events = []

    class Marker(nn.Module):
        def __init__(self, layer, name):
            super().__init__()
            self.layer, self.name = layer, name

        def forward(self, x):
            return self.layer(x)

        def backward(self, g):
            out = self.layer.backward(g)
            events.append(f"backward {self.name}")
            return out

    wrapped = nn.Sequential(*[Marker(layer, str(i)) for i, layer in enumerate(model.children())])
    seen = []

    def counting_hook(g, bucket):
        seen.append(bucket.index)
        ferro.parallel.allreduce_hook(g, bucket)

    ddp = ferro.DDP(wrapped, group=group, bucket_cap_mb=8 * 9 * 8 / 2**20, first_bucket_mb=8 * 9 * 8 / 2**20,
                    comm_hook=counting_hook)
    original_launch = ddp._launch

    def launch(bucket):
        events.append(f"launch {bucket.index}")
        original_launch(bucket)

    ddp._launch = launch
    x = np.ones((2, 8))
    ddp(x)
    ddp.backward(np.ones((2, 8)))
    return len(ddp.buckets), sorted(seen), events


def test_buckets_are_reduced_during_backward_through_the_registered_hook(run):
    for n_buckets, seen, events in run(rank_custom_hook_and_overlap, 2):
        assert n_buckets == 4 and seen == [0, 1, 2, 3]
        # The last layer's bucket is launched before the first layer's backward has run.
        assert events.index("launch 0") < events.index("backward 0")
        assert events[:2] == ["launch 0", "backward 3"]
