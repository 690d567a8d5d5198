"""Compute threads beside a benchmark: the busy cores of a CPU cluster in training.

``ferro bench --load N`` (and the DDP and FSDP benchmarks' ``--load``) start N
threads in every rank that multiply matrices for as long as the sweep runs,
as torch's intra-op threads or NumPy's BLAS do beside DDP's allreduce. The
same threads run in every library's ranks, so the comparison stays like for
like; each thread's matrix work releases the GIL, as the real compute does.

The BLAS libraries start threads of their own per call unless told otherwise;
:func:`single_threaded_blas` sets the usual variables so that N means N busy
threads per rank (it must run before NumPy is first imported, so the
orchestrator sets it for the ranks it starts).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, MutableMapping
from types import TracebackType

import numpy as np

__all__ = ["BLAS_THREAD_VARIABLES", "ComputeLoad", "LOAD_KINDS", "single_threaded_blas"]

LOAD_KINDS = ("numpy", "torch")
BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
# 256x256 float32: about 34 MFLOP, a few milliseconds per product on one core, long enough that the
# loop's Python part (which holds the GIL) is under 1% of its time, short enough to stop promptly.
_SIDE = 256


def single_threaded_blas(environ: MutableMapping[str, str]) -> None:
    """Set every BLAS thread-count variable not set already to 1 in ``environ``."""
    for name in BLAS_THREAD_VARIABLES:
        environ.setdefault(name, "1")


class ComputeLoad:
    """``threads`` threads multiplying matrices until the context exits.

    Args:
        threads: How many compute threads; 0 starts none.
        kind: ``"numpy"`` (``np.matmul``) or ``"torch"`` (``torch.mm`` with one
            intra-op thread per load thread).

    Example:
        >>> with ComputeLoad(2) as load:       # doctest: +SKIP
        ...     run_the_sweep()
        >>> load.gflops                        # what the compute still got  # doctest: +SKIP

    Raises:
        ValueError: ``threads`` below 0 or an unknown ``kind``.
        ImportError: ``kind="torch"`` without torch installed.

    """

    def __init__(self, threads: int, kind: str = "numpy") -> None:
        if threads < 0:
            raise ValueError(f"--load: {threads} compute threads; give 0 or more")
        if kind not in LOAD_KINDS:
            raise ValueError(f"--load-kind: {kind!r}; choose from {', '.join(LOAD_KINDS)}")
        self.threads, self.kind = threads, kind
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []
        self._products = [0] * threads
        self._started = self._ended = 0.0
        if kind == "torch" and threads:
            import torch

            torch.set_num_threads(1)  # one intra-op thread per load thread: N means N busy threads

    def _product(self) -> Callable[[], object]:
        """Return one thread's matrix product, on its own operands."""
        if self.kind == "torch":
            import torch

            a = torch.randn(_SIDE, _SIDE)
            out = torch.empty_like(a)
            return lambda: torch.mm(a, a, out=out)
        b = np.random.default_rng(0).standard_normal((_SIDE, _SIDE), dtype=np.float32)
        result = np.empty_like(b)
        return lambda: np.matmul(b, b, out=result)

    def _work(self, index: int) -> None:
        multiply = self._product()
        while not self._stop.is_set():
            multiply()
            self._products[index] += 1

    def __enter__(self) -> ComputeLoad:
        self._started = time.perf_counter()
        for index in range(self.threads):
            worker = threading.Thread(target=self._work, args=(index,), name=f"ferro-bench-load-{index}",
                                      daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=10.0)
        self._ended = time.perf_counter()

    @property
    def gflops(self) -> float:
        """The compute threads' combined GFLOP/s over the context (0 without threads)."""
        seconds = (self._ended or time.perf_counter()) - self._started
        if not self.threads or seconds <= 0:
            return 0.0
        return sum(self._products) * 2 * _SIDE**3 / seconds / 1e9

