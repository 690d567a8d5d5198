"""The schedules of ``_core/schedule.h``, run as data: every rank's plan executed on simulated ranks against NumPy.

These are the very steps the compiled executor runs (``plan_steps`` iterates the same C plan), so a plan that
sends a range no one receives, or reduces a chunk twice, fails here at every world size from 1 to 9 and 16,
powers of two and not. ``ferro bench --simulate`` replays the same steps on a network model; its tests are below.
"""

from collections import defaultdict, deque

import numpy as np
import pytest

from ferro._core import collectives as native
from ferro.tools.bench import simulate

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16]
ALGORITHMS = sorted(simulate.ALGORITHMS)


def execute(plans, buffers, dtype, sources=None, block=0, reduce=np.add):
    """Run every rank's steps (deques) on its byte buffer, with queues between ranks in order per pair, as TCP
    delivers: a step sends first, then waits for its receive; a reducing step adds what arrived as ``dtype``.
    ``STEP_SEND_SOURCE`` sends from ``sources[rank]``; ``STEP_PACK`` sends the ``block``-byte blocks whose index has
    the step's bit set, packed, and unpacks what arrives into the same places (as ``_exchange_packed`` does)."""
    n = len(plans)
    queues = defaultdict(deque)
    sent = [False] * n  # whether the rank's current step has sent already
    while any(plans):
        progressed = False
        for rank in range(n):
            if not plans[rank]:
                continue
            send_peer, send_off, send_len, recv_peer, recv_off, recv_len, flags, bit = plans[rank][0]
            packed = [j for j in range(n) if j & bit] if flags & native.STEP_PACK else None
            if send_peer >= 0 and send_len and not sent[rank]:
                origin = sources[rank] if flags & native.STEP_SEND_SOURCE else buffers[rank]
                if packed is not None:
                    message = np.concatenate([origin[j * block:(j + 1) * block] for j in packed])
                else:
                    message = origin[send_off:send_off + send_len].copy()
                assert message.size == send_len
                queues[(rank, send_peer)].append(message)
                sent[rank], progressed = True, True
            if recv_peer >= 0 and recv_len:
                if not queues[(recv_peer, rank)]:
                    continue
                data = queues[(recv_peer, rank)].popleft()
                assert data.size == recv_len, f"rank {rank} expected {recv_len} bytes from {recv_peer}, got {data.size}"
                target = buffers[rank][recv_off:recv_off + recv_len]
                if packed is not None:
                    for at, j in enumerate(packed):
                        buffers[rank][j * block:(j + 1) * block] = data[at * block:(at + 1) * block]
                elif flags & native.STEP_REDUCE:
                    view = target.view(dtype)
                    reduce(view, data.view(dtype), out=view)
                else:
                    target[:] = data
            plans[rank].popleft()
            sent[rank], progressed = False, True
        assert progressed, f"the plans deadlock at {n} ranks: {[len(p) for p in plans]} steps left"
    assert not any(queues.values()), "a message was sent that no step received"


def run_plans(inputs, algorithm, phases=3, mean=False, reduce=np.add):
    """Execute every rank's allreduce steps (MEAN's division left out: the tests sum integers); return buffers."""
    n, itemsize, count = len(inputs), inputs[0].itemsize, inputs[0].size
    buffers = [x.copy().view(np.uint8) for x in inputs]
    plans = [deque(native.plan_steps(simulate.ALGORITHMS[algorithm], r, n, count, itemsize, phases, mean))
             for r in range(n)]
    execute(plans, buffers, inputs[0].dtype, reduce=reduce)
    return [b.view(inputs[0].dtype) for b in buffers]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("count", [1, 7, 64, 1001])
