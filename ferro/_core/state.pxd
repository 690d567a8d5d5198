# The per-group state object the Python layers and the compiled core share.

from cpython.ref cimport PyObject
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint32_t, uint64_t

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

cdef extern from "recorder.h":
    ctypedef struct ferro_callsite_table:
        PyObject* prefixes[4]
        int n_prefixes
        PyObject* names[256]
    ctypedef struct ferro_record:
        uint64_t seq
        uint64_t fingerprint
        uint64_t nbytes
        int64_t started
        int64_t ended
        PyObject* code
        int32_t waited
        int32_t offset
        int32_t peer
        int16_t collective
        int8_t state
        int8_t kind
    ctypedef struct ferro_recorder:
        ferro_record* ring
        uint64_t capacity
        uint64_t seq
        uint64_t completed
        uint64_t collectives
    int64_t ferro_now_ns() nogil
    uint64_t ferro_rec_begin(ferro_recorder* r, ferro_callsite_table* sites, int collective, int kind, uint64_t fingerprint,
                             uint64_t nbytes, int peer, int running, int64_t made)
    void ferro_rec_start(ferro_recorder* r, uint64_t seq)
    void ferro_rec_end(ferro_recorder* r, uint64_t seq, int ok, int64_t started, int64_t ended)
    void ferro_rec_clear(ferro_recorder* r)

# The table of call sites every group's recorder shares (ferro._core.state.set_library_prefixes fills it).
cdef ferro_callsite_table* callsites() noexcept

# The counters' slot of allreduce (ferro.types.COLLECTIVE_IDS["allreduce"]), for the compiled direct paths.
cdef enum:
    ALLREDUCE_SLOT = 1


cdef class GroupState:
    cdef public object failure           # why the group is unusable after a failed collective, or None
    cdef public object worker            # the group's GroupWorker (ferro.collective.work), created on first use
    cdef public object p2p               # ferro.p2p's receive state: messages set aside by (source, tag)
    cdef public object direct_allreduce  # the compiled allreduce path, None (the group has none), or UNSET
    cdef public object direct_broadcast  # likewise for the other direct collectives
    cdef public object direct_reduce
    cdef public object direct_all_to_all
    cdef public object direct_all_gather  # (ferro._core.direct)
    cdef public object direct_reduce_scatter
    cdef public object direct_barrier
    cdef public bint busy                # an operation of the group is running (kept by the worker)
    cdef public Py_ssize_t queued        # async operations waiting on the worker
    cdef ferro_stats stats               # bytes and calls per collective id, counted in C
    cdef ferro_recorder rec              # the flight recorder: the group's latest calls
    cdef public object owner             # a weak reference to the group (for the dump's description), or None
    cdef readonly uint64_t created       # creation order among this process's groups
    cdef object __weakref__

    cdef set_capacity(self, uint64_t capacity)
