"""DDP's compressing hooks: int8 with error feedback and PowerSGD, against NumPy references, under ferro.DDP and
torch DDP over "ferro"."""

import numpy as np
import pytest

import ferro
from ferro import nn
from ferro.parallel.comm_hooks import Int8CompressHook, PowerSGDHook, dequantize_int8, quantize_int8


def reference_quantize(row):
    """Symmetric int8 of one row, written out plainly: scale = max|x| / 127 in float32, q = rint(x / scale)."""
    scale = np.float32(np.max(np.abs(row)) / 127)
    if scale == 0:
        return np.zeros(row.shape, np.int8), scale
    return np.clip(np.rint(row / row.dtype.type(scale)), -127, 127).astype(np.int8), scale


def test_int8_round_trip_matches_numpy_and_loses_at_most_half_a_step():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 33)) * np.array([[1e-6], [1.0], [1e3], [0.0], [7.5]])
    q, scales = quantize_int8(x)
    for row, q_row, scale in zip(x, q, scales, strict=True):
        want_q, want_scale = reference_quantize(row)
        np.testing.assert_array_equal(q_row, want_q)
        assert scale == want_scale
    back = dequantize_int8(q, scales, np.float64)
    np.testing.assert_array_equal(back[3], 0)  # a zero row stays zero
    half_step = scales.astype(np.float64)[:, None] / 2
    assert np.all(np.abs(back - x) <= half_step * (1 + 1e-6))
    assert np.array_equal(np.abs(q).max(axis=1)[[0, 1, 2, 4]], [127] * 4)  # each row uses its full range


def test_int8_keeps_a_diverged_row_visible_as_nan():
    q, scales = quantize_int8(np.array([[1.0, np.inf], [1.0, 2.0]]))
    back = dequantize_int8(q, scales)
    assert np.isnan(back[0]).all() and np.isfinite(back[1]).all()


