"""DTensor: every redistribution against NumPy (bit-exact), with the collective it used counted by group.stats().

Data are integer-valued floats, so the terms of a Partial reduce exactly in any order and every comparison
is bit-exact. Shapes are chosen not to divide by the mesh sizes (empty shards included).
"""

import itertools

import numpy as np
import pytest

import ferro
from ferro.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, plan_redistribute
from ferro.dtensor.layout import local_box
from ferro.testing import run_processes, run_threads
from ferro.types import ReduceOp

ONE_D = [Shard(0), Shard(1), Replicate(), Partial(), Partial("max"), Partial("avg")]
TWO_D = [Shard(0), Shard(1), Replicate(), Partial()]

# What the issue asks of a 1-d mesh: the one collective each change uses (None: local).
EXPECTED_1D = {
    ("Shard", "Replicate"): "all_gather", ("Partial", "Replicate"): "allreduce",
    ("Partial", "Shard"): "reduce_scatter", ("Shard", "Shard"): "all_to_all_single_uneven",
    ("Replicate", "Shard"): None, ("Replicate", "Partial"): None,
}


def _piece(full, placements, mesh_shape, coordinate):
    box = local_box(full.shape, placements, mesh_shape, coordinate)
    return full[tuple(slice(o, o + n) for o, n in box)]


def _terms(value, placements, mesh_shape, coordinate, seed):
    """This coordinate's term of ``value`` under the Partial mesh dimensions: random integers that reduce to it."""
    partial_dims = [m for m, p in enumerate(placements) if isinstance(p, Partial)]
    if not partial_dims:
        return value.copy()
    others = tuple(c for m, c in enumerate(coordinate) if m not in partial_dims)
    rng = np.random.default_rng([seed, *others])  # the same on every rank that shares this piece
    cells = list(itertools.product(*(range(mesh_shape[m]) for m in partial_dims)))
    op = placements[partial_dims[0]].reduce_op
    assert all(placements[m].reduce_op is op for m in partial_dims), "one op per test case"
    if op is ReduceOp.MAX:
        terms = {cell: value - rng.integers(0, 5, value.shape) for cell in cells}
        terms[cells[int(rng.integers(len(cells)))]] = value.copy()
    else:
        scale = len(cells) if op is ReduceOp.MEAN else 1
        terms = {cell: rng.integers(-50, 50, value.shape).astype(value.dtype) for cell in cells[:-1]}
        terms[cells[-1]] = value * scale - sum(terms.values(), np.zeros_like(value))
    return terms[tuple(coordinate[m] for m in partial_dims)]


def _groups(mesh):
    return [mesh.get_group(m) for m in range(mesh.ndim)]


