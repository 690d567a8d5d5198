"""Timeouts where MPI has none: a watchdog that ends the job when a blocking MPI call outlives its timeout.

A blocking MPI collective cannot be interrupted or cancelled, and nonblocking
collective requests cannot be cancelled either: a rank whose peer never
arrives would wait forever, and no error could be raised in its place without
leaving MPI writing into a buffer the program believes it owns. So the MPI
group arms this watchdog around every blocking call; when one is still running
after its timeout, the watchdog prints which rank waited how long in which
call, and calls ``MPI_Abort``, which ends every rank of the job (mpirun reports
the exit code). Point-to-point operations poll instead and raise
:class:`~ferro.DistributedTimeoutError` like every other backend.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from ferro._core.foreign import WatchSlot

__all__ = ["ABORT_EXIT_CODE", "Watchdog"]

#: The exit code ``MPI_Abort`` gives the job when a call timed out (a rank that raised uses 1).
ABORT_EXIT_CODE = 124
# How often the watchdog looks: the precision of an MPI timeout.
CHECK_SECONDS = 0.2


class Watchdog:
    """Watches one group's blocking MPI calls; arming and disarming cost a few attribute writes.

    The call in progress lives in a :class:`~ferro._core.foreign.WatchSlot`, which
    the compiled direct allreduce path arms from C.

    Args:
        describe: Returns the group's description for the message (rank, size).
        abort: Ends the job with an exit code (``comm.Abort``).

    """

    def __init__(self, describe: Callable[[], str], abort: Callable[[int], None]) -> None:
        self._describe = describe
        self._abort = abort
        self.slot = WatchSlot()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, call: str, timeout: float) -> None:
        """Start watching ``call``, which may block for ``timeout`` seconds."""
        slot = self.slot
        slot.call, slot.seconds = call, timeout
        slot.deadline = time.monotonic() + timeout
        if self._thread is None:
            self.start()

    def disarm(self) -> None:
        """Stop watching: the call returned."""
        self.slot.deadline = 0.0

    def start(self) -> None:
        """Start the watching thread (the first :meth:`arm` does; the direct path's group does it up front)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="ferro-mpi-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the watchdog's thread (the group closed)."""
        self._stop.set()

    def _watch(self) -> None:
        slot = self.slot
        while not self._stop.wait(CHECK_SECONDS):
            deadline = slot.deadline
            call, timeout = slot.call, slot.seconds
            # Read twice around the names: a call that ended (0) or another that began meanwhile is not stuck.
            if deadline != 0.0 and time.monotonic() > deadline and slot.deadline == deadline:
                print(f"ferro: {self._describe()}: {call} has not returned after its timeout of {timeout:g} s "
                      f"(a peer that never called it, called something else, or hangs). MPI cannot cancel a "
                      f"blocking call, so ferro ends the job with MPI_Abort rather than let every rank wait "
                      f"forever. If the call was slow rather than stuck, raise the group's timeout "
                      f"(timeout=, $FERRO_TIMEOUT).", file=sys.stderr, flush=True)
                self._abort(ABORT_EXIT_CODE)
                return
