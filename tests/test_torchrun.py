"""ferro's own API under the real ``torchrun`` command: one host (every rendezvous style) and two emulated hosts.

torchrun's agent serves a TCPStore on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True); ferro's rank 0 used to
bind the same port and fail with "Address already in use" on every single-host launch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ferro.rendezvous.settings import free_port
from ferro.testing.netns import can_create_namespaces, two_hosts

HELLO = Path(__file__).parent / "torchrun" / "hello.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` console script's entry point

pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="torchrun comes with torch (the test extra)")


def _torchrun_command() -> list[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [beside] if os.path.exists(beside) else TORCHRUN


def _expect_hello(output: str, world_size: int) -> None:
    total = world_size * (world_size + 1) // 2
    for rank in range(world_size):
        assert f"rank {rank} of {world_size}: sum of ranks + 1 = {total}" in output, output
        assert f"rank {rank}: joined twice" in output, output


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flags", [[], ["--standalone"], ["--master-port", "PORT"],
                                   ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:PORT"]],
                         ids=["plain", "standalone", "master port", "c10d"])
def test_init_process_group_joins_a_job_started_by_torchrun(tmp_path, flags):
    port = str(free_port())
    command = [*_torchrun_command(), "--nproc-per-node", "2", *[port if f == "PORT" else
                                                               f.replace("PORT", port) for f in flags], str(HELLO)]
    env = dict(os.environ, FERRO_SECRET="torchrun-test-secret", FERRO_TIMEOUT="60")
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    _expect_hello(done.stdout, 2)


@pytest.mark.timeout(180)
def test_without_the_secret_torchrun_ranks_say_which_variable_to_set(tmp_path):
    env = dict(os.environ)
    env.pop("FERRO_SECRET", None)
    done = subprocess.run([*_torchrun_command(), "--nproc-per-node", "2", str(HELLO)], capture_output=True,
                          text=True, timeout=150, cwd=tmp_path, env=env)
    assert done.returncode != 0
    assert "no job secret: set FERRO_SECRET" in done.stdout + done.stderr


@pytest.mark.timeout(240)
@pytest.mark.skipif(not can_create_namespaces(), reason="two emulated hosts need root and iproute2's ip")
def test_torchrun_across_two_emulated_hosts_with_c10d_rendezvous(tmp_path):
    with two_hosts() as (names, master):
        port, subnet = str(free_port()), master.rpartition(".")[0]
        env = dict(os.environ, FERRO_SECRET="torchrun-two-hosts", FERRO_TIMEOUT="60")
        launchers = [subprocess.Popen(
            ["ip", "netns", "exec", name, *_torchrun_command(), "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{port}", "--rdzv-id", "ferro-two-hosts",
             # Both namespaces share the machine's host name: torch can neither tell which one the endpoint is
             # on nor find a node's address from its name, so each is told (as on a multi-homed cluster host).
             "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", f"{subnet}.{node + 1}", str(HELLO)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
            for node, name in enumerate(names)]
        try:
            outputs = [launcher.communicate(timeout=200) for launcher in launchers]
        finally:
            for launcher in launchers:
                launcher.kill()
                launcher.wait()
    for launcher, (out, err) in zip(launchers, outputs, strict=True):
        assert launcher.returncode == 0, out + err
    _expect_hello(outputs[0][0] + outputs[1][0], 4)
