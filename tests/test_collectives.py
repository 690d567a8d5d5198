"""Collectives against NumPy on TCP processes and simulated ranks; failures, async, input checks."""

import os
import signal

import numpy as np
import pytest

import ferro
from ferro.testing import RankExit, run_processes
from ferro.testing.conformance import check_collectives

MB = 1024 * 1024


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_conformance_against_numpy(run, world_size):
    reports = run(check_collectives, world_size, timeout=240)
    failures = [line for report in reports for line in report.failures]
    assert reports[0].cases > 1500
    assert failures == []
    # Results are identical on every rank, bit for bit.
    assert len({report.digest for report in reports}) == 1


def rank_large_collectives(group):
    n, r = group.world_size, group.rank
    count = 64 * MB // 4
    x = np.arange(count, dtype=np.float32) % 1000 + r
    ferro.allreduce(x, group=group)
    expected = (np.arange(count, dtype=np.float32) % 1000) * n + n * (n - 1) / 2
    ok_allreduce = bool(np.array_equal(x, expected))
    y = np.full(count, r, np.float32) if r == 0 else np.empty(count, np.float32)
    ferro.broadcast(y, root=0, group=group)
    part = ferro.reduce_scatter(np.ones(count, np.float32), group=group)
    gathered = ferro.all_gather(np.full(count // n, r, np.float32), group=group)
    return (ok_allreduce, bool((y == 0).all()), bool((part == n).all()) and part.size == count // n,
            bool(np.array_equal(gathered, np.repeat(np.arange(n, dtype=np.float32), count // n))))


@pytest.mark.slow
def test_64_mb_collectives(run):
    assert run(rank_large_collectives, 2, timeout=240) == [(True, True, True, True)] * 2


def rank_async_interleaved(group):
    r, n = group.rank, group.world_size
    arrays = [np.full(1000 * (i + 1), r + i, np.float64) for i in range(6)]
    handles = [ferro.allreduce(a, group=group, async_op=True) for a in arrays[:3]]
    sync = np.full(10, r, np.int64)
    ferro.allreduce(sync, op=ferro.ReduceOp.MAX, group=group)  # waits behind the three in flight
    handles.append(ferro.async_all_gather(np.array([r]), group=group))
    handles.append(ferro.async_reduce_scatter(np.arange(2 * n, dtype=np.float32), group=group))
    handles += [ferro.allreduce(a, group=group, async_op=True) for a in arrays[3:]]
    results = [h.wait(timeout=60) for h in handles]
    sums = [float(a[0]) for a in arrays]
    expected = [n * i + n * (n - 1) / 2 for i in range(6)]
    return (sums == expected, all(h.is_completed() for h in handles), int(sync[0]), results[3].tolist(),
            results[4].tolist())


def test_async_collectives_interleaved_with_sync(run):
    for r, (sums_ok, completed, sync_max, gathered, part) in enumerate(run(rank_async_interleaved, 3)):
        assert sums_ok and completed
        assert sync_max == 2 and gathered == [0, 1, 2]
        assert part == [3.0 * (2 * r), 3.0 * (2 * r + 1)]


def rank_mismatched_calls(group, kind):
    x = np.ones(8, np.float32)
    try:
        if kind == "collective":
            if group.rank == 0:
                ferro.allreduce(x, group=group, timeout=20)
            else:
                ferro.broadcast(x, root=0, group=group, timeout=20)
        elif kind == "size":
            ferro.allreduce(np.ones(8 + group.rank, np.float32), group=group, timeout=20)
        else:
            ferro.allreduce(np.ones(8, np.float32 if group.rank == 0 else np.float64), group=group, timeout=20)
        first = "no error"
    except ferro.CollectiveMismatchError as exc:
        first = str(exc)
    try:
        ferro.allreduce(x, group=group, timeout=20)
        after = "usable"
    except ferro.ConnectionBrokenError as exc:
        after = "broken" if "earlier failed collective" in str(exc) else str(exc)
    return first, after


@pytest.mark.parametrize("kind, words", [("collective", ["allreduce(float32", "broadcast(float32"]),
                                         ("size", ["8 elements", "9 elements"]),
                                         ("dtype", ["allreduce(float32", "allreduce(float64"])])
def test_mismatched_calls_raise_on_every_rank_naming_both(run, kind, words):
    results = run(rank_mismatched_calls, 2, args=(kind,))
    for first, after in results:
        assert after == "broken"
        assert "rank" in first
    detector_messages = " ".join(first for first, _ in results)
    for word in words:
        assert word in detector_messages


def rank_killed_mid_collective(group):
    r = group.rank
    x = np.ones(4 * MB // 4, np.float32)
    ferro.allreduce(x.copy(), group=group)
    if r == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(100):
            ferro.allreduce(x, group=group, timeout=60)
        return "finished"
    except ferro.PeerLostError as exc:
        return "PeerLostError", exc.peer


def test_rank_killed_mid_collective_makes_every_other_rank_raise_peer_lost():
    results = run_processes(rank_killed_mid_collective, 4, allow_exit={2}, timeout=90)
    assert results[2] == RankExit(None, "SIGKILL")
    # Its ring neighbours see rank 2 go; rank 0 learns it from their notices, or sees a
    # neighbour that already gave up and closed -- a peer-lost error either way, never a hang.
    assert results[1] == ("PeerLostError", 2) and results[3] == ("PeerLostError", 2), results
    assert results[0][0] == "PeerLostError", results


def rank_input_checks(group):
    seen = []
    frozen = np.zeros(4)
    frozen.flags.writeable = False
    calls = [
        lambda: ferro.allreduce(np.zeros(8)[::2], group=group),
        lambda: ferro.allreduce(frozen, group=group),
        lambda: ferro.allreduce(np.zeros(4, np.int32), op=ferro.ReduceOp.MEAN, group=group),
        lambda: ferro.allreduce(np.zeros(4), op=ferro.ReduceOp.BXOR, group=group),
        lambda: ferro.allreduce(np.zeros(4, bool), group=group),
        lambda: ferro.broadcast(np.zeros(4), root=group.world_size, group=group),
        lambda: ferro.reduce(np.zeros(4), dst=-1, group=group),
        lambda: ferro.all_to_all(np.zeros(group.world_size + 1), group=group),
        lambda: ferro.reduce_scatter(np.float32(1.0) * np.ones(()), group=group),
        lambda: ferro.all_to_all_single_uneven(np.zeros(3), [1] * group.world_size, [1] * group.world_size,
                                               group=group),
        lambda: ferro.all_gather(np.zeros(2), out=np.zeros(3), group=group),
        lambda: ferro.allreduce([1.0, 2.0], group=group),
        lambda: ferro.allreduce(np.zeros(2)),
    ]
    for call in calls:
        try:
            call()
            seen.append("accepted")
        except (ValueError, TypeError) as exc:
            seen.append(type(exc).__name__)
    ferro.barrier(group=group)  # nothing above communicated: the group is still in step
    return seen


def test_input_checks_raise_specific_errors_before_communicating(run):
    expected = ["InvalidBufferError", "InvalidBufferError", "InvalidBufferError", "InvalidBufferError",
                "InvalidBufferError", "InvalidRankError", "InvalidRankError", "InvalidBufferError",
                "InvalidBufferError", "ValueError", "SizeMismatchError", "InvalidBufferError", "ConfigurationError"]
    assert run(rank_input_checks, 2) == [expected, expected]


def rank_world_of_one(group):
    x = np.arange(4.0)
    gathered = ferro.all_gather(x, group=group)
    part = ferro.reduce_scatter(x, group=group)
    ferro.allreduce(x, op=ferro.ReduceOp.MEAN, group=group)
    return (x.tolist(), gathered.tolist(), np.shares_memory(gathered, x), np.shares_memory(part, x),
            ferro.all_gather_object("solo", group=group))


def test_world_size_one_needs_no_peers_and_never_aliases(run):
    assert run(rank_world_of_one, 1) == [([0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0], False, False, ["solo"])]


def rank_torch_tensors(group):
    import torch

    r = group.rank
    x = torch.arange(6, dtype=torch.float32) + r
    ferro.allreduce(x, group=group)
    b = (torch.arange(4, dtype=torch.bfloat16) + r) / 2
    ferro.allreduce(b, op=ferro.ReduceOp.MAX, group=group)
    gathered = ferro.all_gather(torch.tensor([r], dtype=torch.int64), group=group)
    part = ferro.reduce_scatter(torch.ones(4, dtype=torch.bfloat16), group=group)
    mine = ferro.scatter([torch.full((2,), float(k)) for k in range(group.world_size)] if r == 0 else None,
                         group=group)
    return (x.tolist(), b.float().tolist(), type(gathered).__name__, gathered.tolist(), part.dtype == torch.bfloat16,
            part.float().tolist(), type(mine).__name__, mine.tolist())


def test_torch_tensors_in_and_out(run):
    results = run(rank_torch_tensors, 2)
    for r, (x, b, gtype, gathered, is_bf16, part, mtype, mine) in enumerate(results):
        assert x == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
        assert b == [0.5, 1.0, 1.5, 2.0]
        assert gtype == "Tensor" and gathered == [0, 1]
        assert is_bf16 and part == [2.0, 2.0]
        assert mtype == "Tensor" and mine == [float(r)] * 2


def rank_objects(group):
    config = ferro.broadcast_object({"lr": 0.1, "tags": ["a"]} if group.rank == 0 else None, group=group)
    everything = ferro.all_gather_object({"rank": group.rank, "blob": "x" * (100 * group.rank)}, group=group)
    return config, [e["rank"] for e in everything], [len(e["blob"]) for e in everything]


def test_object_collectives(run):
    for config, ranks, sizes in run(rank_objects, 3):
        assert config == {"lr": 0.1, "tags": ["a"]}
        assert ranks == [0, 1, 2] and sizes == [0, 100, 200]


def rank_subgroup_collectives(group):
    evens = ferro.new_group([0, 2], group=group)
    odds = ferro.new_group([1, 3], group=group)
    mine = evens if group.rank % 2 == 0 else odds
    x = np.array([float(group.rank)])
    ferro.allreduce(x, group=mine)
    world = np.array([1.0])
    ferro.allreduce(world, group=group)
    return float(x[0]), float(world[0])


def test_collectives_on_subgroups(run):
    assert run(rank_subgroup_collectives, 4) == [(2.0, 4.0), (4.0, 4.0), (2.0, 4.0), (4.0, 4.0)]


def rank_chained_broadcast(group, nbytes, root):
    data = (np.arange(nbytes // 8, dtype=np.float64) * 1.5) if group.rank == root else np.zeros(nbytes // 8)
    ferro.broadcast(data, root=root, group=group)
    return bool(np.array_equal(data, np.arange(nbytes // 8, dtype=np.float64) * 1.5))


@pytest.mark.parametrize("world_size, root", [(3, 1), (4, 3)])
def test_large_broadcast_pipelined_over_a_chain(run, world_size, root):
    # 3.5 MB: several 1 MiB segments flow down the chain, and the last one is partial.
    assert run(rank_chained_broadcast, world_size, args=(3_500_000, root)) == [True] * world_size


def rank_tagged(group):
    x = np.arange(4.0) + group.rank
    same = ferro.all_gather(x, group=group, tag=7)
    part = ferro.reduce_scatter(np.ones(4), group=group, tag=9)
    try:
        ferro.all_gather(x, group=group, tag=group.rank)  # equal shapes, different tags
    except ferro.CollectiveMismatchError as exc:
        return same.tolist(), part.tolist(), str(exc)
    return same.tolist(), part.tolist(), None


def test_tags_must_match(run):
    results = run(rank_tagged, 2)
    for same, part, error in results:
        assert same == [0.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0] and part == [2.0, 2.0]
        assert error is not None and "tag 1" in error, error


def test_tag_out_of_range_is_refused():
    group = ferro.SimulatedBackend.create_group(1)[0]
    for bad in (-1, 1024, 1.5, True):
        with pytest.raises(ValueError, match=r"tag must be an int in \[0, 1023\]"):
            ferro.all_gather(np.ones(2), group=group, tag=bad)


def rank_outputs_given(group):
    n, r = group.world_size, group.rank
    x = np.arange(3.0 * n) + 10 * r
    part = np.full(3, -1.0)
    returned = ferro.reduce_scatter(x, out=part, group=group)
    exchanged = np.full(3 * n, -1.0)
    same = ferro.all_to_all(x, out=exchanged, group=group)
    sends = [j + 1 for j in range(n)]  # rank r sends j + 1 rows to rank j
    uneven = np.full(n * (r + 1), -1.0)
    rows = np.arange(float(sum(sends))) + 100 * r
    ferro.all_to_all_single_uneven(rows, sends, [r + 1] * n, out=uneven, group=group)
    refused = []
    for call in (lambda: ferro.all_to_all(x, out=x, group=group),
                 lambda: ferro.reduce_scatter(x, out=np.zeros(4), group=group),
                 lambda: ferro.all_to_all(x, out=np.zeros(3 * n, np.float32), group=group)):
        try:
            call()
            refused.append("accepted")
        except ValueError as exc:
            refused.append(type(exc).__name__)
    ferro.barrier(group=group)
    return part.tolist(), returned is part, exchanged.tolist(), same is exchanged, uneven.tolist(), refused


def test_results_land_in_the_outputs_given(run):
    n = 3
    results = run(rank_outputs_given, n)
    inputs = [np.arange(3.0 * n) + 10 * r for r in range(n)]
    total = sum(inputs)
    for r, (part, is_part, exchanged, is_same, uneven, refused) in enumerate(results):
        assert part == total[3 * r:3 * r + 3].tolist() and is_part
        assert exchanged == np.concatenate([inputs[s][3 * r:3 * r + 3] for s in range(n)]).tolist() and is_same
        starts = [sum(j + 1 for j in range(r)) for _ in range(n)]  # where rank r's block starts in every sender's rows
        assert uneven == np.concatenate([np.arange(starts[s], starts[s] + r + 1) + 100.0 * s
                                         for s in range(n)]).tolist()
        assert refused == ["InvalidBufferError", "SizeMismatchError", "SizeMismatchError"]


def rank_done_callbacks(group):
    import threading

    seen, ran = [], threading.Event()
    pending = ferro.allreduce(np.ones(4), group=group, async_op=True)
    pending.add_done_callback(lambda p: seen.append(("first", p.wait(0).tolist())))
    pending.add_done_callback(lambda p: 1 / 0)  # logged; the next still runs
    pending.add_done_callback(lambda p: (seen.append(("third", p.is_completed())), ran.set()))
    pending.wait()
    late = []
    pending.add_done_callback(lambda p: late.append(p.is_completed()))  # runs at once, on this thread
    assert ran.wait(10)  # on the worker, just after wait() returned
    return seen, late


def test_done_callbacks_run_in_order_once_the_call_completes(run):
    for seen, late in run(rank_done_callbacks, 2):
        assert seen == [("first", [2.0] * 4), ("third", True)]
        assert late == [True]


def rank_callback_waits_on_a_later_call(group):
    import threading

    chained, done = [], threading.Event()

    def issue_and_wait(_):
        # A later call of the same group, issued and waited for inside the first one's callback
        # (torch's PowerSGD chains its futures so): another thread must serve the group meanwhile.
        chained.append(ferro.allreduce(np.full(3, 2.0), group=group, async_op=True).wait(20).tolist())
        done.set()

    first = ferro.allreduce(np.ones(3), group=group, async_op=True)
    first.add_done_callback(issue_and_wait)
    first.wait(20)
    assert done.wait(20)
    after = ferro.allreduce(np.ones(1), group=group, async_op=True).wait(20).tolist()  # the group goes on
    return chained, after


def test_a_done_callback_may_issue_and_wait_on_a_later_call_of_its_group(run):
    for chained, after in run(rank_callback_waits_on_a_later_call, 2):
        assert chained == [[4.0] * 3]
        assert after == [2.0]
