"""SyncBatchNorm: 3 ranks with local batches of 5, 3 and 0 equal BatchNorm on the concatenated batch of 8.

Compared at 1e-12 in float64: outputs, input gradients, weight and bias gradients (summed over the ranks, as
data parallelism sums them), running statistics after two steps. ferro.nn's BatchNorm is itself checked against
torch's here and against finite differences in test_nn.py.
"""

import numpy as np
import pytest

import ferro
from ferro import nn
from ferro.testing import run_processes, run_threads

BATCHES = [5, 3, 0]
OFFSETS = np.cumsum([0, *BATCHES])
SHAPES = {"1d-flat": (4,), "1d": (4, 6), "2d": (3, 4, 5), "3d": (2, 3, 2, 3)}  # (C, *spatial)
LAYERS = {"1d-flat": "BatchNorm1d", "1d": "BatchNorm1d", "2d": "BatchNorm2d", "3d": "BatchNorm3d"}
STEPS = 2


def batch_data(kind, step):
    rng = np.random.default_rng([step, len(SHAPES[kind])])
    shape = (int(OFFSETS[-1]), *SHAPES[kind])
    return rng.standard_normal(shape) * 3 + 1.5, rng.standard_normal(shape)


def affine_values(channels):
    rng = np.random.default_rng(99)
    return rng.uniform(0.5, 1.5, channels), rng.uniform(-1, 1, channels)


def run_ferro(layer, kind, rank, backward):
    """STEPS training steps on this rank's rows; returns outputs, input grads, weight/bias grads, running stats."""
    outputs = []
    weight, bias = affine_values(SHAPES[kind][0])
    layer.weight.data[...], layer.bias.data[...] = weight, bias
    for step in range(STEPS):
        x, dy = batch_data(kind, step)
        rows = slice(OFFSETS[rank], OFFSETS[rank + 1])
        layer.zero_grad()
        y = layer(x[rows])
        dx = backward(layer, dy[rows])
        outputs.append((y, dx))
    return {"outputs": outputs, "grads": (layer.weight.grad.copy(), layer.bias.grad.copy()),
            "running": (layer.running_mean.copy(), layer.running_var.copy(), int(layer.num_batches_tracked))}


def _whole_batch(layer, kind):
    """The reference: one process, the whole batch of 8 rows."""
    weight, bias = affine_values(SHAPES[kind][0])
    layer.weight.data[...], layer.bias.data[...] = weight, bias
    outputs = []
    for step in range(STEPS):
        x, dy = batch_data(kind, step)
        layer.zero_grad()
        outputs.append((layer(x), layer.backward(dy)))
    return {"outputs": outputs, "grads": (layer.weight.grad.copy(), layer.bias.grad.copy()),
            "running": (layer.running_mean.copy(), layer.running_var.copy(), int(layer.num_batches_tracked))}


def sync_rank(group, kind, momentum):
    layer = ferro.SyncBatchNorm(SHAPES[kind][0], momentum=momentum, group=group, dtype=np.float64)
    group.reset_stats()
    result = run_ferro(layer, kind, group.rank, lambda m, dy: m.backward(dy))
    result["step_calls"] = {k: v["calls"] for k, v in group.stats().items()}
    x, _ = batch_data(kind, 0)
    group.reset_stats()
    layer.eval()
    result["eval_output"] = layer(x[OFFSETS[group.rank]:OFFSETS[group.rank + 1]])
    result["eval_stats"] = group.stats()
    return result


