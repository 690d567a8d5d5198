# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Framed messages between ranks on one host through single-producer rings in shared memory.

The segment holds one control block per rank (its pid and a closed flag) and
one byte ring per ordered pair of ranks. Frames are the transport's: a 32-byte
header (magic and version, kind, length, sequence number, fingerprint), then
the payload. A receiver validates each header before it copies a byte into
the caller's buffer; a refused header stays in the ring, unconsumed.

Waiting follows the schedule of ``pace.h`` (spin, yield, nap): every
millisecond of waiting checks that the peer is alive (its pid, its closed
flag), and every 100 ms checks for signals, so Ctrl-C interrupts a blocked
receive.
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.errno cimport ESRCH, errno
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memset

from ferro._core.posix cimport (
    FERRO_HEADER_SIZE,
    ferro_pace,
    ferro_pace_look_due,
    ferro_pace_progress,
    ferro_pace_rest,
    ferro_pace_signals_due,
    ferro_pace_start,
    ferro_pack_header,
    kill,
)
from ferro._core.state cimport GroupState, ferro_count_received, ferro_count_sent, ferro_stat_slot, ferro_stats
from ferro._core.status cimport (
    ST_ABORTED,
    ST_CLOSED,
    ST_MISMATCH,
    ST_OK,
    ST_PEER_CLOSED,
    ST_TIMEOUT,
    Failure,
    SeenHeader,
    describe_receive,
    failure_error,
)
from ferro._core.transport cimport acquire_buffer, check_header, monotonic_ns, signal_raised

from ferro._core.status import KIND_ABORT, MAX_ABORT_BYTES, abort_error
from ferro.errors import BackendClosedError, ConnectionBrokenError

cdef extern from "shm_ring.h" nogil:
    ctypedef struct ferro_ring_ctl:
        uint64_t head
        uint64_t tail
    ctypedef struct ferro_rank_ctl:
        int32_t pid
        uint32_t closed
    size_t ferro_ring_write(ferro_ring_ctl* ctl, unsigned char* data, size_t capacity, const unsigned char* src,
                            size_t length)
    size_t ferro_ring_available(ferro_ring_ctl* ctl)
    void ferro_ring_peek(ferro_ring_ctl* ctl, const unsigned char* data, size_t capacity, size_t skip,
                         unsigned char* dst, size_t length)
    void ferro_ring_consume(ferro_ring_ctl* ctl, size_t length)
    uint32_t ferro_load_acquire32(const uint32_t* p)
    void ferro_store_release32(uint32_t* p, uint32_t v)

cdef enum:
    HEADER_BYTES = 64         # the segment's own header
    RANK_BYTES = 64           # one rank's control block (a cache line)
    RING_CTL_BYTES = 128      # head and tail, each on its own cache line

SEGMENT_HEADER_BYTES = HEADER_BYTES
RANK_BLOCK_BYTES = RANK_BYTES
RING_CONTROL_BYTES = RING_CTL_BYTES



def segment_bytes(int world_size, size_t ring_bytes) -> int:
    """Bytes a segment for ``world_size`` ranks with ``ring_bytes`` rings needs."""
    return (SEGMENT_HEADER_BYTES + world_size * RANK_BLOCK_BYTES
            + world_size * world_size * (RING_CONTROL_BYTES + ring_bytes))


cdef struct Ring:
    ferro_ring_ctl* ctl
    unsigned char* data
    size_t capacity


