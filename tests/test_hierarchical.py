"""Hierarchical collectives: shared memory inside each host, TCP between host leaders.

Hosts are simulated two ways: by declaring them (``FERRO_HOST_ID``), which runs
anywhere, and by putting ranks in network namespaces joined by a veth pair,
which is what separate hosts look like to the network (needs root and ``ip``).
"""

import os
import signal
import threading
import time

import numpy as np
import pytest

import ferro
from ferro.collective.process_group import choose_backend
from ferro.testing import RankExit, netns, run_processes
from ferro.testing.conformance import check_collectives


def test_auto_chooses_by_how_ranks_share_hosts():
    assert choose_backend(["a", "a", "a"]) == "shm"
    assert choose_backend(["a", "b", "c"]) == "tcp"
    assert choose_backend(["a", "a", "b"]) == "hierarchical"


def join_in_two_levels(host):
    """Join the job on the declared ``host``, every call in two levels however many ranks share this machine's cores."""
    os.environ["FERRO_HOST_ID"] = host
    os.environ["FERRO_HIERARCHY_FLAT_BYTES"] = "0"
    return ferro.init_process_group(timeout=60)


def host_layout(world_size):
    """Two hosts: the first takes the extra rank of an odd world."""
    first = (world_size + 1) // 2
    return [0 if r < first else 1 for r in range(world_size)]


def rank_conformance_on_declared_hosts(rank, world_size):
    group = join_in_two_levels(f"declared-host-{host_layout(world_size)[rank]}")
    try:
        report = check_collectives(group)
        return type(group).__name__, group.hosts, report
    finally:
        ferro.destroy_process_group()


@pytest.mark.parametrize("world_size", [3, 4, 5])
def test_conformance_on_declared_hosts(world_size):
    results = run_processes(rank_conformance_on_declared_hosts, world_size, backend=None, timeout=240)
    layout = host_layout(world_size)
    expected_hosts = [tuple(r for r in range(world_size) if layout[r] == h) for h in (0, 1)]
    for name, hosts, _ in results:
        assert name == "HierarchicalBackend" and hosts == expected_hosts
    reports = [report for _, _, report in results]
    assert reports[0].cases > 1500
    assert [line for report in reports for line in report.failures] == []
    assert len({report.digest for report in reports}) == 1


# --- network namespaces as hosts ------------------------------------------------------------

@pytest.fixture(scope="module")
def two_hosts():
    """Two network namespaces joined by a veth pair; yields their names and the first one's address."""
    if not netns.can_create_namespaces():
        pytest.skip("creating network namespaces needs root and iproute2's `ip`")
    with netns.two_hosts() as hosts:
        yield hosts


enter_namespace = netns.enter_namespace


def rank_conformance_across_namespaces(rank, world_size, names, master):
    enter_namespace(names[host_layout(world_size)[rank]])
    os.environ["MASTER_ADDR"] = master
    group = ferro.init_process_group(timeout=60)  # auto: it must see two hosts
    try:
        report = check_collectives(group)
        x = np.full(1 << 20, float(rank), np.float32)  # 4 MiB: the chunked paths
        ferro.allreduce(x, op=ferro.ReduceOp.MEAN)
        mean_ok = bool((x == np.float32(sum(range(world_size)) / world_size)).all())
        return type(group).__name__, group.hosts, report, mean_ok
    finally:
        ferro.destroy_process_group()


@pytest.mark.parametrize("world_size", [4, 5])
def test_conformance_across_network_namespaces(two_hosts, world_size):
    names, master = two_hosts
    results = run_processes(rank_conformance_across_namespaces, world_size, args=(names, master), backend=None,
                            timeout=300)
    layout = host_layout(world_size)
    expected_hosts = [tuple(r for r in range(world_size) if layout[r] == h) for h in (0, 1)]
    for name, hosts, _, mean_ok in results:
        assert name == "HierarchicalBackend" and hosts == expected_hosts and mean_ok
    reports = [report for _, _, report, _ in results]
    assert [line for report in reports for line in report.failures] == []
    assert len({report.digest for report in reports}) == 1


