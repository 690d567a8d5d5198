"""The physical reference of the benchmarks: how long one core takes to copy the same bytes."""

from __future__ import annotations

import statistics
import time

import numpy as np

__all__ = ["memcpy_seconds"]

PAGE = 4096


def _placed(nbytes: int, offset: int) -> np.ndarray:
    """Return an array of ``nbytes`` starting ``offset`` bytes past a page boundary."""
    raw = np.ones(nbytes + 2 * PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE + offset
    return raw[start:start + nbytes]


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Median time for one core to copy ``nbytes`` once (NumPy ``copyto``, which is ``memcpy``).

    Source and destination sit half a page apart modulo 4 KiB: glibc's ``memcpy``
    runs many times slower on AMD CPUs when the destination is just above the
    source modulo 4 KiB (see ``ferro/_core/copy.h``), and the reference should be
    what the machine can do, not that accident of placement.
    """
    src = _placed(max(nbytes, 1), 0)
    dst = _placed(max(nbytes, 1), PAGE // 2)
    dst[:] = 0  # touch the pages before timing
    calls = max(1, min(1000, (64 << 20) // max(nbytes, 1)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            np.copyto(dst, src)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)