cdef class Segment:
    """A mapped segment: rank control blocks and one ring per ordered pair of ranks.

    Args:
        mapping: A writable buffer over the whole segment (an ``mmap``); kept alive here.
        world_size: Ranks sharing it.
        ring_bytes: Capacity of each ring.
    """

    cdef object mapping
    cdef Py_buffer view
    cdef bint has_view
    cdef unsigned char* base
    cdef readonly int world_size
    cdef readonly size_t ring_bytes

    def __cinit__(self, mapping, int world_size, size_t ring_bytes):
        self.has_view = False
        if len(mapping) < segment_bytes(world_size, ring_bytes):
            raise ValueError("the mapping is smaller than the segment layout needs")
        PyObject_GetBuffer(mapping, &self.view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        self.has_view = True
        self.mapping = mapping
        self.base = <unsigned char*>self.view.buf
        self.world_size = world_size
        self.ring_bytes = ring_bytes

    def release(self) -> None:
        """Let go of the mapping (the caller then closes it)."""
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False
            self.base = NULL

    def __dealloc__(self):
        if self.has_view:
            PyBuffer_Release(&self.view)

    cdef ferro_rank_ctl* rank_ctl(self, int rank) noexcept:
        return <ferro_rank_ctl*>(self.base + HEADER_BYTES + rank * RANK_BYTES)

    cdef Ring ring(self, int src, int dst) noexcept:
        cdef Ring ring
        cdef size_t offset = (HEADER_BYTES + self.world_size * RANK_BYTES
                              + (src * self.world_size + dst) * (RING_CTL_BYTES + self.ring_bytes))
        ring.ctl = <ferro_ring_ctl*>(self.base + offset)
        ring.data = self.base + offset + RING_CTL_BYTES
        ring.capacity = self.ring_bytes
        return ring

    def register(self, int rank, int pid) -> None:
        """Record this rank's pid (for its peers' liveness checks)."""
        self.rank_ctl(rank).pid = pid

    def mark_closed(self, int rank) -> None:
        """Tell the peers this rank closed the group."""
        ferro_store_release32(&self.rank_ctl(rank).closed, 1)


cdef struct SendState:
    Ring ring
    unsigned char header[32]
    const unsigned char* payload
    size_t length
    size_t done
    int status


cdef struct RecvState:
    Ring ring
    unsigned char* buffer
    size_t capacity
    bint exact
    uint32_t kind
    uint64_t fingerprint
    uint64_t expected_seq
    int phase
    size_t length
    size_t done
    int status
    SeenHeader seen


cdef bint _send_step(SendState* s) noexcept nogil:
    """Write what fits; return whether anything was written."""
    cdef size_t total = FERRO_HEADER_SIZE + s.length, n, before = s.done
    while s.done < total:
        if s.done < FERRO_HEADER_SIZE:
            n = ferro_ring_write(s.ring.ctl, s.ring.data, s.ring.capacity, s.header + s.done,
                                 FERRO_HEADER_SIZE - s.done)
        else:
            n = ferro_ring_write(s.ring.ctl, s.ring.data, s.ring.capacity, s.payload + (s.done - FERRO_HEADER_SIZE),
                                 total - s.done)
        if n == 0:
            break
        s.done += n
    return s.done != before


cdef int _recv_step(RecvState* r, bint* progressed) noexcept nogil:
    """Read what has arrived; ST_OK when the frame is complete, -1 to keep waiting, else a refusal."""
    cdef unsigned char header[32]
    cdef size_t available, n
    cdef int rc
    if r.phase == 0:
        if ferro_ring_available(r.ring.ctl) < FERRO_HEADER_SIZE:
            return -1
        ferro_ring_peek(r.ring.ctl, r.ring.data, r.ring.capacity, 0, header, FERRO_HEADER_SIZE)
        rc = check_header(header, r.kind, r.fingerprint, r.expected_seq, r.capacity, r.exact, &r.seen)
        if rc != ST_OK:
            return rc  # refused: the header stays in the ring
        ferro_ring_consume(r.ring.ctl, FERRO_HEADER_SIZE)
        r.length = <size_t>r.seen.length
        r.phase = 1
        progressed[0] = True
    while r.done < r.length:
        available = ferro_ring_available(r.ring.ctl)
        if available == 0:
            return -1
        n = r.length - r.done
        if available < n:
            n = available
        ferro_ring_peek(r.ring.ctl, r.ring.data, r.ring.capacity, 0, r.buffer + r.done, n)
        ferro_ring_consume(r.ring.ctl, n)
        r.done += n
        progressed[0] = True
    r.phase = 2
    return ST_OK


cdef bint _peer_gone(ferro_rank_ctl* peer) noexcept nogil:
    if ferro_load_acquire32(&peer.closed):
        return True
    return peer.pid > 0 and kill(peer.pid, 0) != 0 and errno == ESRCH


cdef int _run(SendState* s, RecvState* r, ferro_rank_ctl* peer_out, ferro_rank_ctl* peer_in, ferro_rank_ctl* own,
              int64_t deadline, int64_t spin_ns, int64_t yield_ns) except -1 nogil:
    """Drive a send and/or a receive to completion, refusal, a lost peer, this rank's close, or the deadline."""
    cdef bint s_active = s != NULL, r_active = r != NULL, progressed
    cdef int rc
    cdef int64_t now
    cdef ferro_pace pace
    ferro_pace_start(&pace, monotonic_ns(), spin_ns, yield_ns)
    while s_active or r_active:
        progressed = False
        if s_active:
            if _send_step(s):
                progressed = True
            if s.done == FERRO_HEADER_SIZE + s.length:
                s.status = ST_OK
                s_active = False
        if r_active:
            rc = _recv_step(r, &progressed)
            if rc != -1:
                r.status = rc
                r_active = False
        if not (s_active or r_active):
            break
        now = monotonic_ns()
        if progressed:
            ferro_pace_progress(&pace, now)
            continue
        if deadline >= 0 and now >= deadline:
            if s_active:
                s.status = ST_TIMEOUT
            if r_active:
                r.status = ST_TIMEOUT
            break
        if ferro_pace_look_due(&pace, now):
            if ferro_load_acquire32(&own.closed):
                # This rank closed the group from another thread: stop waiting. A frame may be
                # half-done, but the channel is closed for good anyway.
                if s_active:
                    s.status = ST_CLOSED
                if r_active:
                    r.status = ST_CLOSED
                break
            # A closed peer may still have left data for us: only an empty ring means it is gone.
            if r_active and _peer_gone(peer_in) and ferro_ring_available(r.ring.ctl) == 0:
                r.status = ST_PEER_CLOSED
                r_active = False
                if s_active:
                    s.status = ST_PEER_CLOSED if _peer_gone(peer_out) else ST_ABORTED
                    s_active = False
                break
            if s_active and _peer_gone(peer_out):
                s.status = ST_PEER_CLOSED
                s_active = False
                break
        if ferro_pace_signals_due(&pace, now) and signal_raised() != 0:
            return -1
        ferro_pace_rest(&pace, now)
    return 0


cdef class Channel:
    """This rank's two rings with one peer: ``rank -> peer`` to send, ``peer -> rank`` to receive.

    Args:
        segment: The mapped segment.
        rank: This rank.
        peer: The other rank.
        spin_us: Microseconds to spin before yielding the CPU while waiting.
        group_state: The group's state, whose counters the channel adds its frames' bytes to.
        yield_us: Without a spin, microseconds a quiet wait keeps calling ``sched_yield()`` before it naps.
    """

    cdef Segment segment
    cdef readonly int rank
    cdef readonly int peer
    cdef uint64_t send_seq
    cdef uint64_t recv_seq
    cdef int64_t spin_ns
    cdef int64_t yield_ns
    cdef bint closed
    cdef object broken  # why the rings are unusable (a frame stopped half-way), or None
    cdef GroupState group_state  # whose counters ``stats`` points into (kept alive here)
    cdef ferro_stats* stats

    def __cinit__(self, Segment segment, int rank, int peer, double spin_us=50.0, GroupState group_state=None,
                  double yield_us=1000.0):
        self.segment = segment
        self.rank = rank
        self.peer = peer
        self.send_seq = 0
        self.recv_seq = 0
        self.spin_ns = <int64_t>(spin_us * 1000)
        self.yield_ns = <int64_t>(yield_us * 1000)
        self.closed = False
        self.broken = None
        self.group_state = group_state
        self.stats = &group_state.stats if group_state is not None else NULL

    def close(self) -> None:
        """Stop using the channel; later operations raise BackendClosedError."""
        self.closed = True

    cdef int _usable(self, str op) except -1:
        if self.closed or self.segment.base == NULL:
            raise BackendClosedError(f"rank {self.rank}: {op}: this process group was closed")
        if self.broken is not None:
            raise ConnectionBrokenError(
                f"rank {self.rank}: {op} with rank {self.peer}: the channel is unusable after {self.broken}")
        return 0

    def frame_waiting(self) -> bool:
        """Whether the peer has begun a frame to this rank, without blocking (a receive from any source asks).

        True too when the peer is gone: the receive that follows then says so.
        """
        self._usable("recv")
        cdef Ring ring = self.segment.ring(self.peer, self.rank)
        return ferro_ring_available(ring.ctl) > 0 or _peer_gone(self.segment.rank_ctl(self.peer))

    def send(self, buf, *, uint32_t kind, uint64_t fingerprint, double timeout, str op="send") -> None:
        """Send ``buf`` as one frame."""
        self.exchange(buf, None, kind=kind, fingerprint=fingerprint, timeout=timeout, op=op)

    def recv_into(self, buf, *, uint32_t kind, uint64_t fingerprint, double timeout, str op="recv") -> None:
        """Receive one frame into ``buf``, which it must fill exactly."""
        self.exchange(None, buf, kind=kind, fingerprint=fingerprint, timeout=timeout, op=op)

    def exchange(self, send_buf, recv_buf, *, uint32_t kind, uint64_t fingerprint, double timeout,
                 str op="sendrecv", Channel receive_from=None) -> None:
        """Send on this channel and/or receive (on ``receive_from``, default this channel), both at once."""
        cdef Channel source = receive_from if receive_from is not None else self
        cdef Py_buffer out_view, in_view
        cdef bint has_out = False, has_in = False
        cdef SendState s
        cdef RecvState r
        cdef ferro_rank_ctl* peer_out
        cdef ferro_rank_ctl* peer_in
        cdef ferro_rank_ctl* own
        cdef int64_t deadline = -1 if timeout < 0 else monotonic_ns() + <int64_t>(timeout * 1e9)
        self._usable(op)
        source._usable(op)
        try:
            if send_buf is not None:
                acquire_buffer(send_buf, &out_view, False, op)
                has_out = True
                memset(&s, 0, sizeof(SendState))
                s.ring = self.segment.ring(self.rank, self.peer)
                s.payload = <const unsigned char*>out_view.buf
                s.length = <size_t>out_view.len
                ferro_pack_header(s.header, kind, s.length, self.send_seq, fingerprint)
            if recv_buf is not None:
                acquire_buffer(recv_buf, &in_view, True, op)
                has_in = True
                memset(&r, 0, sizeof(RecvState))
                r.ring = source.segment.ring(source.peer, source.rank)
                r.buffer = <unsigned char*>in_view.buf
                r.capacity = <size_t>in_view.len
                r.exact = True
                r.kind = kind
                r.fingerprint = fingerprint
                r.expected_seq = source.recv_seq
            own = self.segment.rank_ctl(self.rank)
            peer_out = self.segment.rank_ctl(self.peer)
            peer_in = source.segment.rank_ctl(source.peer)
            with nogil:
                _run(&s if has_out else NULL, &r if has_in else NULL, peer_out, peer_in, own, deadline,
                     self.spin_ns, self.yield_ns)
        finally:
            if has_out:
                PyBuffer_Release(&out_view)
            if has_in:
                PyBuffer_Release(&in_view)
        if has_out and s.status == ST_OK:
            self.send_seq += 1
            ferro_count_sent(self.stats, ferro_stat_slot(kind, fingerprint), s.length)
        if has_in and r.status == ST_OK:
            ferro_count_received(self.stats, ferro_stat_slot(kind, fingerprint), r.length)
        elif has_out and 0 < s.done < FERRO_HEADER_SIZE + s.length:
            self.broken = "a send that stopped in the middle of a frame"
        if has_in and r.phase >= 1:
            source.recv_seq += 1  # the header was consumed: the frame is this receive's, whatever follows
            if r.status != ST_OK:
                source.broken = "a receive that stopped in the middle of a frame"
        if has_in and r.status != ST_OK:
            source._fail_recv(&r, op, timeout)
        if has_out and s.status != ST_OK:
            self._fail_send(&s, op, timeout)

    cdef int _fail_send(self, SendState* s, str op, double timeout) except -1:
        cdef Failure f
        memset(&f, 0, sizeof(Failure))
        f.status = s.status if s.status != ST_ABORTED else ST_PEER_CLOSED
        f.peer = self.peer
        f.mid_frame = 0 < s.done < FERRO_HEADER_SIZE + s.length
        detail = f": the shared-memory ring stayed full (is rank {self.peer} receiving?)" if f.status == ST_TIMEOUT else ""
        raise failure_error(&f, f"rank {self.rank}: {op} to rank {self.peer}", timeout, detail)

    cdef int _fail_recv(self, RecvState* r, str op, double timeout) except -1:
        cdef Failure f
        where = f"rank {self.rank}: {op} from rank {self.peer}"
        if r.status == ST_MISMATCH and r.seen.kind == KIND_ABORT and r.seen.length <= MAX_ABORT_BYTES:
            payload = bytearray(<size_t>r.seen.length)
            self.exchange(None, payload, kind=KIND_ABORT, fingerprint=r.seen.fingerprint, timeout=5.0, op="abort")
            raise abort_error(bytes(payload), self.peer, where)
        describe_receive(&f, r.status, self.peer, r.phase == 1, r.kind, r.fingerprint, r.capacity, r.exact,
                         self.recv_seq, &r.seen)
        detail = f" waiting for frame seq {self.recv_seq}" if r.status == ST_TIMEOUT else ""
        raise failure_error(&f, where, timeout, detail)
