"""A two-rank job run from an installed wheel (``ferro run --nproc-per-node 2 wheel_job.py``).

Each rank checks that the ferro it imported is the installed one, compiled (not a source tree beside it), then
runs an allreduce, a broadcast and an all_gather over the default group and compares them with NumPy.
"""

import sys
from pathlib import Path

import numpy as np

import ferro
from ferro._core import transport

group = ferro.init_process_group()
rank, size = group.rank, group.world_size
installed = Path(ferro.__file__).resolve()
assert "site-packages" in installed.parts, f"ferro was imported from {installed}, not from the installed wheel"
assert Path(transport.__file__).suffix == ".so", f"the compiled core is missing: {transport.__file__}"

x = np.arange(1000, dtype=np.float64) * (rank + 1)
ferro.allreduce(x)
np.testing.assert_array_equal(x, np.arange(1000, dtype=np.float64) * sum(r + 1 for r in range(size)))
b = np.full(7, rank, dtype=np.int32)
ferro.broadcast(b, root=1)
np.testing.assert_array_equal(b, np.full(7, 1, dtype=np.int32))
gathered = ferro.all_gather(np.array([rank], dtype=np.int64))
np.testing.assert_array_equal(gathered, np.arange(size))
ferro.destroy_process_group()
if rank == 0:
    print(f"ferro {ferro.__version__} from {installed.parent}: {size} ranks, allreduce, broadcast and all_gather "
          f"agree with NumPy", file=sys.stderr)
