"""ferro.elastic: training that survives lost ranks in place, checked against one process training the whole batch.

The process tests run ``examples/elastic_train.py`` under ``ferro run --restart-policy rank`` (real
processes, real sockets, the agent's store), kill ranks at fixed steps (SIGKILL, SIGSTOP, two at once,
inside the heal, a replacement while it joins), and compare the final float64 parameters with a
single-process run over the same global batches to 1e-12. The unit tests cover the sampler, the state
transfer, the store view, and the protocol on threads with deaths written by the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ferro
from ferro import nn
from ferro.elastic import ElasticSampler, Manager, Step, keys, membership_failure
from ferro.elastic.membership import members_named, whole_replicas
from ferro.elastic.transfer import receive_state, send_state
from ferro.errors import (
    CollectiveMismatchError,
    ConfigurationError,
    MembershipError,
    PeerLostError,
    QuorumLostError,
)
from ferro.rendezvous.scoped import ScopedStore
from ferro.rendezvous.settings import free_port
from ferro.rendezvous.store import Store
from ferro.testing import run_threads
from ferro.testing.netns import can_create_namespaces, two_hosts

HERE = os.path.dirname(__file__)
EXAMPLE = os.path.join(HERE, "..", "examples", "elastic_train.py")
FAULTY = os.path.join(HERE, "elastic", "faulty_train.py")
STEPS = 60


# --- the reference: one process, the whole global batch each step ------------------------------------------

def _reference(steps: int) -> dict[str, np.ndarray]:
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    try:
        from elastic_train import data, model_and_optimizer
    finally:
        sys.path.pop(0)
    x, y = data(1024, 16, np.float64)
    net, optimizer = model_and_optimizer(16, 64, np.float64, 0.05)
    sampler, criterion = ElasticSampler(len(x), 64, seed=0), nn.MSELoss()
    for step in range(steps):
        batch = sampler.global_batch(step)
        optimizer.zero_grad()
        criterion(net(x[batch]), y[batch])
        net.backward(criterion.backward())
        optimizer.step()
    return net.state_dict()


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return _reference(STEPS)


def _run(tmp_path, *args: str, script: str = EXAMPLE, restarts: int = 1, min_size: int | None = None,
         heartbeat: float = 10.0, grow_to: int = 4, nproc: int = 4, launcher: tuple[str, ...] = (),
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the example under ``ferro run``; its last steps slow down until ``grow_to`` ranks train again."""
    command = [sys.executable, "-m", "ferro", "run", "--nproc-per-node", str(nproc), "--restart-policy", "rank",
               "--max-restarts", str(restarts), "--heartbeat-timeout", str(heartbeat), "--grace", "2", *launcher]
    if min_size is not None:
        command += ["--min-size", str(min_size)]
    return subprocess.run([*command, script, "--steps", str(STEPS), "--float64", "--sleep", "0.02",
                           "--wait-for-size", str(grow_to), "--out", str(tmp_path / "final.npz"), *args],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=None if env is None else dict(os.environ, **env))


def _check_exact(tmp_path, done: subprocess.CompletedProcess, reference: dict[str, np.ndarray]) -> list[dict]:
    assert done.returncode == 0, done.stdout + done.stderr
    # The job can end well without the saver's file: its saver killed after it marked training finished.
    assert (tmp_path / "final.npz").exists(), done.stdout + done.stderr
    final = np.load(tmp_path / "final.npz")
    for name, expected in reference.items():
        np.testing.assert_allclose(final[name], expected, rtol=1e-12, atol=1e-14, err_msg=name)
    record = json.loads((tmp_path / "final.npz.json").read_text())
    steps = [entry[0] for entry in record["log"]]
    # The rank that saved trained each step at most once, in order, to the last. (It may skip a step it
    # received: a step others committed before a loss is taken from them, not trained again. The exact
    # parameters above are what prove that no step was lost or counted twice.)
    assert steps and steps == sorted(set(steps)) and steps[-1] == STEPS - 1, (steps, done.stderr)
    return record["history"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill, options", [("0:20", []), ("2:20", []), ("1:20,3:20", []),
                                           ("0:20", ["--backend", "shm"]),
                                           # torch variants on 2 ranks: each rank's `import torch` costs ~3 s
                                           ("1:5", ["--torch"]), ("0:5", ["--torch-ddp"])],
                         ids=["rank 0", "a middle rank", "two at once", "rank 0, shared memory", "a torch module",
                              "torch's own DDP, rank 0"])
