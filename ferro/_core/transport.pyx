# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Framed messages over connected stream sockets, with the GIL released.

Each operation runs in three phases (the mpi4py pattern): take the caller's
buffers while holding the GIL, run one C progress loop under ``nogil``, then turn
a status code into an exception in exactly one place (``raise_failure``).

The progress loop drives at most one outgoing and one incoming frame at a time
on non-blocking system calls: it spins for a bounded time while a socket is
quiet (a reply on loopback usually arrives within microseconds), then naps
20 us between attempts for a millisecond, then sleeps in ``poll`` in slices,
checking for signals between slices so that Ctrl-C interrupts a blocked
receive. Ranks that outnumber the cores do not spin: they yield the CPU
between attempts for a while (a peer that shares this core runs at once)
before they sleep.

A receiver validates each header before it writes a byte of the caller's
buffer. A header it refuses (wrong kind, fingerprint or size) stays staged and
unconsumed, so the caller can retry with the right buffer and nothing is lost.
A failure in the middle of a frame leaves the byte stream unusable; the
connection is then marked broken and every later call says so.
"""

from cpython.pythread cimport (
    NOWAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
    PyThread_type_lock,
)
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.errno cimport EAGAIN, ECONNRESET, EINTR, EPIPE, ETIMEDOUT, errno
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memmove, memset

from ferro._core.posix cimport (
    CLOCK_MONOTONIC,
    EWOULDBLOCK,
    FERRO_FRAME_MAGIC,
    FERRO_HEADER_SIZE,
    FERRO_PROTOCOL_VERSION,
    MSG_DONTWAIT,
    MSG_NOSIGNAL,
    POLLIN,
    POLLOUT,
    PY_LOCK_ACQUIRED,
    PyThread_acquire_lock_timed,
    clock_gettime,
    nanosleep,
    sched_yield,
    ferro_get_u32,
    ferro_get_u64,
    ferro_pack_header,
    iovec,
    msghdr,
    poll,
    pollfd,
    recv,
    sendmsg,
    ssize_t,
    timespec,
)

from ferro._core.state cimport GroupState, ferro_count_received, ferro_count_sent, ferro_stat_slot
from ferro._core.status cimport (
    ST_ABORTED,
    ST_AGAIN,
    ST_BAD_MAGIC,
    ST_BAD_SEQ,
    ST_BROKEN,
    ST_CLOSED,
    ST_INTR,
    ST_MISMATCH,
    ST_OK,
    ST_OS_ERROR,
    ST_PEER_CLOSED,
    ST_SIZE_MISMATCH,
    ST_TIMEOUT,
    ST_TOO_LARGE,
    Failure,
    describe_receive,
    failure_error,
)

from ferro._core.status import (  # re-exported: the frame kinds and abort notices belong to the wire format
    ABORT_MISMATCH,
    ABORT_OTHER,
    ABORT_PEER_LOST,
    ABORT_TIMEOUT,
    KIND_ABORT,
    KIND_BARRIER,
    KIND_COLLECTIVE,
    KIND_DATA,
    MAX_ABORT_BYTES,
    abort_error,
    abort_payload,
    broken_by,
    kind_name,
    mismatch_error,
    size_error,
)
from ferro.errors import BackendClosedError, DistributedTimeoutError, InvalidBufferError

import select
import time

cdef extern from * nogil:
    """
    #include <sys/ioctl.h>
    #ifdef __linux__
    #include <linux/sockios.h>
    #endif
    /* Bytes a TCP socket holds that its peer has not acknowledged (sent or not); 0 where the system cannot say. */
    static inline size_t ferro_unacked_bytes(int fd) {
    #ifdef SIOCOUTQ
        int queued = 0;
        if (ioctl(fd, SIOCOUTQ, &queued) == 0 && queued > 0)
            return (size_t)queued;
    #endif
        return 0;
    }
    """
    size_t ferro_unacked_bytes(int fd)


cdef extern from "Python.h":
    # Declared without Cython's ``except -1`` so the loop can decide what to
    # clean up before it lets the pending KeyboardInterrupt propagate.
    int PyErr_CheckSignals_noexcept "PyErr_CheckSignals" ()


cdef int signal_raised() noexcept with gil:
    # Runs the Python-level signal handlers; nonzero when one raised (the
    # exception stays set for run_ops' caller to propagate).
    return PyErr_CheckSignals_noexcept()

HEADER_SIZE = FERRO_HEADER_SIZE
PROTOCOL_VERSION = FERRO_PROTOCOL_VERSION

# Longest sleep in poll before the loop looks at the deadline and at signals again.
cdef int POLL_SLICE_MS = 100
# Ranks that outnumber the cores (spin_ns == 0) keep trying between sched_yield()s for the connection's
# yield_ns (the backend's default_yield_us: 200 us, none past four ranks a core) before they sleep in poll.
# A rank with a core of its own never yields: beside compute threads (a training job's normal state) a
# yield hands the core to one of them for a whole time slice. Measured with 2 ranks and one or two
# matmul threads per rank: a 50 us spin, a 200 us yield window and poll averaged 32-519 us per call;
# the spin straight to poll 14-23 us (Open MPI over TCP 75-201).
# A rank with a core of its own naps 20 us between attempts for a quiet millisecond after its spin,
# then sleeps in poll. Under load a wake-up from poll took 70-270 us here (gVisor's netstack must
# run first), a nap 20-100 us. Measured (2 ranks, 4 B allreduce, 4 sittings, median): one matmul
# thread per rank, 15 us per call with naps against 60 us straight to poll (spin 50 us); two per
# rank, 29 against 33 us (Open MPI over TCP, same sittings: 27 and 76 us). Longer spins (200 and
# 1000 us) did no better: spinning holds the core the peer's answer needs.
cdef int64_t NAP_WINDOW_NS = 1000000
cdef timespec NAP
NAP.tv_sec = 0
NAP.tv_nsec = 20000
cdef size_t DEFAULT_STAGE_BYTES = 64 * 1024
# How long close() waits for a thread inside an operation on the connection to leave it.
cdef long long CLOSE_WAIT_US = 1000000
# An abort notice's payload follows its header at once; five seconds is generous.
cdef int64_t ABORT_READ_NS = 5000000000

cdef enum Phase:
    PHASE_HEADER = 0
    PHASE_PAYLOAD = 1
    PHASE_DONE = 2


cdef int64_t monotonic_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef int64_t _deadline_from(double timeout) noexcept:
    # A negative or infinite timeout means "no deadline" (-1).
    if timeout < 0 or timeout != timeout or timeout > 1e9:
        return -1
    return monotonic_ns() + <int64_t>(timeout * 1e9)


cdef inline int _errno_status(int err) noexcept nogil:
    if err == EAGAIN:
        return ST_AGAIN
    if err == EWOULDBLOCK:  # a separate test: the two are equal on Linux, not everywhere
        return ST_AGAIN
    if err == EINTR:
        return ST_INTR
    if err == EPIPE or err == ECONNRESET or err == ETIMEDOUT:
        return ST_PEER_CLOSED
    return ST_OS_ERROR


cdef int _send_step(SendOp* s) noexcept nogil:
    """Send as much of the frame as the socket takes. ST_OK once all is sent."""
    cdef iovec iov[2]
    cdef msghdr msg
    cdef size_t total = FERRO_HEADER_SIZE + s.length
    cdef size_t end = total if s.cap == 0 or s.cap > total else s.cap
    cdef size_t offset
    cdef ssize_t n
    while s.done < end:
        memset(&msg, 0, sizeof(msg))
        msg.msg_iov = iov
        if s.done < FERRO_HEADER_SIZE:
            # Header and payload leave in one system call (one segment for small frames).
            iov[0].iov_base = <void*>(s.header + s.done)
            iov[0].iov_len = (FERRO_HEADER_SIZE if end > FERRO_HEADER_SIZE else end) - s.done
            iov[1].iov_base = <void*>s.payload
            iov[1].iov_len = end - FERRO_HEADER_SIZE if end > FERRO_HEADER_SIZE else 0
            msg.msg_iovlen = 2 if iov[1].iov_len > 0 else 1
        else:
            offset = s.done - FERRO_HEADER_SIZE
            iov[0].iov_base = <void*>(s.payload + offset)
            iov[0].iov_len = end - s.done
            msg.msg_iovlen = 1
        n = sendmsg(s.conn.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT)
        if n < 0:
            s.os_errno = errno
            return _errno_status(s.os_errno)
        s.done += <size_t>n
    if s.done < total:
        return ST_AGAIN  # held at its cap (a budget of bytes in flight, run_until)
    s.conn.send_seq += 1
    ferro_count_sent(s.conn.stats, s.stat_slot, s.length)
    return ST_OK


cdef int check_header(const unsigned char* h, uint32_t kind, uint64_t fingerprint, uint64_t expected_seq,
                      uint64_t capacity, bint exact, SeenHeader* seen) noexcept nogil:
    """Decode a frame header into ``seen`` and judge it against the receive (shared with shared memory)."""
    seen.magic = ferro_get_u32(h)
    seen.kind = ferro_get_u32(h + 4)
    seen.length = ferro_get_u64(h + 8)
    seen.seq = ferro_get_u64(h + 16)
    seen.fingerprint = ferro_get_u64(h + 24)
    if seen.magic != FERRO_FRAME_MAGIC:
        return ST_BAD_MAGIC
    if seen.seq != expected_seq:
        return ST_BAD_SEQ
    if seen.kind != kind or seen.fingerprint != fingerprint:
        return ST_MISMATCH
    if seen.length > capacity:
        return ST_TOO_LARGE
    if exact and seen.length != capacity:
        return ST_SIZE_MISMATCH
    return ST_OK


cdef int _recv_step(RecvOp* r) noexcept nogil:
    """Receive as much of the frame as has arrived. ST_OK once it is complete."""
    cdef ConnState* st = r.conn
    cdef size_t available, n_copy
    cdef ssize_t n
    cdef int rc
    while True:
        if r.phase == PHASE_HEADER:
            available = st.stage_end - st.stage_begin
            if available >= FERRO_HEADER_SIZE:
                rc = check_header(st.stage + st.stage_begin, r.kind, r.fingerprint, st.recv_seq, r.capacity, r.exact,
                                  &r.seen)
                if rc != ST_OK:
                    return rc
                st.stage_begin += FERRO_HEADER_SIZE
                st.recv_seq += 1
                r.length = <size_t>r.seen.length
                r.phase = PHASE_PAYLOAD
                # Bytes that arrived together with the header belong to this payload first.
                n_copy = available - FERRO_HEADER_SIZE
                if n_copy > r.length:
                    n_copy = r.length
                if n_copy > 0:
                    memcpy(r.buffer, st.stage + st.stage_begin, n_copy)
                    st.stage_begin += n_copy
                    r.done = n_copy
                if st.stage_begin == st.stage_end:
                    st.stage_begin = 0
                    st.stage_end = 0
                continue
            if st.stage_begin > 0:
                # Fewer than a header's bytes remain: move them to the front.
                memmove(st.stage, st.stage + st.stage_begin, available)
                st.stage_begin = 0
                st.stage_end = available
            n = recv(st.fd, st.stage + st.stage_end, st.stage_cap - st.stage_end, MSG_DONTWAIT)
            if n > 0:
                st.stage_end += <size_t>n
                continue
        elif r.phase == PHASE_PAYLOAD:
            if r.done == r.length:
                r.phase = PHASE_DONE
                ferro_count_received(st.stats, ferro_stat_slot(r.kind, r.fingerprint), r.length)
                return ST_OK
            # Straight into the caller's buffer, never past this frame's end.
            n = recv(st.fd, r.buffer + r.done, r.length - r.done, MSG_DONTWAIT)
            if n > 0:
                r.done += <size_t>n
                continue
        else:
            return ST_OK
        if n == 0:
            return ST_PEER_CLOSED
        r.os_errno = errno
        return _errno_status(r.os_errno)


cdef inline bint _send_mid_frame(SendOp* s) noexcept nogil:
    return s.done > 0 and s.done < FERRO_HEADER_SIZE + s.length


cdef inline bint _recv_mid_frame(RecvOp* r) noexcept nogil:
    return r.phase == PHASE_PAYLOAD


cdef inline bint _fatal(int status) noexcept nogil:
    # Statuses after which the byte stream cannot be trusted, whatever the phase.
    return (status == ST_PEER_CLOSED or status == ST_OS_ERROR or status == ST_BAD_MAGIC
            or status == ST_BAD_SEQ or status == ST_BROKEN)


cdef void _finish_send(SendOp* s, int status) noexcept nogil:
    s.status = status
    if status != ST_OK and (_fatal(status) or _send_mid_frame(s)) and s.conn.broken == 0:
        s.conn.broken = status


cdef void _finish_recv(RecvOp* r, int status) noexcept nogil:
    r.status = status
    if status != ST_OK and (_fatal(status) or _recv_mid_frame(r)) and r.conn.broken == 0:
        r.conn.broken = status


cdef int _wait_readiness(SendOp* s, bint s_active, RecvOp* r, bint r_active, int timeout_ms) noexcept nogil:
    cdef pollfd fds[2]
    cdef int n = 0
    if s_active:
        fds[0].fd = s.conn.fd
        fds[0].events = POLLOUT
        fds[0].revents = 0
        n = 1
    if r_active:
        if n == 1 and fds[0].fd == r.conn.fd:
            fds[0].events |= POLLIN
        else:
            fds[n].fd = r.conn.fd
            fds[n].events = POLLIN
            fds[n].revents = 0
            n += 1
    if poll(fds, n, timeout_ms) < 0:
        return ST_INTR if errno == EINTR else ST_OS_ERROR
    return ST_OK


cdef inline bint _wait_without_poll(int64_t now, int64_t spin_until, int64_t spin_ns,
                                    int64_t yield_ns) noexcept nogil:
    """Spend one moment of a wait awake, if the connections' settings say so: spin until ``spin_until``, then
    yield for ``yield_ns`` (no spinning) or nap for ``NAP_WINDOW_NS`` (after spinning). False: time to poll."""
    if now < spin_until:
        return True
    if spin_ns == 0 and now < spin_until + yield_ns:
        sched_yield()
        return True
    if spin_ns > 0 and now < spin_until + NAP_WINDOW_NS:
        nanosleep(&NAP, NULL)
        return True
    return False


cdef int run_ops(SendOp* s, RecvOp* r, int64_t deadline_ns, bint either=False) except -1 nogil:
    """Drive a send and/or a receive to completion, failure or the deadline.

    Either pointer may be NULL. Each op's ``status`` holds its outcome. A fatal
    error in one op stops the other at once (breaking its connection if it was
    mid-frame); a refused header on the receive side lets the send finish, so
    that the sender's stream stays whole. Returns -1 only when a signal handler
    raised (KeyboardInterrupt), after marking mid-frame connections broken.

    With ``either``, it returns as soon as one op has finished well, the other's status ``ST_AGAIN`` and its
    progress kept in the op, so that the caller can start its next op beside it and pass both again: the
    streaming ring (``collectives._stream_ring``). A failure still runs the other op to its end, as without.
    """
    cdef bint s_active = s != NULL
    cdef bint r_active = r != NULL
    cdef bint progressed, check_signals
    cdef size_t before_s, before_r
    cdef int rc, phase_before
    cdef int64_t now, spin_ns = 0, yield_ns = 0, spin_until, wait_ns
    cdef int timeout_ms
    if s_active:
        spin_ns = s.conn.spin_ns
        yield_ns = s.conn.yield_ns
        if s.conn.broken:
            _finish_send(s, ST_BROKEN)
            s_active = False
    if r_active:
        if r.conn.spin_ns > spin_ns:
            spin_ns = r.conn.spin_ns
        if r.conn.yield_ns > yield_ns:
            yield_ns = r.conn.yield_ns
        if r.conn.broken:
            _finish_recv(r, ST_BROKEN)
            r_active = False
    if (s != NULL and s.status == ST_BROKEN) or (r != NULL and r.status == ST_BROKEN):
        # Never start half of an exchange whose other half cannot run.
        if s_active:
            _finish_send(s, ST_ABORTED)
        if r_active:
            _finish_recv(r, ST_ABORTED)
        return 0
    spin_until = monotonic_ns() + spin_ns
    while s_active or r_active:
        progressed = False
        check_signals = False
        if s_active:
            before_s = s.done
            rc = _send_step(s)
            progressed = s.done != before_s
            if rc == ST_INTR:
                check_signals = True
            elif rc != ST_AGAIN:
                _finish_send(s, rc)
                s_active = False
                if rc != ST_OK and r_active:
                    _finish_recv(r, ST_ABORTED)
                    r_active = False
        if r_active:
            before_r = r.done
            phase_before = r.phase
            rc = _recv_step(r)
            progressed = progressed or r.done != before_r or r.phase != phase_before
            if rc == ST_INTR:
                check_signals = True
            elif rc != ST_AGAIN:
                _finish_recv(r, rc)
                r_active = False
                if _fatal(rc) and s_active:
                    _finish_send(s, ST_ABORTED)
                    s_active = False
        if not (s_active or r_active):
            break
        if either and ((s != NULL and not s_active and s.status == ST_OK)
                       or (r != NULL and not r_active and r.status == ST_OK)):
            if s_active:
                s.status = ST_AGAIN
            if r_active:
                r.status = ST_AGAIN
            return 0
        now = monotonic_ns()
        if progressed:
            spin_until = now + spin_ns
            continue
        if deadline_ns >= 0 and now >= deadline_ns:
            if s_active:
                _finish_send(s, ST_TIMEOUT)
            if r_active:
                _finish_recv(r, ST_TIMEOUT)
            break
        if not check_signals and _wait_without_poll(now, spin_until, spin_ns, yield_ns):
            continue
        if not check_signals:
            wait_ns = POLL_SLICE_MS * 1000000
            if deadline_ns >= 0 and deadline_ns - now < wait_ns:
                wait_ns = deadline_ns - now
            timeout_ms = <int>((wait_ns + 999999) // 1000000)
            rc = _wait_readiness(s, s_active, r, r_active, timeout_ms)
            if rc == ST_OS_ERROR:
                if s_active:
                    _finish_send(s, ST_OS_ERROR)
                if r_active:
                    _finish_recv(r, ST_OS_ERROR)
                break
            # Look for signals after EINTR and after every full slice of sleep.
            check_signals = rc == ST_INTR or monotonic_ns() - now >= (POLL_SLICE_MS - 1) * 1000000
        if check_signals and signal_raised() != 0:
            if s_active:
                _finish_send(s, ST_INTR)
            if r_active:
                _finish_recv(r, ST_INTR)
            return -1
    return 0


cdef int run_until(SendOp* sends, int nsend, RecvOp* recvs, int nrecv, pollfd* fds, int64_t deadline_ns,
                   bint first_only, size_t budget=0, double drain_rate=0) except -1 nogil:
    """Drive several sends and receives at once, each on its own connection, as :func:`run_ops` drives two.

    Only the ops whose ``status`` is ``ST_AGAIN`` run; the others are skipped. ``fds`` holds room for ``nsend +
    nrecv`` entries. A fatal error in any op stops all the others (breaking the connections they were mid-frame
    on); each op's ``status`` holds its outcome. What lets an all_to_all keep every link busy: a window of its
    pairwise steps in flight together, as gloo and MPI post theirs, so one peer's slow connection does not stall
    the rest.

    With ``first_only`` it returns as soon as one of them has finished, the rest still running (their progress
    kept in the ops), so that a caller can put new ops in the finished ones' places and call again: the sliding
    window of the pairwise all_to_all. A failure still stops every running op. Returns -1 only when a signal
    handler raised.

    ``budget`` (bytes; 0: none) caps what the sends' connections hold unacknowledged together (``SIOCOUTQ``):
    a send goes on only while they hold less, each running one taking an equal share of the room, and waits,
    without polling its socket, for the bytes ``drain_rate`` (bytes per second) drains meanwhile. What a queue
    on the path can hold of these flows is then at most the budget, whatever the congestion control or the
    kernel's pacing let them send (see the pairwise all_to_all's ``_pairwise_windows``).
    """
    cdef int i, rc, active = 0, started, n, timeout_ms, sending
    cdef bint progressed, failed = False, check_signals, held = False
    cdef int64_t now, wait_ns, spin_ns = 0, yield_ns = 0, spin_until
    cdef size_t queued = 0, share = 0, before
    cdef bint looked = False  # ``queued`` was read from the kernel in this call
    for i in range(nsend):
        if sends[i].status == ST_AGAIN and sends[i].conn.broken:
            failed = True
    for i in range(nrecv):
        if recvs[i].status == ST_AGAIN and recvs[i].conn.broken:
            failed = True
    if failed:
        for i in range(nsend):
            if sends[i].status == ST_AGAIN:
                _finish_send(&sends[i], ST_BROKEN if sends[i].conn.broken else ST_ABORTED)
        for i in range(nrecv):
            if recvs[i].status == ST_AGAIN:
                _finish_recv(&recvs[i], ST_BROKEN if recvs[i].conn.broken else ST_ABORTED)
        return 0
    for i in range(nsend):
        if sends[i].status == ST_AGAIN:
            active += 1
            spin_ns = max(spin_ns, sends[i].conn.spin_ns)
            yield_ns = max(yield_ns, sends[i].conn.yield_ns)
    for i in range(nrecv):
        if recvs[i].status == ST_AGAIN:
            active += 1
            spin_ns = max(spin_ns, recvs[i].conn.spin_ns)
            yield_ns = max(yield_ns, recvs[i].conn.yield_ns)
    started = active
    spin_until = monotonic_ns() + spin_ns
    while active > 0:
        progressed = False
        check_signals = False
        if budget > 0:
            sending = 0
            for i in range(nsend):
                sending += sends[i].status == ST_AGAIN
            held = False
            if sending > 0:
                # ``queued`` bounds what the flows hold from above (what was read plus what was sent since: only
                # acknowledgements lower it), so the kernel is asked again only where the bound would hold the
                # sends: a system call per flow at every look cost a 256 KiB call among 32 ranks on 2 cores 7 %.
                # Refill in steps of a quarter of the budget at least, not a segment per wake-up.
                if not looked or queued + budget // 4 > budget:
                    queued = 0
                    for i in range(nsend):
                        if sends[i].conn != NULL:  # a slot of a sliding window that has run a send (see above)
                            queued += ferro_unacked_bytes(sends[i].conn.fd)
                    looked = True
                held = queued + budget // 4 > budget
                if not held:
                    share = (budget - queued) // <size_t>sending
        for i in range(nsend):
            if sends[i].status == ST_AGAIN:
                if held:
                    continue
                before = sends[i].done
                if budget > 0:
                    sends[i].cap = before + share
                rc = _advance_send(&sends[i], &progressed, &check_signals)
                queued += sends[i].done - before
                if rc != ST_AGAIN:
                    _finish_send(&sends[i], rc)
                    active -= 1
                    failed = failed or rc != ST_OK
        for i in range(nrecv):
            if recvs[i].status == ST_AGAIN:
                rc = _advance_recv(&recvs[i], &progressed, &check_signals)
                if rc != ST_AGAIN:
                    _finish_recv(&recvs[i], rc)
                    active -= 1
                    failed = failed or rc != ST_OK
        if failed:
            _stop_all(sends, nsend, recvs, nrecv, ST_ABORTED)
            return 0
        if first_only and active < started:
            return 0
        if active == 0:
            continue
        now = monotonic_ns()
        if progressed:
            spin_until = now + spin_ns
            continue
        if deadline_ns >= 0 and now >= deadline_ns:
            _stop_all(sends, nsend, recvs, nrecv, ST_TIMEOUT)
            return 0
        # Wait as run_ops waits: spin, then yield or nap, then sleep in poll (the connections' settings). Sends
        # held by the budget sleep at once, until the bytes they wait for should have drained.
        if not check_signals and not held and _wait_without_poll(now, spin_until, spin_ns, yield_ns):
            continue
        if not check_signals:
            n = 0
            for i in range(nsend):
                if sends[i].status == ST_AGAIN and not held:
                    fds[n].fd = sends[i].conn.fd
                    fds[n].events = POLLOUT
                    fds[n].revents = 0
                    n += 1
            for i in range(nrecv):
                if recvs[i].status == ST_AGAIN:
                    fds[n].fd = recvs[i].conn.fd
                    fds[n].events = POLLIN
                    fds[n].revents = 0
                    n += 1
            wait_ns = POLL_SLICE_MS * 1000000
            if held and drain_rate > 0:
                wait_ns = min(wait_ns, max(<int64_t>((queued + budget // 4 - budget) / drain_rate * 1e9), 1000000))
            if deadline_ns >= 0 and deadline_ns - now < wait_ns:
                wait_ns = deadline_ns - now
            timeout_ms = <int>((wait_ns + 999999) // 1000000)
            if poll(fds, n, timeout_ms) < 0:
                if errno != EINTR:
                    _stop_all(sends, nsend, recvs, nrecv, ST_OS_ERROR)
                    return 0
                check_signals = True
            check_signals = check_signals or monotonic_ns() - now >= (POLL_SLICE_MS - 1) * 1000000
        if check_signals and signal_raised() != 0:
            _stop_all(sends, nsend, recvs, nrecv, ST_INTR)
            return -1
    return 0


cdef inline int _advance_send(SendOp* s, bint* progressed, bint* check_signals) noexcept nogil:
    """One non-blocking step of a running send: its outcome once it has one, else ST_AGAIN (EINTR included)."""
    cdef size_t before = s.done
    cdef int rc = _send_step(s)
    if s.done != before:
        progressed[0] = True
    if rc == ST_INTR:
        check_signals[0] = True
        return ST_AGAIN
    return rc


cdef inline int _advance_recv(RecvOp* r, bint* progressed, bint* check_signals) noexcept nogil:
    """One non-blocking step of a running receive, as :func:`_advance_send`."""
    cdef size_t before = r.done
    cdef int phase_before = r.phase
    cdef int rc = _recv_step(r)
    if r.done != before or r.phase != phase_before:
        progressed[0] = True
    if rc == ST_INTR:
        check_signals[0] = True
        return ST_AGAIN
    return rc


cdef void _stop_all(SendOp* sends, int nsend, RecvOp* recvs, int nrecv, int status) noexcept nogil:
    """Finish every op still running with ``status`` (mid-frame ones break their connections)."""
    cdef int i
    for i in range(nsend):
        if sends[i].status == ST_AGAIN:
            _finish_send(&sends[i], status)
    for i in range(nrecv):
        if recvs[i].status == ST_AGAIN:
            _finish_recv(&recvs[i], status)


cdef int acquire_buffer(object obj, Py_buffer* view, bint writable, str op) except -1:
    cdef int flags = PyBUF_C_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0)
    try:
        PyObject_GetBuffer(obj, view, flags)
    except (BufferError, TypeError, ValueError) as exc:
        raise InvalidBufferError(f"{op}: {describe_buffer_problem(obj, writable)}") from exc
    return 0


def describe_buffer_problem(obj: object, writable: bool) -> str:
    """Say why ``obj`` cannot serve as a (writable) C-contiguous buffer."""
    try:
        view = memoryview(obj)
    except TypeError:
        return (f"expected a C-contiguous buffer (NumPy array, bytes, bytearray, memoryview), "
                f"got {type(obj).__name__}")
    if writable and view.readonly:
        return ("the receive buffer is read-only; pass a writable array "
                "(for NumPy, one whose flags.writeable is True)")
    if not view.c_contiguous:
        return (f"the buffer is not C-contiguous (shape {view.shape}, strides {view.strides}); "
                f"pass numpy.ascontiguousarray(x)")
    return "the buffer cannot be exported as contiguous bytes"


cdef class Connection:
    """One end of an established stream socket between two ranks, carrying frames.

    The connection takes ownership of ``sock`` and closes it on :meth:`close`.
    It is thread-safe: concurrent sends (or receives) from several threads are
    serialised frame by frame, while one send and one receive run in parallel.

    Args:
        sock: A connected ``socket.socket`` (TCP or Unix stream).
        local_rank: This process's rank, used in error messages.
        peer_rank: The rank at the other end, used in error messages.
        spin_us: Microseconds to spin on a quiet socket before sleeping in
            ``poll``; 0 does not spin (best when ranks outnumber cores).
        yield_us: Without a spin, microseconds to keep trying between
            ``sched_yield()`` calls before sleeping in ``poll`` (0: sleep at once).
        stage_bytes: Size of the receive staging buffer for headers.
        group_state: The group's :class:`~ferro._core.state.GroupState`, whose counters
            this connection adds the payload bytes of its frames to (none counted without one).
    """

    def __cinit__(self, sock, int local_rank, int peer_rank, double spin_us=50.0,
                  size_t stage_bytes=DEFAULT_STAGE_BYTES, GroupState group_state=None, double yield_us=200.0):
        self.st.stage = NULL
        self.send_lock = PyThread_allocate_lock()
        self.recv_lock = PyThread_allocate_lock()
        if self.send_lock == NULL or self.recv_lock == NULL:
            raise MemoryError()
        if stage_bytes < FERRO_HEADER_SIZE:
            raise ValueError(f"stage_bytes must be at least {FERRO_HEADER_SIZE}")
        if spin_us < 0:
            raise ValueError("spin_us must be >= 0")
        if yield_us < 0:
            raise ValueError("yield_us must be >= 0")
        self.sock = sock
        self.st.fd = sock.fileno()
        self.st.local_rank = local_rank
        self.st.peer_rank = peer_rank
        self.st.send_seq = 0
        self.st.recv_seq = 0
        self.st.stage = <unsigned char*>malloc(stage_bytes)
        if self.st.stage == NULL:
            raise MemoryError()
        self.st.stage_cap = stage_bytes
        self.st.stage_begin = 0
        self.st.stage_end = 0
        self.st.broken = 0
        self.st.closing = 0
        self.st.spin_ns = <int64_t>(spin_us * 1000.0)
        self.st.yield_ns = <int64_t>(yield_us * 1000.0)
        self.group_state = group_state
        self.st.stats = &group_state.stats if group_state is not None else NULL
        self.broken_reason = None
        self.is_closed = False

    def __dealloc__(self):
        free(self.st.stage)
        if self.send_lock != NULL:
            PyThread_free_lock(self.send_lock)
        if self.recv_lock != NULL:
            PyThread_free_lock(self.recv_lock)

    @property
    def peer(self) -> int:
        """The rank at the other end."""
        return self.st.peer_rank

    @property
    def local_rank(self) -> int:
        """This process's rank."""
        return self.st.local_rank

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self.is_closed

    @property
    def broken(self) -> str | None:
        """Why the stream is unusable, or None while it is healthy."""
        if self.st.broken == 0:
            return None
        return self.broken_reason or f"status {self.st.broken}"

    @property
    def send_seq(self) -> int:
        """Sequence number of the next frame to send."""
        return self.st.send_seq

    @property
    def recv_seq(self) -> int:
        """Sequence number expected on the next frame received."""
        return self.st.recv_seq

    @property
    def spin_us(self) -> float:
        """Microseconds spent spinning before sleeping in poll."""
        return self.st.spin_ns / 1000.0

    @property
    def yield_us(self) -> float:
        """Without a spin, microseconds spent trying between ``sched_yield()`` calls before sleeping in poll."""
        return self.st.yield_ns / 1000.0

    def fileno(self) -> int:
        """The socket's file descriptor (-1 once closed)."""
        return self.st.fd

    def frame_waiting(self) -> bool:
        """Whether the peer's next frame has begun to arrive, without blocking (a receive from any source asks).

        True too when the socket has closed or failed: the receive that follows
        then says so (a lost peer is not a quiet one).
        """
        cdef pollfd fd
        if self.is_closed:
            raise BackendClosedError(f"rank {self.st.local_rank}: recv: this process group was closed")
        if self.st.stage_end > self.st.stage_begin:
            return True  # bytes of the next frame came in with the previous one
        fd.fd = self.st.fd
        fd.events = POLLIN
        fd.revents = 0
        return poll(&fd, 1, 0) > 0 and fd.revents != 0

    def stop_sending(self) -> None:
        """Send the peer end-of-stream after whatever this end has queued (``shutdown(SHUT_WR)``); see :meth:`linger`."""
        if not self.is_closed:
            try:
                self.sock.shutdown(1)  # SHUT_WR
            except OSError:
                pass  # already disconnected

    def linger(self, double deadline) -> None:
        """Let what this end already sent reach the peer, then :meth:`close` (for a group that failed).

        Closing a socket with unread bytes in it makes the kernel reset the connection
        and discard what this end still had queued -- an abort notice stuck behind a
        peer that is not reading yet, say -- so the peer would see "connection reset"
        instead of the notice. Here this end stops sending (:meth:`stop_sending`: call
        it on every connection of the group first, so that no two ranks wait on each
        other) and reads and discards whatever arrives until the peer closes too, or
        ``time.monotonic()`` passes ``deadline``; only then does it close. A thread
        inside an operation on this connection (holding its receive lock) is left
        alone: the plain close follows at once.
        """
        if self.is_closed:
            return
        cdef bint got_recv = PyThread_acquire_lock(self.recv_lock, 0) == PY_LOCK_ACQUIRED
        try:
            if got_recv:
                self.stop_sending()
                poller = select.poll()
                poller.register(self.st.fd, select.POLLIN)
                try:
                    while (left := deadline - time.monotonic()) > 0:
                        if poller.poll(max(int(left * 1000), 1)) and not self.sock.recv(1 << 16, MSG_DONTWAIT):
                            break  # the peer closed too: nothing of ours is left in flight
                except OSError:
                    pass  # reset or gone (or a spurious wake-up): nothing more to wait for
        finally:
            if got_recv:
                PyThread_release_lock(self.recv_lock)
        self.close()

    def close(self) -> None:
        """Close the socket. Idempotent; later operations raise BackendClosedError.

        A thread blocked on this connection wakes at once and raises
        BackendClosedError too: the socket is shut down before it is closed, so the
        waiter sees the shutdown rather than a descriptor number that may be reused.
        """
        if self.is_closed:
            return
        self.is_closed = True
        self.st.closing = 1
        self.st.broken = ST_BROKEN
        self.broken_reason = "closed by this process"
        try:
            self.sock.shutdown(2)  # SHUT_RDWR
        except OSError:
            pass  # already disconnected
        # Taking both locks waits for a thread inside an operation to leave it (the
        # shutdown wakes it within microseconds) before the descriptor is released.
        # The wait is bounded: a signal handler may call close() on the thread that
        # holds a lock, and that thread's loop then stops on the cleared descriptor.
        cdef int got_send, got_recv
        with nogil:
            got_send = PyThread_acquire_lock_timed(self.send_lock, CLOSE_WAIT_US, 0) == PY_LOCK_ACQUIRED
            got_recv = PyThread_acquire_lock_timed(self.recv_lock, CLOSE_WAIT_US, 0) == PY_LOCK_ACQUIRED
        self.st.fd = -1
        self.sock.close()
        if got_recv:
            PyThread_release_lock(self.recv_lock)
        if got_send:
            PyThread_release_lock(self.send_lock)

    cdef int check_usable(self, str op) except -1:
        if self.is_closed:
            raise BackendClosedError(
                f"rank {self.st.local_rank}: {op}: the connection to rank {self.st.peer_rank} was closed by this process")
        return 0

    cdef int lock(self, PyThread_type_lock which, double timeout, str op) except -1:
        # Uncontended: one atomic operation with the GIL held. Contended: wait
        # without the GIL, for no longer than the operation's own timeout.
        cdef long long micros
        cdef int got
        if PyThread_acquire_lock(which, NOWAIT_LOCK):
            return 0
        micros = -1 if timeout < 0 else <long long>(timeout * 1e6)
        with nogil:
            got = PyThread_acquire_lock_timed(which, micros, 0)
        if got != PY_LOCK_ACQUIRED:
            raise DistributedTimeoutError(
                f"rank {self.st.local_rank}: {op} with rank {self.st.peer_rank} timed out after {timeout:g} s "
                f"waiting for another thread's {op} on the same connection")
        return 0

    def send(self, buf, *, uint32_t kind=KIND_DATA, uint64_t fingerprint=0, double timeout=-1.0,
             str op="send") -> None:
        """Send ``buf`` as one frame.

        Args:
            buf: Any C-contiguous buffer-protocol object; its bytes are sent in place.
            kind: Frame kind the receiver must expect.
            fingerprint: Call fingerprint the receiver must expect.
            timeout: Seconds; negative waits forever.
            op: Operation name for error messages.

        Raises:
            InvalidBufferError, DistributedTimeoutError, PeerLostError,
            ConnectionBrokenError, TransportError, BackendClosedError.
        """
        cdef Py_buffer view
        cdef SendOp s
        self.check_usable(op)
        acquire_buffer(buf, &view, False, op)
        try:
            self.lock(self.send_lock, timeout, op)
            try:
                _init_send(&s, &self.st, &view, kind, fingerprint)
                deadline = _deadline_from(timeout)
                with nogil:
                    run_ops(&s, NULL, deadline)
            finally:
                PyThread_release_lock(self.send_lock)
        finally:
            PyBuffer_Release(&view)
        if s.status != ST_OK:
            raise_failure(&s, NULL, op, timeout)

    def recv_into(self, buf, *, uint32_t kind=KIND_DATA, uint64_t fingerprint=0, double timeout=-1.0,
                  bint exact=True, str op="recv") -> int:
        """Receive one frame into ``buf`` and return its payload length.

        Args:
            buf: A writable C-contiguous buffer.
            kind: Frame kind expected.
            fingerprint: Call fingerprint expected.
            timeout: Seconds; negative waits forever.
            exact: Require the payload to fill ``buf`` exactly (else it may be shorter).
            op: Operation name for error messages.

        Raises:
            SizeMismatchError: The frame does not fit; it stays unconsumed.
            CollectiveMismatchError: The frame's kind or fingerprint differ; it stays unconsumed.
            DistributedTimeoutError, PeerLostError, ProtocolError,
            ConnectionBrokenError, TransportError, InvalidBufferError, BackendClosedError.
        """
        cdef Py_buffer view
        cdef RecvOp r
        self.check_usable(op)
        acquire_buffer(buf, &view, True, op)
        try:
            self.lock(self.recv_lock, timeout, op)
            try:
                _init_recv(&r, &self.st, &view, kind, fingerprint, exact)
                deadline = _deadline_from(timeout)
                with nogil:
                    run_ops(NULL, &r, deadline)
            finally:
                PyThread_release_lock(self.recv_lock)
        finally:
            PyBuffer_Release(&view)
        if r.status != ST_OK:
            raise_failure(NULL, &r, op, timeout)
        return r.length


