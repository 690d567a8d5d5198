"""What the MPI tests run on every rank, under ``mpirun``: ``python _mpi_check.py SCENARIO OUT_DIR``.

Each rank writes what it saw to ``OUT_DIR/rank<N>.json``; tests/test_mpi.py
compares that with NumPy and single-process references.
"""

import json
import os
import sys
import time

import numpy as np

import ferro
from ferro.testing.conformance import check_collectives


def conformance(group):
    report = check_collectives(group)
    return {"cases": report.cases, "failures": report.failures, "digest": report.digest}


def async_ops(group):
    n, r = group.world_size, group.rank
    base = np.arange(1000, dtype=np.float64) * (r + 1)
    x, y = base.copy(), base[::-1].copy()
    # several collectives in flight at once, completed in reverse order
    handles = [ferro.allreduce(x, group=group, async_op=True),
               ferro.allreduce(y, ferro.ReduceOp.MEAN, group=group, async_op=True),
               ferro.all_gather(np.full(3, r, np.int32), group=group, async_op=True),
               ferro.reduce_scatter(np.arange(12.0 * n).reshape(4 * n, 3) + r, group=group, async_op=True),
               ferro.broadcast(np.full(5, r, np.int64), root=n - 1, group=group, async_op=True),
               ferro.barrier(group=group, async_op=True)]
    handles[-1].is_completed()  # testing before wait() progresses the requests; it must not raise
    results = [h.wait() for h in reversed(handles)][::-1]
    scale = n * (n + 1) / 2
    reduced_rows = (np.arange(12.0 * n).reshape(4 * n, 3) * n + n * (n - 1) / 2)[4 * r:4 * (r + 1)]
    return {"allreduce": bool(np.array_equal(results[0], np.arange(1000.0) * scale)),
            "mean": bool(np.allclose(results[1], np.arange(1000.0)[::-1] * scale / n, rtol=1e-15)),
            "all_gather": results[2].tolist() == [k for k in range(n) for _ in range(3)],
            "reduce_scatter": bool(np.array_equal(results[3], reduced_rows)),
            "broadcast": results[4].tolist() == [n - 1] * 5, "barrier": results[5] is None,
            "completed": all(h.is_completed() for h in handles)}


def p2p(group):
    from ferro._core.status import KIND_COLLECTIVE
    from ferro.errors import CollectiveMismatchError, DistributedTimeoutError, SizeMismatchError
    from ferro.types import fingerprint

    r, seen = group.rank, {}
    one, two = fingerprint("allreduce", 2, 0, 0, 4), fingerprint("broadcast", 2, 0, 0, 4)
    if r == 0:
        group.send_tagged(np.arange(4.0), 1, kind=KIND_COLLECTIVE, fingerprint=one)
        ferro.p2p.send(np.arange(6).reshape(2, 3), dst=1, tag=9, group=group)
        ferro.p2p.isend(np.ones(2, np.float32), dst=1, tag=3, group=group).wait()
        buf = np.empty(1_000_000, np.uint8)
        group.recv(buf, 1)
        seen["big"] = bool((buf == 7).all())
    elif r == 1:
        buf = np.empty(4)
        try:
            group.recv_tagged(buf, 0, kind=KIND_COLLECTIVE, fingerprint=two)
        except CollectiveMismatchError as exc:
            seen["mismatch"] = str(exc)
        try:
            group.recv_tagged(np.empty(3), 0, kind=KIND_COLLECTIVE, fingerprint=one)
        except SizeMismatchError as exc:
            seen["size"] = str(exc)
        group.recv_tagged(buf, 0, kind=KIND_COLLECTIVE, fingerprint=one)  # still queued after both refusals
        seen["kept"] = buf.tolist()
        seen["tagged"] = [ferro.p2p.irecv(src=0, tag=3, group=group).wait().tolist(),
                          ferro.p2p.recv(src=0, tag=9, group=group).tolist()]
        try:
            group.recv(np.empty(1), 0, timeout=0.3)
        except DistributedTimeoutError as exc:
            seen["timeout"] = str(exc)
        group.send(np.full(1_000_000, 7, np.uint8), 0)
    ferro.barrier(group=group)
    return seen


