# cython: language_level=3
"""One group's shared state: what the Python layers and the compiled core both read and write.

A process group owns exactly one :class:`GroupState` (``Backend.state``). It
replaces attributes that modules used to hang on group objects: the failure
that makes the group unusable, the worker that orders its operations, the
point-to-point receive state, the compiled allreduce path, and the counters
behind ``group.stats()``. The compiled core reads it directly (the direct
allreduce path checks ``failure``, ``busy`` and ``queued`` without a lookup),
and every transport of the group adds the bytes it moves to its counters in C.
"""

from libc.string cimport memset

#: Marks the direct paths (``direct_allreduce``, ...) as not looked up yet (None means "this group has none").
UNSET = object()


cdef class GroupState:
    """A group's failure, worker, p2p state, direct path and communication counters."""

    def __cinit__(self):
        self.failure = None
        self.worker = None
        self.p2p = None
        self.direct_allreduce = UNSET
        self.direct_broadcast = UNSET
        self.direct_all_gather = UNSET
        self.direct_barrier = UNSET
        self.busy = False
        self.queued = 0
        memset(&self.stats, 0, sizeof(ferro_stats))

    def adopt_worker(self, candidate):
        """Make ``candidate`` the group's worker unless it has one; return the worker.

        Compiled, so it runs without yielding the GIL: racing first uses agree on one worker.
        """
        if self.worker is None:
            self.worker = candidate
        return self.worker

    def adopt_p2p(self, candidate):
        """Make ``candidate`` the group's point-to-point state unless it has one; return that state."""
        if self.p2p is None:
            self.p2p = candidate
        return self.p2p

    def set_direct(self, allreduce, broadcast, all_gather, barrier) -> None:
        """Install the group's direct paths (each a compiled call or None); None for all: the full path only."""
        self.direct_allreduce = allreduce
        self.direct_broadcast = broadcast
        self.direct_all_gather = all_gather
        self.direct_barrier = barrier

    def count_call(self, int collective_id) -> None:
        """Count one call of the operation with this collective id."""
        ferro_count_call(&self.stats, collective_id)

    def count_bytes(self, uint32_t kind, uint64_t fingerprint, uint64_t sent, uint64_t received) -> None:
        """Count bytes moved by a frame of this kind and fingerprint (for transports written in Python)."""
        cdef int slot = ferro_stat_slot(kind, fingerprint)
        ferro_count_sent(&self.stats, slot, sent)
        ferro_count_received(&self.stats, slot, received)

    def counters(self) -> dict:
        """``{collective id: (calls, bytes sent, bytes received)}`` for every id with something counted."""
        found = {}
        cdef int i
        for i in range(FERRO_STAT_SLOTS):
            if self.stats.calls[i] or self.stats.sent[i] or self.stats.received[i]:
                found[i] = (self.stats.calls[i], self.stats.sent[i], self.stats.received[i])
        return found

    def reset_counters(self) -> None:
        """Zero every counter."""
        memset(&self.stats, 0, sizeof(ferro_stats))
