"""The exception hook that ends an MPI job when one rank raises, instead of leaving the others blocked in MPI."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["install_abort_hook", "remove_abort_hook"]


def install_abort_hook(mpi: Any, world_rank: int) -> Any:
    """Make an uncaught exception end the whole MPI job (``MPI_Abort``) instead of leaving the others waiting.

    Returns:
        The hook, for :func:`remove_abort_hook`; None when one is already installed.

    """
    previous = sys.excepthook
    if getattr(previous, "ferro_mpi_abort", False):
        return None

    def abort_job(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        previous(kind, value, traceback)
        print(f"ferro: MPI_COMM_WORLD rank {world_rank} raised {kind.__name__}; calling MPI_Abort so the other "
              f"ranks do not wait in MPI forever", file=sys.stderr, flush=True)
        if not mpi.Is_finalized():
            mpi.COMM_WORLD.Abort(1)

    abort_job.ferro_mpi_abort = True  # type: ignore[attr-defined]
    abort_job.previous = previous  # type: ignore[attr-defined]
    sys.excepthook = abort_job
    return abort_job


def remove_abort_hook(hook: Any) -> None:
    """Put back the exception hook :func:`install_abort_hook` replaced (if ``hook`` is still the current one)."""
    current: Any = sys.excepthook
    if current is hook:
        sys.excepthook = hook.previous
