"""ferro on commodity Ethernet: allreduce, all_gather and reduce_scatter on emulated 1 and 10 Gbit clusters.

For each link rate and cluster shape (2 hosts x 1 rank, 2 x 2, 4 x 1), runs
``ferro bench --emulate HxR@RATE --compare stream,torch-gloo,mpi`` (hosts as
network namespaces, every link shaped both ways by a token bucket; see
``ferro/tools/emulate.py``), keeps each sweep's rows as JSON, and prints one
table per rate: bus bandwidth of the raw duplex TCP stream (the line-rate
reference), of ferro, gloo and Open MPI, and ferro's fraction of the stream.
With ``--plot-dir`` it draws one PNG per rate (matplotlib).

Needs root. Run it on a quiet machine: on 2 cores, anything else running
halves the 10 Gbit figures.

Run: ``python bench/bench_network.py [--rates 1gbit,10gbit] [--shapes 2x1,2x2,4x1] [--out DIR] [--plot-dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from ferro.tools.bench.table import Row, read_json

OPS = ("allreduce", "all_gather", "reduce_scatter")
PEERS = ("torch-gloo", "mpi")
# 256 MB at 1 Gbit is 2-4 s a call for ferro and gloo, and far longer for Open MPI's TCP path there.
MAX_BYTES = {"1gbit": "64M", "10gbit": "256M"}


def run_sweep(shape: str, rate: str, out: str, max_bytes: str) -> int:
    """Run one ``ferro bench --emulate`` sweep; its rows land in ``out``."""
    command = [sys.executable, "-m", "ferro", "bench", *OPS, "--emulate", f"{shape}@{rate}", "-b", "4K", "-e",
               max_bytes, "-f", "4", "--warmup", "2", "--compare", ",".join(("stream", *PEERS)), "--json", out]
    # Outside the repository: `python -m ferro` there would import the source tree, not the installed package.
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run(command, cwd=cwd, check=False).returncode


def busbw(row: Row) -> float:
    """nccl-tests' bus bandwidth (GB/s) of a row, in place where it has that form."""
    return row.busbw(in_place=row.ip_time_us is not None) or 0.0


def _ratio(ours: float, theirs: float | None, unit: str = "x") -> str:
    return f"{ours / theirs:.2f}{unit}" if theirs else "-"


def table(rate: str, sweeps: dict[str, list[Row]], min_bytes: int) -> str:
    """One rate's table: per shape, op and size, each library's bus bandwidth and ferro's ratios."""
    lines = [f"# {rate}: bus bandwidth (GB/s; nccl-tests' factors) from {min_bytes} bytes; stream = the raw duplex "
             f"TCP stream's rate applied to each op's link bytes", "",
             "| shape | op | size | stream | ferro | of stream | gloo | ferro / gloo | Open MPI | ferro / MPI |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for shape, rows in sweeps.items():
        by = {("ferro" if r.library.startswith("ferro") else r.library, r.op, r.size): busbw(r) for r in rows}
        for op in OPS:
            for size in sorted({r.size for r in rows if r.op == op and r.size >= min_bytes}):
                ferro = by.get(("ferro", op, size))
                if ferro is None:
                    continue
                cells = [by.get((library, op, size)) for library in ("stream", "torch-gloo", "mpi")]
                stream, gloo, mpi = cells
                fmt = [f"{v:.3f}" if v is not None else "-" for v in cells]
                lines.append(f"| {shape} | {op} | {size >> 20 if size >= 1 << 20 else size} "
                             f"{'MiB' if size >= 1 << 20 else 'B'} | {fmt[0]} | {ferro:.3f} | "
                             f"{_ratio(ferro, stream, '')} | {fmt[1]} | {_ratio(ferro, gloo)} | {fmt[2]} | "
                             f"{_ratio(ferro, mpi)} |")
    return "\n".join(lines)


def plot(path: str, rate: str, sweeps: dict[str, list[Row]]) -> None:
    """Draw one PNG for a rate: a panel per shape and op, bus bandwidth against size per library."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(OPS), len(sweeps), figsize=(5 * len(sweeps), 3.6 * len(OPS)), squeeze=False)
    styles = {"stream": ("k", ":"), "ferro": ("tab:red", "-"), "torch-gloo": ("tab:blue", "--"),
              "mpi": ("tab:green", "--")}
    for column, (shape, rows) in enumerate(sweeps.items()):
        for line, op in enumerate(OPS):
            axis = axes[line][column]
            for library, (color, style) in styles.items():
                points = sorted((r for r in rows if r.op == op and (r.library == library or (
                    library == "ferro" and r.library.startswith("ferro")))), key=lambda r: r.size)
                if points:
                    label = {"mpi": "Open MPI", "torch-gloo": "gloo", "stream": "raw TCP stream"}.get(library,
                                                                                                     points[0].library)
                    axis.plot([p.size for p in points], [busbw(p) for p in points], style, color=color, marker="o",
                              ms=3, label=label)
            axis.set_xscale("log", base=2)
            axis.set_title(f"{op}, {shape} @ {rate}", fontsize=10)
            axis.set_xlabel("bytes")
            axis.set_ylabel("bus bandwidth (GB/s)")
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1gbit,10gbit")
    parser.add_argument("--shapes", default="2x1,2x2,4x1")
    parser.add_argument("--out", default="bench-network", help="folder for each sweep's JSON rows")
    parser.add_argument("--plot-dir", default=None, help="write network-<rate>.png here")
    parser.add_argument("--table-from", type=int, default=4096, help="smallest size in the printed tables")
    parser.add_argument("--reuse", action="store_true", help="tabulate sweeps already in --out; run none")
    args = parser.parse_args()
    if os.geteuid() != 0 and not args.reuse:
        print("bench_network: an emulated cluster needs root", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    status = 0
    for rate in args.rates.split(","):
        sweeps: dict[str, list[Row]] = {}
        for shape in args.shapes.split(","):
            path = os.path.abspath(os.path.join(args.out, f"{shape}@{rate}.json"))
            if not args.reuse:
                status = run_sweep(shape, rate, path, MAX_BYTES.get(rate, "256M")) or status
            if os.path.exists(path):
                sweeps[shape] = read_json(path)
        print(table(rate, sweeps, args.table_from))
        if args.plot_dir and sweeps:
            os.makedirs(args.plot_dir, exist_ok=True)
            plot(os.path.join(args.plot_dir, f"network-{rate}.png"), rate, sweeps)
    return status


if __name__ == "__main__":
    sys.exit(main())
