"""init_process_group from every configuration style, and the default group."""

import os
import time

import numpy as np
import pytest

import ferro
from ferro.rendezvous.env import detect, first_slurm_host
from ferro.testing import run_processes

LAUNCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"},
     (1, 4, 1, "h", 1234)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, (2, 3, 2, "127.0.0.1", 29500)),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "m"}, (0, 2, 0, "m", 29500)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1"},
     (5, 8, 1, "gpu07", 29500)),
])
def test_detect_each_launcher(env, expected):
    found = detect(env)
    assert (found.rank, found.world_size, found.local_rank, found.master_addr, found.master_port) == expected


def test_torchrun_variables_win_over_mpi_ones():
    found = detect({"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert found.rank == 0 and "torchrun" in found.source


@pytest.mark.parametrize("env, variable", [({"RANK": "0"}, "WORLD_SIZE"), ({"WORLD_SIZE": "2"}, "RANK"),
                                           ({"PMI_RANK": "0"}, "PMI_SIZE"), ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
                                           ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, "MASTER_PORT")])
def test_half_or_malformed_configuration_names_the_variable(env, variable):
    with pytest.raises(ferro.ConfigurationError, match=variable):
        detect(env)


@pytest.mark.parametrize("nodelist, host", [("node[01-04,07],gpu5", "node01"), ("a1,a2", "a1"), ("solo", "solo"),
                                            ("rack[3-5]-n[10-12]", "rack3-n10"), ("x[007]", "x007")])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def rank_init(rank, world_size, style, path):
    launch = {name: os.environ.pop(name) for name in LAUNCH_VARS}
    kwargs = {}
    if style == "env":
        os.environ.update(launch)
        kwargs["init_method"] = "env://"
    elif style == "tcp":
        kwargs.update(init_method=f"tcp://127.0.0.1:{launch['MASTER_PORT']}", rank=rank, world_size=world_size)
    elif style == "file":
        kwargs.update(init_method=f"file://{path}", rank=rank, world_size=world_size)
    elif style == "openmpi":
        os.environ.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(world_size),
                          OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE=str(world_size),
                          MASTER_PORT=launch["MASTER_PORT"])
    elif style == "pmi":
        os.environ.update(PMI_RANK=str(rank), PMI_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=launch["MASTER_PORT"])
    elif style == "slurm":
        os.environ.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world_size), SLURM_LOCALID=str(rank),
                          SLURM_JOB_NODELIST="localhost", MASTER_PORT=launch["MASTER_PORT"])
    group = ferro.init_process_group(timeout=30, **kwargs)
    try:
        x = np.array([float(rank + 1)])
        ferro.allreduce(x)  # no group=: the default group
        sub = ferro.new_group([0, world_size - 1])
        return (ferro.is_initialized(), ferro.get_rank(), ferro.get_world_size(), float(x[0]),
                ferro.get_default_group() is group, None if sub is None else sub.world_size)
    finally:
        ferro.destroy_process_group()
        assert not ferro.is_initialized()


@pytest.mark.parametrize("style", ["env", "tcp", "file", "openmpi", "pmi", "slurm"])
def test_init_process_group_from_each_style(style, tmp_path):
    results = run_processes(rank_init, 3, args=(style, str(tmp_path / "rendezvous")), backend=None)
    assert results == [(True, r, 3, 6.0, True, None if r == 1 else 2) for r in range(3)]


def rank_errors(rank, world_size):
    outcomes = []
    for call in (lambda: ferro.init_process_group(backend="nccl"),
                 lambda: ferro.init_process_group(backend="gloo"),
                 lambda: ferro.init_process_group(init_method="udp://x:1"),
                 lambda: ferro.get_rank()):
        try:
            call()
            outcomes.append("accepted")
        except (ferro.BackendUnavailableError, ferro.ConfigurationError) as exc:
            outcomes.append(type(exc).__name__)
    for name in LAUNCH_VARS:
        del os.environ[name]
    try:
        ferro.init_process_group()
    except ferro.ConfigurationError as exc:
        outcomes.append("names launchers" if "RANK" in str(exc) and "mpirun" in str(exc) else str(exc))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        ferro.init_process_group()
    except ferro.ConfigurationError as exc:
        outcomes.append("names MASTER_ADDR" if "MASTER_ADDR" in str(exc) else str(exc))
    return outcomes


def test_configuration_errors_say_what_to_set():
    assert run_processes(rank_errors, 1, backend=None)[0] == [
        "BackendUnavailableError", "ConfigurationError", "ConfigurationError", "ConfigurationError",
        "names launchers", "names MASTER_ADDR"]


def rank_double_init(rank, world_size):
    ferro.init_process_group(timeout=30)
    try:
        ferro.init_process_group(timeout=30)
        return "accepted"
    except ferro.ConfigurationError as exc:
        return "refused" if "already" in str(exc) else str(exc)
    finally:
        ferro.destroy_process_group()


def test_second_init_is_refused():
    assert run_processes(rank_double_init, 2, backend=None) == ["refused", "refused"]


def rank_init_under_the_rank_restart_policy(rank, world_size):
    # What `ferro run --restart-policy rank` sets: its launcher serves the store, and holds MASTER_PORT.
    os.environ["FERRO_ELASTIC"] = "1"
    try:
        ferro.init_process_group(timeout=30)
        return "joined"
    except ferro.ConfigurationError as exc:
        return "refused" if "ferro.elastic.Manager" in str(exc) and "--restart-policy rank" in str(exc) else str(exc)


def test_init_process_group_under_the_rank_restart_policy_says_to_use_the_manager():
    # Before, rank 0 failed to serve a store on the launcher's port ("address in use"), and the replacements
    # waited out the rendezvous timeout, one after the other.
    assert run_processes(rank_init_under_the_rank_restart_policy, 2, backend=None) == ["refused", "refused"]


def rank_file_rendezvous_times_out(rank, world_size, path, backend):
    # Only this rank of two joins: the rendezvous must time out naming what is missing.
    start = time.monotonic()
    try:
        ferro.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=2, timeout=1.0)
        return "joined"
    except ferro.DistributedTimeoutError as exc:
        return "timeout", "file store" in str(exc) or "rendezvous" in str(exc), time.monotonic() - start < 20


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_file_rendezvous_that_times_out_says_so(tmp_path, backend):
    # It used to raise AttributeError (the file store has no server) instead of the timeout.
    results = run_processes(rank_file_rendezvous_times_out, 1, args=(str(tmp_path / "rdv"), backend), backend=None)
    assert results == [("timeout", True, True)]


def rank_master_port_with_explicit_rank(rank, world_size):
    # RANK and WORLD_SIZE are passed as arguments; MASTER_PORT still comes from the environment.
    port = os.environ["MASTER_PORT"]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        del os.environ[name]
    group = ferro.init_process_group("tcp", rank=rank, world_size=world_size, timeout=30)
    try:
        return int(port) == group.store.port
    finally:
        ferro.destroy_process_group()


def test_master_port_is_honoured_when_rank_and_size_are_arguments():
    assert run_processes(rank_master_port_with_explicit_rank, 2, backend=None) == [True, True]