def run_matrix(group, mesh_shape, shape, choices, as_torch=False, seed=0):
    """Every (source, target) pair of placement tuples; returns a list of failures (empty = all exact)."""
    mesh = ferro.init_device_mesh(mesh_shape, group=group)
    coordinate = mesh.get_coordinate()
    full = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) * 3 - 7
    failures = []
    tuples = list(itertools.product(choices, repeat=len(mesh_shape)))
    for case, (source, target) in enumerate(itertools.product(tuples, tuples)):
        if any(len({p.reduce_op for p in side if isinstance(p, Partial)}) > 1 for side in (source, target)):
            continue  # Partials of different ops on one tensor: the value depends on the order of reductions
        local = _terms(_piece(full, source, mesh_shape, coordinate), source, mesh_shape, coordinate, seed + case)
        if as_torch:
            import torch
            local = torch.from_numpy(local)
        x = DTensor.from_local(local, mesh, source, shape=shape)
        for g in _groups(mesh):
            g.reset_stats()
        y = x.redistribute(target, timeout=30)
        # What ran, per mesh dimension's group, against the plan.
        calls = [{name: entry["calls"] for name, entry in g.stats().items()} for g in _groups(mesh)]
        expected = [dict() for _ in mesh_shape]
        for step in plan_redistribute(x.placements, y.placements):
            if step.collective is not None:
                counts = expected[step.mesh_dim]
                counts[step.collective] = counts.get(step.collective, 0) + 1
        if len({id(g) for g in _groups(mesh)}) == 1:  # a 1-d mesh: one group
            expected = [expected[0]]
            calls = calls[:1]
        if calls != expected:
            failures.append(f"{source}->{target}: ran {calls}, planned {expected}")
        got = y.to_local()
        got = got.numpy() if as_torch else got
        if type(y.to_local()) is not type(local):
            failures.append(f"{source}->{target}: local became {type(y.to_local()).__name__}")
        if any(isinstance(p, Partial) for p in target):
            got = y.full_tensor(timeout=30)
            got = got.numpy() if as_torch else got
            want = full
        else:
            want = _piece(full, target, mesh_shape, coordinate)
        if got.shape != want.shape or not np.array_equal(got, want):
            failures.append(f"{source}->{target}: wrong values (shape {got.shape}, want {want.shape})")
        # The source is left as it was.
        before = x.to_local().numpy() if as_torch else x.to_local()
        if not np.array_equal(before, local.numpy() if as_torch else local):
            failures.append(f"{source}->{target}: the source DTensor changed")
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_redistribute_matrix_1d_simulated(world):
    results = run_threads(run_matrix, world, args=((world,), (7, 5), ONE_D), timeout=120)
    assert results[0] == [] and all(r == [] for r in results)


def test_redistribute_matrix_2x2_simulated():
    results = run_threads(run_matrix, 4, args=((2, 2), (5, 3), TWO_D), timeout=240)
    assert all(r == [] for r in results), results[0][:5]


def test_redistribute_matrix_torch_tensors():
    pytest.importorskip("torch")
    results = run_threads(run_matrix, 3, args=((3,), (7, 5), ONE_D, True), timeout=120)
    assert all(r == [] for r in results), results[0][:5]


def test_redistribute_matrix_over_tcp_processes():
    results = run_processes(run_matrix, 3, args=((3,), (7, 5), ONE_D), backend="tcp", timeout=240)
    assert all(r == [] for r in results), results[0][:5]


def test_redistribute_matrix_2x2_over_shm_processes():
    results = run_processes(run_matrix, 4, args=((2, 2), (5, 3), TWO_D), backend="shm", timeout=300)
    assert all(r == [] for r in results), results[0][:5]


@pytest.mark.parametrize(("source", "target", "collective"), [
    ((Shard(0),), (Replicate(),), "all_gather"), ((Partial(),), (Replicate(),), "allreduce"),
    ((Partial(),), (Shard(1),), "reduce_scatter"), ((Shard(0),), (Shard(1),), "all_to_all_single_uneven"),
    ((Shard(1),), (Shard(0),), "all_to_all_single_uneven"), ((Replicate(),), (Shard(0),), None),
    ((Replicate(),), (Partial(),), None), ((Partial("max"),), (Replicate(),), "allreduce"),
])
def test_a_1d_change_is_one_collective(source, target, collective):
    steps = plan_redistribute(source, target)
    assert [s.collective for s in steps] == [collective]
    assert EXPECTED_1D[(type(source[0]).__name__, type(target[0]).__name__)] == collective


def test_chunks_follow_torch_chunk():
    torch = pytest.importorskip("torch")
    for n, k in [(5, 4), (7, 3), (6, 4), (0, 3), (2, 5), (9, 2)]:
        chunks = [c.shape[0] for c in torch.arange(n).chunk(k)]
        chunks += [0] * (k - len(chunks))
        ours = [local_box((n,), (Shard(0),), (k,), (i,))[0][1] for i in range(k)]
        assert ours == chunks, (n, k)


# --- a tensor-parallel MLP -------------------------------------------------------------------------------------