def test_every_rank_ends_with_the_numpy_sum(algorithm, n, count):
    rng = np.random.default_rng(n * 1000 + count)
    inputs = [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(n)]
    results = run_plans(inputs, algorithm)
    expected = np.sum(inputs, axis=0)
    for rank, result in enumerate(results):
        np.testing.assert_array_equal(result, expected, err_msg=f"{algorithm}, {n} ranks, rank {rank}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_every_dtype_and_op_matches_numpy_and_every_rank_holds_the_same_bits(algorithm, n):
    # Each plan reduces in a fixed order, so floats agree bit for bit on every rank and with NumPy to rounding.
    count = 37
    for dtype in (np.int32, np.int64, np.float32, np.float64):
        rng = np.random.default_rng(n * 7 + np.dtype(dtype).itemsize)
        inputs = [(rng.integers(-9, 10, count) if np.dtype(dtype).kind == "i" else rng.standard_normal(count))
                  .astype(dtype) for _ in range(n)]
        for reduce, reference in ((np.add, np.sum), (np.multiply, np.prod), (np.minimum, np.min),
                                  (np.maximum, np.max)):
            results = run_plans(inputs, algorithm, reduce=reduce)
            expected = reference(np.array(inputs), axis=0).astype(dtype)
            for rank, result in enumerate(results):
                if np.dtype(dtype).kind == "i" or reduce in (np.minimum, np.maximum):
                    np.testing.assert_array_equal(result, expected, err_msg=f"{algorithm} {n} {dtype} {reduce}")
                else:
                    tolerance = 1e-5 if dtype == np.float32 else 1e-12  # relative, and absolute where sums cancel
                    np.testing.assert_allclose(result, expected, rtol=tolerance, atol=tolerance)
                assert result.tobytes() == results[0].tobytes(), (algorithm, n, dtype, reduce, rank)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_ring_s_phases_alone_reduce_scatter_and_all_gather(n):
    count = 3 * n + 1
    inputs = [np.arange(count, dtype=np.int32) * (r + 1) for r in range(n)]
    scattered = run_plans(inputs, "ring", phases=1)
    bounds = [native_bound(count, n, i) for i in range(n + 1)]
    total = np.sum(inputs, axis=0)
    for rank in range(n):
        mine = slice(bounds[rank], bounds[rank + 1])
        np.testing.assert_array_equal(scattered[rank][mine], total[mine])
    pieces = [np.where((np.arange(count) >= bounds[r]) & (np.arange(count) < bounds[r + 1]), total, 0).astype(np.int32)
              for r in range(n)]
    gathered = run_plans(pieces, "ring", phases=2)
    for rank in range(n):
        np.testing.assert_array_equal(gathered[rank], total)


def native_bound(total, parts, i):
    base, extra = divmod(total, parts)
    return i * base + min(i, extra)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_mean_divides_each_element_exactly_once(algorithm, n):
    count = 40
    steps = [native.plan_steps(simulate.ALGORITHMS[algorithm], r, n, count, 8, 3, True) for r in range(n)]
    # The ring and halving-doubling divide each rank's completed chunk once, so the divided ranges tile the buffer
    # exactly; recursive doubling divides the whole result on every rank that computed it (not the folded ones).
    divided = np.zeros(count * 8, dtype=int)
    for rank_steps in steps:
        for step in rank_steps:
            if step[6] & native.STEP_DIVIDE:
                offset, length = _divided_range(step, count * 8)
                divided[offset:offset + length] += 1
    if algorithm == "recursive_doubling":
        power = 1 << (n.bit_length() - 1)
        assert (divided == power).all(), divided
    else:
        assert (divided == 1).all(), divided


def _divided_range(step, nbytes):
    # plan_steps reports the division through the step's flags; where it falls is the step's completed range:
    # the received chunk for the ring and halving-doubling, the whole buffer for recursive doubling's empty step.
    send_peer, send_off, send_len, recv_peer, recv_off, recv_len, flags, _ = step
    if send_peer < 0 and recv_peer < 0:
        return 0, nbytes
    return recv_off, recv_len


def test_plan_refuses_a_rank_outside_the_group():
    with pytest.raises(ValueError, match="no plan for rank 4 of 4"):
        native.plan_steps(native.ALGORITHM_RING, 4, 4, 10, 4)


# --- the simulator ---

@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("spec", ["1x1@1gbit", "2x1@1gbit", "5x1@100mbit", "8x2@200mbit", "3x3@1gbit,10us"])
def test_simulation_replays_every_plan_and_never_beats_the_lower_bound(algorithm, spec):
    network = simulate.parse_network(spec)
    for nbytes in (8, 64 * 1024, 4 * 1024 * 1024):
        predicted = simulate.predict(network, algorithm, nbytes)
        assert predicted >= simulate.lower_bound(network, nbytes) * 0.999, (spec, algorithm, nbytes)


def test_simulated_ring_approaches_the_line_for_large_messages_and_doubling_wins_small_ones():
    network = simulate.parse_network("16x1@100mbit,50us")
    big = 64 * 1024 * 1024
    assert simulate.predict(network, "ring", big) < 1.05 * simulate.lower_bound(network, big)
    # 4 bytes: log2(16) = 4 rounds against the ring's 30.
    assert simulate.predict(network, "recursive_doubling", 4) < simulate.predict(network, "ring", 4) / 4


@pytest.mark.parametrize("op", ["allreduce", "all_gather", "reduce_scatter", "broadcast", "reduce"])
def test_a_two_level_plan_with_one_rank_a_host_is_its_leaders_plan(op):
    from ferro.tools.bench import two_level

    network = simulate.parse_network("8x1@200mbit,50us")
    plan = "ring" if op in ("all_gather", "reduce_scatter", "allreduce") else "binomial tree"
    for nbytes in (64, 256 * 1024, 1 << 20):  # below the pipeline's 2 MiB: one piece, nothing for shared memory
        assert two_level.predict_two_level(network, plan, nbytes, op=op) == simulate.predict(network, plan, nbytes,
                                                                                             op=op)


def test_two_level_plans_carry_only_what_other_hosts_need_and_never_beat_the_bound():
    """On 8 hosts of 2 ranks a host's link carries 2 (H-1)/H of the buffer in the hierarchy, 2 (n-1)/n in a flat ring.

    The pipelined pieces (4 and 16 MiB) stay within a tenth of the bound; the flat ring is slower on the same links.
    """
    from ferro.tools.bench import two_level

    network = simulate.parse_network("8x2@200mbit,50us")
    for nbytes in (4 << 20, 16 << 20):
        bound = simulate.lower_bound(network, nbytes)
        hierarchy = two_level.predict_two_level(network, "ring", nbytes)
        assert bound * 0.999 <= hierarchy < 1.1 * bound, (nbytes, hierarchy, bound)
        assert hierarchy < simulate.predict(network, "ring", nbytes)
        for op in ("all_gather", "reduce_scatter"):
            assert simulate.lower_bound(network, nbytes, op) * 0.999 <= two_level.predict_two_level(
                network, "ring", nbytes, op=op) < 1.1 * simulate.lower_bound(network, nbytes, op), (op, nbytes)
    with pytest.raises(ValueError, match="at least two hosts"):
        two_level.predict_two_level(simulate.parse_network("1x4@1gbit"), "ring", 64)
    assert two_level.leaders_plan("two-level binomial tree") == "binomial tree"
    assert two_level.leaders_plan("ring") is None


def test_network_specs_parse_and_bad_ones_say_the_form():
    network = simulate.parse_network("8x2@25gbit,5us")
    assert (network.hosts, network.ranks_per_host, network.world_size) == (8, 2, 16)
    assert network.rate == pytest.approx(25e9 / 8) and network.latency == pytest.approx(5e-6)
    for bad in ("8@1gbit", "8x1@fast", "8x1@1gbit,5parsecs"):
        with pytest.raises(ValueError, match="HOSTSxRANKS@RATE"):
            simulate.parse_network(bad)
    with pytest.raises(ValueError, match="at least one host"):
        simulate.parse_network("0x1@1gbit")


# --- forcing an algorithm (FERRO_ALGORITHM_ALLREDUCE, algorithm=) on real ranks ---

def _forced_allreduce(rank, world_size, count):
    import ferro

    with ferro.TcpBackend.from_env(timeout=30) as group:
        x = np.arange(count, dtype=np.float64) * (rank + 1)
        ferro.allreduce(x, group=group)
        sent = group.stats()["allreduce"]["bytes_sent"]
        mean = np.arange(count, dtype=np.float64) * (rank + 1)
        ferro.allreduce(mean, ferro.ReduceOp.MEAN, group=group)
        return x.tolist(), mean.tolist(), sent


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_variable_forces_an_algorithm_and_every_rank_gets_numpy_s_answer(algorithm):
    from ferro.testing import run_processes

    n, count = 5, 1000  # 5: recursive doubling and halving-doubling fold a rank; 1000 floats: the rule's RD
    results = run_processes(_forced_allreduce, n, args=(count,), backend=None, timeout=90,
                            env={"FERRO_ALGORITHM_ALLREDUCE": algorithm})
    total = np.arange(count, dtype=np.float64) * sum(r + 1 for r in range(n))
    for rank, (summed, mean, sent) in enumerate(results):
        np.testing.assert_array_equal(summed, total)
        np.testing.assert_allclose(mean, total / n, rtol=1e-15)
        # The bytes each rank sent are the bytes its plan sends: the forced algorithm is the one that ran.
        planned = sum(step[2] for step in native.plan_steps(simulate.ALGORITHMS[algorithm], rank, n, count, 8))
        assert sent == planned, (rank, sent, planned)
    assert len({tuple(mean) for _, mean, _ in results}) == 1  # bit for bit the same on every rank


def _mismatched_algorithms(rank, world_size):
    import ferro

    with ferro.TcpBackend.from_env(timeout=20) as group:
        try:
            ferro.allreduce(np.ones(64), group=group, algorithm="ring" if rank == 0 else "recursive_doubling")
        except ferro.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"


def test_ranks_that_force_different_algorithms_fail_with_a_mismatch_naming_them_not_a_hang():
    from ferro.testing import run_processes

    results = run_processes(_mismatched_algorithms, 2, backend=None, timeout=60)
    assert any("algorithm ring" in r and "algorithm recursive_doubling" in r for r in results), results


def test_a_variable_that_names_no_algorithm_is_refused_with_its_name(monkeypatch):
    import ferro
    from ferro.testing import run_threads

    monkeypatch.setenv("FERRO_ALGORITHM_ALLREDUCE", "fastest")

    def rank(group):
        with pytest.raises(ValueError, match="FERRO_ALGORITHM_ALLREDUCE 'fastest'"):
            ferro.allreduce(np.ones(4), group=group)
        return True

    assert run_threads(rank, 2) == [True, True]


# --- the cost model: closed forms of the same schedules, chosen from, fitted by ferro bench --fit ---

def _model_and_network(n, rate, latency):
    from ferro.backend.cost_model import CostModel

    network = simulate.Network(n, 1, rate, latency=latency, overhead=5e-6, reduce_rate=4e9)
    return CostModel(latency + 5e-6, 1 / rate, 1 / 4e9), network


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_closed_forms_match_the_replayed_schedules_where_no_rank_folds(n):
    model, network = _model_and_network(n, 12.5e6, 50e-6)
    frames = {"segment": model.segment_bytes(), "piece": model.piece_bytes()}  # as that model's mesh cuts them
    for nbytes in (8, 4096, 262144, 4 << 20, 64 << 20):
        for algorithm in ALGORITHMS:
            replayed = simulate.predict(network, algorithm, nbytes, **frames)
            assert model.allreduce(algorithm, nbytes, n) == pytest.approx(replayed, rel=0.1), (algorithm, nbytes)


def test_the_model_s_choice_costs_at_most_a_fifth_more_than_the_best_replayed_schedule():
    worst = 1.0
    for n in (2, 3, 4, 5, 6, 7, 8, 9, 12, 16):
        for rate, latency in ((12.5e6, 50e-6), (1.25e9, 5e-6), (125e6, 20e-6)):
            model, network = _model_and_network(n, rate, latency)
            frames = {"segment": model.segment_bytes(), "piece": model.piece_bytes()}
            for nbytes in (8, 512, 4096, 32768, 262144, 1 << 20, 4 << 20):
                replayed = {name: simulate.predict(network, name, nbytes, **frames) for name in ALGORITHMS}
                worst = max(worst, replayed[model.choose_allreduce(nbytes, n)] / min(replayed.values()))
    assert worst < 1.2, worst


def test_the_cost_model_file_drives_the_choice_and_a_bad_one_is_refused(tmp_path, monkeypatch):
    from ferro.backend.cost_model import CostModel, load_cost_model
    from ferro.collective import resolve
    from ferro.errors import ConfigurationError

    slow_link = tmp_path / "slow.json"
    CostModel(50e-6, 1 / 12.5e6, 0.0, "test").save(slow_link)
    assert load_cost_model(str(slow_link)) == CostModel(50e-6, 1 / 12.5e6, 0.0, "test")
    monkeypatch.setenv("FERRO_COST_MODEL", str(slow_link))
    # 32 KiB on 8 ranks: the loopback rule takes recursive doubling; on a 100 Mbit link the model takes
    # halving-doubling (measured on the emulated cluster: 4.8 ms against 8.2 ms, DESIGN.md).
    assert resolve.choose_allreduce(32768, 8) == "recursive_doubling"
    assert resolve.resolve_allreduce_algorithm(32768, 8) == "halving_doubling"
    assert resolve.resolve_allreduce_algorithm(32768, 8, "ring") == "ring"  # forcing still wins
    broken = tmp_path / "broken.json"
    broken.write_text("{\"alpha\": 1}")
    with pytest.raises(ConfigurationError, match="not a cost model written by ferro bench --fit"):
        load_cost_model(str(broken))
    # The machine's CPU costs travel with the model; negative ones are refused like negative link costs.
    with_cpu = CostModel(50e-6, 1 / 12.5e6, 0.0, "test", cpu=(13e-6, 4e-9, 2))
    with_cpu.save(slow_link)
    assert load_cost_model(str(slow_link)) == with_cpu
    CostModel(50e-6, 1 / 12.5e6, 0.0, "test", cpu=(-1e-6, 4e-9, 2)).save(broken)
    with pytest.raises(ConfigurationError, match="must not be negative"):
        load_cost_model(str(broken))


# --- broadcast's schedules: the binomial tree and the pipelined chain ---

def run_broadcast(n, root, nbytes, code, segment):
    data = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    buffers = [data.copy() if r == root else np.zeros(nbytes, np.uint8) for r in range(n)]
    plans = [deque(native.plan_steps(code, r, n, nbytes, 1, root=root, segment=segment)) for r in range(n)]
    execute(plans, buffers, np.uint8)
    return data, buffers


@pytest.mark.parametrize("algorithm", sorted(simulate.BROADCAST_ALGORITHMS))
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_every_rank_gets_the_root_s_bytes(algorithm, n):
    for root in {0, n // 2, n - 1}:
        for nbytes, segment in ((1, 4), (10, 4), (1000, 64), (4096, 4096)):
            data, buffers = run_broadcast(n, root, nbytes, simulate.BROADCAST_ALGORITHMS[algorithm], segment)
            for rank, got in enumerate(buffers):
                np.testing.assert_array_equal(got, data, err_msg=f"{algorithm} {n} ranks, root {root}, rank {rank}")


def test_the_chain_pipelines_and_the_tree_does_not():
    network = simulate.parse_network("16x1@100mbit,50us")
    big, small = 16 << 20, 1024

    def bcast(algorithm, nbytes, **kwargs):
        return simulate.predict(network, algorithm, nbytes, op="broadcast", **kwargs)

    bound = simulate.lower_bound(network, big, "broadcast")
    # 16 MiB from one root: the tree sends the whole message log2(16) = 4 times over; the chain forwards its
    # segments as they arrive, paying the pipeline's fill (14 hops of a segment) on top of the segments.
    assert bcast("binomial tree", big) > 3.5 * bound
    segment = native.chain_segment(big, 16)
    assert 16 << 10 <= segment < 1 << 20
    pieces = -(-big // segment)
    assert bcast("pipelined chain", big) == pytest.approx((pieces + 14) * segment / network.rate, rel=0.05)
    assert bcast("pipelined chain", big) < 1.1 * bound
    # A link whose messages cost more (latency_bytes) gets longer segments.
    assert native.chain_segment(big, 16, 1e6) > segment
    # 1 KiB: 4 rounds against 15 hops.
    assert bcast("binomial tree", small) < bcast("pipelined chain", small) / 2


# --- all_gather, all_to_all and the barrier: the remaining plans, on simulated ranks ---

@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("block", [1, 8, 1000])
def test_bruck_all_gather_leaves_every_block_on_every_rank(n, block):
    parts = [np.random.default_rng(r).integers(0, 255, block, dtype=np.uint8) for r in range(n)]
    # The working buffer holds the blocks in each rank's order (its own first), as _all_gather_bruck puts them.
    buffers = [np.concatenate([parts[r], np.zeros((n - 1) * block, np.uint8)]) for r in range(n)]
    plans = [deque(native.plan_steps(native.ALGORITHM_BRUCK, r, n, block, 1)) for r in range(n)]
    assert all(len(p) == (n - 1).bit_length() for p in plans)  # ceil(log2 n) rounds
    execute(plans, buffers, np.uint8)
    for r in range(n):
        in_rank_order = np.roll(buffers[r], r * block)
        np.testing.assert_array_equal(in_rank_order, np.concatenate(parts), err_msg=f"{n} ranks, rank {r}")


@pytest.mark.parametrize("algorithm", ["pairwise", "bruck"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_to_all_plans_deliver_each_block_to_its_rank(algorithm, n):
    block = 24
    code = simulate.OP_ALGORITHMS["all_to_all"][algorithm]
    sends = [np.random.default_rng(100 + r).integers(0, 255, n * block, dtype=np.uint8) for r in range(n)]
    expected = [np.concatenate([sends[src][dst * block:(dst + 1) * block] for src in range(n)]) for dst in range(n)]
    plans = [deque(native.plan_steps(code, r, n, block, 1)) for r in range(n)]
    if algorithm == "pairwise":
        buffers = [np.zeros(n * block, np.uint8) for _ in range(n)]
        for r in range(n):  # the executor copies a rank's own block before the steps
            buffers[r][r * block:(r + 1) * block] = sends[r][r * block:(r + 1) * block]
        execute(plans, buffers, np.uint8, sources=sends)
        results = buffers
    else:  # Bruck works on the blocks rotated: block j is bound for rank + j, and ends up from rank - j
        buffers = [np.concatenate([sends[r][((r + j) % n) * block:((r + j) % n + 1) * block] for j in range(n)])
                   for r in range(n)]
        assert all(len(p) == (n - 1).bit_length() for p in plans)  # ceil(log2 n) rounds
        execute(plans, buffers, np.uint8, block=block)
        results = [np.concatenate([buffers[r][((r - s) % n) * block:((r - s) % n + 1) * block] for s in range(n)])
                   for r in range(n)]
    for r in range(n):
        np.testing.assert_array_equal(results[r], expected[r], err_msg=f"{algorithm}, {n} ranks, rank {r}")


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_dissemination_barrier_lets_no_rank_leave_before_every_rank_arrived(n):
    # heard[r]: the ranks whose arrival rank r has learnt of, through the messages so far.
    plans = [native.plan_steps(native.ALGORITHM_DISSEMINATION, r, n, 0, 1) for r in range(n)]
    heard = [{r} for r in range(n)]
    for round_steps in zip(*plans, strict=True) if n > 1 else []:
        sent = [set(heard[r]) for r in range(n)]
        for r, (send_peer, _, _, recv_peer, *_) in enumerate(round_steps):
            assert round_steps[send_peer][3] == r  # whom r signals waits for r in the same round
            heard[r] |= sent[recv_peer]
    assert all(h == set(range(n)) for h in heard), heard
    assert all(len(p) == (n - 1).bit_length() for p in plans)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_to_all", "broadcast"])
@pytest.mark.parametrize("spec", ["2x1@1gbit", "5x1@100mbit", "8x2@200mbit", "16x1@100mbit,50us"])
def test_every_op_s_plans_replay_and_none_beats_its_lower_bound(op, spec):
    network = simulate.parse_network(spec)
    for algorithm in simulate.OP_ALGORITHMS[op]:
        for nbytes in (64, 64 * 1024, 4 << 20):
            predicted = simulate.predict(network, algorithm, nbytes, op=op)
            assert predicted >= simulate.lower_bound(network, nbytes, op) * 0.999, (spec, op, algorithm, nbytes)


def test_the_closed_forms_the_mesh_chooses_by_agree_with_the_replay():
    # The mesh's choice (schedule.h's forms) against the simulator replaying both plans, on a 16-host 100 Mbit
    # network and the link numbers that network has (latency_bytes: alpha / beta; copies free beside the link).
    network = simulate.parse_network("16x1@100mbit,100us")
    latency_bytes = (network.latency + network.overhead) * network.rate
    agree, total = 0, 0
    for op, names in (("broadcast", tuple(native.BROADCAST_PLANS)), ("all_gather", ("ring", "bruck")),
                      ("all_to_all", ("pairwise", "bruck")), ("reduce", tuple(native.REDUCE_PLANS))):
        for nbytes in (1024, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20):
            replayed = {name: simulate.predict(network, name, nbytes, op=op, latency_bytes=latency_bytes)
                        for name in names}
            chosen = native.choose(op, nbytes, 16, latency_bytes, 0.0, measured=True)  # a fitted network's numbers
            total += 1
            agree += chosen == min(replayed, key=replayed.get) or replayed[chosen] < 1.1 * min(replayed.values())
    assert agree == total


def test_a_fitted_model_chooses_by_its_timings_inside_their_range_and_by_its_forms_outside():
    from ferro.backend.cost_model import CostModel

    # Timings as ferro bench --fit took them at 8 ranks on an emulated 100 Mbit cluster (us): recursive doubling
    # fastest at 4 KiB, halving-doubling at 16 KiB, the ring from 256 KiB.
    timed = {"ring": [(4096, 1171e-6), (16384, 2551e-6), (262144, 38505e-6), (4194304, 619985e-6)],
             "recursive_doubling": [(4096, 531e-6), (16384, 4079e-6), (262144, 115211e-6), (4194304, 1431405e-6)],
             "halving_doubling": [(4096, 886e-6), (16384, 2422e-6), (262144, 38720e-6), (4194304, 837712e-6)]}
    model = CostModel(36e-6, 1 / 12.1e6, 0.0, "test", {"ring": (36e-6, 1 / 12.1e6),
                                                        "recursive_doubling": (0.0, 1 / 9.0e6),
                                                        "halving_doubling": (29e-6, 1 / 11.0e6)}, 8, timed)
    assert [model.choose_allreduce(size, 8) for size in (4096, 16384, 4194304)] == [
        "recursive_doubling", "halving_doubling", "ring"]
    assert model.choose_allreduce(1 << 20, 8) == "ring"  # between timed sizes: interpolated
    # Outside the timed sizes, or at another world size, the per-algorithm forms decide: large, the ring.
    assert model.choose_allreduce(64 << 20, 8) == "ring" and model.choose_allreduce(64 << 20, 16) == "ring"


def _fit_at_32x1():
    """The model ferro bench --fit wrote at 32x1@100mbit, 4 KiB to 256 KiB (seconds; the forms as it fitted them)."""
    from ferro.backend.cost_model import CostModel

    timed = {"ring": [(4096, 11999e-6), (65536, 12341e-6), (262144, 43209e-6)],
             "recursive_doubling": [(4096, 1975e-6), (65536, 49658e-6), (262144, 318141e-6)],
             "halving_doubling": [(4096, 2654e-6), (65536, 10718e-6), (262144, 69183e-6)]}
    forms = {"ring": (33.18e-6, 1 / 11.1e6), "recursive_doubling": (253.74e-6, 1 / 13.0e6),
             "halving_doubling": (116.82e-6, 1 / 12.0e6)}
    return CostModel(33.18e-6, 1 / 11.1e6, 0.0, "test", forms, 32, timed)


def test_above_the_timed_sizes_each_form_keeps_its_largest_timings_ratio():
    from ferro.backend.cost_model import CostModel

    # Halving-doubling took 69 ms at 256 KiB where its form says 44: above, it ran 1.08-1.24 s at 4 MiB against
    # the ring's 0.69-0.72.
    model = _fit_at_32x1()
    bare = CostModel(model.alpha, model.beta, 0.0, "test", model.per_algorithm, 32)
    for size in (1 << 20, 4 << 20, 16 << 20):
        assert bare.choose_allreduce(size, 32) == "halving_doubling"  # the forms alone: 4 % apart, the wrong way
        assert model.choose_allreduce(size, 32) == "ring"
    # The ratio carries no further than the world size it was timed at.
    assert model.choose_allreduce(4 << 20, 64) == bare.choose_allreduce(4 << 20, 64)


def test_the_partner_ratio_follows_the_size_the_fit_timed_it_at():
    from ferro._core.collectives import PARTNER_CURVE_POINTS, Mesh, choose
    from ferro.backend.cost_model import CostModel

    # Halving-doubling over the ring: 0.22, 0.87 and 1.60 at 4, 64 and 256 KiB.
    model = _fit_at_32x1()
    forms = model.per_algorithm
    curve = model.partner_curve()
    assert [size for size, _ in curve] == [4096, 65536, 262144]
    assert curve[0][1] == curve[1][1] == 1.0 and curve[2][1] == pytest.approx(69183 / 43209)
    assert model.link_numbers()[2] == curve[2][1]  # past the largest size, its ratio
    latency_bytes, copy_ratio, _ = model.link_numbers()
    mesh = Mesh([None] * 32, 0, latency_bytes, copy_ratio, model.link_numbers()[2])
    mesh.measured = True
    mesh.set_partner_curve(curve)
    assert mesh.partner_at(100) == 1.0 and mesh.partner_at(1 << 30) == curve[2][1]
    assert mesh.partner_at(131072) == pytest.approx(1 + 0.5 * (curve[2][1] - 1))  # halfway on log sizes
    # Bruck's all_gather measured 5.3 ms against the ring's 8.5 at 64 KiB, and 39 against 21 ms at 256 KiB.
    assert [mesh.choose("all_gather", size) for size in (65536, 262144, 1 << 20)] == ["bruck", "ring", "ring"]
    assert model.partner_ratio_at(262144) == mesh.partner_at(262144)
    # One ratio at every size gets one end wrong: the fitted betas' (1.0) the large sizes, the largest's the small.
    fitted = max(1.0, forms["halving_doubling"][1] / forms["ring"][1])
    assert choose("all_gather", 262144, 32, latency_bytes, copy_ratio, fitted, True) == "bruck"
    assert choose("all_gather", 65536, 32, latency_bytes, copy_ratio, curve[2][1], True) == "ring"
    # Ranks on different curves decide differently, and their settings say so (the rendezvous compares them).
    other = Mesh([None] * 32, 0, latency_bytes, copy_ratio, model.link_numbers()[2])
    other.measured = True
    assert other.plan_settings() != mesh.plan_settings()
    for bad in ([(0, 1.0), (4096, 1.0)], [(4096, 1.0), (4096, 1.2)], [(4096, 0.9)], [(i + 1, 1.0) for i in range(65)]):
        with pytest.raises(ValueError, match="partner curve"):
            mesh.set_partner_curve(bad)
    # A model timed at more sizes than a mesh holds gives it every few, the largest kept.
    many = CostModel(model.alpha, model.beta, 0.0, "test", model.per_algorithm, 32,
                     {name: [(1024 * (i + 1), 1e-3 * (i + 1)) for i in range(100)]
                      for name in ("ring", "halving_doubling")})
    points = many.partner_curve()
    assert 2 <= len(points) <= PARTNER_CURVE_POINTS and points[-1][0] == 102400
    mesh.set_partner_curve(points)


def _all_to_all_both_plans(rank, world_size):
    import ferro

    with ferro.TcpBackend.from_env(timeout=30) as group:
        n, mesh = world_size, group.native.direct_mesh
        results = {}
        uneven = [1 + (rank + dst) % 3 for dst in range(n)]  # the pairwise exchange sliding 40 bytes at most
        mesh.window_bytes = 40
        got = ferro.all_to_all_single_uneven(np.concatenate([np.full(c, 100.0 * rank + d) for d, c in
                                                             enumerate(uneven)]), uneven,
                                             [1 + (src + rank) % 3 for src in range(n)], group=group)
        results["uneven"] = got.tolist()
        # Empty, small (slide within the window's bytes) and large blocks (slide a few steps at a time) at once.
        mixed = [(rank + dst) % 4 * 3 for dst in range(n)]  # 0, 24, 48 or 72 bytes
        got = ferro.all_to_all_single_uneven(np.concatenate([np.full(c, 100.0 * rank + d) for d, c in
                                                             enumerate(mixed)]), mixed,
                                             [(src + rank) % 4 * 3 for src in range(n)], group=group)
        results["mixed"] = got.tolist()
        mesh.window_bytes = native.DEFAULT_WINDOW_BYTES
        for block in (1, 3, 20000):  # float64s to each peer: small totals take Bruck at these sizes, large pairwise
            x = np.concatenate([np.arange(block, dtype=np.float64) + 100 * rank + dst for dst in range(n)])
            before = [conn.send_seq if conn is not None else 0 for conn in mesh.connections]
            got = ferro.all_to_all(x, group=group)
            peers = sorted(p for p, conn in enumerate(mesh.connections)
                           if conn is not None and conn.send_seq > before[p])
            results[block] = (got.tolist(), peers, mesh.choose("all_to_all", x.nbytes))
        return results


@pytest.mark.parametrize("n", [4, 5, 8])
def test_all_to_all_on_real_ranks_takes_the_chosen_plan_and_matches_numpy(n):
    from ferro.testing import run_processes

    results = run_processes(_all_to_all_both_plans, n, backend=None, timeout=120)
    chosen = set()
    for rank, by_block in enumerate(results):
        counts = [1 + (src + rank) % 3 for src in range(n)]
        assert by_block.pop("uneven") == np.concatenate([np.full(c, 100.0 * src + rank) for src, c in
                                                          enumerate(counts)]).tolist()
        mixed = [(src + rank) % 4 * 3 for src in range(n)]
        assert by_block.pop("mixed") == np.concatenate([np.full(c, 100.0 * src + rank) for src, c in
                                                         enumerate(mixed)]).tolist()
        for block, (got, peers, algorithm) in by_block.items():
            expected = np.concatenate([np.arange(block, dtype=np.float64) + 100 * src + rank for src in range(n)])
            np.testing.assert_array_equal(got, expected, err_msg=f"rank {rank}, block {block}, {algorithm}")
            # Bruck's rounds send to rank + 1, + 2, + 4, ...; the pairwise exchange to every peer.
            bruck_peers = sorted({(rank + (1 << k)) % n for k in range((n - 1).bit_length())})
            assert peers == (bruck_peers if algorithm == "bruck" else sorted(set(range(n)) - {rank})), (block, peers)
            chosen.add(algorithm)
    assert chosen == {"bruck", "pairwise"}


@pytest.mark.parametrize("spec", ["16x1@100mbit", "64x1@25gbit,5us", "128x1@100gbit,2us", "8x2@200mbit"])
def test_the_symmetric_replay_equals_the_full_one_where_both_run(spec):
    # The replay from host 0's plans alone predicts 256 to 16,384 ranks; here it must give what replaying every
    # rank gives: exactly at one rank per host; at two per host never less (it serialises a host's ranks on its
    # link and steps them in lockstep) and within 2x, an upper estimate (the scale predictions use one per host).
    network = simulate.parse_network(spec)
    for op, algorithm in sorted(simulate.SYMMETRIC) + [("allreduce", "recursive_doubling"),
                                                       ("allreduce", "halving_doubling")]:
        for nbytes in (64, 256 << 10, 8 << 20):
            if algorithm == "ring" and nbytes // 4 < network.world_size:
                continue  # chunks of nothing: not the same from every host (predict replays them in full)
            full = simulate.predict(network, algorithm, nbytes, op=op, method="full")
            symmetric = simulate.predict(network, algorithm, nbytes, op=op, method="symmetric")
            if network.ranks_per_host == 1:
                assert symmetric == pytest.approx(full, rel=1e-9), (op, algorithm, nbytes)
            else:
                assert full * 0.999 <= symmetric <= 2 * full, (op, algorithm, nbytes, symmetric / full)
    with pytest.raises(ValueError, match="not the same from every host"):
        simulate.predict(simulate.parse_network("5x1@1gbit"), "binomial tree", 64, op="broadcast",
                         method="symmetric")


def _mesh_numbers(rank, world_size):
    import ferro

    with ferro.TcpBackend.from_env(timeout=30) as group:
        mesh = group.native.direct_mesh
        group.barrier()  # rank 0 serves the store: no rank leaves before all have joined
        return mesh.latency_bytes, mesh.copy_ratio, mesh.partner_ratio, mesh.choose("all_gather", 16 << 10)


def test_a_fitted_model_gives_every_tcp_group_its_link_numbers(tmp_path):
    from ferro.backend.cost_model import CostModel, load_cost_model
    from ferro.testing import run_processes

    # Fitted on a 100 Mbit cluster between hosts: 100 us and 12.5 MB/s for the ring; halving-doubling (a new
    # partner every step) 1.5x the ring's cost per byte. 16 KiB all_gathers at 4 ranks then take the ring.
    path = tmp_path / "model.json"
    CostModel(100e-6, 80e-9, 0.0, "test", {"ring": (100e-6, 80e-9), "halving_doubling": (50e-6, 120e-9)}, 4, {},
              "between_hosts", {"between_hosts": (100e-6, 80e-9)}).save(path)
    numbers = load_cost_model(str(path)).link_numbers()
    assert numbers == pytest.approx((1250.0, 0.3e-9 / 80e-9, 1.5))
    results = run_processes(_mesh_numbers, 4, backend=None, timeout=60, env={"FERRO_COST_MODEL": str(path)})
    assert all(r[:3] == pytest.approx(numbers) for r in results)
    assert {r[3] for r in results} == {"ring"}
    assert native.choose("all_gather", 16 << 10, 4, numbers[0], numbers[1], 1.0) == "bruck"  # without the ratio
    defaults = run_processes(_mesh_numbers, 4, backend=None, timeout=60)
    assert all(r[:3] == (native.DEFAULT_LATENCY_BYTES, native.DEFAULT_COPY_RATIO, 1.0) for r in defaults)


def _forced_every_dtype_and_op(rank, world_size):
    import ferro

    with ferro.TcpBackend.from_env(timeout=60) as group:
        out = {}
        for algorithm in ALGORITHMS:
            for dtype in ("int32", "int64", "float16", "float32", "float64"):
                x = ((np.arange(50) % 7 - 3) * (rank + 1)).astype(dtype)
                for op in ("SUM", "PRODUCT", "MIN", "MAX") + (("MEAN",) if dtype.startswith("float") else ()):
                    y = x.copy()
                    ferro.allreduce(y, getattr(ferro.ReduceOp, op), group=group, algorithm=algorithm)
                    out[algorithm, dtype, op] = y.tobytes()
        return out


@pytest.mark.parametrize("n", [3, 4])
def test_every_forced_algorithm_every_dtype_and_op_on_real_ranks_matches_numpy(n):
    from ferro.testing import run_processes

    results = run_processes(_forced_every_dtype_and_op, n, backend=None, timeout=120)
    references = {"SUM": np.sum, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max, "MEAN": np.mean}
    for (algorithm, dtype, op), got in results[0].items():
        inputs = np.array([((np.arange(50) % 7 - 3) * (r + 1)).astype(np.float64) for r in range(n)])
        expected = references[op](inputs, axis=0).astype(dtype)
        np.testing.assert_allclose(np.frombuffer(got, dtype).astype(np.float64), expected.astype(np.float64),
                                   rtol=1e-3 if dtype == "float16" else 1e-12, err_msg=f"{algorithm} {dtype} {op}")
        assert all(r[algorithm, dtype, op] == got for r in results), (algorithm, dtype, op)  # bit for bit


def _even_all_to_all_with_unequal_blocks(rank, world_size):
    import ferro

    with ferro.TcpBackend.from_env(timeout=30) as group:
        send, recv = np.arange(12, dtype=np.uint8) + 100 * rank, np.zeros(12, np.uint8)
        try:
            group.native_all_to_all(send, [0, 4, 12], recv, [0, 4, 12], 1, 10.0, even=True)
            refused = "no error"
        except ValueError as exc:
            refused = str(exc)
        group.native_all_to_all(send, [0, 6, 12], recv, [0, 6, 12], 2, 10.0, even=True)  # the group still works
        return refused, recv.tolist()


def test_an_even_all_to_all_with_unequal_blocks_is_refused_before_any_rank_sends():
    # The even flag lets a rank take Bruck's plan; a rank whose blocks differ would take the pairwise one and leave
    # its peers waiting, so it is refused on the spot.
    from ferro.testing import run_processes

    results = run_processes(_even_all_to_all_with_unequal_blocks, 2, backend=None, timeout=60)
    for rank, (refused, received) in enumerate(results):
        assert "even=True needs 2 equal blocks" in refused
        assert received == [v + 100 * src for src in range(2) for v in range(6 * rank, 6 * rank + 6)]


# --- reduce's schedules: the binomial tree, and the ring's reduce-scatter with a gather to the root ---

REDUCE_ALGORITHMS = sorted(simulate.OP_ALGORITHMS["reduce"])


def run_reduce(inputs, algorithm, root, reduce=np.add, segment=24):
    n, itemsize, count = len(inputs), inputs[0].itemsize, inputs[0].size
    buffers = [x.copy().view(np.uint8) for x in inputs]
    plans = [deque(native.plan_steps(simulate.OP_ALGORITHMS["reduce"][algorithm], r, n, count, itemsize, root=root,
                                     segment=segment)) for r in range(n)]
    execute(plans, buffers, inputs[0].dtype, reduce=reduce)
    return [b.view(inputs[0].dtype) for b in buffers], plans


@pytest.mark.parametrize("algorithm", REDUCE_ALGORITHMS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_reduce_plans_leave_numpy_s_reduction_on_the_root(algorithm, n):
    rng = np.random.default_rng(n)
    for count in (1, 7, 1001):
        inputs = [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(n)]
        for root in sorted({0, n // 2, n - 1}):
            for reduce, reference in ((np.add, np.sum), (np.maximum, np.max)):
                buffers, _ = run_reduce(inputs, algorithm, root, reduce)  # the chain: 3 elements a segment
                np.testing.assert_array_equal(buffers[root], reference(inputs, axis=0),
                                              err_msg=f"{algorithm}, {n} ranks, root {root}, {count} elements")


@pytest.mark.parametrize("algorithm", REDUCE_ALGORITHMS)
@pytest.mark.parametrize("n", [2, 3, 5, 8, 9])
def test_reduce_s_mean_divides_each_element_of_the_root_s_result_once(algorithm, n):
    count = 40
    divided = np.zeros(count * 8, dtype=int)
    for rank in range(n):
        for step in native.plan_steps(simulate.OP_ALGORITHMS["reduce"][algorithm], rank, n, count, 8, mean=True,
                                      root=1 % n, segment=48):
            if step[6] & native.STEP_DIVIDE:
                offset, length = _divided_range(step, count * 8)
                divided[offset:offset + length] += 1
    # The tree and the chain: the root divides its whole result. The ring: each rank its completed chunk, before
    # the gather.
    assert (divided == 1).all(), divided


def test_reduce_plans_move_what_their_closed_forms_say():
    # The tree and the chain send the whole message once from every rank but the root (the chain in segments);
    # the ring and gather 2 (n - 1) chunks from each rank but the root's n - 1: the closed forms count these.
    n, count = 9, 9 * 1000
    codes = simulate.OP_ALGORITHMS["reduce"]
    for rank in range(n):
        tree = native.plan_steps(codes["binomial tree"], rank, n, count, 1, root=0)
        ring = native.plan_steps(codes["ring and gather"], rank, n, count, 1, root=0)
        chain = native.plan_steps(codes["pipelined chain"], rank, n, count, 1, root=0, segment=1000)
        assert sum(s[2] for s in tree) == (0 if rank == 0 else count)
        assert sum(s[2] for s in chain) == (0 if rank == 0 else count)
        assert len([s for s in chain if s[0] >= 0]) == (0 if rank == 0 else 9)  # nine segments, each one frame
        assert sum(s[2] for s in ring) == (n - 1) * 1000 + (0 if rank == 0 else 1000)
    assert native.choose("reduce", 64, n) == "binomial tree"
    assert native.choose("reduce", 64 << 20, n) != "binomial tree"
    network = simulate.parse_network("16x1@100mbit")
    for nbytes in (1 << 10, 256 << 10, 16 << 20):
        latency_bytes = (network.latency + network.overhead) * network.rate
        times = {name: simulate.predict(network, name, nbytes, op="reduce", latency_bytes=latency_bytes)
                 for name in codes}
        chosen = native.choose("reduce", nbytes, 16, latency_bytes)
        assert times[chosen] <= 1.1 * min(times.values()), (nbytes, chosen, times)  # the best, or a near tie
        assert min(times.values()) >= simulate.lower_bound(network, nbytes, "reduce")


def _reduce_every_dtype_op_and_plan(rank, world_size):
    import ferro
    from ferro.types import KERNEL_CODES, dtype_by_name

    with ferro.TcpBackend.from_env(timeout=60) as group:
        out = {}
        for dtype in ("float64", "float32", "int32", "int64"):
            for op in ("SUM", "PRODUCT", "MIN", "MAX", "MEAN"):
                if op == "MEAN" and not dtype.startswith("float"):
                    continue
                x = ((np.arange(50) % 7 - 3) * (rank + 1)).astype(dtype)
                for root in range(world_size):
                    y = x.copy()
                    ferro.reduce(y, dst=root, op=getattr(ferro.ReduceOp, op), group=group)
                    out["chosen", dtype, op, root] = y.tobytes()
                    for plan in native.REDUCE_PLANS:  # each plan forced on the compiled call
                        y = x.copy()
                        reduce_op = getattr(ferro.ReduceOp, op)
                        native.reduce(group.direct_mesh, y, root, dtype_by_name(dtype).code, KERNEL_CODES[reduce_op],
                                      y.itemsize, 0, 30.0, float(world_size) if op == "MEAN" else 0.0,
                                      simulate.OP_ALGORITHMS["reduce"][plan])
                        out[plan, dtype, op, root] = y.tobytes() if rank == root else None
        big = np.arange(300_000, dtype=np.float64) * (rank + 1)  # 2.4 MB: the chain in some 24 segments
        for plan, code in native.REDUCE_PLANS.items():
            y = big.copy()
            native.reduce(group.direct_mesh, y, 0, dtype_by_name("float64").code, KERNEL_CODES[ferro.ReduceOp.SUM],
                          8, 0, 30.0, 0.0, code)
            out["big", plan] = bool((y == np.arange(300_000) * (world_size * (world_size + 1) // 2)).all())
        return out


@pytest.mark.parametrize("n", [3, 4])
def test_reduce_on_real_ranks_gives_the_root_numpy_s_answer_by_either_plan_and_leaves_the_others_alone(n):
    from ferro.testing import run_processes

    results = run_processes(_reduce_every_dtype_op_and_plan, n, backend=None, timeout=180)
    assert all(results[0].pop(("big", plan)) for plan in native.REDUCE_PLANS)  # the root's sum of 2.4 MB, exact
    references = {"SUM": np.sum, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max, "MEAN": np.mean}
    for plan, dtype, op, root in results[0]:
        inputs = np.array([((np.arange(50) % 7 - 3) * (r + 1)).astype(np.float64) for r in range(n)])
        expected = references[op](inputs, axis=0)
        for rank, by_call in enumerate(results):
            value = by_call[plan, dtype, op, root]
            if plan != "chosen" and rank != root:
                continue
            mine = np.frombuffer(value, dtype).astype(np.float64)
            want = expected.astype(dtype).astype(np.float64) if rank == root else inputs[rank]
            np.testing.assert_allclose(mine, want, rtol=1e-6 if dtype == "float32" else 1e-12,
                                       err_msg=f"{plan} {dtype} {op}, root {root}, rank {rank}")


def _plans_chosen_differently(rank, world_size, op):
    import ferro

    with ferro.TcpBackend.from_env(timeout=20) as group:
        mesh = group.direct_mesh
        if rank == 0:  # this rank's link numbers say another plan (as another FERRO_COST_MODEL would)
            mesh.latency_bytes = 1e12 if op == "broadcast" else 0.0
        size = {"broadcast": 4 << 20, "all_to_all": 4 * 64}[op]
        try:
            if op == "broadcast":
                ferro.broadcast(np.zeros(size, np.uint8), root=0, group=group)
            else:
                ferro.all_to_all(np.zeros(size, np.uint8), group=group)
        except ferro.DistributedError as exc:
            return mesh.choose(op, size), str(exc)
        return mesh.choose(op, size), "no error"


@pytest.mark.parametrize("op", ["broadcast", "all_to_all"])
def test_ranks_whose_meshes_choose_different_plans_fail_with_a_mismatch_naming_both(op):
    from ferro.testing import run_processes

    results = run_processes(_plans_chosen_differently, 4, args=(op,), backend=None, timeout=60)
    chosen = {plan for plan, _ in results}
    assert len(chosen) == 2, results  # the premise: rank 0 chose one plan, the others another
    assert any("the ranks' calls differ" in message and all(f"plan {plan}" in message for plan in chosen)
               for _, message in results), results


def _every_root_and_plan_at_six_ranks(rank, world_size):
    import ferro
    from ferro.types import KERNEL_CODES, dtype_by_name

    with ferro.TcpBackend.from_env(timeout=60) as group:
        mesh, out = group.direct_mesh, {}
        x = (np.arange(40_000, dtype=np.float64) + 1) * (rank + 1)
        for root in range(world_size):
            for plan, code in native.REDUCE_PLANS.items():
                y = x.copy()
                native.reduce(mesh, y, root, dtype_by_name("float64").code, KERNEL_CODES[ferro.ReduceOp.SUM], 8, 0,
                              30.0, 0.0, code)
                if rank == root:
                    out["reduce", plan, root] = bool((y == (np.arange(40_000) + 1) * 21).all())
            for plan, code in native.BROADCAST_PLANS.items():
                y = x.copy() if rank == root else np.zeros_like(x)
                native.broadcast(mesh, y.view(np.uint8), root, 0, 30.0, algorithm=code)
                out["broadcast", plan, root] = bool((y == (np.arange(40_000) + 1) * (root + 1)).all())
        return out


def test_every_reduce_and_broadcast_plan_from_every_root_on_six_real_ranks():
    # Six ranks: the ring-and-gather reduce's gather reaches a root three ranks away, a peer no ring, tree or
    # doubling partner is (the call must connect and lock it); 320 KB in every plan, the chain in segments.
    from ferro.testing import run_processes

    results = run_processes(_every_root_and_plan_at_six_ranks, 6, backend=None, timeout=180)
    assert sum(len(r) for r in results) == 6 * 3 * 6 + 6 * 3  # every rank's broadcasts, and each root's reduces
    assert all(all(r.values()) for r in results), [k for r in results for k, ok in r.items() if not ok]


def test_the_names_a_mismatch_gives_plans_are_the_mesh_s_names_in_the_fingerprint_s_code_order():
    # ferro.types (which imports nothing of ferro) names the plan code a TCP mesh puts in a broadcast's,
    # all_gather's or all_to_all's fingerprint (collectives._with_plan: 1 the first plan, 2 the second, ...); the
    # mesh's own tables must list them in the same order, or a mismatch would name the wrong plans.
    from ferro.types import _PLANS

    assert _PLANS["broadcast"] == tuple(native.BROADCAST_PLANS)
    assert _PLANS["all_gather"] == ("ring", "bruck") == tuple(simulate.OP_ALGORITHMS["all_gather"])
    assert _PLANS["all_to_all"] == ("pairwise", "bruck") == tuple(simulate.OP_ALGORITHMS["all_to_all"])


# --- forcing a plan of broadcast, reduce, all_gather and all_to_all (FERRO_ALGORITHM_<OP>) ---

# Three rounds force every plan of each op once (all_gather and all_to_all have two: the third round repeats one).
FORCED_ROUNDS = [
    {"broadcast": "binomial_tree", "reduce": "pipelined_chain", "all_gather": "bruck", "all_to_all": "bruck"},
    {"broadcast": "pipelined_chain", "reduce": "ring_gather", "all_gather": "ring", "all_to_all": "pairwise"},
    {"broadcast": "scatter_all_gather", "reduce": "binomial_tree", "all_gather": "bruck", "all_to_all": "pairwise"},
]


def _forced_plans(rank, world_size, root, count):
    import ferro

    with ferro.TcpBackend.from_env(timeout=30) as group:
        base = np.arange(count, dtype=np.float64) + 1
        b = base * (root + 1) if rank == root else np.zeros(count)
        ferro.broadcast(b, root=root, group=group)
        r = base * (rank + 1)
        ferro.reduce(r, dst=root, group=group)
        gathered = np.zeros(count * world_size)
        ferro.all_gather(base * (rank + 1), out=gathered, group=group)
        blocks = np.concatenate([np.full(count, 100.0 * rank + peer) for peer in range(world_size)])
        exchanged = ferro.all_to_all(blocks, group=group)
        sent = {op: entry["bytes_sent"] for op, entry in group.stats().items()}
        return group.direct_mesh.forced(), b, r, gathered, np.asarray(exchanged), sent


@pytest.mark.parametrize("plans", FORCED_ROUNDS, ids=lambda plans: "+".join(plans.values()))
def test_the_variables_force_each_op_s_plan_and_every_rank_gets_numpy_s_answer(plans):
    # 4 ranks from root 1, 3,000 doubles (24 KB): sizes where the cost forms choose the tree, Bruck's or the ring
    # and gather, so forcing the others shows; the bytes each rank sent are those of the forced plans' steps.
    from ferro.testing import run_processes

    n, root, count = 4, 1, 3000
    env = {f"FERRO_ALGORITHM_{op.upper()}": name for op, name in plans.items()}
    results = run_processes(_forced_plans, n, args=(root, count), backend=None, timeout=120, env=env)
    base = np.arange(count, dtype=np.float64) + 1
    codes = dict(native.FORCEABLE_PLANS["broadcast"])
    to_all = {"pairwise": native.ALGORITHM_PAIRWISE, "bruck": native.ALGORITHM_BRUCK_ALL_TO_ALL}
    for rank, (forced, b, r, gathered, exchanged, sent) in enumerate(results):
        assert forced == plans
        np.testing.assert_array_equal(b, base * (root + 1))
        np.testing.assert_array_equal(r, base * (sum(range(1, n + 1)) if rank == root else rank + 1))
        np.testing.assert_array_equal(gathered, np.concatenate([base * (k + 1) for k in range(n)]))
        np.testing.assert_array_equal(exchanged, np.concatenate([np.full(count, 100.0 * k + rank) for k in range(n)]))
        expected = {
            "broadcast": native.plan_steps(codes[plans["broadcast"]], rank, n, count, 8, root=root),
            "reduce": native.plan_steps(native.FORCEABLE_PLANS["reduce"][plans["reduce"]], rank, n, count, 8,
                                        root=root),
            "all_to_all": native.plan_steps(to_all[plans["all_to_all"]], rank, n, count, 8),
        }
        for op, steps in expected.items():
            assert sent[op] == sum(step[2] for step in steps), (op, rank, sent[op])


def _settings_differ(rank, world_size):
    import os

    import ferro

    if rank == 1:  # this rank alone forces a plan, as one host's environment might
        os.environ["FERRO_ALGORITHM_REDUCE"] = "pipelined_chain"
    with ferro.TcpBackend.from_env(timeout=15):
        return "joined"


def test_a_rank_that_forces_other_plans_is_refused_at_rendezvous_naming_both_settings():
    from ferro.errors import RankFailedError
    from ferro.testing import run_processes

    with pytest.raises(RankFailedError) as caught:
        run_processes(_settings_differ, 2, backend=None, timeout=60)
    text = str(caught.value)
    assert "rank 1" in text and "ConfigurationError" in text, text
    assert "rank 0 has link numbers" in text and "forced plans none" in text, text
    assert "forced plans reduce=pipelined_chain" in text, text


def test_a_variable_that_names_no_plan_is_refused_with_the_plans_it_takes(monkeypatch):
    from ferro.backend.cost_model import force_plans
    from ferro.errors import ConfigurationError

    mesh = native.Mesh([None, None], 0)
    monkeypatch.setenv("FERRO_ALGORITHM_BROADCAST", "fastest")
    with pytest.raises(ConfigurationError, match="rank 0: FERRO_ALGORITHM_BROADCAST=fastest: broadcast has no plan "
                                                 "'fastest'; use one of binomial_tree, pipelined_chain, "
                                                 "scatter_all_gather"):
        force_plans(mesh, 0)
    monkeypatch.setenv("FERRO_ALGORITHM_BROADCAST", "pipelined_chain")
    monkeypatch.setenv("FERRO_ALGORITHM_ALL_TO_ALL", "bruck")
    force_plans(mesh, 0)
    assert mesh.forced() == {"broadcast": "pipelined_chain", "all_to_all": "bruck"}
    assert mesh.choose("broadcast", 8) == "pipelined chain" and mesh.choose("all_to_all", 1 << 24) == "bruck"
    assert "forced plans all_to_all=bruck,broadcast=pipelined_chain" in mesh.plan_settings()


# --- the frame size on a fitted link (CostModel.segment_bytes -> Mesh.segment_bytes) ---

def test_a_fitted_link_s_frames_last_about_ten_milliseconds_within_64_kib_and_1_mib():
    from ferro.backend.cost_model import CostModel

    def segment(bits_per_second):
        return CostModel(1e-4, 8 / bits_per_second, 0.0, "test").segment_bytes()

    assert segment(100e6) == 128 * 1024  # 125 KB in 10 ms
    assert segment(200e6) == 256 * 1024
    assert segment(10e6) == 64 * 1024  # the floor
    assert segment(1e9) == segment(10e9) == 1024 * 1024  # loopback's 1 MiB, the ceiling
    assert CostModel(1e-4, 0.0, 0.0, "test").segment_bytes() == 1024 * 1024


def _slow_link_frames(rank, world_size, count):
    import os

    import ferro

    with ferro.TcpBackend.from_env(timeout=60) as group:
        segment = group.direct_mesh.segment_bytes
        out = {}
        for extra, algorithm in enumerate(("ring", "halving_doubling", "recursive_doubling")):
            # Even ranks take the full path (algorithm=), odd ones the compiled direct path, which reads the
            # variable: the two must cut the same frames. Another count per algorithm: the direct path keeps
            # its choice per call shape.
            os.environ["FERRO_ALGORITHM_ALLREDUCE"] = algorithm
            x = (np.arange(count + extra, dtype=np.float64) % 97) * (rank + 1)
            ferro.allreduce(x, group=group, algorithm=algorithm if rank % 2 == 0 else None)
            out[algorithm] = x
        base = (np.arange(count, dtype=np.float64) % 97) * (rank + 1)
        gathered = np.zeros(count * world_size)
        ferro.all_gather(base, out=gathered, group=group)
        out["all_gather"] = gathered
        out["reduce_scatter"] = np.asarray(ferro.reduce_scatter(base.copy(), group=group))
        y = base.copy()
        ferro.reduce(y, dst=1, group=group)
        out["reduce"] = y
        return segment, out


def test_ranks_on_a_fitted_slow_link_cut_128_kib_frames_and_every_collective_matches_numpy(tmp_path):
    # A model of a 100 Mbit link: frames of 128 KiB, so 1.2 MB (150,000 doubles) travels in several per step.
    from ferro.backend.cost_model import CostModel
    from ferro.testing import run_processes

    model = tmp_path / "slow.json"
    CostModel(1e-4, 8e-8, 0.0, "test").save(model)
    n, count = 4, 150_000
    results = run_processes(_slow_link_frames, n, args=(count,), backend=None, timeout=120,
                            env={"FERRO_COST_MODEL": str(model)})

    def inputs(size):
        return [(np.arange(size, dtype=np.float64) % 97) * (r + 1) for r in range(n)]

    total = sum(inputs(count))
    for rank, (segment, out) in enumerate(results):
        assert segment == 128 * 1024
        for extra, name in enumerate(("ring", "halving_doubling", "recursive_doubling")):
            np.testing.assert_array_equal(out[name], sum(inputs(count + extra)), err_msg=name)
        np.testing.assert_array_equal(out["all_gather"], np.concatenate(inputs(count)))
        np.testing.assert_array_equal(out["reduce_scatter"], np.array_split(total, n)[rank])
        np.testing.assert_array_equal(out["reduce"], total if rank == 1 else inputs(count)[rank])


# --- the all_to_all's flows held to a budget of unacknowledged bytes on a fitted link (Mesh.pace_bytes) ---

def _unacked_bytes(fd):
    """What a TCP socket holds that its peer has not acknowledged (SIOCOUTQ, which is TIOCOUTQ on Linux)."""
    import fcntl
    import struct
    import termios

    return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, struct.pack("i", 0)))[0]


def _budgeted_all_to_all(rank, world_size, count):
    import threading

    import ferro

    with ferro.TcpBackend.from_env(timeout=60) as group:
        mesh = group.direct_mesh
        ferro.all_to_all(np.zeros(world_size), group=group)  # every connection made
        fds = [conn.fileno() for conn in mesh.connections if conn is not None]
        stop, peaks = threading.Event(), []

        def watch():  # one socket at a time: a sum of reads taken at different moments would overstate the whole
            peak = 0
            while not stop.is_set():
                peak = max(peak, *(_unacked_bytes(fd) for fd in fds))
            peaks.append(peak)

        watcher = threading.Thread(target=watch)
        watcher.start()
        blocks = np.concatenate([np.full(count, 1000.0 * rank + peer) for peer in range(world_size)])
        try:
            got = np.asarray(ferro.all_to_all(blocks, group=group))
        finally:
            stop.set()
            watcher.join()
        # Empty, small (within the byte window) and large blocks in one uneven exchange, under the same budget.
        counts = [[0, 5, 200_000, 3][(rank + peer) % 4] for peer in range(world_size)]
        uneven = ferro.all_to_all_single_uneven(
            np.concatenate([np.arange(c, dtype=np.float64) + 1000.0 * rank + peer for peer, c in enumerate(counts)]),
            counts, counts, group=group)  # (rank + peer) % 4 is symmetric: what each sends is what it receives
        return mesh.pace_bytes, mesh.choose("all_to_all", blocks.nbytes), got, len(fds), peaks[0], uneven


def test_a_fitted_link_holds_the_all_to_all_s_flows_to_a_budget_of_unacknowledged_bytes(tmp_path):
    # 8 MiB blocks to each peer, all three steps in flight at once. Without the budget these sockets held up to
    # 5.6 MB unacknowledged each (loopback's send buffers, the receivers' windows full); with it, its share.
    from ferro._core.collectives import FLIGHT_BUDGET_SECONDS
    from ferro.backend.cost_model import CostModel
    from ferro.testing import run_processes

    model = tmp_path / "slow.json"
    CostModel(1e-4, 8e-8, 0.0, "test", line_rate=2e6).save(model)
    n, count = 4, 1 << 20
    results = run_processes(_budgeted_all_to_all, n, args=(count,), backend=None, timeout=120,
                            env={"FERRO_COST_MODEL": str(model), "LOCAL_WORLD_SIZE": "2"})
    assert CostModel(1e-4, 0.0, 0.0, "test").pace_bytes() == 0.0  # no rate, no budget
    for rank, (pace, plan, got, peers, peak, uneven) in enumerate(results):
        # Two ranks share each host's 2 MB/s link, and of each rank's three flows one stays on its host.
        assert pace == pytest.approx(2e6 / 2 * 3 / 2)
        assert plan == "pairwise"
        np.testing.assert_array_equal(got, np.concatenate([np.full(count, 1000.0 * k + rank) for k in range(n)]))
        assert peers == n - 1
        assert 0 < peak <= pace * FLIGHT_BUDGET_SECONDS, (rank, peak)
        counts = [[0, 5, 200_000, 3][(rank + src) % 4] for src in range(n)]
        np.testing.assert_array_equal(uneven, np.concatenate([np.arange(c, dtype=np.float64) + 1000.0 * src + rank
                                                              for src, c in enumerate(counts)]))


def _pace_of(conn):
    """The connection's SO_MAX_PACING_RATE (option 47 on Linux); 2**64 - 1 (or 2**32 - 1): no limit."""
    import socket

    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
        return int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, 47, 8), "little")


def _line_paced_calls(rank, world_size, line, signal):
    import os
    import threading
    import time

    import ferro

    big = (4 << 20) // 8  # float64 elements in 4 MiB: Mesh.pace_from_bytes
    with ferro.TcpBackend.from_env(timeout=60) as group:
        mesh = group.direct_mesh
        group.barrier()  # the ring's connections are made
        seen = []
        if rank == 0:  # rank 0 waits inside the call for the others, who start once it has seen its pace
            def watch():
                deadline = time.monotonic() + 30
                while _pace_of(mesh.connections[1]) != line and time.monotonic() < deadline:
                    time.sleep(0.001)
                seen.append(_pace_of(mesh.connections[1]))
                open(signal, "w").close()

            watcher = threading.Thread(target=watch)
            watcher.start()
        else:
            deadline = time.monotonic() + 60
            while not os.path.exists(signal) and time.monotonic() < deadline:
                time.sleep(0.001)
        x = np.arange(big, dtype=np.float64) * (rank + 1)
        ferro.allreduce(x, group=group)
        if rank == 0:
            watcher.join()
        counts = [mesh.paced_calls]
        below = np.full(big - 1, rank + 1.0)
        ferro.allreduce(below, group=group)  # one element short of the threshold: unpaced
        counts.append(mesh.paced_calls)
        gathered = np.empty(big)  # a 4 MiB output: paced
        ferro.all_gather(np.full(big // world_size, float(rank)), gathered, group=group)
        counts.append(mesh.paced_calls)
        ferro.all_to_all(np.full(big, float(rank)), group=group)  # holds its flows to its own budget: not paced
        counts.append(mesh.paced_calls)
        lifted = [_pace_of(conn) for conn in mesh.connections if conn is not None]
        return mesh.line_pace, seen, counts, x, below, gathered, lifted


def test_a_known_line_paces_a_large_call_s_connections_to_it_while_the_call_runs(tmp_path):
    # A line of 1 TB/s paces nothing here, but the kernel holds the cap rank 0 reads while it waits in the call.
    from ferro.backend.cost_model import CostModel
    from ferro.testing import run_processes

    line = 10**12
    model = tmp_path / "line.json"
    CostModel(1e-4, 8e-8, 0.0, "test", line_rate=float(line)).save(model)
    n, big = 4, (4 << 20) // 8
    results = run_processes(_line_paced_calls, n, args=(line, str(tmp_path / "seen")), backend=None, timeout=120,
                            env={"FERRO_COST_MODEL": str(model)})
    expected = sum(np.arange(big, dtype=np.float64) * (r + 1) for r in range(n))
    for rank, (line_pace, seen, counts, x, below, gathered, lifted) in enumerate(results):
        assert line_pace == line
        if rank == 0:
            assert seen == [line]
        # The 4 MiB allreduce and the all_gather into a 4 MiB output were paced; the smaller allreduce and the
        # all_to_all were not.
        assert counts == [1, 1, 2, 2]
        np.testing.assert_array_equal(x, expected)
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(n, dtype=np.float64), big // n))
        np.testing.assert_array_equal(below, np.full(big - 1, n * (n + 1) / 2))
        assert lifted and all(rate in (2**64 - 1, 2**32 - 1) for rate in lifted), lifted


def test_the_pace_is_a_known_line_rate_else_most_of_the_fitted_one(tmp_path):
    from ferro.backend.cost_model import FITTED_PACE_SHARE, CostModel, load_cost_model
    from ferro.errors import ConfigurationError

    fitted = 1 / 8e-8  # 12.5 MB/s
    below = CostModel(1e-4, 8e-8, 0.0, "test", line_rate=10e6)
    assert below.pace_bytes() == pytest.approx(10e6)  # the line itself
    assert below.pace_bytes(2) == pytest.approx(10e6 / 2)  # two ranks of a group of two: both on one host
    # 8 hosts of 2: of a rank's 15 flows, 14 cross the link, and they carry the rank's half of it.
    assert below.pace_bytes(2, 16) * 14 / 15 == pytest.approx(10e6 / 2)
    assert CostModel(1e-4, 8e-8, 0.0, "test", line_rate=20e6).pace_bytes() == pytest.approx(fitted)  # fit lower
    assert CostModel(1e-4, 8e-8, 0.0, "test").pace_bytes(1, 16) == pytest.approx(FITTED_PACE_SHARE * fitted)
    path = tmp_path / "model.json"
    below.save(path)
    assert load_cost_model(str(path)) == below
    negative = tmp_path / "negative.json"
    CostModel(1e-4, 8e-8, 0.0, "test", line_rate=-1.0).save(negative)
    with pytest.raises(ConfigurationError, match="must not be negative"):
        load_cost_model(str(negative))


def test_an_emulated_link_s_payload_rate_counts_the_headers_of_each_frame():
    from ferro.errors import ConfigurationError
    from ferro.tools.emulate import payload_rate

    assert payload_rate("100mbit") == pytest.approx(100e6 / 8 * 1448 / 1514)  # 11.96 MB/s of TCP payload
    assert payload_rate("2.5Gbit") == pytest.approx(2.5e9 / 8 * 1448 / 1514)
    with pytest.raises(ConfigurationError, match="kbit, mbit or gbit"):
        payload_rate("100mb")


# --- the streaming ring: each chunk in several frames, the next step's leaving as the last one's arrive ---

def _streamed_ring(group, piece, segment, counts):
    import ferro
    from ferro._core import collectives

    mesh = group.direct_mesh
    mesh.piece_bytes, mesh.segment_bytes = piece, segment
    rank, n = group.rank, group.world_size
    out = {}
    for count in counts:
        x = (np.arange(count, dtype=np.float64) % 13 + 1) * (rank + 1)
        ferro.allreduce(x, group=group, algorithm="ring")
        out["sum", count] = x
        m = (np.arange(count, dtype=np.float32) % 7) * (rank + 2)
        ferro.allreduce(m, op=ferro.ReduceOp.AVG, group=group, algorithm="ring")
        out["mean", count] = m
        i = (np.arange(count, dtype=np.int32) % 5) * (rank + 1)
        ferro.allreduce(i, op=ferro.ReduceOp.MAX, group=group, algorithm="ring")
        out["max", count] = i
        out["reduce_scatter", count] = np.asarray(ferro.reduce_scatter(x.copy() * 0 + rank + np.arange(count),
                                                                       group=group))
        gathered = np.zeros(count * n)
        ferro.all_gather(np.arange(count, dtype=np.float64) + 100 * rank, out=gathered, group=group)
        out["all_gather", count] = gathered
    # Rows of 40: rank 0's part is two rows, the others' one, so a rank sends many more frames than it receives.
    rows = np.arange((n + 1) * 40, dtype=np.float64).reshape(n + 1, 40) * (rank + 1)
    out["rows"] = np.asarray(ferro.reduce_scatter(rows, group=group))
    assert collectives.ring_piece(1000, segment, piece, 8) == max(min(-(-1000 // 4), segment), piece) // 8 * 8
    return out


@pytest.mark.parametrize(("n", "frames"), [(2, (24, 64)), (3, (24, 64)), (5, (24, 64)), (5, (8, 8))])
def test_a_streamed_ring_in_many_uneven_frames_matches_numpy(n, frames):
    # Frames of 24-64 bytes, or of one element: every chunk (uneven: 1-100 elements among n ranks) goes in
    # several, the next step's first ones leaving while this step's last ones arrive, a rank sending more frames
    # than it receives where its chunks are larger; sum, mean and max, reduce_scatter and all_gather.
    from ferro.testing import run_processes

    counts = (1, n + 1, 37, 100)
    results = run_processes(_streamed_ring, n, args=(*frames, counts), timeout=120)
    for rank, out in enumerate(results):
        for count in counts:
            base = np.arange(count)
            np.testing.assert_array_equal(out["sum", count], sum((base % 13 + 1.0) * (r + 1) for r in range(n)))
            mean = sum((base % 7).astype(np.float32) * (r + 2) for r in range(n)) / np.float32(n)
            np.testing.assert_allclose(out["mean", count], mean, rtol=1e-6)
            np.testing.assert_array_equal(out["max", count], (base % 5) * n)
            total = sum(np.float64(r) + base for r in range(n))
            np.testing.assert_array_equal(out["reduce_scatter", count], np.array_split(total, n)[rank])
            np.testing.assert_array_equal(out["all_gather", count],
                                          np.concatenate([base + 100.0 * r for r in range(n)]))
        rows = np.arange((n + 1) * 40, dtype=np.float64).reshape(n + 1, 40) * sum(range(1, n + 1))
        np.testing.assert_array_equal(out["rows"], np.array_split(rows, n)[rank])


def test_the_simulator_streams_the_ring_as_the_executor_does():
    # Two hosts, a 4 MiB allreduce: chunks of 2 MiB cut in quarter frames of 512 KiB. Streamed, the all-gather's
    # frames queue behind the reduce-scatter's on the link (each was received long before), so the call takes the
    # eight frames back to back plus one latency: 8 (overhead + frame / rate) + latency. Step by step it would
    # also wait, between the two steps, for the last frame's latency and reduction.
    network = simulate.Network(2, 1, 12.5e6, latency=100e-6, overhead=5e-6, reduce_rate=4e9)
    nbytes = 4 << 20
    assert native.ring_piece(2 << 20, 1 << 20, 16 << 10, 4) == 512 << 10
    predicted = simulate.predict(network, "ring", nbytes, segment=1 << 20, piece=16 << 10)
    assert predicted == pytest.approx(8 * 5e-6 + nbytes / 12.5e6 + 100e-6, rel=1e-12)
    # Frames the size of the chunk: the all-gather's first frame waits for the whole of the reduce-scatter's.
    whole = simulate.predict(network, "ring", nbytes, segment=4 << 20, piece=4 << 20)
    assert whole == pytest.approx(2 * (5e-6 + (2 << 20) / 12.5e6 + 100e-6) + (2 << 20) / 4e9, rel=1e-12)



def test_a_token_bucket_passes_what_it_saved_while_idle_at_once_and_the_rest_at_the_line():
    from ferro.tools.bench.simulate import _cross, _links

    rate, burst, wire = 1e6, 10_000, 1e9
    network = simulate.Network(2, 1, rate, burst=burst, local_rate=wire)
    up, down = _links(network), _links(network)
    assert _cross(network, up, down, 0, 1, 0.0, 5_000) == pytest.approx(5e-3)  # empty at first: the line
    # A second idle: both ways' buckets fill to their size, which passes at once; the rest goes at the line.
    assert _cross(network, up, down, 0, 1, 1.0, 8_000) == pytest.approx(1.0 + 8_000 / wire)
    left = 2_000  # what the last message left (a busy link saves nothing)
    at = 1.0 + 8_000 / wire
    assert _cross(network, up, down, 0, 1, at, 8_000) == pytest.approx(at + left / wire + (8_000 - left) / rate)
    # Back to back after a second's idle, the bucket adds no more than its size to what the line passes.
    up, down = _links(network), _links(network)
    t = 1.0
    for _ in range(100):
        t = _cross(network, up, down, 0, 1, t, 10_000)
    assert (100 * 10_000 - burst) / rate <= t - 1.0 < 100 * 10_000 / rate
    # A ring all_gather of 64 KiB on 16 hosts at 100 Mbit with 70 us a message: on plain lines each of its 15
    # steps pays the latency; with the bucket an emulated link holds, the latency passes while the bucket fills.
    plain = simulate.Network(16, 1, 11.75e6, latency=70e-6, overhead=5e-6)
    shaped = simulate.Network(16, 1, 11.75e6, latency=70e-6, overhead=5e-6, burst=61_604)
    line = 65536 * 15 / 16 / plain.rate
    assert simulate.predict(plain, "ring", 65536, op="all_gather", calls=5) > line + 15 * 70e-6
    assert line < simulate.predict(shaped, "ring", 65536, op="all_gather", calls=5) < 1.01 * line


def test_cpu_work_waits_for_a_free_core_in_the_hosts_pool_or_the_one_shared_by_every_host():
    # Four hosts of one rank, a link too fast to matter, and 1 ms of CPU per message: recursive doubling's two
    # rounds take a rank 2 ms of its own work. With one core for the whole cluster the eight messages queue for it
    # (8 ms); with a core per host, or as many shared cores as ranks, or none counted, the ranks' work overlaps.
    base = dict(hosts=4, ranks_per_host=1, rate=1e15, latency=0.0, overhead=1e-3, local_rate=1e15,
                local_latency=0.0, reduce_rate=1e15)
    own = simulate.predict(simulate.Network(**base), "recursive_doubling", 4)
    assert own == pytest.approx(2e-3, rel=1e-6)
    one_core = simulate.Network(**base, cores=1, cores_shared=True)
    assert simulate.predict(one_core, "recursive_doubling", 4) == pytest.approx(8e-3, rel=1e-6)
    assert simulate.predict(simulate.Network(**base, cores=1), "recursive_doubling", 4) == pytest.approx(2e-3, rel=1e-6)
    assert simulate.predict(simulate.Network(**base, cores=4, cores_shared=True), "recursive_doubling",
                            4) == pytest.approx(2e-3, rel=1e-6)
    # The streamed ring too: 4 ranks x 6 frames of 1 ms on one core.
    assert simulate.predict(one_core, "ring", 4096) == pytest.approx(24e-3, rel=1e-6)
    # Bytes cost CPU as well: 1 ns a byte on 4 KiB messages adds 8 x 4,096 ns on the one core.
    per_byte = simulate.Network(**base, cores=1, cores_shared=True, cpu_per_byte=1e-9)
    assert simulate.predict(per_byte, "recursive_doubling", 4096) == pytest.approx(8e-3 + 8 * 4096e-9, rel=1e-6)
    with pytest.raises(ValueError, match="method='full'"):
        simulate.predict(one_core, "ring", 4096, method="symmetric")


def test_the_symmetric_replay_bounds_a_step_by_its_host_s_cores():
    # Two ranks on each of 4 hosts, one core per host: host 0's two ranks' messages of a step queue for it.
    base = dict(hosts=4, ranks_per_host=2, rate=1e15, latency=0.0, overhead=1e-3, local_rate=1e15,
                local_latency=0.0, reduce_rate=1e15)
    free = simulate.predict(simulate.Network(**base), "recursive_doubling", 4, method="symmetric")
    queued = simulate.predict(simulate.Network(**base, cores=1), "recursive_doubling", 4, method="symmetric")
    assert free == pytest.approx(3e-3, rel=1e-6) and queued == pytest.approx(6e-3, rel=1e-6)
    assert simulate.predict(simulate.Network(**base, cores=1), "recursive_doubling", 4,
                            method="full") == pytest.approx(6e-3, rel=1e-6)


def test_a_stream_s_per_byte_cpu_overlaps_the_link_carrying_its_next_frame():
    # Two hosts, a 1 MB/s link and half a microsecond of CPU per byte: the CPU alone would take half the link's
    # time. Charged as each frame lands, it overlaps the next frame's crossing, so the ring's 1 MiB allreduce
    # costs the link's time and one frame's CPU, not 1.5 times the link's.
    base = dict(hosts=2, ranks_per_host=1, rate=1e6, latency=0.0, overhead=0.0, reduce_rate=1e15)
    line = simulate.predict(simulate.Network(**base), "ring", 1 << 20, segment=1 << 16)
    with_cpu = simulate.predict(simulate.Network(**base, cpu_per_byte=0.5e-6), "ring", 1 << 20, segment=1 << 16)
    frame_cpu = (1 << 16) * 0.5e-6
    assert line < with_cpu <= line + 2 * frame_cpu
