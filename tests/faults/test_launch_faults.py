"""Faults under ``ferro run``: processes a rank leaves behind, a killed launcher, a rank that exits before the
others have mapped their shared memory (issue 11)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _procs import survivors, wait_dead, wait_gone

FERRO = [sys.executable, "-m", "ferro"]


def write(path, body):
    path.write_text(textwrap.dedent(body))
    return str(path)


# Each rank starts three processes that escape its process group in three ways, records their pids, then
# exits 0 (or, with "wait", says so and sleeps until the launcher is killed).
SPAWNER = """
    import os, subprocess, sys, time
    out = sys.argv[1]
    pids = []
    pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                 start_new_session=True).pid)
    pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                 process_group=0).pid)
    child = os.fork()
    if child == 0:
        if os.fork() == 0:  # a double fork: a daemon's grandchild, orphaned at once
            os.setsid()
            time.sleep(300)
        os._exit(0)
    os.waitpid(child, 0)
    with open(out + "." + os.environ["RANK"], "w") as f:
        f.write(" ".join(map(str, pids)))
    if len(sys.argv) > 2:
        print("ready", flush=True)
        time.sleep(300)
"""


def _spawned(tmp_path, nproc):
    pids = []
    for rank in range(nproc):
        with open(tmp_path / f"pids.{rank}") as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def test_processes_a_rank_leaves_behind_end_with_the_job(tmp_path):
    script = write(tmp_path / "spawner.py", SPAWNER)
    done = subprocess.run([*FERRO, "run", "--nproc-per-node", "2", "--grace", "2", script, str(tmp_path / "pids")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert wait_dead(_spawned(tmp_path, 2), seconds=1.0) == []
    assert survivors(str(tmp_path)) == []


def test_a_killed_launcher_takes_the_ranks_children_too(tmp_path):
    script = write(tmp_path / "spawner.py", SPAWNER)
    launcher = subprocess.Popen([*FERRO, "run", "--nproc-per-node", "2", script, str(tmp_path / "pids"), "wait"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    ready = 0
    deadline = time.monotonic() + 60
    while ready < 2 and time.monotonic() < deadline:
        ready += "ready" in launcher.stdout.readline()
    assert ready == 2
    launcher.kill()
    launcher.wait(timeout=30)
    assert wait_dead(_spawned(tmp_path, 2)) == []
    assert wait_gone(str(tmp_path), seconds=15) == []  # the daemon grandchildren too


# Rank 2 exits without joining, once rank 0 has created its segment and waits for the others to map it.
EARLY_EXIT = """
    import os, sys, time
    with open(sys.argv[1] + "." + os.environ["RANK"], "w") as f:
        f.write(str(os.getpid()))
    if os.environ["RANK"] == "2":
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                pid0 = open(sys.argv[1] + ".0").read()
                started = open(sys.argv[1] + ".1").read()  # rank 1 too, so its pid is known
                if pid0 and started and any(n.startswith(f"ferro-{pid0}-") for n in os.listdir("/dev/shm")):
                    break
            except OSError:
                pass
            time.sleep(0.01)
        sys.exit(5)
    import ferro
    ferro.init_process_group(backend="shm", timeout=60)
"""


def _segments_of(pids):
    return [name for name in os.listdir("/dev/shm") for pid in pids if name.startswith(f"ferro-{pid}-")]


@pytest.mark.parametrize("guardian", ["1", "0"])
def test_a_rank_exiting_early_leaves_no_shared_memory_behind(tmp_path, guardian):
    script = write(tmp_path / "early.py", EARLY_EXIT)
    env = dict(os.environ, FERRO_GUARDIAN=guardian)
    done = subprocess.run([*FERRO, "run", "--nproc-per-node", "3", "--grace", "5", script, str(tmp_path / "pid")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 5, done.stderr
    assert "rank 2 exited with code 5" in done.stderr
    pids = [int((tmp_path / f"pid.{rank}").read_text()) for rank in range(3)]
    assert _segments_of(pids) == []


def test_sigterm_while_rank0_waits_for_the_others_unlinks_its_segment(tmp_path):
    """Without the launcher: rank 0 alone, waiting for rank 1 to map, is ended by SIGTERM."""
    script = write(tmp_path / "rank0.py", """
        import os, sys
        os.environ.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1],
                          FERRO_SECRET="s")
        import ferro
        print("starting", flush=True)
        ferro.init_process_group(backend="shm", timeout=60)
    """)
    from ferro.rendezvous.settings import free_port

    rank0 = subprocess.Popen([sys.executable, script, str(free_port())], stdout=subprocess.PIPE, text=True)
    assert rank0.stdout.readline().strip() == "starting"
    deadline = time.monotonic() + 30
    while not _segments_of([rank0.pid]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _segments_of([rank0.pid]), "rank 0 never created its segment"
    rank0.send_signal(signal.SIGTERM)
    assert rank0.wait(timeout=30) == -signal.SIGTERM  # ended by the signal, as without ferro's handler
    assert _segments_of([rank0.pid]) == []