def _mlp_data():
    rng = np.random.default_rng(7)
    return {"x": rng.standard_normal((6, 5)), "t": rng.standard_normal((6, 3)),
            "w1": rng.standard_normal((5, 7)), "b1": rng.standard_normal(7),
            "w2": rng.standard_normal((7, 3)), "b2": rng.standard_normal(3)}


def _mlp_reference(d):
    pre = d["x"] @ d["w1"] + d["b1"]
    h = pre * (pre > 0)
    y = h @ d["w2"] + d["b2"]
    dy = y - d["t"]
    dpre = (dy @ d["w2"].T) * (pre > 0)
    return {"y": y, "loss": 0.5 * (dy ** 2).sum(), "w2": h.T @ dy, "b2": dy.sum(0), "w1": d["x"].T @ dpre,
            "b1": dpre.sum(0), "x": dpre @ d["w1"].T}


def tensor_parallel_mlp(group, as_torch):
    """Column-wise W1 (Shard(1)), row-wise W2 (Shard(0)): forward and a hand-written backward in DTensor ops."""
    d = _mlp_data()
    if as_torch:
        import torch
        d = {k: torch.from_numpy(v) for k, v in d.items()}
    mesh = ferro.init_device_mesh((group.world_size,), group=group)
    x, t, b2 = (distribute_tensor(d[k], mesh, [Replicate()]) for k in ("x", "t", "b2"))
    w1, b1 = distribute_tensor(d["w1"], mesh, [Shard(1)]), distribute_tensor(d["b1"], mesh, [Shard(0)])
    w2 = distribute_tensor(d["w2"], mesh, [Shard(0)])
    group.reset_stats()
    pre = x @ w1 + b1                                        # Shard(1): each rank its hidden units
    mask = pre > 0
    h = pre * mask
    partial = h @ w2                                         # Partial(sum)
    y = partial.redistribute([Replicate()]) + b2             # the forward's one allreduce
    dy = y - t
    loss = (dy * dy).sum() * 0.5                             # Replicate: every rank has it
    grads = {"w2": h.T @ dy, "b2": dy.sum(0)}                # Shard(0) like w2; Replicate
    dpre = (dy @ w2.T) * mask                                # Shard(1)
    grads.update(w1=x.T @ dpre, b1=dpre.sum(0))              # Shard(1) like w1; Shard(0) like b1
    grads["x"] = (dpre @ w1.T).redistribute([Replicate()])   # the backward's one allreduce
    stats = {name: entry["calls"] for name, entry in group.stats().items()}
    placements = {k: g.placements for k, g in grads.items()}
    full = {k: np.asarray(g.full_tensor()) for k, g in grads.items()}
    full.update(y=np.asarray(y.to_local()), loss=float(np.asarray(loss.to_local())))
    return {"partial": partial.placements, "stats": stats, "placements": placements, "values": full}


@pytest.mark.parametrize("as_torch", [False, True])
def test_tensor_parallel_mlp_equals_one_process(as_torch):
    if as_torch:
        pytest.importorskip("torch")
    want = _mlp_reference(_mlp_data())
    results = run_processes(tensor_parallel_mlp, 2, args=(as_torch,), backend="tcp", timeout=120)
    for r in results:
        assert r["partial"] == (Partial(),)
        assert r["stats"] == {"allreduce": 2}, r["stats"]  # nothing but the two allreduces moved
        assert r["placements"] == {"w2": (Shard(0),), "b2": (Replicate(),), "w1": (Shard(1),), "b1": (Shard(0),),
                                   "x": (Replicate(),)}
        for name, value in want.items():
            np.testing.assert_allclose(r["values"][name], value, rtol=0, atol=1e-12, err_msg=name)


# --- rules and refusals ----------------------------------------------------------------------------------------

