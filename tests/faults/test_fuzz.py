"""A bounded run of the coverage-guided fuzzer over each parser of untrusted bytes (tests/fuzz/fuzz_parsers.py).

The longer runs are documented there; a finding makes atheris exit non-zero with the input that broke the oracle.
"""

import os
import subprocess
import sys

import pytest

FUZZER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fuzz", "fuzz_parsers.py")


@pytest.mark.parametrize("target", ["handshake", "frame", "store"])
def test_bounded_fuzz_run_finds_nothing(target, tmp_path):
    done = subprocess.run([sys.executable, FUZZER, target, "-runs=20000", "-max_total_time=60",
                           f"-artifact_prefix={tmp_path}/"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Done 20000 runs" in done.stderr or "max_total_time" in done.stderr
