# cython: language_level=3, boundscheck=False, wraparound=False
"""The front every compiled direct path shares: one call from ``ferro.allreduce`` (and friends) into C.

The collective layer's full path -- validation, the call's fingerprint, the
group's worker, the fail-together guard -- costs tens of microseconds of Python
per call, more than a small message takes on the wire. A direct path does what
that path does for the common case in C and then runs the backend's compiled
collective: a writable (or, where the call only reads, readable) C-contiguous
NumPy array, on the thread that built the path, with nothing queued on the group.
Anything else returns "not taken", having done nothing, and the full path takes
the call (and explains what is wrong with it).

What it keeps of the full path's guarantees:

* **Order.** It steps aside while the group's worker runs or holds queued async
  calls, and marks the group busy while it runs, so a call from another thread
  queues behind it; it wakes the worker when it leaves if something was queued.
* **Agreement.** The plan of a call signature (dtype, shape and the call's op,
  root or tag) is made once by the collective layer and carries the same
  fingerprint the full path would, so ranks that mix the two paths interoperate
  and ranks that call different things refuse each other.
* **Failing together.** An error of the collective goes through ``on_failure``
  (the fail-together guard: the peers are told, the group is marked failed)
  before it propagates, with the full path's messages.

Subclasses (``ferro._core.arena.DirectAllreduce``, the mesh paths of
``ferro._core.collectives``) read their plan from ``self.plan`` and run the call.
"""

from cpython.pythread cimport PyThread_get_thread_ident

from ferro._core.state cimport callsites, ferro_count_call, ferro_now_ns, ferro_rec_begin, ferro_rec_end


cdef class DirectCall:
    """The checks, plan cache and turn-taking of a direct path (an abstract base: subclasses define ``__call__``).

    Args:
        group_state: The group's state: the path steps aside while it records a failure, a
            running operation or queued async ones; it counts its calls there.
        slot: The counters' slot of the collective (``ferro.types.COLLECTIVE_IDS``).
        make_plan: ``make_plan(plans, key, extra)`` returns the plan tuple of a signature,
            or False for "the full path takes it", and remembers it in ``plans`` under
            ``key`` (``(dtype, shape, extra's key)``).
        on_failure: ``on_failure(exc)`` tells the group about a failed call; it may raise a
            clearer error itself (a mismatch naming both calls).
        wake: ``wake()`` tells the group's worker that the group is free again.
        ndarray: ``numpy.ndarray``.
        resolve_timeout: Turns a caller's timeout into seconds (validating it).
        default_timeout: Seconds for calls that pass None.
        op_type: A type whose members key plans by identity (``ReduceOp``), or None.

    """

    def __cinit__(self, GroupState group_state, int slot, make_plan, on_failure, wake, ndarray, resolve_timeout,
                  double default_timeout, op_type=None, *args, **kwargs):
        self.group_state = group_state
        self.slot = slot
        self.plans = {}
        self.make_plan = make_plan
        self.on_failure = on_failure
        self.wake = wake
        self.ndarray = ndarray
        self.resolve_timeout = resolve_timeout
        self.default_timeout = default_timeout
        self.op_type = op_type
        self.owner = PyThread_get_thread_ident()
        self.plan = None
        self.last_dtype = None
        self.last_extra = None
        self.last_ndim = -1

    cdef bint may_take(self, x) noexcept:
        # Another thread's call takes the full path, which tags it with that thread (the thread rule of
        # ferro.collective.work). The group's flags are read without the worker's lock: a hint, as ordering across
        # threads is the caller's; begin() then claims the group before anything can let another thread in.
        if x is not None and type(x) is not self.ndarray:
            return False
        if PyThread_get_thread_ident() != self.owner:
            return False
        state = self.group_state
        return state.failure is None and not state.busy and not state.queued

    cdef bint find_plan(self, x, object extra, Py_buffer* view) except -1:
        """Point ``self.plan`` at the plan of this call's signature; False when the full path must take it."""
        cdef int i
        cdef bint same
        dtype = x.dtype
        # The plan of the previous call, if this one has the same signature: no key, no lookup.
        same = self.plan is not None and dtype is self.last_dtype and extra is self.last_extra \
            and view.ndim == self.last_ndim
        i = 0
        while same and i < view.ndim:
            same = view.shape[i] == self.last_shape[i]
            i += 1
        if same:
            return True
        # Members of op_type live forever, so their address is a safe key (and cheaper than their hash).
        key = (dtype, x.shape, <Py_ssize_t><void*>extra if type(extra) is self.op_type else extra)
        found = self.plans.get(key)
        if found is None:
            found = self.make_plan(self.plans, key, extra)
        self.plan = None  # until the new signature is complete
        if found is False or view.ndim > MAX_DIMS:
            return False
        for i in range(view.ndim):
            self.last_shape[i] = view.shape[i]
        self.last_ndim = view.ndim
        self.last_extra = extra
        self.last_dtype = dtype
        self.plan = <tuple>found
        return True

    cdef double seconds(self, object timeout) except? -1.0:
        return self.default_timeout if timeout is None else self.resolve_timeout(timeout)

    cdef void begin(self, uint64_t fingerprint, uint64_t nbytes, int64_t made) noexcept:
        # Busy: a call from another thread queues on the worker instead of meeting this one on the wire.
        self.group_state.busy = True
        ferro_count_call(&self.group_state.stats, self.slot)
        # made: the caller's clock read, 0 for none, READ_CLOCK to read it here, and only if the recorder is on.
        if made == READ_CLOCK:
            made = ferro_now_ns() if self.group_state.rec.capacity else 0
        self.record = ferro_rec_begin(&self.group_state.rec, callsites(), self.slot, 0, fingerprint, nbytes, -1, 1,
                                      made)

    cdef int end(self, bint ok, int64_t started, int64_t ended) except -1:
        # The times come from the caller, which has them from its engine's clock reads (see recorder.h), or
        # READ_CLOCK, as for begin().
        state = self.group_state
        if ended == READ_CLOCK:
            ended = ferro_now_ns() if state.rec.capacity else 0
        ferro_rec_end(&state.rec, self.record, ok, started, ended)
        state.busy = False
        if state.queued:
            self.wake()  # the worker saw the group busy and waits for a nudge
        return 0

    cdef int fail(self, BaseException exc) except -1:
        # After end(): the guard talks to the peers over the same connections.
        self.on_failure(exc)
        return 0
