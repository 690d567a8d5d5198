"""A clumsy user's configuration: each mistake is named at once, by what went wrong (issue 11)."""

import logging
import socket
import time

import numpy as np
import pytest

import ferro
from ferro.errors import (
    BackendClosedError,
    ConfigurationError,
    DistributedError,
    InvalidBufferError,
    InvalidRankError,
    InvalidWorldSizeError,
)
from ferro.rendezvous.settings import free_port
from ferro.rendezvous.store import Store
from ferro.testing import run_processes, run_threads


@pytest.fixture(autouse=True)
def no_default_group():
    yield
    if ferro.is_initialized():
        ferro.destroy_process_group()


@pytest.mark.parametrize("raw", ["inf", "nan", "-1", "1e300"])
def test_an_unusable_ferro_timeout_is_a_configuration_error(monkeypatch, raw):
    monkeypatch.setenv("FERRO_TIMEOUT", raw)
    with pytest.raises(ConfigurationError, match="FERRO_TIMEOUT") as caught:
        ferro.init_process_group(backend="tcp", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    assert "finite number of seconds" in str(caught.value)


@pytest.mark.parametrize("timeout", [float("inf"), True, "10"])
def test_an_unusable_timeout_argument_is_a_configuration_error(timeout):
    with pytest.raises(ConfigurationError, match="timeout"):
        ferro.init_process_group(backend="tcp", rank=0, world_size=1, timeout=timeout,
                                 init_method=f"tcp://127.0.0.1:{free_port()}")


def test_a_fractional_world_size_is_named_before_any_rendezvous():
    start = time.monotonic()
    with pytest.raises(InvalidWorldSizeError, match="1.5"):
        ferro.init_process_group(rank=0, world_size=1.5, init_method=f"tcp://127.0.0.1:{free_port()}")
    assert time.monotonic() - start < 1


def test_a_bad_rank_in_the_environment_is_named_at_once_with_backend_auto(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("FERRO_SECRET", "s")
    start = time.monotonic()
    with pytest.raises(InvalidRankError, match=r"got 5.*RANK"):
        ferro.init_process_group(timeout=30)
    assert time.monotonic() - start < 1


def _rank_one_twice(rank, world_size):
    as_rank = min(rank, 1)  # processes 1 and 2 are both given rank 1
    try:
        group = ferro.init_process_group(backend="tcp", rank=as_rank, world_size=2, timeout=8)
    except DistributedError as exc:
        return f"{type(exc).__name__}: {exc}"
    ferro.barrier(timeout=8)
    time.sleep(3)  # the group lives on while the other process of rank 1 tries to join
    ferro.destroy_process_group()
    del group
    return "joined"


def test_two_processes_with_the_same_rank_are_told_so():
    results = run_processes(_rank_one_twice, 3, backend=None, timeout=120)
    assert results[0] == "joined"
    assert sorted(r[:39] for r in results[1:]) == sorted(["joined", "ConfigurationError: rank 1 joined twice"]), results


def _use_after_close(group):
    group.close()
    try:
        ferro.allreduce(np.ones(4), group=group)
    except DistributedError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_use_after_close_says_closed(backend):
    for kind, message in run_processes(_use_after_close, 2, backend=backend):
        assert kind == BackendClosedError.__name__ and "was closed" in message, message
        assert "failed collective" not in message


def _raw_bytes(group):
    try:
        ferro.allreduce(bytearray(8), group=group)
        refused = ""
    except InvalidBufferError as exc:
        refused = str(exc)
    if group.rank == 0:
        group.send(b"ferro!", 1)
        return refused, None
    out = bytearray(6)
    group.recv(out, 0)
    return refused, bytes(out)


def test_raw_bytes_go_through_a_groups_send_and_collectives_say_how_to_pass_them():
    (refused0, _), (refused1, received) = run_threads(_raw_bytes, 2)
    assert "numpy.frombuffer" in refused0 and "numpy.frombuffer" in refused1
    assert received == b"ferro!"


def test_a_flood_of_refused_connections_logs_a_few_lines_not_one_each(caplog):
    caplog.set_level(logging.WARNING, logger="ferro.store")
    with Store("127.0.0.1", 0, secret="s", serve=True, timeout=10) as store:
        for _ in range(300):
            with socket.create_connection(("127.0.0.1", store.port)) as sock:
                sock.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64)
        deadline = time.monotonic() + 10
        while store.server._refusals.total < 300 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.server._refusals.total == 300
        assert "does not speak ferro's handshake" in store.refused[-1]
    lines = [r for r in caplog.records if r.name == "ferro.store" and r.levelno == logging.WARNING]
    assert 1 <= len(lines) <= 3, [r.getMessage() for r in lines]