def test_sigkilled_ranks_are_survived_in_place_and_training_is_exact(tmp_path, reference, kill, options):
    size = 4
    if any(option.startswith("--torch") for option in options):
        pytest.importorskip("torch", reason="the torch variants need torch (pip install '.[test]')")
        size = 2
    done = _run(tmp_path, "--kill", kill, *options, nproc=size, grow_to=size)
    history = _check_exact(tmp_path, done, reference)
    lost = kill.count(":")
    for rank in (item.split(":")[0] for item in kill.split(",")):
        assert f"rank {rank}.0 was killed by SIGKILL; the others train on; starting a replacement" in done.stderr
    sizes = [len(change["members"]) for change in history]
    assert size - lost in sizes or history[0]["cause"] == "grow"  # it shrank (or this rank is a replacement)
    assert sizes[-1] == size, done.stderr  # and grew back
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill", ["1:20", "0:20"], ids=["a replica's second rank", "rank 0"])
def test_a_hybrid_sharded_replica_that_loses_a_rank_drops_out_whole_and_heals(tmp_path, reference, kill):
    done = _run(tmp_path, "--kill", kill, "--replica-size", "2")
    history = _check_exact(tmp_path, done, reference)
    lost = int(kill.split(":")[0])
    mate = lost ^ 1  # the other rank of its replica (pairs 0-1 and 2-3)
    assert f"member {mate}.0: its replica lost a rank; waiting out of epoch 1 until it is whole again" in done.stderr
    saver = [change["members"] for change in history]
    assert saver[-1] == (["0.0", "1.1", "2.0", "3.0"] if lost == 1 else ["0.1", "1.0", "2.0", "3.0"]), saver
    if lost == 1:  # rank 0 waited out, then rejoined: it trained in epoch 0 and from the heal on
        assert [len(members) for members in saver] == [4, 4], saver
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(300)
def test_hybrid_sharding_stops_cleanly_when_every_replica_lost_a_rank(tmp_path):
    done = _run(tmp_path, "--kill", "1:10,2:10", "--replica-size", "2", grow_to=0)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("ferro run: job failed: only 0 rank(s) left (), fewer than min_size=1: training stops (0.0, 3.0 alive "
            "but out of training: their replicas of 2 ranks each lost a rank)") in done.stderr, done.stderr


@pytest.mark.timeout(300)
@pytest.mark.skipif(not can_create_namespaces(), reason="two emulated hosts need root and iproute2's ip")
@pytest.mark.parametrize("how, min_nodes", [("killed", 1), ("frozen", 1), ("killed", 2)],
                         ids=["node killed", "node frozen", "node killed below --min-nodes"])