def assert_matches(results, want, offsets=OFFSETS):
    for rank, got in enumerate(results):
        rows = slice(offsets[rank], offsets[rank + 1])
        for (y, dx), (y_ref, dx_ref) in zip(got["outputs"], want["outputs"], strict=True):
            assert y.shape == y_ref[rows].shape
            np.testing.assert_allclose(y, y_ref[rows], rtol=0, atol=1e-12)
            np.testing.assert_allclose(dx, dx_ref[rows], rtol=0, atol=1e-12)
        for ours, theirs in zip(got["running"][:2], want["running"][:2], strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
        assert got["running"][2] == want["running"][2] == STEPS
    for ours, theirs in zip([sum(r["grads"][i] for r in results) for i in range(2)], want["grads"], strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("momentum", [0.1, None])
def test_ferro_sync_batch_norm_equals_batch_norm_on_the_whole_batch(kind, momentum):
    want = _whole_batch(getattr(nn, LAYERS[kind])(SHAPES[kind][0], momentum=momentum, dtype=np.float64), kind)
    results = run_threads(sync_rank, 3, args=(kind, momentum), timeout=60)
    assert_matches(results, want)
    for rank, got in enumerate(results):
        assert got["step_calls"] == {"all_gather": STEPS, "allreduce": STEPS}  # one each way per step
        assert got["eval_stats"] == {}  # evaluation moved nothing
        layer = getattr(nn, LAYERS[kind])(SHAPES[kind][0], momentum=momentum, dtype=np.float64)
        layer.running_mean[...], layer.running_var[...] = want["running"][0], want["running"][1]
        layer.weight.data[...], layer.bias.data[...] = affine_values(SHAPES[kind][0])
        x, _ = batch_data(kind, 0)
        expected = layer.eval()(x[OFFSETS[rank]:OFFSETS[rank + 1]])
        np.testing.assert_allclose(got["eval_output"], expected, rtol=0, atol=1e-12)


def test_ferro_sync_batch_norm_over_tcp_processes():
    want = _whole_batch(nn.BatchNorm2d(SHAPES["2d"][0], dtype=np.float64), "2d")
    results = run_processes(sync_rank, 3, args=("2d", 0.1), backend="tcp", timeout=120)
    assert_matches(results, want)
    assert all(r["eval_stats"] == {} for r in results)


@pytest.mark.parametrize("kind", list(SHAPES))
def test_ferro_batch_norm_equals_torch(kind):
    torch = pytest.importorskip("torch")
    ours = _whole_batch(getattr(nn, LAYERS[kind])(SHAPES[kind][0], dtype=np.float64), kind)
    layer = getattr(torch.nn, LAYERS[kind])(SHAPES[kind][0], dtype=torch.float64)
    theirs = run_torch(layer, kind, None)
    assert_matches([ours], theirs, offsets=[0, OFFSETS[-1]])


# --- torch ------------------------------------------------------------------------------------------------------

def run_torch(layer, kind, rank):
    """STEPS steps of a torch layer on this rank's rows (all rows when rank is None)."""
    import torch
    weight, bias = affine_values(SHAPES[kind][0])
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight))
        layer.bias.copy_(torch.from_numpy(bias))
    outputs = []
    for step in range(STEPS):
        x, dy = batch_data(kind, step)
        if rank is not None:
            x, dy = x[OFFSETS[rank]:OFFSETS[rank + 1]], dy[OFFSETS[rank]:OFFSETS[rank + 1]]
        xt = torch.from_numpy(x.copy()).requires_grad_()
        layer.zero_grad()
        y = layer(xt)
        y.backward(torch.from_numpy(dy))
        outputs.append((y.detach().numpy().copy(), xt.grad.numpy().copy()))
    return {"outputs": outputs, "grads": (layer.weight.grad.numpy().copy(), layer.bias.grad.numpy().copy()),
            "running": (layer.running_mean.numpy().copy(), layer.running_var.numpy().copy(),
                        int(layer.num_batches_tracked))}


def torch_sync_rank(group, kinds):
    return {kind: torch_sync_one(group, kind) for kind in kinds}


