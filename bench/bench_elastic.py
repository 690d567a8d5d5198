"""Recovering from a lost rank: ferro.elastic in place, against restarting from a checkpoint (ferro run, torchrun).

Four ranks on loopback train a ~25 M-parameter float32 model (one 5000x5000
linear layer with its bias, SGD with momentum, so the state is ~200 MB) with a
global batch of 16; at step 50 launch rank 1 SIGKILLs itself. Each rank logs
every step it completes with the time; the kill is logged just before it.

* ``ferro-elastic``: ``ferro run --restart-policy rank --max-restarts 1``: the
  survivors shrink in place and redo step 50; the replacement joins later.
* ``ferro-restart``: ``ferro run --max-restarts 1``: every rank restarts and
  resumes from the last checkpoint (every 20 steps, written by rank 0 with ``np.savez``).
* ``torchrun-gloo``: the same model in PyTorch under ``torchrun --max-restarts 1``,
  torch DDP over gloo, ``torch.save`` checkpoints every 20 steps.
* ``torchft-gloo``: torchft 0.2 (``pip install torchft``): four replica groups of one rank, each under
  ``torchrun --max-restarts 1``, its ``Manager`` over ``ProcessGroupGloo`` with the lighthouse its README
  starts (``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``); its own defaults otherwise.
* ``ferro-elastic-2hosts``: ``ferro-elastic`` on two emulated hosts of two ranks each (network
  namespaces joined by a veth pair, one ``ferro run`` per host; needs root), the killed rank on the first.
* On request (``--modes``): ``ferro-elastic-torch-ddp``, the same model in PyTorch through torch's own
  ``DistributedDataParallel`` (``ferro.interop.torch_elastic.elastic_ddp``); ``ferro-elastic-hsdp``,
  ``ferro.FSDP`` hybrid-sharded over pairs of ranks (``Manager(replica_size=2).fsdp``): rank 1's pair drops
  out whole until its replacement joins, so it trains at 2 ranks meanwhile.

Reported per run: ``recover`` (kill -> the first step completed after it),
``lost`` (steps trained before the kill and trained again), ``healed`` (kill ->
first step completed at four ranks again), and for ferro.elastic the state
transfer's bandwidth beside a point-to-point stream of the same bytes between two
ranks (``loopback``). Medians over ``--rounds``.

Run: ``python bench/bench_elastic.py [--rounds 3] [--steps 200] [--modes ferro-elastic,ferro-restart,torchrun-gloo]``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before NumPy loads: 4 ranks share 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

WIDTH, BATCH, KILL_STEP, KILLED_RANK, CHECKPOINT_EVERY = 5000, 16, 50, 1, 20
LAUNCH_TIMEOUT = 600.0  # seconds a whole run may take before it counts as hung
MODES = ("ferro-elastic", "ferro-elastic-2hosts", "ferro-restart", "torchrun-gloo", "torchft-gloo")
#: ferro.elastic beyond ferro.DDP, run on request (--modes): torch's own DDP, and hybrid-sharded FSDP in pairs.
MORE_MODES = ("ferro-elastic-torch-ddp", "ferro-elastic-hsdp")


# --- the rank programs ----------------------------------------------------------------------------------------

class _Log:
    def __init__(self, directory: str, rank: int) -> None:
        self.path = os.path.join(directory, f"log-{rank}-{os.getpid()}.jsonl")

    def write(self, **entry: object) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"t": time.time(), **entry}) + "\n")


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((256, WIDTH), dtype=np.float32),
            rng.standard_normal((256, WIDTH), dtype=np.float32))


def _maybe_kill(log: _Log, rank: int, step: int, first_life: bool) -> None:
    if first_life and rank == KILLED_RANK and step == KILL_STEP:
        log.write(kill=step)
        os.kill(os.getpid(), signal.SIGKILL)


def _ferro_model():
    from ferro import nn

    net = nn.Sequential(nn.Linear(WIDTH, WIDTH, rng=np.random.default_rng(1)))
    return net, nn.SGD(net.parameters(), lr=1e-4, momentum=0.9)


def _torch_model(directory: str, rank: int) -> tuple[_Log, Any, Any, Any, Any]:
    """Return the log, the data as tensors, and the same model in PyTorch (one seed on every rank) with its SGD."""
    import torch

    torch.set_num_threads(1)
    log, (x, y) = _Log(directory, rank), _data()
    torch.manual_seed(1)
    net = torch.nn.Linear(WIDTH, WIDTH)
    return log, torch.from_numpy(x), torch.from_numpy(y), net, torch.optim.SGD(net.parameters(), lr=1e-4,
                                                                               momentum=0.9)


def worker_ferro_elastic(directory: str, steps: int, hybrid: bool = False) -> None:
    from ferro import nn
    from ferro.elastic import ElasticSampler, Manager

    rank = int(os.environ["RANK"])
    log, (x, y) = _Log(directory, rank), _data()
    net, optimizer = _ferro_model()
    manager = Manager(replica_size=2 if hybrid else 1)
    if hybrid:  # pairs of ranks shard the model; the pair that loses a rank waits for its replacement
        model = manager.fsdp(net)
        optimizer = nn.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        manager.register(optimizer=optimizer)
    else:
        model = manager.ddp(net)
        manager.register(model=net, optimizer=optimizer)
    first_life = os.environ.get("FERRO_RESTART_COUNT", "0") == "0"
    for step in manager.steps(steps, ElasticSampler(len(x), BATCH)):
        with step:
            index = step.shard.indices
            optimizer.zero_grad()
            out = model(x[index])
            _maybe_kill(log, rank, step.number, first_life)
            model.backward((out - y[index]) * (2 * step.shard.loss_weight / out.size))
            optimizer.step()
            log.write(step=step.number, world=step.world_size)
    log.write(history=[change.__dict__ for change in manager.history])
    manager.close()


def worker_ferro_elastic_hsdp(directory: str, steps: int) -> None:
    worker_ferro_elastic(directory, steps, hybrid=True)


def worker_ferro_elastic_torch_ddp(directory: str, steps: int) -> None:
    import torch

    from ferro.elastic import ElasticSampler, Manager
    from ferro.interop.torch_elastic import elastic_ddp

    rank = int(os.environ["RANK"])
    log, x, y, net, optimizer = _torch_model(directory, rank)
    manager = Manager()
    model = elastic_ddp(manager, net)
    manager.register(model=net, optimizer=optimizer)
    first_life = os.environ.get("FERRO_RESTART_COUNT", "0") == "0"
    for step in manager.steps(steps, ElasticSampler(len(x), BATCH)):
        with step:
            index = torch.from_numpy(step.shard.indices)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[index]), y[index]) * step.shard.loss_weight
            _maybe_kill(log, rank, step.number, first_life)
            loss.backward()
            optimizer.step()
            log.write(step=step.number, world=step.world_size)
    log.write(history=[change.__dict__ for change in manager.history])
    manager.close()


def worker_ferro_restart(directory: str, steps: int) -> None:
    import ferro

    rank = int(os.environ["RANK"])
    log, (x, y) = _Log(directory, rank), _data()
    group = ferro.init_process_group()
    net, optimizer = _ferro_model()
    model = ferro.DDP(net)
    checkpoint, start = os.path.join(directory, "checkpoint.npz"), 0
    if os.path.exists(checkpoint):
        saved = np.load(checkpoint)
        net.load_state_dict({name: saved[f"model.{name}"] for name in net.state_dict()})
        optimizer.load_state_dict({"lr": optimizer.lr, "state": {
            i: {"momentum_buffer": saved[f"momentum.{i}"]} for i in range(len(optimizer.params))}})
        start = int(saved["step"])
    first_life = os.environ.get("FERRO_RESTART_COUNT", "0") == "0"
    world = group.world_size
    for number in range(start, steps):
        index = np.arange(number * BATCH, (number + 1) * BATCH)[rank::world] % len(x)
        optimizer.zero_grad()
        out = model(x[index])
        _maybe_kill(log, rank, number, first_life)
        model.backward((out - y[index]) * (2 / out.size))
        optimizer.step()
        log.write(step=number, world=world)
        if (number + 1) % CHECKPOINT_EVERY == 0 and rank == 0:
            state = {f"model.{k}": v for k, v in net.state_dict().items()}
            state.update({f"momentum.{i}": s["momentum_buffer"] for i, s in optimizer.state_dict()["state"].items()})
            np.savez(checkpoint + ".tmp.npz", step=number + 1, **state)
            os.replace(checkpoint + ".tmp.npz", checkpoint)
    ferro.destroy_process_group()


def worker_torchrun_gloo(directory: str, steps: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    log, x, y, net, optimizer = _torch_model(directory, rank)
    # A bounded rendezvous: torchrun's restarted workers were seen waiting in it for minutes (see _launch).
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = torch.nn.parallel.DistributedDataParallel(net)
    checkpoint, start = os.path.join(directory, "checkpoint.pt"), 0
    if os.path.exists(checkpoint):
        saved = torch.load(checkpoint)
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    world = dist.get_world_size()
    for number in range(start, steps):
        index = torch.from_numpy(np.arange(number * BATCH, (number + 1) * BATCH)[rank::world] % len(x))
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[index]), y[index])
        _maybe_kill(log, rank, number, first_life)
        loss.backward()
        optimizer.step()
        log.write(step=number, world=world)
        if (number + 1) % CHECKPOINT_EVERY == 0 and rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": number + 1},
                       checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
    dist.destroy_process_group()


def worker_torchft_gloo(directory: str, steps: int) -> None:
    import torch
    from torchft import Manager, Optimizer, ProcessGroupGloo

    replica = int(os.environ["REPLICA_GROUP_ID"])
    log, x, y, net, inner = _torch_model(directory, replica)

    def load_state_dict(state: dict) -> None:
        net.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])

    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=lambda: {"model": net.state_dict(), "optimizer": inner.state_dict()},
                      replica_id=f"bench_{replica}", use_async_quorum=False)
    # Gradients through Manager.allreduce, torchft's fault-tolerant call: its DistributedDataParallel wrapper
    # failed on this torch (2.13) the moment a peer died (`assert fut._fut` in its comm hook), ending every
    # replica group, which then restarted from step 0.
    optimizer = Optimizer(manager, inner)
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    while manager.current_step() < steps:
        optimizer.zero_grad()  # the step's quorum
        number, world = manager.current_step(), manager.num_participants()
        share = manager.participating_rank() or 0  # None while this replica heals (its gradient is not counted)
        index = torch.from_numpy(np.arange(number * BATCH, (number + 1) * BATCH)[share::world] % len(x))
        loss = torch.nn.functional.mse_loss(net(x[index]), y[index])
        _maybe_kill(log, replica, number, first_life)
        loss.backward()
        for work in [manager.allreduce(param.grad) for param in net.parameters()]:
            work.wait()
        optimizer.step()  # applied only when every participant's reduction succeeded (should_commit)
        if manager.current_step() > number:
            log.write(step=number, world=world)
    manager.shutdown()


# --- the orchestrator --------------------------------------------------------------------------------------------

def _start_all(commands: list[list[str]], envs: list[dict[str, str]]) -> list[tuple[subprocess.Popen, object]]:
    """Start launchers side by side, their output into files: pipes read one after another would fill and stall."""
    started = []
    for command, env in zip(commands, envs, strict=True):
        output = tempfile.TemporaryFile(mode="w+")
        started.append((subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True, env=env),
                        output))
    return started


def _wait_for(launchers: list[tuple[subprocess.Popen, object]], start: float) -> tuple[float, str]:
    """Wait for every launcher (LAUNCH_TIMEOUT from ``start`` in all); return the wall time and what went wrong."""
    problems = []
    for launcher, output in launchers:
        try:
            launcher.wait(timeout=max(LAUNCH_TIMEOUT - (time.time() - start), 1))
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
            problems.append(f"hung: no end within {LAUNCH_TIMEOUT:.0f} s")
        else:
            if launcher.returncode != 0:
                output.seek(0)  # type: ignore[attr-defined]
                text = output.read()  # type: ignore[attr-defined]
                lines = [line for line in text.splitlines() if "Error" in line]
                problems.append(f"failed with {launcher.returncode}: {lines[-1][:200] if lines else text[-200:]}")
        output.close()  # type: ignore[attr-defined]
    return time.time() - start, "; ".join(problems)


def _launch_two_hosts(worker: list[str]) -> tuple[float, str]:
    import secrets

    from ferro.rendezvous.settings import free_port
    from ferro.testing.netns import two_hosts

    with two_hosts() as (names, master):
        env = dict(os.environ, FERRO_SECRET=secrets.token_hex(16))
        port = str(free_port("127.0.0.1"))
        start = time.time()
        launchers = _start_all(
            [["ip", "netns", "exec", name, sys.executable, "-m", "ferro", "run", "--nnodes", "2", "--node-rank",
              str(node), "--nproc-per-node", "2", "--master-addr", master, "--master-port", port,
              "--restart-policy", "rank", "--max-restarts", "1", "--grace", "2", *worker]
             for node, name in enumerate(names)], [env, env])
        return _wait_for(launchers, start)


def _launch_torchft(worker: list[str]) -> tuple[float, str]:
    from ferro.rendezvous.settings import free_port

    port = free_port("127.0.0.1")
    lighthouse = subprocess.Popen(["torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", "100",
                                   "--join_timeout_ms", "10000", "--bind", f"[::]:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        start = time.time()
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts", "1",
                   "--standalone", *worker]
        groups = _start_all([command] * 4, [dict(os.environ, REPLICA_GROUP_ID=str(i), NUM_REPLICA_GROUPS="4",
                                                 TORCHFT_LIGHTHOUSE=f"http://localhost:{port}") for i in range(4)])
        return _wait_for(groups, start)
    finally:
        lighthouse.kill()
        lighthouse.wait()


def _launch(mode: str, directory: str, steps: int) -> tuple[float, str]:
    """Run one job; return its wall time and "" or what went wrong."""
    me = os.path.abspath(__file__)
    worker = [me, "--worker", mode.removesuffix("-2hosts"), "--dir", directory, "--steps", str(steps)]
    elastic = mode.startswith("ferro-elastic")
    if mode == "ferro-elastic-2hosts":
        return _launch_two_hosts(worker)
    if mode == "torchft-gloo":
        return _launch_torchft(worker)
    if mode == "torchrun-gloo":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts", "1",
                   "--standalone", *worker]
    else:
        policy = ["--restart-policy", "rank"] if elastic else []
        command = [sys.executable, "-m", "ferro", "run", "--nproc-per-node", "4", "--max-restarts", "1", *policy,
                   "--grace", "2", *worker]
    start = time.time()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        return time.time() - start, f"hung: no end within {LAUNCH_TIMEOUT:.0f} s"
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if "Error" in line]
        return time.time() - start, f"failed with {done.returncode}: {lines[-1][:200] if lines else ''}"
    return time.time() - start, ""


def _entries(directory: str) -> list[dict]:
    entries = []
    for path in glob.glob(os.path.join(directory, "log-*.jsonl")):
        with open(path) as handle:
            entries += [json.loads(line) for line in handle]
    return sorted(entries, key=lambda e: e["t"])


def _measure(mode: str, directory: str) -> dict[str, float]:
    entries = _entries(directory)
    kills = [e["t"] for e in entries if "kill" in e]
    if not kills:
        return {}  # the run never reached the kill (its problem is reported)
    killed = kills[0]
    done_before = [e for e in entries if "step" in e and e["t"] < killed]
    before = max(e["step"] for e in done_before)
    # a step's time: between completions of consecutive steps before the kill (median of the last 10)
    times = sorted({e["step"]: e["t"] for e in done_before if e["step"] > before - 11}.items())
    result = {"step": statistics.median(b[1] - a[1] for a, b in zip(times, times[1:], strict=False))}
    after = [e for e in entries if "step" in e and e["t"] > killed]
    if not after:
        return result
    first = after[0]
    result.update({"recover": first["t"] - killed, "lost": float(before + 1 - first["step"])})
    back = [e["t"] for e in after if e["world"] == 4]
    if back:
        result["healed"] = back[0] - killed
    if mode.startswith("ferro-elastic"):
        changes = [c for e in entries if "history" in e for c in e["history"]]
        shrink = [c for c in changes if c["cause"] not in ("start", "grow") and c["detected"] > killed]
        if shrink:
            result["detect"] = min(c["detected"] for c in shrink) - killed
            result["reform"] = max(c["synced"] for c in shrink) - min(c["detected"] for c in shrink)
        grown = [c for c in changes if c["sent_bytes"]]
        if grown:
            heal = max(grown, key=lambda c: c["synced"])
            result["heal_gbps"] = heal["sent_bytes"] / max(heal["synced"] - heal["formed"], 1e-9) / 1e9
    return result


def _stream(group, nbytes: int) -> float:
    import ferro

    buffer = np.ones(nbytes // 4, np.float32)
    ferro.barrier(group=group)
    start = time.perf_counter()
    for _ in range(3):
        if group.rank == 0:
            ferro.send(buffer, 1, group=group)
        else:
            ferro.recv_into(buffer, 0, group=group)
    ferro.barrier(group=group)
    return 3 * nbytes / (time.perf_counter() - start) / 1e9


def _loopback_gbps(nbytes: int) -> float:
    """Point-to-point bandwidth of ferro's TCP transport between two processes, for ``nbytes`` (median of 3)."""
    from ferro.testing import run_processes

    return statistics.median(float(run_processes(_stream, 2, args=(nbytes,), backend="tcp")[0]) for _ in range(3))


