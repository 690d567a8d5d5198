"""Start-up at scale: many real ranks on this machine, the store under thousands of clients, many emulated hosts.

Parts (``--parts``, default all):

* ``ranks``: N real processes (oversubscribed; ``FERRO_BACKEND=tcp``) start, join
  and run one allreduce of 1 float32; torch's gloo does the same at the same N in
  the same run. Per N: the slowest rank's time from its start to the allreduce
  done (``init``), the time from the last rank's import done to the last
  allreduce done (``after start``: what rendezvous and connecting cost beyond the
  processes' own start), sockets and resident memory per rank (medians).
* ``store``: the store alone, under ``--clients`` clients from ``--client-procs``
  processes, each client doing a rank's rendezvous (connect, set its key, read
  its two ring neighbours', a store-based barrier; see
  :mod:`ferro.testing.store_load`); the same load on torch's
  ``TCPStore(use_libuv=True)``. Runs inside a fresh network namespace with only
  loopback: this machine's resolver is unreachable, and torch's client asks it
  for the reverse name of every connection it makes (5 s stalls); in the
  namespace the question fails at once, for both stores alike.
* ``hosts``: ``ferro run --nnodes H`` over H emulated hosts (network namespaces
  on one bridge; see :mod:`ferro.testing.netns`) with 1 rank each, to the first
  allreduce; ``torchrun`` + gloo on the same hosts.

Rounds are interleaved (ferro, then the peer, per round) and the tables give medians.

Run: ``python bench/bench_scale.py [--parts ranks,store,hosts] [--ranks 16,64,128,256] [--clients 1000,4000,16000]
[--hosts 16,32] [--rounds 3] [--json out.json] [--plot scale.png]`` (as root for ``store`` and ``hosts``);
``--from-json a.json --from-json b.json --plot scale.png`` draws saved results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
SECRET = "bench-scale-secret-0123456789abcdef"

# One rank of the ``ranks`` part: argv = flavour, result file; the job in the environment.
RANK_PROGRAM = r"""
import json, os, sys, time
started = time.time()
flavour, out = sys.argv[1], sys.argv[2]
import numpy as np
if flavour == "ferro":
    import ferro
    imported = time.time()
    ferro.init_process_group(backend="tcp", timeout=600)
    x = np.ones(1, np.float32)
    ferro.allreduce(x)
    ok = float(x[0]) == float(os.environ["WORLD_SIZE"])
else:
    import datetime, torch, torch.distributed as dist
    imported = time.time()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    x = torch.ones(1)
    dist.all_reduce(x)
    ok = float(x[0]) == float(os.environ["WORLD_SIZE"])