def any_source(group):
    if group.rank != 0:
        ferro.p2p.send(np.full(2, float(group.rank)), dst=0, tag=4, group=group)
        ferro.barrier(group=group)
        return None
    got = sorted((src, x.tolist()) for src, x in (ferro.p2p.recv_any(tag=4, group=group) for _ in range(2)))
    ferro.barrier(group=group)
    return got


def mismatch(group):
    from ferro.errors import CollectiveMismatchError

    try:
        ferro.allreduce(np.ones(4 if group.rank == 0 else 8, np.float32), group=group)
    except CollectiveMismatchError as exc:
        return {"error": str(exc), "peer": exc.peer}
    return {"error": None}


def ddp(group):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_ddp import data, numpy_model, torch_model, train_numpy, train_torch

    numpy_params = train_numpy(numpy_model(seed=group.rank + 100), data(), (group.rank, group.world_size),
                               lambda m: ferro.DDP(m, group=group, bucket_cap_mb=0.0005, first_bucket_mb=0.0001))
    torch_params = train_torch(torch_model(seed=group.rank + 5), data(), (group.rank, group.world_size),
                               lambda m: ferro.DDP(m, group=group, bucket_cap_mb=0.0005, first_bucket_mb=0.0001))
    return {"numpy": [p.tolist() for p in numpy_params], "torch": [p.tolist() for p in torch_params]}


def subgroups(group):
    from mpi4py import MPI

    from ferro.backend.mpi import MpiBackend

    r = group.rank
    evens = ferro.new_group([k for k in range(group.world_size) if k % 2 == 0], group=group)
    odds = ferro.new_group([k for k in range(group.world_size) if k % 2 == 1], group=group)
    mine = evens if r % 2 == 0 else odds
    x = np.array([float(r)])
    ferro.allreduce(x, group=mine)
    parity = MpiBackend.from_comm(MPI.COMM_WORLD.Split(color=r % 2, key=r))
    y = np.array([float(r)])
    ferro.allreduce(y, group=parity)
    return {"sub": [mine.rank, mine.world_size, x.tolist()], "from_comm": [parity.rank, parity.world_size,
                                                                          y.tolist()],
            "other": (odds if r % 2 == 0 else evens) is None}


def huge(group):
    count = 2**31 + 3  # 2**31 / itemsize + 3 elements of uint8: a count no C int holds
    x = np.empty(count, np.uint8)
    x[:] = group.rank + 1
    x[-1] = 200  # overflows on two ranks: wraps to 144
    ferro.allreduce(x, group=group)
    head, boundary, tail = x[:4].tolist(), x[2**31 - 2:2**31 + 2].tolist(), x[-3:].tolist()
    total = int(np.count_nonzero(x[:-1] != sum(range(1, group.world_size + 1))))
    del x
    return {"head": head, "boundary": boundary, "tail": tail, "wrong": total}


def raises(group):
    if group.rank == 1:
        raise RuntimeError("this rank failed on purpose")
    ferro.barrier(group=group)  # would wait forever for rank 1 without the abort hook
    return {}


def stall(group):
    if group.rank == 1:
        time.sleep(60)  # never arrives within rank 0's timeout
    ferro.barrier(group=group, timeout=1.0)
    return {}


def auto(group):
    return {"type": type(group).__name__}


SCENARIOS = {f.__name__: f for f in (conformance, async_ops, p2p, any_source, mismatch, ddp, subgroups, huge, raises,
                                      stall, auto)}


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    group = ferro.init_process_group(backend="auto" if scenario == "auto" else "mpi")
    result = SCENARIOS[scenario](group)
    with open(os.path.join(out_dir, f"rank{group.rank}.json"), "w") as f:
        json.dump(result, f)
    ferro.destroy_process_group()


if __name__ == "__main__":
    main()
