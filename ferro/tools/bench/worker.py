"""One rank of a ``ferro bench`` sweep, for ferro or for a peer library (torch gloo, Open MPI).

Started by ``ferro bench -n`` through ``ferro run`` (or ``mpirun`` for the MPI
peer), or run directly inside any launcher: ``python -m ferro.tools.bench.worker ...``.
Every library runs the same loop -- warm-up calls, a barrier, timed calls,
the slowest rank's average kept -- through a small adapter per library.
Rank 0 prints the nccl-tests table as rows complete and writes them as JSON.
"""

from __future__ import annotations

import abc
import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ferro.tools.bench.load import LOAD_KINDS, ComputeLoad
from ferro.tools.bench.table import HEADER, Row, footer, format_row, write_json

__all__ = ["OPS", "main", "sizes_from"]

OPS = ["allreduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv", "barrier"]
REDUCING = {"allreduce", "reduce_scatter", "reduce"}
# (out-of-place call, in-place call or None, check) -- each returns the array to check
Plan = tuple[Callable[[], Any], Callable[[], Any] | None, Callable[[], int] | None]


def sizes_from(begin: int, end: int, factor: int) -> list[int]:
    """Return the sweep's sizes: ``begin``, ``begin * factor``, ... up to ``end``."""
    out, size = [], max(begin, 1)
    while size <= end:
        out.append(size)
        size *= max(factor, 2)
    return out


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class _Adapter(abc.ABC):
    """What the sweep needs from a library: its ranks, a barrier, a MAX over ranks, and each op."""

    name = ""
    rank = 0
    world_size = 1

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait for every rank."""

    @abc.abstractmethod
    def max_over_ranks(self, value: float) -> float:
        """Return the largest ``value`` over the ranks."""

    @abc.abstractmethod
    def plan(self, op: str, count: int, dtype: np.dtype, redop: str) -> Plan | None:
        """Return the calls that measure and check ``op``, or None where the library lacks it."""

    def close(self) -> None:  # noqa: B027 - optional: MPI needs no leaving
        """Leave the group."""

    def algorithm(self, op: str, nbytes: int) -> str:
        """Name the algorithm ``op`` of ``nbytes`` runs (a peer library chooses its own: its name says so)."""
        return f"{self.name}'s"

    def synchronize(self) -> None:  # noqa: B027 - host libraries finish inside the call
        """Wait for work the calls left running (GPU streams)."""


def _expected(redop: str, n: int) -> float:
    """Every element's reduced value when rank ``r`` contributes ``r + 1`` everywhere."""
    import math

    values = {"sum": n * (n + 1) / 2, "mean": (n + 1) / 2, "avg": (n + 1) / 2, "prod": float(math.factorial(n)),
              "product": float(math.factorial(n)), "min": 1.0, "max": float(n)}
    if redop not in values:
        raise ValueError(f"ferro bench: unknown --op {redop!r}; use sum, mean, prod, min or max")
    return values[redop]


