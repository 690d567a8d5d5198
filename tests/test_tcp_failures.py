"""Failures that only real processes over real sockets can show: death, signals, strangers."""

import logging
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
from _sync import on_entering

import ferro
from ferro.rendezvous.auth import connect_handshake
from ferro.rendezvous.connect import build_mesh
from ferro.rendezvous.settings import RendezvousConfig
from ferro.rendezvous.store import Store
from ferro.testing import RankExit, run_processes


def rank_killed_while_peer_receives(group):
    pids = ferro.all_gather_object(os.getpid(), group=group)
    if group.rank == 1:
        group.recv(np.empty(1), 0, timeout=60)  # waits until rank 0 kills it
        return "not killed"
    on_entering("recv_tagged", lambda: os.kill(pids[1], signal.SIGKILL))  # once rank 0 blocks in its receive
    try:
        group.recv(np.empty(1 << 20), 1, timeout=60)
        return "no error"
    except ferro.PeerLostError as exc:
        return type(exc).__name__, exc.peer, "rank 1" in str(exc)


def test_killed_rank_makes_its_peer_raise_peer_lost_not_time_out():
    results = run_processes(rank_killed_while_peer_receives, 2, allow_exit={1}, timeout=50)
    assert results[0] == ("PeerLostError", 1, True)
    assert results[1] == RankExit(None, "SIGKILL")


def rank_killed_mid_exchange(group):
    # A 4-rank ring exchange where rank 2 dies; its neighbours must not hang.
    n, r = group.world_size, group.rank
    group.barrier()
    if r == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(50):
            group.sendrecv(np.ones(1 << 21), (r + 1) % n, np.empty(1 << 21), (r - 1) % n, timeout=60)
        return "finished"
    except (ferro.PeerLostError, ferro.ConnectionBrokenError) as exc:
        return type(exc).__name__


def test_rank_killed_mid_ring_exchange():
    results = run_processes(rank_killed_mid_exchange, 4, allow_exit={0, 1, 2, 3}, timeout=50)
    # Rank 1 sends to and rank 3 receives from the dead rank 2: both see it go.
    assert results[1] == "PeerLostError"
    assert results[3] == "PeerLostError"
    assert results[2] == RankExit(None, "SIGKILL")


