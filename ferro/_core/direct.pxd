# The front every compiled direct path shares (ferro/_core/direct.pyx): the checks, the plan, the group's turn.

from libc.stdint cimport int64_t, uint64_t

from ferro._core.state cimport GroupState

cdef enum:
    MAX_DIMS = 64  # NumPy's limit; a direct path remembers the last call's shape
    READ_CLOCK = -1  # a time DirectCall.begin/end read themselves, when the flight recorder is on


cdef class DirectCall:
    cdef GroupState group_state
    cdef dict plans
    cdef object make_plan
    cdef object on_failure
    cdef object wake
    cdef object ndarray
    cdef object resolve_timeout
    cdef object op_type
    cdef public double default_timeout
    cdef unsigned long owner
    cdef int slot
    cdef uint64_t record        # the flight recorder's seq of the running call
    cdef tuple plan            # the plan of the last call that found one
    cdef object last_dtype     # that call's signature: dtype, extra (op, root or tag) and shape
    cdef object last_extra
    cdef int last_ndim
    cdef Py_ssize_t last_shape[MAX_DIMS]

    cdef bint may_take(self, x) noexcept
    cdef bint find_plan(self, x, object extra, Py_buffer* view) except -1
    cdef double seconds(self, object timeout) except? -1.0
    cdef void begin(self, uint64_t fingerprint, uint64_t nbytes, int64_t made) noexcept
    cdef int end(self, bint ok, int64_t started, int64_t ended) except -1
    cdef int fail(self, BaseException exc) except -1
