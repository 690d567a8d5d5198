"""Collectives on emulated clusters, measured beside their peers and beside the simulator's prediction.

For each cluster (``HxR@RATE``, network namespaces behind a switch, see ``ferro bench --emulate``) this runs one
``ferro bench`` sweep of the ops with its peers in the same run (``--compare``), then replays, for every row
ferro measured, the schedule of the algorithm that row names (``ferro bench --simulate``'s model, with the
cluster's rate) and prints measured and predicted side by side with the lower bound and the peers' times:

    python bench/bench_scale_collectives.py --clusters 8x1@100mbit,16x1@100mbit --ops allreduce,broadcast \\
        -b 4 -e 4M -f 16 --compare torch-gloo,mpi --json scale.json

Needs root (network namespaces). ``--mpirun /usr/bin/mpirun`` compares Debian's Open MPI 4.1. With
``FERRO_COST_MODEL`` set, ferro's ranks choose by that model and the simulator cuts the chain as they do. The
simulator predicts one call; ``ferro bench`` times calls back to back, which for a pipelined chain overlaps
successive broadcasts, so its chain rows are rates the single-call replay does not model.
``--from-json`` re-predicts rows an earlier run wrote (``--json``) without running anything; ``--plot`` draws them.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ferro.backend.cost_model import CostModel, load_cost_model
from ferro.tools.bench import simulate, two_level
from ferro.tools.bench.table import read_json
from ferro.tools.bench.worker import timed_calls
from ferro.tools.emulate import TCP_PAYLOAD_SHARE, bucket_bytes, parse_emulation


@functools.cache
def _cost_model() -> CostModel | None:
    return load_cost_model()  # $FERRO_COST_MODEL, read once for every row


def emulated_network(cluster: str, bucket: bool = True, cores: bool = True) -> simulate.Network:
    """The simulator's model of an emulated cluster: its links at the TCP payload rate with the emulator's token
    bucket, and, where a cost model is loaded (``FERRO_COST_MODEL``, fitted on that cluster), its measured cost per
    message as the latency and its machine's CPU costs (``CostModel.cpu``) on that machine's cores, which every
    emulated host shares. ``bucket=False``: plain lines, as the simulator models a real cluster's NICs;
    ``cores=False``: a core per rank, as the simulator models a real cluster whose ranks have theirs."""
    network = simulate.parse_network(cluster)
    model = _cost_model()
    latency, overhead, per_byte, machine_cores = network.latency, network.overhead, 0.0, 0
    if model is not None:
        if cores and model.cpu[2]:
            overhead, per_byte, machine_cores = model.cpu
        alpha = model.per_algorithm.get("ring", (model.alpha, model.beta))[0]
        latency = max(alpha - overhead, 0.0)
    burst = bucket_bytes(parse_emulation(cluster)[2]) * TCP_PAYLOAD_SHARE if bucket else 0.0
    return simulate.Network(network.hosts, network.ranks_per_host, network.rate * TCP_PAYLOAD_SHARE, latency=latency,
                            overhead=overhead, burst=burst, cpu_per_byte=per_byte, cores=machine_cores,
                            cores_shared=True)


def _predict(network: simulate.Network, op: str, algorithm: str, nbytes: int, itemsize: int,
             calls: int = 1) -> float | None:
    """The simulator's seconds per call for the plan a row names, ``calls`` of them back to back as ``ferro bench``
    times them (None: a plan the simulator does not hold). A two-level plan (the hierarchical backend's) is
    replayed as its three steps, the leaders' plan among the hosts (``two_level.predict_two_level``)."""
    leaders = two_level.leaders_plan(algorithm)
    if (leaders or algorithm) not in simulate.OP_ALGORITHMS.get(op, {}):
        return None
    model = _cost_model()
    # The frames the measured ranks cut on this model's link (TcpBackend sets its mesh's from the same calls).
    frames = {} if model is None else {"latency_bytes": model.link_numbers()[0], "segment": model.segment_bytes(),
                                       "piece": model.piece_bytes()}
    if leaders is not None:
        return two_level.predict_two_level(network, leaders, nbytes, itemsize, op=op, calls=calls, **frames)
    return simulate.predict(network, algorithm, nbytes, itemsize, op=op, calls=calls, **frames)


def run_cluster(cluster: str, args: argparse.Namespace) -> list[dict]:
    """Run one cluster's sweep and return its rows with predictions."""
    network = emulated_network(cluster, not args.no_bucket, not args.no_cores)
    with tempfile.TemporaryDirectory(prefix="ferro-scale-") as tmp:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, "-m", "ferro", "bench", *args.ops.split(","), "--emulate", cluster,
                   "--backend", args.backend, "-b", args.minbytes, "-e", args.maxbytes, "-f", str(args.stepfactor),
                   "--iters", str(args.iters), "--warmup", str(args.warmup), "--json", str(out)]
        if args.compare:
            command += ["--compare", args.compare]
        if args.mpirun:
            command += ["--mpirun", args.mpirun]
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        if not out.exists():
            raise SystemExit(f"{cluster}: ferro bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
        if done.returncode != 0:  # a peer failed: what was measured stands, and the peer's rows are missing
            print(f"# {cluster}: ferro bench exited {done.returncode}; keeping the rows it wrote:\n"
                  + "\n".join(f"#   {line}" for line in done.stderr[-2000:].splitlines()), file=sys.stderr)
        rows = read_json(str(out))
    results = []
    for row in rows:
        if not row.library.startswith("ferro"):
            continue
        itemsize = max(1, row.size // max(1, row.count))
        calls = timed_calls(args.iters, row.size)
        predicted = _predict(network, row.op, row.algorithm, row.size, itemsize, calls)
        same = [r for r in rows if r.op == row.op and r.size == row.size and not r.library.startswith("ferro")]
        peers = {r.library: r.time_us() for r in same}
        bound = simulate.lower_bound(network, row.size, row.op) if row.op in simulate.OP_ALGORITHMS else None
        results.append({"cluster": cluster, "op": row.op, "size": row.size, "itemsize": itemsize, "calls": calls,
                        "algorithm": row.algorithm,
                        "measured_us": row.time_us(), "cpu_us": row.cpu_us,
                        "predicted_us": None if predicted is None else predicted * 1e6,
                        "bound_us": None if bound is None else bound * 1e6, "peers_us": peers,
                        "peers_cpu_us": {r.library: r.cpu_us for r in same}})
    return results


def predict_scale(ranks: list[int], links: list[str], sizes: list[int], per_host: int = 1) -> list[dict]:
    """Predict the allreduce at ``ranks`` (``per_host`` ranks a host) on each link ``RATE,LATENCY``: ferro's choice
    by a cost model of that link (what ``ferro bench --fit`` would measure there) and the ring alone over every
    rank, beside the bound. With several ranks a host ferro's choice is the hierarchy's (``--backend auto``): the
    leaders' algorithm for their pieces among the hosts, replayed by ``two_level.predict_two_level``.

    The ring and, on powers of two, recursive doubling and halving-doubling are replayed from one host's plan
    (:func:`simulate.replay_streams` and :func:`simulate.replay_symmetric`, equal to the full replay at 1 rank per
    host: ``tests/test_schedule.py``), in the frames that model's mesh cuts.
    """
    from ferro.backend.cost_model import CostModel
    from ferro.backend.hierarchy_plan import leaders_call

    rows = []
    for link in links:
        for n in ranks:
            hosts = max(1, n // per_host)
            network = simulate.parse_network(f"{hosts}x{per_host}@{link}")
            model = CostModel(network.latency + network.overhead, 1 / network.rate, 1 / network.reduce_rate)
            frames = {"segment": model.segment_bytes(), "piece": model.piece_bytes()}  # as that model's mesh cuts
            for size in sizes:
                ring = simulate.predict(network, "ring", size, **frames)
                if per_host > 1 and hosts > 1:
                    leaders = model.choose_allreduce(leaders_call("allreduce", size, per_host)[0], hosts)
                    chosen = two_level.TWO_LEVEL + leaders
                    best = two_level.predict_two_level(network, leaders, size, **frames)
                else:
                    chosen = model.choose_allreduce(size, n)
                    best = ring if chosen == "ring" else simulate.predict(network, chosen, size, **frames)
                rows.append({"link": link, "ranks": n, "size": size, "algorithm": chosen, "chosen_us": best * 1e6,
                             "ring_us": ring * 1e6, "bound_us": simulate.lower_bound(network, size) * 1e6})
                print(f"  {link:>14} {n:>6} {size:>10} {chosen:>28} {best * 1e6:>12.1f} {ring * 1e6:>12.1f} "
                      f"{ring / best:>6.1f}x {rows[-1]['bound_us']:>11.1f}", flush=True)
    return rows


def _repredicted(row: dict, bucket: bool, cores: bool) -> dict:
    network = emulated_network(row["cluster"], bucket, cores)
    itemsize = row.get("itemsize", 4)
    predicted = _predict(network, row["op"], row["algorithm"], row["size"], itemsize, row.get("calls", 1))
    bound = simulate.lower_bound(network, row["size"], row["op"]) if row["op"] in simulate.OP_ALGORITHMS else None
    return {"predicted_us": None if predicted is None else predicted * 1e6,
            "bound_us": None if bound is None else bound * 1e6}


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _markdown_row(r: dict) -> str:
    ours, peers = r["measured_us"], r["peers_us"]
    predicted, stream = r["predicted_us"], peers.get("stream")

    def ratio(peer: str) -> str:
        return f"{peers[peer] / ours:.2f}x" if peers.get(peer) and ours else "-"

    return (f"| {r['op']} | {_size(r['size'])} | {r['algorithm']} | {_cell(ours)} | {_cell(predicted)} | "
            f"{_cell(predicted / ours if predicted and ours else None, 2)} | {_cell(stream)} | "
            f"{_cell(stream / ours if stream and ours else None, 2)} | {_cell(peers.get('torch-gloo'))} | "
            f"{ratio('torch-gloo')} | {_cell(peers.get('mpi'))} | {ratio('mpi')} |")


def _first_rows(results: list[dict]) -> list[dict]:
    """The rows, each cluster's op and size once: ferro bench may give a size twice (its smallest count), and the
    first row stands."""
    first: dict[tuple, dict] = {}
    for r in results:
        first.setdefault((r["cluster"], r["op"], r["size"]), r)
    return list(first.values())


def markdown(results: list[dict]) -> str:
    """The rows as Markdown tables, one per cluster: ferro beside its prediction, the stream and the peers."""
    lines: list[str] = []
    for cluster in dict.fromkeys(r["cluster"] for r in results):
        lines += [f"## {cluster}", "",
                  "| op | size | ferro's plan | ferro (us) | predicted | pred / ferro | stream | of stream | gloo | "
                  "ferro / gloo | Open MPI | ferro / MPI |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [_markdown_row(r) for r in _first_rows(results) if r["cluster"] == cluster]
        lines.append("")
    return "\n".join(lines)


#: The lines of a --plot panel: label, how a row gives it, and its style.
_PLOT_LINES = (("ferro", lambda r: r["measured_us"], "o-C0"), ("ferro predicted", lambda r: r["predicted_us"], "x--C1"),
               ("bound", lambda r: r["bound_us"], ":C2"), ("stream", lambda r: r["peers_us"].get("stream"), "-.C7"),
               ("gloo", lambda r: r["peers_us"].get("torch-gloo"), "s-C3"),
               ("Open MPI", lambda r: r["peers_us"].get("mpi"), "^-C4"))


def plot(results: list[dict], path: str) -> None:
    """Draw time per call against size into ``path`` (PNG): a panel per cluster and op, a line per library.

    ferro's measured and predicted times, the lower bound and the stream beside gloo and Open MPI, so the gaps
    the tables give as ratios can be seen across sizes. Needs matplotlib (``pip install 'ferro[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'ferro[plot]'") from exc
    first = _first_rows(results)
    clusters = list(dict.fromkeys(r["cluster"] for r in results))
    ops = list(dict.fromkeys(r["op"] for r in results))
    panels = [(cluster, op) for cluster in clusters for op in ops]
    # A row per cluster, a column per op; one cluster's ops, or one op's clusters, in rows of three.
    columns = len(ops) if len(clusters) > 1 and len(ops) > 1 else min(3, len(panels))
    rows_of_panels = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows_of_panels, columns, figsize=(3.6 * columns, 3.0 * rows_of_panels),
                                squeeze=False)
    for index, axis in enumerate(axes.flat):
        if index >= len(panels):
            axis.set_visible(False)
            continue
        cluster, op = panels[index]
        rows = sorted((r for r in first if r["cluster"] == cluster and r["op"] == op), key=lambda r: r["size"])
        for label, value, style in _PLOT_LINES:
            points = [(r["size"], value(r)) for r in rows if value(r)]
            if points:
                axis.plot(*zip(*points, strict=True), style, ms=3, lw=1, label=label)
        axis.set_yscale("log")
        axis.set_xscale("log", base=2)
        axis.set_title(f"{cluster} {op}", fontsize=9)
        axis.grid(True, which="both", alpha=0.3)
        axis.tick_params(labelsize=7)
        if index % columns == 0:
            axis.set_ylabel("us per call", fontsize=8)
        if index + columns >= len(panels):
            axis.set_xlabel("bytes per call", fontsize=8)
    handles, labels = [], []
    for axis in axes.flat:  # every line that appears in some panel, once
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    figure.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 0.97 if rows_of_panels > 1 else 0.92))
    figure.savefig(path, dpi=110)
    plt.close(figure)


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
    parser.add_argument("--backend", default="tcp", help="ferro's backend (default tcp: the plans the simulator "
                        "replays; auto takes the hierarchical backend where hosts hold several ranks)")
    parser.add_argument("--compare", default="", help="ferro bench --compare peers, e.g. torch-gloo,mpi")
    parser.add_argument("--mpirun", default=None, help="the mpirun of the mpi peer (Open MPI 4 or 5)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per cluster")
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--from-json", default=None,
                        help="re-predict the rows of earlier --json files (comma-separated); run nothing")
    parser.add_argument("--no-bucket", action="store_true",
                        help="predict the emulated links as plain lines, without the token bucket tc shapes them with")
    parser.add_argument("--no-cores", action="store_true",
                        help="predict a core per rank, ignoring the cost model's CPU costs on this machine's cores")
    parser.add_argument("--markdown", default=None, help="also write the rows as Markdown tables here")
    parser.add_argument("--plot", default=None, help="also draw time against size into this PNG (matplotlib)")
    parser.add_argument("--predict-scale", default=None, metavar="RANKS",
                        help="comma-separated rank counts (e.g. 256,1024,4096,16384): predict the allreduce there "
                             "on --links, run nothing")
    parser.add_argument("--links", default="25gbit,2us,25gbit,10us,100gbit,2us,100gbit,10us",
                        help="RATE,LATENCY pairs for --predict-scale")
    parser.add_argument("--sizes", default="8,65536,1048576,67108864", help="bytes, for --predict-scale")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="ranks on each host, for --predict-scale (above 1: the hierarchy's two-level plans)")
    args = parser.parse_args()
    if args.predict_scale:
        parts = args.links.split(",")
        print(f"# {'link':>14} {'ranks':>6} {'size':>10} {'ferro chooses':>28} {'its time':>12} {'ring alone':>12} "
              f"{'gain':>7} {'bound':>11}   (us, predicted)")
        rows = predict_scale([int(n) for n in args.predict_scale.split(",")],
                             [f"{parts[i]},{parts[i + 1]}" for i in range(0, len(parts), 2)],
                             [int(size) for size in args.sizes.split(",")], args.ranks_per_host)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    if args.from_json:
        results = [dict(r, **_repredicted(r, not args.no_bucket, not args.no_cores))
                   for path in args.from_json.split(",") for r in json.loads(Path(path).read_text())]
    else:
        results = [row for cluster in args.clusters.split(",") for row in run_cluster(cluster, args)]
    show(results)
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))
    if args.plot:
        plot(results, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