cdef void _init_send(SendOp* s, ConnState* st, Py_buffer* view, uint32_t kind, uint64_t fingerprint) noexcept:
    memset(s, 0, sizeof(SendOp))
    s.conn = st
    s.payload = <const unsigned char*>view.buf
    s.length = <size_t>view.len
    s.stat_slot = ferro_stat_slot(kind, fingerprint)
    ferro_pack_header(s.header, kind, s.length, st.send_seq, fingerprint)


cdef void _init_recv(RecvOp* r, ConnState* st, Py_buffer* view, uint32_t kind, uint64_t fingerprint,
                     bint exact) noexcept:
    memset(r, 0, sizeof(RecvOp))
    r.conn = st
    r.buffer = <unsigned char*>view.buf
    r.capacity = <size_t>view.len
    r.exact = exact
    r.kind = kind
    r.fingerprint = fingerprint


def sendrecv(Connection send_conn, send_buf, Connection recv_conn, recv_buf, *,
             uint32_t kind=KIND_DATA, uint64_t fingerprint=0, double timeout=-1.0,
             bint exact=True, str op="sendrecv") -> int:
    """Send one frame on ``send_conn`` while receiving one on ``recv_conn``.

    Both directions progress together, so a ring of ranks each sending to the
    next and receiving from the previous never deadlocks, whatever the size.
    The two connections may be the same (an exchange with one peer).

    Returns:
        The received payload length.

    Raises:
        The errors of :meth:`Connection.send` and :meth:`Connection.recv_into`.
    """
    cdef Py_buffer send_view, recv_view
    cdef SendOp s
    cdef RecvOp r
    send_conn.check_usable(op)
    recv_conn.check_usable(op)
    acquire_buffer(send_buf, &send_view, False, op)
    try:
        acquire_buffer(recv_buf, &recv_view, True, op)
    except BaseException:
        PyBuffer_Release(&send_view)
        raise
    try:
        # Always the send lock first: a fixed order, so two exchanges cannot deadlock on the locks.
        send_conn.lock(send_conn.send_lock, timeout, op)
        try:
            recv_conn.lock(recv_conn.recv_lock, timeout, op)
            try:
                _init_send(&s, &send_conn.st, &send_view, kind, fingerprint)
                _init_recv(&r, &recv_conn.st, &recv_view, kind, fingerprint, exact)
                deadline = _deadline_from(timeout)
                with nogil:
                    run_ops(&s, &r, deadline)
            finally:
                PyThread_release_lock(recv_conn.recv_lock)
        finally:
            PyThread_release_lock(send_conn.send_lock)
    finally:
        PyBuffer_Release(&send_view)
        PyBuffer_Release(&recv_view)
    if s.status != ST_OK or r.status != ST_OK:
        raise_failure(&s, &r, op, timeout)
    return r.length


