"""ferro.rpc: every worker calls every other over real processes; errors, timeouts, lost workers, shutdown."""

import os
import signal
import socket
import struct
import time

import numpy as np
import pytest

import ferro
from ferro import rpc
from ferro.testing import run_processes


def add(a, b):
    return a + b


def whoami():
    return rpc.get_worker_info().name


def fail(message):
    raise KeyError(message)


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def relay(to, value):
    """A nested call: this worker asks another one."""
    return rpc.rpc_sync(to, add, (value, 1)) * 10


def rank_all_pairs(rank, world_size):
    rpc.init_rpc(f"w{rank}", timeout=60)
    seen = {}
    for peer in range(world_size):
        name = f"w{peer}"
        seen[f"sync {name}"] = rpc.rpc_sync(name, whoami)
        seen[f"async {name}"] = rpc.rpc_async(peer, add, (rank, peer)).wait()
        seen[f"nested {name}"] = rpc.rpc_sync(name, relay, (f"w{(peer + 1) % world_size}", rank))
        array = np.arange(1000.0) * rank
        seen[f"array {name}"] = float(rpc.rpc_sync(name, np.add, (array, 1.0)).sum())
        import torch
        tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) * rank
        back = rpc.rpc_sync(name, torch.mul, (tensor, 2))
        seen[f"tensor {name}"] = (str(back.dtype), tuple(back.shape), back.float().sum().item())
    futures = [rpc.rpc_async(f"w{p}", add, (p, 100)) for p in range(world_size) for _ in range(5)]
    seen["many"] = sorted(f.wait() for f in futures)
    seen["then"] = rpc.rpc_async("w0", add, (1, 2)).then(lambda f: f.wait() * 2).wait()
    rpc.shutdown()
    return seen


@pytest.mark.parametrize("world", [3, 4])
def test_every_worker_calls_every_worker(world):
    pytest.importorskip("torch")
    for rank, seen in enumerate(run_processes(rank_all_pairs, world, backend=None, timeout=120)):
        for peer in range(world):
            assert seen[f"sync w{peer}"] == f"w{peer}"
            assert seen[f"async w{peer}"] == rank + peer
            assert seen[f"nested w{peer}"] == (rank + 1) * 10
            assert seen[f"array w{peer}"] == pytest.approx(np.arange(1000.0).sum() * rank + 1000)
            assert seen[f"tensor w{peer}"] == ("torch.bfloat16", (2, 3), 30.0 * rank)
        assert seen["many"] == sorted(p + 100 for p in range(world) for _ in range(5))
        assert seen["then"] == 6


def rank_errors(rank, world_size):
    rpc.init_rpc(f"w{rank}", timeout=60)
    seen = {}
    if rank == 0:
        try:
            rpc.rpc_sync("w1", fail, ("no such key",))
        except KeyError as exc:
            seen["remote"] = (str(exc), "".join(getattr(exc, "__notes__", [])), str(exc.__cause__))
        try:
            rpc.rpc_sync("w1", sleep_then, (2.0, "late"), timeout=0.3)
        except ferro.DistributedTimeoutError as exc:
            seen["timeout"] = str(exc)
        seen["after timeout"] = rpc.rpc_sync("w1", add, (2, 3))  # the agent stays usable
        try:
            rpc.rpc_sync("w1", lambda: 1)
        except Exception as exc:  # noqa: BLE001 - a lambda cannot travel by reference
            seen["lambda"] = type(exc).__name__
        try:
            rpc.rpc_sync("nobody", add, (1, 2))
        except ferro.InvalidRankError as exc:
            seen["unknown"] = str(exc)
    rpc.shutdown()
    return seen


def test_remote_exceptions_timeouts_and_bad_targets():
    seen = run_processes(rank_errors, 2, backend=None, timeout=120)[0]
    message, notes, cause = seen["remote"]
    assert message == "'no such key'" and "raised on RPC worker w1" in notes
    assert "in fail" in cause and "KeyError: 'no such key'" in cause
    assert "rpc to w1 (test_rpc.sleep_then): no answer within 0.3 s" in seen["timeout"]
    assert seen["after timeout"] == 5
    assert seen["lambda"] in ("PicklingError", "AttributeError")
    assert "no worker is named 'nobody' (workers: w0, w1)" in seen["unknown"]


