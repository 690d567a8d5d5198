"""Point-to-point semantics that every backend shares, run on TCP processes and on simulated threads.

Rank functions live at module level so the process harness can pickle them.
"""

import os

import numpy as np
import pytest

import ferro

DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool", "complex128"]
MB = 1024 * 1024


def payload(dtype, n, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 50).astype(dtype)


def expected_from(src, dst, nbytes):
    """Deterministic content that names its sender and receiver."""
    data = np.arange(nbytes // 4, dtype=np.uint32)
    data ^= np.uint32(src * 1_000_003 + dst * 7)
    return data


# --- rank functions -------------------------------------------------------

def rank_round_trip_dtypes(group):
    if group.rank == 0:
        for i, dtype in enumerate(DTYPES):
            group.send(payload(dtype, 333, i), 1)
        group.send(np.empty(0, np.float32), 1)
        return None
    received = {}
    for dtype in DTYPES:
        out = np.empty(333, dtype)
        group.recv(out, 0)
        received[dtype] = out
    empty = np.empty(0, np.float32)
    group.recv(empty, 0)
    return received


def rank_large_message(group, nbytes):
    if group.rank == 0:
        group.send(expected_from(0, 1, nbytes), 1)
        return True
    out = np.empty(nbytes // 4, np.uint32)
    group.recv(out, 0)
    return bool(np.array_equal(out, expected_from(0, 1, nbytes)))


def rank_ring_exchange(group, nbytes):
    n, r = group.world_size, group.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    out = np.empty(nbytes // 4, np.uint32)
    group.sendrecv(expected_from(r, nxt, nbytes), nxt, out, prv)
    return bool(np.array_equal(out, expected_from(prv, r, nbytes)))


def rank_all_pairs(group, nbytes):
    n, r = group.world_size, group.rank
    heard = []
    for shift in range(1, n):
        dst, src = (r + shift) % n, (r - shift) % n
        out = np.empty(nbytes // 4, np.uint32)
        group.sendrecv(expected_from(r, dst, nbytes), dst, out, src)
        if np.array_equal(out, expected_from(src, r, nbytes)):
            heard.append(src)
    # and plain send/recv between every pair, lower rank first
    for peer in range(n):
        if peer == r:
            continue
        small = np.empty(4, np.uint32)
        if r < peer:
            group.send(expected_from(r, peer, 16), peer)
            group.recv(small, peer)
        else:
            group.recv(small, peer)
            group.send(expected_from(r, peer, 16), peer)
        if not np.array_equal(small, expected_from(peer, r, 16)):
            heard.remove(peer)
    group.barrier()
    return sorted(heard)


def rank_size_mismatch(group):
    if group.rank == 0:
        group.send(np.arange(10, dtype=np.float32), 1)
        return None
    small = np.zeros(5, np.float32)
    try:
        group.recv(small, 0)
        return "no error"
    except ferro.SizeMismatchError as exc:
        error = (type(exc).__name__, exc.expected, exc.actual, bool(np.all(small == 0)))
    out = np.empty(10, np.float32)
    group.recv(out, 0)
    return error, out.tolist()


def rank_invalid_peers(group):
    seen = []
    for bad in (group.world_size, -1, group.rank, "1", 1.0, True):
        try:
            group.send(b"x", bad)
            seen.append("accepted")
        except ferro.SelfSendError:
            seen.append("SelfSendError")
        except ferro.InvalidRankError:
            seen.append("InvalidRankError")
    return seen


def rank_bad_buffers(group):
    seen = []
    frozen = np.zeros(4)
    frozen.flags.writeable = False
    for call in (lambda: group.send(np.arange(8.0)[::2], 1 - group.rank),
                 lambda: group.recv(frozen, 1 - group.rank),
                 lambda: group.send([1, 2], 1 - group.rank)):
        try:
            call()
            seen.append("accepted")
        except ferro.InvalidBufferError as exc:
            seen.append(str(exc).split(":")[1].strip()[:20])
    group.barrier()
    return seen


def rank_barrier_against_recv(group):
    if group.rank == 0:
        group.barrier(timeout=20)
        return "barrier done"
    try:
        group.recv(np.empty(1), 0, timeout=2)
        outcome = "no error"
    except (ferro.CollectiveMismatchError, ferro.DistributedTimeoutError) as exc:
        names_both = "barrier" in str(exc) and "rank 0" in str(exc)
        outcome = type(exc).__name__ if names_both else str(exc)
    group.barrier(timeout=20)  # the barrier was not consumed, so this completes
    return outcome


def rank_timeout_then_usable(group):
    buf = np.empty(3)
    if group.rank == 0:
        group.recv(np.empty(1), 1)  # rank 1 says go once its receive has timed out
        group.send(np.array([1.0, 2.0, 3.0]), 1)
        return None
    try:
        group.recv_timeout(buf, 0, 0.2)
        first = "no error"
    except ferro.DistributedTimeoutError as exc:
        first = "timeout" if isinstance(exc, TimeoutError) else "wrong type"
    group.send(np.zeros(1), 0)
    group.recv(buf, 0)
    return first, buf.tolist()


def rank_subgroups_do_not_mix(group):
    r = group.rank
    evens = ferro.new_group([0, 2], group=group)
    odds = ferro.new_group([3, 1], group=group)
    mine = evens if r % 2 == 0 else odds
    other = odds if r % 2 == 0 else evens
    if other is not None or mine is None:
        return "membership wrong"
    peer_local = 1 - mine.rank
    world_peer = r ^ 2  # same partner as in the sub-group
    # Send on the sub-group first, then on the parent; receive in the opposite order.
    mine.send(np.full(4, 100 + r, np.int64), peer_local)
    group.send(np.full(4, 200 + r, np.int64), world_peer)
    from_world, from_sub = np.empty(4, np.int64), np.empty(4, np.int64)
    group.recv(from_world, world_peer)
    mine.recv(from_sub, peer_local)
    mine.barrier()
    result = (mine.rank, mine.ranks, mine.global_rank(peer_local), int(from_world[0]), int(from_sub[0]))
    mine.close()
    return result


def rank_peer_closes(group):
    if group.rank == 1:
        group.send(np.arange(3.0), 0)
        group.close()
        return "closed"
    first = np.empty(3)
    group.recv(first, 1)  # sent before the close: still delivered
    try:
        group.recv(np.empty(3), 1, timeout=30)
        return "no error"
    except ferro.PeerLostError as exc:
        return first.tolist(), exc.peer


def rank_use_after_close(group):
    group.barrier()
    group.close()
    try:
        group.send(b"x", 1 - group.rank)
        return "no error"
    except ferro.BackendClosedError:
        return "closed"


# --- tests ------------------------------------------------------------------

def test_round_trip_of_every_dtype_and_empty(run):
    received = run(rank_round_trip_dtypes, 2)[1]
    for i, dtype in enumerate(DTYPES):
        np.testing.assert_array_equal(received[dtype], payload(dtype, 333, i))


@pytest.mark.slow
def test_64_mb_message(run):
    assert run(rank_large_message, 2, args=(64 * MB,)) == [True, True]


def test_full_duplex_ring_of_four_with_32_mb_messages(run):
    assert run(rank_ring_exchange, 4, args=(32 * MB,), timeout=120) == [True] * 4


def test_all_pairs_exchange_in_a_full_mesh_of_four(run):
    results = run(rank_all_pairs, 4, args=(4 * MB,))
    for r, heard in enumerate(results):
        assert heard == [p for p in range(4) if p != r]


def test_size_mismatch_is_reported_and_loses_nothing(run):
    error, data = run(rank_size_mismatch, 2)[1]
    assert error == ("SizeMismatchError", 20, 40, True)
    assert data == list(range(10))


def test_invalid_peer_ranks(run):
    expected = ["InvalidRankError", "InvalidRankError", "SelfSendError", "InvalidRankError", "InvalidRankError",
                "InvalidRankError"]
    assert run(rank_invalid_peers, 2) == [expected, expected]


def test_bad_buffers_are_refused(run):
    for seen in run(rank_bad_buffers, 2):
        assert seen[0].startswith("the buffer is not C")
        assert seen[1].startswith("the receive buffer")
        assert seen[2].startswith("expected a C-contig")


def test_barrier_met_by_a_receive_is_reported_and_loses_nothing(run, request):
    # Frame-based backends refuse the barrier's frame at once; shared memory runs barriers in
    # its arena, so the receive times out and its error names the peer's barrier.
    shm = request.node.callspec.params["run"] == "shm"
    expected = "DistributedTimeoutError" if shm else "CollectiveMismatchError"
    assert run(rank_barrier_against_recv, 2) == ["barrier done", expected]


def test_receive_timeout_leaves_the_group_usable(run):
    assert run(rank_timeout_then_usable, 2)[1] == ("timeout", [1.0, 2.0, 3.0])


def test_subgroups_have_their_own_traffic(run):
    results = run(rank_subgroups_do_not_mix, 4)
    assert results[0] == (0, (0, 2), 2, 202, 102)
    assert results[2] == (1, (0, 2), 0, 200, 100)
    assert results[1] == (0, (1, 3), 3, 203, 103)
    assert results[3] == (1, (1, 3), 1, 201, 101)


def test_peer_that_closes_is_lost_after_its_messages(run):
    assert run(rank_peer_closes, 2)[0] == ([0.0, 1.0, 2.0], 1)


def test_operations_after_close(run):
    assert run(rank_use_after_close, 2) == ["closed", "closed"]


@pytest.mark.parametrize("world_size", [1, 3, 5])
def test_barrier_at_other_world_sizes(run, world_size):
    assert run(rank_all_pairs, world_size, args=(64,)) == [
        [p for p in range(world_size) if p != r] for r in range(world_size)]


def _tcp_spin_with(rank, world_size, local):
    import os

    from ferro.backend import base

    base.usable_cpus = lambda: 1  # this host: one core
    os.environ.pop(base.SPIN_ENV, None)
    os.environ.pop(base.YIELD_ENV, None)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    if local is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local)
    with ferro.TcpBackend.from_env(timeout=30) as group:
        group.barrier()  # connections made
        return [(conn.spin_us, conn.yield_us) for conn in group.direct_mesh.connections if conn is not None]


@pytest.mark.parametrize(("local", "spin", "yielding"), [(1, 50.0, 200.0), (None, 0.0, 200.0), (2, 0.0, 200.0),
                                                          (5, 0.0, 0.0)])
def test_a_tcp_rank_spins_while_the_ranks_a_launcher_started_on_its_host_each_have_a_core(local, spin, yielding):
    # Two ranks on hosts of one core each: a launcher's $LOCAL_WORLD_SIZE of 1 says each is alone on its host,
    # so it spins; without it the group's size is the guess (both here: no spin), as with 2 on this host.
    # Past four ranks a core, a rank that does not spin does not yield either.
    from ferro.testing import run_processes

    results = run_processes(_tcp_spin_with, 2, args=(local,), backend=None, timeout=60)
    assert results == [[(spin, yielding)]] * 2


def test_emulated_hosts_tell_their_ranks_how_to_wait_for_all_of_them_on_the_machine_s_cores(monkeypatch):
    # Each emulated host's launcher sees only its own ranks; together they share this machine's cores.
    from ferro.backend import base
    from ferro.tools import emulate

    monkeypatch.delenv(base.SPIN_ENV, raising=False)
    monkeypatch.delenv(base.YIELD_ENV, raising=False)
    cluster = emulate.EmulatedCluster.__new__(emulate.EmulatedCluster)  # its environment only: no namespaces
    cluster.hosts, cluster.subnet = 4, "10.9.9"
    monkeypatch.setattr(base, "usable_cpus", lambda: 4)
    env = cluster.host_environment(2, 2, {"PATH": "/bin"}, "s3cret")  # 8 ranks on 4 cores: yield, no spin
    assert (env[base.SPIN_ENV], env[base.YIELD_ENV]) == ("0.0", "200.0")
    assert env["FERRO_HOST_ID"] == "host2" and env["FERRO_BIND_ADDR"] == "10.9.9.3" and env["PATH"] == "/bin"
    assert cluster.host_environment(2, 1, {}, "s3cret")[base.SPIN_ENV] == "50.0"  # 4 ranks, 4 cores: spin
    monkeypatch.setattr(base, "usable_cpus", lambda: 1)  # 8 ranks on 1 core: neither
    assert cluster.host_environment(2, 2, {}, "s3cret")[base.YIELD_ENV] == "0.0"
    assert cluster.host_environment(0, 2, {base.SPIN_ENV: "25"}, "s3cret")[base.SPIN_ENV] == "25"  # the user's


def test_ranks_stop_yielding_past_four_a_core(monkeypatch):
    from ferro.backend import base

    monkeypatch.delenv(base.YIELD_ENV, raising=False)
    monkeypatch.setattr(base, "usable_cpus", lambda: 2)
    assert [base.default_yield_us(None, n) for n in (1, 8, 9, 32)] == [base.DEFAULT_YIELD_US] * 2 + [0.0] * 2
    assert base.default_yield_us(30.0, 32) == 30.0
    monkeypatch.setenv(base.YIELD_ENV, "75")
    assert base.default_yield_us(None, 32) == 75.0
    monkeypatch.setenv(base.YIELD_ENV, "soon")
    with pytest.raises(ferro.ConfigurationError, match="FERRO_YIELD_US='soon'"):
        base.default_yield_us(None, 32)


def test_ranks_confined_to_fewer_cores_than_ranks_do_not_spin(monkeypatch):
    # Two ranks that taskset, a cgroup cpuset or mpirun's binding confine to one core count one core, not the
    # machine's: spinning there steals the core the peer needs to answer.
    from ferro.backend import base, shm

    monkeypatch.delenv(base.SPIN_ENV, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert base.usable_cpus() == 1
    assert base.default_spin_us(None, 2) == 0.0
    assert base.default_spin_us(None, 1) == base.DEFAULT_SPIN_US
    assert shm._buffer_bytes(None, 2) == shm.OVERSUBSCRIBED_BUFFER_BYTES
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert base.default_spin_us(None, 4) == base.DEFAULT_SPIN_US
    assert base.default_spin_us(None, 5) == 0.0
    assert shm._buffer_bytes(None, 4) == shm.DEFAULT_BUFFER_BYTES
    # Without affinity masks (not Linux), every CPU of the machine counts.
    monkeypatch.delattr(os, "sched_getaffinity")
    assert base.usable_cpus() == 8
    # What the caller or $FERRO_SPIN_US says wins.
    assert base.default_spin_us(25.0, 64) == 25.0
    monkeypatch.setenv(base.SPIN_ENV, "7")
    assert base.default_spin_us(None, 64) == 7.0
