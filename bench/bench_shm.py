"""Shared memory: ferro's ShmBackend beside Open MPI's default (shared-memory) path and ferro's TCP backend.

One run at world sizes 2 and 4, 4 bytes to 256 MB, with one core's memcpy time
per size as the physical reference; the rounds are interleaved and the tables
give the median (see ``bench/bench_allreduce.py``, which this presets).

Run: ``python bench/bench_shm.py [--repeats 3] [--max-bytes 268435456] [--json out.json]``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_allreduce import main  # noqa: E402 - the sibling script, found through the path above

if __name__ == "__main__":
    sys.exit(main(["--peers", "ferro-shm,mpi-sm,ferro-tcp", "--worlds", "2,4", *sys.argv[1:]]))
