"""ferro run: environment, output, failures, restarts, Ctrl-C -- and no process left behind."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _procs import wait_gone

FERRO = [sys.executable, "-m", "ferro"]


def write(path, body):
    path.write_text(textwrap.dedent(body))
    return str(path)


ENV_SCRIPT = """
    import json, os, sys
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "FERRO_RESTART_COUNT"]
    info = {k: os.environ[k] for k in keys}
    info["secret_length"] = len(os.environ["FERRO_SECRET"])
    info["argv"] = sys.argv
    import numpy as np, ferro
    ferro.init_process_group(timeout=30)
    x = np.ones(1)
    ferro.allreduce(x)
    info["sum"] = float(x[0])
    ferro.destroy_process_group()
    print("INFO " + json.dumps(info))
"""


@pytest.mark.parametrize("nproc", [2, 4])
def test_runs_a_script_with_the_right_environment(tmp_path, nproc):
    script = write(tmp_path / "job.py", ENV_SCRIPT)
    done = subprocess.run([*FERRO, "run", "--nproc-per-node", str(nproc), script, "--lr", "0.1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    infos = {}
    for line in done.stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("INFO "):
            info = json.loads(rest[5:])
            assert prefix == f"[rank {info['RANK']}"  # each line carries its rank
            infos[int(info["RANK"])] = info
    assert sorted(infos) == list(range(nproc))
    ports = {info["MASTER_PORT"] for info in infos.values()}
    for rank, info in infos.items():
        assert info["LOCAL_RANK"] == str(rank) and info["WORLD_SIZE"] == str(nproc)
        assert info["LOCAL_WORLD_SIZE"] == str(nproc) and info["GROUP_RANK"] == "0"
        assert info["MASTER_ADDR"] == "127.0.0.1" and info["FERRO_RESTART_COUNT"] == "0"
        assert info["secret_length"] == 32 and info["argv"] == [script, "--lr", "0.1"]
        assert info["sum"] == nproc
    assert len(ports) == 1


def test_runs_a_module_without_prefix(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    write(tmp_path / "pkg" / "work.py", """
        import os, sys
        print("module", os.environ["RANK"], sys.argv[1:], __name__)
    """)
    done = subprocess.run([*FERRO, "run", "--nproc-per-node", "2", "--no-prefix", "-m", "pkg.work", "x"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["module 0 ['x'] __main__", "module 1 ['x'] __main__"]


FAILING = """
    import os, signal, sys, time
    print("pid", os.getpid(), flush=True)
    mode = sys.argv[1]
    if os.environ["RANK"] == "1" and os.environ["FERRO_RESTART_COUNT"] == "0":
        if mode == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ["FERRO_RESTART_COUNT"] != "0":
        print("restarted", os.environ["RANK"], flush=True)
        sys.exit(0)
    time.sleep(120)   # the launcher must stop this rank
"""


@pytest.mark.parametrize("mode, code, how", [("exit", 3, "exited with code 3"), ("kill", 137, "was killed by SIGKILL")])
def test_failing_rank_takes_the_job_down_and_nothing_survives(tmp_path, mode, code, how):
    script = write(tmp_path / "fail.py", FAILING)
    start = time.monotonic()
    done = subprocess.run([*FERRO, "run", "--nproc-per-node", "3", "--grace", "2", script, mode],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == code
    assert f"rank 1 {how}" in done.stderr
    assert time.monotonic() - start < 60  # not the sleeping ranks' 120 s
    assert wait_gone(str(tmp_path)) == []


SLOW_TO_EXIT_CAUSE = """
    import os, time
    import ferro

    def exited(pid):  # and reaped by its guardian, within 0.2 s of exiting
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True

    ferro.init_process_group(timeout=30)
    pid0 = ferro.broadcast_object(os.getpid(), root=0)
    if os.environ["RANK"] == "1":
        try:
            raise ValueError("the cause, on rank 1")
        finally:
            ferro.destroy_process_group()  # rank 0 loses rank 1 now and exits first...
            deadline = time.monotonic() + 4
            while not exited(pid0) and time.monotonic() < deadline:
                time.sleep(0.01)  # ...while this rank is still unwinding (as under load)
            time.sleep(0.5)  # and the launcher has seen rank 0 go
    ferro.recv(1, timeout=60)