def rank_killed_across_namespaces(rank, world_size, names, master, count):
    enter_namespace(names[host_layout(world_size)[rank]])
    os.environ["MASTER_ADDR"] = master
    ferro.init_process_group(timeout=60)
    x = np.ones(count, np.float32)
    ferro.allreduce(x.copy())
    if rank == 3:  # the second host's non-leader
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(100):
            ferro.allreduce(x, timeout=60)
        return "finished"
    except ferro.PeerLostError:
        return "PeerLostError", time.monotonic() - start < 30
    finally:
        ferro.destroy_process_group()


@pytest.mark.parametrize("count", [1 << 18, 1 << 22], ids=["1MiB", "16MiB-pipelined"])
def test_a_rank_killed_on_one_host_fails_every_host_promptly(two_hosts, count):
    """Also mid-pipeline: the other host's leader has an exchange in flight on its thread when its host fails."""
    names, master = two_hosts
    results = run_processes(rank_killed_across_namespaces, 4, args=(names, master, count), backend=None,
                            allow_exit={3}, timeout=120)
    assert results[3] == RankExit(None, "SIGKILL")
    assert results[:3] == [("PeerLostError", True)] * 3


def rank_hierarchical_stats(rank, world_size):
    group = join_in_two_levels(f"declared-host-{host_layout(world_size)[rank]}")
    try:
        group.reset_stats()
        ferro.allreduce(np.ones(256, np.float32), group=group)  # 1 KiB
        return group.stats()
    finally:
        ferro.destroy_process_group()


def test_hierarchical_stats_add_up_the_three_groups():
    results = run_processes(rank_hierarchical_stats, 4, backend=None, timeout=120)
    # Leaders (ranks 0 and 2): in the host's arena reduce, publish their half for the other rank (512),
    # read its half of theirs (512), publish the reduced half (512) and read the other reduced half (512);
    # then 1 KiB each way to the other leader over TCP; then publish the result for the host (1 KiB).
    leader = {"calls": 1, "bytes_sent": 512 + 512 + 1024 + 1024, "bytes_received": 512 + 512 + 1024}
    # The others publish their halves for the leader, read the leader's half, then read the result.
    member = {"calls": 1, "bytes_sent": 512 + 512, "bytes_received": 512 + 1024}
    assert [r["allreduce"] for r in results] == [leader, member, leader, member]


def rank_bytes_between_hosts(rank, world_size):
    group = join_in_two_levels(f"declared-host-{host_layout(world_size)[rank]}")
    try:
        sent = {}
        calls = {"all_gather": lambda: ferro.all_gather(np.full(256, float(rank), np.float32)),   # 1 KiB a rank
                 "reduce_scatter": lambda: ferro.reduce_scatter(np.full(1024, float(rank), np.float32))}  # 4 KiB
        for name, call in calls.items():
            for part in (group.leader_group, group.local_group):
                if part is not None:
                    part.reset_stats()
            result = call()
            leaders = group.leader_group.stats()[name]["bytes_sent"] if group.leader_group else None
            sent[name] = (leaders, result.tolist())
        return sent
    finally:
        ferro.destroy_process_group()


def test_all_gather_and_reduce_scatter_send_between_hosts_only_what_the_other_host_needs():
    results = run_processes(rank_bytes_between_hosts, 4, backend=None, timeout=120)
    for rank, sent in enumerate(results):
        gathered_by, gathered = sent["all_gather"]
        scattered_by, scattered = sent["reduce_scatter"]
        assert gathered == [float(r) for r in range(4) for _ in range(256)]
        assert scattered == [6.0] * 256
        if rank in (0, 2):  # the leaders: their host's half of the 4 KiB result; the other host's half of the sums
            assert gathered_by == 2048 and scattered_by == 2048  # a ring over the 4 ranks would send 3 KiB each
        else:
            assert gathered_by is None and scattered_by is None


