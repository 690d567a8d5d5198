"""The clients people already use, over "ferro" beside "gloo": Lightning's DDP strategy, accelerate and Ray Train.

Each runs the same model on the same data (``clients/_common.py``) as a user's
script would, in processes of its own, once per backend; ferro must match gloo
bit for bit and one process on whole batches to 1e-12. The libraries come with
the ``clients`` extra (part of ``test``).
"""

import importlib.util
import json
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clients")
sys.path.insert(0, HERE)
from _common import single_process_params  # noqa: E402

sys.path.remove(HERE)


def _needs(package):
    # Looked up, not imported: importing Lightning or Ray here would cost this worker 2-6 s of CPU for a check,
    # and the scripts import them in processes of their own anyway.
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"needs {package} (the clients extra)")


def _environment():
    # FERRO_SECRET as a user exports it; nothing else of ferro: the scripts never import it.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRO_", "RANK", "WORLD_SIZE", "MASTER_"))}
    return {**env, "FERRO_SECRET": secrets.token_hex(16), "PYTHONPATH": HERE}


def _run(command, tmp_path, timeout=300):
    done = subprocess.run(command, cwd=tmp_path, env=_environment(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def _result(path):
    with open(path) as f:
        return json.load(f)


def _assert_ferro_matches_gloo_and_one_process(ferro, gloo):
    assert ferro["backend"] == "ferro" and gloo["backend"] == "gloo"
    assert ferro["params"] == gloo["params"]  # bit for bit
    for ours, single in zip(ferro["params"], single_process_params(), strict=True):
        np.testing.assert_allclose(ours, single, rtol=0, atol=1e-12)


def test_lightning_ddp_strategy_over_ferro_matches_gloo(tmp_path):
    _needs("lightning")
    # One job per backend: a second fit in the same job re-creates the rendezvous store on the port the first
    # one just released, and a rank that reached the first store while it was closing failed in gloo's leg
    # ("Failed to recv, got 0 bytes", once in CI while another Lightning job ran beside it).
    for backend in ("ferro", "gloo"):
        _run([sys.executable, os.path.join(HERE, "lightning_ddp.py"), str(tmp_path), backend], tmp_path)
    _assert_ferro_matches_gloo_and_one_process(_result(tmp_path / "ferro.json"), _result(tmp_path / "gloo.json"))


def test_accelerate_over_ferro_matches_gloo(tmp_path):
    _needs("accelerate")
    for backend in ("ferro", "gloo"):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(_free_port()), os.path.join(HERE, "accelerate_ddp.py"), backend,
                   str(tmp_path / f"{backend}.json")]
        # The peer only: gloo's known teardown abort (its worker threads destroyed while running) gets one more
        # try; any other failure, and any failure of ferro's leg, fails the test.
        tries = 2 if backend == "gloo" else 1
        for attempt in range(tries):
            done = subprocess.run(command, cwd=tmp_path, env=_environment(), capture_output=True, text=True,
                                  timeout=300)
            teardown_abort = "terminate called without an active exception" in done.stderr
            if done.returncode == 0 or not teardown_abort or attempt == tries - 1:
                break
            command[5] = str(_free_port())
        assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    _assert_ferro_matches_gloo_and_one_process(_result(tmp_path / "ferro.json"), _result(tmp_path / "gloo.json"))


def test_ray_train_finds_ferro_by_name_and_matches_gloo(tmp_path):
    _needs("ray")
    _run([sys.executable, os.path.join(HERE, "ray_train.py"), str(tmp_path)], tmp_path, timeout=400)
    _assert_ferro_matches_gloo_and_one_process(_result(tmp_path / "ferro.json"), _result(tmp_path / "gloo.json"))


def _free_port():
    from ferro.rendezvous.settings import free_port

    return free_port()