class _Ferro(_Adapter):
    name = "ferro"

    def __init__(self, backend: str = "auto") -> None:
        import ferro

        self.ferro = ferro
        self.group = ferro.init_process_group(backend=backend)
        self.name = f"ferro-{type(self.group).__name__.removesuffix('Backend').lower()}"
        self.rank, self.world_size = self.group.rank, self.group.world_size

    def barrier(self) -> None:
        self.ferro.barrier()

    def algorithm(self, op: str, nbytes: int) -> str:
        """Name the algorithm ferro runs: its TCP rules (``FERRO_ALGORITHM_ALLREDUCE`` included), else the engine."""
        from ferro.backend.hierarchical import HierarchicalBackend
        from ferro.collective.resolve import resolve_allreduce_algorithm

        n = self.world_size
        kind = type(self.group).__name__
        if isinstance(self.group, HierarchicalBackend):  # the leaders' allreduce is chosen for their own shape
            if op == "allreduce":
                chosen = resolve_allreduce_algorithm(*self.group.exchange_shape(nbytes, n))
                return chosen if self.group.runs_flat(op, nbytes) else f"two-level {chosen}"
            return self.group.plan_name(op, nbytes)
        if kind != "TcpBackend":
            return {"ShmBackend": "shared-memory arena", "MpiBackend": "MPI's"}.get(kind, kind)
        if op == "allreduce":
            return resolve_allreduce_algorithm(nbytes, n)
        native_calls = self.group.native
        if op in ("all_gather", "broadcast", "all_to_all", "reduce") and native_calls is not None:
            return native_calls.direct_mesh.choose(op, nbytes)  # the mesh's own choice, by its cost forms
        return {"reduce_scatter": "ring", "all_to_all": "pairwise", "barrier": "dissemination",
                "reduce": "binomial tree", "gather": "direct", "scatter": "direct"}.get(op, "")

    def max_over_ranks(self, value: float) -> float:
        x = np.array([value])
        self.ferro.allreduce(x, op=self.ferro.ReduceOp.MAX)
        return float(x[0])

    def plan(self, op: str, count: int, dtype: np.dtype, redop: str) -> Plan | None:
        f, n, r = self.ferro, self.world_size, self.rank
        reduce_op = f.ReduceOp[{"prod": "PRODUCT"}.get(redop, redop.upper())] if op in REDUCING else None
        mine = np.full(count, r + 1, dtype)
        if op == "allreduce":
            buf = mine.copy()
            expected = _expected(redop, n)

            def check() -> int:
                y = mine.copy()
                f.allreduce(y, reduce_op)
                return int(np.count_nonzero(y.astype(np.float64) != expected))
            return (lambda: f.allreduce(mine.copy(), reduce_op), lambda: f.allreduce(buf, reduce_op), check)
        if op == "all_gather":
            out = np.empty(count * n, dtype)
            block = out[r * count:(r + 1) * count]
            block[:] = mine
            want = np.repeat(np.arange(1, n + 1), count).astype(np.float64)
            return (lambda: f.all_gather(mine), lambda: f.all_gather(block, out=out),
                    lambda: int(np.count_nonzero(f.all_gather(mine).astype(np.float64) != want)))
        if op == "reduce_scatter":
            expected = _expected(redop, n)
            return (lambda: f.reduce_scatter(mine, reduce_op), None,
                    lambda: int(np.count_nonzero(f.reduce_scatter(mine, reduce_op).astype(np.float64) != expected)))
        if op == "broadcast":
            buf = mine.copy()

            def check() -> int:
                y = mine.copy()
                f.broadcast(y, root=0)
                return int(np.count_nonzero(y.astype(np.float64) != 1))
            return (lambda: f.broadcast(mine.copy(), root=0), lambda: f.broadcast(buf, root=0), check)
        if op == "reduce":
            expected = _expected(redop, n)

            def check() -> int:  # the root holds the result; the others' buffers are untouched
                y = mine.copy()
                f.reduce(y, dst=0, op=reduce_op)
                return int(np.count_nonzero(y.astype(np.float64) != (expected if r == 0 else r + 1)))
            return (lambda: f.reduce(mine.copy(), dst=0, op=reduce_op), None, check)
        if op == "all_to_all":
            if count % n:
                return None
            send = np.repeat(np.arange(n) + 10 * r, count // n).astype(dtype)
            want = np.repeat(np.arange(n) * 10 + r, count // n).astype(np.float64)
            return (lambda: f.all_to_all(send), None,
                    lambda: int(np.count_nonzero(f.all_to_all(send).astype(np.float64) != want)))
        if op == "sendrecv":
            group, incoming = self.group, np.empty_like(mine)
            nxt, prv = (r + 1) % n, (r - 1) % n

            def exchange() -> None:
                if n > 1:
                    group.sendrecv(mine, nxt, incoming, prv)

            def check() -> int:
                exchange()
                return int(np.count_nonzero(incoming.astype(np.float64) != prv + 1)) if n > 1 else 0
            return (exchange, None, check)
        if op == "barrier":
            return (self.barrier, None, None)
        return None

    def close(self) -> None:
        self.ferro.destroy_process_group()


class _Gloo(_Adapter):
    name = "torch-gloo"

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def barrier(self) -> None:
        self.dist.barrier()

    def max_over_ranks(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t[0])

    def plan(self, op: str, count: int, dtype: np.dtype, redop: str) -> Plan | None:
        torch, dist, n, r = self.torch, self.dist, self.world_size, self.rank
        if dtype.name == "bfloat16":
            return None
        mine = torch.from_numpy(np.full(count, r + 1, dtype))
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "prod": dist.ReduceOp.PRODUCT}.get(redop)
        if op == "allreduce" and red is not None:
            buf = mine.clone()
            return (lambda: dist.all_reduce(mine.clone(), op=red), lambda: dist.all_reduce(buf, op=red), None)
        if op == "all_gather":
            out = torch.empty(count * n, dtype=mine.dtype)
            return (lambda: dist.all_gather_into_tensor(out, mine), None, None)
        if op == "broadcast":
            buf = mine.clone()
            return (lambda: dist.broadcast(mine.clone(), src=0), lambda: dist.broadcast(buf, src=0), None)
        if op == "reduce" and red is not None:
            return (lambda: dist.reduce(mine.clone(), dst=0, op=red), None, None)
        if op == "all_to_all" and count % n == 0:
            out = torch.empty_like(mine)
            return (lambda: dist.all_to_all_single(out, mine), None, None)
        if op == "sendrecv":
            incoming = torch.empty_like(mine)

            def exchange() -> None:
                if n > 1:
                    ops = [dist.P2POp(dist.isend, mine, (r + 1) % n), dist.P2POp(dist.irecv, incoming, (r - 1) % n)]
                    for work in dist.batch_isend_irecv(ops):
                        work.wait()
            return (exchange, None, None)
        if op == "barrier":
            return (self.barrier, None, None)
        return None  # reduce_scatter is not implemented by torch's gloo backend

    def close(self) -> None:
        self.dist.destroy_process_group()


class _Mpi(_Adapter):
    name = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self) -> None:
        self.comm.Barrier()

    def max_over_ranks(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self.MPI.MAX))

    def plan(self, op: str, count: int, dtype: np.dtype, redop: str) -> Plan | None:
        MPI, comm, n, r = self.MPI, self.comm, self.world_size, self.rank
        if dtype.name in ("bfloat16", "float16"):
            return None
        mine = np.full(count, r + 1, dtype)
        red = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}.get(redop)
        if op == "allreduce" and red is not None:
            buf, out = mine.copy(), np.empty_like(mine)
            return (lambda: comm.Allreduce(mine, out, op=red), lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=red),
                    None)
        if op == "all_gather":
            out = np.empty(count * n, dtype)
            return (lambda: comm.Allgather(mine, out), None, None)
        if op == "reduce_scatter" and red is not None and count % n == 0:
            out = np.empty(count // n, dtype)
            return (lambda: comm.Reduce_scatter_block(mine, out, op=red), None, None)
        if op == "broadcast":
            buf = mine.copy()
            return (lambda: comm.Bcast(mine.copy(), root=0), lambda: comm.Bcast(buf, root=0), None)
        if op == "reduce" and red is not None:
            out = np.empty_like(mine)
            return (lambda: comm.Reduce(mine, out, op=red, root=0), None, None)
        if op == "all_to_all" and count % n == 0:
            out = np.empty_like(mine)
            return (lambda: comm.Alltoall(mine, out), None, None)
        if op == "sendrecv":
            incoming = np.empty_like(mine)
            return (lambda: comm.Sendrecv(mine, (r + 1) % n, recvbuf=incoming, source=(r - 1) % n), None, None)
        if op == "barrier":
            return (self.barrier, None, None)
        return None


class _CudaTensors(_Adapter):
    """What the GPU adapters share: CUDA tensors on this rank's device, and the calls on them."""

    torch: Any

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def _calls(self, op: str, count: int, dtype: np.dtype, redop: str, allreduce: Callable[[Any], Any],
               all_gather: Callable[[Any, Any], Any], reduce_scatter: Callable[[Any, Any], Any],
               broadcast: Callable[[Any], Any]) -> Plan | None:
        torch, n, r = self.torch, self.world_size, self.rank
        if dtype.name not in ("float32", "float64", "float16", "int32", "int64", "int8", "uint8"):
            return None
        mine = torch.full((count,), r + 1, dtype=getattr(torch, dtype.name), device="cuda")
        if op == "allreduce":
            buf = mine.clone()
            expected = _expected(redop, n)

            def check() -> int:
                y = mine.clone()
                allreduce(y)
                self.synchronize()
                return int((y.double() != expected).sum())
            return (lambda: allreduce(mine.clone()), lambda: allreduce(buf), check)
        if op == "all_gather":
            out = torch.empty(count * n, dtype=mine.dtype, device="cuda")
            return (lambda: all_gather(out, mine), None, None)
        if op == "reduce_scatter" and count % n == 0:
            out = torch.empty(count // n, dtype=mine.dtype, device="cuda")
            return (lambda: reduce_scatter(out, mine), None, None)
        if op == "broadcast":
            buf = mine.clone()
            return (lambda: broadcast(mine.clone()), lambda: broadcast(buf), None)
        if op == "barrier":
            return (self.barrier, None, None)
        return None


class _FerroGpu(_CudaTensors):
    """ferro's NCCL or hybrid group on CUDA tensors."""

    def __init__(self, backend: str) -> None:
        import os

        import torch

        import ferro

        self.torch, self.ferro = torch, ferro
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        self.group = ferro.init_process_group(backend=backend)
        self.name = f"ferro-{backend}"
        self.rank, self.world_size = self.group.rank, self.group.world_size

    def barrier(self) -> None:
        self.ferro.barrier()

    def max_over_ranks(self, value: float) -> float:
        x = self.torch.tensor([value], dtype=self.torch.float64, device="cuda")
        self.ferro.allreduce(x, op=self.ferro.ReduceOp.MAX)
        return float(x.cpu()[0])

    def plan(self, op: str, count: int, dtype: np.dtype, redop: str) -> Plan | None:
        f = self.ferro
        reduce_op = f.ReduceOp[{"prod": "PRODUCT"}.get(redop, redop.upper())]
        return self._calls(op, count, dtype, redop, lambda x: f.allreduce(x, reduce_op),
                           lambda out, x: f.all_gather(x, out=out),
                           lambda out, x: f.reduce_scatter(x, reduce_op), lambda x: f.broadcast(x, root=0))

    def close(self) -> None:
        self.ferro.destroy_process_group()


class _TorchNccl(_CudaTensors):
    """torch.distributed's NCCL group on CUDA tensors: the peer of ferro's NCCL."""

    name = "torch-nccl"

    def __init__(self) -> None:
        import os

        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def barrier(self) -> None:
        self.dist.barrier()

    def max_over_ranks(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device="cuda")
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.cpu()[0])

    def plan(self, op: str, count: int, dtype: np.dtype, redop: str) -> Plan | None:
        dist = self.dist
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "prod": dist.ReduceOp.PRODUCT, "mean": dist.ReduceOp.AVG}.get(redop)
        if red is None:
            return None
        return self._calls(op, count, dtype, redop, lambda x: dist.all_reduce(x, op=red),
                           lambda out, x: dist.all_gather_into_tensor(out, x),
                           lambda out, x: dist.reduce_scatter_tensor(out, x, op=red),
                           lambda x: dist.broadcast(x, src=0))

    def close(self) -> None:
        self.dist.destroy_process_group()


