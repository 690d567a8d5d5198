"""ferro as a torch.distributed backend: torch's DDP, fully_shard and every collective over "ferro" vs "gloo".

Each rank joins the default group with ``init_process_group("ferro")`` (through
torch's own store, as under torchrun) and makes a gloo group beside it, so both
run on the same inputs in the same processes.
"""

import datetime
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from ferro.testing import RankExit, run_processes  # noqa: E402

STEPS = 3
BATCH = 12  # divisible by 2 and 3: every rank's share is equal, so the mean of means is the mean

# gloo's objects live until the rank's process exits. torch 2.13 can deadlock destroying a gloo group (or the DDP
# reducer holding one) with the GIL held: ~ProcessGroupGloo joins its worker thread, which may still be dropping a
# finished work and waits for the GIL to release the work's Python state (seen here as a rank stuck in teardown).
_KEEP_ALIVE = []


def _init(timeout=60):
    import ferro.interop.torch  # noqa: F401 - registers "ferro"

    dist.init_process_group("ferro", timeout=datetime.timedelta(seconds=timeout))
    gloo = dist.new_group(backend="gloo")
    _KEEP_ALIVE.append(gloo)
    return gloo


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 3)).to(dtype)


def _batches(dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, 6, generator=g, dtype=dtype), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _train(model, rank, world_size, dtype=torch.float64):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(dtype):
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _params(model):
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy() for p in model.parameters()]


def _reference(dtype=torch.float64):
    model = _model(dtype)
    _train(model, 0, 1, dtype)
    return _params(model)


def rank_ddp(rank, world_size):
    gloo = _init()
    results = {}
    for name, group in (("ferro", None), ("gloo", gloo)):
        # Tiny buckets: several allreduces per step, issued while backward goes on.
        ddp = torch.nn.parallel.DistributedDataParallel(_model(), process_group=group, bucket_cap_mb=0.001)
        _KEEP_ALIVE.append(ddp)
        _train(ddp, rank, world_size)
        results[name] = _params(ddp.module)
    results["backend"] = repr(dist.distributed_c10d._get_default_group())
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize("world_size, transport", [(2, "shm"), (3, "tcp"), (3, "hierarchical")])
def test_torch_ddp_over_ferro_trains_as_over_gloo_and_as_one_process(world_size, transport):
    results = run_processes(rank_ddp, world_size, backend=None, timeout=120, env={"FERRO_BACKEND": transport})
    reference = _reference()
    for result in results:
        assert {"shm": "ShmBackend", "tcp": "TcpBackend", "hierarchical": "HierarchicalBackend"}[transport] \
            in result["backend"]
        for ours, gloos, single in zip(result["ferro"], result["gloo"], reference, strict=True):
            np.testing.assert_allclose(ours, gloos, rtol=0, atol=1e-12)
            np.testing.assert_allclose(ours, single, rtol=0, atol=1e-12)
        for ours, first in zip(result["ferro"], results[0]["ferro"], strict=True):
            np.testing.assert_array_equal(ours, first)  # every rank holds the same bits


def rank_fsdp(rank, world_size, dtype_name, divide_factor):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    dtype = getattr(torch, dtype_name)
    gloo = _init()
    results = {}
    for name, group in (("ferro", dist.group.WORLD), ("gloo", gloo)):
        model = _model(dtype)
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _KEEP_ALIVE.append(model)
        if divide_factor:
            model.set_gradient_divide_factor(float(world_size))  # reduce-scatters with PREMUL_SUM(1/world)
        _train(model, rank, world_size, dtype)
        results[name] = _params(model)
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize("dtype_name, divide_factor", [("float64", False), ("float32", True)],
                         ids=["float64", "float32_premul_sum"])
def test_fully_shard_over_ferro_trains_as_over_gloo_and_as_one_process(dtype_name, divide_factor):
    results = run_processes(rank_fsdp, 2, args=(dtype_name, divide_factor), backend=None, timeout=150)
    reference = _reference(getattr(torch, dtype_name))
    tolerance = 1e-12 if dtype_name == "float64" else 1e-5
    for result in results:
        for ours, gloos, single in zip(result["ferro"], result["gloo"], reference, strict=True):
            np.testing.assert_array_equal(ours, gloos)
            np.testing.assert_allclose(ours, single, rtol=0, atol=tolerance)


