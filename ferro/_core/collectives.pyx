# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Native collective algorithms over a full mesh of connections, run entirely without the GIL.

One call runs a whole collective: the buffers are taken and the connections'
locks acquired while holding the GIL, then every step -- frames on the wire and
reductions in C kernels -- runs under ``nogil``, and a failure becomes an
exception in :func:`ferro._core.transport.raise_failure`.

Frames are the transport's ``KIND_COLLECTIVE`` frames carrying the call's
fingerprint, so ranks that called different things refuse each other's data.
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.pythread cimport PyThread_release_lock
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from ferro._core.reduce cimport ferro_divide, ferro_reduce_fn, ferro_reduce_kernel
from ferro._core.state cimport ferro_stat_slot
from ferro._core.status cimport ST_OK
from ferro._core.transport cimport (
    ConnState,
    Connection,
    RecvOp,
    SendOp,
    monotonic_ns,
    raise_failure,
    run_ops,
)
from ferro._core.posix cimport FERRO_HEADER_SIZE, ferro_pack_header

from ferro.errors import InvalidBufferError

cdef enum:
    RING = 0
    RECURSIVE_DOUBLING = 1

ALGORITHM_RING = RING
ALGORITHM_RECURSIVE_DOUBLING = RECURSIVE_DOUBLING
# 1 MiB measured best on loopback (256 KiB: -25% at 64 MB; 4 MiB: -10%); fits in L2 for the reduce.
DEFAULT_SEGMENT_BYTES = 1024 * 1024

cdef uint32_t KIND_BARRIER = 2
cdef uint32_t KIND_COLLECTIVE = 3


cdef inline void _prepare_send(SendOp* s, ConnState* st, const unsigned char* data, size_t length,
                               uint64_t fingerprint, uint32_t kind=KIND_COLLECTIVE) noexcept nogil:
    memset(s, 0, sizeof(SendOp))
    s.conn = st
    s.payload = data
    s.length = length
    s.stat_slot = ferro_stat_slot(kind, fingerprint)
    ferro_pack_header(s.header, kind, length, st.send_seq, fingerprint)


cdef inline void _prepare_recv(RecvOp* r, ConnState* st, unsigned char* data, size_t length,
                               uint64_t fingerprint, uint32_t kind=KIND_COLLECTIVE) noexcept nogil:
    memset(r, 0, sizeof(RecvOp))
    r.conn = st
    r.buffer = data
    r.capacity = length
    r.exact = 1
    r.kind = kind
    r.fingerprint = fingerprint


cdef inline size_t _bound(size_t total, int parts, int i) noexcept nogil:
    # Chunk i starts here when total elements split as numpy.array_split does.
    cdef size_t base = total // parts, extra = total % parts
    return i * base + (<size_t>i if <size_t>i < extra else extra)


cdef enum:
    PHASE_REDUCE_SCATTER = 1
    PHASE_ALL_GATHER = 2


cdef int _exchange(SendOp* s, ConnState* to, const unsigned char* out, size_t out_len,
                   RecvOp* r, ConnState* frm, unsigned char* into, size_t in_len,
                   uint64_t fingerprint, int64_t deadline, uint32_t kind=KIND_COLLECTIVE) except -1 nogil:
    """One frame each way at once (either side may be absent: NULL connection). 0 or 1 on failure."""
    if to != NULL:
        _prepare_send(s, to, out, out_len, fingerprint, kind)
    if frm != NULL:
        _prepare_recv(r, frm, into, in_len, fingerprint, kind)
    run_ops(s if to != NULL else NULL, r if frm != NULL else NULL, deadline)
    if (to != NULL and s.status != ST_OK) or (frm != NULL and r.status != ST_OK):
        return 1
    return 0


