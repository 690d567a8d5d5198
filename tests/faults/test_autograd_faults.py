"""Collectives writing into tensors autograd needs: they must behave as torch's own in-place operations (issue 11)."""

import pytest
import torch

import ferro
from ferro.errors import InvalidBufferError
from ferro.testing import run_processes, run_threads


def _allreduce_into_a_saved_tensor(group):
    a = torch.ones(3, dtype=torch.float64, requires_grad=True)
    t = a.exp()  # exp saves its output for backward
    ferro.allreduce(t, group=group)
    try:
        t.sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return f"no error; a.grad = {a.grad.tolist()}"


@pytest.mark.parametrize("harness", [run_threads, run_processes], ids=["simulated", "tcp"])
def test_a_collective_into_a_tensor_backward_needs_is_caught_by_autograd(harness):
    for message in harness(_allreduce_into_a_saved_tensor, 2):
        assert "modified by an inplace operation" in message, message


def _each_writer_bumps_the_version(group):
    seen = {}
    for name, call in {
        "allreduce": lambda t: ferro.allreduce(t, group=group),
        "broadcast": lambda t: ferro.broadcast(t, 0, group=group),
        "reduce": lambda t: ferro.reduce(t, 0, group=group),
        "recv_into": lambda t: ferro.send(torch.zeros(3, dtype=torch.float64), 1, group=group)
        if group.rank == 0 else ferro.recv_into(t, 0, group=group),
    }.items():
        t = torch.zeros(3, dtype=torch.float64)
        before = t._version
        call(t)
        seen[name] = t._version > before
    return seen


def test_every_call_that_writes_into_a_tensor_bumps_its_version():
    results = run_threads(_each_writer_bumps_the_version, 2)
    assert results[1] == {"allreduce": True, "broadcast": True, "reduce": True, "recv_into": True}
    assert results[0]["allreduce"] and results[0]["reduce"]  # the root of a broadcast and a sender write nothing


def _write_into_a_leaf(group):
    w = torch.full((3,), float(group.rank + 1), dtype=torch.float64, requires_grad=True)
    try:
        ferro.allreduce(w, group=group)
        refused = None
    except InvalidBufferError as exc:
        refused = str(exc)
    untouched = w.tolist()
    with torch.no_grad():  # as torch allows its own in-place ops on a leaf
        ferro.allreduce(w, group=group)
    return refused, untouched, w.tolist(), w.requires_grad


def test_a_leaf_that_requires_grad_is_refused_outside_no_grad():
    for rank, (refused, untouched, reduced, requires_grad) in enumerate(run_threads(_write_into_a_leaf, 2)):
        assert refused is not None and "leaf that requires grad" in refused and "torch.no_grad()" in refused
        assert untouched == [float(rank + 1)] * 3  # refused before anything moved
        assert reduced == [3.0, 3.0, 3.0]
        assert requires_grad


def _sparse(group):
    try:
        ferro.allreduce(torch.eye(3).to_sparse(), group=group)
    except InvalidBufferError as exc:
        return str(exc)
    return "accepted"


def test_a_sparse_tensor_is_called_sparse_not_non_contiguous():
    for message in run_threads(_sparse, 2):
        assert "sparse" in message and "to_dense()" in message and "contiguous" not in message
