"""The shared-memory backend: what only shared memory can get wrong."""

import os
import signal
import threading
import time

import numpy as np
import pytest
from _sync import on_entering, wait_until_inside

import ferro
from ferro.backend.shm import SHM_DIR, _sweep_stale_segments
from ferro.testing import RankExit, run_processes
from ferro.testing.conformance import check_collectives


def own_segments(creator_pid):
    """The segments of this test's group: its rank 0 created them under its pid (other jobs' are not ours)."""
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(f"ferro-{creator_pid}-"))


def rank_killed(group):
    creator = ferro.broadcast_object(os.getpid(), 0, group=group)
    pids = ferro.all_gather_object(os.getpid(), group=group)
    if group.rank == 1:
        group.recv(np.empty(1), 0, timeout=60)  # waits until rank 0 kills it
        return "not killed"
    on_entering("recv_tagged", lambda: os.kill(pids[1], signal.SIGKILL))  # once rank 0 waits on rank 1
    start = time.monotonic()
    try:
        group.recv(np.empty(10), 1, timeout=60)
        return "no error"
    except ferro.PeerLostError as exc:
        return exc.peer, time.monotonic() - start < 30, creator, own_segments(creator)


def test_killed_rank_is_noticed_and_nothing_is_left_in_dev_shm():
    results = run_processes(rank_killed, 2, backend="shm", allow_exit={1}, timeout=60)
    peer, prompt, creator, during = results[0]
    assert peer == 1 and prompt
    assert results[1] == RankExit(None, "SIGKILL")
    assert during == []  # unlinked as soon as both ranks had mapped it
    assert own_segments(creator) == []


