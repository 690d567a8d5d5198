"""Allreduce: ferro beside Intel oneCCL (the CPU collectives library), idle and beside compute threads.

oneCCL's PyPI runtime (``pip install --prefix PREFIX oneccl-cpu==2022.1.2 impi-rt intel-cmplr-lib-rt``)
ships the libraries but no benchmark and no headers, so this script compiles the short one in
``bench/oneccl/allreduce.cpp`` against oneCCL's public headers (``--include``: the ``include``
folder of a checkout of https://github.com/uxlfoundation/oneCCL, e.g. tag 2021.14, whose v1 API the
2022.1 library keeps) and links it to the installed library. The runtime's ``libccl.so.1`` asks
for ``libccl.so.2``, which the wheel lacks: a link to itself in a temporary folder stands in.

The oneCCL ranks exchange its key-value store's address through a file, in four settings: over
its libfabric transport (``oneccl-ofi``: ``CCL_ATL_TRANSPORT=ofi``, ranks started here) or over
the wheel's Intel MPI on shared memory (``oneccl-impi``: ``CCL_ATL_TRANSPORT=mpi``,
``I_MPI_FABRICS=shm``, ranks started by its ``mpiexec``); each with its defaults (a worker thread
per rank runs the collectives) and with ``-direct`` (``CCL_WORKER_OFFLOAD=0``: the calling
thread runs them). The ratio is against the best of them at each size. ferro runs the same
sizes through ``ferro bench``'s ranks (``--backend shm`` by default). Rounds are interleaved and the
table gives the median per size; ``--load N`` puts N compute threads in every rank of every library.

Run: ``python bench/bench_oneccl.py --prefix PREFIX --include oneCCL/include [--load 1]
[--repeats 3] [--max-bytes 16777216] [-n 2]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from ferro.rendezvous.settings import free_port
from ferro.tools.bench.load import single_threaded_blas

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_allreduce import run_peer, seconds_by_size, sizes  # noqa: E402 - the sibling script, as bench_shm's

HERE = os.path.dirname(os.path.abspath(__file__))
# name: oneCCL's transport (ATL) and settings. "ofi" ranks are started here, "mpi" ranks by Intel MPI's mpiexec.
SETTINGS = {"oneccl-ofi": ("ofi", {}), "oneccl-ofi-direct": ("ofi", {"CCL_WORKER_OFFLOAD": "0"}),
            "oneccl-impi": ("mpi", {}), "oneccl-impi-direct": ("mpi", {"CCL_WORKER_OFFLOAD": "0"})}


def build(prefix: str, include: str, folder: str) -> tuple[str, str]:
    """Compile the benchmark; return (its path, the library folder to put on LD_LIBRARY_PATH)."""
    lib = os.path.join(prefix, "lib")
    library = os.path.join(lib, "libccl.so.1")
    if not os.path.exists(library):
        raise SystemExit(f"bench_oneccl: no {library}; pip install --prefix {prefix} oneccl-cpu==2022.1.2 impi-rt "
                         "intel-cmplr-lib-rt")
    if not os.path.exists(os.path.join(include, "oneapi", "ccl.hpp")):
        raise SystemExit(f"bench_oneccl: no oneapi/ccl.hpp under {include}; git clone --depth 1 --branch 2021.14 "
                         "https://github.com/uxlfoundation/oneCCL and pass --include oneCCL/include")
    links = os.path.join(folder, "lib")
    os.makedirs(links)
    for name in ("libccl.so", "libccl.so.2"):  # the linker's name, and the one the runtime asks for
        os.symlink(library, os.path.join(links, name))
    binary = os.path.join(folder, "allreduce")
    # libccl leaves the Intel compiler's runtime (libirc, libintlc: intel-cmplr-lib-rt) to the program.
    source = os.path.join(HERE, "oneccl", "allreduce.cpp")
    subprocess.run(["g++", "-O2", "-std=c++17", "-pthread", "-I", include, source,
                    "-L", links, "-L", lib, "-lccl", "-lirc", "-lintlc", "-o", binary], check=True)
    return binary, f"{links}:{lib}"


def run_oneccl(binary: str, libraries: str, setting: str, ranks: int, max_bytes: int, iters: int,
               load: int, folder: str) -> dict[int, float]:
    """One sweep of ``setting`` on ``ranks`` local ranks; {bytes: microseconds per call}."""
    address = os.path.join(folder, f"kvs-{setting}-{os.getpid()}-{free_port()}")
    transport, settings = SETTINGS[setting]
    env = dict(os.environ, LD_LIBRARY_PATH=libraries, CCL_ATL_TRANSPORT=transport, CCL_PROCESS_LAUNCHER="none",
               CCL_LOCAL_SIZE=str(ranks), I_MPI_FABRICS="shm", **settings)
    arguments = [address, str(iters), str(min(iters, 100)), str(load), *map(str, sizes(max_bytes))]
    processes = []
    if transport == "mpi":  # Intel MPI's launcher; its PMI gives each rank its number
        mpiexec = os.path.join(os.path.dirname(libraries.rsplit(":", 1)[1]), "bin", "mpiexec")
        script = f'exec {binary} "$PMI_RANK" {ranks} ' + " ".join(arguments)
        processes.append(subprocess.Popen([mpiexec, "-n", str(ranks), "sh", "-c", script], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank in range(ranks if transport == "ofi" else 0):
        env["CCL_LOCAL_RANK"] = str(rank)
        processes.append(subprocess.Popen([binary, str(rank), str(ranks), *arguments], env=dict(env),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=1800) for p in processes]
    if any(p.returncode for p in processes):
        raise SystemExit(f"bench_oneccl: {setting} failed: {outputs[0][1][-1500:]}{outputs[-1][1][-800:]}")
    found = {}
    for line in outputs[0][0].splitlines():
        if not re.fullmatch(r"\d+ \d+\.\d+ \d+", line):
            continue  # oneCCL's and Intel MPI's own messages
        nbytes, micros, wrong = line.split()
        if int(wrong):
            raise SystemExit(f"bench_oneccl: {setting} gave {wrong} wrong elements at {nbytes} B")
        found[int(nbytes)] = float(micros)
    return found


def run_ferro(backend: str, ranks: int, max_bytes: int, iters: int, load: int, folder: str) -> dict[int, float]:
    """One sweep of ferro's ``backend`` through bench_allreduce.py's runner; {bytes: microseconds per call}."""
    out = os.path.join(folder, f"ferro-{backend}.json")
    if not run_peer(f"ferro-{backend}", ranks, max_bytes, out, load, iters=iters):
        raise SystemExit(f"bench_oneccl: ferro-{backend} failed")
    return {size: seconds * 1e6 for size, seconds in seconds_by_size(out).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default=sys.prefix, help="where oneccl-cpu, impi-rt and intel-cmplr-lib-rt are")
    parser.add_argument("--include", default=os.environ.get("ONECCL_INCLUDE", ""),
                        help="oneCCL's include folder (default $ONECCL_INCLUDE)")
    parser.add_argument("-n", "--ranks", type=int, default=2)
    parser.add_argument("--backends", default="shm,tcp", help="ferro's backends to run")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"any of {', '.join(SETTINGS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--max-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--load", type=int, default=0, help="compute threads per rank beside the sweep")
    args = parser.parse_args(argv)
    if args.load:
        single_threaded_blas(os.environ)
    if shutil.which("g++") is None:
        raise SystemExit("bench_oneccl: needs g++ to build the oneCCL benchmark")
    columns = [f"ferro-{b}" for b in args.backends.split(",") if b] + [s for s in args.settings.split(",") if s]
    rounds: dict[str, list[dict[int, float]]] = {column: [] for column in columns}
    with tempfile.TemporaryDirectory(prefix="ferro-oneccl-") as folder:
        binary, libraries = build(args.prefix, args.include, folder)
        for repeat in range(args.repeats):
            for column in columns:
                if column.startswith("ferro-"):
                    found = run_ferro(column.removeprefix("ferro-"), args.ranks, args.max_bytes, args.iters,
                                      args.load, folder)
                else:
                    found = run_oneccl(binary, libraries, column, args.ranks, args.max_bytes, args.iters, args.load,
                                       folder)
                rounds[column].append(found)
                print(f"# round {repeat + 1}/{args.repeats}: {column} done", file=sys.stderr, flush=True)
    beside = f", beside {args.load} compute thread(s) per rank" if args.load else ""
    print(f"# allreduce float32 SUM in place, {args.ranks} ranks on one host{beside}; us per call, median of "
          f"{args.repeats} rounds; ratio = the best oneCCL setting's time / ferro's (above 1: ferro is faster)")
    header = f"{'bytes':>10}" + "".join(f"{column:>20}" for column in columns)
    ferro_columns = [c for c in columns if c.startswith("ferro-")]
    oneccl_columns = [c for c in columns if not c.startswith("ferro-")]
    header += "".join(f"{'vs ' + c:>14}" for c in ferro_columns) if oneccl_columns else ""
    print(header)
    for nbytes in sizes(args.max_bytes):
        median = {c: statistics.median(r[nbytes] for r in rounds[c]) for c in columns}
        line = f"{nbytes:>10}" + "".join(f"{median[c]:>20.1f}" for c in columns)
        if oneccl_columns:
            best = min(median[c] for c in oneccl_columns)
            line += "".join(f"{best / median[c]:>13.2f}x" for c in ferro_columns)
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
