"""Run one function on N simulated ranks as threads of this process."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ferro.backend.simulated import SimulatedBackend
from ferro.errors import DistributedTimeoutError, RankFailedError

__all__ = ["run_threads"]


def run_threads(fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (), timeout: float = 60.0,
                group_timeout: float | None = None) -> list[Any]:
    """Run ``fn(group, *args)`` on ``world_size`` ranks of a :class:`~ferro.SimulatedBackend`.

    When a rank raises, the whole group is aborted so that the other ranks'
    blocking calls fail at once instead of waiting for their timeouts.

    Args:
        fn: The function every rank runs.
        world_size: Number of ranks.
        args: Extra positional arguments for ``fn``.
        timeout: Seconds for the whole run.
        group_timeout: Default timeout of the simulated group.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RankFailedError: The first rank that raised, with its traceback.
        DistributedTimeoutError: Ranks still running after ``timeout``, with their stacks.

    """
    groups = SimulatedBackend.create_group(world_size, timeout=group_timeout)
    results: list[Any] = [None] * world_size
    failures: list[tuple[int, str]] = []
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        try:
            results[rank] = fn(groups[rank], *args)
        except BaseException:
            with lock:
                failures.append((rank, traceback.format_exc()))
            groups[rank].abort()
        finally:
            groups[rank].close()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"ferro-sim-rank-{r}", daemon=True)
               for r in range(world_size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0))
    hung = [r for r, thread in enumerate(threads) if thread.is_alive()]
    if failures:
        groups[0].abort()
        rank, text = failures[0]
        raise RankFailedError(f"rank {rank} failed:\n{text}", rank, text)
    if hung:
        frames = sys._current_frames()
        parts = [f"simulated ranks {hung} did not finish within {timeout:g} s; their stacks:"]
        for r in hung:
            ident = threads[r].ident
            frame = frames.get(ident) if ident is not None else None
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
            parts.append(f"--- rank {r} ---\n{stack}")
        groups[0].abort()
        raise DistributedTimeoutError("\n".join(parts))
    return results