# ---------------------------------------------------------------------------
# Failures, described for ferro._core.status (the one place statuses become exceptions).

cdef object _send_error(SendOp* s, str op, double timeout):
    cdef ConnState* st = s.conn
    cdef Failure f
    memset(&f, 0, sizeof(Failure))
    f.status = ST_CLOSED if st.closing else s.status
    f.peer = st.peer_rank
    f.os_errno = s.os_errno
    f.mid_frame = _send_mid_frame(s)
    where = f"rank {st.local_rank}: {op} to rank {st.peer_rank}"
    detail = f" (frame seq {st.send_seq})"
    if f.status == ST_TIMEOUT and not f.mid_frame:
        detail += "; nothing was sent"
    elif f.status == ST_BROKEN or f.status == ST_ABORTED:
        detail = _broken_text(st)
    return failure_error(&f, where, timeout, detail)


cdef object _recv_error(RecvOp* r, str op, double timeout):
    cdef ConnState* st = r.conn
    cdef Failure f
    if r.status == ST_MISMATCH and r.seen.kind == KIND_ABORT and r.seen.length <= MAX_ABORT_BYTES and not st.closing:
        return _read_abort(r, f"rank {st.local_rank}: {op} from rank {st.peer_rank}")
    describe_receive(&f, ST_CLOSED if st.closing else r.status, st.peer_rank, _recv_mid_frame(r), r.kind,
                     r.fingerprint, r.capacity, r.exact, st.recv_seq, &r.seen)
    f.os_errno = r.os_errno
    where = f"rank {st.local_rank}: {op} from rank {st.peer_rank}"
    detail = ""
    if f.status == ST_TIMEOUT:
        detail = f" waiting for frame seq {st.recv_seq}" + ("" if f.mid_frame else "; no frame was consumed")
    elif f.status == ST_PEER_CLOSED:
        detail = f" while frame seq {st.recv_seq} was due"
    elif f.status == ST_BROKEN or f.status == ST_ABORTED:
        detail = _broken_text(st)
    return failure_error(&f, where, timeout, detail)