def test_a_lost_node_is_noticed_by_its_lease_and_min_nodes_holds(tmp_path, reference, how, min_nodes):
    # A frozen node closes no connection: the survivors must not wait for the collective timeout (600 s here)
    with two_hosts() as (names, master):
        env = dict(os.environ, FERRO_SECRET="elastic-node-loss", FERRO_TIMEOUT="600")
        port = str(free_port("127.0.0.1"))
        logs = [tmp_path / f"node{node}.txt" for node in range(2)]
        launchers = []
        for node, name in enumerate(names):
            with open(logs[node], "w") as out:
                launchers.append(subprocess.Popen(
                    ["ip", "netns", "exec", name, sys.executable, "-m", "ferro", "run", "--nnodes", "2",
                     "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr", master, "--master-port",
                     port, "--restart-policy", "rank", "--min-nodes", str(min_nodes), "--heartbeat-timeout", "2",
                     "--grace", "2", EXAMPLE, "--steps", str(STEPS), "--float64", "--sleep", "0.1", "--out",
                     str(tmp_path / "final.npz")], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path))
        frozen: list[int] = []
        try:
            deadline = time.monotonic() + 120
            while "step 0: loss" not in logs[0].read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)
            if how == "frozen":  # the whole node stops: launcher and ranks, every connection left open
                frozen = _process_tree(launchers[1].pid)
                for pid in frozen:
                    os.kill(pid, signal.SIGSTOP)
            else:
                launchers[1].kill()  # node 1 goes whole: its launcher, and with it (parent-death signal) its ranks
            codes = [launchers[0].wait(timeout=150)]
        finally:
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for launcher in launchers:
                launcher.kill()
                launcher.wait()
    text = logs[0].read_text()
    assert "ferro run: node 1's launcher sent nothing for 2." in text, text
    assert "its ranks (2.0, 3.0) are taken for lost" in text
    if how == "frozen":
        assert "member 0.0: the launcher recorded members 2.0 and 3.0 of epoch 0 dead: cutting their connections" \
            in text
    if min_nodes == 1:
        assert codes[0] == 0, text
        history = _check_exact(tmp_path, subprocess.CompletedProcess([], 0, text, text), reference)
        assert [len(change["members"]) for change in history][-1] == 2
    else:
        assert codes[0] == 1, text
        message = "ranks on only 1 node(s) left (node(s) 0: 0.0, 1.0), fewer than min_nodes=2: training stops"
        assert f"ferro run: job failed: {message}" in text
        for rank in (0, 1):
            assert f"[rank {rank}] ferro.QuorumLostError: member {rank}.0: {message}" in text


