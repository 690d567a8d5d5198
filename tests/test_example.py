"""The main job: the digits MLP trains data-parallel under ferro run, with ferro.nn and with PyTorch."""

import os
import re
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_mlp.py")


@pytest.mark.parametrize("extra", [[], ["--torch"]], ids=["ferro.nn", "torch"])
def test_digits_mlp_learns_under_ferro_run(tmp_path, extra):
    done = subprocess.run([sys.executable, "-m", "ferro", "run", "--nproc-per-node", "2", EXAMPLE, "--epochs", "4",
                           *extra], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    epochs = re.findall(r"\[rank 0\] epoch\s+(\d+)\s+loss ([\d.]+)\s+test accuracy ([\d.]+)\s+time ([\d.]+) s",
                        done.stdout)
    assert [int(e[0]) for e in epochs] == [1, 2, 3, 4]
    losses = [float(e[1]) for e in epochs]
    assert losses[-1] < losses[0] / 3  # it learns
    assert float(epochs[-1][2]) > 0.85  # ten classes: chance is 0.1
    assert "[rank 1] epoch" not in done.stdout  # only rank 0 reports