def rank_killed_in_all_to_all(group, block):
    # rank 2 dies as the others start a pairwise all_to_all: every survivor exchanges with rank 2 in that call,
    # so each must name it, none may hang. 2 MiB blocks go in a batch, all steps at once; 8 KiB blocks slide
    # (a step starts as one ends), and an uneven exchange never takes Bruck's rounds.
    n, r = group.world_size, group.rank
    counts = [block // 8] * n
    blocks = np.ones(n * (block // 8))

    def exchange(timeout=None):
        ferro.all_to_all_single_uneven(blocks, counts, counts, group=group, timeout=timeout)

    exchange()  # every connection made
    group.barrier()
    if r == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(20):
            exchange(timeout=60)
        return "finished"
    except (ferro.PeerLostError, ferro.ConnectionBrokenError) as exc:
        return type(exc).__name__, "rank 2" in str(exc)


@pytest.mark.parametrize("block", [2 << 20, 8 << 10])
def test_rank_killed_in_a_windowed_all_to_all_is_named_by_every_survivor(block):
    results = run_processes(rank_killed_in_all_to_all, 4, args=(block,), allow_exit={0, 1, 2, 3}, timeout=60)
    assert results[2] == RankExit(None, "SIGKILL")
    for r in (0, 1, 3):
        assert results[r] in (("PeerLostError", True), ("ConnectionBrokenError", True)), (r, results[r])


def rank_interrupted_in_recv(group):
    if group.rank == 1:
        out = np.empty(1)
        group.recv(out, 0, timeout=60)  # rank 0 sends once it was interrupted
        return float(out[0])
    on_entering("recv_tagged", lambda: os.kill(os.getpid(), signal.SIGINT))
    start = time.monotonic()
    try:
        group.recv(np.empty(1), 1, timeout=60)
        outcome = "no interrupt"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    elapsed = time.monotonic() - start
    group.send(np.array([7.0]), 1)  # no frame had started, so the group still works
    return outcome, elapsed < 30


def test_ctrl_c_interrupts_a_blocked_receive():
    results = run_processes(rank_interrupted_in_recv, 2, timeout=50)
    assert results == [("KeyboardInterrupt", True), 7.0]


def rank_with_wrong_secret(rank, world_size):
    secret = "right" if rank == 0 else "wrong"
    try:
        with ferro.TcpBackend.from_env(secret=secret, timeout=3):
            return "joined"
    except ferro.AuthenticationError as exc:
        return "AuthenticationError: " + str(exc)
    except ferro.DistributedTimeoutError as exc:
        return "DistributedTimeoutError: " + str(exc)


def test_process_without_the_secret_is_refused_on_both_sides():
    results = run_processes(rank_with_wrong_secret, 2, backend=None, timeout=50)
    assert results[1].startswith("AuthenticationError") and "secret" in results[1]
    assert results[0].startswith("DistributedTimeoutError") and "rank(s) [1]" in results[0]
    assert "the store refused 1 connection(s)" in results[0] and "job secret" in results[0]


def test_stray_connection_during_rendezvous_is_refused_and_the_mesh_still_forms(caplog):
    secret = b"job-secret"
    with Store("127.0.0.1", 0, secret=secret, serve=True, timeout=10) as store:
        meshes = {}

        def rank(r, client):
            meshes[r] = build_mesh(client, r, 2, prefix="test", secret=secret, bind_addr="127.0.0.1", timeout=10)

        with caplog.at_level(logging.WARNING, logger="ferro.rendezvous"), \
                Store("127.0.0.1", store.port, secret=secret) as client0:
            rank0 = threading.Thread(target=rank, args=(0, client0))
            rank0.start()
            host, port = store.get("test/addr/0", timeout=10).decode().rsplit(":", 1)
            stray = socket.create_connection((host, int(port)))
            with pytest.raises(ferro.AuthenticationError, match="does not hold this job's secret"):
                connect_handshake(stray, b"guess", b"mesh|test|2|1->0", 5, "rank 0")
            stray.close()
            rank(1, store)
            rank0.join(10)
            # Rank 0 refuses the stray on a handler thread of its own, which may log after the mesh has formed.
            deadline = time.monotonic() + 10
            while not any("refused a connection" in rec.message for rec in caplog.records) \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
        assert set(meshes) == {0, 1} and set(meshes[0]) == {1} and set(meshes[1]) == {0}
        assert any("refused a connection" in rec.message for rec in caplog.records)
        for mesh in meshes.values():
            for sock in mesh.values():
                sock.close()


def rank_from_env(rank, world_size):
    with ferro.TcpBackend.from_env(timeout=20) as group:
        out = np.empty(1, np.int64)
        group.sendrecv(np.array([group.rank], np.int64), (rank + 1) % world_size, out, (rank - 1) % world_size)
        return group.rank, group.world_size, int(out[0])


def test_from_env_reads_torchrun_style_variables():
    assert run_processes(rank_from_env, 3, backend=None) == [(0, 3, 2), (1, 3, 0), (2, 3, 1)]


@pytest.mark.parametrize("missing, variable", [("RANK", "RANK"), ("WORLD_SIZE", "WORLD_SIZE"),
                                               ("MASTER_ADDR", "MASTER_ADDR"), ("MASTER_PORT", "MASTER_PORT"),
                                               ("FERRO_SECRET", "FERRO_SECRET")])
def test_missing_configuration_names_the_variable(missing, variable):
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "FERRO_SECRET": "s"}
    del env[missing]
    with pytest.raises(ferro.ConfigurationError, match=variable):
        RendezvousConfig.resolve(environ=env)


@pytest.mark.parametrize("rank, world_size, error", [(2, 2, ferro.InvalidRankError), (-1, 2, ferro.InvalidRankError),
                                                     (0, 0, ferro.InvalidWorldSizeError),
                                                     (0, "2", ferro.InvalidWorldSizeError)])
def test_invalid_rank_or_world_size_is_refused_before_connecting(rank, world_size, error):
    with pytest.raises(error):
        ferro.TcpBackend(rank, world_size, secret="s", timeout=1)


def test_torch_tensors_travel_zero_copy_including_bfloat16():
    import torch  # part of the test extra: a missing torch is a failure, not a skip
    groups = ferro.SimulatedBackend.create_group(2, timeout=10)
    source = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4) / 3
    target = torch.zeros(3, 4, dtype=torch.bfloat16)
    floats = torch.linspace(0, 1, 5, requires_grad=True)
    floats_out = torch.zeros(5)
    groups[0].send(source, 1)
    groups[0].send(floats, 1)
    groups[1].recv(target, 0)
    groups[1].recv(floats_out, 0)
    assert torch.equal(target, source)
    assert torch.equal(floats_out, floats.detach())


def rank_congestion_of_each_connection(group):
    x = np.full(1 << 16, group.rank + 1.0)
    ferro.allreduce(x, group=group)
    names = {peer: socket.socket(fileno=os.dup(link.fileno())) for peer, link in group._links.items()}
    try:
        return float(x[0]), {peer: s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
                             for peer, s in names.items()}
    finally:
        for s in names.values():
            s.close()


def _another_congestion_control():
    """A congestion control this kernel allows that is not its default (None: none, or not Linux)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_allowed_congestion_control") as f:
            allowed = f.read().split()
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            default = f.read().strip()
    except OSError:
        return None
    return next((name for name in allowed if name != default), None)


@pytest.mark.skipif(_another_congestion_control() is None, reason="needs Linux allowing a second congestion control")
def test_ferro_tcp_congestion_sets_every_connections_congestion_control():
    chosen = _another_congestion_control()  # not the default, so a setting that did nothing would show
    results = run_processes(rank_congestion_of_each_connection, 3, env={"FERRO_TCP_CONGESTION": chosen})
    assert [total for total, _ in results] == [6.0] * 3
    assert [sorted(names) for _, names in results] == [[1, 2], [0, 2], [0, 1]]
    assert {name for _, names in results for name in names.values()} == {chosen}


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="TCP_CONGESTION is Linux's")
def test_a_congestion_control_the_kernel_refuses_fails_when_the_group_starts(monkeypatch):
    from ferro.backend.tcp import _congestion_control

    monkeypatch.setenv("FERRO_TCP_CONGESTION", "no-such-control")
    with pytest.raises(ferro.ConfigurationError, match="FERRO_TCP_CONGESTION='no-such-control': the kernel refuses"):
        _congestion_control()
    monkeypatch.delenv("FERRO_TCP_CONGESTION")
    assert _congestion_control() is None
