# cython: boundscheck=False, wraparound=False
"""The direct path of ``ferro.allreduce`` on a group whose engine is a foreign library's call (MPI's).

The collective layer's full path costs microseconds of Python per call, as
much as a small MPI_Allreduce itself. This class does what that path does for
the common case -- a writable C-contiguous NumPy array, a known dtype and op,
nothing queued on the group -- in C, then makes the library's call: one
Python call out of C. Anything else returns False and the full path takes it.
It needs no MPI at build time: the communicator and the datatypes are Python
objects handed to it.
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer

from libc.stdint cimport uint64_t

from ferro._core.reduce cimport ferro_divide
from ferro._core.state cimport (ALLREDUCE_SLOT, GroupState, callsites, ferro_count_call, ferro_now_ns,
                                ferro_rec_begin, ferro_rec_end)
from ferro._core.transport cimport monotonic_ns



cdef class WatchSlot:
    """The blocking call a group is in, for its watchdog thread: set from C on the direct path, from Python elsewhere.

    Attributes:
        deadline: ``time.monotonic()`` seconds by which the call should have returned; 0 while none runs.
        call: The call's name.
        seconds: Its timeout.

    """

    cdef public double deadline
    cdef public object call
    cdef public double seconds

    def __cinit__(self):
        self.deadline = 0.0
        self.call = ""
        self.seconds = 0.0


cdef class DirectForeignAllreduce:
    """Call ``(x, op, timeout)``: run ``allreduce(in_place, [x, datatype], op=library_op)`` and return True, or False.

    Args:
        allreduce: The library's blocking in-place allreduce (``comm.Allreduce``).
        in_place: Its in-place marker (``MPI.IN_PLACE``).
        group_state: The group's state: the path steps aside while it records a failure,
            a running operation or queued async ones, and counts its calls there.
        watch: The group's :class:`WatchSlot`, armed around the call.
        make_plan: ``make_plan(dtype, op)`` returns ``(datatype, library_op, dtype_code, divisor,
            max_count)`` (``divisor`` 0 but for MEAN; ``datatype`` None where the library infers it from
            the array) or False for the full path.
        on_failure: ``on_failure(exc)`` returns the exception to raise for one the call raised
            (after telling the group, as the fail-together guard does).
        ndarray: ``numpy.ndarray``.
        default_timeout: The group's default seconds.
        resolve_timeout: Turns a caller's timeout into seconds (validating it).

    """

    cdef object allreduce
    cdef object in_place
    cdef GroupState group_state
    cdef WatchSlot watch
    cdef object make_plan
    cdef object on_failure
    cdef object ndarray
    cdef double default_timeout
    cdef object resolve_timeout
    cdef dict plans
    cdef object name
    # The last call's signature and plan.
    cdef object last_dtype
    cdef object last_op
    cdef object datatype
    cdef object library_op
    cdef int dtype_code
    cdef double divisor
    cdef Py_ssize_t max_count

    def __cinit__(self, allreduce, in_place, GroupState group_state, WatchSlot watch, make_plan, on_failure, ndarray,
                  double default_timeout, resolve_timeout):
        self.allreduce = allreduce
        self.in_place = in_place
        self.group_state = group_state
        self.watch = watch
        self.make_plan = make_plan
        self.on_failure = on_failure
        self.ndarray = ndarray
        self.default_timeout = default_timeout
        self.resolve_timeout = resolve_timeout
        self.plans = {}
        self.name = "allreduce"
        self.last_dtype = None
        self.last_op = None

    def __call__(self, x, op, timeout) -> bool:
        cdef Py_buffer view
        cdef double seconds
        cdef Py_ssize_t count
        cdef uint64_t record
        if type(x) is not self.ndarray:
            return False
        state = self.group_state
        if state.failure is not None or state.busy or state.queued:
            return False
        dtype = x.dtype
        if dtype is not self.last_dtype or op is not self.last_op:
            key = (dtype, op)
            plan = self.plans.get(key)
            if plan is None:
                plan = self.plans[key] = self.make_plan(dtype, op)
            if plan is False:
                return False
            self.datatype, self.library_op, self.dtype_code, self.divisor, self.max_count = plan
            self.last_dtype, self.last_op = dtype, op
        try:
            PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        except (BufferError, ValueError, TypeError):
            return False  # read-only or not contiguous: the full path explains
        try:
            count = view.len // view.itemsize if view.itemsize else 0
            if count == 0 or count > self.max_count:
                return False
            seconds = self.default_timeout if timeout is None else self.resolve_timeout(timeout)
            datatype, library_op, divisor, dtype_code = self.datatype, self.library_op, self.divisor, self.dtype_code
            ferro_count_call(&state.stats, ALLREDUCE_SLOT)
            record = ferro_rec_begin(&state.rec, callsites(), ALLREDUCE_SLOT, 0, 0, <uint64_t>view.len, -1, 1,
                                     ferro_now_ns())
            watch = self.watch
            watch.call, watch.seconds = self.name, seconds
            watch.deadline = monotonic_ns() * 1e-9 + seconds
            try:
                # Positional arguments, and the array itself where its format names the datatype:
                # each saves mpi4py a step on every call.
                self.allreduce(self.in_place, x if datatype is None else [x, datatype], library_op)
            except BaseException as exc:
                ferro_rec_end(&state.rec, record, False, 0, ferro_now_ns())
                raise self.on_failure(exc)
            finally:
                watch.deadline = 0.0
            ferro_rec_end(&state.rec, record, True, 0, ferro_now_ns())
            if divisor != 0.0:
                ferro_divide(view.buf, <size_t>count, dtype_code, divisor)
            return True
        finally:
            PyBuffer_Release(&view)