"""


def test_the_rank_that_failed_first_is_named_not_the_peer_that_lost_it(tmp_path):
    script = write(tmp_path / "cause.py", SLOW_TO_EXIT_CAUSE)
    done = subprocess.run([*FERRO, "run", "--nproc-per-node", "2", "--grace", "2", script],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    summary = [line for line in done.stderr.splitlines() if line.startswith("ferro run:")]
    assert summary == [
        "ferro run: rank 1 exited with code 1 (ValueError: the cause, on rank 1); rank 0 failed after losing rank 1; "
        "stopping the other ranks",
        "ferro run: job failed: rank 1 exited with code 1 (ValueError: the cause, on rank 1)"], done.stderr
    assert "[rank 0] ferro.PeerLostError" in done.stderr  # the consequence's traceback, the error as users name it


FROZEN_PEER = """
    import os, signal
    import numpy as np
    import ferro

    ferro.init_process_group(timeout=3)
    x = ferro.allreduce(np.ones(2))
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: a debugger, a swapped-out host, a deadlock
    ferro.allreduce(x)
"""

FROZEN_PEER_UNDER_TORCH_DDP = """
    import os, signal
    import torch, torch.distributed as dist

    dist.init_process_group("ferro")  # no timeout=: $FERRO_TIMEOUT applies, not torch's 30 minutes
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8), bucket_cap_mb=0.001)
    for step in range(1000):
        if step == 3 and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        model(torch.ones(4, 8)).sum().backward()
"""

FROZEN_SUMMARY = ("ferro run: rank 1 stopped responding (it was still running, frozen or stuck, when a peer timed out "
                  "waiting for it); rank 0 failed after timing out waiting for rank 1 ")


@pytest.mark.parametrize("program", ["ferro", "torch_ddp"])
def test_a_frozen_rank_is_named_as_the_cause_not_the_rank_that_timed_out_waiting_for_it(tmp_path, program):
    if program == "torch_ddp":
        pytest.importorskip("torch")
    script = write(tmp_path / "frozen.py", FROZEN_PEER if program == "ferro" else FROZEN_PEER_UNDER_TORCH_DDP)
    start = time.monotonic()
    done = subprocess.run([*FERRO, "run", "--nproc-per-node", "2", "--grace", "2", script], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path, env={**os.environ, "FERRO_TIMEOUT": "3"})
    assert done.returncode == 1, done.stderr
    summary = [line for line in done.stderr.splitlines() if line.startswith("ferro run:")]
    # The survivor's error, as torch re-raised it under DDP: ferro's class and text, and $FERRO_TIMEOUT's 3 s.
    assert summary[0].startswith(FROZEN_SUMMARY) and "timeout after 3 s" in summary[0], summary
    assert "DistributedTimeoutError: rank 0: allreduce" in summary[0] or program == "ferro", summary
    assert summary[0].endswith("; stopping the other ranks"), summary
    assert summary[-1].startswith("ferro run: job failed: rank 1 stopped responding"), summary
    # Between them, the flight records' verdict (ferro.launch.hang): the frozen rank never arrived.
    verdict = [line for line in summary if line.startswith("ferro run: verdict: ")]
    assert len(verdict) == 1 and "rank 1 did not arrive at call #" in verdict[0], summary
    assert time.monotonic() - start < 90  # the 3 s timeout, not torch's 30 minutes
    assert wait_gone(str(tmp_path)) == []


def test_max_restarts_restarts_the_whole_group(tmp_path):
    script = write(tmp_path / "fail.py", FAILING)
    done = subprocess.run([*FERRO, "run", "--nproc-per-node", "2", "--max-restarts", "1", "--grace", "2", script,
                           "exit"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "restarting all ranks (restart 1 of 1)" in done.stderr
    assert sorted(line for line in done.stdout.splitlines() if "restarted" in line) == [
        "[rank 0] restarted 0", "[rank 1] restarted 1"]
    assert wait_gone(str(tmp_path)) == []


SLEEPER = """
    import os, time
    print("ready", os.getpid(), flush=True)
    time.sleep(120)
"""


def start_sleepers(tmp_path, nproc=2):
    script = write(tmp_path / "sleep.py", SLEEPER)
    launcher = subprocess.Popen([*FERRO, "run", "--nproc-per-node", str(nproc), "--grace", "3", script],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    ready = 0
    deadline = time.monotonic() + 60
    while ready < nproc and time.monotonic() < deadline:
        line = launcher.stdout.readline()
        ready += "ready" in line
    assert ready == nproc
    return launcher


def test_ctrl_c_reaches_every_rank_and_the_launcher_exits_promptly(tmp_path):
    launcher = start_sleepers(tmp_path)
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    code = launcher.wait(timeout=30)
    assert code == 130
    assert time.monotonic() - start < 15
    assert "received SIGINT; stopping all ranks" in launcher.stderr.read()
    assert wait_gone(str(tmp_path)) == []


def test_ranks_die_with_a_killed_launcher(tmp_path):
    launcher = start_sleepers(tmp_path)
    launcher.kill()
    launcher.wait(timeout=30)
    assert wait_gone(str(tmp_path)) == []  # the parent-death signal took them


def test_several_nodes_need_a_shared_secret(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FERRO_SECRET"}
    done = subprocess.run([*FERRO, "run", "--nnodes", "2", "--node-rank", "0", "x.py"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 2 and "FERRO_SECRET" in done.stderr


def test_python_dash_m_ferro_run_is_the_same_command(tmp_path):
    write(tmp_path / "hello.py", "print('hello')\n")
    done = subprocess.run([sys.executable, "-m", "ferro", "run", "--nproc-per-node", "2", "hello.py"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.count("hello") == 2


SHADOW_SCRIPT = """
    import json, os, sys
    import ferro
    import helper  # beside the script: sys.path[0] is the script's folder, as `python script.py` gives
    ferro.init_process_group(timeout=30)
    print("PATH " + json.dumps({"ferro": ferro.__file__, "path0": sys.path[0], "helper": helper.WHERE}))
    ferro.destroy_process_group()
