# Declarations of the framed transport, so later compiled modules (ring
# collectives, shared memory) can drive connections without the GIL.

from cpython.pythread cimport PyThread_type_lock
from libc.stdint cimport int64_t, uint32_t, uint64_t

from ferro._core.posix cimport pollfd
from ferro._core.state cimport ferro_stats
from ferro._core.status cimport SeenHeader


cdef struct ConnState:
    int fd                 # the socket's descriptor (owned by the Python socket object)
    int local_rank         # this process's rank, for messages
    int peer_rank          # the rank at the other end, for messages
    uint64_t send_seq      # sequence number of the next frame this side sends
    uint64_t recv_seq      # sequence number expected on the next frame received
    unsigned char* stage   # staging buffer for headers (and bytes that arrive with them)
    size_t stage_cap       # its capacity; fixed at creation, never sized by the wire
    size_t stage_begin     # first unconsumed staged byte
    size_t stage_end       # one past the last staged byte
    int broken             # 0, or the Status that left the stream unusable
    int closing            # close() was called, possibly while another thread waits here
    int64_t spin_ns        # how long to spin on a quiet socket before sleeping in poll
    int64_t yield_ns       # without a spin, how long to try between sched_yield()s before poll
    ferro_stats* stats     # the group's counters (its GroupState's), or NULL


cdef struct SendOp:
    ConnState* conn                 # where the frame goes
    unsigned char header[32]        # the packed header (FERRO_HEADER_SIZE bytes)
    const unsigned char* payload    # the caller's bytes, sent in place
    size_t length                   # payload length
    size_t done                     # bytes of header + payload already sent
    size_t cap                      # send no further than this many bytes of header + payload yet (0: all)
    int status                      # final Status of this op
    int os_errno                    # errno behind ST_OS_ERROR
    int stat_slot                   # the counter slot of the frame's operation (stats.h)


cdef struct RecvOp:
    ConnState* conn            # where the frame comes from
    unsigned char* buffer      # the caller's buffer, written in place
    size_t capacity            # its size in bytes
    bint exact                 # require length == capacity
    uint32_t kind              # the kind the caller expects
    uint64_t fingerprint       # the fingerprint the caller expects
    int phase                  # 0 waiting for the header, 1 payload, 2 done
    size_t length              # payload length from the accepted header
    size_t done                # payload bytes written so far
    int status                 # final Status of this op
    int os_errno               # errno behind ST_OS_ERROR
    SeenHeader seen            # the last header looked at, for error messages


cdef class Connection:
    cdef ConnState st          # the C state every nogil routine works on
    cdef object sock           # the socket object: keeps the descriptor open and owned
    cdef object broken_reason  # message of the error that broke the stream, or None
    cdef bint is_closed        # close() was called
    cdef PyThread_type_lock send_lock  # one sending thread at a time: frames must not interleave
    cdef PyThread_type_lock recv_lock  # one receiving thread at a time
    cdef object group_state    # the GroupState whose counters st.stats points into (kept alive here)

    cdef int check_usable(self, str op) except -1
    cdef int lock(self, PyThread_type_lock which, double timeout, str op) except -1


cdef int64_t monotonic_ns() noexcept nogil
cdef int check_header(const unsigned char* h, uint32_t kind, uint64_t fingerprint, uint64_t expected_seq,
                      uint64_t capacity, bint exact, SeenHeader* seen) noexcept nogil
cdef int signal_raised() noexcept with gil
cdef int run_ops(SendOp* s, RecvOp* r, int64_t deadline_ns, bint either=*) except -1 nogil
cdef int run_until(SendOp* sends, int nsend, RecvOp* recvs, int nrecv, pollfd* fds, int64_t deadline_ns,
                   bint first_only, size_t budget=*, double drain_rate=*) except -1 nogil
cdef int raise_failure(SendOp* s, RecvOp* r, str op, double timeout) except -1
cdef int acquire_buffer(object obj, Py_buffer* view, bint writable, str op) except -1