def rank_killed(rank, world_size):
    rpc.init_rpc(f"w{rank}", timeout=30)
    if rank == 1:
        rpc.rpc_sync("w0", add, (1, 1))
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)  # dies while w0 waits on it: no goodbye
    seen = {}
    try:
        rpc.rpc_sync("w1", sleep_then, (30, "never"))
    except ferro.PeerLostError as exc:
        seen["lost"] = str(exc)
    try:
        rpc.rpc_sync("w1", add, (1, 1))
    except ferro.PeerLostError as exc:
        seen["after"] = str(exc)
    start = time.monotonic()
    rpc.shutdown(timeout=20)
    seen["shutdown seconds"] = time.monotonic() - start
    return seen


def test_a_worker_killed_mid_call_fails_the_futures_waiting_on_it():
    results = run_processes(rank_killed, 3, backend=None, timeout=120, allow_exit=[1])
    for rank in (0, 2):
        if rank == 0:
            assert "worker w1 (rank 1) is gone" in results[0]["lost"]
            assert "worker w1 is gone" in results[0]["after"]
        assert results[rank]["shutdown seconds"] < 10  # the survivors do not wait for the dead


def rank_without_secret(rank, world_size):
    if rank == 1:
        os.environ["FERRO_SECRET"] = "not the job's secret"
    try:
        rpc.init_rpc(f"w{rank}", timeout=3)
    except (ferro.AuthenticationError, ferro.DistributedTimeoutError) as exc:
        return type(exc).__name__
    rpc.shutdown()
    return "joined"


def test_a_process_without_the_secret_is_refused():
    results = run_processes(rank_without_secret, 2, backend=None, timeout=120)
    assert "joined" not in results
    assert "AuthenticationError" in results


class Counter:
    def __init__(self, start=0):
        self.value = start

    def add(self, n):
        self.value += n
        return self.value


def make_array(n):
    return np.arange(n, dtype=np.float64)


def rref_sum(rref):
    """Runs on any worker: fetch the value behind an RRef passed as an argument."""
    return float(np.sum(rref.to_here()))


def pass_back(rref):
    return rref  # an RRef returned: a new copy on the caller


def owned():
    return rpc.owned_count()


def rank_rrefs(rank, world_size):
    rpc.init_rpc(f"w{rank}", timeout=60)
    seen = {}
    for owner in range(world_size):
        ref = rpc.remote(f"w{owner}", make_array, (10 + rank,))
        seen[f"to_here {owner}"] = ref.to_here().tolist()
        seen[f"owner {owner}"] = (ref.owner_name(), ref.owner().id, ref.is_owner())
        other = f"w{(rank + 1) % world_size}"  # the RRef travels to a third worker, which fetches from the owner
        seen[f"passed {owner}"] = rpc.rpc_sync(other, rref_sum, (ref,))
        back = rpc.rpc_sync(other, pass_back, (ref,))
        seen[f"back {owner}"] = back.to_here().tolist()
        counter = rpc.remote(owner, Counter, (rank,))
        counter.rpc_sync().add(5)
        seen[f"proxy {owner}"] = (counter.rpc_async().add(1).wait(), counter.remote().add(0).to_here())
        if owner == rank:
            seen["local"] = counter.local_value().value
        else:
            try:
                counter.local_value()
            except RuntimeError as exc:
                seen["not owner"] = str(exc)
        del ref, back, counter
    failing = rpc.remote("w0", fail, ("made badly",))
    try:
        failing.to_here()
    except KeyError as exc:
        seen["failed"] = str(exc)
    del failing
    import gc
    gc.collect()
    # Every holder everywhere dropped its RRefs: every owner's count returns to zero (decrefs are notifications).
    rpc.rpc_sync("w0", add, (0, 0))  # all workers get here before anyone counts (a round trip is no barrier;
    deadline = time.monotonic() + 20  # so poll)
    while True:
        counts = [rpc.rpc_sync(f"w{w}", owned) for w in range(world_size)]
        if sum(counts) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    seen["owned"] = counts
    rpc.shutdown()
    return seen