def rank_interrupted(group):
    if group.rank == 1:
        out = np.empty(1)
        group.recv(out, 0, timeout=60)
        return float(out[0])
    on_entering("recv_tagged", lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        group.recv(np.empty(1), 1, timeout=60)
        outcome = "no interrupt"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    group.send(np.array([5.0]), 1)
    return outcome


def test_ctrl_c_interrupts_a_receive_waiting_on_shared_memory():
    assert run_processes(rank_interrupted, 2, backend="shm", timeout=60) == ["KeyboardInterrupt", 5.0]


def test_sweep_removes_only_segments_of_dead_creators(tmp_path):
    dead = os.path.join(SHM_DIR, "ferro-999999999-deadbeef")  # no such pid
    alive = os.path.join(SHM_DIR, f"ferro-{os.getpid()}-cafe0000")
    other = os.path.join(SHM_DIR, "ferro-not-a-segment")
    for path in (dead, alive, other):
        with open(path, "w"):
            pass
    try:
        _sweep_stale_segments()
        assert not os.path.exists(dead)
        assert os.path.exists(alive) and os.path.exists(other)
    finally:
        for path in (dead, alive, other):
            if os.path.exists(path):
                os.unlink(path)


def rank_two_groups(group):
    from ferro.backend.shm import ShmBackend

    second = ShmBackend(group.rank, group.world_size, store=group._store, secret="unused-with-a-store", timeout=30)
    try:
        peer = 1 - group.rank
        group.send(np.array([1.0 + group.rank]), peer)
        second.send(np.array([10.0 + group.rank]), peer)
        a, b = np.empty(1), np.empty(1)
        second.recv(b, peer)
        group.recv(a, peer)
        return float(a[0]), float(b[0])
    finally:
        second.close()


def test_two_groups_on_one_host_keep_their_own_segments():
    assert run_processes(rank_two_groups, 2, backend="shm") == [(2.0, 11.0), (1.0, 10.0)]


def rank_init_shm(rank, world_size):
    group = ferro.init_process_group(backend="shm", timeout=30)
    try:
        x = np.array([rank + 1.0])
        ferro.allreduce(x)
        return type(group).__name__, float(x[0])
    finally:
        ferro.destroy_process_group()


def test_init_process_group_with_shared_memory():
    assert run_processes(rank_init_shm, 3, backend=None) == [("ShmBackend", 6.0)] * 3


@pytest.mark.parametrize("ring_bytes", [4096, 65536])
def test_messages_far_larger_than_the_ring_stream_through(ring_bytes):
    assert run_processes(rank_big_exchange, 3, args=(ring_bytes,), backend=None, timeout=120) == [True] * 3


def rank_big_exchange(rank, world_size, ring_bytes):
    from ferro.backend.shm import ShmBackend

    with ShmBackend(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                    ring_bytes=ring_bytes, timeout=60) as group:
        n = 3 * 1024 * 1024 // 8
        mine = np.arange(n, dtype=np.float64) + rank
        theirs = np.empty(n)
        group.sendrecv(mine, (rank + 1) % world_size, theirs, (rank - 1) % world_size)
        return bool(np.array_equal(theirs, np.arange(n, dtype=np.float64) + (rank - 1) % world_size))


# --- the collective arena ------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_in_many_small_chunks_match_numpy(world_size):
    # 4 KiB slot buffers cut every message above a few hundred elements into many chunks,
    # with parts of uneven length: the pipelining and bounds logic, against the NumPy reference.
    reports = run_processes(check_collectives, world_size, backend="shm", timeout=240,
                            env={"FERRO_SHM_BUFFER_BYTES": "4096"})
    assert reports[0].cases > 1500
    assert [line for report in reports for line in report.failures] == []
    assert len({report.digest for report in reports}) == 1


def rank_arena_mismatch_reaches_a_bystander(group):
    # Ranks 0 and 1 disagree on the size; rank 2 made the call rank 0 made and is waiting.
    count = 9 if group.rank == 1 else 8
    start = time.monotonic()
    try:
        ferro.allreduce(np.ones(count, np.float32), group=group, timeout=60)
        return "no error"
    except ferro.CollectiveMismatchError as exc:
        return "mismatch", "8 elements" in str(exc) or "gave up" in str(exc), time.monotonic() - start < 30


def test_a_mismatch_in_the_arena_reaches_every_rank_promptly():
    assert run_processes(rank_arena_mismatch_reaches_a_bystander, 3, backend="shm", timeout=90) == [
        ("mismatch", True, True)] * 3


def rank_killed_in_arena(group):
    creator = ferro.broadcast_object(os.getpid(), 0, group=group)
    x = np.ones(1 << 20, np.float32)
    ferro.allreduce(x.copy(), group=group)
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(100):
            ferro.allreduce(x, group=group, timeout=60)
        return "finished"
    except ferro.PeerLostError as exc:
        return exc.peer, time.monotonic() - start < 30, creator, own_segments(creator)


def test_rank_killed_in_an_arena_collective_is_noticed_and_nothing_is_left():
    results = run_processes(rank_killed_in_arena, 3, backend="shm", allow_exit={1}, timeout=90)
    assert results[1] == RankExit(None, "SIGKILL")
    for rank in (0, 2):
        peer, prompt, creator, during = results[rank]
        assert peer == 1 and prompt and during == [], results
    assert own_segments(results[0][2]) == []


def rank_interrupted_in_barrier(group):
    if group.rank == 1:
        group.recv(np.empty(1), 0, timeout=60)  # never enters the barrier: waits for rank 0's word
        return "waited"
    on_entering("barrier", lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        group.barrier(timeout=60)
        outcome = "no interrupt"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    group.send(np.zeros(1), 1)
    return outcome


def test_ctrl_c_interrupts_a_rank_waiting_in_the_arena():
    assert run_processes(rank_interrupted_in_barrier, 2, backend="shm", timeout=60) == ["KeyboardInterrupt",
                                                                                       "waited"]


def rank_arena_timeout(group):
    if group.rank == 1:
        try:  # never calls the allreduce; rank 0's abort notice ends this wait
            group.recv(np.empty(1), 0, timeout=60)
            return "received"
        except ferro.DistributedTimeoutError as exc:
            told = "rank 0 gave up" in str(exc) and "is waiting in" not in str(exc)
            return "told" if told else str(exc)
    try:
        ferro.allreduce(np.ones(4), group=group, timeout=0.3)
        return "no timeout"
    except ferro.DistributedTimeoutError as exc:
        return "rank 1" in str(exc) and isinstance(exc, TimeoutError)


def test_a_rank_that_never_arrives_times_out_naming_it():
    assert run_processes(rank_arena_timeout, 2, backend="shm", timeout=60) == [True, "told"]


def rank_closed_while_another_thread_waits(group):
    if group.rank == 1:
        try:  # neither sends nor enters the barrier; learns that rank 0 closed
            group.recv(np.empty(1), 0, timeout=60)
            return "received"
        except ferro.PeerLostError:
            return "idle"
    outcomes = {}

    def wait(name, call):
        start = time.monotonic()
        try:
            call()
            outcomes[name] = "returned"
        except ferro.BackendClosedError:
            outcomes[name] = time.monotonic() - start < 5

    threads = [threading.Thread(target=wait, args=("recv", lambda: group.recv(np.empty(4), 1, timeout=30))),
               threading.Thread(target=wait, args=("barrier", lambda: group._arena.barrier(30.0)))]
    for thread in threads:
        thread.start()
    wait_until_inside(threads[0], "recv_tagged")
    wait_until_inside(threads[1], "<lambda>")  # the arena's barrier is compiled: its caller is the lambda
    group.close()
    for thread in threads:
        thread.join(10)
    return outcomes


def test_closing_a_group_wakes_threads_waiting_on_it():
    results = run_processes(rank_closed_while_another_thread_waits, 2, backend="shm", timeout=60)
    assert results == [{"recv": True, "barrier": True}, "idle"]


def rank_alternating_signatures(group):
    # The direct path remembers the last call's plan: every change of dtype, shape or op must be seen.
    n, r = group.world_size, group.rank
    wrong = []
    cases = [(np.float32, (6,), ferro.ReduceOp.SUM), (np.float32, (2, 3), ferro.ReduceOp.SUM),
             (np.float32, (3, 2), "max"), (np.float64, (3, 2), "max"), (np.int32, (3, 2), ferro.ReduceOp.PRODUCT),
             (np.float32, (6,), ferro.ReduceOp.MEAN), (np.float32, (5000,), ferro.ReduceOp.SUM)]
    for step in range(3 * len(cases)):
        dtype, shape, op = cases[(step * 5) % len(cases)]
        values = [np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape) + k + 1 for k in range(n)]
        x = values[r].copy()
        ferro.allreduce(x, op, group=group)
        name = op if isinstance(op, str) else op.name.lower()
        reference = {"sum": sum(values), "max": np.maximum.reduce(values), "product": np.multiply.reduce(values),
                     "mean": sum(values) / n}[name]
        if x.dtype != dtype or x.shape != shape or not np.allclose(x, reference.astype(dtype)):
            wrong.append((step, str(dtype), shape, name))
    return wrong


def test_the_direct_path_follows_every_change_of_signature():
    assert run_processes(rank_alternating_signatures, 3, backend="shm") == [[], [], []]


def rank_segment_properties(group):
    # Rank 0 unlinks the name at the end of its set-up, once every rank has mapped the segment;
    # after a barrier every rank's set-up is over. The mapping outlives the name: find it in
    # /proc/self/maps and stat the mapped file itself.
    group.barrier()
    with open("/proc/self/maps") as maps:
        lines = [line.split() for line in maps if "/dev/shm/ferro-" in line]
    found = []
    for fields in lines:
        info = os.stat(f"/proc/self/map_files/{fields[0]}")
        found.append((oct(info.st_mode & 0o777), info.st_uid == os.getuid(), fields[-1] == "(deleted)",
                      os.path.basename(fields[5])))
    return found


def test_segments_are_owner_only_and_already_unlinked():
    results = run_processes(rank_segment_properties, 2, backend="shm")
    names = set()
    for found in results:
        assert found, "no shared-memory segment mapped"
        for mode, owned, deleted, name in found:
            assert (mode, owned, deleted) == ("0o600", True, True)
            names.add(name)
    assert len(names) == 1  # one segment for the group, the same on both ranks