def _process_tree(pid: int) -> list[int]:
    """Return ``pid`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue  # ended meanwhile
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


def _on_two_hosts(tmp_path, restarts: str, script: str, *args: str) -> tuple[list[int], list[tuple[str, str]]]:
    """Run ``script`` under ``ferro run --restart-policy rank`` on two emulated hosts of 2 ranks each."""
    with two_hosts() as (names, master):
        env = dict(os.environ, FERRO_SECRET="elastic-two-hosts")
        port = str(free_port("127.0.0.1"))
        launchers = [subprocess.Popen(
            ["ip", "netns", "exec", name, sys.executable, "-m", "ferro", "run", "--nnodes", "2", "--node-rank",
             str(node), "--nproc-per-node", "2", "--master-addr", master, "--master-port", port,
             "--restart-policy", "rank", "--max-restarts", restarts, "--grace", "2", script, "--steps", str(STEPS),
             "--float64", "--sleep", "0.02", "--out", str(tmp_path / "final.npz"), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path) for node, name in
            enumerate(names)]
        outputs = [launcher.communicate(timeout=240) for launcher in launchers]
    return [launcher.returncode for launcher in launchers], outputs


@pytest.mark.timeout(300)
@pytest.mark.skipif(not can_create_namespaces(), reason="two emulated hosts need root and iproute2's ip")
def test_two_hosts_survive_a_rank_of_the_second_host_in_place(tmp_path, reference):
    codes, outputs = _on_two_hosts(tmp_path, "1", EXAMPLE, "--wait-for-size", "4", "--kill", "3:20")
    for code, (out, err) in zip(codes, outputs, strict=True):
        assert code == 0, out + err
    assert "rank 3.0 was killed by SIGKILL; the others train on; starting a replacement" in outputs[1][1]
    history = _check_exact(tmp_path, subprocess.CompletedProcess([], 0, outputs[0][0], outputs[0][1]), reference)
    assert [len(change["members"]) for change in history][-1] == 4


@pytest.mark.timeout(300)
def test_a_frozen_rank_is_killed_by_its_heartbeat_and_training_is_exact(tmp_path, reference):
    done = _run(tmp_path, "--stop", "1:20", heartbeat=2.0)
    _check_exact(tmp_path, done, reference)
    assert "rank 1.0 sent no heartbeat for" in done.stderr
    assert "rank 1.0 stopped responding and was killed; the others train on" in done.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("die_in", ["2.0:settle", "1.1:receive_state", "1.1:request_join"],
                         ids=["a rank dies during heal", "a replacement dies receiving state",
                              "a replacement dies before admission"])
def test_deaths_during_recovery_end_correctly(tmp_path, reference, die_in):
    done = _run(tmp_path, "--kill", "1:15", "--die-in", die_in, script=FAULTY, restarts=2)
    history = _check_exact(tmp_path, done, reference)
    member = die_in.split(":")[0]
    assert f"rank {member} was killed by SIGKILL" in done.stderr, done.stderr
    if member == "1.1":  # the slot's next replacement joined, or came after the last step: both end well
        assert (len(history[-1]["members"]) == 4 or
                "[rank 1.2] member 1.2: the job finished before it could join" in done.stderr), done.stderr


@pytest.mark.timeout(300)
def test_below_min_size_every_rank_stops_with_one_clear_error(tmp_path):
    done = _run(tmp_path, "--kill", "1:10,2:10", restarts=0, min_size=3, grow_to=0)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ferro run: job failed: only 2 rank(s) left (0.0, 3.0), fewer than min_size=3: training stops" in done.stderr
    for rank in (0, 3):  # the same error on every survivor
        assert (f"[rank {rank}] ferro.QuorumLostError: member {rank}.0: only 2 rank(s) left (0.0, 3.0), fewer than "
                f"min_size=3" in done.stderr), done.stderr


@pytest.mark.timeout(300)
def test_when_every_rank_dies_at_once_the_replacements_say_so_and_stop(tmp_path):
    done = _run(tmp_path, "--kill", "0:3,1:3,2:3,3:3", grow_to=0)
    assert done.returncode == 1, done.stdout + done.stderr
    message = ("every rank of epoch 0 ended (0.0, 1.0, 2.0, 3.0): no rank holds the training state any more, so "
               "nothing can be joined")
    assert f"ferro run: job failed: {message}" in done.stderr, done.stderr
    assert f"QuorumLostError: member 2.1: the job stopped before it could join: {message}" in done.stderr


def test_the_manager_needs_the_in_place_launcher(monkeypatch):
    monkeypatch.delenv("FERRO_ELASTIC", raising=False)
    with pytest.raises(ConfigurationError, match="--restart-policy rank"):
        Manager()


@pytest.mark.parametrize("flags, message", [(["--min-size", "5"], "--min-size must be between 1 and the 4 ranks"),
                                            (["--min-nodes", "2"], "--min-nodes must be between 1 and the 1 node(s)"),
                                            (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be positive")])
def test_ferro_run_refuses_bad_elastic_settings(tmp_path, flags, message):
    done = subprocess.run([sys.executable, "-m", "ferro", "run", "--nproc-per-node", "4", "--restart-policy", "rank",
                           *flags, EXAMPLE], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr


def test_min_size_and_min_nodes_need_the_in_place_policy(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ferro", "run", "--nproc-per-node", "2", "--min-size", "2",
                           EXAMPLE], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and "--min-size and --min-nodes apply to --restart-policy rank" in done.stderr


# --- the protocol on threads: deaths written by the test, as the agent would --------------------------------

@pytest.mark.timeout(120)
def test_threads_shrink_in_place_when_a_member_is_recorded_dead():
    port = free_port("127.0.0.1")
    server = Store("127.0.0.1", port, secret=b"t", serve=True)
    members = ["0.0", "1.0", "2.0"]
    results: dict[str, tuple[int, list[int]]] = {}

    def rank(i: int) -> None:
        store = Store("127.0.0.1", port, secret=b"t")
        manager = Manager(store=store, member=members[i], members=members, secret=b"t", timeout=20)
        value = np.zeros(1)
        sizes = []
        for step in manager.steps(6):
            with step:
                if members[i] == "2.0" and step.number == 3:
                    server.set(keys.dead("2.0"), "killed by the test")  # what the agent writes...
                    manager.group.close()                             # ...when the process is gone
                    return
                value += ferro.allreduce(np.ones(1), group=manager.group)
                sizes.append(step.world_size)
        results[members[i]] = (manager.step, sizes)
        manager.close()

    try:
        _run_in_threads(rank, 3)
    finally:
        server.close()
    for member in ("0.0", "1.0"):
        committed, sizes = results[member]
        assert committed == 6
        assert sizes == [3, 3, 3, 2, 2, 2]  # step 3 abandoned at 3 ranks and redone at 2


def _run_in_threads(fn, n: int) -> None:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,), name="rank") for i in range(n)]  # one thread tag
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]


def test_a_member_left_out_of_an_epoch_is_told():
    port = free_port("127.0.0.1")
    with Store("127.0.0.1", port, secret=b"t", serve=True) as store:
        store.set(keys.epoch(1, "members"), json.dumps({"members": ["0.0"], "joins": 0}))
        from ferro.elastic.membership import Membership

        with pytest.raises(MembershipError, match="epoch 1 formed without it"):
            Membership(store, "1.0").settle(1, ["0.0", "1.0"], 0, timeout=5)


def test_messages_name_one_member_or_a_list_of_members():
    assert members_named(["1.0"]) == "member 1.0"
    assert members_named(["2.0", "3.0"]) == "members 2.0 and 3.0"
    assert members_named(iter(["0.1", "2.0", "3.0"])) == "members 0.1, 2.0 and 3.0"


def test_whole_replicas_train_in_launch_order_and_broken_ones_wait():
    assert whole_replicas(["2.0", "0.0", "1.0"], 1) == (["2.0", "0.0", "1.0"], [])  # one rank each: all, as given
    assert whole_replicas(["0.0", "2.0", "3.0", "1.1"], 2) == (["0.0", "1.1", "2.0", "3.0"], [])
    assert whole_replicas(["3.0", "0.0", "2.0"], 2) == (["2.0", "3.0"], ["0.0"])
    assert whole_replicas(["0.0", "4.1", "5.0", "3.0"], 3) == (["3.0", "4.1", "5.0"], ["0.0"])


def test_a_waiting_member_is_invited_back_or_told_it_was_left_out():
    port = free_port("127.0.0.1")
    with Store("127.0.0.1", port, secret=b"t", serve=True) as store:
        from ferro.elastic.membership import Membership

        store.set(keys.epoch(1, "members"), json.dumps({"members": ["2.0", "3.0"], "joins": 1, "waiting": ["0.0"]}))
        store.set(keys.epoch(2, "invited"), json.dumps({"invited": ["0.0", "1.1"], "joins": 1, "waiting": []}))
        invitation = Membership(store, "0.0").wait_for_invitation(None, 2)
        assert invitation is not None and (invitation.number, invitation.previous) == (2, ("2.0", "3.0"))
        store.set(keys.epoch(2, "members"), json.dumps({"members": ["2.0", "3.0"], "joins": 1}))
        with pytest.raises(MembershipError, match="epoch 2 considered this member and left it out"):
            Membership(store, "1.0").wait_for_invitation(None, 2)


@pytest.mark.timeout(120)
def test_torch_ddp_and_fsdp_refuse_what_the_manager_sets():
    torch = pytest.importorskip("torch", reason="torch's DDP needs torch (pip install '.[test]')")
    from ferro.interop.torch_elastic import elastic_ddp

    port = free_port("127.0.0.1")
    with Store("127.0.0.1", port, secret=b"t", serve=True) as server:
        manager = Manager(store=server.clone(), member="0.0", members=["0.0"], secret=b"t", timeout=20)
        try:
            with pytest.raises(ConfigurationError, match="init_sync, process_group are set here"):
                elastic_ddp(manager, torch.nn.Linear(2, 2), process_group=None, init_sync=True)
            with pytest.raises(ConfigurationError, match="give Manager\\(replica_size=N\\)"):
                manager.fsdp(nn.Linear(2, 2))
            with pytest.raises(ConfigurationError, match="has no rebind"):
                manager.track(torch.nn.Linear(2, 2))
            ddp = elastic_ddp(manager, torch.nn.Linear(2, 2))
            assert ddp.process_group.size() == 1 and ddp.process_group.name() == "ferro"
        finally:
            manager.close()


def test_fsdp_rebind_keeps_the_sharding_and_moves_local_shards():
    def body(group):
        mesh = ferro.init_device_mesh((2, 2), ("replicate", "shard"), group=group)
        net = nn.Sequential(nn.Linear(6, 5, rng=np.random.default_rng(1), dtype=np.float64))
        model = ferro.FSDP(net, device_mesh=mesh, sharding_strategy="hybrid_shard")
        shards = model.local_state_dict()
        same = ferro.init_device_mesh((2, 2), ("replicate", "shard"), group=group)
        model.rebind(device_mesh=same)  # new sub-groups, same layout: accepted
        assert model.shard_group is same.get_group(1) and model.replicate_group is same.get_group(0)
        other = ferro.init_device_mesh((1, 4), ("replicate", "shard"), group=group)
        with pytest.raises(ConfigurationError, match="only the replicate dimension may change"):
            model.rebind(device_mesh=other)
        model.load_local_state_dict({name: np.full_like(value, group.rank) for name, value in shards.items()})
        with pytest.raises(ValueError, match="holds 3 elements"):
            model.load_local_state_dict({name: np.zeros(3) for name in shards})
        return {name: value.copy() for name, value in model.local_state_dict().items()}

    for rank, state in enumerate(run_threads(body, 4)):
        for value in state.values():
            np.testing.assert_array_equal(value, np.full_like(value, rank))


# --- the pieces -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 3, 4, 7])
def test_the_sampler_splits_each_global_batch_once_and_weights_shards_to_the_global_mean(world_size):
    sampler = ElasticSampler(100, 16, seed=3)
    for step in (0, 5, 6, 7):  # step 6 spans two passes over the data (96..111)
        shards = [sampler.shard(step, r, world_size) for r in range(world_size)]
        together = np.concatenate([s.indices for s in shards])
        np.testing.assert_array_equal(together, sampler.global_batch(step))
        assert len(set(together.tolist())) == 16 or step == 6
        # mean over ranks of (weight * local mean) is the global mean, for any per-sample values
        values = np.random.default_rng(step).standard_normal(100)
        weighted = np.mean([s.loss_weight * values[s.indices].mean() for s in shards])
        np.testing.assert_allclose(weighted, values[sampler.global_batch(step)].mean(), rtol=1e-13)
    passes = np.concatenate([sampler.global_batch(s) for s in range(6)])[:96]
    assert len(set(passes.tolist())) == 96  # a pass visits each sample once
    with pytest.raises(ValueError, match="cannot split a batch of 16"):
        sampler.shard(0, 0, 17)


def test_optimizer_state_round_trips_through_state_dict():
    rng = np.random.default_rng(0)
    for make in (lambda p: nn.SGD(p, lr=0.1, momentum=0.9), lambda p: nn.Adam(p, lr=0.01)):
        a, b = nn.Linear(3, 2, rng=rng), nn.Linear(3, 2, rng=rng)
        b.load_state_dict(a.state_dict())
        opt_a, opt_b = make(a.parameters()), make(b.parameters())
        for _ in range(2):
            a(np.ones((4, 3), np.float32))
            opt_a.zero_grad()
            a.backward(np.ones((4, 2), np.float32))
            opt_a.step()
        b.load_state_dict(a.state_dict())
        opt_b.load_state_dict(opt_a.state_dict())
        for model, opt in ((a, opt_a), (b, opt_b)):
            model(np.full((4, 3), 0.5, np.float32))
            opt.zero_grad()
            model.backward(np.ones((4, 2), np.float32))
            opt.step()
        for name, value in a.state_dict().items():
            np.testing.assert_array_equal(b.state_dict()[name], value)


def test_state_transfer_moves_model_and_optimizer_between_simulated_ranks():
    def body(group):
        rng = np.random.default_rng(group.rank)
        net = nn.Linear(5, 3, rng=rng, dtype=np.float64)
        opt = nn.SGD(net.parameters(), lr=0.1, momentum=0.9)
        if group.rank == 0:
            net(np.ones((2, 5)))
            opt.zero_grad()
            net.backward(np.ones((2, 3)))
            opt.step()
            sent = send_state({"model": net, "optimizer": opt}, 1, group)
            assert sent == (5 * 3 + 3) * 8 * 2  # weight and bias, and their momentum buffers, in float64
            return net.state_dict(), opt.state_dict()
        received = receive_state({"model": net, "optimizer": opt}, 0, group)
        assert received == (5 * 3 + 3) * 8 * 2
        return net.state_dict(), opt.state_dict()

    (model0, opt0), (model1, opt1) = run_threads(body, 2)
    for name in model0:
        np.testing.assert_array_equal(model0[name], model1[name])
    for index, values in opt0["state"].items():
        np.testing.assert_array_equal(values["momentum_buffer"], opt1["state"][index]["momentum_buffer"])


def test_only_lost_members_abandon_a_step():
    lost = PeerLostError("rank 1 exited", peer=1)
    assert membership_failure(RuntimeError("wrapped")) is None
    wrapped = RuntimeError("from torch")
    wrapped.__cause__ = lost
    assert membership_failure(wrapped) is lost
    assert membership_failure(RuntimeError("ferro.errors.PeerLostError: rank 0: ...")) is not None
    step = Step(3, 0, 2, None)
    with step:
        raise lost
    assert step.failure is lost
    with pytest.raises(CollectiveMismatchError), Step(3, 0, 2, None):
        raise CollectiveMismatchError("a bug, not a lost rank")
    with pytest.raises(QuorumLostError), Step(3, 0, 2, None):
        raise QuorumLostError("below min_size")


def test_scoped_store_keeps_its_keys_under_its_prefix():
    port = free_port("127.0.0.1")
    with Store("127.0.0.1", port, secret=b"t", serve=True) as store:
        scoped = ScopedStore(store, "a/b/")
        scoped.set("k", "v")
        assert store.get("a/b/k") == b"v" and scoped.get("k") == b"v"
        assert scoped.add("n", 2) == 2 and store.add("a/b/n", 0) == 2
        assert scoped.compare_set("c", "", "x") == b"x" and scoped.check(["k", "c"]) and not scoped.check(["z"])
        clone = scoped.clone()
        assert clone.get("k") == b"v"
        clone.close()
        assert store.get("a/b/k") == b"v"  # the shared client is not closed by a view that does not own it


# --- hardening: a stuck rank, names after a change, a bug, one dump folder, another model ------------------------

@pytest.mark.timeout(300)
def test_a_stuck_rank_is_killed_by_the_hang_watch_replaced_and_the_job_ends(tmp_path, reference):
    """Rank 1 sleeps for good at step 10 (its heartbeat thread beats on): the hang watch ends it, the job ends."""
    done = _run(tmp_path, "--hang-at", "1:10", script=FAULTY, nproc=3, grow_to=3,
                launcher=("--hang-timeout", "4", "--dump-dir", "dumps"), env={"FERRO_TIMEOUT": "5"})
    _check_exact(tmp_path, done, reference)
    assert "ferro run: rank 1.0 is hung (--hang-timeout 4 s): killing it; the others train on" in done.stderr
    verdict = next(line for line in done.stderr.splitlines() if line.startswith("ferro run: verdict: "))
    assert "rank 1" in verdict and "faulty_train.py" in verdict and "in _hang (idle" in verdict, verdict
    assert "rank 1.0 hung (no call made or ended for 4 s, idle) and was killed; the others train on; starting a " \
        "replacement" in done.stderr
    # One folder for the whole job: every rank's dump and the verdict, where the printed hint says.
    folder = tmp_path / "dumps"
    assert {"rank-0.json", "rank-1.json", "rank-2.json", "verdict.txt"} <= {p.name for p in folder.iterdir()}
    assert f"ferro doctor {folder.name}" in done.stderr or f"ferro doctor {folder}" in done.stderr
    assert not (tmp_path / "ferro-dumps").exists()


@pytest.mark.timeout(300)
def test_after_changes_of_membership_every_message_names_the_launcher_s_identity(tmp_path, reference):
    """Member 1.0 dies at step 10, its replacement 1.1 at step 30: survivors name 1.0 and 1.1, never themselves."""
    done = _run(tmp_path, "--kill", "1:10", "--kill-member", "1.1:30", script=FAULTY, restarts=2, nproc=3,
                grow_to=3)
    _check_exact(tmp_path, done, reference)
    survivors = [line for line in done.stderr.splitlines() if line.startswith(("[rank 0]", "[rank 2]"))]
    lost = [line for line in survivors if "abandoned" in line or "recorded" in line]
    assert lost, done.stderr
    for line in lost:
        prefix_rank = line.split("]")[0].removeprefix("[rank ")
        assert f"member {prefix_rank}.0 exited" not in line and f"rank {prefix_rank} exited" not in line, line
        about = re.sub(r"\bmember \d+\.\d+: ", "", line)  # less each speaker's own "member 0.0: "
        named = {name for names in re.findall(r"\bmembers? ((?:\d+\.\d+(?:, | and )?)+)", about)
                 for name in re.findall(r"\d+\.\d+", names)}
        assert named & {"1.0", "1.1"} and f"{prefix_rank}.0" not in named, line  # the lost, relayed or not
    assert any("member 1.1 exited, crashed or closed its group" in line for line in lost), done.stderr


@pytest.mark.timeout(300)
def test_a_bug_is_not_restarted_twice_and_the_job_does_not_succeed(tmp_path):
    """Rank 1 raises the same RuntimeError from step 10 on, in every life: two lives, then the others go on."""
    done = _run(tmp_path, "--raise-from", "1:10", script=FAULTY, restarts=3, nproc=3, grow_to=0)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("rank 1.1 exited with code 1 (RuntimeError: a bug in rank 1's training step); the same error as its "
            "previous life (1.0): a bug in the program, not a lost rank, so it is not restarted again") in done.stderr
    assert "[rank 1.2]" not in done.stderr
    assert ("ferro run: summary: rank 1 failed 2 time(s) (1.0, 1.1): RuntimeError: a bug in rank 1's training step"
            in done.stderr), done.stderr
    assert "ferro run: job failed: training finished, but rank(s) 1 failed by an error of their own" in done.stderr
    assert (tmp_path / "final.npz").exists()  # the others trained to the end


@pytest.mark.timeout(300)
def test_a_replacement_with_another_model_is_refused_before_it_trains_a_step(tmp_path, reference):
    """1.1 builds a 32-unit model where the job trains 64: refused at its state transfer, no step abandoned."""
    done = _run(tmp_path, "--kill", "1:10", "--model-of", "1.1:32", script=FAULTY, restarts=2, nproc=3, grow_to=3)
    assert done.returncode == 1, done.stdout + done.stderr
    history = _check_exact(tmp_path, subprocess.CompletedProcess([], 0, done.stdout, done.stderr), reference)
    causes = [change["cause"].split(":")[0] for change in history]
    assert "refused 1.1" in causes, causes
    # After the kill at step 10 the survivors abandoned that one step; the refusal abandoned none.
    abandoned = [line for line in done.stderr.splitlines() if "abandoned" in line and line.startswith("[rank 0]")]
    assert len(abandoned) == 1 and "step 10 abandoned" in abandoned[0], abandoned
    assert "[rank 1.1] ferro.ConfigurationError: member 1.1: refused: its objects do not take the job's training " \
        "state" in done.stderr, done.stderr
    assert "ferro run: summary: rank 1 failed 1 time(s) (1.1): ConfigurationError: member 1.1: refused" in done.stderr
    assert [len(change["members"]) for change in history][-1] == 3  # 1.2, with the job's model, joined


@pytest.mark.timeout(300)
@pytest.mark.skipif(not can_create_namespaces(), reason="two emulated hosts need root and iproute2's ip")
def test_a_bug_on_the_second_host_fails_the_first_host_s_exit_status_too(tmp_path):
    """Rank 3 (node 1) raises in every life: both launchers exit 1, node 0 from node 1's record in the store."""
    codes, outputs = _on_two_hosts(tmp_path, "2", FAULTY, "--raise-from", "3:10")
    assert codes == [1, 1], outputs
    assert "summary: rank 3 failed 2 time(s) (3.0, 3.1): RuntimeError: a bug in rank 3's training step" in \
        outputs[1][1], outputs[1][1]
    assert "job failed: training finished, but rank(s) 3 failed by an error of their own" in outputs[0][1], \
        outputs[0][1]
