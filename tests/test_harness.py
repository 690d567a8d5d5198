"""The multi-rank harness: results, failures, hangs and deliberate deaths are reported, never hung on."""

import os
import time

import numpy as np
import pytest

import ferro
from ferro.testing import RankExit, run_processes, run_threads


def rank_returns_identity(group):
    return group.rank, group.world_size


def rank_one_fails_while_zero_waits(group):
    if group.rank == 1:
        raise ValueError("deliberate failure on rank 1")
    group.recv(np.empty(1), 1, timeout=300)  # would wait long; the harness must not
    return "unreachable"


def rank_hangs_in_a_named_function(group):
    def stuck_waiting_for_godot():
        time.sleep(300)

    if group.rank == 1:
        stuck_waiting_for_godot()
    return "ok"


def rank_exits_early(group):
    if group.rank == 1:
        os._exit(3)
    return "ok"


def test_processes_return_every_rank_result():
    assert run_processes(rank_returns_identity, 3) == [(0, 3), (1, 3), (2, 3)]


def test_threads_return_every_rank_result():
    assert run_threads(rank_returns_identity, 3) == [(0, 3), (1, 3), (2, 3)]


def test_process_failure_ships_the_traceback_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(ferro.RankFailedError) as info:
        run_processes(rank_one_fails_while_zero_waits, 2, timeout=120)
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in info.value.remote_traceback
    assert "rank_one_fails_while_zero_waits" in info.value.remote_traceback
    assert time.monotonic() - start < 60  # rank 0 was killed, not waited for


def rank_one_fails_then_closes_slowly(group):
    if group.rank == 1:
        close = group.close

        def close_then_stall():
            close()  # rank 0 fails now...
            time.sleep(1.0)  # ...while rank 1 is still unwinding (as under load, or lingering after an abort)

        group.close = close_then_stall
        raise ValueError("deliberate failure on rank 1")
    group.recv(np.empty(1), 1, timeout=300)


def test_the_cause_is_reported_though_the_failed_rank_is_slow_to_close_its_group():
    # Rank 0's failure is a consequence and reaches the harness first: the cause must still win.
    with pytest.raises(ferro.RankFailedError) as info:
        run_processes(rank_one_fails_then_closes_slowly, 2, timeout=120)
    assert info.value.rank == 1, info.value
    assert "deliberate failure on rank 1" in info.value.remote_traceback


def test_thread_failure_aborts_the_group():
    with pytest.raises(ferro.RankFailedError) as info:
        run_threads(rank_one_fails_while_zero_waits, 2, timeout=120)
    assert info.value.rank == 1 and "deliberate failure" in str(info.value)


def test_process_hang_reports_the_stacks():
    with pytest.raises(ferro.DistributedTimeoutError) as info:
        run_processes(rank_hangs_in_a_named_function, 2, timeout=3)
    assert "ranks [1]" in str(info.value)
    assert "stuck_waiting_for_godot" in str(info.value)


def test_thread_hang_reports_the_stacks():
    def stuck(group):
        # Both ranks receive and nobody sends: a deadlock the harness must report, not wait out.
        group.recv(np.empty(1), 1 - group.rank, timeout=5)

    with pytest.raises(ferro.DistributedTimeoutError, match="simulated ranks \\[0, 1\\]") as info:
        run_threads(stuck, 2, timeout=0.5)
    assert "stuck" in str(info.value)


def test_early_exit_is_a_failure_unless_allowed():
    with pytest.raises(ferro.RankFailedError, match="exited with status 3"):
        run_processes(rank_exits_early, 2)
    assert run_processes(rank_exits_early, 2, allow_exit={1}) == ["ok", RankExit(3, None)]
