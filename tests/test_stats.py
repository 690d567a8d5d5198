"""group.stats(): calls and payload bytes per operation, counted where the bytes move, on every backend.

The expected byte counts follow from each algorithm: what a ring, recursive doubling,
a binomial tree or the shared-memory arena must move for the sizes used.
"""

import numpy as np

import ferro
from ferro.testing import run_processes


def _entry(calls, sent, received):
    return {"calls": calls, "bytes_sent": sent, "bytes_received": received}


def rank_schedule(group):
    # Two ranks: every backend's algorithms move the same bytes here (see the expectations below).
    group.reset_stats()
    x = np.ones(256, np.float32)  # 1 KiB
    ferro.allreduce(x, group=group)
    ferro.allreduce(x, ferro.ReduceOp.MEAN, group=group)
    ferro.all_gather(np.ones(64, np.float64), group=group)  # 512 bytes a rank
    ferro.broadcast(np.ones(32, np.float32), root=0, group=group)  # 128 bytes
    ferro.barrier(group=group)
    if group.rank == 0:
        ferro.send(np.arange(100.0), 1, group=group)  # a 256-byte description, then 800 bytes
        group.send(np.zeros(5), 1)  # 40 bytes
    else:
        ferro.recv(0, group=group)
        group.recv(np.empty(5), 0)
    stats = group.stats()
    group.reset_stats()
    return stats, group.stats()


def test_two_ranks_count_the_bytes_each_algorithm_moves(run):
    for rank, (stats, after_reset) in enumerate(run(rank_schedule, 2)):
        p2p_bytes = 256 + 800 + 40
        expected = {
            # Recursive doubling (TCP, simulated) or the one-phase arena (shm): 1 KiB out, 1 KiB in, per call.
            "allreduce": _entry(2, 2048, 2048),
            # Ring, or the arena: this rank's 512 bytes out, the other's in.
            "all_gather": _entry(1, 512, 512),
            "broadcast": _entry(1, 128 if rank == 0 else 0, 0 if rank == 0 else 128),
            "barrier": _entry(1, 0, 0),
            "p2p": _entry(2, p2p_bytes if rank == 0 else 0, 0 if rank == 0 else p2p_bytes),
        }
        assert stats == expected, (rank, stats)
        assert after_reset == {}


def rank_ring_on_four(group):
    group.reset_stats()
    ferro.allreduce(np.ones(1024, np.float32), group=group, algorithm="ring")  # 4 KiB
    ferro.allreduce(np.ones(256, np.float32), group=group, algorithm="recursive_doubling")  # 1 KiB
    parts = ferro.reduce_scatter(np.ones(400, np.float32), group=group)  # 100 floats a part
    assert parts.shape == (100,)
    return group.stats()


def test_tcp_counts_follow_the_ring_and_recursive_doubling_on_four_ranks():
    for stats in run_processes(rank_ring_on_four, 4):
        # Ring allreduce: 2 (n-1)/n of 4 KiB each way; recursive doubling: log2(4) whole messages.
        assert stats["allreduce"] == _entry(2, 6144 + 2048, 6144 + 2048)
        # Ring reduce-scatter: (n-1) parts of 400 bytes each way.
        assert stats["reduce_scatter"] == _entry(1, 1200, 1200)


def rank_arena_on_four(group):
    group.reset_stats()
    ferro.allreduce(np.ones(256, np.float32), group=group)  # the one-phase arena algorithm
    return group.stats()


def test_shared_memory_counts_what_a_rank_publishes_and_reads():
    # One phase: every rank publishes its 1 KiB and reads the three others' slots.
    assert run_processes(rank_arena_on_four, 4, backend="shm") == [{"allreduce": _entry(1, 1024, 3072)}] * 4


def rank_sent_equals_received(group):
    group.reset_stats()
    ferro.allreduce(np.ones(3000, np.float64), group=group)
    ferro.all_to_all(np.ones(30, np.int32), group=group)
    ferro.gather(np.ones(7, np.int64), dst=1, group=group)
    return group.stats()


def test_every_byte_sent_over_tcp_is_received():
    results = run_processes(rank_sent_equals_received, 3)
    for op in ("allreduce", "all_to_all", "gather"):
        assert sum(r[op]["bytes_sent"] for r in results) == sum(r[op]["bytes_received"] for r in results) > 0
        assert all(r[op]["calls"] == 1 for r in results)
    # all_to_all: 10 ints to each of two peers; gather: ranks 0 and 2 send 56 bytes to rank 1.
    assert [r["all_to_all"]["bytes_sent"] for r in results] == [80, 80, 80]
    assert [r["gather"]["bytes_received"] for r in results] == [0, 112, 0]


def rank_sub_group_stats(group):
    group.reset_stats()
    sub = ferro.new_group([0, 1], group=group)
    if sub is not None:
        ferro.allreduce(np.ones(8, np.float32), group=sub)
        return sub.stats(), group.stats()
    return None, group.stats()


def test_a_sub_group_counts_its_own_traffic():
    results = run_processes(rank_sub_group_stats, 3)
    for rank in (0, 1):
        sub_stats, parent_stats = results[rank]
        assert sub_stats == {"allreduce": _entry(1, 32, 32)}
        assert "allreduce" not in parent_stats  # the parent only carried the sub-group's rendezvous
    assert results[2][0] is None