def rules_and_refusals(group):
    mesh = ferro.init_device_mesh((group.world_size,), group=group)
    full = np.arange(12.0).reshape(4, 3)
    s0, s1 = distribute_tensor(full, mesh, [Shard(0)]), distribute_tensor(full, mesh, [Shard(1)])
    p = distribute_tensor(full, mesh, [Partial()])
    seen = {}
    seen["sum0"] = (s0.sum(0).placements, s0.sum(0).full_tensor().tolist())
    seen["sum1"] = (s0.sum(1).placements, s0.sum(1).full_tensor().tolist())
    seen["mean"] = s1.mean().full_tensor().tolist()
    seen["scaled"] = (p * 2 - p).full_tensor().tolist()
    seen["ufunc"] = (np.exp(s1).placements, np.allclose(np.exp(s1).full_tensor(), np.exp(full)))
    for name, call in {"mixed": lambda: s0 + s1, "partial_mul": lambda: p * p, "partial_ufunc": lambda: np.exp(p),
                       "plain_array": lambda: s0 + full, "matmul_rule": lambda: s0 @ s0.T.T.T,
                       "attribute": lambda: s0.reshape}.items():
        try:
            call()
            seen[name] = None
        except Exception as exc:  # noqa: BLE001 - the test records which error
            seen[name] = f"{type(exc).__name__}: {exc}"
    local = np.zeros((3 if group.rank == 0 else 1, 3))  # 4 rows split 2 + 2: rank 0's 3 rows are wrong
    try:
        DTensor.from_local(local, mesh, [Shard(0)], timeout=30)
        seen["from_local"] = None
    except ferro.SizeMismatchError as exc:
        seen["from_local"] = str(exc)
    return seen


def test_rules_and_refusals():
    for seen in run_threads(rules_and_refusals, 2, timeout=60):
        full = np.arange(12.0).reshape(4, 3)
        assert seen["sum0"] == ((Partial(),), full.sum(0).tolist())
        assert seen["sum1"] == ((Shard(0),), full.sum(1).tolist())
        assert seen["mean"] == full.mean()
        assert seen["scaled"] == full.tolist()
        assert seen["ufunc"] == ((Shard(1),), True)
        assert seen["mixed"].startswith("NotImplementedError: DTensor: add of DTensors placed [Shard(0)] and "
                                        "[Shard(1)]")
        assert "multiply on a Partial (Partial(sum)) DTensor" in seen["partial_mul"]
        assert "exp on a Partial" in seen["partial_ufunc"]
        assert seen["plain_array"].startswith("TypeError: DTensor: add of a DTensor and a ndarray")
        assert "no rule for Shard(0) @ Shard(1) on mesh dimension 0" in seen["matmul_rule"]
        assert seen["attribute"].startswith("AttributeError: DTensor: 'reshape' is not supported")
        # Every rank reports the rank whose piece is wrong, not only that rank.
        assert ("rank 0 (mesh coordinate (0,)) holds a piece of shape (3, 3), but the pieces make a (4, 3) tensor "
                "placed [Shard(0)], whose piece there has shape (2, 3)") in seen["from_local"]


def overlapping_entries(group):
    from ferro.parallel.fsdp import ShardedEntry
    start, stop = [(0, 3), (2, 6)][group.rank]
    entry = ShardedEntry(np.zeros(stop - start), (2, 3), start, stop)
    with pytest.raises(ValueError, match=r"w: rank 1 holds \[2, 6\) but the ranges must tile the 6 elements"):
        ferro.dtensor.from_sharded_entries({"w": entry, "step": 3}, group, timeout=30)
    start, stop = [(0, 4), (4, 6)][group.rank]
    made = ferro.dtensor.from_sharded_entries(
        {"w": ShardedEntry(np.arange(start, stop, dtype=np.float64), (2, 3), start, stop), "step": 3}, group)
    return made["step"], made["w"].placements, made["w"].to_local().tolist()


def test_flat_ranges_become_row_shards_and_bad_ranges_are_refused():
    results = run_threads(overlapping_entries, 2, timeout=60)
    assert results == [(3, (Shard(0),), [[0.0, 1.0, 2.0]]), (3, (Shard(0),), [[3.0, 4.0, 5.0]])]


# --- autograd through DTensor programs (torch pieces that require grad) --------------------------------------

