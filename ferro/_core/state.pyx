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

import weakref

from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject
from libc.string cimport memset

#: Marks the direct paths (``direct_allreduce``, ...) as not looked up yet (None means "this group has none").
UNSET = object()

cdef extern from "recorder.h":
    enum:
        FERRO_CALLSITE_PREFIXES
        FERRO_CALLSITE_CACHE
        FERRO_WAIT_UNIT


# The flight recorders' process-wide settings: the call-site table they share (a cache), the size new groups'
# rings get, and the live groups' states, for the dump (a weak set: it keeps no group alive).
cdef ferro_callsite_table _SITES
cdef uint64_t _capacity = 2048
cdef uint64_t _created = 0
_LIVE = weakref.WeakSet()


cdef ferro_callsite_table* callsites() noexcept:
    return &_SITES


def set_library_prefixes(prefixes) -> None:
    """Name the folders whose files are the library's: a call site is the innermost frame outside them."""
    cdef int i
    values = tuple(str(p) for p in prefixes)[:FERRO_CALLSITE_PREFIXES]
    for i in range(FERRO_CALLSITE_PREFIXES):
        Py_XDECREF(_SITES.prefixes[i])
        _SITES.prefixes[i] = NULL
    for i in range(len(values)):
        Py_INCREF(values[i])
        _SITES.prefixes[i] = <PyObject*>values[i]
    _SITES.n_prefixes = len(values)
    for i in range(FERRO_CALLSITE_CACHE):  # decided under the old prefixes
        Py_XDECREF(_SITES.names[i])
        _SITES.names[i] = NULL


def set_recorder_capacity(Py_ssize_t records) -> None:
    """Give every group's flight recorder room for ``records`` calls (rounded up to a power of two); 0: off.

    Applies to live groups (their records are dropped) and to groups made later.
    """
    global _capacity
    if records < 0:
        raise ValueError(f"flight recorder size must be >= 0, got {records}")
    cdef uint64_t n = 1
    while n < <uint64_t>records:
        n <<= 1
    _capacity = n if records > 0 else 0
    for state in list(_LIVE):
        (<GroupState>state).set_capacity(_capacity)


def recorder_capacity() -> int:
    """The number of records each group's flight recorder keeps (0: off)."""
    return _capacity


def live_states() -> list:
    """The states of this process's groups that still exist, in creation order."""
    return sorted(_LIVE, key=lambda state: state.created)


def monotonic_ns() -> int:
    """The recorder's clock: CLOCK_MONOTONIC in nanoseconds (what ``time.monotonic_ns()`` reads on Linux)."""
    return ferro_now_ns()


cdef class GroupState:
    """A group's failure, worker, p2p state, direct path and communication counters."""

    def __cinit__(self):
        self.failure = None
        self.worker = None
        self.p2p = None
        self.direct_allreduce = UNSET
        self.direct_broadcast = UNSET
        self.direct_reduce = UNSET
        self.direct_all_to_all = UNSET
        self.direct_all_gather = UNSET
        self.direct_reduce_scatter = UNSET
        self.direct_barrier = UNSET
        self.busy = False
        self.queued = 0
        memset(&self.stats, 0, sizeof(ferro_stats))
        memset(&self.rec, 0, sizeof(ferro_recorder))
        self.rec.capacity = _capacity
        self.owner = None
        global _created
        _created += 1
        self.created = _created
        _LIVE.add(self)

    def __dealloc__(self):
        ferro_rec_clear(&self.rec)

    cdef set_capacity(self, uint64_t capacity):
        ferro_rec_clear(&self.rec)
        self.rec.capacity = capacity

    def record_call(self, int collective_id, uint64_t fingerprint, uint64_t nbytes, int peer, bint running,
                    int kind=0) -> int:
        """Record a call being made (running now, or queued); return its sequence number (0: recorder off).

        ``kind``: 0 a collective, 1 a send, 2 a receive, 3 both at once (``peer`` is then the destination).
        """
        return ferro_rec_begin(&self.rec, &_SITES, collective_id, kind, fingerprint, nbytes, peer, running,
                               ferro_now_ns())

    def record_start(self, uint64_t seq) -> None:
        """Record that queued call ``seq`` began to run."""
        ferro_rec_start(&self.rec, seq)

    def record_end(self, uint64_t seq, bint ok) -> None:
        """Record that call ``seq`` ended, done (``ok``) or failed."""
        ferro_rec_end(&self.rec, seq, ok, 0, ferro_now_ns())

    def records(self) -> list:
        """The recorded calls, oldest first: ``(seq, collective id, kind, fingerprint, nbytes, peer, queued,
        started, ended, state, code, offset, collective number)``; times in CLOCK_MONOTONIC ns (0: not known),
        state 1 queued, 2 running, 3 done, 4 failed; the collective number counts collective calls only (the
        same on every rank), and is that of the latest collective before a point-to-point call."""
        cdef uint64_t first, seq
        cdef ferro_record* e
        found = []
        if self.rec.ring == NULL:
            return found
        first = self.rec.seq - self.rec.capacity + 1 if self.rec.seq > self.rec.capacity else 1
        for seq in range(first, self.rec.seq + 1):
            e = &self.rec.ring[(seq - 1) & (self.rec.capacity - 1)]
            if e.seq != seq:
                continue
            found.append([e.seq, e.collective, e.kind, e.fingerprint, e.nbytes, e.peer,
                          e.started - <int64_t>e.waited * FERRO_WAIT_UNIT if e.started else 0,
                          e.started if e.state >= 2 else 0, e.ended,
                          e.state, <object>e.code if e.code != NULL else None, e.offset, 0])
        number = self.rec.collectives  # counted back from the newest: the ring holds the latest calls
        for record in reversed(found):
            record[12] = number
            if record[2] == 0:
                number -= 1
        return [tuple(record) for record in found]

    def progress(self) -> tuple:
        """``(calls made, calls ended, capacity)``."""
        return self.rec.seq, self.rec.completed, self.rec.capacity

    def collectives_made(self) -> int:
        """Collective calls made (point-to-point ones not): the same count on every rank of a healthy group."""
        return self.rec.collectives

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

    def set_direct(self, allreduce, broadcast=None, all_gather=None, reduce_scatter=None, barrier=None,
                   reduce=None, all_to_all=None) -> None:
        """Install the group's direct paths (each a compiled call or None); None for all: the full path only."""
        self.direct_allreduce = allreduce
        self.direct_broadcast = broadcast
        self.direct_reduce = reduce
        self.direct_all_to_all = all_to_all
        self.direct_all_gather = all_gather
        self.direct_reduce_scatter = reduce_scatter
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
