"""Collectives on emulated clusters, measured beside their peers and beside the simulator's prediction.

For each cluster (``HxR@RATE``, network namespaces behind a switch, see ``ferro bench --emulate``) this runs one
``ferro bench`` sweep of the ops with its peers in the same run (``--compare``), then replays, for every row
ferro measured, the schedule of the algorithm that row names (``ferro bench --simulate``'s model, with the
cluster's rate) and prints measured and predicted side by side with the lower bound and the peers' times:

    python bench/bench_scale_collectives.py --clusters 8x1@100mbit,16x1@100mbit --ops allreduce,broadcast \\
        -b 4 -e 4M -f 16 --compare torch-gloo,mpi --json scale.json

Needs root (network namespaces). ``--mpirun /usr/bin/mpirun`` compares Debian's Open MPI 4.1. The simulator
predicts one call; ``ferro bench`` times calls back to back, which for a pipelined chain overlaps successive
broadcasts, so its broadcast rows above the tree's threshold are rates the single-call replay does not model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ferro.tools.bench import simulate
from ferro.tools.bench.table import read_json

PREDICTED = ("allreduce", "broadcast")


def _predict(network: simulate.Network, op: str, algorithm: str, nbytes: int, itemsize: int) -> float | None:
    if op == "allreduce" and algorithm in simulate.ALGORITHMS:
        return simulate.predict(network, algorithm, nbytes, itemsize)
    if op == "broadcast" and algorithm in simulate.BROADCAST_ALGORITHMS:
        return simulate.predict_broadcast(network, algorithm, nbytes)
    return None


def _bound(network: simulate.Network, op: str, nbytes: int) -> float | None:
    if op == "allreduce":
        return simulate.lower_bound(network, nbytes)
    if op == "broadcast":
        return simulate.lower_bound_broadcast(network, nbytes)
    return None


def run_cluster(cluster: str, args: argparse.Namespace) -> list[dict]:
    """Run one cluster's sweep and return its rows with predictions."""
    network = simulate.parse_network(cluster)
    with tempfile.TemporaryDirectory(prefix="ferro-scale-") as tmp:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, "-m", "ferro", "bench", *args.ops.split(","), "--emulate", cluster,
                   "--backend", "tcp", "-b", args.minbytes, "-e", args.maxbytes, "-f", str(args.stepfactor),
                   "--iters", str(args.iters), "--warmup", str(args.warmup), "--json", str(out)]
        if args.compare:
            command += ["--compare", args.compare]
        if args.mpirun:
            command += ["--mpirun", args.mpirun]
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"{cluster}: ferro bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
        rows = read_json(str(out))
    results = []
    for row in rows:
        if not row.library.startswith("ferro"):
            continue
        itemsize = max(1, row.size // max(1, row.count))
        predicted = _predict(network, row.op, row.algorithm, row.size, itemsize) if row.op in PREDICTED else None
        peers = {r.library: r.time_us() for r in rows if r.op == row.op and r.size == row.size
                 and not r.library.startswith("ferro")}
        bound = _bound(network, row.op, row.size)
        results.append({"cluster": cluster, "op": row.op, "size": row.size, "algorithm": row.algorithm,
                        "measured_us": row.time_us(), "predicted_us": None if predicted is None else predicted * 1e6,
                        "bound_us": None if bound is None else bound * 1e6, "peers_us": peers})
    return results


def show(results: list[dict]) -> None:
    """Print the side-by-side table."""
    peers = sorted({name for r in results for name in r["peers_us"]})
    print(f"# {'cluster':>14} {'op':>10} {'size':>10} {'algorithm':>18} {'measured':>11} {'predicted':>11} "
          f"{'pred/meas':>9} {'bound':>11} " + " ".join(f"{p:>11}" for p in peers) + "   (us)")
    for r in results:
        predicted = r["predicted_us"]
        ratio = f"{predicted / r['measured_us']:>9.2f}" if predicted and r["measured_us"] else f"{'-':>9}"
        cells = " ".join(f"{r['peers_us'][p]:>11.1f}" if p in r["peers_us"] else f"{'-':>11}" for p in peers)
        print(f"  {r['cluster']:>14} {r['op']:>10} {r['size']:>10} {r['algorithm']:>18} {r['measured_us']:>11.1f} "
              f"{predicted if predicted is not None else float('nan'):>11.1f} {ratio} "
              f"{r['bound_us'] if r['bound_us'] is not None else float('nan'):>11.1f} {cells}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clusters", default="8x1@100mbit", help="comma-separated HxR@RATE (default 8x1@100mbit)")
    parser.add_argument("--ops", default="allreduce,broadcast", help="ferro bench ops (default allreduce,broadcast)")
    parser.add_argument("-b", "--minbytes", default="4")
    parser.add_argument("-e", "--maxbytes", default="4M")
    parser.add_argument("-f", "--stepfactor", type=int, default=16)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compare", default="", help="ferro bench --compare peers, e.g. torch-gloo,mpi")
    parser.add_argument("--mpirun", default=None, help="the mpirun of the mpi peer (Open MPI 4 or 5)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per cluster")
    parser.add_argument("--json", default=None, help="write every row here")
    args = parser.parse_args()
    results = [row for cluster in args.clusters.split(",") for row in run_cluster(cluster, args)]
    show(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