cdef object _read_abort(RecvOp* refused, str where):
    """Consume the abort frame that ``refused`` ran into and turn it into the error it reports."""
    cdef RecvOp r
    cdef ConnState* st = refused.conn
    cdef bytearray payload = bytearray(<size_t>refused.seen.length)
    cdef Py_buffer view
    cdef int64_t deadline = monotonic_ns() + ABORT_READ_NS
    PyObject_GetBuffer(payload, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
    try:
        _init_recv(&r, st, &view, KIND_ABORT, refused.seen.fingerprint, True)
        with nogil:
            run_ops(NULL, &r, deadline)
    finally:
        PyBuffer_Release(&view)
    if r.status != ST_OK:
        return _recv_error(&r, "reading an abort notice", 5.0)
    return abort_error(bytes(payload), st.peer_rank, where)


cdef str _broken_text(ConnState* st):
    return broken_by(st.broken)


cdef int raise_failure(SendOp* s, RecvOp* r, str op, double timeout) except -1:
    """Raise the most telling error of a failed send/receive pair."""
    send_exc = _send_error(s, op, timeout) if s != NULL and s.status != ST_OK else None
    recv_exc = _recv_error(r, op, timeout) if r != NULL and r.status != ST_OK else None
    # A fatal cause beats the abort it caused on the other half.
    if s != NULL and s.status == ST_ABORTED and recv_exc is not None:
        raise recv_exc
    if r != NULL and r.status == ST_ABORTED and send_exc is not None:
        raise send_exc
    if recv_exc is not None:
        raise recv_exc
    if send_exc is not None:
        raise send_exc
    return 0
