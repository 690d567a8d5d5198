# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Collectives through a shared-memory arena: every rank reads its peers' slots directly.

Each rank owns a slot in the segment, split into ``BUFFERS`` buffers used in
turn, so one chunk is being filled while the previous one is still read.
A collective is a fixed sequence of *phases*; after each, a rank bumps its
``step`` counter (``arena.h``). Waiting means "until rank j's step reaches v":
a bounded spin, then short naps (``pace.h``; ranks that outnumber the cores
yield instead of spinning), checking every
millisecond that the peers are alive and have not given up, and every 100 ms
for signals. Everything between taking the buffers and returning runs without
the GIL.

The algorithms:

* **allreduce, reduce-scatter, all-gather, reduce** (one routine): the message
  is cut into chunks; in each, every rank copies the parts that other ranks
  reduce into its slot, reduces its own part in place by reading that part
  from every peer's slot, publishes the result in its slot, and copies the
  peers' results out. The reduction order is fixed (this rank's value, then the
  peers' in rank order), and each part is reduced by one rank only, so every
  rank gets the same bits.
* **small allreduce**: one phase; every rank copies its whole input into its
  slot and reduces all slots in rank order. One synchronisation instead of two.
* **broadcast**: the root copies chunks into its slot, the others copy them out.
* **barrier**: one phase with no data.
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.pythread cimport (
    NOWAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
    PyThread_type_lock,
)
from libc.errno cimport ESRCH, errno
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from libc.string cimport memset

from ferro._core.posix cimport (
    PY_LOCK_ACQUIRED,
    PyThread_acquire_lock_timed,
    ferro_pace,
    ferro_pace_look_due,
    ferro_pace_rest,
    ferro_pace_signals_due,
    ferro_pace_start,
    kill,
)
from ferro._core.direct cimport DirectCall
from ferro._core.reduce cimport ferro_divide, ferro_reduce_fn, ferro_reduce_kernel
from ferro._core.state cimport (
    GroupState,
    ferro_count_received,
    ferro_count_sent,
    ferro_stat_slot,
    ferro_stats,
)
from ferro._core.status cimport (
    ST_CLOSED,
    ST_INTR,
    ST_MISMATCH,
    ST_PEER_CLOSED,
    ST_TIMEOUT,
    Failure,
    failure_error,
)
from ferro._core.transport cimport acquire_buffer, monotonic_ns, signal_raised

from ferro._core.status import KIND_BARRIER, KIND_COLLECTIVE, abort_error
from ferro.errors import BackendClosedError, ConnectionBrokenError, DistributedTimeoutError, InvalidBufferError

cdef extern from "shm_ring.h" nogil:
    ctypedef struct ferro_rank_ctl:
        int32_t pid
        uint32_t closed
    uint64_t ferro_load_acquire(const uint64_t* p)
    void ferro_store_release(uint64_t* p, uint64_t v)
    uint32_t ferro_load_acquire32(const uint32_t* p)
    void ferro_store_release32(uint32_t* p, uint32_t v)

cdef extern from "copy.h" nogil:
    void ferro_copy(void* dst, const void* src, size_t n)

cdef extern from "arena.h" nogil:
    enum:
        FERRO_ARENA_HISTORY
        FERRO_ARENA_NOTICE_BYTES
    ctypedef struct ferro_arena_call:
        uint64_t call
        uint64_t kind
        uint64_t fingerprint
    ctypedef struct ferro_arena_ctl:
        uint64_t step
        uint64_t calls
        ferro_arena_call history[8]
        uint32_t abort_len
        unsigned char notice[4096]

cdef enum:
    BUFFERS = 2               # buffers per slot: fill the next chunk while the peers still read the last
    ALIGN = 64                # parts of a buffer start on cache lines

# Outcomes of a wait besides 0 (reached), -1 (a signal handler raised) and the Status codes
# ST_TIMEOUT, ST_PEER_CLOSED, ST_MISMATCH and ST_CLOSED: a peer's abort notice.
cdef enum:
    W_ABORTED = 100

cdef int64_t DEADLINE_AT_FIRST_WAIT = -2   # set the deadline when a wait first has to wait

cdef uint64_t KIND_COLLECTIVE_C = KIND_COLLECTIVE
cdef uint64_t KIND_BARRIER_C = KIND_BARRIER



def arena_bytes(int world_size, size_t buffer_bytes) -> int:
    """Bytes the arena of ``world_size`` ranks with ``buffer_bytes`` per slot buffer needs."""
    return world_size * (_round_up(sizeof(ferro_arena_ctl), 4096) + BUFFERS * _round_up(buffer_bytes, 4096))


cdef inline size_t _round_up(size_t n, size_t to) noexcept nogil:
    return (n + to - 1) // to * to


cdef inline size_t _min(size_t a, size_t b) noexcept nogil:
    return a if a < b else b


