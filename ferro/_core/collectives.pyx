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
from libc.string cimport memset

from ferro._core.reduce cimport ferro_reduce_fn, ferro_reduce_kernel
from ferro._core.transport cimport (
    ST_OK,
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

cdef uint32_t KIND_COLLECTIVE = 3


cdef inline void _prepare_send(SendOp* s, ConnState* st, const unsigned char* data, size_t length,
                               uint64_t fingerprint) noexcept nogil:
    memset(s, 0, sizeof(SendOp))
    s.conn = st
    s.payload = data
    s.length = length
    ferro_pack_header(s.header, KIND_COLLECTIVE, length, st.send_seq, fingerprint)


cdef inline void _prepare_recv(RecvOp* r, ConnState* st, unsigned char* data, size_t length,
                               uint64_t fingerprint) noexcept nogil:
    memset(r, 0, sizeof(RecvOp))
    r.conn = st
    r.buffer = data
    r.capacity = length
    r.exact = 1
    r.kind = KIND_COLLECTIVE
    r.fingerprint = fingerprint


cdef inline size_t _bound(size_t total, int parts, int i) noexcept nogil:
    # Chunk i starts here when total elements split as numpy.array_split does.
    cdef size_t base = total // parts, extra = total % parts
    return i * base + (<size_t>i if <size_t>i < extra else extra)


cdef int _exchange(SendOp* s, ConnState* to, const unsigned char* out, size_t out_len,
                   RecvOp* r, ConnState* frm, unsigned char* into, size_t in_len,
                   uint64_t fingerprint, int64_t deadline) except -1 nogil:
    """One frame each way at once (either side may be absent: NULL connection). 0 or 1 on failure."""
    if to != NULL:
        _prepare_send(s, to, out, out_len, fingerprint)
    if frm != NULL:
        _prepare_recv(r, frm, into, in_len, fingerprint)
    run_ops(s if to != NULL else NULL, r if frm != NULL else NULL, deadline)
    if (to != NULL and s.status != ST_OK) or (frm != NULL and r.status != ST_OK):
        return 1
    return 0


cdef int _ring_allreduce(ConnState** conns, int rank, int n, unsigned char* buf, size_t count, size_t itemsize,
                         ferro_reduce_fn kernel, unsigned char* scratch, size_t segment, uint64_t fingerprint,
                         int64_t deadline, SendOp* s, RecvOp* r) except -1 nogil:
    """Segmented ring: reduce-scatter then all-gather; each segment is reduced as soon as it lands."""
    cdef ConnState* nxt = conns[(rank + 1) % n]
    cdef ConnState* prv = conns[(rank - 1 + n) % n]
    cdef int step, send_idx, recv_idx
    cdef size_t send_off, send_len, recv_off, recv_len, pos, a, b
    cdef int phase
    for phase in range(2):
        for step in range(n - 1):
            if phase == 0:  # reduce-scatter: afterwards chunk `rank` is complete here
                send_idx = (rank - step - 1 + 2 * n) % n
                recv_idx = (rank - step - 2 + 2 * n) % n
            else:           # all-gather: pass the complete chunks around
                send_idx = (rank - step + 2 * n) % n
                recv_idx = (rank - step - 1 + 2 * n) % n
            send_off = _bound(count, n, send_idx) * itemsize
            send_len = _bound(count, n, send_idx + 1) * itemsize - send_off
            recv_off = _bound(count, n, recv_idx) * itemsize
            recv_len = _bound(count, n, recv_idx + 1) * itemsize - recv_off
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


def allreduce(tuple connections, int rank, buf, int dtype, int op, Py_ssize_t itemsize, uint64_t fingerprint,
              double timeout, int algorithm, Py_ssize_t segment_bytes=DEFAULT_SEGMENT_BYTES) -> None:
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

    Raises:
        The transport's errors (PeerLostError, DistributedTimeoutError,
        CollectiveMismatchError, ...), and InvalidBufferError for a bad buffer.
    """
    cdef int n = len(connections)
    cdef Py_buffer view
    cdef SendOp s
    cdef RecvOp r
    cdef ConnState** states = NULL
    cdef unsigned char* scratch = NULL
    cdef ferro_reduce_fn kernel = ferro_reduce_kernel(dtype, op)
    cdef size_t count, segment, scratch_bytes
    cdef int64_t deadline
    cdef int rc = 0, locked = 0, i
    cdef Connection conn
    if kernel == NULL:
        raise ValueError(f"no reduction kernel for dtype code {dtype} and op code {op}")
    if segment_bytes < itemsize:
        raise ValueError("segment_bytes must hold at least one element")
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    PyObject_GetBuffer(buf, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
    try:
        if view.len % itemsize:
            raise InvalidBufferError(f"allreduce: {view.len} bytes is not a whole number of {itemsize}-byte elements")
        count = <size_t>(view.len // itemsize)
        segment = <size_t>(segment_bytes - segment_bytes % itemsize)
        if n < 2 or count == 0:
            return
        states = <ConnState**>malloc(n * sizeof(ConnState*))
        if states == NULL:
            raise MemoryError()
        for i in range(n):
            states[i] = NULL
            if i != rank:
                conn = connections[i]
                conn.check_usable("allreduce")
                states[i] = &conn.st
        # Take every peer's locks in rank order (sends, then receives): one fixed
        # order, so no other thread's operation can deadlock against this one.
        for i in range(n):
            if i != rank:
                conn = connections[i]
                conn.lock(conn.send_lock, timeout, "allreduce")
                locked += 1
        for i in range(n):
            if i != rank:
                conn = connections[i]
                conn.lock(conn.recv_lock, timeout, "allreduce")
                locked += 1
        scratch_bytes = <size_t>view.len if algorithm == RECURSIVE_DOUBLING else min(segment, <size_t>view.len)
        scratch = <unsigned char*>malloc(scratch_bytes if scratch_bytes else 1)
        if scratch == NULL:
            raise MemoryError()
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            if algorithm == RECURSIVE_DOUBLING:
                rc = _recursive_doubling(states, rank, n, <unsigned char*>view.buf, <size_t>view.len, itemsize,
                                         kernel, scratch, fingerprint, deadline, &s, &r)
            else:
                rc = _ring_allreduce(states, rank, n, <unsigned char*>view.buf, count, itemsize, kernel, scratch,
                                     segment, fingerprint, deadline, &s, &r)
    finally:
        _unlock(connections, rank, locked)
        free(scratch)
        free(states)
        PyBuffer_Release(&view)
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "allreduce", timeout)


cdef void _unlock(tuple connections, int rank, int locked):
    cdef int n = len(connections), i, released = 0
    cdef Connection conn
    # Release in the order taken: all send locks, then the receive locks.
    for i in range(n):
        if i != rank and released < locked:
            conn = connections[i]
            PyThread_release_lock(conn.send_lock)
            released += 1
    for i in range(n):
        if i != rank and released < locked:
            conn = connections[i]
            PyThread_release_lock(conn.recv_lock)
            released += 1
