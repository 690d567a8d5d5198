"""Many ranks: a 64-rank job on real processes, which peers a rank connects to, and the descriptor limit."""

import math
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from ferro._core.collectives import Mesh

JOB = Path(__file__).parent / "scale" / "job.py"


def _near(rank, n):
    return set(Mesh([None] * n, rank).near_peers)


@pytest.mark.parametrize("n", [*range(1, 40), 64, 100, 127, 128, 129, 255, 256, 1000, 4096])
def test_the_peers_a_rank_may_touch_are_few_and_mutual(n):
    """Symmetric, or one end would wait for a connection the other never makes; about 2 log2(n) of them."""
    near = {r: _near(r, n) for r in range(n)} if n <= 256 else {r: _near(r, n) for r in (0, 1, n // 3, n - 1)}
    for rank, peers in near.items():
        assert rank not in peers and all(0 <= p < n for p in peers)
        assert len(peers) <= 3 * max(1, math.ceil(math.log2(n))) + 1, (rank, len(peers))
        for peer in peers:
            assert rank in _near(peer, n), (n, rank, peer)
    # Every neighbour of the ring and of the dissemination barrier is among them.
    for rank, peers in near.items():
        distance = 1
        while distance < n:
            assert (rank + distance) % n in peers and (rank - distance) % n in peers
            distance *= 2


def test_a_64_rank_job_runs_every_collective_on_few_connections():
    env = {**os.environ, "FERRO_SECRET": "scale-test-secret", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "ferro", "run", "--nproc-per-node", "64", str(JOB)],
                          capture_output=True, text=True, timeout=400, env=env, cwd=tempfile.gettempdir())
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split()[2:] for line in done.stdout.splitlines() if " ok " in line]  # "[rank 3] ok 3 11"
    assert sorted(int(rank) for _, rank, _ in lines) == list(range(64)), done.stdout[-2000:]
    connected = [int(count) for _, _, count in lines]
    # The ring, trees and doubling partners (12), one p2p partner each way (2): not the 63 of a full mesh.
    assert max(connected) <= 14, connected


def test_too_few_descriptors_is_an_error_naming_the_limit_and_the_fix():
    program = textwrap.dedent("""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (50, 50))
        from ferro.errors import ConfigurationError
        from ferro.rendezvous.limits import ensure_descriptors
        ensure_descriptors(40, "a test")
        try:
            ensure_descriptors(500, "rank 3's connections to 499 peers")
        except ConfigurationError as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                          cwd=tempfile.gettempdir())
    assert done.returncode == 0, done.stderr
    assert "rank 3's connections to 499 peers needs about 500 file descriptors" in done.stdout
    assert "RLIMIT_NOFILE: soft 50, hard 50" in done.stdout and "ulimit -Hn" in done.stdout