ADAPTERS = {"ferro": _Ferro, "torch-gloo": _Gloo, "mpi": _Mpi, "torch-nccl": _TorchNccl}
GPU_BACKENDS = ("nccl", "hybrid")


def _count_for(op: str, nbytes: int, itemsize: int, n: int) -> tuple[int, int]:
    """(elements per rank's input, the row's size in bytes) for a requested size."""
    if op == "all_gather":
        per_rank = max(nbytes // itemsize // n, 1)
        return per_rank, per_rank * n * itemsize
    if op in ("reduce_scatter", "all_to_all"):
        total = max(nbytes // itemsize // n, 1) * n
        return total, total * itemsize
    count = max(nbytes // itemsize, 1)
    return count, count * itemsize


def timed_calls(iters: int, size: int) -> int:
    """How many calls a row of ``size`` bytes times back to back: ``iters``, fewer above 4 MB (same bytes)."""
    return max(1, min(iters, int(iters * 4e6 / max(size, 4e6)))) if size else iters


def machine_busy_seconds() -> float | None:
    """Return the CPU seconds this machine's cores have spent busy since boot (``/proc/stat``), None off Linux.

    Busy is everything but idle and I/O wait: every process's user and system time, and the kernel's interrupt
    and softirq work, which on an emulated cluster (``--emulate``) carries the links' packets for every host.
    The kernel counts it in ticks (10 ms), so only a span of many calls measures it well.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _time(adapter: _Adapter, call: Callable[[], Any], iters: int, warmup: int) -> tuple[float, float | None]:
    """Return the slowest rank's microseconds per call, and the machine's busy CPU microseconds per call.

    The CPU figure is rank 0's machine (every rank's, on one host or an emulated cluster), read by rank 0 alone
    (None on the others): from before the barrier that starts the timed calls until every rank has finished
    them, so the reading delays no rank's start; it also holds the barrier's and the agreement on the slowest
    time, two small collectives, well inside the kernel's 10 ms ticks.
    """
    for _ in range(warmup):
        call()
    adapter.synchronize()
    reads_cpu = adapter.rank == 0
    busy_before = machine_busy_seconds() if reads_cpu else None
    adapter.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    adapter.synchronize()
    mine = (time.perf_counter() - start) / iters * 1e6
    slowest = adapter.max_over_ranks(mine)
    busy_after = machine_busy_seconds() if reads_cpu else None
    cpu = None if busy_before is None or busy_after is None else (busy_after - busy_before) / iters * 1e6
    return slowest, cpu


def sweep(adapter: _Adapter, ops: list[str], sizes: list[int], dtype: np.dtype, redop: str, iters: int,
          warmup: int, check: bool, show: Callable[[str], None], rows: list[Row]) -> None:
    """Measure every op at every size, appending each row to ``rows`` as it completes."""
    progress = _progress(adapter.rank == 0, len(ops) * len(sizes))
    for op in ops:
        show(f"#\n# {op} on {adapter.name}, {adapter.world_size} ranks")
        show(HEADER)
        for nbytes in ([0] if op == "barrier" else sizes):
            count, size = _count_for(op, nbytes, dtype.itemsize, adapter.world_size) if op != "barrier" else (0, 0)
            plan = adapter.plan(op, max(count, 1), dtype, redop)
            progress()
            if plan is None:
                show(f"# {op} with {dtype.name}/{redop} is not available in {adapter.name}; skipped")
                break
            out_of_place, in_place, checker = plan
            scaled = timed_calls(iters, size)
            oop, oop_cpu = _time(adapter, out_of_place, scaled, warmup)
            ip, ip_cpu = _time(adapter, in_place, scaled, warmup) if in_place is not None else (None, None)
            wrong = int(adapter.max_over_ranks(float(checker()))) if check and checker is not None else None
            row = Row(adapter.name, op, size, count, dtype.name, redop if op in REDUCING else "none",
                      0 if op in ("broadcast", "reduce") else -1, adapter.world_size, oop, ip, wrong,
                      wrong if ip is not None else None, adapter.algorithm(op, size),
                      ip_cpu if ip is not None else oop_cpu)
            rows.append(row)
            show(format_row(row))
    show(footer(rows))


def _progress(enabled: bool, total: int) -> Callable[[], None]:
    """Return a step function for a tqdm bar on stderr when tqdm is installed and the sweep is long."""
    if not enabled or total < 20 or not sys.stderr.isatty():
        return lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda: None
    bar = tqdm(total=total, file=sys.stderr, leave=False, desc="ferro bench")
    return lambda: bar.update(1)


def build_parser() -> argparse.ArgumentParser:
    """Return the worker's parser (the orchestrator passes these through)."""
    parser = argparse.ArgumentParser(prog="python -m ferro.tools.bench.worker")
    parser.add_argument("--library", choices=list(ADAPTERS), default="ferro")
    parser.add_argument("--backend", default="auto", help="ferro's backend: auto or a name of ferro.backend.BACKENDS")
    parser.add_argument("--ops", default="allreduce")
    parser.add_argument("--sizes", required=True, help="comma-separated byte sizes")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--redop", default="sum")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out", help="rank 0 writes the rows here as JSON")
    parser.add_argument("--quiet", action="store_true", help="do not print the table")
    parser.add_argument("--load", type=int, default=0, help="compute threads beside the sweep in this rank")
    parser.add_argument("--load-kind", default="numpy", choices=LOAD_KINDS, help="their matrix products")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one rank's sweep."""
    args = build_parser().parse_args(argv)
    adapter: _Adapter
    if args.library == "ferro":
        adapter = _FerroGpu(args.backend) if args.backend in GPU_BACKENDS else _Ferro(args.backend)
    else:
        adapter = ADAPTERS[args.library]()
    rows: list[Row] = []

    def show(line: str) -> None:
        if adapter.rank == 0 and not args.quiet:
            print(line, flush=True)

    if args.load:
        show(f"# beside {args.load} compute thread(s) per rank ({args.load_kind} matmuls)")
    try:
        with ComputeLoad(args.load, args.load_kind) as load:
            sweep(adapter, args.ops.split(","), [int(s) for s in args.sizes.split(",")], _dtype(args.dtype),
                  args.redop, args.iters, args.warmup, args.check, show, rows)
        if args.load:
            show(f"# the compute threads of rank {adapter.rank} ran at {load.gflops:.1f} GFLOP/s")
    except KeyboardInterrupt:
        show("# interrupted: the rows above are what was measured")
        return 130
    finally:
        if adapter.rank == 0 and args.out:
            write_json(args.out, rows)
        adapter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
