"""The main job, ``ferro demo``, run as a user runs it."""

import subprocess
import sys


def test_ferro_demo_runs_two_ranks_and_verifies_the_data(tmp_path):
    # Run from an empty directory, as a user of the installed package would.
    done = subprocess.run(
        [sys.executable, "-m", "ferro", "demo", "--size-mb", "4", "--round-trips", "200", "--exchanges", "2"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "2 ranks over TCP" in done.stdout
    assert "round trip of 8 bytes x 200" in done.stdout
    assert "data verified" in done.stdout


def test_ferro_without_a_command_explains_usage(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ferro"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and "usage: ferro" in done.stderr
