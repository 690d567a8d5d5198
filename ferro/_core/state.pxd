# The per-group state object the Python layers and the compiled core share.

from libc.stdint cimport uint32_t, uint64_t

cdef extern from "stats.h" nogil:
    enum:
        FERRO_STAT_SLOTS
    ctypedef struct ferro_stats:
        uint64_t calls[64]
        uint64_t sent[64]
        uint64_t received[64]
    int ferro_stat_slot(uint32_t kind, uint64_t fingerprint)
    void ferro_count_sent(ferro_stats* s, int slot, uint64_t n)
    void ferro_count_received(ferro_stats* s, int slot, uint64_t n)
    void ferro_count_call(ferro_stats* s, int slot)

# The counters' slot of allreduce (ferro.types.COLLECTIVE_IDS["allreduce"]), for the compiled direct paths.
cdef enum:
    ALLREDUCE_SLOT = 1


cdef class GroupState:
    cdef public object failure           # why the group is unusable after a failed collective, or None
    cdef public object worker            # the group's GroupWorker (ferro.collective.work), created on first use
    cdef public object p2p               # ferro.p2p's receive state: messages set aside by (source, tag)
    cdef public object direct_allreduce  # the compiled allreduce path, None (the group has none), or UNSET
    cdef public object direct_broadcast  # likewise for broadcast, all_gather and barrier (ferro._core.direct)
    cdef public object direct_all_gather
    cdef public object direct_barrier
    cdef public bint busy                # an operation of the group is running (kept by the worker)
    cdef public Py_ssize_t queued        # async operations waiting on the worker
    cdef ferro_stats stats               # bytes and calls per collective id, counted in C
