"""ferro.nn: every backward against finite differences; optimizers against PyTorch's."""

import numpy as np
import pytest

from ferro import nn

EPS = 1e-6


def numeric_gradient(f, array):
    grad = np.zeros_like(array)
    for index in np.ndindex(array.shape):
        saved = array[index]
        array[index] = saved + EPS
        up = f()
        array[index] = saved - EPS
        down = f()
        array[index] = saved
        grad[index] = (up - down) / (2 * EPS)
    return grad


def check_module(model, x, loss_fn, target):
    """Analytic gradients of the loss w.r.t. every parameter and the input match finite differences."""
    def loss():
        return loss_fn(model(x), target)

    loss()
    model.zero_grad()
    grad_x = model.backward(loss_fn.backward())
    for name, param in model.named_parameters():
        np.testing.assert_allclose(param.grad, numeric_gradient(loss, param.data), rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(grad_x, numeric_gradient(loss, x), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("activation", [nn.ReLU, nn.Tanh])
def test_mlp_backward_matches_finite_differences(activation):
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(5, 7, rng=rng, dtype=np.float64), activation(),
                          nn.Linear(7, 3, rng=rng, dtype=np.float64))
    x = rng.standard_normal((4, 5))
    check_module(model, x, nn.CrossEntropyLoss(), np.array([0, 2, 1, 2]))
    check_module(model, x, nn.MSELoss(), rng.standard_normal((4, 3)))


@pytest.mark.parametrize(("layer", "shape"), [(nn.BatchNorm1d, (6, 3)), (nn.BatchNorm1d, (4, 3, 5)),
                                              (nn.BatchNorm2d, (3, 2, 3, 2)), (nn.BatchNorm3d, (2, 2, 2, 3, 2))])
def test_batch_norm_backward_matches_finite_differences(layer, shape):
    rng = np.random.default_rng(1)
    bn = layer(shape[1], dtype=np.float64)
    bn.weight.data[...] = rng.uniform(0.5, 1.5, shape[1])
    bn.bias.data[...] = rng.uniform(-1, 1, shape[1])
    model = nn.Sequential(bn, nn.Tanh())
    x = rng.standard_normal(shape) * 2 + 1
    target = rng.standard_normal(shape)
    check_module(model, x, _FlatMSE(), target)  # training: through the batch statistics
    model.eval()
    check_module(model, x, _FlatMSE(), target)  # evaluation: through the running statistics


class _FlatMSE(nn.MSELoss):
    """MSELoss over inputs of any shape."""

    def __call__(self, y, target):
        self._shape = y.shape
        return super().__call__(y.reshape(len(y), -1), target.reshape(len(target), -1))

    def backward(self):
        return super().backward().reshape(self._shape)


def test_linear_without_bias():
    rng = np.random.default_rng(1)
    layer = nn.Linear(3, 2, bias=False, rng=rng, dtype=np.float64)
    check_module(layer, rng.standard_normal((6, 3)), nn.MSELoss(), rng.standard_normal((6, 2)))
    assert [name for name, _ in layer.named_parameters()] == ["weight"]


def test_gradients_accumulate_until_zeroed_and_hooks_fire_when_ready():
    rng = np.random.default_rng(2)
    layer = nn.Linear(2, 2, rng=rng, dtype=np.float64)
    seen = []
    layer.weight.register_grad_ready_hook(lambda p: seen.append("weight"))
    remove = layer.bias.register_grad_ready_hook(lambda p: seen.append("bias"))
    x = rng.standard_normal((3, 2))
    layer(x)
    layer.backward(np.ones((3, 2)))
    first = layer.weight.grad.copy()
    layer(x)
    layer.backward(np.ones((3, 2)))
    np.testing.assert_allclose(layer.weight.grad, 2 * first)
    assert seen == ["bias", "weight", "bias", "weight"]  # reverse definition order, like autograd
    remove()
    layer.zero_grad()
    assert not layer.weight.grad.any()


def test_frozen_parameter_gets_no_gradient():
    layer = nn.Linear(2, 2, rng=np.random.default_rng(3))
    layer.bias.requires_grad = False
    layer(np.ones((1, 2), np.float32))
    layer.backward(np.ones((1, 2), np.float32))
    assert layer.bias.grad is None and layer.weight.grad is not None


def test_state_dict_round_trip_and_shape_check():
    a = nn.Sequential(nn.Linear(3, 4, rng=np.random.default_rng(4)), nn.ReLU(), nn.Linear(4, 2))
    b = nn.Sequential(nn.Linear(3, 4, rng=np.random.default_rng(5)), nn.ReLU(), nn.Linear(4, 2))
    weight_before = b._modules["0"].weight.data
    b.load_state_dict(a.state_dict())
    assert b._modules["0"].weight.data is weight_before  # updated in place
    for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        np.testing.assert_array_equal(p.data, q.data)
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict({**a.state_dict(), "0.weight": np.zeros((2, 2))})


@pytest.mark.parametrize("make", [
    lambda ps, torch: (nn.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
                       lambda tps: torch.optim.SGD(tps, lr=0.1, momentum=0.9, weight_decay=0.01)),
    lambda ps, torch: (nn.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
                       lambda tps: torch.optim.SGD(tps, lr=0.7, momentum=0.9, nesterov=True)),
    lambda ps, torch: (nn.Adam(ps, lr=0.01, weight_decay=0.01),
                       lambda tps: torch.optim.Adam(tps, lr=0.01, weight_decay=0.01)),
], ids=["sgd", "sgd_nesterov", "adam"])
def test_optimizers_match_torch(make):
    import torch

    rng = np.random.default_rng(6)
    start = rng.standard_normal((3, 4))
    grads = [rng.standard_normal((3, 4)) for _ in range(5)]
    param = nn.Parameter(start.copy())
    ours, theirs_factory = make([param], torch)
    tparam = torch.nn.Parameter(torch.from_numpy(start.copy()))
    theirs = theirs_factory([tparam])
    for g in grads:
        param.grad = g.copy()
        ours.step()
        tparam.grad = torch.from_numpy(g.copy())
        theirs.step()
    np.testing.assert_allclose(param.data, tparam.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_backward_before_forward_is_a_clear_error():
    with pytest.raises(RuntimeError, match="before forward"):
        nn.Linear(2, 2).backward(np.ones((1, 2)))


def mlp(seed=0):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(5, 7, rng=rng, dtype=np.float64), nn.Tanh(),
                         nn.Linear(7, 3, rng=rng, dtype=np.float64), nn.ReLU())


def test_split_backward_equals_backward():
    rng = np.random.default_rng(1)
    x, target = rng.standard_normal((6, 5)), rng.standard_normal((6, 3))
    whole, split = mlp(), mlp()
    criterion = nn.MSELoss()
    criterion(whole(x), target)
    grad_x = whole.backward(criterion.backward())
    criterion(split(x), target)
    split_x = split.backward_input(criterion.backward())
    assert all(p.grad is None for p in split.parameters())  # weights wait for backward_weight
    split.backward_weight()
    np.testing.assert_array_equal(split_x, grad_x)
    for (name, a), (_, b) in zip(whole.named_parameters(), split.named_parameters(), strict=True):
        np.testing.assert_array_equal(a.grad, b.grad, err_msg=name)
    assert split.splits_backward and nn.Tanh().splits_backward


def test_stashed_state_lets_several_forwards_be_in_flight():
    """Two forwards, then their backwards in the other order: each sees its own input (a pipeline's need)."""
    rng = np.random.default_rng(2)
    first_x, second_x = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    grad = rng.standard_normal((4, 3))
    model, reference = mlp(), mlp()
    model(first_x)
    first = model.stash_saved()
    model(second_x)
    second = model.stash_saved()
    model.restore_saved(second)
    model.backward(grad)
    model.restore_saved(first)
    model.backward(grad)
    for x in (first_x, second_x):
        reference(x)
        reference.backward(grad)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        np.testing.assert_allclose(a.grad, b.grad, rtol=1e-14)
    model.stash_saved()
    with pytest.raises(RuntimeError, match="before forward"):
        model.backward(grad)  # stashing takes the state away: nothing is left to use by mistake


def test_a_module_with_parameters_and_no_split_says_so():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.factor = nn.Parameter(np.ones(1))

    model = nn.Sequential(nn.Linear(2, 2), Scale())
    assert not model.splits_backward
    with pytest.raises(NotImplementedError, match="Scale has parameters and does not split its backward"):
        model.backward_input(np.ones((1, 2)))
