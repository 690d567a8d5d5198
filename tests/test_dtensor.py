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
        if len({p.reduce_op for p in source + target if isinstance(p, Partial)}) > 1:
            continue  # Partials of different ops on one tensor have no single reference value
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
