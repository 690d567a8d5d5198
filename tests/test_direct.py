"""The TCP group's direct paths: allreduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all and barrier, one
compiled call each.

Each test checks that the direct path really took the calls it should (the
compiled object returns True), that its results equal NumPy's, and that it keeps
the full path's guarantees: order behind queued async calls, refusal of calls
that differ between ranks, every rank failing together, the same errors.
"""

import os
import signal
import threading

import numpy as np
import pytest

import ferro
from ferro._core.collectives import DIRECT_REDUCE_SCATTER_BYTES
from ferro.testing import RankExit, run_processes
from ferro.testing.conformance import _cases, _close, _input, _reference, conformance_dtypes


def direct_paths(group):
    """Build the group's direct paths (as the first call does) and return them."""
    ferro.barrier(group=group)
    state = group.state
    return (state.direct_allreduce, state.direct_broadcast, state.direct_all_gather, state.direct_barrier,
            state.direct_reduce_scatter, state.direct_reduce, state.direct_all_to_all)


def rank_every_dtype_and_op(group):
    n, r = group.world_size, group.rank
    allreduce, broadcast, all_gather, barrier, reduce_scatter, reduce, all_to_all = direct_paths(group)
    kinds = tuple(type(path).__name__
                  for path in (allreduce, broadcast, all_gather, barrier, reduce_scatter, reduce, all_to_all))
    wrong, taken, untaken = [], 0, set()
    for index, (case, dtype, shape, op) in enumerate(_cases(conformance_dtypes())):
        inputs = [_input(dtype, shape, k, case, op) for k in range(n)]
        label = f"{dtype.name} {shape} {op.name}"
        root = index % n  # every rank is the reduce's root in turn
        y = inputs[r].copy()
        if not reduce(y, root, op, None):
            untaken.add((dtype.name, shape))
            ferro.reduce(y, root, op, group=group)
        if r == root and not _close(y, _reference(inputs, op), inputs, op) \
                or r != root and y.tobytes() != inputs[r].tobytes():  # the others' x is left as it was
            wrong.append(f"reduce to {root} {label}")
        x = inputs[r].copy()
        if allreduce(x, op, None):
            taken += 1
        else:  # the full path: bfloat16 (viewed as uint16) and empty arrays
            untaken.add((dtype.name, shape))
            ferro.allreduce(x, op, group=group)
        if not _close(x, _reference(inputs, op), inputs, op):
            wrong.append(f"allreduce {label}")
        if shape:  # reduce_scatter splits axis 0: rank r gets part r, as numpy.array_split cuts
            source = inputs[r].copy()
            source.flags.writeable = False  # it is only read
            part = reduce_scatter(source, op, None, 0, None)
            if part is None:
                untaken.add((dtype.name, shape))
                part = ferro.reduce_scatter(source, op, group=group)
            parts = [np.array_split(a, n)[r] for a in inputs]
            if not _close(part, np.array_split(_reference(inputs, op), n)[r], parts, op) \
                    or not np.array_equal(source, inputs[r], equal_nan=True):
                wrong.append(f"reduce_scatter {label}")
        if op is not ferro.ReduceOp.SUM:
            continue
        for root in range(n):
            y = inputs[r].copy() if r == root else np.zeros_like(inputs[r])
            if not broadcast(y, root, None):
                ferro.broadcast(y, root, group=group)
            if y.tobytes() != inputs[root].tobytes():
                wrong.append(f"broadcast root {root} {label}")
        # all_to_all: block j of rank r (its own values) goes to rank j, which finds it at block r.
        blocks = np.stack([_input(dtype, shape, r * n + j, case, op) for j in range(n)])
        exchanged = all_to_all(blocks, None, None)
        if exchanged is None:
            untaken.add((dtype.name, shape))
            exchanged = ferro.all_to_all(blocks, group=group)
        expected = np.stack([_input(dtype, shape, j * n + r, case, op) for j in range(n)])
        if exchanged.shape != expected.shape or exchanged.tobytes() != expected.tobytes():
            wrong.append(f"all_to_all {label}")
        gathered = all_gather(inputs[r], None, 0, None)
        if gathered is None:
            gathered = ferro.all_gather(inputs[r], group=group)
        expected = np.concatenate([a.reshape(-1) if a.ndim == 0 else a for a in inputs])
        if gathered.shape != expected.shape or gathered.tobytes() != expected.tobytes():
            wrong.append(f"all_gather {label}")
    if not barrier(None):
        wrong.append("barrier not taken")
    return kinds, wrong, taken, sorted(untaken)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_dtype_and_op_matches_numpy_on_the_direct_path(world_size):
    # 3 ranks: recursive doubling folds a rank in, and 20011 elements x 8 bytes x 2 rounds take the ring;
    # 4 ranks: the largest arrays take halving-doubling.
    for kinds, wrong, taken, untaken in run_processes(rank_every_dtype_and_op, world_size, timeout=120):
        assert kinds == ("DirectMeshAllreduce", "DirectMeshBroadcast", "DirectMeshAllGather", "DirectMeshBarrier",
                         "DirectMeshReduceScatter", "DirectMeshReduce", "DirectMeshAllToAll")
        assert wrong == []
        assert taken > 200
        assert all(shape == (0,) or name == "bfloat16" for name, shape in untaken), untaken