def reference_int8_average(per_rank, world_size, divisor=None):
    """The int8 hook's two exchanges without error feedback, on one process (the sum divided by ``divisor``)."""
    size = per_rank[0].size
    chunk = -(-size // world_size)
    padded = [np.concatenate([g, np.zeros(chunk * world_size - size, g.dtype)]).reshape(world_size, chunk)
              for g in per_rank]
    out = []
    for owner in range(world_size):
        received = [reference_round_trip(p[owner]) for p in padded]
        mean = np.sum(received, axis=0, dtype=padded[0].dtype) / padded[0].dtype.type(divisor or world_size)
        out.append(reference_round_trip(mean))
    return np.concatenate(out)[:size]


def reference_round_trip(row):
    q, scale = reference_quantize(row)
    return q.astype(row.dtype) * row.dtype.type(scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_int8_kernels_equal_numpy_bit_for_bit(dtype):
    """The hook's kernels: quantise with residual, dequantise-and-average, dequantise rows, against NumPy."""
    from ferro._core.reduce import dequantize_mean, dequantize_rows, quantize_rows

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((7, 301)) * np.array([[1e-6], [1.0], [1e3], [0.0], [7.5], [1e-300], [2.0]])).astype(dtype)
    x[4, 3], x[6, 0] = np.nan, -np.inf
    packed, residual = np.empty((7, 4 + 301), np.uint8), np.empty_like(x)
    quantize_rows(x, packed, residual)
    scales = packed[:, :4].copy().view(np.float32).reshape(-1)
    q = packed[:, 4:].view(np.int8)
    for row, (value, q_row, scale) in enumerate(zip(x, q, scales, strict=True)):
        if row in (4, 6):  # a NaN or an infinity: a NaN scale, zeros, and no residual carried on
            assert np.isnan(scale) and not q_row.any() and not residual[row].any()
            continue
        want_q, want_scale = reference_quantize(value)
        np.testing.assert_array_equal(q_row, want_q)
        assert scale == want_scale
        assert residual[row].tobytes() == (value - q_row.astype(dtype) * dtype(scale)).tobytes()
    assert scales[5] == 0 and residual[5].tobytes() == x[5].tobytes()  # underflowed scale: everything kept
    finite = np.delete(packed, [4, 6], axis=0)
    mean = np.empty(301, dtype)
    dequantize_mean(finite, mean, dtype(3))
    rows = [r[4:].view(np.int8).astype(dtype) * dtype(r[:4].copy().view(np.float32)[0]) for r in finite]
    assert mean.tobytes() == (np.sum(rows, axis=0, dtype=dtype) / dtype(3)).tobytes()
    flat = np.empty(5 * 301 - 10, dtype)
    dequantize_rows(finite, flat)
    assert flat.tobytes() == np.concatenate(rows)[:flat.size].tobytes()
    with pytest.raises(ValueError, match="packed rows"):
        quantize_rows(x, np.empty((7, 301), np.uint8))
    with pytest.raises(ValueError, match="cannot fill"):
        dequantize_rows(finite, np.empty(5 * 301 + 1, dtype))


def flat_gradient(rank, step, size, dtype):
    return (np.random.default_rng([rank, step]).standard_normal(size) * (1 + step)).astype(dtype)


def rank_int8_hook(group, dtype_name, steps, error_feedback):
    dtype = np.dtype(dtype_name)
    model = nn.Sequential(nn.Linear(7, 5, rng=np.random.default_rng(0), dtype=dtype))
    hook = Int8CompressHook(error_feedback=error_feedback)
    ddp = ferro.DDP(model, group=group, comm_hook=hook)
    (bucket,) = ddp.buckets
    results = []
    for step in range(steps):
        bucket.buffer[...] = flat_gradient(group.rank, step, bucket.buffer.size, dtype)
        ddp.sync_gradients()
        results.append(bucket.buffer.copy())
    return results


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_int8_hook_averages_as_the_numpy_reference_does(run, dtype_name):
    world_size = 3
    (first, *others) = run(rank_int8_hook, world_size, args=(dtype_name, 1, False))
    dtype = np.dtype(dtype_name)
    size = first[0].size
    per_rank = [flat_gradient(r, 0, size, dtype) for r in range(world_size)]
    np.testing.assert_allclose(first[0], reference_int8_average(per_rank, world_size), rtol=1e-6, atol=1e-7)
    for other in others:
        np.testing.assert_array_equal(other[0], first[0])  # every rank holds the same bits
    exact = np.mean(per_rank, axis=0)
    assert np.max(np.abs(first[0] - exact)) <= 2 * np.max(np.abs(per_rank)) / 127
    assert not np.allclose(first[0], exact, rtol=1e-9, atol=1e-12)  # it really was quantised


def rank_int8_hierarchical(rank, world_size):
    import os

    os.environ["FERRO_HOST_ID"] = f"declared-host-{0 if rank < 3 else 1}"  # hosts of 3 and 2 ranks
    group = ferro.init_process_group(timeout=60)
    try:
        return type(group).__name__, rank_int8_hook(group, "float64", 1, False)[0]
    finally:
        ferro.destroy_process_group()


def test_int8_on_a_hierarchical_group_sums_each_host_exactly_and_sends_int8_between_hosts():
    from ferro.testing import run_processes

    results = run_processes(rank_int8_hierarchical, 5, backend=None, timeout=120)
    size = results[0][1].size
    per_rank = [flat_gradient(r, 0, size, np.float64) for r in range(5)]
    per_host = [per_rank[0] + per_rank[1] + per_rank[2], per_rank[3] + per_rank[4]]
    want = reference_int8_average(per_host, 2, divisor=5)
    for backend, got in results:
        assert backend == "HierarchicalBackend"
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_int8_error_feedback_delays_the_rounding_loss_instead_of_losing_it(run):
    steps, world_size = 12, 2
    with_feedback = run(rank_int8_hook, world_size, args=("float64", steps, True))[0]
    without = run(rank_int8_hook, world_size, args=("float64", steps, False))[0]
    size = with_feedback[0].size
    exact = sum(np.mean([flat_gradient(r, s, size, np.float64) for r in range(world_size)], axis=0)
                for s in range(steps))
    drift_with = np.max(np.abs(np.sum(with_feedback, axis=0) - exact))
    drift_without = np.max(np.abs(np.sum(without, axis=0) - exact))
    # With feedback the summed updates miss only what the last step's two residuals hold (half a step each).
    last_scale = np.max(np.abs([flat_gradient(r, steps - 1, size, np.float64) for r in range(world_size)])) / 127
    assert drift_with <= 2.5 * last_scale
    assert drift_without > drift_with


def reference_powersgd(per_rank_matrices, q, rank):
    """One PowerSGD step from ``q`` on one process: P = sum M Q, orthonormalised; Q' = sum M^T P; P Q'^T / n."""
    n = len(per_rank_matrices)
    p = sum(m @ q for m in per_rank_matrices)
    p, _ = np.linalg.qr(p)  # the same column space; Gram-Schmidt's signs may differ, the product does not
    q_next = sum(m.T @ p for m in per_rank_matrices)
    return p @ q_next.T / n, q_next


def rank_powersgd(group, steps, rank_of_input, approximation_rank):
    model = nn.Sequential(nn.Linear(9, 6, rng=np.random.default_rng(0), dtype=np.float64))
    hook = PowerSGDHook(matrix_approximation_rank=approximation_rank, start_powerSGD_iter=1,
                        min_compression_rate=1.0, random_seed=5)
    ddp = ferro.DDP(model, group=group, comm_hook=hook)
    weight, bias = model._modules["0"].weight, model._modules["0"].bias
    out = []
    for step in range(steps):
        weight.grad[...] = low_rank_gradient(group.rank, step, rank_of_input)
        bias.grad[...] = np.random.default_rng([group.rank, step, 1]).standard_normal(6)
        ddp.sync_gradients()
        out.append((weight.grad.copy(), bias.grad.copy(), hook.error_dict[0].copy() if step else None))
    return out


def low_rank_gradient(rank, step, rank_of_input):
    rng = np.random.default_rng([rank, step, 0])
    if rank_of_input is None:
        return rng.standard_normal((6, 9))
    return rng.standard_normal((6, rank_of_input)) @ rng.standard_normal((rank_of_input, 9))


def test_powersgd_is_exact_where_the_average_has_the_approximation_s_rank(run):
    world_size = 3  # each rank's gradient has rank 1, so the average has rank <= 3
    results = run(rank_powersgd, world_size, args=(3, 1, 3))
    for step in range(3):
        want = np.mean([low_rank_gradient(r, step, 1) for r in range(world_size)], axis=0)
        want_bias = np.mean([np.random.default_rng([r, step, 1]).standard_normal(6) for r in range(world_size)],
                            axis=0)
        for weight, bias, _ in (result[step] for result in results):
            np.testing.assert_allclose(bias, want_bias, rtol=0, atol=1e-12)  # vectors are averaged exactly
            # The first step is a plain allreduce; after it, one power step is exact here.
            np.testing.assert_allclose(weight, want, rtol=0, atol=1e-12 if step == 0 else 1e-10)
        if step:
            # Each rank keeps its own input minus the average; nothing was missed, so they cancel.
            assert np.max(np.abs(np.sum([result[step][2] for result in results], axis=0))) < 1e-10


def test_powersgd_matches_a_numpy_power_iteration_with_warm_start_and_error_feedback(run):
    world_size, r = 2, 2
    results = run(rank_powersgd, world_size, args=(3, None, r))
    # The hook's first Q: the seeded generator's draw, orthonormalised (the same on every rank).
    q = np.random.default_rng(5).standard_normal((9, r))
    q, _ = np.linalg.qr(q)
    errors = [np.zeros((6, 9)) for _ in range(world_size)]
    bias_errors = [np.zeros(6) for _ in range(world_size)]
    for step in (1, 2):
        inputs = [low_rank_gradient(rank, step, None) + errors[rank] for rank in range(world_size)]
        want, q = reference_powersgd(inputs, q, r)
        errors = [m - want for m in inputs]
        bias_inputs = [np.random.default_rng([rank, step, 1]).standard_normal(6) + bias_errors[rank]
                       for rank in range(world_size)]
        bias_errors = [b - np.mean(bias_inputs, axis=0) for b in bias_inputs]  # exact average: error = own - mean
        for rank, result in enumerate(results):
            np.testing.assert_allclose(result[step][0], want, rtol=1e-9, atol=1e-10)
            # The bucket holds the bias first (buckets run in reverse definition order), then the weight.
            np.testing.assert_allclose(result[step][2], np.concatenate([bias_errors[rank], errors[rank].reshape(-1)]),
                                       rtol=1e-9, atol=1e-10)


def test_hook_options_are_checked():
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        PowerSGDHook(matrix_approximation_rank=0)
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        PowerSGDHook(start_powerSGD_iter=-1)


_KEEP_ALIVE = []  # torch 2.13 can deadlock destroying a gloo group mid-teardown (see test_torch_backend)


def rank_torch_ddp_hooks(rank, world_size):
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    import ferro.interop.torch as ferro_torch

    dist.init_process_group("ferro", timeout=datetime.timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    _KEEP_ALIVE.append(gloo)
    x = torch.from_numpy(np.random.default_rng([rank, 9]).standard_normal((4, 9)))

    def one_step(model):
        model.zero_grad()
        (model(x) ** 2).sum().backward()

    def linear():
        model = torch.nn.Linear(9, 6, bias=False).double()
        with torch.no_grad():
            model.weight.copy_(torch.from_numpy(np.random.default_rng(1).standard_normal((6, 9))))
        return model

    results = {}
    local = linear()
    one_step(local)
    results["local"] = local.weight.grad.numpy().copy()

    ddp = torch.nn.parallel.DistributedDataParallel(linear())
    _KEEP_ALIVE.append(ddp)
    ddp.register_comm_hook(None, ferro_torch.comm_hook(Int8CompressHook(error_feedback=False)))
    one_step(ddp)
    results["int8"] = ddp.module.weight.grad.numpy().copy()

    ddp = torch.nn.parallel.DistributedDataParallel(linear().float())
    _KEEP_ALIVE.append(ddp)
    # torch refuses its own bf16 hook without CUDA; ferro's reduces bfloat16 natively (gloo cannot reduce it at all).
    ddp.register_comm_hook(None, ferro_torch.comm_hook(ferro.parallel.bf16_compress_hook))
    x = x.float()
    one_step(ddp)
    results["bf16"] = ddp.module.weight.grad.numpy().copy()
    x = x.double()

    for name, group in (("ferro", None), ("gloo", gloo)):
        ddp = torch.nn.parallel.DistributedDataParallel(linear(), process_group=group)
        _KEEP_ALIVE.append(ddp)
        state = torch_powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                             random_seed=3)
        ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for _ in range(4):
            one_step(ddp)
            optimizer.step()
        results["torch_powersgd_" + name] = ddp.module.weight.detach().numpy().copy()
    dist.destroy_process_group()
    return results


def test_torch_ddp_over_ferro_runs_ferro_s_hooks_and_torch_s_own():
    pytest.importorskip("torch")
    from ferro.testing import run_processes

    world_size = 2
    results = run_processes(rank_torch_ddp_hooks, world_size, backend=None, timeout=120)
    per_rank = [result["local"] for result in results]
    want_int8 = reference_int8_average([g.reshape(-1) for g in per_rank], world_size).reshape(6, 9)
    exact = np.mean(per_rank, axis=0)
    for result in results:
        np.testing.assert_allclose(result["int8"], want_int8, rtol=0, atol=1e-12)
        # bfloat16 on the wire: 8 bits of mantissa.
        np.testing.assert_allclose(result["bf16"], exact, rtol=2e-2, atol=2e-2 * np.abs(exact).max())
        # torch's PowerSGD over ferro and over gloo: the same hook, the same seeds, the same result.
        np.testing.assert_allclose(result["torch_powersgd_ferro"], result["torch_powersgd_gloo"], rtol=0, atol=1e-12)
    assert not np.allclose(results[0]["int8"], exact, rtol=1e-9, atol=1e-12)