done = time.time()
def kind(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""  # the listing's own descriptor, closed by now
sockets = sum(kind(fd).startswith("socket:") for fd in os.listdir("/proc/self/fd"))
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
with open(out, "a") as f:
    f.write(json.dumps({"rank": int(os.environ["RANK"]), "started": started, "imported": imported, "done": done,
                        "ok": ok, "sockets": sockets, "rss_mb": rss}) + "\n")
if flavour == "ferro":
    ferro.destroy_process_group()
else:
    dist.barrier()
    dist.destroy_process_group()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float, what: str, each: str) -> None:
    """Wait for every process; on a timeout kill them all; raise naming the first that failed."""
    deadline = time.monotonic() + timeout
    failures = []
    for index, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise RuntimeError(f"{what} did not finish within {timeout:g} s") from None
        if proc.returncode:
            failures.append(f"{each} {index} exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    if failures:
        raise RuntimeError(f"{what} failed: {failures[0]}")


def run_ranks(flavour: str, n: int, timeout: float = 900.0) -> dict[str, float]:
    """Start ``n`` rank processes of ``flavour`` ("ferro" or "gloo"); return the start-up figures."""
    out = tempfile.mktemp(suffix=".jsonl")
    port = _free_port()
    env = {**os.environ, "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "FERRO_SECRET": SECRET, "FERRO_BACKEND": "tcp", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_PROGRAM, flavour, out], env={**env, "RANK": str(r)},
                              cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in range(n)]
    _wait_all(procs, timeout, f"{flavour} at {n} ranks", "rank")
    rows = [json.loads(line) for line in Path(out).read_text().splitlines()]
    os.unlink(out)
    assert len(rows) == n and all(row["ok"] for row in rows), f"{flavour}: wrong allreduce or missing ranks"
    return {"init": max(row["done"] - row["started"] for row in rows),
            "after_start": max(row["done"] for row in rows) - max(row["imported"] for row in rows),
            "sockets": statistics.median(row["sockets"] for row in rows),
            "rss_mb": statistics.median(row["rss_mb"] for row in rows)}


def part_ranks(sizes: list[int], rounds: int, peers: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for n in sizes:
        for flavour in ["ferro", *peers]:
            results.setdefault(f"{flavour}@{n}", [])
        for _ in range(rounds):
            for flavour in ["ferro", *peers]:
                try:
                    results[f"{flavour}@{n}"].append(run_ranks(flavour, n))
                except RuntimeError as exc:  # gloo at 256 ranks: 256 x 223 MB does not fit in 24 GB
                    results[f"{flavour}@{n}"].append({"error": str(exc)[:300]})
        print(f"\n{n} ranks (median of {rounds}):")
        print(f"{'':8} {'init s':>8} {'after start s':>14} {'sockets/rank':>13} {'MB/rank':>8}")
        for flavour in ["ferro", *peers]:
            rows = [r for r in results[f"{flavour}@{n}"] if "error" not in r]
            if not rows:
                print(f"{flavour:8} failed: {results[f'{flavour}@{n}'][0]['error']}")
                continue
            print(f"{flavour:8} {_med(rows, 'init'):8.2f} {_med(rows, 'after_start'):14.2f} "
                  f"{_med(rows, 'sockets'):13.0f} {_med(rows, 'rss_mb'):8.0f}", flush=True)
    return results


def _med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


# --- the store ---------------------------------------------------------------------------------------------------

def part_store(sizes: list[int], rounds: int, procs: int, peers: list[str]) -> dict[str, Any]:
    """Re-run this script inside a fresh namespace with only loopback (see the module's docstring)."""
    name = f"ferro-store-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        out = tempfile.mktemp(suffix=".json")
        subprocess.run(["ip", "netns", "exec", name, sys.executable, str(HERE), "--inner-store", out,
                        "--clients", ",".join(map(str, sizes)), "--rounds", str(rounds), "--client-procs", str(procs),
                        "--peers", ",".join(peers)], check=True)
        result: dict[str, Any] = json.loads(Path(out).read_text())
        os.unlink(out)
        return result
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _inner_store(sizes: list[int], rounds: int, procs: int, peers: list[str], out: str) -> None:
    from datetime import timedelta

    from ferro.rendezvous.limits import raise_descriptor_limit
    from ferro.rendezvous.store import Store
    from ferro.testing.store_load import PHASES, run_store_load

    raise_descriptor_limit()
    results: dict[str, Any] = {}
    for n in sizes:
        for _ in range(rounds):
            for flavour in ["ferro", *peers]:
                if flavour == "ferro":
                    server: Any = Store("127.0.0.1", 0, secret=SECRET, serve=True, timeout=600)
                    port = server.port
                else:
                    import torch.distributed as dist

                    server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                                           timeout=timedelta(seconds=600))
                    port = server.port
                try:
                    times = run_store_load(flavour, "127.0.0.1", port, n, procs, secret=SECRET, timeout=600)
                except (RuntimeError, AssertionError) as exc:
                    times = {"error": str(exc)[:300]}
                results.setdefault(f"{flavour}@{n}", []).append(times)
                if flavour == "ferro":
                    server.close()
                del server
        print(f"\n{n} clients from {procs} processes (median of {rounds}, seconds per phase):")
        print(f"{'':8} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'total':>9}")
        for flavour in ["ferro", *peers]:
            rows = [r for r in results[f"{flavour}@{n}"] if "error" not in r]
            if not rows:
                print(f"{flavour:8} failed: {results[f'{flavour}@{n}'][0]['error']}")
                continue
            meds = [statistics.median(r[p] for r in rows) for p in PHASES]
            print(f"{flavour:8} " + " ".join(f"{m:9.3f}" for m in meds) + f" {sum(meds):9.3f}", flush=True)
    Path(out).write_text(json.dumps(results))


# --- many hosts --------------------------------------------------------------------------------------------------

def part_hosts(sizes: list[int], rounds: int, peers: list[str]) -> dict[str, Any]:
    from ferro.testing.netns import many_hosts

    results: dict[str, Any] = {}
    for hosts in sizes:
        with many_hosts(hosts) as (names, addresses):
            for _ in range(rounds):
                for flavour in ["ferro", *peers]:
                    results.setdefault(f"{flavour}@{hosts}", []).append(_run_hosts(flavour, names, addresses))
        print(f"\n{hosts} emulated hosts, 1 rank each (median of {rounds}): start to the first allreduce done, s")
        for flavour in ["ferro", *peers]:
            rows = results[f"{flavour}@{hosts}"]
            print(f"{flavour:8} {statistics.median(rows):8.2f}", flush=True)
    return results


HOST_PROGRAM = r"""
import os, sys, time
flavour = sys.argv[1]
import numpy as np
if flavour == "ferro":
    import ferro
    ferro.init_process_group(timeout=600)
    x = np.ones(1, np.float32)
    ferro.allreduce(x)
    assert float(x[0]) == float(os.environ["WORLD_SIZE"]), x
    ferro.destroy_process_group()
else:
    import datetime, torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    x = torch.ones(1)
    dist.all_reduce(x)
    assert float(x[0]) == float(os.environ["WORLD_SIZE"]), x
    dist.barrier()
    dist.destroy_process_group()
"""


def _interface(namespace: str) -> str:
    """The emulated host's own interface (its end of the veth pair to the switch)."""
    listing = subprocess.run(["ip", "-n", namespace, "-o", "link"], capture_output=True, text=True, check=True).stdout
    return next(line.split(":")[1].strip().split("@")[0] for line in listing.splitlines() if ": fh" in line)


def _run_hosts(flavour: str, names: list[str], addresses: list[str]) -> float:
    port = 29400 + os.getpid() % 500
    program = tempfile.mktemp(suffix=".py")
    Path(program).write_text(HOST_PROGRAM)
    env = {**os.environ, "FERRO_SECRET": SECRET, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    procs = []
    start = time.monotonic()
    for node, name in enumerate(names):
        if flavour == "ferro":
            command = [sys.executable, "-m", "ferro", "run", "--nnodes", str(len(names)), "--node-rank", str(node),
                       "--nproc-per-node", "1", "--master-addr", addresses[0], "--master-port", str(port), program,
                       flavour]
        else:
            env["GLOO_SOCKET_IFNAME"] = _interface(name)  # else gloo takes the host name's 127.0.0.1
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(names)), "--node-rank",
                       str(node), "--nproc-per-node", "1", "--master-addr", addresses[0], "--master-port", str(port),
                       "--local-addr", addresses[node], program, flavour]
        procs.append(subprocess.Popen(["ip", "netns", "exec", name, *command], env=dict(env), cwd=tempfile.gettempdir(),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    try:
        _wait_all(procs, 900.0, f"{flavour} on {len(names)} hosts", "node")
    finally:
        os.unlink(program)
    return time.monotonic() - start


def plot(results: dict[str, Any], path: str) -> None:
    """Draw the ranks part (start-up beyond the processes' own, sockets per rank) and the store part (total time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("ranks", "store") if p in results]
    fig, axes = plt.subplots(1, len(panels) + ("ranks" in results), figsize=(5 * (len(panels) + 1), 3.8))
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    series = _series(results.get("ranks", {}))
    if series:
        for flavour, points in series.items():
            sizes = sorted(points)
            axes[0].plot(sizes, [_med(points[n], "after_start") for n in sizes], "o-", label=flavour)
            axes[1].plot(sizes, [_med(points[n], "sockets") for n in sizes], "o-", label=flavour)
        axes[0].set(xscale="log", yscale="log", xlabel="ranks", ylabel="s",
                    title="last import done -> first allreduce done")
        axes[1].set(xscale="log", yscale="log", xlabel="ranks", ylabel="sockets", title="sockets per rank")
    if "store" in results:
        ax = axes[-1]
        for flavour, points in _series(results["store"]).items():
            sizes = sorted(points)
            totals = [statistics.median(sum(r[p] for p in ("connect", "set", "get", "barrier"))
                                        for r in points[n] if "error" not in r) for n in sizes]
            ax.plot(sizes, totals, "o-", label=flavour)
        ax.set(xscale="log", yscale="log", xlabel="clients", ylabel="s", title="store: rendezvous of N clients")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _series(part: dict[str, Any]) -> dict[str, dict[int, Any]]:
    out: dict[str, dict[int, Any]] = {}
    for key, rows in part.items():
        flavour, n = key.rsplit("@", 1)
        if rows and all("error" not in r for r in rows if isinstance(r, dict)):
            out.setdefault(flavour, {})[int(n)] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="ranks,store,hosts")
    parser.add_argument("--ranks", default="16,64,128,256")
    parser.add_argument("--clients", default="1000,4000,16000")
    parser.add_argument("--client-procs", type=int, default=8)
    parser.add_argument("--hosts", default="16,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peers", default="gloo", help="the peers beside ferro (gloo / torch; empty for none)")
    parser.add_argument("--json", help="write every round's figures here")
    parser.add_argument("--plot", help="draw the figures into this PNG (needs matplotlib)")
    parser.add_argument("--from-json", action="append", default=[],
                        help="plot (or print) results saved by --json instead of measuring (repeatable)")
    parser.add_argument("--inner-store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.from_json:
        merged: dict[str, Any] = {}
        for path in args.from_json:
            merged.update(json.loads(Path(path).read_text()))
        if args.plot:
            plot(merged, args.plot)
        return 0
    peers = [p for p in args.peers.split(",") if p]
    if args.inner_store:
        _inner_store([int(n) for n in args.clients.split(",")], args.rounds, args.client_procs,
                     ["torch" if p == "gloo" else p for p in peers], args.inner_store)
        return 0
    results: dict[str, Any] = {}
    parts = args.parts.split(",")
    if "ranks" in parts:
        results["ranks"] = part_ranks([int(n) for n in args.ranks.split(",")], args.rounds, peers)
    if "store" in parts:
        results["store"] = part_store([int(n) for n in args.clients.split(",")], args.rounds, args.client_procs,
                                      peers)
    if "hosts" in parts:
        results["hosts"] = part_hosts([int(n) for n in args.hosts.split(",")], args.rounds, peers)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