def rank_signatures_and_arguments(group):
    n, r = group.world_size, group.rank
    allreduce, broadcast, all_gather, _, reduce_scatter, reduce, all_to_all = direct_paths(group)
    wrong = []
    # Every change of dtype, shape or op between calls must be seen (the last plan is remembered).
    cases = [(np.float32, (6,), ferro.ReduceOp.SUM), (np.float32, (2, 3), ferro.ReduceOp.SUM),
             (np.float32, (3, 2), "max"), (np.float64, (3, 2), "max"), (np.int32, (3, 2), ferro.ReduceOp.PRODUCT),
             (np.float32, (6,), ferro.ReduceOp.MEAN), (np.float64, (300_000,), ferro.ReduceOp.AVG)]
    for step in range(3 * len(cases)):
        dtype, shape, op = cases[(step * 5) % len(cases)]
        values = [np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape) + k + 1 for k in range(n)]
        x = values[r].copy()
        part = ferro.reduce_scatter(x, op, group=group)  # before the allreduce overwrites x
        ferro.allreduce(x, op, group=group)
        name = op if isinstance(op, str) else op.name.lower()
        reference = {"sum": sum(values), "max": np.maximum.reduce(values), "product": np.multiply.reduce(values),
                     "mean": sum(values) / n, "avg": sum(values) / n}[name]
        if x.dtype != dtype or x.shape != shape or not np.array_equal(x, reference.astype(dtype)):
            wrong.append(("allreduce", step))
        expected = np.array_split(reference.astype(dtype), n)[r]
        if part.dtype != dtype or part.shape != expected.shape or not np.array_equal(part, expected):
            wrong.append(("reduce_scatter", step))
    # reduce_scatter: into a given out; a tag and an input over the direct path's size take the full path
    # (the same ring, so the result is the same).
    rows = np.arange(5 * n * 2.0).reshape(5 * n, 2) * (r + 1)
    expected = np.array_split(rows / (r + 1) * n * (n + 1) / 2, n)[r]
    out = np.zeros_like(expected)
    if reduce_scatter(rows, "sum", out, 0, None) is not out or not np.array_equal(out, expected):
        wrong.append("reduce_scatter into out")
    if reduce_scatter(rows, "sum", None, 3, None) is not None \
            or not np.array_equal(ferro.reduce_scatter(rows, tag=3, group=group), expected):
        wrong.append("reduce_scatter with a tag")
    big = np.full((DIRECT_REDUCE_SCATTER_BYTES // 8 + n,), r + 1.0)
    expected = np.array_split(np.full(big.shape, n * (n + 1) / 2), n)[r]
    if reduce_scatter(big, "sum", None, 0, None) is not None \
            or not np.array_equal(ferro.reduce_scatter(big, group=group), expected):
        wrong.append("reduce_scatter over the direct path's size")
    # all_gather: into a given out, in place (x is this rank's part of out), with a tag, of a 0-d array.
    out = np.zeros(3 * n)
    mine = out[3 * r:3 * r + 3]
    mine[:] = r + 1
    if all_gather(mine, out, 7, None) is not out or not np.array_equal(out, np.repeat(np.arange(1.0, n + 1), 3)):
        wrong.append("all_gather in place")
    scalar = ferro.all_gather(np.array(r * 10, np.int64), group=group)
    if scalar.shape != (n,) or scalar.tolist() != [k * 10 for k in range(n)]:
        wrong.append("all_gather 0-d")
    # The root may pass a read-only array: a broadcast only reads it there.
    x = np.arange(5.0) if r == 0 else np.zeros(5)
    x.flags.writeable = r != 0
    if not broadcast(x, 0, None) or not np.array_equal(x, np.arange(5.0)):
        wrong.append("read-only root")
    # What the direct path leaves to the full path, which explains it (on every rank alike). Root 1's
    # plan exists first, so a root of True (equal to 1, and hashed alike) could find it.
    ferro.broadcast(np.ones(2), 1, group=group)
    errors, shared = [], np.ones(n + 1)
    for call in (lambda: ferro.allreduce(np.arange(4.0)[::2], group=group),
                 lambda: ferro.allreduce(np.frombuffer(b"\0" * 8, np.float32), group=group),
                 lambda: ferro.allreduce(np.ones(2), "bogus", group=group),
                 lambda: ferro.allreduce(np.ones(2, np.float32), ferro.ReduceOp.BAND, group=group),
                 lambda: ferro.broadcast(np.ones(2), n, group=group),
                 lambda: ferro.broadcast(np.ones(2), True, group=group),  # not root 1, though True == 1
                 lambda: ferro.all_gather(np.ones(2), np.zeros(3), group=group),
                 lambda: ferro.all_gather(np.ones(2), tag=-1, group=group),
                 lambda: ferro.reduce_scatter(np.ones(3 * n), out=np.zeros(4), group=group),
                 lambda: ferro.reduce_scatter(np.array(1.0), group=group),
                 lambda: ferro.reduce_scatter(np.ones(2), "bogus", group=group),
                 lambda: ferro.reduce(np.ones(2), n, group=group),
                 lambda: ferro.reduce(np.ones(2), True, group=group),  # True == 1, but not a rank
                 lambda: ferro.reduce(np.ones(2), 0, "bogus", group=group),
                 lambda: ferro.reduce(np.frombuffer(b"\0" * 16), 0, group=group),  # read-only, root or not
                 lambda: ferro.all_to_all(np.ones(n + 1), group=group),  # no equal blocks
                 lambda: ferro.all_to_all(np.ones(n), out=np.zeros(n + 1), group=group),
                 lambda: ferro.all_to_all(shared[:n], out=shared[1:], group=group)):  # out overlaps x
        try:
            call()
            errors.append(None)
        except (ferro.InvalidBufferError, ferro.InvalidRankError, ferro.SizeMismatchError, ValueError) as exc:
            errors.append(type(exc).__name__)
    return wrong, errors, (allreduce(np.ones(3), "sum", None), broadcast(np.ones(3), 0, None),
                           reduce_scatter(np.ones(3), "sum", None, 0, None) is not None,
                           reduce(np.ones(3), 1, "sum", None), all_to_all(np.ones(n), None, None) is not None)


def test_the_direct_path_follows_signatures_and_leaves_bad_arguments_to_the_full_path():
    results = run_processes(rank_signatures_and_arguments, 3)
    for wrong, errors, still_taken in results:
        assert wrong == []
        assert errors == ["InvalidBufferError", "InvalidBufferError", "ValueError", "InvalidBufferError",
                          "InvalidRankError", "InvalidRankError", "SizeMismatchError", "ValueError",
                          "SizeMismatchError", "InvalidBufferError", "ValueError", "InvalidRankError",
                          "InvalidRankError", "ValueError", "InvalidBufferError", "InvalidBufferError",
                          "SizeMismatchError", "InvalidBufferError"]
        assert still_taken == (True,) * 5  # refused arguments did not fail the group


def rank_async_then_direct(group):
    # Rank 0 queues async calls and then makes synchronous ones, which must wait behind them (the direct
    # path steps aside while anything is queued); rank 1 makes the same calls synchronously, through its
    # direct path. The frames are the same either way, so the ranks meet call for call.
    r = group.rank
    big = np.full(1 << 20, r + 1.0)
    small = np.full(3, 10.0 * (r + 1))
    allreduce = direct_paths(group)[0]
    if r == 0:
        pending = [ferro.allreduce(big, group=group, async_op=True),
                   ferro.broadcast(np.full(4, 7.0), 0, group=group, async_op=True)]
        took_direct = allreduce(small, ferro.ReduceOp.SUM, None)  # steps aside: work is queued
        ferro.allreduce(small, group=group)
        gathered = ferro.all_gather(np.array([r]), group=group)
        ferro.barrier(group=group)
        for p in pending:
            p.wait()
    else:
        took_direct = None
        ferro.allreduce(big, group=group)
        got = ferro.broadcast(np.zeros(4), 0, group=group)
        assert got.tolist() == [7.0] * 4
        ferro.allreduce(small, group=group)
        gathered = ferro.all_gather(np.array([r]), group=group)
        ferro.barrier(group=group)
    return took_direct, float(big[0]), small.tolist(), gathered.tolist()


def test_synchronous_calls_wait_behind_queued_async_ones():
    results = run_processes(rank_async_then_direct, 2)
    assert results[0] == (False, 3.0, [30.0] * 3, [0, 1])
    assert results[1] == (None, 3.0, [30.0] * 3, [0, 1])


def rank_thread_queues_behind_a_direct_call(group):
    # While the main thread is inside a direct allreduce (rank 1 comes late), a second thread's call on
    # the same group must queue behind it rather than meet its peer's frames in between, and the worker
    # must be woken when the direct call ends. Both ranks issue the thread's call from a thread of the
    # same name, after the main thread's (rank 1 waits for its main call to end first).
    r = group.rank
    allreduce = direct_paths(group)[0]
    entered, result = threading.Event(), {}

    def second():
        if r == 0:
            entered.wait(30)
        try:
            y = np.full(2, 100.0 * (r + 1))
            # Woken when the direct call ends, not after the idle worker's 10 s poll.
            ferro.allreduce(y, group=group, async_op=True).wait(timeout=8)
            result["y"] = y.tolist()
        except Exception as exc:  # reported, not lost in the thread
            result["y"] = repr(exc)

    thread = threading.Thread(target=second, name="second")
    x = np.full(2, 1.0 + r)
    if r == 0:
        thread.start()
        timer = threading.Timer(0.3, entered.set)  # the main call is inside by then: rank 1 arrives after 1 s
        timer.start()
        taken = allreduce(x, ferro.ReduceOp.SUM, None)
    else:
        threading.Event().wait(1.0)
        taken = allreduce(x, ferro.ReduceOp.SUM, None)
        thread.start()
    thread.join(40)
    return taken, x.tolist(), result.get("y")


def test_another_threads_call_queues_behind_a_direct_call_and_then_runs():
    results = run_processes(rank_thread_queues_behind_a_direct_call, 2)
    assert results == [(True, [3.0, 3.0], [300.0, 300.0])] * 2


def rank_calls_differ(group, kind):
    r = group.rank
    direct_paths(group)
    x = np.ones(4 if r == 0 else 5, np.float32)
    try:
        if kind == "shape":
            ferro.allreduce(x, group=group)
        elif kind == "root":
            # Both ranks think they are the root, so both only send; the call after reads the
            # other's broadcast frame and refuses it.
            ferro.broadcast(np.ones(4), r, group=group)
        elif kind == "tag":
            ferro.all_gather(np.ones(4), tag=r, group=group)
        elif kind == "op":
            ferro.reduce_scatter(np.ones(4), "sum" if r == 0 else "max", group=group)
        elif kind == "reduce":
            ferro.reduce(np.ones(4), 0, "sum" if r == 0 else "max", group=group)
        elif kind == "all_to_all":
            ferro.all_to_all(np.ones(4 if r == 0 else 6), group=group)
        elif kind == "collective":
            ferro.allreduce(np.ones(4), group=group) if r == 0 else ferro.barrier(group=group)
        ferro.allreduce(np.ones(4), group=group)
        outcome = "no error"
    except ferro.CollectiveMismatchError as exc:
        outcome = ("mismatch", str(exc))
    try:
        ferro.allreduce(np.ones(4), group=group)
        after = "usable"
    except ferro.ConnectionBrokenError:
        after = "broken"
    return outcome, after


@pytest.mark.parametrize("kind", ["shape", "root", "tag", "op", "reduce", "all_to_all", "collective"])
def test_ranks_that_call_different_things_both_fail_with_a_mismatch(kind):
    results = run_processes(rank_calls_differ, 2, args=(kind,))
    for outcome, after in results:
        assert outcome[0] == "mismatch", outcome
        assert after == "broken"
    # The rank that read the other's frame names both calls.
    messages = " ".join(outcome[1] for outcome, _ in results)
    assert "rank 0 called" in messages or "rank 1 called" in messages
    if kind == "shape":
        assert "4 elements" in messages and "5 elements" in messages


def rank_peer_dies_in_a_direct_call(group, collective):
    pids = ferro.all_gather_object(os.getpid(), group=group)
    direct_paths(group)
    if group.rank == 1:
        os.kill(pids[1], signal.SIGKILL)
    try:
        if collective == "allreduce":
            ferro.allreduce(np.ones(8), group=group)
        elif collective == "broadcast":
            ferro.broadcast(np.ones(8), 1, group=group)
        elif collective == "all_gather":
            ferro.all_gather(np.ones(8), group=group)
        elif collective == "reduce_scatter":
            ferro.reduce_scatter(np.ones(8), group=group)
        elif collective == "reduce":
            ferro.reduce(np.ones(8), 0, group=group)
        elif collective == "all_to_all":
            ferro.all_to_all(np.ones(8), group=group)
        else:
            ferro.barrier(group=group)
        return "no error"
    except ferro.PeerLostError as exc:
        lost = (type(exc).__name__, exc.peer, "rank 1" in str(exc))
    try:
        ferro.allreduce(np.ones(8), group=group)
        return lost, "usable"
    except ferro.ConnectionBrokenError:
        return lost, "broken"


@pytest.mark.parametrize("collective",
                         ["allreduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "all_to_all", "barrier"])
def test_a_peer_killed_under_a_direct_call_raises_peer_lost(collective):
    results = run_processes(rank_peer_dies_in_a_direct_call, 2, args=(collective,), allow_exit={1}, timeout=60)
    assert results[0] == (("PeerLostError", 1, True), "broken")
    assert results[1] == RankExit(None, "SIGKILL")


def rank_times_out_then_peer_hears(group):
    direct_paths(group)
    if group.rank == 0:
        try:
            ferro.allreduce(np.ones(4), group=group, timeout=0.5)
            return "no error"
        except ferro.DistributedTimeoutError as exc:
            return "timeout", "rank 0" in str(exc)
    threading.Event().wait(2.0)  # arrive after rank 0 gave up
    # Rank 0's frame was already sent, so this call completes (with both ranks' data); rank 0's
    # notice that it gave up comes next, and the call after this one raises it.
    first = ferro.allreduce(np.ones(4), group=group, timeout=30).tolist()
    try:
        ferro.allreduce(np.ones(4), group=group, timeout=30)
        return first, "no error"
    except ferro.DistributedError as exc:
        return first, type(exc).__name__, "rank 0" in str(exc)


def test_a_timed_out_direct_call_fails_the_peer_too_instead_of_hanging_it():
    results = run_processes(rank_times_out_then_peer_hears, 2, timeout=60)
    assert results[0] == ("timeout", True)
    first, *error = results[1]
    assert first == [2.0] * 4
    assert error[0] != "no error" and error[1] is True, error


def rank_closed_group(group):
    direct_paths(group)
    group.close()
    found = []
    for call in (lambda: ferro.allreduce(np.ones(2), group=group), lambda: ferro.broadcast(np.ones(2), group=group),
                 lambda: ferro.all_gather(np.ones(2), group=group), lambda: ferro.barrier(group=group),
                 lambda: ferro.reduce_scatter(np.ones(2), group=group), lambda: ferro.reduce(np.ones(2), group=group),
                 lambda: ferro.all_to_all(np.ones(2), group=group)):
        try:
            call()
            found.append("no error")
        except ferro.BackendClosedError:
            found.append("closed")
    return found


def test_a_closed_group_refuses_every_direct_call():
    assert run_processes(rank_closed_group, 2) == [["closed"] * 7] * 2


def rank_gather_and_broadcast_across_the_thresholds(group):
    # Sizes on both sides of the all_gather's Bruck threshold and the broadcast's tree/chain one. Odd
    # ranks take the direct path, even ones the full path (async): both must choose the same algorithm.
    # Which peers each call sent frames to (the connections' sequence numbers) shows the algorithm taken.
    n, r = group.world_size, group.rank
    mesh = group.native.direct_mesh
    wrong, sent_to = [], {}

    def run(collective, *args):
        """Call on this rank's path; return the peers it sent frames to."""
        before = [conn.send_seq if conn is not None else 0 for conn in mesh.connections]
        if r % 2:
            collective(*args, group=group)
        else:
            collective(*args, group=group, async_op=True).wait()
        return sorted(p for p, conn in enumerate(mesh.connections) if conn is not None and conn.send_seq > before[p])

    for count in (1, 7, 512, 2048, 40000):
        gathered = np.empty(n * count)
        sent_to["all_gather", count] = run(ferro.all_gather, np.arange(count, dtype=np.float64) + 1000.0 * r,
                                           gathered)
        if not np.array_equal(gathered, np.concatenate([np.arange(count) + 1000.0 * k for k in range(n)])):
            wrong.append(f"all_gather of {count} per rank")
    for nbytes in (8, 64 << 10, (64 << 10) + 8, 256 << 10, 4 << 20):
        for root in (0, n - 1):
            data = np.arange(nbytes // 8, dtype=np.float64) + root if r == root else np.zeros(nbytes // 8)
            peers = run(ferro.broadcast, data, root)
            if r == root:
                sent_to["broadcast", nbytes] = peers
            if not np.array_equal(data, np.arange(nbytes // 8) + root):
                wrong.append(f"broadcast of {nbytes} B from {root}")
    reduced_by = set()
    # reduce on both sides of its plans' crossovers (the tree, the chain, the ring and a gather), into either
    # end rank: the root's x holds the sum, the others' is left as it was.
    for nbytes in (8, 64 << 10, 256 << 10, 4 << 20):
        for root in (0, n - 1):
            values = [np.arange(nbytes // 8, dtype=np.float64) % 89 * (k + 1) for k in range(n)]
            x = values[r].copy()
            run(ferro.reduce, x, root)
            if not np.array_equal(x, sum(values) if r == root else values[r]):
                wrong.append(f"reduce of {nbytes} B to {root}")
            reduced_by.add(mesh.choose("reduce", nbytes))
    # reduce_scatter on both sides of the direct path's size: the same ring either way.
    for count in (1, n, 1001 * n + 1, DIRECT_REDUCE_SCATTER_BYTES // 8 - 1, DIRECT_REDUCE_SCATTER_BYTES // 8 + n):
        x = (np.arange(count) % 97 + r).astype(np.float64)
        part = ferro.reduce_scatter(x, "mean", group=group) if r % 2 else \
            ferro.reduce_scatter(x, "mean", group=group, async_op=True).wait()
        if not np.array_equal(part, np.array_split(np.arange(count) % 97 + (n - 1) / 2, n)[r]):
            wrong.append(f"reduce_scatter of {count}")
    chosen = {key: mesh.choose(key[0], key[1] * 8 * n if key[0] == "all_gather" else key[1]) for key in sent_to}
    return (mesh.latency_bytes, mesh.copy_ratio), sent_to, chosen, wrong, reduced_by


@pytest.mark.parametrize("world_size", [3, 4, 5, 7])
def test_gather_and_broadcast_agree_across_paths_and_thresholds(world_size):
    from ferro._core.collectives import DEFAULT_COPY_RATIO, DEFAULT_LATENCY_BYTES, choose

    n = world_size
    distances = [1 << k for k in range(n.bit_length()) if 1 << k < n]  # 1, 2, 4, ... below n
    results = run_processes(rank_gather_and_broadcast_across_the_thresholds, n, timeout=180)
    for r, (link, sent_to, chosen, wrong, reduced_by) in enumerate(results):
        assert link == (DEFAULT_LATENCY_BYTES, DEFAULT_COPY_RATIO)  # no cost model: the mesh's defaults
        assert wrong == []
        # Every reduce plan was crossed (4 ranks: the tree's and the chain's; their ring and gather never wins).
        assert reduced_by == ({"binomial tree", "pipelined chain"} if n == 4 else
                              {"binomial tree", "ring and gather", "pipelined chain"})
        for (op, size), peers in sent_to.items():
            if op == "all_gather":  # Bruck sends to rank - 1, - 2, - 4, ...; the ring only to rank + 1
                expected = sorted({(r - d) % n for d in distances}) if chosen[op, size] == "bruck" else [(r + 1) % n]
            else:  # at the root: the tree sends to root + 1, + 2, + 4, ...; the chain only to root + 1
                tree = chosen[op, size] == "binomial tree"
                expected = sorted({(r + d) % n for d in distances}) if tree else [(r + 1) % n]
            assert peers == expected, (op, size, r, chosen[op, size])
    # Both sides of each choice were crossed (the sizes straddle the forms' crossovers at these world sizes).
    assert {choose("broadcast", size, n) for size in (8, 4 << 20)} == {"binomial tree", "pipelined chain"}
    if n > 3:
        assert {choose("all_gather", count * 8 * n, n) for count in (1, 40000)} == {"bruck", "ring"}