cdef struct Parts:
    unsigned char* data       # the caller's buffer
    size_t* starts            # each rank's part: byte offset
    size_t* lengths           # and byte length
    size_t itemsize
    ferro_reduce_fn kernel
    int dtype_code
    double divisor            # non-zero: divide each reduced part (MEAN)
    size_t part               # bytes of each rank's part per chunk
    size_t longest            # the longest part


cdef struct WaitResult:
    int peer                  # the rank that failed the wait (or the first one not there at a timeout)
    uint64_t seen_kind        # its call, when the calls differ
    uint64_t seen_fingerprint


cdef class Arena:
    """This rank's view of the arena: every rank's control block and slot.

    Args:
        mapping: A writable buffer over the whole segment (an ``mmap``).
        world_size: Ranks sharing it.
        rank: This rank.
        ranks_offset: Offset of the segment's per-rank blocks (pid and closed flag), 64 bytes each.
        arena_offset: Offset of the arena (page-aligned).
        buffer_bytes: Bytes of each of a slot's buffers.
        spin_us: Microseconds to spin before yielding the CPU while waiting.
        group_state: The group's state, whose counters the arena adds the bytes it publishes
            (copies into this rank's slot) and reads (copies from peers' slots) to.
        yield_us: Without a spin, microseconds a quiet wait keeps calling ``sched_yield()`` before it naps.
    """

    cdef object mapping
    cdef Py_buffer view
    cdef bint has_view
    cdef readonly int rank
    cdef readonly int world_size
    cdef readonly size_t buffer_bytes
    cdef public double default_timeout  # seconds, for calls that pass None
    cdef public Py_ssize_t small_limit  # largest allreduce taking the one-phase algorithm
    cdef int64_t deadline              # the running call's deadline (monotonic ns), -1 for none
    cdef int64_t timeout_ns            # its timeout, for a deadline set at the first wait
    cdef int64_t spin_ns
    cdef int64_t yield_ns
    cdef readonly int64_t first_wait   # the running (or last) call's first and last clock reads while it waited
    cdef readonly int64_t last_wait    # for a peer (0: it never waited); the flight recorder's times
    cdef ferro_rank_ctl** ranks
    cdef ferro_arena_ctl** ctl
    cdef unsigned char** slots
    cdef uint64_t step                 # this rank's completed phases
    cdef uint64_t call                 # this rank's calls
    cdef uint64_t call_start           # step at which the current call began
    cdef uint64_t* checked             # per peer: the last call whose record matched ours
    cdef uint64_t free_after[BUFFERS]  # a buffer may be rewritten once every rank reached this step
    cdef int next_buffer
    cdef uint64_t kind                 # the current call's kind and fingerprint
    cdef uint64_t fingerprint
    cdef PyThread_type_lock lock
    cdef object broken                 # why the arena is unusable (a call stopped part-way), or None
    cdef bint closed
    cdef GroupState group_state        # whose counters ``stats`` points into (kept alive here)
    cdef ferro_stats* stats
    cdef int slot                      # the running call's counter slot

    def __cinit__(self, mapping, int world_size, int rank, size_t ranks_offset, size_t arena_offset,
                  size_t buffer_bytes, double spin_us=50.0, GroupState group_state=None, double yield_us=1000.0):
        cdef unsigned char* base
        cdef size_t block = _round_up(sizeof(ferro_arena_ctl), 4096)
        cdef size_t slot = BUFFERS * _round_up(buffer_bytes, 4096)
        cdef int j
        self.has_view = False
        self.ranks = NULL
        self.ctl = NULL
        self.slots = NULL
        self.checked = NULL
        self.lock = NULL
        if buffer_bytes < <size_t>(ALIGN * world_size):
            raise ValueError(f"arena buffers need at least {ALIGN * world_size} bytes for {world_size} ranks")
        if len(mapping) < arena_offset + arena_bytes(world_size, buffer_bytes):
            raise ValueError("the mapping is smaller than the arena layout needs")
        PyObject_GetBuffer(mapping, &self.view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        self.has_view = True
        self.mapping = mapping
        base = <unsigned char*>self.view.buf
        self.rank = rank
        self.world_size = world_size
        self.buffer_bytes = buffer_bytes
        self.spin_ns = <int64_t>(spin_us * 1000)
        self.yield_ns = <int64_t>(yield_us * 1000)
        self.ranks = <ferro_rank_ctl**>malloc(world_size * sizeof(void*))
        self.ctl = <ferro_arena_ctl**>malloc(world_size * sizeof(void*))
        self.slots = <unsigned char**>malloc(world_size * sizeof(void*))
        self.checked = <uint64_t*>malloc(world_size * sizeof(uint64_t))
        self.lock = PyThread_allocate_lock()
        if self.ranks == NULL or self.ctl == NULL or self.slots == NULL or self.checked == NULL or self.lock == NULL:
            raise MemoryError()
        for j in range(world_size):
            self.ranks[j] = <ferro_rank_ctl*>(base + ranks_offset + j * 64)
            self.ctl[j] = <ferro_arena_ctl*>(base + arena_offset + j * block)
            self.slots[j] = base + arena_offset + world_size * block + j * slot
            self.checked[j] = 0
        # The segment may be reused memory only if it was never used: start from what is there.
        self.step = self.ctl[rank].step
        self.call = 0
        self.call_start = self.step
        for j in range(BUFFERS):
            self.free_after[j] = 0
        self.next_buffer = 0
        self.broken = None
        self.closed = False
        self.default_timeout = -1.0
        self.small_limit = 0
        self.group_state = group_state
        self.stats = &group_state.stats if group_state is not None else NULL
        self.slot = -1

    def __dealloc__(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
        free(self.ranks)
        free(self.ctl)
        free(self.slots)
        free(self.checked)
        if self.lock != NULL:
            PyThread_free_lock(self.lock)

    def release(self) -> None:
        """Stop using the arena and let go of the mapping (the caller then closes it)."""
        self.closed = True
        if PyThread_acquire_lock(self.lock, NOWAIT_LOCK):
            # No call in progress: the mapping can go now. Otherwise the running call keeps it.
            if self.has_view:
                PyBuffer_Release(&self.view)
                self.has_view = False
            PyThread_release_lock(self.lock)

    def post_abort(self, bytes payload) -> None:
        """Tell every peer this rank gave up, and why (an abort notice, at most 4096 bytes)."""
        cdef ferro_arena_ctl* mine
        cdef size_t n = _min(len(payload), FERRO_ARENA_NOTICE_BYTES)
        if not self.has_view:
            return
        mine = self.ctl[self.rank]
        if ferro_load_acquire32(&mine.abort_len) != 0:
            return  # the first notice stands
        ferro_copy(mine.notice, <const unsigned char*>payload, n)
        ferro_store_release32(&mine.abort_len, <uint32_t>(n if n > 0 else 1))

    def peer_gave_up(self, int peer) -> bool:
        """Whether ``peer`` posted an abort notice (it is no longer waiting in any collective)."""
        if not self.has_view or not 0 <= peer < self.world_size:
            return False
        return ferro_load_acquire32(&self.ctl[peer].abort_len) != 0

    def peer_call(self, int peer):
        """``(kind, fingerprint)`` of the collective ``peer`` started that this rank has not, or None.

        For diagnostics: a receive that times out can say the peer is waiting in a collective.
        """
        cdef uint64_t calls
        cdef ferro_arena_call* entry
        if not self.has_view or not 0 <= peer < self.world_size:
            return None
        calls = ferro_load_acquire(&self.ctl[peer].calls)
        if calls <= self.call:
            return None
        entry = &self.ctl[peer].history[calls % FERRO_ARENA_HISTORY]
        return (entry.kind, entry.fingerprint) if entry.call == calls else None

    # --- the collectives -------------------------------------------------------

    def allreduce(self, flat, int dtype_code, int op_code, size_t itemsize, uint64_t fingerprint,
                  object timeout=None, double divisor=0.0, int root=-1) -> None:
        """Allreduce ``flat`` in place (or reduce it onto ``root`` when ``root >= 0``).

        Up to ``small_limit`` bytes an allreduce takes one phase in which every rank
        reduces every slot; larger messages (and every reduce) are cut into parts as
        ``numpy.array_split`` cuts them, each reduced by one rank chunk by chunk.
        ``timeout`` None means the arena's ``default_timeout``.
        """
        cdef double seconds = self.default_timeout if timeout is None else timeout
        cdef Py_buffer view
        acquire_buffer(flat, &view, True, "allreduce" if root < 0 else "reduce")
        try:
            self._allreduce(&view, itemsize, dtype_code, op_code, fingerprint, seconds, divisor, root)
        finally:
            PyBuffer_Release(&view)

    cdef int _allreduce(self, Py_buffer* view, size_t itemsize, int dtype_code, int op_code, uint64_t fingerprint,
                        double seconds, double divisor, int root) except -1:
        if root < 0 and view.len <= self.small_limit:
            return self._allreduce_small(view, dtype_code, op_code, fingerprint, seconds, divisor)
        return self._allreduce_parts(view, itemsize, dtype_code, op_code, fingerprint, seconds, divisor, root)

    cdef int _allreduce_small(self, Py_buffer* view, int dtype_code, int op_code, uint64_t fingerprint,
                              double seconds, double divisor) except -1:
        cdef ferro_reduce_fn kernel = ferro_reduce_kernel(dtype_code, op_code)
        cdef WaitResult w
        cdef int rc = 0, b, j
        cdef size_t n = <size_t>view.len, count
        if kernel == NULL:
            raise InvalidBufferError(f"allreduce: no kernel for dtype code {dtype_code} and op code {op_code}")
        if n > self.buffer_bytes:
            raise ValueError(f"allreduce_small: {n} bytes do not fit in a {self.buffer_bytes}-byte buffer")
        count = n // <size_t>view.itemsize if view.itemsize > 0 else n
        self._enter("allreduce", seconds)
        try:
            self.deadline = DEADLINE_AT_FIRST_WAIT
            self.timeout_ns = -1 if seconds < 0 else <int64_t>(seconds * 1e9)
            with nogil:
                self._begin(KIND_COLLECTIVE_C, fingerprint)
                b = self._take_buffer()
                rc = self._wait(self.free_after[b], -1, &w)
                if rc == 0:
                    ferro_copy(self.slots[self.rank] + b * self._stride(), view.buf, n)
                    self._signal()
                    rc = self._wait(self.step, -1, &w)
                if rc == 0:
                    ferro_copy(view.buf, self.slots[0] + b * self._stride(), n)
                    for j in range(1, self.world_size):
                        kernel(view.buf, self.slots[j] + b * self._stride(), count)
                    if divisor != 0.0:
                        ferro_divide(view.buf, count, dtype_code, divisor)
                    self.free_after[b] = self.step + 1
                    ferro_count_sent(self.stats, self.slot, n)
                    ferro_count_received(self.stats, self.slot, n * <size_t>(self.world_size - 1))
            self._finish(rc, &w, "allreduce", seconds)
        finally:
            PyThread_release_lock(self.lock)
        return 0

    def ring(self, flat, bounds, int dtype_code, int op_code, size_t itemsize, uint64_t fingerprint, double timeout,
             bint reduce_scatter, bint all_gather, double divisor=0.0) -> None:
        """Reduce-scatter or all-gather ``flat`` (cut at ``bounds``) in place, chunk by chunk.

        With ``reduce_scatter``, part ``i`` of ``flat`` (``bounds[i]:bounds[i+1]``,
        in elements of ``itemsize`` bytes) ends reduced on rank ``i``. With
        ``all_gather``, every rank ends with every rank's part ``i``; with both, an
        allreduce over these bounds. A non-zero ``divisor`` (MEAN) divides each reduced part.
        """
        cdef Py_buffer view
        cdef ferro_reduce_fn kernel = NULL
        cdef WaitResult w
        cdef int rc = 0, n = self.world_size, j
        cdef size_t* starts
        cdef size_t* lengths
        op = "reduce_scatter" if reduce_scatter else "all_gather"
        if len(bounds) != n + 1:
            raise ValueError(f"{op}: bounds need {n + 1} entries, got {len(bounds)}")
        if reduce_scatter:
            kernel = ferro_reduce_kernel(dtype_code, op_code)
            if kernel == NULL:
                raise InvalidBufferError(f"{op}: no kernel for dtype code {dtype_code} and op code {op_code}")
        self._enter(op, timeout)
        starts = <size_t*>malloc(n * sizeof(size_t))
        lengths = <size_t*>malloc(n * sizeof(size_t))
        try:
            if starts == NULL or lengths == NULL:
                raise MemoryError()
            acquire_buffer(flat, &view, True, op)
            try:
                for j in range(n):
                    starts[j] = <size_t>bounds[j] * itemsize
                    lengths[j] = (<size_t>bounds[j + 1] - <size_t>bounds[j]) * itemsize
                    if bounds[j + 1] < bounds[j] or starts[j] + lengths[j] > <size_t>view.len:
                        raise ValueError(f"{op}: bounds {list(bounds)} do not fit a {view.len}-byte buffer")
                self.deadline = _deadline(timeout)
                with nogil:
                    rc = self._ring(<unsigned char*>view.buf, starts, lengths, itemsize, kernel, dtype_code,
                                    reduce_scatter, all_gather, divisor, -1, fingerprint, &w)
            finally:
                PyBuffer_Release(&view)
            self._finish(rc, &w, op, timeout)
        finally:
            free(starts)
            free(lengths)
            PyThread_release_lock(self.lock)

    cdef int _allreduce_parts(self, Py_buffer* view, size_t itemsize, int dtype_code, int op_code,
                              uint64_t fingerprint, double seconds, double divisor, int root) except -1:
        # Reduce-scatter plus all-gather (onto ``root`` only, if >= 0) over parts split as
        # numpy.array_split splits.
        cdef ferro_reduce_fn kernel = ferro_reduce_kernel(dtype_code, op_code)
        cdef WaitResult w
        cdef int rc = 0, n = self.world_size, j
        cdef size_t count = <size_t>view.len // itemsize, base, extra, first
        cdef size_t* starts
        cdef size_t* lengths
        if kernel == NULL:
            raise InvalidBufferError(f"allreduce: no kernel for dtype code {dtype_code} and op code {op_code}")
        starts = <size_t*>malloc(n * sizeof(size_t))
        lengths = <size_t*>malloc(n * sizeof(size_t))
        try:
            if starts == NULL or lengths == NULL:
                raise MemoryError()
            base, extra = count // <size_t>n, count % <size_t>n
            for j in range(n):
                first = <size_t>j * base + (<size_t>j if <size_t>j < extra else extra)
                starts[j] = first * itemsize
                lengths[j] = (base + (1 if <size_t>j < extra else 0)) * itemsize
            op = "allreduce" if root < 0 else "reduce"
            self._enter(op, seconds)
            try:
                self.deadline = _deadline(seconds)
                with nogil:
                    rc = self._ring(<unsigned char*>view.buf, starts, lengths, itemsize, kernel, dtype_code, True,
                                    True, divisor, root, fingerprint, &w)
                self._finish(rc, &w, op, seconds)
            finally:
                PyThread_release_lock(self.lock)
        finally:
            free(starts)
            free(lengths)
        return 0

    def broadcast(self, flat, int root, uint64_t fingerprint, double timeout) -> None:
        """Copy ``flat`` from rank ``root`` into ``flat`` on every rank, a buffer-sized chunk at a time."""
        cdef Py_buffer view
        cdef WaitResult w
        cdef int rc = 0, b
        cdef size_t total, done = 0, chunk
        cdef unsigned char* data
        self._enter("broadcast", timeout)
        try:
            acquire_buffer(flat, &view, self.rank != root, "broadcast")
            try:
                total = <size_t>view.len
                data = <unsigned char*>view.buf
                self.deadline = _deadline(timeout)
                with nogil:
                    self._begin(KIND_COLLECTIVE_C, fingerprint)
                    while rc == 0 and done < total:
                        chunk = _min(self.buffer_bytes, total - done)
                        b = self._take_buffer()
                        if self.rank == root:
                            rc = self._wait(self.free_after[b], -1, &w)
                            if rc != 0:
                                break
                            ferro_copy(self.slots[root] + b * self._stride(), data + done, chunk)
                            ferro_count_sent(self.stats, self.slot, chunk)
                        self._signal()
                        if self.rank != root:
                            rc = self._wait(self.step, root, &w)
                            if rc != 0:
                                break
                            ferro_copy(data + done, self.slots[root] + b * self._stride(), chunk)
                            ferro_count_received(self.stats, self.slot, chunk)
                        self.free_after[b] = self.step + 1
                        done += chunk
            finally:
                PyBuffer_Release(&view)
            self._finish(rc, &w, "broadcast", timeout)
        finally:
            PyThread_release_lock(self.lock)

    def barrier(self, double timeout) -> None:
        """Block until every rank has entered the barrier."""
        cdef WaitResult w
        cdef int rc
        self._enter("barrier", timeout)
        try:
            self.deadline = _deadline(timeout)
            with nogil:
                self._begin(KIND_BARRIER_C, 0)
                self._signal()
                rc = self._wait(self.step, -1, &w)
            self._finish(rc, &w, "barrier", timeout)
        finally:
            PyThread_release_lock(self.lock)

    # --- the machinery ---------------------------------------------------------

    cdef int _enter(self, str op, double timeout) except -1:
        cdef long long micros
        cdef int got
        self.first_wait = 0
        self.last_wait = 0
        if self.closed or not self.has_view:
            raise BackendClosedError(f"rank {self.rank}: {op}: this process group was closed")
        if self.broken is not None:
            raise ConnectionBrokenError(
                f"rank {self.rank}: {op}: the shared-memory arena is unusable after {self.broken}; "
                f"create a new group")
        if not PyThread_acquire_lock(self.lock, NOWAIT_LOCK):
            micros = -1 if timeout < 0 else <long long>(timeout * 1e6)
            with nogil:
                got = PyThread_acquire_lock_timed(self.lock, micros, 0)
            if got != PY_LOCK_ACQUIRED:
                raise DistributedTimeoutError(
                    f"rank {self.rank}: {op} timed out after {timeout:g} s waiting for another thread's "
                    f"collective on the same group")
        if self.closed or not self.has_view:
            PyThread_release_lock(self.lock)
            raise BackendClosedError(f"rank {self.rank}: {op}: this process group was closed")
        return 0

    cdef inline size_t _stride(self) noexcept nogil:
        return _round_up(self.buffer_bytes, 4096)

    cdef inline void _begin(self, uint64_t kind, uint64_t fingerprint) noexcept nogil:
        # Record the call before this call's first step is published, so a peer that
        # sees the step also sees the record.
        cdef ferro_arena_call* entry
        self.call += 1
        self.call_start = self.step
        self.kind = kind
        self.fingerprint = fingerprint
        self.slot = ferro_stat_slot(<uint32_t>kind, fingerprint)
        entry = &self.ctl[self.rank].history[self.call % FERRO_ARENA_HISTORY]
        entry.call = self.call
        entry.kind = kind
        entry.fingerprint = fingerprint
        ferro_store_release(&self.ctl[self.rank].calls, self.call)

    cdef inline int _take_buffer(self) noexcept nogil:
        cdef int b = self.next_buffer
        self.next_buffer = (b + 1) % BUFFERS
        return b

    cdef inline void _signal(self) noexcept nogil:
        self.step += 1
        ferro_store_release(&self.ctl[self.rank].step, self.step)

    cdef int _check_call(self, int peer, WaitResult* w) noexcept nogil:
        # The peer has published a step of this call: its record of the call must match ours.
        cdef ferro_arena_call* entry = &self.ctl[peer].history[self.call % FERRO_ARENA_HISTORY]
        if self.checked[peer] == self.call:
            return 0
        if entry.call == self.call and (entry.kind != self.kind or entry.fingerprint != self.fingerprint):
            w.peer = peer
            w.seen_kind = entry.kind
            w.seen_fingerprint = entry.fingerprint
            return ST_MISMATCH
        self.checked[peer] = self.call
        return 0

    cdef int _look(self, int peer, WaitResult* w, uint64_t target) noexcept nogil:
        # Every millisecond of waiting: has the peer given up, or has a peer this wait still
        # needs (its step below ``target``) closed or died? A peer that already got there may
        # close and exit at once (its last barrier done): that is no loss to this wait.
        cdef bint gone
        if ferro_load_acquire32(&self.ctl[peer].abort_len) != 0:
            w.peer = peer
            return W_ABORTED
        if ferro_load_acquire(&self.ctl[peer].step) >= target:
            return 0
        gone = ferro_load_acquire32(&self.ranks[peer].closed) != 0 or (
            self.ranks[peer].pid > 0 and kill(self.ranks[peer].pid, 0) != 0 and errno == ESRCH)
        # Read the step again: the peer may have reached the target just before it left.
        if gone and ferro_load_acquire(&self.ctl[peer].step) < target:
            w.peer = peer
            return ST_PEER_CLOSED
        return 0

    cdef int _wait(self, uint64_t target, int only, WaitResult* w) except -1 nogil:
        """Wait until rank ``only`` (or every peer, for -1) reached ``target``; 0, or a W_ code."""
        cdef int j, first = 0 if only < 0 else only, last = self.world_size if only < 0 else only + 1
        cdef int pending, rc, lagging = -1
        cdef int64_t now
        cdef bint started = False
        cdef ferro_pace pace
        while True:
            pending = 0
            for j in range(first, last):
                if j == self.rank:
                    continue
                if ferro_load_acquire(&self.ctl[j].step) < target:
                    pending += 1
                    lagging = j
                elif target > self.call_start:
                    rc = self._check_call(j, w)
                    if rc != 0:
                        return rc
            if pending == 0:
                return 0
            now = monotonic_ns()
            self.last_wait = now
            if self.first_wait == 0:
                self.first_wait = now
            if not started:
                started = True
                if self.deadline == DEADLINE_AT_FIRST_WAIT:
                    # A call that never has to wait never reads the clock for its deadline.
                    self.deadline = -1 if self.timeout_ns < 0 else now + self.timeout_ns
                ferro_pace_start(&pace, now, self.spin_ns, self.yield_ns)
                continue
            if self.deadline >= 0 and now >= self.deadline:
                w.peer = lagging
                return ST_TIMEOUT
            if ferro_pace_look_due(&pace, now):
                if ferro_load_acquire32(&self.ranks[self.rank].closed):
                    return ST_CLOSED  # this rank closed the group from another thread
                for j in range(self.world_size):
                    if j != self.rank:
                        rc = self._look(j, w, target if first <= j < last else 0)
                        if rc != 0:
                            return rc
            if ferro_pace_signals_due(&pace, now) and signal_raised() != 0:
                return -1
            ferro_pace_rest(&pace, now)

    cdef int _ring(self, unsigned char* data, size_t* starts, size_t* lengths, size_t itemsize,
                   ferro_reduce_fn kernel, int dtype_code, bint reduce_scatter, bint all_gather, double divisor,
                   int gather_root, uint64_t fingerprint, WaitResult* w) except -1 nogil:
        cdef Parts p
        cdef int j
        p.data = data
        p.starts = starts
        p.lengths = lengths
        p.itemsize = itemsize
        p.kernel = kernel
        p.dtype_code = dtype_code
        p.divisor = divisor
        # Each buffer holds one cache-line-aligned part per rank, a whole number of elements.
        p.part = (self.buffer_bytes // <size_t>self.world_size) // ALIGN * ALIGN // itemsize * itemsize
        p.longest = 0
        for j in range(self.world_size):
            if lengths[j] > p.longest:
                p.longest = lengths[j]
        self._begin(KIND_COLLECTIVE_C, fingerprint)
        if reduce_scatter and all_gather:
            return self._ring_pipelined(&p, gather_root, w)
        return self._ring_one_way(&p, reduce_scatter, w)

    cdef int _ring_pipelined(self, Parts* p, int gather_root, WaitResult* w) except -1 nogil:
        """Reduce-scatter then all-gather, chunk by chunk, each wait placed after independent work.

        Per chunk k: wait for every rank's copy-in of k, reduce this rank's part
        and publish it; copy in chunk k+1 (into the next buffer); then wait for
        every rank's part of k and copy them out. The phases (and step values)
        are those of the plain loop, A_k then B_k; only the work between them
        moves, so each wait has the other ranks' matching work to hide behind.
        """
        cdef size_t chunks = (p.longest + p.part - 1) // p.part, k
        cdef int b, b_next = -1, rc
        cdef uint64_t copied_in, reduced
        b = self._take_buffer()
        rc = self._wait(self.free_after[b], -1, w)
        if rc != 0:
            return rc
        self._copy_in(p, 0, b)
        self._signal()
        copied_in = self.step
        for k in range(chunks):
            rc = self._wait(copied_in, -1, w)
            if rc != 0:
                return rc
            self._reduce_own(p, k, b, True)
            self._signal()
            reduced = self.step
            if k + 1 < chunks:
                b_next = self._take_buffer()
                rc = self._wait(self.free_after[b_next], -1, w)
                if rc != 0:
                    return rc
                self._copy_in(p, k + 1, b_next)
                self._signal()
                copied_in = self.step
            rc = self._wait(reduced, -1, w)
            if rc != 0:
                return rc
            if gather_root < 0 or gather_root == self.rank:
                self._copy_out(p, k, b)
            # Every read of this buffer is done before its reader's next step; a wait's target
            # never exceeds the waiter's own step, so the slowest rank can always go on.
            self.free_after[b] = self.step + 1
            b = b_next
        return 0

    cdef int _ring_one_way(self, Parts* p, bint reduce_scatter, WaitResult* w) except -1 nogil:
        """Reduce-scatter alone (each rank's part ends reduced in place) or all-gather alone."""
        cdef size_t chunks = (p.longest + p.part - 1) // p.part, k, offset
        cdef int b, rc, me = self.rank
        for k in range(chunks):
            offset = k * p.part
            b = self._take_buffer()
            rc = self._wait(self.free_after[b], -1, w)
            if rc != 0:
                return rc
            if reduce_scatter:
                self._copy_in(p, k, b)
            elif p.lengths[me] > offset:
                ferro_copy(self._part_of(me, b, me, p), p.data + p.starts[me] + offset,
                           _min(p.part, p.lengths[me] - offset))
                ferro_count_sent(self.stats, self.slot, _min(p.part, p.lengths[me] - offset))
            self._signal()
            rc = self._wait(self.step, -1, w)
            if rc != 0:
                return rc
            if reduce_scatter:
                self._reduce_own(p, k, b, False)
            else:
                self._copy_out(p, k, b)
            self.free_after[b] = self.step + 1
        return 0

    cdef inline unsigned char* _part_of(self, int owner, int b, int index, Parts* p) noexcept nogil:
        # Part ``index`` of buffer ``b`` in ``owner``'s slot.
        return self.slots[owner] + b * self._stride() + index * p.part

    cdef void _copy_in(self, Parts* p, size_t k, int b) noexcept nogil:
        # Publish chunk k of the parts the other ranks reduce.
        cdef size_t offset = k * p.part, length
        cdef int j
        for j in range(self.world_size):
            if j != self.rank and p.lengths[j] > offset:
                length = _min(p.part, p.lengths[j] - offset)
                ferro_copy(self._part_of(self.rank, b, j, p), p.data + p.starts[j] + offset, length)
                ferro_count_sent(self.stats, self.slot, length)

    cdef void _reduce_own(self, Parts* p, size_t k, int b, bint publish) noexcept nogil:
        # Reduce chunk k of this rank's part in place, reading it from every peer's slot;
        # with ``publish``, copy the result into this rank's slot for the others.
        cdef size_t offset = k * p.part, length, count
        cdef int j, me = self.rank
        cdef unsigned char* own
        if p.lengths[me] <= offset:
            return
        length = _min(p.part, p.lengths[me] - offset)
        count = length // p.itemsize
        own = p.data + p.starts[me] + offset
        for j in range(self.world_size):
            if j != me:
                p.kernel(own, self._part_of(j, b, me, p), count)
        ferro_count_received(self.stats, self.slot, length * <size_t>(self.world_size - 1))
        if p.divisor != 0.0:
            ferro_divide(own, count, p.dtype_code, p.divisor)
        if publish:
            ferro_copy(self._part_of(me, b, me, p), own, length)
            ferro_count_sent(self.stats, self.slot, length)

    cdef void _copy_out(self, Parts* p, size_t k, int b) noexcept nogil:
        # Copy chunk k of every other rank's part out of its slot.
        cdef size_t offset = k * p.part, length
        cdef int j
        for j in range(self.world_size):
            if j != self.rank and p.lengths[j] > offset:
                length = _min(p.part, p.lengths[j] - offset)
                ferro_copy(p.data + p.starts[j] + offset, self._part_of(j, b, j, p), length)
                ferro_count_received(self.stats, self.slot, length)

    cdef int _finish(self, int rc, WaitResult* w, str op, double timeout) except -1:
        # A call that stopped part-way leaves the arena unusable: the peers' steps no longer line up.
        cdef ferro_arena_ctl* peer_ctl
        cdef uint32_t n
        cdef Failure f
        if rc == 0:
            return 0
        where = f"rank {self.rank}: {op}"
        self.broken = _BROKEN_BY.get(rc, f"status {rc}").format(peer=w.peer)
        if rc == -1:
            return -1  # the pending KeyboardInterrupt (or whatever a handler raised) propagates
        if rc == W_ABORTED:
            peer_ctl = self.ctl[w.peer]
            n = ferro_load_acquire32(&peer_ctl.abort_len)
            raise abort_error((<char*>peer_ctl.notice)[:_min(n, FERRO_ARENA_NOTICE_BYTES)], w.peer, where)
        memset(&f, 0, sizeof(Failure))
        f.status = rc
        f.peer = w.peer
        f.kind = <uint32_t>self.kind
        f.fingerprint = self.fingerprint
        f.seq = self.call
        f.seen.kind = <uint32_t>w.seen_kind
        f.seen.fingerprint = w.seen_fingerprint
        f.seen.seq = self.call
        detail = ""
        if rc == ST_TIMEOUT:
            detail = (f" waiting for rank {w.peer} in shared memory (still in an earlier phase of the call, "
                      f"or in another call)")
        raise failure_error(&f, where, timeout, detail)


# Why the arena became unusable, by the outcome of the wait that stopped a call.
_BROKEN_BY = {
    -1: "an interrupt (Ctrl-C) in the middle of a collective",
    ST_CLOSED: "closing the group during a collective",
    ST_TIMEOUT: "a timeout in the middle of a collective",
    ST_PEER_CLOSED: "rank {peer} was lost",
    W_ABORTED: "rank {peer} gave up on a collective",
    ST_MISMATCH: "calls that differed between ranks",
}


cdef int64_t _deadline(double timeout):
    return -1 if timeout < 0 else monotonic_ns() + <int64_t>(timeout * 1e9)


cdef class DirectAllreduce(DirectCall):
    """The direct path of ``ferro.allreduce`` on a shared-memory group (see :class:`ferro._core.direct.DirectCall`).

    Calling it with ``(x, op, timeout)`` runs the allreduce and returns True, or
    returns False, having done nothing, when the full path must take the call.
    The arena chooses the algorithm by size (:meth:`Arena.allreduce`).

    Args:
        *args: :class:`~ferro._core.direct.DirectCall`'s; ``make_plan`` returns ``(dtype code,
            kernel code, fingerprint, divisor, itemsize)``.
        engine: The group's arena.
    """

    cdef Arena arena

    def __cinit__(self, *args, Arena engine=None, **kwargs):
        self.arena = engine

    def __call__(self, x, op, timeout) -> bool:
        cdef Py_buffer view
        cdef double seconds
        cdef tuple plan
        cdef uint64_t fingerprint
        if not self.may_take(x):
            return False
        try:
            PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        except (BufferError, ValueError, TypeError):
            return False  # read-only or not contiguous: the full path explains
        try:
            if view.len == 0 or not self.find_plan(x, op, &view):
                return False
            plan = self.plan  # into a local before anything can let another thread in to change it
            seconds = self.seconds(timeout)
            if not self.may_take(x):
                return False  # the plan or the timeout ran Python code, and another thread took the group
            fingerprint = plan[2]
            self.begin(fingerprint, <uint64_t>view.len, 0)
            try:
                if self.arena.world_size > 1:  # every op of one rank is the identity (MEAN divides by 1)
                    self.arena._allreduce(&view, plan[4], plan[0], plan[1], fingerprint, seconds, plan[3], -1)
            except BaseException as exc:
                self.end(False, self.arena.first_wait, self.arena.last_wait)
                self.fail(exc)
                raise
            self.end(True, self.arena.first_wait, self.arena.last_wait)
            return True
        finally:
            PyBuffer_Release(&view)
