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


def test_output_piped_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    # `ferro ckpt inspect PATH | head -1`: head exits after one line, the next write meets a closed pipe.
    import numpy as np

    from ferro import checkpoint

    path = tmp_path / "ckpt"
    checkpoint.save({f"tensor{i}": np.zeros(4) for i in range(2000)}, path)
    inspect = subprocess.Popen([sys.executable, "-m", "ferro", "ckpt", "inspect", str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    first = inspect.stdout.readline()
    inspect.stdout.close()
    errors = inspect.stderr.read().decode()
    assert inspect.wait(timeout=60) == 141 and first.startswith(b"checkpoint ")
    assert errors == "", errors