cdef int _ring(ConnState** conns, int rank, int n, unsigned char* buf, const size_t* bounds, size_t itemsize,
               ferro_reduce_fn kernel, unsigned char* scratch, size_t segment, uint64_t fingerprint,
               int64_t deadline, SendOp* s, RecvOp* r, int phases, int dtype=-1, double divisor=0) except -1 nogil:
    """Segmented ring over chunks ``[bounds[i], bounds[i+1])`` (in elements) of ``buf``.

    Reduce-scatter (``PHASE_REDUCE_SCATTER``) leaves chunk ``rank`` fully reduced
    here, each segment reduced as soon as it lands; all-gather
    (``PHASE_ALL_GATHER``) then passes every rank's chunk around. Both make an allreduce.
    """
    cdef ConnState* nxt = conns[(rank + 1) % n]
    cdef ConnState* prv = conns[(rank - 1 + n) % n]
    cdef int step, send_idx, recv_idx
    cdef size_t send_off, send_len, recv_off, recv_len, pos, a, b
    cdef int phase
    for phase in range(2):
        if phase == 1 and divisor != 0:
            # MEAN: this rank scales only the chunk it completed (1/n of the data, still in
            # cache); the all-gather then spreads the averaged values, identical everywhere.
            ferro_divide(buf + bounds[rank] * itemsize, bounds[rank + 1] - bounds[rank], dtype, divisor)
        if not phases & (PHASE_REDUCE_SCATTER if phase == 0 else PHASE_ALL_GATHER):
            continue
        for step in range(n - 1):
            if phase == 0:  # reduce-scatter: afterwards chunk `rank` is complete here
                send_idx = (rank - step - 1 + 2 * n) % n
                recv_idx = (rank - step - 2 + 2 * n) % n
            else:           # all-gather: pass the complete chunks around
                send_idx = (rank - step + 2 * n) % n
                recv_idx = (rank - step - 1 + 2 * n) % n
            send_off = bounds[send_idx] * itemsize
            send_len = bounds[send_idx + 1] * itemsize - send_off
            recv_off = bounds[recv_idx] * itemsize
            recv_len = bounds[recv_idx + 1] * itemsize - recv_off
            pos = 0
            while pos < send_len or pos < recv_len:
                a = send_len - pos if pos < send_len else 0
                b = recv_len - pos if pos < recv_len else 0
                if a > segment:
                    a = segment
                if b > segment:
                    b = segment
                if phase == 0:
                    if _exchange(s, nxt if a else NULL, buf + send_off + pos, a,
                                 r, prv if b else NULL, scratch, b, fingerprint, deadline):
                        return 1
                    if b:
                        kernel(buf + recv_off + pos, scratch, b // itemsize)
                else:
                    if _exchange(s, nxt if a else NULL, buf + send_off + pos, a,
                                 r, prv if b else NULL, buf + recv_off + pos, b, fingerprint, deadline):
                        return 1
                pos += segment
    return 0


cdef int _recursive_doubling(ConnState** conns, int rank, int n, unsigned char* buf, size_t nbytes,
                             size_t itemsize, ferro_reduce_fn kernel, unsigned char* scratch, uint64_t fingerprint,
                             int64_t deadline, SendOp* s, RecvOp* r) except -1 nogil:
    """log2(n) whole-message exchanges; ranks beyond a power of two fold into a partner first."""
    cdef int power = 1, extra, virtual, mask, partner_virtual, partner
    while power * 2 <= n:
        power *= 2
    extra = n - power
    if rank < 2 * extra:
        if rank % 2 == 0:
            if _exchange(s, conns[rank + 1], buf, nbytes, r, NULL, NULL, 0, fingerprint, deadline):
                return 1
            return _exchange(s, NULL, NULL, 0, r, conns[rank + 1], buf, nbytes, fingerprint, deadline)
        if _exchange(s, NULL, NULL, 0, r, conns[rank - 1], scratch, nbytes, fingerprint, deadline):
            return 1
        kernel(buf, scratch, nbytes // itemsize)
        virtual = rank // 2
    else:
        virtual = rank - extra
    mask = 1
    while mask < power:
        partner_virtual = virtual ^ mask
        partner = partner_virtual * 2 + 1 if partner_virtual < extra else partner_virtual + extra
        if _exchange(s, conns[partner], buf, nbytes, r, conns[partner], scratch, nbytes, fingerprint, deadline):
            return 1
        kernel(buf, scratch, nbytes // itemsize)
        mask <<= 1
    if rank < 2 * extra:
        return _exchange(s, conns[rank - 1], buf, nbytes, r, NULL, NULL, 0, fingerprint, deadline)
    return 0


cdef class _Call:
    """What one native collective holds while it runs: the buffer, the peers' states and their locks."""

    cdef Py_buffer view       # the writable buffer the collective works in
    cdef bint has_view
    cdef Py_buffer input      # a read-only input, for collectives with separate in and out buffers
    cdef bint has_input
    cdef tuple connections
    cdef int rank
    cdef int n
    cdef ConnState** states
    cdef int locked
    cdef unsigned char* scratch
    cdef size_t* bounds

    def __cinit__(self):
        self.has_view = False
        self.has_input = False
        self.states = NULL
        self.scratch = NULL
        self.bounds = NULL
        self.locked = 0

    cdef int take(self, tuple connections, int rank, buf, double timeout, str op) except -1:
        cdef int i
        cdef Connection conn
        self.connections = connections
        self.rank = rank
        self.n = len(connections)
        PyObject_GetBuffer(buf, &self.view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        self.has_view = True
        self.states = <ConnState**>malloc(self.n * sizeof(ConnState*))
        if self.states == NULL:
            raise MemoryError()
        for i in range(self.n):
            self.states[i] = NULL
            if i != rank:
                conn = connections[i]
                conn.check_usable(op)
                self.states[i] = &conn.st
        # Every peer's locks in rank order (sends, then receives): one fixed order,
        # so no other thread's operation can deadlock against this one.
        for i in range(self.n):
            if i != rank:
                conn = connections[i]
                conn.lock(conn.send_lock, timeout, op)
                self.locked += 1
        for i in range(self.n):
            if i != rank:
                conn = connections[i]
                conn.lock(conn.recv_lock, timeout, op)
                self.locked += 1
        return 0

    cdef int take_input(self, buf) except -1:
        PyObject_GetBuffer(buf, &self.input, PyBUF_C_CONTIGUOUS)
        self.has_input = True
        return 0

    cdef int set_bounds(self, object offsets) except -1:
        cdef int i
        self.bounds = <size_t*>malloc((self.n + 1) * sizeof(size_t))
        if self.bounds == NULL:
            raise MemoryError()
        for i in range(self.n + 1):
            self.bounds[i] = offsets[i]
        return 0

    cdef int make_scratch(self, size_t nbytes) except -1:
        self.scratch = <unsigned char*>malloc(nbytes if nbytes else 1)
        if self.scratch == NULL:
            raise MemoryError()
        return 0

    cdef void release(self):
        cdef int i, released = 0
        cdef Connection conn
        for i in range(self.n):  # in the order taken: send locks, then receive locks
            if i != self.rank and released < self.locked:
                conn = self.connections[i]
                PyThread_release_lock(conn.send_lock)
                released += 1
        for i in range(self.n):
            if i != self.rank and released < self.locked:
                conn = self.connections[i]
                PyThread_release_lock(conn.recv_lock)
                released += 1
        self.locked = 0
        free(self.scratch)
        free(self.states)
        free(self.bounds)
        self.scratch = NULL
        self.states = NULL
        self.bounds = NULL
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False
        if self.has_input:
            PyBuffer_Release(&self.input)
            self.has_input = False


cdef size_t _segment_size(Py_ssize_t segment_bytes, Py_ssize_t itemsize) except 0:
    if segment_bytes < itemsize or itemsize <= 0:
        raise ValueError("segment_bytes must hold at least one element")
    return <size_t>(segment_bytes - segment_bytes % itemsize)


def allreduce(tuple connections, int rank, buf, int dtype, int op, Py_ssize_t itemsize, uint64_t fingerprint,
              double timeout, int algorithm, Py_ssize_t segment_bytes=DEFAULT_SEGMENT_BYTES,
              double divisor=0) -> None:
    """Allreduce ``buf`` in place over ``connections`` (indexed by rank; None at ``rank``).

    Args:
        connections: One :class:`Connection` per peer rank, ``None`` for this rank.
        rank: This rank.
        buf: Writable C-contiguous buffer of ``itemsize``-byte elements.
        dtype: ``FERRO_*`` dtype code.
        op: ``FERRO_*`` op code (MEAN's division is the caller's).
        itemsize: Bytes per element.
        fingerprint: The call's fingerprint, carried by every frame.
        timeout: Seconds for the whole collective.
        algorithm: ``ALGORITHM_RING`` or ``ALGORITHM_RECURSIVE_DOUBLING``.
        segment_bytes: Ring segment size; every rank must use the same.
        divisor: When not 0, divide the result by it (MEAN) inside the collective:
            the ring divides each chunk once, between its two phases.

    Raises:
        The transport's errors (PeerLostError, DistributedTimeoutError,
        CollectiveMismatchError, ...), and InvalidBufferError for a bad buffer.
    """
    cdef _Call call = _Call()
    cdef SendOp s
    cdef RecvOp r
    cdef ferro_reduce_fn kernel = ferro_reduce_kernel(dtype, op)
    cdef size_t segment = _segment_size(segment_bytes, itemsize), count, nbytes
    cdef int64_t deadline
    cdef int rc = 0, n = len(connections)
    if kernel == NULL:
        raise ValueError(f"no reduction kernel for dtype code {dtype} and op code {op}")
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    try:
        call.take(connections, rank, buf, timeout, "allreduce")
        nbytes = <size_t>call.view.len
        if nbytes % itemsize:
            raise InvalidBufferError(f"allreduce: {nbytes} bytes is not a whole number of {itemsize}-byte elements")
        count = nbytes // itemsize
        if n < 2 or count == 0:
            return
        if algorithm == RECURSIVE_DOUBLING:
            call.make_scratch(nbytes)
        else:
            call.set_bounds([_bound(count, n, i) for i in range(n + 1)])
            call.make_scratch(min(segment, nbytes))
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            if algorithm == RECURSIVE_DOUBLING:
                rc = _recursive_doubling(call.states, rank, n, <unsigned char*>call.view.buf, nbytes, itemsize,
                                         kernel, call.scratch, fingerprint, deadline, &s, &r)
                if rc == 0 and divisor != 0:
                    ferro_divide(call.view.buf, count, dtype, divisor)
            else:
                rc = _ring(call.states, rank, n, <unsigned char*>call.view.buf, call.bounds, itemsize, kernel,
                           call.scratch, segment, fingerprint, deadline, &s, &r,
                           PHASE_REDUCE_SCATTER | PHASE_ALL_GATHER, dtype, divisor)
    finally:
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "allreduce", timeout)


def ring(tuple connections, int rank, buf, object bounds, int dtype, int op, Py_ssize_t itemsize,
         uint64_t fingerprint, double timeout, bint reduce_scatter, bint all_gather,
         Py_ssize_t segment_bytes=DEFAULT_SEGMENT_BYTES, double divisor=0) -> None:
    """Run a ring reduce-scatter and/or all-gather in place on ``buf``.

    Args:
        connections: As for :func:`allreduce`.
        rank: This rank.
        buf: Writable C-contiguous buffer.
        bounds: ``n + 1`` element offsets: chunk ``i`` is ``[bounds[i], bounds[i+1])``.
        dtype: ``FERRO_*`` dtype code (any value when only gathering).
        op: ``FERRO_*`` op code (any value when only gathering).
        itemsize: Bytes per element.
        fingerprint: The call's fingerprint.
        timeout: Seconds for the whole collective.
        reduce_scatter: Reduce so that chunk ``rank`` ends complete here.
        all_gather: Then (or only) circulate every rank's chunk ``i`` to all.
        segment_bytes: Segment size; every rank must use the same.
        divisor: When not 0 (MEAN), divide chunk ``rank`` by it once it is reduced.
    """
    cdef _Call call = _Call()
    cdef SendOp s
    cdef RecvOp r
    cdef ferro_reduce_fn kernel = NULL
    cdef size_t segment = _segment_size(segment_bytes, itemsize), largest = 0
    cdef int64_t deadline
    cdef int rc = 0, n = len(connections), i
    cdef int phases = (PHASE_REDUCE_SCATTER if reduce_scatter else 0) | (PHASE_ALL_GATHER if all_gather else 0)
    if reduce_scatter:
        kernel = ferro_reduce_kernel(dtype, op)
        if kernel == NULL:
            raise ValueError(f"no reduction kernel for dtype code {dtype} and op code {op}")
    if len(bounds) != n + 1:
        raise ValueError(f"ring: {n + 1} bounds needed, got {len(bounds)}")
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    try:
        call.take(connections, rank, buf, timeout, "ring")
        if n < 2 or phases == 0:
            return
        call.set_bounds(bounds)
        if call.bounds[n] * itemsize > <size_t>call.view.len:
            raise InvalidBufferError(f"ring: bounds reach element {call.bounds[n]} of a {call.view.len}-byte buffer")
        for i in range(n):
            largest = max(largest, (call.bounds[i + 1] - call.bounds[i]) * itemsize)
        call.make_scratch(min(segment, largest))
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            rc = _ring(call.states, rank, n, <unsigned char*>call.view.buf, call.bounds, itemsize, kernel,
                       call.scratch, segment, fingerprint, deadline, &s, &r, phases, dtype, divisor)
    finally:
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "ring", timeout)


cdef int _broadcast_tree(ConnState** conns, int rank, int n, int root, unsigned char* buf, size_t nbytes,
                         uint64_t fingerprint, int64_t deadline, SendOp* s, RecvOp* r) except -1 nogil:
    """Binomial tree: receive once from the parent, then send to each child; log2(n) rounds."""
    cdef int virtual = (rank - root + n) % n, mask = 1
    while mask < n:
        if virtual & mask:
            if _exchange(s, NULL, NULL, 0, r, conns[(virtual - mask + root) % n], buf, nbytes, fingerprint, deadline):
                return 1
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if virtual + mask < n:
            if _exchange(s, conns[(virtual + mask + root) % n], buf, nbytes, r, NULL, NULL, 0, fingerprint, deadline):
                return 1
        mask >>= 1
    return 0


cdef int _broadcast_chain(ConnState** conns, int rank, int n, int root, unsigned char* buf, size_t nbytes,
                          size_t segment, uint64_t fingerprint, int64_t deadline, SendOp* s,
                          RecvOp* r) except -1 nogil:
    """Pipelined chain root -> root+1 -> ...: forward segment i-1 while segment i arrives."""
    cdef int virtual = (rank - root + n) % n
    cdef ConnState* nxt = conns[(rank + 1) % n] if virtual != n - 1 else NULL
    cdef ConnState* prv = conns[(rank - 1 + n) % n] if virtual != 0 else NULL
    cdef size_t count = (nbytes + segment - 1) // segment, i, start, length, prev_start = 0, prev_length = 0
    cdef ConnState* to
    for i in range(count + 1):
        start = i * segment
        length = min(segment, nbytes - start) if i < count else 0
        if virtual == 0:
            # The root sends segment i; it has nothing to receive.
            if i < count and _exchange(s, nxt, buf + start, length, r, NULL, NULL, 0, fingerprint, deadline):
                return 1
            continue
        # Others forward segment i-1 while segment i arrives.
        to = nxt if i > 0 else NULL
        if _exchange(s, to, buf + prev_start, prev_length, r, prv if i < count else NULL, buf + start, length,
                     fingerprint, deadline):
            return 1
        prev_start, prev_length = start, length
    return 0


def broadcast(tuple connections, int rank, buf, int root, uint64_t fingerprint, double timeout, bint chain,
              Py_ssize_t segment_bytes=DEFAULT_SEGMENT_BYTES) -> None:
    """Broadcast ``buf`` (bytes) from ``root`` in place: binomial tree, or pipelined chain when ``chain``."""
    cdef _Call call = _Call()
    cdef SendOp s
    cdef RecvOp r
    cdef int rc = 0, n = len(connections)
    cdef int64_t deadline
    cdef size_t segment = _segment_size(segment_bytes, 1)
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    try:
        call.take(connections, rank, buf, timeout, "broadcast")
        if n < 2 or call.view.len == 0:
            return
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            if chain:
                rc = _broadcast_chain(call.states, rank, n, root, <unsigned char*>call.view.buf, <size_t>call.view.len,
                                      segment, fingerprint, deadline, &s, &r)
            else:
                rc = _broadcast_tree(call.states, rank, n, root, <unsigned char*>call.view.buf, <size_t>call.view.len,
                                     fingerprint, deadline, &s, &r)
    finally:
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "broadcast", timeout)


def all_to_all(tuple connections, int rank, send_buf, object send_offsets, recv_buf, object recv_offsets,
               uint64_t fingerprint, double timeout) -> None:
    """Pairwise exchange: bytes ``[send_offsets[j], send_offsets[j+1])`` go to rank ``j``.

    In step ``k`` rank ``r`` sends to ``r+k`` and receives from ``r-k``, both at once.
    ``recv_offsets`` say where each source's block lands in ``recv_buf``.
    """
    cdef _Call call = _Call()
    cdef SendOp s
    cdef RecvOp r
    cdef int rc = 0, n = len(connections), step, dst, src, i
    cdef int64_t deadline
    cdef size_t* send_at = NULL
    cdef size_t* recv_at = NULL
    cdef const unsigned char* out
    cdef unsigned char* into
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    if len(send_offsets) != n + 1 or len(recv_offsets) != n + 1:
        raise ValueError(f"all_to_all: {n + 1} offsets needed on each side")
    try:
        call.take(connections, rank, recv_buf, timeout, "all_to_all")
        call.take_input(send_buf)
        send_at = <size_t*>malloc((n + 1) * sizeof(size_t))
        recv_at = <size_t*>malloc((n + 1) * sizeof(size_t))
        if send_at == NULL or recv_at == NULL:
            raise MemoryError()
        for i in range(n + 1):
            send_at[i] = send_offsets[i]
            recv_at[i] = recv_offsets[i]
        if send_at[n] > <size_t>call.input.len or recv_at[n] > <size_t>call.view.len:
            raise InvalidBufferError("all_to_all: offsets reach past the buffers")
        if send_at[rank + 1] - send_at[rank] != recv_at[rank + 1] - recv_at[rank]:
            raise InvalidBufferError("all_to_all: the block a rank sends itself must match the one it receives")
        out = <const unsigned char*>call.input.buf
        into = <unsigned char*>call.view.buf
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            memcpy(into + recv_at[rank], out + send_at[rank], send_at[rank + 1] - send_at[rank])
            for step in range(1, n):
                dst = (rank + step) % n
                src = (rank - step + n) % n
                if _exchange(&s, call.states[dst], out + send_at[dst], send_at[dst + 1] - send_at[dst],
                             &r, call.states[src], into + recv_at[src], recv_at[src + 1] - recv_at[src],
                             fingerprint, deadline):
                    rc = 1
                    break
    finally:
        free(send_at)
        free(recv_at)
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "all_to_all", timeout)


def barrier(tuple connections, int rank, double timeout) -> None:
    """Dissemination barrier: in round k signal rank+2^k and wait for rank-2^k (empty barrier frames)."""
    cdef _Call call = _Call()
    cdef SendOp s
    cdef RecvOp r
    cdef int rc = 0, n = len(connections), distance = 1
    cdef int64_t deadline
    cdef bytearray nothing = bytearray(1)
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    try:
        call.take(connections, rank, nothing, timeout, "barrier")
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            while distance < n:
                if _exchange(&s, call.states[(rank + distance) % n], NULL, 0,
                             &r, call.states[(rank - distance + n) % n], NULL, 0, 0, deadline, KIND_BARRIER):
                    rc = 1
                    break
                distance *= 2
    finally:
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "barrier", timeout)