def main() -> int:
    """Run the comparison and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES + MORE_MODES)} (default: the first five)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        {"ferro-elastic": worker_ferro_elastic, "ferro-restart": worker_ferro_restart,
         "ferro-elastic-torch-ddp": worker_ferro_elastic_torch_ddp, "ferro-elastic-hsdp": worker_ferro_elastic_hsdp,
         "torchrun-gloo": worker_torchrun_gloo, "torchft-gloo": worker_torchft_gloo}[args.worker](args.dir, args.steps)
        return 0
    modes = args.modes.split(",")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    problems: dict[str, list[str]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes:  # interleaved: each round runs every mode once
            directory = tempfile.mkdtemp(prefix=f"ferro-bench-elastic-{mode}-")
            try:
                wall, problem = _launch(mode, directory, args.steps)
                walls[mode].append(wall)
                results[mode].append(_measure(mode, directory))
                if problem:
                    problems[mode].append(problem)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            print(f"round {round_ + 1} {mode}: {json.dumps(results[mode][-1])} {problem}", file=sys.stderr,
                  flush=True)
    loopback = _loopback_gbps(200_000_000)
    print(f"4 ranks, {WIDTH}x{WIDTH}+{WIDTH} float32 parameters, SGD momentum; SIGKILL of rank {KILLED_RANK} at "
          f"step {KILL_STEP} of {args.steps}; medians of {args.rounds} rounds")
    print("| mode | step | recover (kill -> next step done) | of which detect / re-form | steps lost | "
          "back to 4 ranks | whole run | heal GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode in modes:
        rows = results[mode]

        def median(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(r[key] for r in rows if key in r) if any(key in r for r in rows) else float("nan")

        heal = median("heal_gbps")
        heal_text = f"{heal:.2f} ({heal / loopback:.0%} of loopback {loopback:.2f})" if heal == heal else "-"
        split = f"{median('detect'):.2f} / {median('reform'):.2f} s" if mode.startswith("ferro-elastic") else "-"
        print(f"| {mode} | {median('step'):.2f} s | {median('recover'):.2f} s | {split} | {median('lost'):.0f} | "
              f"{median('healed'):.2f} s | {statistics.median(walls[mode]):.1f} s | {heal_text} |")
    for mode, seen in problems.items():
        for problem in seen:
            print(f"{mode}: {problem}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