def _ints(rank, n, dtype=torch.float64, base=1):
    # Small integers: every sum is exact in any order, so ferro and gloo must agree bit for bit.
    return (torch.arange(n, dtype=torch.float64) % 7 + base + 3 * rank).to(dtype)


def rank_collectives(rank, world_size):
    gloo = _init()
    me, n = rank, world_size
    found = {}

    def both(name, fn, skip_gloo=False):
        found[name] = {"ferro": fn(None)}
        if not skip_gloo:
            found[name]["gloo"] = fn(gloo)

    def all_reduce(op, dtype=torch.float64):
        def run(group):
            t = _ints(me, 10, dtype)
            dist.all_reduce(t, op=op, group=group)
            return t.numpy().copy()
        return run

    for op in ("SUM", "PRODUCT", "MIN", "MAX"):
        both(f"all_reduce_{op}", all_reduce(getattr(dist.ReduceOp, op)))
    for op in ("BAND", "BOR", "BXOR"):
        both(f"all_reduce_{op}", all_reduce(getattr(dist.ReduceOp, op), torch.int64))
    both("all_reduce_AVG", all_reduce(dist.ReduceOp.AVG), skip_gloo=True)  # gloo has no AVG
    found["all_reduce_AVG"]["expected"] = np.mean([_ints(r, 10).numpy() for r in range(n)], axis=0)
    both("all_reduce_PREMUL_SUM", all_reduce(dist._make_nccl_premul_sum(0.5)), skip_gloo=True)
    found["all_reduce_PREMUL_SUM"]["expected"] = sum(_ints(r, 10).numpy() * 0.5 for r in range(n))

    def all_reduce_async_future(group):
        t = _ints(me, 1000)
        work = dist.all_reduce(t, group=group, async_op=True)
        value = work.get_future().wait()
        work.wait()
        return np.concatenate([value[0].numpy(), t.numpy()])
    both("all_reduce_async_future", all_reduce_async_future)

    def all_reduce_coalesced(group):
        ts = [_ints(me, 5), _ints(me, 3, base=2)]
        with dist._coalescing_manager(group=group):
            for t in ts:
                dist.all_reduce(t, group=group)
        return np.concatenate([t.numpy() for t in ts])
    both("all_reduce_coalesced", all_reduce_coalesced)

    def broadcast(group):
        t = _ints(me, 7)
        dist.broadcast(t, src=n - 1, group=group)
        return t.numpy().copy()
    both("broadcast", broadcast)

    def all_gather(group):
        outs = [torch.zeros(4, dtype=torch.float64) for _ in range(n)]
        dist.all_gather(outs, _ints(me, 4), group=group)
        return torch.cat(outs).numpy()
    both("all_gather", all_gather)

    def all_gather_into_tensor(group):
        out = torch.zeros(2 * n, 3, dtype=torch.float64)
        dist.all_gather_single(out, _ints(me, 6).view(2, 3), group=group)
        return out.numpy()
    both("all_gather_into_tensor", all_gather_into_tensor)

    def all_gather_into_tensor_coalesced(group):
        outs = [torch.zeros(n * 4, dtype=torch.float64), torch.zeros(n * 2, dtype=torch.float64)]
        with dist._coalescing_manager(group=group):
            dist.all_gather_single(outs[0], _ints(me, 4), group=group)
            dist.all_gather_single(outs[1], _ints(me, 2, base=5), group=group)
        return torch.cat(outs).numpy()
    both("all_gather_into_tensor_coalesced", all_gather_into_tensor_coalesced)

    def reduce_scatter(group):
        out = torch.zeros(3, dtype=torch.float64)
        dist.reduce_scatter(out, [_ints(me, 3, base=b) for b in range(n)], group=group)
        return out.numpy()
    both("reduce_scatter", reduce_scatter)

    def reduce_scatter_tensor(group):
        out = torch.zeros(5, dtype=torch.float64)
        dist.reduce_scatter_single(out, _ints(me, 5 * n), op=dist.ReduceOp.MAX, group=group)
        return out.numpy()
    both("reduce_scatter_tensor", reduce_scatter_tensor)

    def reduce_scatter_tensor_coalesced(group):
        outs = [torch.zeros(2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)]
        with dist._coalescing_manager(group=group):
            dist.reduce_scatter_single(outs[0], _ints(me, 2 * n), group=group)
            dist.reduce_scatter_single(outs[1], _ints(me, 3 * n, base=4), group=group)
        return torch.cat(outs).numpy()
    both("reduce_scatter_tensor_coalesced", reduce_scatter_tensor_coalesced)

    def reduce_scatter_premul(group):
        out = torch.zeros(4, dtype=torch.float64)
        dist.reduce_scatter_single(out, _ints(me, 4 * n), op=dist._make_nccl_premul_sum(0.25), group=group)
        return out.numpy()
    both("reduce_scatter_PREMUL_SUM", reduce_scatter_premul, skip_gloo=True)
    found["reduce_scatter_PREMUL_SUM"]["expected"] = sum(_ints(r, 4 * n).numpy() * 0.25
                                                         for r in range(n))[4 * me:4 * me + 4]

    def all_to_all_single(group):
        out = torch.zeros(2 * n, 3, dtype=torch.float64)
        dist.all_to_all_single(out, _ints(me, 6 * n).view(2 * n, 3), group=group)
        return out.numpy()
    both("all_to_all_single", all_to_all_single)

    def all_to_all_single_uneven(group):
        sends = [(me + j) % 3 + 1 for j in range(n)]  # rank me sends (me + j) % 3 + 1 rows to rank j
        recvs = [(j + me) % 3 + 1 for j in range(n)]
        out = torch.zeros(sum(recvs), 2, dtype=torch.int32)
        source = _ints(me, 2 * sum(sends), torch.int32).view(-1, 2)
        dist.all_to_all_single(out, source, recvs, sends, group=group)
        return out.numpy()
    both("all_to_all_single_uneven", all_to_all_single_uneven)

    def all_to_all(group):
        inputs = [_ints(me, 2, base=10 * j) for j in range(n)]  # gloo takes equal sizes only
        outputs = [torch.zeros(2, dtype=torch.float64) for _ in range(n)]
        dist.all_to_all(outputs, inputs, group=group)
        return torch.cat(outputs).numpy()
    both("all_to_all", all_to_all)

    def reduce(group):
        t = _ints(me, 6)
        dist.reduce(t, dst=1, op=dist.ReduceOp.SUM, group=group)
        return t.numpy() if me == 1 else np.zeros(0)
    both("reduce", reduce)

    def gather(group):
        outs = [torch.zeros(3, dtype=torch.float64) for _ in range(n)] if me == 0 else None
        dist.gather(_ints(me, 3), outs, dst=0, group=group)
        return torch.cat(outs).numpy() if me == 0 else np.zeros(0)
    both("gather", gather)

    def scatter(group):
        out = torch.zeros(4, dtype=torch.float64)
        dist.scatter(out, [_ints(j, 4, base=20) for j in range(n)] if me == n - 1 else None, src=n - 1, group=group)
        return out.numpy()
    both("scatter", scatter)

    def barrier(group):
        dist.barrier(group=group)
        return np.zeros(0)
    both("barrier", barrier)

    def send_recv(group):
        # A ring: each rank sends to the next, receives from the one before, tags 3 and 4.
        nxt, prev = (me + 1) % n, (me - 1) % n
        out = [torch.zeros(5, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
        works = [dist.isend(_ints(me, 5), nxt, group=group, tag=3), dist.isend(_ints(me, 2, base=9), nxt,
                                                                                 group=group, tag=4)]
        dist.recv(out[0], prev, group=group, tag=3)
        dist.irecv(out[1], prev, group=group, tag=4).wait()
        for work in works:
            work.wait()
        return torch.cat(out).numpy()
    both("send_recv", send_recv)

    def batch_isend_irecv_receives_first(group):
        # Every rank posts its receive before its send, as pipeline code does: nothing may wait on anything.
        nxt, prev = (me + 1) % n, (me - 1) % n
        out = torch.zeros(4, dtype=torch.float64)
        ops = [dist.P2POp(dist.irecv, out, prev, group=group), dist.P2POp(dist.isend, _ints(me, 4), nxt, group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return out.numpy()
    both("batch_isend_irecv_receives_first", batch_isend_irecv_receives_first)

    def all_gather_object(group):
        found = [None] * n
        dist.all_gather_object(found, {"rank": me, "name": "x" * me}, group=group)
        return np.array([len(f["name"]) + 10 * f["rank"] for f in found])
    both("all_gather_object", all_gather_object)

    dist.destroy_process_group()
    return found


def test_every_collective_matches_gloo_on_the_same_inputs():
    results = run_processes(rank_collectives, 3, backend=None, timeout=120, env={"FERRO_BACKEND": "tcp"})
    names = set(results[0])
    assert len(names) == 29
    for rank, found in enumerate(results):
        for name, got in found.items():
            want = got.get("gloo", got.get("expected"))
            assert got["ferro"].shape == np.shape(want), (rank, name)
            np.testing.assert_array_equal(got["ferro"], want, err_msg=f"rank {rank}: {name}")
    # The async call's future holds the reduced tensor itself.
    value, tensor = np.split(results[0]["all_reduce_async_future"]["ferro"], 2)
    np.testing.assert_array_equal(value, tensor)


def rank_new_group(rank, world_size):
    _init()
    sub = dist.new_group([0, 2], backend="ferro")
    t = torch.full((3,), float(rank + 1), dtype=torch.float64)
    if rank in (0, 2):
        dist.all_reduce(t, group=sub)
    name = sub.name() if rank in (0, 2) else ""
    dist.destroy_process_group()
    return t.tolist(), name


def test_new_group_with_backend_ferro_reduces_among_its_members():
    results = run_processes(rank_new_group, 3, backend=None, timeout=90, env={"FERRO_BACKEND": "tcp"})
    assert results == [([4.0] * 3, "ferro"), ([2.0] * 3, ""), ([4.0] * 3, "ferro")]


def rank_mismatch(rank, world_size):
    _init(timeout=20)
    t = torch.ones(4 + rank, dtype=torch.float64)  # rank 1 reduces five elements, rank 0 four
    try:
        dist.all_reduce(t)
    except Exception as exc:
        return type(exc).__name__, str(exc), isinstance(exc, RuntimeError)
    return None


def test_ranks_that_call_different_things_both_get_a_mismatch_error():
    results = run_processes(rank_mismatch, 2, backend=None, timeout=90, env={"FERRO_BACKEND": "tcp"})
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} reduced mismatched tensors without an error"
        name, message, is_runtime_error = result
        assert name == "CollectiveMismatchError" and is_runtime_error, result
        assert "allreduce" in message and "rank" in message, message


def rank_peer_death(rank, world_size):
    _init(timeout=60)
    t = torch.ones(1 << 16, dtype=torch.float64)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        dist.all_reduce(t)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start, isinstance(exc, ConnectionError)
    return None


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_dead_peer_fails_the_next_call_promptly_naming_it(transport):
    survivor = _survivor_of_rank_1_exiting(rank_peer_death, transport)
    name, message, seconds, is_connection_error = survivor
    assert name == "PeerLostError" and is_connection_error, survivor
    assert "rank 1" in message, message
    assert seconds < 30, f"took {seconds:.1f} s to notice a dead peer (the group timeout is 60 s)"


def _survivor_of_rank_1_exiting(rank_fn, transport):
    """Run ``rank_fn`` on 2 ranks, rank 1 exiting with code 3; return rank 0's result."""
    results = run_processes(rank_fn, 2, backend=None, timeout=120, allow_exit=[1], env={"FERRO_BACKEND": transport})
    assert results[1] == RankExit(3, None)
    return results[0]


def _ddp_until_a_peer_goes(rank):
    """Train DDP until it raises; rank 1 exits inside its third backward, while rank 0's goes on.

    (A frozen rank under torch DDP, with $FERRO_TIMEOUT and no timeout=, is test_launch's: ferro run names it.)
    """
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets per backward
    _KEEP_ALIVE.append(ddp)
    steps = {"done": 0}

    def leave(grad):
        if rank == 1 and steps["done"] == 2:
            os._exit(3)
        return grad

    model[0].weight.register_hook(leave)  # the first layer's gradient comes last: some buckets are already out
    x = torch.randn(BATCH, 6, dtype=torch.float64)
    start = None
    try:
        while True:
            start = time.monotonic()
            ddp(x).square().sum().backward()
            steps["done"] += 1
    except Exception as exc:
        return steps["done"], type(exc).__name__, str(exc), time.monotonic() - start
    return None


def rank_ddp_peer_death(rank, world_size):
    _init(timeout=60)
    return _ddp_until_a_peer_goes(rank)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_peer_dying_mid_backward_raises_on_the_survivor_naming_it(transport):
    # torch's Future.set_exception completes the C++ future successfully, holding the exception as its value; DDP's
    # reducer then read tensors out of it and the survivor segfaulted. The survivor must raise instead.
    survivor = _survivor_of_rank_1_exiting(rank_ddp_peer_death, transport)
    steps, name, message, seconds = survivor
    assert steps == 2, survivor
    assert name == "RuntimeError" and "PeerLostError" in message and "rank 1" in message, survivor
    assert seconds < 30, f"took {seconds:.1f} s to notice a dead peer (the group timeout is 60 s)"


def test_the_torch_group_timeout_is_torch_s_when_given_else_ferro_timeout(monkeypatch):
    from torch.distributed.constants import default_pg_timeout

    from ferro.errors import ConfigurationError
    from ferro.interop.torch import group_timeout

    monkeypatch.delenv("FERRO_TIMEOUT", raising=False)
    assert group_timeout(default_pg_timeout) == default_pg_timeout.total_seconds()  # as gloo would wait
    assert group_timeout(datetime.timedelta(seconds=7)) == 7.0
    monkeypatch.setenv("FERRO_TIMEOUT", "12.5")
    assert group_timeout(default_pg_timeout) == 12.5
    assert group_timeout(datetime.timedelta(seconds=7)) == 7.0  # what the user gave torch wins
    monkeypatch.setenv("FERRO_TIMEOUT", "soon")
    with pytest.raises(ConfigurationError, match="FERRO_TIMEOUT"):
        group_timeout(default_pg_timeout)


def rank_any_source(rank, world_size):
    gloo = _init()
    seen = {}
    for name, group in (("ferro", None), ("gloo", gloo)):
        if rank == 0:
            senders = []
            for receive in ("recv", "irecv", "recv", "irecv"):
                t = torch.full((5,), -1.0)
                if receive == "recv":
                    sender = dist.recv(t, group=group)
                else:
                    work = dist.irecv(t, group=group)
                    work.wait()
                    sender = work._source_rank()
                senders.append((sender, t.tolist()))
            seen[name] = sorted(senders)
        else:
            for step in range(2):
                dist.send(torch.full((5,), float(rank * 10 + step)), 0, group=group)
        dist.barrier(group=group)
    return seen


def test_receives_from_any_source_match_gloo():
    results = run_processes(rank_any_source, 3, backend=None, timeout=120, env={"FERRO_BACKEND": "tcp"})
    expected = sorted((rank, [float(rank * 10 + step)] * 5) for rank in (1, 2) for step in range(2))
    assert results[0]["ferro"] == results[0]["gloo"] == expected


def rank_sparse_allreduce(rank, world_size):
    gloo = _init()
    sums = {}
    for name, group in (("ferro", None), ("gloo", gloo)):
        # Overlapping and distinct entries, a different count on each rank.
        indices = torch.tensor([[0, rank, 3, rank + 1], [1, 2, rank, 0]])[:, :2 + rank]
        values = torch.arange(2 + rank, dtype=torch.float64) + 10 * rank
        t = torch.sparse_coo_tensor(indices, values, (4, 4))
        dist.all_reduce(t, group=group)
        sums[name] = t.to_dense().tolist()
    expected = sum(torch.sparse_coo_tensor(torch.tensor([[0, r, 3, r + 1], [1, 2, r, 0]])[:, :2 + r],
                                           torch.arange(2 + r, dtype=torch.float64) + 10 * r, (4, 4)).to_dense()
                   for r in range(world_size))
    return sums, expected.tolist()


def test_sparse_tensors_allreduce_as_over_gloo():
    for sums, expected in run_processes(rank_sparse_allreduce, 3, backend=None, timeout=120,
                                        env={"FERRO_BACKEND": "tcp"}):
        assert sums["ferro"] == sums["gloo"] == expected


def rank_monitored_barrier(rank, world_size):
    _init()
    group = dist.distributed_c10d._get_default_group()
    group.monitored_barrier(datetime.timedelta(seconds=10))  # everyone arrives
    said = {}
    if rank == 0:  # the others stay away this time
        for wait_all in (False, True):
            try:
                group.monitored_barrier(datetime.timedelta(seconds=0.5), wait_all_ranks=wait_all)
            except RuntimeError as exc:
                said[wait_all] = str(exc)
    dist.barrier()
    if rank == 1:  # rank 0 stays away: rank 1 is told it arrived and rank 0 did not answer
        try:
            group.monitored_barrier(datetime.timedelta(seconds=0.5))
        except RuntimeError as exc:
            said["waiting"] = str(exc)
    dist.barrier()
    return said


def test_monitored_barrier_names_the_ranks_that_did_not_arrive_in_gloo_s_words():
    results = run_processes(rank_monitored_barrier, 3, backend=None, timeout=120, env={"FERRO_BACKEND": "tcp"})
    assert results[0][False].startswith("[Rank 0]: Rank 1 failed to pass monitoredBarrier in 500 ms"), results[0]
    assert results[0][True].startswith("[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 500 ms"), results[0]
    assert results[1]["waiting"].startswith("Rank 1 successfully reached monitoredBarrier, but received errors "
                                            "while waiting for send/recv from rank 0"), results[1]


def rank_bad_input(rank, world_size):
    _init()
    errors = {}
    for name, call in (
            ("not_contiguous", lambda: dist.all_reduce(torch.ones(4, 4, dtype=torch.float64).t())),
            ("avg_of_ints", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int64), op=dist.ReduceOp.AVG)),
            ("gather_size", lambda: dist.all_gather_single(torch.zeros(3), torch.ones(2)))):
        try:
            call()
            errors[name] = None
        except Exception as exc:
            errors[name] = (type(exc).__name__, str(exc))
    # A receive whose tag differs from the message's is refused, and the message waits for the right one.
    if rank == 0:
        dist.send(torch.full((3,), 7.0), 1, tag=1)
    else:
        got = torch.zeros(3)
        try:
            dist.recv(got, 0, tag=2)
            errors["wrong_tag"] = None
        except Exception as exc:
            errors["wrong_tag"] = (type(exc).__name__, str(exc))
        dist.recv(got, 0, tag=1)
        errors["right_tag"] = got.tolist()
    # After refused calls the group still works: nothing was sent.
    t = torch.ones(2, dtype=torch.float64)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return errors, t.tolist()


def test_bad_input_is_refused_at_the_call_and_the_group_goes_on():
    results = run_processes(rank_bad_input, 2, backend=None, timeout=90, env={"FERRO_BACKEND": "tcp"})
    for errors, after in results:
        assert errors["not_contiguous"][0] == "InvalidBufferError" and "contiguous" in errors["not_contiguous"][1]
        assert errors["avg_of_ints"][0] == "InvalidBufferError" and "MEAN" in errors["avg_of_ints"][1]
        assert errors["gather_size"][0] == "InvalidBufferError" and "world size" in errors["gather_size"][1]
        assert after == [2.0, 2.0]
    errors = results[1][0]
    assert errors["wrong_tag"][0] == "CollectiveMismatchError" and "point-to-point" in errors["wrong_tag"][1], errors
    assert errors["right_tag"] == [7.0] * 3


def rank_without_secret(rank, world_size):
    os.environ.pop("FERRO_SECRET")
    try:
        _init(timeout=10)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def test_a_rank_without_the_job_secret_is_told_what_to_set():
    results = run_processes(rank_without_secret, 2, backend=None, timeout=90, env={"FERRO_BACKEND": "tcp"})
    for result in results:
        assert result is not None and "FERRO_SECRET" in result[1], result


def test_importing_ferro_interop_imports_no_torch(tmp_path):
    import subprocess
    import sys

    import ferro

    # The ferro this test imported (the installed one under .ci/run), not a source tree in the working directory.
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(ferro.__file__))}
    code = "import sys, ferro, ferro.interop; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


NO_FERRO_IMPORT = """
import os, sys
import torch, torch.distributed as dist

imported_at_torch_import = sorted(m for m in sys.modules if m == "ferro" or m.startswith("ferro."))
dist.init_process_group("ferro", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=int(os.environ['RANK']),
                        world_size=2)
t = torch.arange(4, dtype=torch.float64) * (int(os.environ["RANK"]) + 1)
dist.all_reduce(t)
print(imported_at_torch_import, dist.get_backend(), t.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_ferro_is_a_torch_backend_by_name_in_a_process_that_never_imports_it(tmp_path):
    # torch calls the "torch.backends" entry points as it is imported (as Ray Train's workers do), and ferro's
    # registers "ferro" without importing ferro itself: `import torch` stays as cheap as it was.
    import subprocess
    import sys

    from ferro.rendezvous.settings import free_port

    script = tmp_path / "plain_torch.py"
    script.write_text(NO_FERRO_IMPORT)
    env = {**os.environ, "PORT": str(free_port()), "FERRO_SECRET": "a shared secret", "FERRO_BACKEND": "tcp"}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(rank)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, err
        assert out.strip() == "[] ferro [0.0, 3.0, 6.0, 9.0]", (out, err)