def autograd_mlp(group):
    """The same tensor-parallel MLP, differentiated by torch's autograd through the DTensor ops."""
    import torch
    d = {k: torch.from_numpy(v) for k, v in _mlp_data().items()}
    mesh = ferro.init_device_mesh((group.world_size,), group=group)
    leaves = {}

    def leaf(name, placement):
        piece = distribute_tensor(d[name], mesh, [placement]).to_local().clone().requires_grad_()
        leaves[name] = piece
        return DTensor.from_local(piece, mesh, [placement], shape=tuple(d[name].shape))

    x, w1, b1, w2, b2 = (leaf("x", Replicate()), leaf("w1", Shard(1)), leaf("b1", Shard(0)), leaf("w2", Shard(0)),
                         leaf("b2", Replicate()))
    t = distribute_tensor(d["t"], mesh, [Replicate()])
    group.reset_stats()
    pre = x @ w1 + b1
    h = pre * (pre > 0)
    y = (h @ w2).redistribute([Replicate()]) + b2
    loss = ((y - t) * (y - t)).sum() * 0.5
    forward = {k: v["calls"] for k, v in group.stats().items()}
    group.reset_stats()
    loss.to_local().backward()
    backward = {k: v["calls"] for k, v in group.stats().items()}
    grads = {}
    for name, placement in (("x", Replicate()), ("w1", Shard(1)), ("b1", Shard(0)), ("w2", Shard(0)),
                            ("b2", Replicate())):
        grad = DTensor.from_local(leaves[name].grad, mesh, [placement], shape=tuple(d[name].shape))
        grads[name] = grad.full_tensor().numpy()
    return {"forward": forward, "backward": backward, "grads": grads, "loss": float(loss.to_local().detach())}


def test_autograd_through_a_tensor_parallel_mlp_equals_one_process():
    pytest.importorskip("torch")
    want = _mlp_reference(_mlp_data())
    for r in run_processes(autograd_mlp, 2, backend="tcp", timeout=120):
        assert r["forward"] == {"allreduce": 1}          # the row-wise layer's Partial -> Replicate
        assert r["backward"] == {"allreduce": 1}         # x's gradient: each rank held its hidden units' share
        assert abs(r["loss"] - want["loss"]) <= 1e-12
        for name in ("x", "w1", "b1", "w2", "b2"):
            np.testing.assert_allclose(r["grads"][name], want[name], rtol=0, atol=1e-12, err_msg=name)


def autograd_redistributions(group):
    """d(sum of y * c)/dx for y = x redistributed: the gradient comes back placed like x, with value c."""
    import torch
    mesh = ferro.init_device_mesh((2, 2), group=group)
    full = torch.arange(35.0, dtype=torch.float64).reshape(5, 7)
    weights = torch.arange(35.0, dtype=torch.float64).reshape(5, 7) * 0.5 - 3
    failures = []
    for source, target in itertools.product(itertools.product(TWO_D, repeat=2), repeat=2):
        local = distribute_tensor(full, mesh, source).to_local().clone().requires_grad_()
        x = DTensor.from_local(local, mesh, source, shape=(5, 7))
        y = x.redistribute(target)
        if any(isinstance(p, Partial) for p in target):
            loss, expected = y.sum(), torch.ones(5, 7, dtype=torch.float64)  # a Partial allows linear ops only
        else:
            loss, expected = (y * distribute_tensor(weights, mesh, target)).sum(), weights
        loss.redistribute([Replicate(), Replicate()]).to_local().backward()
        grad_placements = tuple(Replicate() if isinstance(p, Partial) else p for p in source)
        got = DTensor.from_local(local.grad, mesh, grad_placements, shape=(5, 7)).full_tensor()
        if not torch.equal(got, expected):
            failures.append(f"{source}->{target}")
    return failures


def test_every_2x2_redistribution_is_differentiable():
    pytest.importorskip("torch")
    assert run_threads(autograd_redistributions, 4, timeout=240) == [[], [], [], []]