"""


# The console script, as a user types it: `python -m ferro` would itself import the working directory's ferro/.
FERRO_SCRIPT = [os.path.join(os.path.dirname(sys.executable), "ferro")]


def _shadowing_tree(root):
    """A working directory holding a ferro source tree that must never be imported (a clone's root)."""
    (root / "ferro").mkdir()
    write(root / "ferro" / "__init__.py", "raise ImportError('the working directory\'s source tree was imported')\n")
    (root / "job").mkdir()
    write(root / "job" / "helper.py", "WHERE = 'script folder'\n")
    write(root / "helper.py", "WHERE = 'working directory'\n")
    return write(root / "job" / "train.py", SHADOW_SCRIPT)


def _paths(stdout):
    return [json.loads(line.split("PATH ", 1)[1]) for line in stdout.splitlines() if "PATH " in line]


@pytest.mark.parametrize("form", ["script", "module"])
def test_ranks_import_the_installed_ferro_from_a_source_tree_root(tmp_path, form):
    # The README's first command runs in a clone's root, where ferro/ is the uncompiled source. The target
    # still sees what `python job/train.py` (its folder first) or `python -m entry` (the working directory) gives.
    script = _shadowing_tree(tmp_path)
    write(tmp_path / "entry.py", SHADOW_SCRIPT)
    target = ["job/train.py"] if form == "script" else ["-m", "entry"]
    path0, helper = ((os.path.dirname(script), "script folder") if form == "script"
                     else (str(tmp_path), "working directory"))
    done = subprocess.run([*FERRO_SCRIPT, "run", "--nproc-per-node", "2", *target], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = _paths(done.stdout)
    assert len(seen) == 2
    for info in seen:
        assert not info["ferro"].startswith(str(tmp_path))
        assert (info["path0"], info["helper"]) == (path0, helper)


def test_a_failure_record_names_the_lost_peer_behind_the_error_and_skips_clean_exits(tmp_path, monkeypatch):
    from ferro.errors import PeerLostError
    from ferro.launch.failures import ERROR_FILE_ENV, FailureRecord, read_failure, record_failure

    path = str(tmp_path / "record.json")
    monkeypatch.setenv(ERROR_FILE_ENV, path)
    record_failure(SystemExit(0))
    assert read_failure(path) is None  # a clean exit is no failure
    try:
        try:
            raise PeerLostError("rank 0: recv from rank 2: rank 2 exited", peer=2)
        except PeerLostError as lost:
            raise RuntimeError("training step failed\nsecond line") from lost
    except RuntimeError as exc:
        record_failure(exc)
    assert read_failure(path) == FailureRecord("RuntimeError: training step failed", 2)
    record_failure(SystemExit(3))
    assert read_failure(path) == FailureRecord("SystemExit: 3", None)
    (tmp_path / "torn.json").write_text('{"error": ')
    assert read_failure(str(tmp_path / "torn.json")) is None


def test_a_reader_that_stops_early_neither_blocks_the_ranks_nor_prints_a_traceback(tmp_path):
    # `ferro run ... | head -1`: after the reader goes, each rank still prints 4 MB, far past a pipe's 64 KiB.
    script = write(tmp_path / "chatty.py", """
        import sys, time
        print("first", flush=True)
        time.sleep(1)  # the reader has gone by now
        for i in range(100_000):
            print("x" * 40)
        print("done", file=sys.stderr, flush=True)
    """)
    launcher = subprocess.Popen([*FERRO, "run", "--nproc-per-node", "2", script], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=tmp_path)
    assert launcher.stdout.readline().endswith(b"first\n")
    launcher.stdout.close()
    errors = launcher.stderr.read().decode()
    assert launcher.wait(timeout=60) == 0, errors
    assert errors.count("done") == 2 and "Traceback" not in errors, errors