def rank_pipelined_collectives(rank, world_size):
    """Collectives large enough to go piece by piece, on integer-valued data so every sum is exact."""
    os.environ["FERRO_HOST_ID"] = f"declared-host-{host_layout(world_size)[rank]}"
    ferro.init_process_group(timeout=60)
    try:
        results = {}
        for name, dtype, count in [("f64", np.float64, (3 << 20) // 8 + 7),     # 6 pieces, odd cuts
                                   ("f32", np.float32, (17 << 20) // 4 + 5),    # the most pieces
                                   ("i32", np.int32, (2 << 20) // 4 + 3)]:      # just at the threshold
            x = np.random.default_rng(rank).integers(-1000, 1000, count).astype(dtype)
            total = ferro.allreduce(x.copy())
            mean = ferro.allreduce(x.astype(np.float64), op=ferro.ReduceOp.MEAN)
            largest = ferro.allreduce(x.copy(), op=ferro.ReduceOp.MAX)
            frozen = x.copy()
            frozen.setflags(write=False)  # reduce_scatter copies it piece by piece and never writes to it
            part = ferro.reduce_scatter(frozen)
            assert np.array_equal(frozen, x), f"rank {rank}: reduce_scatter changed its read-only input"
            gathered = ferro.all_gather(x)
            results[name] = (total, mean, largest, part, gathered)
        exchanging = any(thread.name.startswith("ferro-leaders-") for thread in threading.enumerate())
        return results, exchanging
    finally:
        ferro.destroy_process_group()


@pytest.mark.parametrize("world_size", [4, 5])
def test_pipelined_collectives_equal_numpy(world_size):
    """2 MiB and up goes piece by piece (leaders exchange one piece while shared memory reduces the next).

    2+2 ranks pipeline all three collectives; 3+2 pipelines allreduce and takes
    the ring for reduce_scatter and all_gather. Every rank must hold NumPy's
    answer, bit for bit the same everywhere.
    """
    returned = run_processes(rank_pipelined_collectives, world_size, backend=None, timeout=240)
    # The leaders (the first rank of each host) ran their exchanges on a thread of their own: the pipeline ran.
    assert [exchanging for _, exchanging in returned] == [r in (0, (world_size + 1) // 2) for r in range(world_size)]
    results = [result for result, _ in returned]
    for name, count in [("f64", (3 << 20) // 8 + 7), ("f32", (17 << 20) // 4 + 5), ("i32", (2 << 20) // 4 + 3)]:
        dtype = results[0][name][0].dtype
        inputs = [np.random.default_rng(r).integers(-1000, 1000, count).astype(dtype) for r in range(world_size)]
        total = np.sum(inputs, axis=0, dtype=np.float64).astype(dtype)
        parts = np.array_split(total, world_size)
        for rank, result in enumerate(results):
            got_total, got_mean, got_max, got_part, got_gathered = result[name]
            assert np.array_equal(got_total, total), (name, rank)
            np.testing.assert_allclose(got_mean, np.mean(np.array(inputs, np.float64), axis=0), rtol=1e-12)
            assert got_mean.tobytes() == results[0][name][1].tobytes()
            assert np.array_equal(got_max, np.max(inputs, axis=0)), (name, rank)
            assert np.array_equal(got_part, parts[rank]), (name, rank)
            assert np.array_equal(got_gathered, np.concatenate(inputs)), (name, rank)


def rank_ring_pieces(group):
    """A reduce-scatter, then an all-gather, over chunks with gaps between them (what the leaders' pipeline passes)."""
    from ferro.types import BYTES, dtype_by_name

    n, rank = group.world_size, group.rank
    starts, ends = [10, 40, 75], [25, 52, 75 + 9]  # unequal chunks; the gaps must stay untouched
    x = np.arange(100, dtype=np.float64) * (rank + 1)
    group.ring_pieces(x, starts, ends, dtype=dtype_by_name("float64"), op=ferro.ReduceOp.SUM, fingerprint=7,
                      timeout=30)
    raw = np.full(100, rank, np.uint8)
    raw[starts[rank]:ends[rank]] = 100 + rank
    group.ring_pieces(raw, starts, ends, dtype=BYTES, op=None, fingerprint=8, timeout=30)
    return n, x, raw


def test_the_ring_over_chunks_with_gaps_equals_numpy():
    results = run_processes(rank_ring_pieces, 3, timeout=60)
    starts, ends = [10, 40, 75], [25, 52, 84]
    total = np.arange(100, dtype=np.float64) * (1 + 2 + 3)
    for rank, (_, reduced, gathered) in enumerate(results):
        mine = np.arange(100, dtype=np.float64) * (rank + 1)
        # Its own chunk ends complete (the others' chunks hold partial sums, as a reduce-scatter leaves them).
        np.testing.assert_array_equal(reduced[starts[rank]:ends[rank]], total[starts[rank]:ends[rank]])
        outside = np.ones(100, bool)
        for s, e in zip(starts, ends, strict=True):
            outside[s:e] = False
        np.testing.assert_array_equal(reduced[outside], mine[outside])  # the gaps are not touched
        want_raw = np.full(100, rank, np.uint8)
        for owner, (s, e) in enumerate(zip(starts, ends, strict=True)):
            want_raw[s:e] = 100 + owner
        np.testing.assert_array_equal(gathered, want_raw)


def rank_late_for_a_pipelined_allreduce(rank, world_size):
    os.environ["FERRO_HOST_ID"] = f"declared-host-{host_layout(world_size)[rank]}"
    ferro.init_process_group(timeout=60)
    try:
        x = np.ones(1 << 22, np.float32)  # 16 MiB: the pipelined path
        if rank == 3:  # the second host's non-leader never comes (until the others have given up)
            time.sleep(12)
            return "absent"
        start = time.monotonic()
        try:
            ferro.allreduce(x, timeout=3)
        except ferro.DistributedError as exc:
            return type(exc).__name__, time.monotonic() - start < 10
        return "finished"
    finally:
        ferro.destroy_process_group()


def test_a_rank_that_never_comes_fails_a_pipelined_allreduce_on_every_host_within_its_timeout():
    """No hang: the other host's leader has an exchange in flight on its thread, the host itself waits on rank 3."""
    results = run_processes(rank_late_for_a_pipelined_allreduce, 4, backend=None, timeout=120)
    assert results[3] == "absent"
    for name, prompt in results[:3]:
        assert name in ("DistributedTimeoutError", "PeerLostError") and prompt, results


def rank_all_to_all_two_levels(rank, world_size):
    os.environ["FERRO_HOST_ID"] = f"declared-host-{host_layout(world_size)[rank]}"
    group = ferro.init_process_group(timeout=60)
    try:
        n, results = world_size, {}
        for block in (1, 3000):  # float64s to each rank
            x = np.concatenate([np.arange(block, dtype=np.float64) + 1000 * rank + dst for dst in range(n)])
            parts = [p for p in (group.leader_group, group.local_group) if p is not None]
            for part in parts:
                part.reset_stats()
            even = ferro.all_to_all(x)
            between = (group.leader_group.stats().get("all_to_all", {}).get("bytes_sent", 0)
                       if group.leader_group else None)
            counts = [block + (dst + rank) % 3 for dst in range(n)]  # uneven: the TCP mesh's pairwise exchange
            rows = np.concatenate([np.full(c, 1000.0 * rank + dst) for dst, c in enumerate(counts)])
            uneven = ferro.all_to_all_single_uneven(rows, counts, [block + (rank + src) % 3 for src in range(n)])
            results[block] = (even.tolist(), between, uneven.tolist())
        return results
    finally:
        ferro.destroy_process_group()


@pytest.mark.parametrize("world_size", [4, 8])
def test_all_to_all_of_equal_blocks_goes_in_two_levels_where_hosts_hold_many_ranks(world_size):
    """4+4 ranks: small equal blocks meet in shared memory and cross between hosts once, leader to leader (R x R
    blocks); larger ones (R x R blocks over 64 KiB), 2+2 ranks and uneven calls take the TCP mesh, where the
    leaders' own group carries nothing. Every way equals NumPy's answer."""
    from ferro.backend.hierarchy_plan import TWO_LEVEL_ALL_TO_ALL_BYTES

    n, per_host = world_size, world_size // 2
    results = run_processes(rank_all_to_all_two_levels, n, backend=None, timeout=180)
    for rank, by_block in enumerate(results):
        for block, (even, between, uneven) in by_block.items():
            expected = np.concatenate([np.arange(block, dtype=np.float64) + 1000 * src + rank for src in range(n)])
            assert even == expected.tolist(), (rank, block)
            two_levels = per_host >= 4 and per_host * per_host * block * 8 <= TWO_LEVEL_ALL_TO_ALL_BYTES
            if rank % per_host:
                assert between is None  # not a leader
            else:  # a leader: the other host's R x R blocks of 8-byte floats in one message, or nothing
                assert between == (per_host * per_host * block * 8 if two_levels else 0), (rank, block, between)
            counts = [block + (rank + src) % 3 for src in range(n)]
            assert uneven == np.concatenate([np.full(c, 1000.0 * src + rank) for src, c in enumerate(counts)]
                                            ).tolist(), (rank, block)


def _paces_on_declared_hosts(rank, world_size):
    os.environ["FERRO_HOST_ID"] = f"declared-host-{rank // 2}"
    group = ferro.init_process_group(timeout=60)
    try:
        leaders = group.leader_group
        blocks = np.concatenate([np.full(3, 10.0 * rank + peer) for peer in range(world_size)])
        got = np.asarray(ferro.all_to_all(blocks, group=group))
        return (group._world.direct_mesh.pace_bytes, None if leaders is None else leaders.direct_mesh.pace_bytes,
                got)
    finally:
        ferro.destroy_process_group()


def test_the_leaders_pace_their_all_to_all_to_the_whole_link_the_flat_group_to_a_host_s_share(tmp_path):
    # Two declared hosts of two ranks, a model of a 100 Mbit link: the flat group's ranks share their host's link
    # (LOCAL_WORLD_SIZE=2), the leaders' group has one rank per host.
    from ferro.backend.cost_model import CostModel

    model = CostModel(1e-4, 8e-8, 0.0, "test")
    model.save(tmp_path / "slow.json")
    results = run_processes(_paces_on_declared_hosts, 4, backend=None, timeout=120,
                            env={"FERRO_COST_MODEL": str(tmp_path / "slow.json"), "LOCAL_WORLD_SIZE": "2"})
    for rank, (flat, leaders, got) in enumerate(results):
        assert flat == pytest.approx(model.pace_bytes(2, 4))
        assert leaders == (pytest.approx(model.pace_bytes(1, 2)) if rank % 2 == 0 else None)
        np.testing.assert_array_equal(got, np.concatenate([np.full(3, 10.0 * k + rank) for k in range(4)]))


def rank_leaders_run_the_plan_chosen_for_them(rank, world_size, forced):
    """Four declared hosts of two ranks: a 4 MiB float64 allreduce, its leaders' bytes, and the plan chosen."""
    from ferro.collective.resolve import resolve_allreduce_algorithm

    group = join_in_two_levels(f"declared-host-{rank // 2}")
    try:
        big = 1 << 22
        shapes = [group.exchange_shape(nbytes, world_size) for nbytes in (64, big)]
        with pytest.raises(ValueError, match="exchange_shape"):
            group.plan_name("allreduce", big)  # the collective layer's choice, not the backend's
        name = resolve_allreduce_algorithm(*group.exchange_shape(big, world_size))
        x = np.arange(big // 8, dtype=np.float64) * (rank + 1)
        if group.leader_group is not None:
            group.leader_group.reset_stats()
        ferro.allreduce(x, algorithm=forced)
        sent = group.leader_group.stats()["allreduce"]["bytes_sent"] if group.leader_group is not None else None
        gathered = ferro.all_gather(np.full(2, float(rank)))  # 16 B a rank: one piece, the leaders' mesh chooses
        return shapes, name, x, sent, (group.plan_name("all_gather", 16 * world_size), gathered)
    finally:
        ferro.destroy_process_group()


@pytest.mark.parametrize("forced", [None, "ring", "recursive_doubling", "halving_doubling"])
def test_the_leaders_run_the_allreduce_chosen_for_their_own_pieces_and_hosts(forced):
    """The algorithm is chosen for the exchange that runs it: 512 KiB pieces among 4 leaders, not 4 MiB among 8.

    A forced algorithm (the argument) is what the leaders run: each leader sends exactly its plan's bytes for
    the 8 pieces, and every rank holds NumPy's sum.
    """
    from ferro._core import collectives as native
    from ferro.collective.resolve import resolve_allreduce_algorithm
    from ferro.tools.bench import simulate

    world_size, hosts, big = 8, 4, 1 << 22
    results = run_processes(rank_leaders_run_the_plan_chosen_for_them, world_size, args=(forced,), backend=None,
                            timeout=180)
    algorithm = forced or resolve_allreduce_algorithm(big // 8, hosts)
    total = np.arange(big // 8, dtype=np.float64) * sum(range(1, world_size + 1))
    for rank, (shapes, name, x, sent, (gather_plan, gathered)) in enumerate(results):
        assert shapes == [(64, hosts), (big // 8, hosts)], rank
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(world_size, dtype=np.float64), 2))
        # A small all_gather's leaders take Bruck's rounds where their mesh chooses them, not the pipeline's ring.
        assert native.choose("all_gather", 16 * world_size, hosts) == "bruck"
        assert gather_plan == ("two-level bruck" if rank % 2 == 0 else "two-level"), (rank, gather_plan)
        assert name == resolve_allreduce_algorithm(big // 8, hosts)
        np.testing.assert_array_equal(x, total)
        if rank % 2 == 0:  # a leader: the 8 pieces of 64 Ki elements, each its plan among the 4 leaders
            planned = 8 * sum(step[2] for step in native.plan_steps(simulate.ALGORITHMS[algorithm], rank // 2,
                                                                    hosts, (big // 8) // 8, 8))
            assert sent == planned, (rank, sent, planned)
        else:
            assert sent is None


def rank_broadcast_and_reduce_by_the_mesh_s_plan(rank, world_size):
    group = join_in_two_levels(f"declared-host-{host_layout(world_size)[rank]}")
    try:
        out = {}
        for count in (8, 1 << 17):  # 64 B and 1 MiB of float64
            names = (group.plan_name("broadcast", count * 8), group.plan_name("reduce", count * 8))
            if group.leader_group is not None:
                group.leader_group.reset_stats()
            sent = np.arange(count, dtype=np.float64) + 100 * rank
            received = ferro.broadcast(sent.copy(), root=1)
            reduced = sent.copy()
            ferro.reduce(reduced, dst=3)
            stats = group.leader_group.stats() if group.leader_group is not None else None
            leaders = None if stats is None else {op: stats.get(op, {}).get("bytes_sent", 0)
                                                  for op in ("broadcast", "reduce")}
            out[count] = (names, received, reduced, leaders)
        return out
    finally:
        ferro.destroy_process_group()


def test_broadcast_and_reduce_take_the_flat_chain_where_the_mesh_chooses_it_else_two_levels():
    """A pipelined chain through consecutive ranks crosses each host's link once each way, pipelined end to end:
    the hierarchy runs it over every rank (the leaders send nothing); smaller calls go in two levels.
    """
    from ferro._core import collectives as native

    world_size = 4
    results = run_processes(rank_broadcast_and_reduce_by_the_mesh_s_plan, world_size, backend=None, timeout=120)
    for count in (8, 1 << 17):
        base = np.arange(count, dtype=np.float64)
        flat = [native.choose(op, count * 8, world_size) for op in ("broadcast", "reduce")]
        assert (flat == ["pipelined chain", "pipelined chain"]) == (count > 8), flat
        for rank, result in enumerate(results):
            names, received, reduced, leaders = result[count]
            np.testing.assert_array_equal(received, base + 100)
            if rank == 3:
                np.testing.assert_array_equal(reduced, base * world_size + 100 * sum(range(world_size)))
            if count > 8:
                assert names == ("pipelined chain", "pipelined chain"), (rank, names)
                assert leaders in (None, {"broadcast": 0, "reduce": 0}), (rank, leaders)
            else:
                # A leader names its leaders' plan (two leaders: the tree); a rank that is not one, the levels.
                tree = "two-level binomial tree" if rank in (0, 2) else "two-level"
                assert names == (tree, tree), (rank, names)
                if rank in (0, 2):  # the leaders: host 0's sends the broadcast to host 1's; host 0's the reduce
                    assert leaders == {"broadcast": 64 if rank == 0 else 0, "reduce": 64 if rank == 0 else 0}, \
                        (rank, leaders)


def test_a_job_is_crowded_when_some_machine_runs_more_of_its_ranks_than_it_has_cores(monkeypatch):
    from ferro.backend.hierarchy_plan import CROWDED_FLAT_BYTES, FLAT_BYTES_ENV, flat_below_bytes, runs_flat
    from ferro.rendezvous.hosts import crowded

    # (host, machine, cpus): two namespaces of one 2-core machine holding 4 ranks; two 8-core machines of 2 each.
    assert crowded([("h0", "m", 2), ("h0", "m", 2), ("h1", "m", 2), ("h1", "m", 2)])
    assert not crowded([("h0", "a", 8), ("h0", "a", 8), ("h1", "b", 8), ("h1", "b", 8)])
    assert crowded([("h0", "a", 8), ("h1", "b", 1), ("h1", "b", 1)])  # one crowded machine is enough
    assert not crowded([("h0", "a", 0), ("h0", "a", 0)])  # ranks that did not say are not counted as crowded
    monkeypatch.delenv(FLAT_BYTES_ENV, raising=False)
    assert flat_below_bytes(True) == CROWDED_FLAT_BYTES
    assert flat_below_bytes(False) == dict.fromkeys(CROWDED_FLAT_BYTES, 0)
    # Unpipelined below 2 MiB, the all_gather and reduce_scatter go flat up to there; the others below 64 KiB.
    assert CROWDED_FLAT_BYTES["all_gather"] == CROWDED_FLAT_BYTES["reduce_scatter"] == 2 << 20
    monkeypatch.setenv(FLAT_BYTES_ENV, "4096")
    assert flat_below_bytes(True) == flat_below_bytes(False) == dict.fromkeys(CROWDED_FLAT_BYTES, 4096)
    monkeypatch.setenv(FLAT_BYTES_ENV, "lots")
    with pytest.raises(ferro.ConfigurationError, match="FERRO_HIERARCHY_FLAT_BYTES='lots'"):
        flat_below_bytes(True)
    for op in ("allreduce", "all_gather", "reduce_scatter", "broadcast", "reduce"):
        assert runs_flat(op, "binomial tree", 2, 4096, 16, flat_below=CROWDED_FLAT_BYTES)
        assert not runs_flat(op, "binomial tree", 2, CROWDED_FLAT_BYTES[op], 16, flat_below=CROWDED_FLAT_BYTES)
        assert not runs_flat(op, "binomial tree", 2, 4096, 16)
    assert runs_flat("all_to_all", "bruck", 2, 4096, 16)  # two ranks a host: the mesh's all_to_all, always


def rank_small_calls_on_a_crowded_machine(rank, world_size):
    os.environ["FERRO_HOST_ID"] = f"declared-host-{rank // 2}"
    os.environ["FERRO_HIERARCHY_FLAT_BYTES"] = "65536"  # as a crowded machine's default: this test's, anywhere
    from ferro.collective.resolve import resolve_allreduce_algorithm

    group = ferro.init_process_group(timeout=60)
    full_path = []  # the hierarchy's own allreduces: the calls the direct path declined
    native_allreduce = group.native_allreduce
    group.native_allreduce = lambda *args: full_path.append(args[0].nbytes) or native_allreduce(*args)
    try:
        for part in (group.leader_group, group.local_group):
            if part is not None:
                part.reset_stats()
        small, large = np.full(8, float(rank)), np.full(1 << 14, float(rank))  # 64 B and 128 KiB
        results = {"allreduce": ferro.allreduce(small.copy()), "all_gather": ferro.all_gather(small),
                   "broadcast": ferro.broadcast(small.copy(), root=1),
                   "reduce_scatter": ferro.reduce_scatter(np.full(8 * world_size, float(rank)))}
        between = group.leader_group.stats() if group.leader_group is not None else {}
        local = group.local_group.stats()
        names = {op: group.plan_name(op, 64) for op in ("all_gather", "broadcast", "reduce_scatter")}
        names["allreduce"] = resolve_allreduce_algorithm(*group.exchange_shape(64, world_size))
        flat_allreduce = group.runs_flat("allreduce", 64), group.runs_flat("allreduce", large.nbytes)
        ferro.allreduce(large)
        direct = (group.state.direct_allreduce is not None, group.state.direct_barrier is None, full_path)
        return results, between, local, names, flat_allreduce, large, group.leader_group.stats() if \
            group.leader_group is not None else None, direct
    finally:
        ferro.destroy_process_group()


def test_small_calls_go_flat_below_the_crowded_size_and_large_ones_in_two_levels():
    """Below FERRO_HIERARCHY_FLAT_BYTES the calls run on the mesh over every rank, by its compiled direct path:
    neither the leaders' group nor shared memory carries a byte, and the plans are named as a flat group names
    them; a larger allreduce goes in two levels again. Every result equals NumPy's."""
    from ferro.collective.resolve import resolve_allreduce_algorithm

    world_size = 4
    results = run_processes(rank_small_calls_on_a_crowded_machine, world_size, backend=None, timeout=120)
    total = float(sum(range(world_size)))
    for rank, (got, between, local, names, flat_allreduce, large, after, direct) in enumerate(results):
        # The flat calls took the world mesh's compiled direct path; the 128 KiB one came to the hierarchy, and
        # the barrier (host, leaders, host) never takes the mesh's.
        assert direct == (True, True, [1 << 17]), (rank, direct)
        np.testing.assert_array_equal(got["allreduce"], np.full(8, total))
        np.testing.assert_array_equal(got["all_gather"], np.repeat(np.arange(world_size, dtype=np.float64), 8))
        np.testing.assert_array_equal(got["broadcast"], np.full(8, 1.0))
        np.testing.assert_array_equal(got["reduce_scatter"], np.full(8, total))
        np.testing.assert_array_equal(large, np.full(1 << 14, total))
        assert between == {} and local == {}, (rank, between, local)  # nothing went through the two levels
        assert names["allreduce"] == resolve_allreduce_algorithm(64, world_size)
        assert not any(name.startswith("two-level") for name in names.values()), (rank, names)
        assert flat_allreduce == (True, False)
        if rank % 2 == 0:  # the 128 KiB allreduce crossed between the leaders
            assert after["allreduce"]["bytes_sent"] > 0, (rank, after)