def torch_sync_one(group, kind):
    import torch
    model = torch.nn.Sequential(getattr(torch.nn, LAYERS[kind])(SHAPES[kind][0], dtype=torch.float64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = ferro.convert_sync_batchnorm(model, group=group)
    layer = model[0]
    assert type(layer).__name__ == "TorchSyncBatchNorm" and optimizer.param_groups[0]["params"][0] is layer.weight
    group.reset_stats()
    result = run_torch(layer, kind, group.rank)
    result["step_calls"] = {k: v["calls"] for k, v in group.stats().items()}
    x, _ = batch_data(kind, 0)
    mine = torch.from_numpy(x[OFFSETS[group.rank]:OFFSETS[group.rank + 1]].copy())
    group.reset_stats()
    model.eval()
    result["eval_output"] = model(mine).detach().numpy()
    result["eval_stats"] = group.stats()
    return result


def test_torch_convert_sync_batchnorm_equals_batch_norm_on_the_whole_batch():
    torch = pytest.importorskip("torch")
    every = run_processes(torch_sync_rank, 3, args=(list(SHAPES),), backend="tcp", timeout=120)
    for kind in SHAPES:  # 1d (N, C), 1d (N, C, L), 2d, 3d in one launch of 3 processes
        check_torch_kind(torch, kind, [r[kind] for r in every])


def check_torch_kind(torch, kind, results):
    reference = getattr(torch.nn, LAYERS[kind])(SHAPES[kind][0], dtype=torch.float64)
    want = run_torch(reference, kind, None)
    assert_matches(results, want)
    reference.eval()
    x, _ = batch_data(kind, 0)
    for rank, got in enumerate(results):
        assert got["step_calls"] == {"all_gather": STEPS, "allreduce": STEPS}
        assert got["eval_stats"] == {}
        with torch.no_grad():
            expected = reference(torch.from_numpy(x[OFFSETS[rank]:OFFSETS[rank + 1]].copy())).numpy()
        np.testing.assert_allclose(got["eval_output"], expected, rtol=0, atol=1e-12)


# --- refusals ---------------------------------------------------------------------------------------------------

def too_small(group):
    layer = ferro.SyncBatchNorm(2, group=group, dtype=np.float64)
    x = np.ones((1, 2)) if group.rank == 0 else np.ones((0, 2))
    with pytest.raises(ValueError, match="expected more than 1 value per channel when training, got 1"):
        layer(x)
    with pytest.raises(ValueError, match=r"expected 2 channels \(dimension 1\), got shape \(4, 3\)"):
        layer(np.ones((4, 3)))
    return True


def test_a_batch_of_one_value_over_the_group_is_refused_on_every_rank():
    assert run_threads(too_small, 2, timeout=60) == [True, True]


def test_convert_keeps_parameters_and_buffers_of_ferro_layers():
    model = nn.Sequential(nn.Linear(3, 4, dtype=np.float64), nn.BatchNorm1d(4, dtype=np.float64))
    weight, running = model._modules["1"].weight, model._modules["1"].running_mean
    converted = ferro.convert_sync_batchnorm(model)
    layer = converted._modules["1"]
    assert isinstance(layer, ferro.SyncBatchNorm) and layer.weight is weight and layer.running_mean is running
    assert list(converted.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                                            "1.running_var", "1.num_batches_tracked"]


# --- with DDP on the same group ---------------------------------------------------------------------------------

def _ddp_model(sync, group=None):
    rng = np.random.default_rng(5)
    norm = ferro.SyncBatchNorm(6, group=group, dtype=np.float64) if sync else nn.BatchNorm1d(6, dtype=np.float64)
    return nn.Sequential(nn.Linear(4, 6, rng=rng, dtype=np.float64), norm, nn.Tanh(),
                         nn.Linear(6, 2, rng=rng, dtype=np.float64))


def _ddp_data():
    rng = np.random.default_rng(6)
    return rng.standard_normal((int(OFFSETS[-1]), 4)), rng.standard_normal((int(OFFSETS[-1]), 2))


def ddp_rank(group):
    """DDP's bucket allreduces (async, tiny buckets) interleave with SyncBatchNorm's blocking allreduce."""
    net = ferro.DDP(_ddp_model(True, group), group=group, bucket_cap_mb=1e-5)
    x, dy = _ddp_data()
    rows = slice(OFFSETS[group.rank], OFFSETS[group.rank + 1])
    y = net(x[rows])
    net.backward(dy[rows])
    return y, {name: p.grad.copy() for name, p in net.module.named_parameters()}


def test_ddp_with_sync_batch_norm_on_one_group_equals_one_process():
    reference = _ddp_model(False)
    x, dy = _ddp_data()
    y_ref = reference(x)
    reference.backward(dy)
    results = run_processes(ddp_rank, 3, backend="tcp", timeout=120)
    for rank, (y, grads) in enumerate(results):
        np.testing.assert_allclose(y, y_ref[OFFSETS[rank]:OFFSETS[rank + 1]], rtol=0, atol=1e-12)
        for name, p in reference.named_parameters():
            # DDP averages over 3 ranks; the whole batch's gradient is the sum of the ranks' parts.
            np.testing.assert_allclose(grads[name] * 3, p.grad, rtol=0, atol=1e-12, err_msg=name)


def _torch_ddp_model(torch):
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 2)).double()


def torch_ddp_rank(group):
    import torch
    model = ferro.convert_sync_batchnorm(_torch_ddp_model(torch), group=group)
    net = ferro.DDP(model, group=group, bucket_cap_mb=1e-5)
    x, dy = (torch.from_numpy(a) for a in _ddp_data())
    rows = slice(int(OFFSETS[group.rank]), int(OFFSETS[group.rank + 1]))
    y = net(x[rows])
    y.backward(dy[rows])
    return y.detach().numpy(), {name: p.grad.numpy().copy() for name, p in model.named_parameters()}


def test_torch_ddp_with_converted_sync_batch_norm_equals_one_process():
    torch = pytest.importorskip("torch")
    reference = _torch_ddp_model(torch)
    x, dy = (torch.from_numpy(a) for a in _ddp_data())
    y_ref = reference(x)
    y_ref.backward(dy)
    for rank, (y, grads) in enumerate(run_processes(torch_ddp_rank, 3, backend="tcp", timeout=120)):
        np.testing.assert_allclose(y, y_ref.detach().numpy()[OFFSETS[rank]:OFFSETS[rank + 1]], rtol=0, atol=1e-12)
        for name, p in reference.named_parameters():
            np.testing.assert_allclose(grads[name] * 3, p.grad.numpy(), rtol=0, atol=1e-12, err_msg=name)