@pytest.mark.parametrize("world", [3, 4])
def test_remote_references_and_their_counts(world):
    for rank, seen in enumerate(run_processes(rank_rrefs, world, backend=None, timeout=120)):
        for owner in range(world):
            values = list(np.arange(10 + rank, dtype=np.float64))
            assert seen[f"to_here {owner}"] == values and seen[f"back {owner}"] == values
            assert seen[f"owner {owner}"] == (f"w{owner}", owner, owner == rank)
            assert seen[f"passed {owner}"] == sum(values)
            assert seen[f"proxy {owner}"] == (rank + 6, rank + 6)
        assert seen["local"] == rank + 6
        assert "the value lives on w" in seen["not owner"]
        assert seen["failed"] == "'made badly'"
        assert seen["owned"] == [0] * world


def test_parameter_server_example_trains_to_the_single_process_weights(tmp_path):
    import re
    import subprocess
    import sys
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "parameter_server.py")
    done = subprocess.run([sys.executable, "-m", "ferro", "run", "--nproc-per-node", "3", example, "--steps", "20",
                           "--check"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[ps] 20 steps from 2 trainers" in done.stdout
    worst = float(re.search(r"max \|parameter server - single process\| = ([\d.e+-]+)", done.stdout).group(1))
    assert worst <= 1e-12
    assert "is gone" not in done.stdout + done.stderr  # a graceful shutdown is not a lost worker


def rank_not_graceful(rank, world_size, slow_join):
    if slow_join and rank == 1:  # w1's last rendezvous steps come late: w0 shuts down before they reach the store
        import ferro.rpc.api as api
        real_wait = api.wait_for_ranks

        def late_wait(store, keys, deadline, rank, doing):
            time.sleep(1.0 if doing == "start serving RPC" else 0.0)
            real_wait(store, keys, deadline, rank, doing)
        api.wait_for_ranks = late_wait
    rpc.init_rpc(f"w{rank}", timeout=30)
    seen = {}
    if rank == 0:
        future = rpc.rpc_async("w1", sleep_then, (1.0, "late"))
        rpc.shutdown(graceful=False)
        try:
            future.wait()
        except ferro.BackendClosedError as exc:
            seen["failed"] = str(exc)
        return seen
    start = time.monotonic()
    rpc.shutdown()  # w0 left without a goodbye: its closed connection counts as done
    seen["seconds"] = time.monotonic() - start
    return seen


@pytest.mark.parametrize("slow_join", [False, True])
def test_shutdown_without_grace_fails_pending_calls_at_once(slow_join):
    first, second = run_processes(rank_not_graceful, 2, args=(slow_join,), backend=None, timeout=120)
    assert "rpc to w1 (test_rpc.sleep_then): the RPC agent was shut down" in first["failed"]
    assert second["seconds"] < 10


def test_frames_that_lie_are_refused_before_allocating():
    from ferro.rpc.wire import Receiver
    for header in (b"HTTP" + bytes(24),  # not an RPC frame
                   struct.pack("<4sIQQI", b"FRPC", 1, 7, 1 << 40, 0),  # a body of a terabyte
                   struct.pack("<4sIQQI", b"FRPC", 1, 7, 10, 1 << 20)):  # a million buffers
        ours, theirs = socket.socketpair()
        with ours, theirs:
            theirs.sendall(header)
            with pytest.raises(ferro.ProtocolError, match="rpc: "):
                Receiver(ours).receive()


def rank_beside_a_group(rank, world_size):
    group = ferro.init_process_group("tcp")  # its store on MASTER_PORT, served by rank 0
    rpc.init_rpc(f"w{rank}")  # the same port: rank 0 joins that store instead of serving a second one
    total = ferro.allreduce(np.array([rank + 1.0]), group=group)
    answer = rpc.rpc_sync(f"w{(rank + 1) % world_size}", add, (rank, 10))
    rpc.shutdown()
    ferro.destroy_process_group()
    return float(total[0]), answer


def test_rpc_beside_a_process_group_on_the_same_port():
    results = run_processes(rank_beside_a_group, 3, backend=None, timeout=120)
    assert results == [(6.0, 10), (6.0, 11), (6.0, 12)]
