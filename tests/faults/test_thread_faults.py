"""Several threads, one group: a call never meets another thread's call; results are right or the calls raise
(issue 11; the rule is in ferro.collective.work's docstring)."""

import threading

import numpy as np
import pytest

import ferro
from ferro.errors import CollectiveMismatchError, ConnectionBrokenError, DistributedError
from ferro.testing import run_processes

CALLS = 200


def _race(group, groups_per_thread):
    """Threads "A" and "B" each run CALLS allreduces; return per thread (right, wrong, first error).

    The orders are made to differ for sure: on rank 0 thread A makes the first call, on rank 1 thread B,
    and the other thread starts once that first call is over (a free race often does not show on a
    loaded machine, where one thread may run all its calls before the other is scheduled).
    """
    scale = {"A": 1.0, "B": 1000.0}
    expected = {name: s * sum(r + 1 for r in range(group.world_size)) for name, s in scale.items()}
    groups = {"A": group, "B": ferro.new_group(range(group.world_size), group=group) if groups_per_thread else group}
    outcome = {}
    # With a group each the threads are independent: no order to force (it would deadlock them).
    first = None if groups_per_thread else "A" if group.rank == 0 else "B"
    first_call_over = threading.Event()

    def work(name):
        right = wrong = 0
        error = None
        if first is not None and name != first:
            first_call_over.wait(60)
        for call in range(CALLS):
            x = np.full(64, scale[name] * (group.rank + 1))
            try:
                ferro.allreduce(x, group=groups[name], timeout=30)
            except DistributedError as exc:
                error = exc
                break
            finally:
                if call == 0 and name == first:
                    first_call_over.set()
            if np.all(x == expected[name]):
                right += 1
            else:
                wrong += 1
        first_call_over.set()
        outcome[name] = (right, wrong, None if error is None else f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=work, args=(name,), name=name) for name in scale]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_two_threads_racing_on_one_group_never_get_a_wrong_result(backend):
    results = run_processes(_race, 2, args=(False,), backend=backend, timeout=240)
    errors = []
    for rank, outcome in enumerate(results):
        for name, (_right, wrong, error) in outcome.items():
            assert wrong == 0, f"rank {rank} thread {name}: {wrong} wrong results"
            if error is not None:
                errors.append(error)
                assert error.startswith((CollectiveMismatchError.__name__, ConnectionBrokenError.__name__)), error
    # The orders differ, and the first error says what happened.
    mismatches = [e for e in errors if e.startswith(CollectiveMismatchError.__name__)]
    assert mismatches, results
    assert any("threads of different names" in e and "new_group" in e for e in mismatches), mismatches


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_two_threads_with_a_group_each_are_exact(backend):
    for outcome in run_processes(_race, 2, args=(True,), backend=backend, timeout=240):
        assert outcome == {"A": (CALLS, 0, None), "B": (CALLS, 0, None)}


def _one_thread_after_another(group):
    totals = []

    def work():
        x = np.full(8, float(group.rank + 1))
        ferro.allreduce(x, group=group)
        totals.append(float(x[0]))

    worker = threading.Thread(target=work, name="loader")  # the same name on every rank
    worker.start()
    worker.join()
    work()  # then the main thread
    pending = ferro.allreduce(np.full(8, 1.0), group=group, async_op=True)  # and its async call
    totals.append(float(pending.wait()[0]))
    return totals


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_threads_taking_turns_on_a_group_are_exact(backend):
    for totals in run_processes(_one_thread_after_another, 2, backend=backend):
        assert totals == [3.0, 3.0, 2.0]
