# What a compiled operation's outcome means: the status codes, and the one place they become exceptions.

from libc.stdint cimport uint32_t, uint64_t


cdef enum Status:
    ST_OK = 0              # the operation finished
    ST_AGAIN = 1           # internal: the socket would block
    ST_INTR = 2            # internal: a system call saw EINTR, or a signal handler raised
    ST_TIMEOUT = 3         # the deadline passed
    ST_PEER_CLOSED = 4     # the peer exited, crashed or closed its group
    ST_OS_ERROR = 5        # any other errno (kept in the failure's os_errno)
    ST_BAD_MAGIC = 6       # the header does not start with ferro's magic and version
    ST_BAD_SEQ = 7         # a frame out of order: the stream is corrupt
    ST_MISMATCH = 8        # kind or fingerprint differ from the receiver's call
    ST_TOO_LARGE = 9       # the payload is larger than the posted buffer
    ST_SIZE_MISMATCH = 10  # an exact-size receive got a different length
    ST_BROKEN = 11         # the channel was left unusable by an earlier error
    ST_ABORTED = 12        # stopped because the other half of an exchange failed
    ST_CLOSED = 13         # this process closed the group while the operation waited


cdef struct SeenHeader:
    uint32_t magic             # a frame header's fields as received
    uint32_t kind
    uint64_t length
    uint64_t seq
    uint64_t fingerprint


cdef struct Failure:
    int status                 # a Status
    int peer                   # the rank concerned, -1 for none
    int os_errno               # behind ST_OS_ERROR
    bint mid_frame             # it stopped inside a frame: that channel is now unusable
    uint32_t kind              # this rank's call: frame kind and fingerprint
    uint64_t fingerprint
    uint64_t capacity          # the posted buffer, for size refusals
    bint exact                 # the receive required exactly ``capacity`` bytes
    uint64_t seq               # the frame due (or, in the arena, the call)
    SeenHeader seen            # what the peer sent, for refusals


cdef void describe_receive(Failure* f, int status, int peer, bint mid_frame, uint32_t kind, uint64_t fingerprint,
                           uint64_t capacity, bint exact, uint64_t seq, SeenHeader* seen) noexcept
cdef object failure_error(Failure* f, str where, double timeout, str detail)
