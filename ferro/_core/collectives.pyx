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
from libc.math cimport log
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memmove, memset

cdef extern from * nogil:
    """
    #include <sys/socket.h>
    #ifndef SO_MAX_PACING_RATE
    #define SO_MAX_PACING_RATE 47  /* Linux's (asm-generic/socket.h), for headers older than 3.13's */
    #endif
    """
    int setsockopt(int fd, int level, int name, const void* value, unsigned int length)
    enum:
        SOL_SOCKET
        SO_MAX_PACING_RATE

from ferro._core.direct cimport READ_CLOCK, DirectCall
from ferro._core.reduce cimport ferro_divide, ferro_reduce_fn, ferro_reduce_kernel
from ferro._core.state cimport ferro_stat_slot
from ferro._core.status cimport ST_ABORTED, ST_AGAIN, ST_OK
from ferro._core.transport cimport (
    ConnState,
    Connection,
    RecvOp,
    SendOp,
    monotonic_ns,
    raise_failure,
    run_ops,
    run_until,
)
from ferro._core.posix cimport FERRO_HEADER_SIZE, ferro_pack_header, pollfd

from ferro.errors import InvalidBufferError


cdef extern from "schedule.h" nogil:
    enum:
        FERRO_PLAN_RING
        FERRO_PLAN_RECURSIVE_DOUBLING
        FERRO_PLAN_HALVING_DOUBLING
        FERRO_PLAN_BINOMIAL_TREE
        FERRO_PLAN_CHAIN
        FERRO_PLAN_BRUCK
        FERRO_PLAN_PAIRWISE
        FERRO_PLAN_BRUCK_ALL_TO_ALL
        FERRO_PLAN_DISSEMINATION
        FERRO_PLAN_REDUCE_TREE
        FERRO_PLAN_REDUCE_RING_GATHER
        FERRO_PLAN_REDUCE_CHAIN
        FERRO_PLAN_SCATTER_ALL_GATHER
        FERRO_PHASE_REDUCE_SCATTER
        FERRO_PHASE_ALL_GATHER
        FERRO_STEP_REDUCE
        FERRO_STEP_SEND_SOURCE
        FERRO_STEP_RECV_BASE
        FERRO_STEP_DIVIDE
        FERRO_STEP_PACK
    ctypedef struct ferro_step:
        int send_peer
        int recv_peer
        size_t send_off
        size_t send_len
        size_t recv_off
        size_t recv_len
        unsigned flags
        size_t divide_off
        size_t divide_len
        size_t pack_bit
    ctypedef struct ferro_plan:
        int algorithm
        int n
        int power
        size_t block
    void ferro_plan_init(ferro_plan* plan, int algorithm, int rank, int n, size_t count, size_t itemsize,
                         const size_t* starts, const size_t* ends, size_t* bounds, int phases, int mean, int source)
    void ferro_plan_init_broadcast(ferro_plan* plan, int algorithm, int rank, int n, int root, size_t nbytes,
                                   size_t segment)
    void ferro_plan_init_bruck(ferro_plan* plan, int rank, int n, size_t block)
    void ferro_plan_init_scatter_all_gather(ferro_plan* plan, int rank, int n, int root, size_t nbytes,
                                            size_t* starts, size_t* ends)
    void ferro_plan_init_reduce(ferro_plan* plan, int algorithm, int rank, int n, int root, size_t count,
                                size_t itemsize, const size_t* starts, const size_t* ends, int mean, size_t segment)
    void ferro_plan_init_all_to_all(ferro_plan* plan, int algorithm, int rank, int n, const size_t* send_bounds,
                                    const size_t* recv_bounds, size_t block)
    size_t ferro_plan_blocks_with_bit(int n, size_t bit)
    size_t ferro_plan_bound(size_t total, int parts, int i)
    int ferro_plan_folded_partner(int virtual_rank, int extra)
    int ferro_plan_next(ferro_plan* plan, ferro_step* step)
    size_t ferro_chain_segment(size_t nbytes, int n, double latency_bytes, size_t smallest, size_t largest)
    double ferro_cost_tree(size_t nbytes, int n, double latency_bytes, double partner_ratio)
    double ferro_cost_chain(size_t nbytes, int n, double latency_bytes, size_t segment)
    double ferro_cost_scatter_all_gather(size_t nbytes, int n, double latency_bytes, double partner_ratio)
    double ferro_cost_reduce_ring_gather(size_t nbytes, int n, double latency_bytes)
    double ferro_cost_all_gather_ring(size_t total, int n, double latency_bytes)
    double ferro_cost_all_gather_bruck(size_t total, int n, double latency_bytes, double copy_ratio,
                                       double partner_ratio)
    double ferro_cost_all_to_all_pairwise(size_t total, int n, double latency_bytes, double partner_ratio)
    double ferro_cost_all_to_all_bruck(size_t total, int n, double latency_bytes, double copy_ratio,
                                       double partner_ratio)

cdef enum:
    RING = 0
    RECURSIVE_DOUBLING = 1
    HALVING_DOUBLING = 2

ALGORITHM_RING = RING
ALGORITHM_RECURSIVE_DOUBLING = RECURSIVE_DOUBLING
ALGORITHM_HALVING_DOUBLING = HALVING_DOUBLING
#: The allreduce algorithms by the name ``ferro.allreduce(algorithm=...)`` takes.
ALGORITHMS = {"ring": RING, "recursive_doubling": RECURSIVE_DOUBLING, "halving_doubling": HALVING_DOUBLING}
# 1 MiB measured best on loopback (256 KiB: -25% at 64 MB; 4 MiB: -10%); fits in L2 for the reduce.
cdef size_t SEGMENT_BYTES = 1024 * 1024
DEFAULT_SEGMENT_BYTES = SEGMENT_BYTES
# The broadcast, all_gather and all_to_all choose among their plans by the closed forms of schedule.h, with two
# numbers of the link (see Mesh): these defaults reproduce what loopback measured (DESIGN.md, "Choosing by size"):
# the tree and the chain tie at 64 KiB among 4 ranks, Bruck's all_gather and the ring at 128 KiB among 8.
DEFAULT_LATENCY_BYTES = 8192.0
DEFAULT_COPY_RATIO = 0.125
# The streaming ring cuts each chunk into about this many frames (so that the next step's first frame is ready while
# this step's last ones are on the wire); Mesh.piece_bytes keeps them from being too small for the link.
cdef size_t RING_PIECES = 4
# ... and sends a frame only while it has sent at most this many more than it has received: the link's queue holds
# about one frame of each flow, as when the steps ran whole (unbounded, a step's frames all queued behind the last
# one's: a 4 MiB all_gather among 8 emulated 100 Mbit hosts 311-323 ms against 310-313, and 32 hosts' 4 MiB
# allreduce 689-726 ms against 682-686).
cdef size_t RING_LEAD = 1
RING_LEAD_FRAMES = RING_LEAD
# A call of at least this many bytes sends paced to the line where the mesh knows the line's rate (Mesh.line_pace).
# Unpaced, the 32 hosts' 16 MiB allreduce filled the emulated links' shapers, whose per-packet timers then took 74 %
# of the machine's 2 cores (softirq): 4.1-4.6 s, 0.59-0.66 of the line; paced to it, 2.77-2.90 s. At 4 MiB, paced
# and unpaced ran alike (682-697 ms). What pacing gives up is a link's burst after an idle spell (a token bucket's
# 64 KiB on the emulated links: under 2 % of a 4 MiB call's time at 100 Mbit; a real line has none to give up).
cdef size_t PACE_FROM = 4 * 1024 * 1024
DEFAULT_PACE_FROM_BYTES = PACE_FROM
cdef uint64_t NO_PACE = 0xFFFFFFFFFFFFFFFF  # SO_MAX_PACING_RATE's ~0: no cap

# The chain's segment stays within these (the frame header and a wake-up per frame below; pipelining above).
cdef enum:
    CHAIN_SMALLEST = 16 * 1024
    CHAIN_LARGEST = 1024 * 1024
CHAIN_SEGMENT_SMALLEST = CHAIN_SMALLEST
CHAIN_SEGMENT_LARGEST = CHAIN_LARGEST


def chain_segment(size_t nbytes, int n, double latency_bytes=DEFAULT_LATENCY_BYTES) -> int:
    """The pipelined chain's segment for a broadcast of ``nbytes`` among ``n`` ranks (``schedule.h``)."""
    return ferro_chain_segment(nbytes, n, latency_bytes, CHAIN_SMALLEST, CHAIN_LARGEST)


cdef int _broadcast_plan(size_t nbytes, int n, double latency_bytes, double partner_ratio,
                         bint measured) noexcept nogil:
    """The broadcast's plan of least cost: the binomial tree, the pipelined chain, or a scatter and all-gather.

    The scatter and all-gather only on a measured link (a fitted cost model): on loopback its log2(n) + n - 1
    messages took 2.6-3.7x the tree's time at 64 KiB among 4 and 8 ranks, a per-message cost the defaults (set by
    the tree and the chain) do not carry; on the emulated 100 Mbit clusters it beat the tree 2x at 16-64 KiB.
    """
    cdef double tree = ferro_cost_tree(nbytes, n, latency_bytes, partner_ratio), chain, scatter = tree
    if n <= 2:
        return FERRO_PLAN_BINOMIAL_TREE
    chain = ferro_cost_chain(nbytes, n, latency_bytes,
                             ferro_chain_segment(nbytes, n, latency_bytes, CHAIN_SMALLEST, CHAIN_LARGEST))
    if measured:
        scatter = ferro_cost_scatter_all_gather(nbytes, n, latency_bytes, partner_ratio)
    if chain < tree and chain <= scatter:
        return FERRO_PLAN_CHAIN
    if scatter < tree:
        return FERRO_PLAN_SCATTER_ALL_GATHER
    return FERRO_PLAN_BINOMIAL_TREE


#: The broadcast's plans by the names :func:`choose` gives them.
BROADCAST_PLANS = {"binomial tree": FERRO_PLAN_BINOMIAL_TREE, "pipelined chain": FERRO_PLAN_CHAIN,
                   "scatter and all-gather": FERRO_PLAN_SCATTER_ALL_GATHER}
_BROADCAST_PLAN_NAMES = {code: name for name, code in BROADCAST_PLANS.items()}


cdef inline bint _prefer_bruck_all_gather(size_t total, int n, double latency_bytes, double copy_ratio,
                                          double partner_ratio) noexcept nogil:
    return n > 3 and (ferro_cost_all_gather_bruck(total, n, latency_bytes, copy_ratio, partner_ratio)
                      < ferro_cost_all_gather_ring(total, n, latency_bytes))


cdef inline bint _prefer_bruck_all_to_all(size_t total, int n, double latency_bytes, double copy_ratio,
                                          double partner_ratio) noexcept nogil:
    return n > 3 and (ferro_cost_all_to_all_bruck(total, n, latency_bytes, copy_ratio, partner_ratio)
                      < ferro_cost_all_to_all_pairwise(total, n, latency_bytes, partner_ratio))


# The plan a broadcast, all_gather or all_to_all chose rides in its fingerprint's op field (0 in a call that reduces
# nothing, ferro.types.fingerprint): 1 for the tree, the ring or the pairwise exchange, 2 for the chain or Bruck's,
# 3 for the broadcast's scatter and all-gather.
# Ranks whose meshes choose differently (another FERRO_COST_MODEL) then refuse each other's first frame and the
# error names both plans (ferro.types.describe_fingerprint), where they would have waited on each other.
cdef enum:
    PLAN_FIELD_SHIFT = 50

cdef enum:
    PARTNER_POINTS = 64  # the most sizes a mesh's partner curve holds (ferro bench --fit times about 12-24)
#: The most sizes :meth:`Mesh.set_partner_curve` takes.
PARTNER_CURVE_POINTS = PARTNER_POINTS


cdef inline uint64_t _with_plan(uint64_t fingerprint, int code) noexcept nogil:
    return (fingerprint & ~(<uint64_t>7 << PLAN_FIELD_SHIFT)) | (<uint64_t>code << PLAN_FIELD_SHIFT)


cdef int _reduce_plan(size_t nbytes, int n, double latency_bytes, double partner_ratio) noexcept nogil:
    """The reduce's plan of least cost: the binomial tree, the ring and a gather, or the pipelined chain."""
    cdef double tree = ferro_cost_tree(nbytes, n, latency_bytes, partner_ratio)
    cdef double ring = ferro_cost_reduce_ring_gather(nbytes, n, latency_bytes)
    cdef double chain = tree
    if n > 2:
        chain = ferro_cost_chain(nbytes, n, latency_bytes,
                                 ferro_chain_segment(nbytes, n, latency_bytes, CHAIN_SMALLEST, CHAIN_LARGEST))
    if chain < tree and chain <= ring:
        return FERRO_PLAN_REDUCE_CHAIN
    if n > 2 and ring < tree:
        return FERRO_PLAN_REDUCE_RING_GATHER
    return FERRO_PLAN_REDUCE_TREE


#: The reduce's plans by the names :func:`choose` gives them.
REDUCE_PLANS = {"binomial tree": FERRO_PLAN_REDUCE_TREE, "ring and gather": FERRO_PLAN_REDUCE_RING_GATHER,
                "pipelined chain": FERRO_PLAN_REDUCE_CHAIN}
_REDUCE_PLAN_NAMES = {code: name for name, code in REDUCE_PLANS.items()}

#: The plans a group can be told to run instead of its choice (``FERRO_ALGORITHM_<OP>``, :meth:`Mesh.force`), by op
#: and the name the variable takes. all_gather's and all_to_all's codes are their fingerprint codes (1, 2).
FORCEABLE_PLANS = {
    "broadcast": {"binomial_tree": FERRO_PLAN_BINOMIAL_TREE, "pipelined_chain": FERRO_PLAN_CHAIN,
                  "scatter_all_gather": FERRO_PLAN_SCATTER_ALL_GATHER},
    "all_gather": {"ring": 1, "bruck": 2},
    "all_to_all": {"pairwise": 1, "bruck": 2},
    "reduce": {"binomial_tree": FERRO_PLAN_REDUCE_TREE, "ring_gather": FERRO_PLAN_REDUCE_RING_GATHER,
               "pipelined_chain": FERRO_PLAN_REDUCE_CHAIN},
}
# What choose() calls a forced plan.
_FORCED_NAMES = {"broadcast": _BROADCAST_PLAN_NAMES, "all_gather": {1: "ring", 2: "bruck"},
                 "all_to_all": {1: "pairwise", 2: "bruck"}, "reduce": _REDUCE_PLAN_NAMES}


def choose(str op, size_t nbytes, int n, double latency_bytes=DEFAULT_LATENCY_BYTES,
           double copy_ratio=DEFAULT_COPY_RATIO, double partner_ratio=1.0, bint measured=False) -> str:
    """Name the plan a TCP group of ``n`` runs for ``op`` of ``nbytes``: what :class:`Mesh` chooses.

    ``nbytes`` is the broadcast's message, the all_gather's output (every rank's part), the all_to_all's bytes
    sent per rank (equal blocks; uneven ones always take the pairwise exchange). ``measured``: the numbers come
    from a fitted cost model (the mesh's ``measured``), which lets the broadcast take a scatter and all-gather.
    """
    if op == "broadcast":
        return _BROADCAST_PLAN_NAMES[_broadcast_plan(nbytes, n, latency_bytes, partner_ratio, measured)]
    if op == "all_gather":
        return "bruck" if _prefer_bruck_all_gather(nbytes, n, latency_bytes, copy_ratio, partner_ratio) else "ring"
    if op == "all_to_all":
        return "bruck" if _prefer_bruck_all_to_all(nbytes, n, latency_bytes, copy_ratio, partner_ratio) else "pairwise"
    if op == "reduce":
        return _REDUCE_PLAN_NAMES[_reduce_plan(nbytes, n, latency_bytes, partner_ratio)]
    raise ValueError(f"no plan is chosen by cost for {op!r}")
# A reduce_scatter of at most this many bytes of input may take the direct path, which works in the
# mesh's scratch (kept at the largest call's size); above it the front end's ~100 us are under 2 % of
# the call at 1 Gbit, and the full path's scratch is the call's own.
DIRECT_REDUCE_SCATTER_BYTES = 1024 * 1024
# The pairwise all_to_all keeps up to this many of its steps in flight at once (one frame per block); blocks
# smaller than the mesh's window_bytes no more than that many bytes each way (the first step always goes), a
# step starting as soon as the ones in flight leave it room. At 16x1@100mbit, 1 MiB (64 KiB blocks): 316-368 ms
# with 15 in flight, 111-124 with 128 KiB in batches, 98-108 sliding (8x2@200mbit: 125-132 batched, 97-98
# sliding; 64 or 256 KiB windows no better): many small frames at once lose.
# Larger blocks slide too, LARGE_STEPS_IN_FLIGHT at a time, under the flight budget (FLIGHT_BUDGET_S). At
# 32x1@100mbit (bound 325 ms at 4 MiB, 1,300 at 16 MiB), one sitting each: batches of 16 without the budget 727 ms
# at 4 MiB, 415-420 with it; sliding 4 at a time 422 and 1,506 ms, 8: 368 and 1,472, 12: 366 and 1,422,
# 16: 380 and 1,481. At 16x1, 4 and 16 MiB: 334 and 1,332 ms sliding 8 under the budget, 422 and 1,386 batched.
# Without a budget (no fitted link) large blocks slide 16 at a time, as many as the batches that came before
# (16 ranks on loopback, 4-64 MiB, two rounds: 8 at a time ran about 5 % slower, 16 within noise of the batches).
# Under the flight budget, blocks from 32 KiB count as large: the budget, not the byte window, keeps the queues
# short. At 1 MiB (64 KiB blocks), one sitting each way, two rounds at 16x1: 85-86 ms against 104-107 with two
# steps in the window (the stream: 88); at 8x2@200mbit 78 against 97 (86); at 32x1 (32 KiB blocks) 86 against 88.
cdef enum:
    PAIRWISE_WINDOW = 16
    LARGE_STEPS_IN_FLIGHT = 8
    BUDGETED_LARGE_BYTES = 32 * 1024
# What the pairwise all_to_all's sends may hold unacknowledged together, in seconds of this rank's share of its
# host's link (Mesh.pace_bytes; none where that is not known). Each host's 31 flows at 32x1@100mbit, paced to
# shares of the line by the kernel (SO_MAX_PACING_RATE), still sent up to twice their caps on cores that are never
# idle (the kernel forgives a late pacing timer), filled their own link's 50 ms queue and lost 30,000-40,000
# packets a run, which BBR does not back off from: 0.38 of the bound at 4 MiB. Held to a budget of 20 ms, a queue
# on the path can never hold more of them, whatever the congestion control or the pacing: no packet lost, 0.80-0.89
# of the bound. 40 ms lost packets again (243 a run; the flows that ended are counted only for a while); 10 ms ran
# 12 % slower in batches (471 ms at 4 MiB against 415-420: the sends wait on the wake-ups of 32 ranks on 2 cores).
cdef double FLIGHT_BUDGET_S = 0.02
cdef size_t FLIGHT_BUDGET_FLOOR = 16 * 1024  # so that each of 16 flows' share of a quarter of it is some bytes
FLIGHT_BUDGET_SECONDS = FLIGHT_BUDGET_S
DEFAULT_WINDOW_BYTES = 128 * 1024

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


cdef int _exchange_segments(SendOp* s, ConnState* to, const unsigned char* out, size_t out_len,
                            RecvOp* r, ConnState* frm, unsigned char* into, size_t in_len,
                            ferro_reduce_fn kernel, unsigned char* scratch, size_t itemsize, size_t segment,
                            uint64_t fingerprint, int64_t deadline,
                            const unsigned char* base=NULL) except -1 nogil:
    """Send ``out_len`` bytes to ``to`` while ``in_len`` arrive from ``frm``, one segment each way at a time.

    With a ``kernel``, each arriving segment lands in ``scratch`` and is reduced into
    ``into`` at once (while the next one is in flight on the next call); without, it
    lands in ``into``. With a ``base`` (an out-of-place reduce-scatter), ``into``
    holds nothing yet: each segment of ``base`` is copied there just before the
    arriving one is reduced into it. Both ends cut their bytes into the same
    ``segment``-sized frames.
    """
    cdef size_t pos = 0, a, b
    while pos < out_len or pos < in_len:
        a = out_len - pos if pos < out_len else 0
        b = in_len - pos if pos < in_len else 0
        if a > segment:
            a = segment
        if b > segment:
            b = segment
        if _exchange(s, to if a else NULL, out + pos, a, r, frm if b else NULL,
                     (scratch if kernel != NULL else into + pos), b, fingerprint, deadline):
            return 1
        if b and kernel != NULL:
            if base != NULL:
                memcpy(into + pos, base + pos, b)
            kernel(into + pos, scratch, b // itemsize)
        pos += segment
    return 0


cdef int _exchange_packed(ConnState** conns, ferro_step* step, unsigned char* buf, size_t block, int n,
                          unsigned char* scratch, size_t segment, uint64_t fingerprint, int64_t deadline,
                          SendOp* s, RecvOp* r) except -1 nogil:
    """A Bruck all_to_all round: the blocks ``j`` with ``j & pack_bit`` leave packed, and the arriving ones take
    their places. ``scratch`` holds twice ``step.send_len`` bytes."""
    cdef size_t j, at = 0, bit = step.pack_bit
    cdef unsigned char* inbox = scratch + step.send_len
    for j in range(<size_t>n):
        if j & bit:
            memcpy(scratch + at, buf + j * block, block)
            at += block
    if _exchange_segments(s, conns[step.send_peer], scratch, step.send_len, r, conns[step.recv_peer], inbox,
                          step.recv_len, NULL, NULL, 1, segment, fingerprint, deadline):
        return 1
    at = 0
    for j in range(<size_t>n):
        if j & bit:
            memcpy(buf + j * block, inbox + at, block)
            at += block
    return 0


cdef inline size_t _ring_piece(size_t length, size_t segment, size_t smallest, size_t itemsize) noexcept nogil:
    """The frames a streaming ring cuts a chunk of ``length`` bytes into: a ``RING_PIECES``-th of it, within
    [``smallest``, ``segment``], whole elements. Sender and receiver of a chunk cut it alike."""
    cdef size_t piece = (length + RING_PIECES - 1) // RING_PIECES
    if piece < smallest:
        piece = smallest
    if piece > segment:
        piece = segment
    piece -= piece % itemsize
    return piece if piece else itemsize


def ring_piece(size_t length, size_t segment, size_t smallest, size_t itemsize) -> int:
    """Return the frame size the streaming ring cuts a chunk of ``length`` bytes into (``ferro bench --simulate``).

    Args:
        length: The chunk's bytes.
        segment: The mesh's largest frame (``Mesh.segment_bytes``).
        smallest: The smallest frame worth its fixed cost on the link (``Mesh.piece_bytes``).
        itemsize: Bytes per element; frames hold whole elements.
    """
    if itemsize == 0:
        raise ValueError("itemsize must be at least 1")
    return _ring_piece(length, segment, smallest, itemsize)


cdef int _stream_ring(ConnState** conns, ferro_plan* plan, unsigned char* buf, const unsigned char* src,
                      size_t itemsize, int dtype, ferro_reduce_fn kernel, unsigned char* scratch, size_t segment,
                      double divisor, uint64_t fingerprint, int64_t deadline, SendOp* s, RecvOp* r,
                      size_t piece) except -1 nogil:
    """Run a ring plan as two streams: every frame leaves as soon as its bytes are ready, not a step at a time.

    The ring's step ``k + 1`` sends the chunk its step ``k`` received. Run step by step (as :func:`_run_plan`
    runs the other plans), a rank sends nothing between its last frame of a step and its left neighbour's last
    frame of that step arriving and being reduced: on a slow link every step pays a wake-up and a reduction
    with the wire idle, and a late rank delays its right neighbour's next step. Here a send cursor and a receive
    cursor walk the same plan: a piece of step ``k + 1`` leaves once the same bytes of step ``k`` have arrived and
    been reduced, so it is queued behind step ``k``'s last frames and the link never waits (gloo's chunked ring
    keeps two chunks in flight for the same reason). Each chunk is cut into :func:`_ring_piece` frames (none
    under ``piece`` bytes) so that a step's first frame is ready long before its last.

    A rank also sends at most ``RING_LEAD`` frames more than it has received, while it has frames to receive, so
    the stream is clocked by its arrivals as the step-by-step exchange was. Receiving never runs ahead into bytes
    a send still needs: the chunk that step ``k`` sends is next written by step ``k + n - 1``'s receive, which
    needs this rank's step-``k`` frame to have gone round the ring first.
    """
    cdef ferro_plan out_plan = plan[0]
    cdef ferro_plan in_plan = plan[0]
    cdef ferro_step out, inn
    cdef bint have_out = ferro_plan_next(&out_plan, &out)
    cdef bint have_in = ferro_plan_next(&in_plan, &inn)
    cdef int out_step = 0, in_step = 0
    cdef size_t out_pos = 0, in_pos = 0, a = 0, b = 0, lo, first, sent = 0, received = 0
    cdef bint sending = False, receiving = False, ready
    cdef unsigned char* at
    while True:
        if not receiving:  # first, so that a send sees every receive done so far (the last one ends the lead)
            while have_in and (inn.recv_peer < 0 or in_pos >= inn.recv_len):
                have_in = ferro_plan_next(&in_plan, &inn)
                in_step += 1
                in_pos = 0
        if not sending:
            while have_out and (out.send_peer < 0 or out_pos >= out.send_len):
                have_out = ferro_plan_next(&out_plan, &out)
                out_step += 1
                out_pos = 0
            if have_out:
                a = out.send_len - out_pos
                lo = _ring_piece(out.send_len, segment, piece, itemsize)
                if a > lo:
                    a = lo
                # Ready: the first step, the input itself, or the previous step's receive has these bytes.
                first = out.send_off + out_pos
                ready = (out_step == 0 or out.flags & FERRO_STEP_SEND_SOURCE or not have_in
                         or in_step >= out_step
                         or (in_step == out_step - 1 and (in_pos >= inn.recv_len or (
                             first >= inn.recv_off and first + a <= inn.recv_off + in_pos))))
                ready = ready and (not have_in or sent <= received + RING_LEAD)
                if ready:
                    _prepare_send(s, conns[out.send_peer],
                                  (src if out.flags & FERRO_STEP_SEND_SOURCE else buf) + first, a, fingerprint)
                    sending = True
                    sent += 1
        if not receiving and have_in:
            b = inn.recv_len - in_pos
            lo = _ring_piece(inn.recv_len, segment, piece, itemsize)
            if b > lo:
                b = lo
            _prepare_recv(r, conns[inn.recv_peer],
                          scratch if inn.flags & FERRO_STEP_REDUCE else buf + inn.recv_off + in_pos, b, fingerprint)
            receiving = True
        if not (sending or receiving):
            if have_out or have_in:
                with gil:  # a send waiting on bytes no receive will bring: a plan this executor cannot run
                    raise RuntimeError(f"ferro: ring plan stalled at send step {out_step}, receive step {in_step}")
            return 0
        run_ops(s if sending else NULL, r if receiving else NULL, deadline, True)
        if sending and s.status != ST_AGAIN:
            if s.status != ST_OK:
                return 1
            sending = False
            out_pos += a
        if receiving and r.status != ST_AGAIN:
            if r.status != ST_OK:
                return 1
            receiving = False
            received += 1
            at = buf + inn.recv_off + in_pos
            if inn.flags & FERRO_STEP_REDUCE:
                if inn.flags & FERRO_STEP_RECV_BASE:
                    memcpy(at, src + inn.recv_off + in_pos, b)
                kernel(at, scratch, b // itemsize)
            if inn.flags & FERRO_STEP_DIVIDE and divisor != 0:
                # The ring divides the chunk its last reduce-scatter step completes, which is the chunk that step
                # receives (schedule.h: divide_off/len are recv_off/len there), a frame at a time as it lands.
                ferro_divide(at, b // itemsize, dtype, divisor)
            in_pos += b


cdef int _run_plan(ConnState** conns, ferro_plan* plan, unsigned char* buf, const unsigned char* src,
                   size_t itemsize, int dtype, ferro_reduce_fn kernel, unsigned char* scratch, size_t segment,
                   double divisor, uint64_t fingerprint, int64_t deadline, SendOp* s, RecvOp* r,
                   size_t piece=0) except -1 nogil:
    """Run a schedule (``schedule.h``) on the mesh: each step's frames, reductions and MEAN's division.

    A ring plan streams (:func:`_stream_ring`), its frames no smaller than ``piece`` bytes (0: ``segment``).

    Every step exchanges its ranges segment by segment (:func:`_exchange_segments`), each arriving segment of a
    reducing step reduced at once while it is in cache. ``src`` is the read-only input of an out-of-place
    reduce-scatter (NULL otherwise).
    """
    cdef ferro_step step
    if plan.algorithm == FERRO_PLAN_RING:
        return _stream_ring(conns, plan, buf, src, itemsize, dtype, kernel, scratch, segment, divisor, fingerprint,
                            deadline, s, r, piece if piece else segment)
    while ferro_plan_next(plan, &step):
        if (step.send_peer >= 0 and conns[step.send_peer] == NULL) or (
                step.recv_peer >= 0 and conns[step.recv_peer] == NULL):
            with gil:  # a plan that reaches a peer its call did not connect (Mesh.acquire): a bug, never a skip
                raise RuntimeError(f"ferro: plan {plan.algorithm} step to rank {step.send_peer} / from rank "
                                   f"{step.recv_peer}: no connection was taken for that peer")
        if step.flags & FERRO_STEP_PACK:
            if _exchange_packed(conns, &step, buf, plan.block, plan.n, scratch, segment, fingerprint, deadline, s, r):
                return 1
            continue
        if step.send_peer >= 0 or step.recv_peer >= 0:
            if _exchange_segments(s, conns[step.send_peer] if step.send_peer >= 0 else NULL,
                                  (src if step.flags & FERRO_STEP_SEND_SOURCE else buf) + step.send_off,
                                  step.send_len, r, conns[step.recv_peer] if step.recv_peer >= 0 else NULL,
                                  buf + step.recv_off, step.recv_len,
                                  kernel if step.flags & FERRO_STEP_REDUCE else NULL, scratch, itemsize, segment,
                                  fingerprint, deadline,
                                  src + step.recv_off if step.flags & FERRO_STEP_RECV_BASE else NULL):
                return 1
        if step.flags & FERRO_STEP_DIVIDE and divisor != 0:
            ferro_divide(buf + step.divide_off, step.divide_len // itemsize, dtype, divisor)
    return 0


cdef int _ring(ConnState** conns, int rank, int n, unsigned char* buf, const size_t* starts, const size_t* ends,
               size_t itemsize, ferro_reduce_fn kernel, unsigned char* scratch, size_t segment, uint64_t fingerprint,
               int64_t deadline, SendOp* s, RecvOp* r, int phases, int dtype=-1, double divisor=0,
               const unsigned char* src=NULL, size_t piece=0) except -1 nogil:
    """Segmented ring over chunks ``[starts[i], ends[i])`` (in elements) of ``buf``: the ring's schedule, run.

    Chunks cut at bounds pass ``bounds, bounds + 1``; chunks with gaps between
    them (a piece of each host's block, in a pipelined hierarchical collective)
    pass their own ends. With ``src`` (reduce-scatter alone), the input is read
    from ``src``, never written, and ``buf`` starts empty: the first step sends
    from ``src``, and each arriving segment is reduced into a copy of ``src``'s
    made just then, so no up-front copy of the whole input is needed.

    Reduce-scatter (``PHASE_REDUCE_SCATTER``) leaves chunk ``rank`` fully reduced
    here, each segment reduced as soon as it lands; all-gather
    (``PHASE_ALL_GATHER``) then passes every rank's chunk around. Both make an allreduce. It streams
    (:func:`_stream_ring`): frames of a quarter chunk, none under ``piece`` bytes (0: ``segment``) nor over ``segment``.
    """
    cdef ferro_plan plan
    ferro_plan_init(&plan, FERRO_PLAN_RING, rank, n, 0, itemsize, starts, ends, NULL, phases, divisor != 0,
                    src != NULL)
    return _run_plan(conns, &plan, buf, src, itemsize, dtype, kernel, scratch, segment, divisor, fingerprint,
                     deadline, s, r, piece)


cdef int _recursive_doubling(ConnState** conns, int rank, int n, unsigned char* buf, size_t count, size_t itemsize,
                             int dtype, ferro_reduce_fn kernel, unsigned char* scratch, size_t segment,
                             double divisor, uint64_t fingerprint, int64_t deadline, SendOp* s,
                             RecvOp* r) except -1 nogil:
    """log2(n) whole-message exchanges; ranks beyond a power of two fold into a partner first (``schedule.h``)."""
    cdef ferro_plan plan
    ferro_plan_init(&plan, FERRO_PLAN_RECURSIVE_DOUBLING, rank, n, count, itemsize, NULL, NULL, NULL, 0,
                    divisor != 0, 0)
    return _run_plan(conns, &plan, buf, NULL, itemsize, dtype, kernel, scratch, segment, divisor, fingerprint,
                     deadline, s, r)


cdef int _halving_doubling(ConnState** conns, int rank, int n, unsigned char* buf, size_t count, size_t itemsize,
                           int dtype, ferro_reduce_fn kernel, unsigned char* scratch, size_t segment,
                           size_t* bounds, double divisor, uint64_t fingerprint, int64_t deadline,
                           SendOp* s, RecvOp* r) except -1 nogil:
    """Rabenseifner's allreduce: reduce-scatter by recursive halving, then all-gather by recursive doubling.

    It moves what the ring moves (2(p-1)/p of the message per rank) in 2 log2(p) rounds
    instead of 2(p-1). Ranks beyond a power of two p fold into a partner first, as in
    recursive doubling. ``bounds`` must hold p + 1 entries (filled here); each round is
    cut into ``segment``-byte frames, each reduced as soon as it lands. The steps are ``schedule.h``'s.
    """
    cdef ferro_plan plan
    ferro_plan_init(&plan, FERRO_PLAN_HALVING_DOUBLING, rank, n, count, itemsize, NULL, NULL, bounds, 0,
                    divisor != 0, 0)
    return _run_plan(conns, &plan, buf, NULL, itemsize, dtype, kernel, scratch, segment, divisor, fingerprint,
                     deadline, s, r)


def plan_steps(int algorithm, int rank, int n, Py_ssize_t count, Py_ssize_t itemsize, int phases=3,
               bint mean=False, bint source=False, int root=0, Py_ssize_t segment=DEFAULT_SEGMENT_BYTES):
    """Return the steps ``rank`` of ``n`` runs for a collective of ``count`` elements: ``schedule.h``'s plan.

    The same iterator the compiled executor runs, exposed for ``ferro bench --simulate`` and the tests. Each
    step is ``(send_peer, send_off, send_len, recv_peer, recv_off, recv_len, flags, pack_bit)`` in bytes; a peer
    of -1 means no message that way; ``flags`` holds ``STEP_REDUCE``, ``STEP_DIVIDE``, ``STEP_PACK`` (Bruck's
    all_to_all: the blocks whose index has ``pack_bit`` set travel, packed), ... The ring's chunks are cut
    as the allreduce cuts them (``numpy.array_split`` of ``count`` over ``n``).

    Args:
        algorithm: ``ALGORITHM_RING``, ``ALGORITHM_RECURSIVE_DOUBLING``, ``ALGORITHM_HALVING_DOUBLING``;
            broadcast's ``ALGORITHM_BINOMIAL_TREE``, ``ALGORITHM_CHAIN`` and ``ALGORITHM_SCATTER_ALL_GATHER``
            (``count`` elements from ``root``, the chain in ``segment``-byte pieces); all_gather's
            ``ALGORITHM_BRUCK``; all_to_all's ``ALGORITHM_PAIRWISE`` and ``ALGORITHM_BRUCK_ALL_TO_ALL``; the
            barrier's ``ALGORITHM_DISSEMINATION``;
            reduce's ``ALGORITHM_REDUCE_TREE``, ``ALGORITHM_REDUCE_RING_GATHER`` and ``ALGORITHM_REDUCE_CHAIN``
            (to ``root``; the chain in ``segment``-byte pieces).
            For all_gather and all_to_all, ``count`` elements is each rank's block (to each peer).
        rank: The rank whose steps to list.
        n: The world size.
        count: Elements.
        itemsize: Bytes per element.
        phases: The ring's: 1 reduce-scatter, 2 all-gather, 3 both (an allreduce).
        mean: MEAN's division included.
        source: An out-of-place reduce-scatter (the ring reads its input).
    """
    cdef ferro_plan plan
    cdef ferro_step step
    cdef size_t* bounds = <size_t*>malloc((n + 2) * sizeof(size_t))
    cdef size_t* parts = <size_t*>malloc((2 * n + 1) * sizeof(size_t))
    cdef size_t block = <size_t>count * <size_t>itemsize
    cdef int i
    if bounds == NULL or parts == NULL:
        free(bounds)
        free(parts)
        raise MemoryError()
    if not 0 <= rank < n or count < 0 or itemsize <= 0:
        free(bounds)
        free(parts)
        raise ValueError(f"no plan for rank {rank} of {n}, {count} elements of {itemsize} bytes")
    steps = []
    try:
        for i in range(n + 1):
            bounds[i] = ferro_plan_bound(count, n, i)
        if algorithm in (FERRO_PLAN_BINOMIAL_TREE, FERRO_PLAN_CHAIN, FERRO_PLAN_SCATTER_ALL_GATHER):
            if not 0 <= root < n or segment <= 0:
                raise ValueError(f"no broadcast plan from root {root} of {n} in {segment}-byte segments")
            if algorithm == FERRO_PLAN_SCATTER_ALL_GATHER:
                ferro_plan_init_scatter_all_gather(&plan, rank, n, root, count * itemsize, parts, parts + n)
            else:
                ferro_plan_init_broadcast(&plan, algorithm, rank, n, root, count * itemsize, segment)
        elif algorithm == FERRO_PLAN_BRUCK:
            ferro_plan_init_bruck(&plan, rank, n, block)
        elif algorithm == FERRO_PLAN_PAIRWISE or algorithm == FERRO_PLAN_BRUCK_ALL_TO_ALL:
            for i in range(n + 1):
                bounds[i] = <size_t>i * block
            ferro_plan_init_all_to_all(&plan, algorithm, rank, n, bounds, bounds, block)
        elif algorithm == FERRO_PLAN_DISSEMINATION:
            ferro_plan_init(&plan, algorithm, rank, n, 0, 1, NULL, NULL, NULL, 0, 0, 0)
        elif algorithm in (FERRO_PLAN_REDUCE_TREE, FERRO_PLAN_REDUCE_RING_GATHER, FERRO_PLAN_REDUCE_CHAIN):
            if not 0 <= root < n or segment < itemsize:
                raise ValueError(f"no reduce plan to root {root} of {n} in {segment}-byte segments")
            ferro_plan_init_reduce(&plan, algorithm, rank, n, root, count, itemsize, bounds, bounds + 1, mean,
                                   <size_t>(segment - segment % itemsize))
        elif algorithm == RING:
            ferro_plan_init(&plan, FERRO_PLAN_RING, rank, n, count, itemsize, bounds, bounds + 1, NULL, phases,
                            mean, source)
        else:
            ferro_plan_init(&plan, algorithm, rank, n, count, itemsize, NULL, NULL, bounds, 0, mean, 0)
        while ferro_plan_next(&plan, &step):
            steps.append((step.send_peer, step.send_off, step.send_len, step.recv_peer, step.recv_off,
                          step.recv_len, step.flags, step.pack_bit))
    finally:
        free(bounds)
        free(parts)
    return steps


STEP_REDUCE = FERRO_STEP_REDUCE
ALGORITHM_BINOMIAL_TREE = FERRO_PLAN_BINOMIAL_TREE
ALGORITHM_CHAIN = FERRO_PLAN_CHAIN
ALGORITHM_BRUCK = FERRO_PLAN_BRUCK
ALGORITHM_PAIRWISE = FERRO_PLAN_PAIRWISE
ALGORITHM_BRUCK_ALL_TO_ALL = FERRO_PLAN_BRUCK_ALL_TO_ALL
ALGORITHM_DISSEMINATION = FERRO_PLAN_DISSEMINATION
ALGORITHM_REDUCE_TREE = FERRO_PLAN_REDUCE_TREE
ALGORITHM_REDUCE_RING_GATHER = FERRO_PLAN_REDUCE_RING_GATHER
ALGORITHM_REDUCE_CHAIN = FERRO_PLAN_REDUCE_CHAIN
ALGORITHM_SCATTER_ALL_GATHER = FERRO_PLAN_SCATTER_ALL_GATHER
STEP_PACK = FERRO_STEP_PACK
STEP_SEND_SOURCE = FERRO_STEP_SEND_SOURCE
STEP_RECV_BASE = FERRO_STEP_RECV_BASE
STEP_DIVIDE = FERRO_STEP_DIVIDE


def _near_peers(int rank, int n):
    """The peers every collective but all_to_all may touch (see :class:`Mesh`)."""
    cdef int distance = 1, power = 1, extra, virtual, mask, partner_virtual
    peers = set()
    while distance < n:  # the ring, the trees, the dissemination barrier, Bruck
        peers.add((rank + distance) % n)
        peers.add((rank - distance + n) % n)
        distance *= 2
    while power * 2 <= n:  # recursive doubling and halving-doubling, as _recursive_doubling folds them
        power *= 2
    extra = n - power
    if rank < 2 * extra:
        peers.add(rank + 1 if rank % 2 == 0 else rank - 1)
    if not (rank < 2 * extra and rank % 2 == 0):
        virtual = rank // 2 if rank < 2 * extra else rank - extra
        mask = 1
        while mask < power:
            partner_virtual = virtual ^ mask
            peers.add(ferro_plan_folded_partner(partner_virtual, extra))
            mask <<= 1
    peers.discard(rank)
    return peers


cdef class Mesh:
    """A group's connections as the compiled collectives hold them, call after call: made on demand.

    It keeps the peers' C states in an array indexed by rank (NULL until
    connected) and, for the allreduce, a scratch buffer and the ring's bounds
    that grow to the largest call. A collective first connects the peers its
    algorithms may touch (through ``connector``, with the GIL), then takes those
    connections' locks for its whole run (see :meth:`acquire`).

    Which peers: every collective but all_to_all runs on the ring (rank +-1), the
    binomial trees and the dissemination barrier (rank +- 2^k), Bruck's all_gather
    (rank +- 2^k) and recursive doubling/halving (the folded partners): together
    about 2 log2(n) peers, whatever the algorithm the size picks. all_to_all
    touches every peer.

    Args:
        connections: One :class:`~ferro._core.transport.Connection` per rank, None at
            ``rank`` and at peers not connected yet.
        rank: This rank.
        latency_bytes: A message's fixed cost in bytes of the link's time (alpha / beta).
        copy_ratio: A byte copied in memory, in bytes of the link's time.
        partner_ratio: A byte sent to a new partner each step, in bytes streamed to one (see ``schedule.h``);
            :meth:`set_partner_curve` makes it depend on the call's size.
        connector: ``connector(peer, timeout) -> Connection``, called (with the GIL) for a
            peer not connected yet; None: every peer must be connected up front.

    Which plan a broadcast, all_gather or all_to_all runs comes from the closed forms of their schedules with
    those three numbers (:func:`choose`): the binomial tree's log2(n) rounds or the pipelined chain (its segment
    from the same forms), Bruck's ceil(log2 n) rounds or the ring's (all_gather) and the pairwise exchange's
    (all_to_all) n - 1 steps. The TCP backend sets them from the cost model
    (:meth:`ferro.backend.cost_model.CostModel.link_numbers`); every rank must hold the same ones.
    ``window_bytes`` (default 128 KiB) caps the bytes of small blocks the pairwise all_to_all has in flight.
    ``measured`` says the three numbers come from a fitted model (the TCP backend sets it with them); only then may
    the broadcast take a scatter and all-gather. ``segment_bytes`` (default 1 MiB, loopback's best) is the largest
    frame the ring, halving-doubling, the reduce and the tree cut their messages into; every rank must hold the same.
    ``piece_bytes`` (default: the segment, one frame a chunk up to it) is the smallest frame the streaming ring cuts a
    chunk into, so that its next step's first frame is ready while this step's last ones are on the wire; every
    rank must hold the same. On loopback a frame costs more than the wait it saves (a 1 MiB ring allreduce among 3
    ranks took 1.0-1.1 ms in quarter-chunk frames against 0.6-0.8 ms in whole ones), so only a fitted model lowers it.
    ``pace_bytes`` (bytes per second; 0, the default: none) is this rank's share of its host's link: the pairwise
    all_to_all's sends hold no more than ``FLIGHT_BUDGET_SECONDS`` of it unacknowledged together, so that a queue
    on the path never holds more of them, where fifteen flows converging on each receiver of a 100 Mbit emulated
    cluster ran at 0.5-0.6 of the line, and 31 flows paced by the kernel at 32 hosts lost tens of thousands of
    packets a run.
    ``line_pace`` (bytes per second; 0, the default: none) is the host's line: a call of ``pace_from_bytes`` (default
    4 MiB) or more, but an all_to_all, sends on its peers' connections paced to it and lifts the cap when it ends,
    so that its flows never queue at the line (``paced_calls`` counts those calls).
    """

    cdef readonly list connections
    cdef readonly int rank
    cdef readonly int n
    cdef ConnState** states
    cdef int* near            # the peers every collective but all_to_all may touch, ascending
    cdef int near_count
    cdef int* others          # every peer, ascending (all_to_all)
    cdef int* with_extra      # near and one more peer, ascending (a reduce's root, for its gather)
    cdef int* held            # the running collective's peers: near, with_extra or others
    cdef int npeers           # how many peers are held
    cdef int locked           # how many locks are taken: held's send locks, then their receive locks
    cdef unsigned char* scratch
    cdef size_t scratch_cap
    cdef size_t* bounds
    cdef public double latency_bytes
    cdef public double copy_ratio
    cdef public double partner_ratio
    # The partner ratio by size (set_partner_curve): ascending sizes, none when partner_count is 0.
    cdef double partner_sizes[PARTNER_POINTS]
    cdef double partner_ratios[PARTNER_POINTS]
    cdef readonly int partner_count
    cdef public size_t window_bytes
    cdef public size_t segment_bytes
    cdef public size_t piece_bytes
    cdef public double pace_bytes
    cdef public double line_pace
    cdef public size_t pace_from_bytes
    cdef readonly long long paced_calls
    cdef bint pacing          # the held peers' connections are paced to line_pace until release()
    cdef public bint measured
    cdef public object connector
    # Plans forced by force() (-1: chosen by the cost forms): codes of FORCEABLE_PLANS.
    cdef readonly int forced_broadcast, forced_all_gather, forced_all_to_all, forced_reduce

    def __cinit__(self, connections, int rank, double latency_bytes=DEFAULT_LATENCY_BYTES,
                  double copy_ratio=DEFAULT_COPY_RATIO, double partner_ratio=1.0, connector=None):
        cdef int i
        self.connections = list(connections)
        self.rank = rank
        self.n = len(self.connections)
        self.latency_bytes = latency_bytes
        self.copy_ratio = copy_ratio
        self.partner_ratio = partner_ratio
        self.partner_count = 0
        self.window_bytes = DEFAULT_WINDOW_BYTES
        self.segment_bytes = SEGMENT_BYTES
        self.piece_bytes = SEGMENT_BYTES
        self.pace_bytes = 0
        self.line_pace = 0
        self.pace_from_bytes = PACE_FROM
        self.paced_calls = 0
        self.pacing = False
        self.measured = False
        self.connector = connector
        self.forced_broadcast = self.forced_all_gather = self.forced_all_to_all = self.forced_reduce = -1
        if not 0 <= rank < self.n:
            raise ValueError(f"rank {rank} is outside a mesh of {self.n}")
        self.states = <ConnState**>malloc(self.n * sizeof(ConnState*))
        self.bounds = <size_t*>malloc((self.n + 1) * sizeof(size_t))
        self.near = <int*>malloc(self.n * sizeof(int))
        self.others = <int*>malloc(self.n * sizeof(int))
        self.with_extra = <int*>malloc(self.n * sizeof(int))
        if (self.states == NULL or self.bounds == NULL or self.near == NULL or self.others == NULL
                or self.with_extra == NULL):
            raise MemoryError()
        for i in range(self.n):
            self.states[i] = NULL
            if i != rank:
                self.others[i - (i > rank)] = i
                if self.connections[i] is not None:
                    self.attach(i, self.connections[i])
        self.near_count = 0
        for i in sorted(_near_peers(rank, self.n)):
            self.near[self.near_count] = i
            self.near_count += 1

    def __dealloc__(self):
        free(self.states)
        free(self.bounds)
        free(self.near)
        free(self.others)
        free(self.with_extra)
        free(self.scratch)

    def attach(self, int peer, Connection conn):
        """Make ``conn`` this mesh's connection to ``peer`` (once; the connector's result, or given up front)."""
        if not 0 <= peer < self.n or peer == self.rank:
            raise ValueError(f"rank {self.rank}: no peer {peer} in a mesh of {self.n}")
        self.connections[peer] = conn
        self.states[peer] = &conn.st

    @property
    def near_peers(self):
        """The peers every collective but all_to_all may touch, ascending."""
        return [self.near[i] for i in range(self.near_count)]

    cdef int _connect(self, int peer, double timeout) except -1:
        if self.connector is None:
            raise TypeError(f"rank {self.rank}: no connection to rank {peer} and no connector to make one")
        self.attach(peer, self.connector(peer, timeout))  # idempotent: the connector may have attached it
        return 0

    cdef int acquire(self, double timeout, str op, int extra=-1, size_t nbytes=0) except -1:
        """Connect the peers ``op`` may touch, check them and take their locks: sends, then receives, by rank.

        ``extra``: one more peer this call touches (a gather's root, which every rank sends to); on the root
        itself, every peer (it receives from each). One order everywhere, so no other thread's operation can
        deadlock against this one. On an error, whatever was taken is released again. A call of ``nbytes`` (its
        buffer) from ``pace_from_bytes`` up, where ``line_pace`` is set, sends paced to it until :meth:`release`
        (an all_to_all holds its own flows to a budget of unacknowledged bytes instead).
        """
        cdef int j, which, k = 0
        cdef bint placed = False
        cdef Connection conn
        if op == "all_to_all" or extra == self.rank:
            self.held, self.npeers = self.others, self.n - 1
        else:
            self.held, self.npeers = self.near, self.near_count
            for j in range(self.near_count):
                placed = placed or self.near[j] == extra
            if 0 <= extra < self.n and extra != self.rank and not placed:
                for j in range(self.near_count):
                    if not placed and extra < self.near[j]:
                        self.with_extra[k] = extra
                        k += 1
                        placed = True
                    self.with_extra[k] = self.near[j]
                    k += 1
                if not placed:
                    self.with_extra[k] = extra
                self.held, self.npeers = self.with_extra, self.near_count + 1
        for j in range(self.npeers):  # connecting may wait for the peer: before any lock is taken
            if self.states[self.held[j]] == NULL:
                self._connect(self.held[j], timeout)
        try:
            for j in range(self.npeers):
                (<Connection>self.connections[self.held[j]]).check_usable(op)
            for which in range(2):
                for j in range(self.npeers):
                    conn = self.connections[self.held[j]]
                    conn.lock(conn.send_lock if which == 0 else conn.recv_lock, timeout, op)
                    self.locked += 1
        except BaseException:
            self.release()
            raise
        if self.line_pace > 0 and nbytes >= self.pace_from_bytes and op != "all_to_all":
            self._pace_held(<uint64_t>self.line_pace)
            self.pacing = True
            self.paced_calls += 1
        return 0

    cdef void _pace_held(self, uint64_t rate) noexcept:
        """Cap the held peers' connections at ``rate`` bytes a second (``SO_MAX_PACING_RATE``; ``NO_PACE``: no cap)."""
        cdef int j
        for j in range(self.npeers):
            if self.states[self.held[j]] != NULL:
                setsockopt(self.states[self.held[j]].fd, SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof(uint64_t))

    cdef void release(self) noexcept:
        cdef int t
        cdef Connection conn
        if self.pacing:  # lifted before the locks go, so the next call on these connections starts unpaced
            self._pace_held(NO_PACE)
            self.pacing = False
        for t in range(self.locked):  # in the order taken: the send locks, then the receive locks
            conn = self.connections[self.held[t % self.npeers]]
            PyThread_release_lock(conn.send_lock if t < self.npeers else conn.recv_lock)
        self.locked = 0

    cdef double partner(self, size_t nbytes) noexcept nogil:
        """The partner ratio for a call of ``nbytes``: the curve's, interpolated on log sizes, held flat past its
        ends; ``partner_ratio`` without one. Every rank computes the same double from the same curve."""
        cdef int i
        cdef double x = <double>nbytes, share
        if self.partner_count == 0:
            return self.partner_ratio
        if x <= self.partner_sizes[0]:
            return self.partner_ratios[0]
        for i in range(1, self.partner_count):
            if x <= self.partner_sizes[i]:
                share = log(x / self.partner_sizes[i - 1]) / log(self.partner_sizes[i] / self.partner_sizes[i - 1])
                return self.partner_ratios[i - 1] + share * (self.partner_ratios[i] - self.partner_ratios[i - 1])
        return self.partner_ratios[self.partner_count - 1]

    def set_partner_curve(self, points) -> None:
        """Make the partner ratio depend on the call's size: ``[(bytes, ratio), ...]``, sizes ascending.

        ``ferro.backend.cost_model.CostModel.partner_curve`` measures it: a new partner each step costs nothing
        extra for small messages and up to 2.3x a byte at 1 MiB on the emulated clusters. Empty: one ratio again.

        Raises:
            ValueError: More than 64 points, sizes not ascending and positive, or a ratio below 1.
        """
        cdef int i
        points = [(float(size), float(ratio)) for size, ratio in points]
        if len(points) > PARTNER_POINTS:
            raise ValueError(f"a partner curve holds at most {PARTNER_POINTS} points, not {len(points)}")
        if any(size <= 0 or ratio < 1.0 for size, ratio in points) or any(
                a[0] >= b[0] for a, b in zip(points, points[1:])):
            raise ValueError(f"a partner curve's sizes ascend from above 0 and its ratios are 1 or more: {points}")
        for i, (size, ratio) in enumerate(points):
            self.partner_sizes[i] = size
            self.partner_ratios[i] = ratio
        self.partner_count = len(points)

    def partner_curve(self) -> list:
        """The points :meth:`set_partner_curve` set (empty: ``partner_ratio`` at every size)."""
        return [(int(self.partner_sizes[i]), self.partner_ratios[i]) for i in range(self.partner_count)]

    def partner_at(self, size_t nbytes) -> float:
        """The partner ratio a call of ``nbytes`` chooses its plan with."""
        return self.partner(nbytes)

    cdef inline int broadcast_plan(self, size_t nbytes) noexcept nogil:
        if self.forced_broadcast >= 0:
            return self.forced_broadcast
        return _broadcast_plan(nbytes, self.n, self.latency_bytes, self.partner(nbytes), self.measured)

    cdef inline bint bruck(self, size_t total) noexcept nogil:
        if self.forced_all_gather >= 0:
            return self.forced_all_gather == 2
        return _prefer_bruck_all_gather(total, self.n, self.latency_bytes, self.copy_ratio, self.partner(total))

    cdef inline bint bruck_all_to_all(self, size_t total) noexcept nogil:
        if self.forced_all_to_all >= 0:
            return self.forced_all_to_all == 2
        return _prefer_bruck_all_to_all(total, self.n, self.latency_bytes, self.copy_ratio, self.partner(total))

    cdef inline int reduce_plan(self, size_t nbytes) noexcept nogil:
        if self.forced_reduce >= 0:
            return self.forced_reduce
        return _reduce_plan(nbytes, self.n, self.latency_bytes, self.partner(nbytes))

    def force(self, str op, name) -> None:
        """Run plan ``name`` (one of :data:`FORCEABLE_PLANS`' for ``op``) for every ``op`` call; None: choose again.

        Every rank of the group must force the same (the TCP backend checks at rendezvous, see
        :meth:`plan_settings`). all_to_all's Bruck applies to calls of equal blocks; uneven ones stay pairwise.

        Raises:
            ValueError: Not an op with plans to force, or not one of its plans.
        """
        if op not in FORCEABLE_PLANS:
            raise ValueError(f"no plan can be forced for {op!r}; these ops have plans: {', '.join(FORCEABLE_PLANS)}")
        plans = FORCEABLE_PLANS[op]
        if name is not None and name not in plans:
            raise ValueError(f"{op} has no plan {name!r}; use one of {', '.join(plans)}")
        code = -1 if name is None else plans[name]
        if op == "broadcast":
            self.forced_broadcast = code
        elif op == "all_gather":
            self.forced_all_gather = code
        elif op == "all_to_all":
            self.forced_all_to_all = code
        else:
            self.forced_reduce = code

    def _forced_codes(self) -> dict:
        return {"broadcast": self.forced_broadcast, "all_gather": self.forced_all_gather,
                "all_to_all": self.forced_all_to_all, "reduce": self.forced_reduce}

    def forced(self) -> dict:
        """The plans :meth:`force` set, by op: ``{"broadcast": "pipelined_chain"}``."""
        return {op: next(name for name, c in FORCEABLE_PLANS[op].items() if c == code)
                for op, code in self._forced_codes().items() if code >= 0}

    def plan_settings(self) -> str:
        """What decides this mesh's plans and frames, as text equal on ranks that decide alike: the link's numbers
        and partner curve, whether they were measured, the segment and the ring's smallest frame, the forced plans."""
        forced = ",".join(f"{op}={name}" for op, name in sorted(self.forced().items())) or "none"
        curve = "".join(f" {size}:{ratio!r}" for size, ratio in self.partner_curve())
        by_size = f" (partner ratio by size{curve})" if curve else ""
        return (f"link numbers {self.latency_bytes!r}/{self.copy_ratio!r}/{self.partner_ratio!r}{by_size}"
                f"{' (measured)' if self.measured else ''}, segments of {self.segment_bytes} bytes "
                f"(ring frames from {self.piece_bytes}), forced plans {forced}")

    def choose(self, str op, size_t nbytes) -> str:
        """Name the plan this mesh runs for ``op`` of ``nbytes``: the forced one, else the module's :func:`choose`."""
        code = self._forced_codes().get(op, -1)
        if code >= 0:
            return _FORCED_NAMES[op][code]
        return choose(op, nbytes, self.n, self.latency_bytes, self.copy_ratio, self.partner(nbytes), self.measured)

    cdef unsigned char* scratch_for(self, size_t nbytes) except NULL:
        """A scratch buffer of at least ``nbytes`` (while the locks are held)."""
        cdef unsigned char* grown
        if nbytes > self.scratch_cap or self.scratch == NULL:
            grown = <unsigned char*>malloc(nbytes if nbytes else 1)
            if grown == NULL:
                raise MemoryError()
            free(self.scratch)
            self.scratch = grown
            self.scratch_cap = nbytes
        return self.scratch

    cdef int prepare_allreduce(self, size_t count, size_t itemsize, int algorithm, size_t segment) except -1:
        """Scratch (and the ring's chunk bounds) for an allreduce of ``count`` elements."""
        cdef int i
        if algorithm == RECURSIVE_DOUBLING:
            self.scratch_for(count * itemsize)
        elif algorithm == HALVING_DOUBLING:
            self.scratch_for(min(segment, count * itemsize))  # bounds: filled by the algorithm (n + 1 >= p + 1)
        else:
            for i in range(self.n + 1):
                self.bounds[i] = ferro_plan_bound(count, self.n, i)
            self.scratch_for(min(segment, count * itemsize))
        return 0


cdef int _allreduce_locked(Mesh mesh, unsigned char* buf, size_t count, size_t itemsize, int dtype,
                           ferro_reduce_fn kernel, uint64_t fingerprint, int64_t deadline, int algorithm,
                           size_t segment, double divisor, SendOp* s, RecvOp* r) except -1 nogil:
    """The allreduce itself, once :meth:`Mesh.prepare_allreduce` ran and the locks are held."""
    cdef int rc
    if algorithm == RECURSIVE_DOUBLING:
        return _recursive_doubling(mesh.states, mesh.rank, mesh.n, buf, count, itemsize, dtype, kernel,
                                   mesh.scratch, segment, divisor, fingerprint, deadline, s, r)
    if algorithm == HALVING_DOUBLING:
        return _halving_doubling(mesh.states, mesh.rank, mesh.n, buf, count, itemsize, dtype, kernel, mesh.scratch,
                                 segment, mesh.bounds, divisor, fingerprint, deadline, s, r)
    return _ring(mesh.states, mesh.rank, mesh.n, buf, mesh.bounds, mesh.bounds + 1, itemsize, kernel, mesh.scratch, segment,
                 fingerprint, deadline, s, r, PHASE_REDUCE_SCATTER | PHASE_ALL_GATHER, dtype, divisor, NULL,
                 mesh.piece_bytes)


cdef class _Call:
    """What one native collective holds while it runs: the buffer and the mesh's locks."""

    cdef Mesh mesh
    cdef ConnState** states
    cdef int rank
    cdef int n
    cdef Py_buffer view       # the writable buffer the collective works in
    cdef bint has_view
    cdef Py_buffer input      # a read-only input, for collectives with separate in and out buffers
    cdef bint has_input
    cdef bint holds           # the mesh's locks are taken
    cdef unsigned char* scratch
    cdef size_t* bounds

    def __cinit__(self):
        self.has_view = False
        self.has_input = False
        self.holds = False
        self.scratch = NULL
        self.bounds = NULL

    cdef int take(self, Mesh mesh, buf, double timeout, str op, int extra=-1) except -1:
        self.take_view(mesh, buf)
        return self.hold(timeout, op, extra)

    cdef int take_view(self, Mesh mesh, buf) except -1:
        """The call's writable buffer, before its peers are held (a plan may depend on the buffer's size)."""
        self.mesh = mesh
        self.states = mesh.states
        self.rank = mesh.rank
        self.n = mesh.n
        PyObject_GetBuffer(buf, &self.view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        self.has_view = True
        return 0

    cdef int hold(self, double timeout, str op, int extra=-1) except -1:
        """Connect and lock the peers ``op`` touches, ``extra`` too (see :meth:`Mesh.acquire`)."""
        self.mesh.acquire(timeout, op, extra, <size_t>self.view.len if self.has_view else 0)
        self.holds = True
        return 0

    cdef Py_ssize_t elements(self, str op, Py_ssize_t itemsize) except -1:
        """The buffer's length in whole ``itemsize``-byte elements (else InvalidBufferError)."""
        if self.view.len % itemsize:
            raise InvalidBufferError(f"{op}: {self.view.len} bytes is not a whole number of {itemsize}-byte elements")
        return self.view.len // itemsize

    cdef int take_input(self, buf) except -1:
        PyObject_GetBuffer(buf, &self.input, PyBUF_C_CONTIGUOUS)
        self.has_input = True
        return 0

    cdef int set_bounds(self, object offsets) except -1:
        cdef Py_ssize_t i, count = len(offsets)
        self.bounds = <size_t*>malloc(count * sizeof(size_t))
        if self.bounds == NULL:
            raise MemoryError()
        for i in range(count):
            self.bounds[i] = offsets[i]
        return 0

    cdef int make_scratch(self, size_t nbytes) except -1:
        self.scratch = <unsigned char*>malloc(nbytes if nbytes else 1)
        if self.scratch == NULL:
            raise MemoryError()
        return 0

    cdef void release(self):
        if self.holds:
            self.mesh.release()
            self.holds = False
        free(self.scratch)
        free(self.bounds)
        self.scratch = NULL
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


def allreduce(Mesh mesh, buf, int dtype, int op, Py_ssize_t itemsize, uint64_t fingerprint, double timeout,
              int algorithm, Py_ssize_t segment_bytes=0, double divisor=0) -> None:
    """Allreduce ``buf`` in place over the mesh.

    Args:
        mesh: The group's :class:`Mesh`.
        buf: Writable C-contiguous buffer of ``itemsize``-byte elements.
        dtype: ``FERRO_*`` dtype code.
        op: ``FERRO_*`` op code (MEAN's division is the caller's).
        itemsize: Bytes per element.
        fingerprint: The call's fingerprint, carried by every frame.
        timeout: Seconds for the whole collective.
        algorithm: ``ALGORITHM_RING``, ``ALGORITHM_RECURSIVE_DOUBLING`` or ``ALGORITHM_HALVING_DOUBLING``.
        segment_bytes: Ring segment size (0: the mesh's ``segment_bytes``); every rank must use the same.
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
    cdef size_t segment = _segment_size(segment_bytes or <Py_ssize_t>mesh.segment_bytes, itemsize), count, nbytes
    cdef int64_t deadline
    cdef int rc = 0
    if kernel == NULL:
        raise ValueError(f"no reduction kernel for dtype code {dtype} and op code {op}")
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    try:
        call.take(mesh, buf, timeout, "allreduce")
        count = <size_t>call.elements("allreduce", itemsize)
        nbytes = count * <size_t>itemsize
        if mesh.n < 2 or count == 0:
            return
        mesh.prepare_allreduce(count, itemsize, algorithm, segment)
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            rc = _allreduce_locked(mesh, <unsigned char*>call.view.buf, count, itemsize, dtype, kernel, fingerprint,
                                   deadline, algorithm, segment, divisor, &s, &r)
    finally:
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "allreduce", timeout)


def ring(Mesh mesh, buf, object bounds, int dtype, int op, Py_ssize_t itemsize,
         uint64_t fingerprint, double timeout, bint reduce_scatter, bint all_gather,
         Py_ssize_t segment_bytes=0, double divisor=0, object ends=None,
         object source=None) -> None:
    """Run a ring reduce-scatter and/or all-gather in place on ``buf``.

    Args:
        mesh: The group's :class:`Mesh`.
        buf: Writable C-contiguous buffer.
        bounds: ``n + 1`` element offsets: chunk ``i`` is ``[bounds[i], bounds[i+1])``;
            with ``ends``, ``n`` starts: chunk ``i`` is ``[bounds[i], ends[i])``.
        dtype: ``FERRO_*`` dtype code (any value when only gathering).
        op: ``FERRO_*`` op code (any value when only gathering).
        itemsize: Bytes per element.
        fingerprint: The call's fingerprint.
        timeout: Seconds for the whole collective.
        reduce_scatter: Reduce so that chunk ``rank`` ends complete here.
        all_gather: Then (or only) circulate every rank's chunk ``i`` to all.
        segment_bytes: Segment size (0: the mesh's ``segment_bytes``); every rank must use the same.
        divisor: When not 0 (MEAN), divide chunk ``rank`` by it once it is reduced.
        ends: ``n`` element offsets where the chunks end, for chunks with gaps
            between them (None: each chunk ends where the next begins).
        source: For a reduce-scatter alone, the input (read-only, ``buf``'s
            size): ``buf`` is then scratch that needs no copy of it first.
    """
    cdef _Call call = _Call()
    cdef SendOp s
    cdef RecvOp r
    cdef ferro_reduce_fn kernel = NULL
    cdef size_t segment = _segment_size(segment_bytes or <Py_ssize_t>mesh.segment_bytes, itemsize), largest = 0
    cdef size_t* chunk_ends
    cdef int64_t deadline
    cdef int rc = 0, n = mesh.n, i
    cdef int phases = (PHASE_REDUCE_SCATTER if reduce_scatter else 0) | (PHASE_ALL_GATHER if all_gather else 0)
    if reduce_scatter:
        kernel = ferro_reduce_kernel(dtype, op)
        if kernel == NULL:
            raise ValueError(f"no reduction kernel for dtype code {dtype} and op code {op}")
    if ends is None and len(bounds) != n + 1:
        raise ValueError(f"ring: {n + 1} bounds needed, got {len(bounds)}")
    if ends is not None and (len(bounds) != n or len(ends) != n):
        raise ValueError(f"ring: {n} starts and {n} ends needed, got {len(bounds)} and {len(ends)}")
    cdef const unsigned char* src = NULL
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    try:
        call.take(mesh, buf, timeout, "ring")
        if source is not None:
            if all_gather or not reduce_scatter:
                raise ValueError("ring: a source is for a reduce-scatter alone")
            call.take_input(source)
            if call.input.len != call.view.len:
                raise InvalidBufferError(f"ring: the source has {call.input.len} bytes, the buffer {call.view.len}")
            src = <const unsigned char*>call.input.buf
            if <const void*>src == <const void*>call.view.buf:
                src = NULL  # the input is the buffer itself: the in-place ring (and no copy onto itself)
        if n < 2 or phases == 0:
            if src != NULL:
                memcpy(call.view.buf, src, call.view.len)
            return
        call.set_bounds(bounds if ends is None else [*bounds, *ends])
        chunk_ends = call.bounds + (1 if ends is None else n)
        for i in range(n):
            if chunk_ends[i] < call.bounds[i] or chunk_ends[i] * itemsize > <size_t>call.view.len:
                raise InvalidBufferError(f"ring: chunk {i} [{call.bounds[i]}, {chunk_ends[i]}) does not fit a "
                                         f"{call.view.len}-byte buffer of {itemsize}-byte elements")
            largest = max(largest, (chunk_ends[i] - call.bounds[i]) * itemsize)
        call.make_scratch(min(segment, largest))
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            rc = _ring(call.states, mesh.rank, n, <unsigned char*>call.view.buf, call.bounds, chunk_ends, itemsize,
                       kernel, call.scratch, segment, fingerprint, deadline, &s, &r, phases, dtype, divisor, src,
                       mesh.piece_bytes)
    finally:
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "ring", timeout)


cdef int _all_gather_bruck(ConnState** conns, int rank, int n, unsigned char* out, size_t nbytes,
                           unsigned char* blocks, uint64_t fingerprint, int64_t deadline, SendOp* s,
                           RecvOp* r) except -1 nogil:
    """Bruck's all-gather of ``nbytes`` per rank into ``out``: ceil(log2 n) rounds, any n (``schedule.h``).

    ``blocks`` (``n * nbytes``) holds the blocks in this rank's order: block ``j`` is
    rank ``rank + j``'s. Round ``k`` sends the first ``min(2^k, n - 2^k)`` blocks to
    rank ``rank - 2^k`` while as many arrive from rank ``rank + 2^k``; a rotation
    puts them in rank order at the end.
    """
    cdef ferro_plan plan
    memcpy(blocks, out + <size_t>rank * nbytes, nbytes)
    ferro_plan_init_bruck(&plan, rank, n, nbytes)
    if _run_plan(conns, &plan, blocks, NULL, 1, -1, NULL, NULL, SEGMENT_BYTES, 0, fingerprint, deadline, s, r):
        return 1
    memcpy(out + <size_t>rank * nbytes, blocks, <size_t>(n - rank) * nbytes)
    memcpy(out, blocks + <size_t>(n - rank) * nbytes, <size_t>rank * nbytes)
    return 0


cdef int _all_gather_locked(Mesh mesh, unsigned char* out, size_t nbytes, uint64_t fingerprint, double timeout,
                            SendOp* s, RecvOp* r) except -1:
    """Gather ``nbytes`` from every rank into ``out`` (this rank's part already there): Bruck or the ring.

    Called with the mesh's locks held; returns 1 on a transport failure (see ``s``, ``r``).
    """
    cdef int rc, i
    cdef unsigned char* blocks
    cdef int64_t deadline
    cdef bint bruck = mesh.bruck(nbytes * <size_t>mesh.n)
    fingerprint = _with_plan(fingerprint, 2 if bruck else 1)
    if bruck:
        blocks = mesh.scratch_for(nbytes * <size_t>mesh.n)
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            rc = _all_gather_bruck(mesh.states, mesh.rank, mesh.n, out, nbytes, blocks, fingerprint, deadline, s, r)
        return rc
    for i in range(mesh.n + 1):
        mesh.bounds[i] = i * nbytes
    deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
    with nogil:
        rc = _ring(mesh.states, mesh.rank, mesh.n, out, mesh.bounds, mesh.bounds + 1, 1, NULL, NULL, mesh.segment_bytes,
                   fingerprint, deadline, s, r, PHASE_ALL_GATHER, -1, 0, NULL, mesh.piece_bytes)
    return rc


def all_gather(Mesh mesh, buf, Py_ssize_t nbytes, uint64_t fingerprint, double timeout) -> None:
    """Gather ``nbytes`` per rank in place: ``buf`` holds ``n * nbytes``, this rank's part at ``rank * nbytes``.

    Bruck's algorithm for small totals (see :class:`Mesh`), the segmented ring above.
    """
    cdef _Call call = _Call()
    cdef SendOp s
    cdef RecvOp r
    cdef int rc = 0
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    try:
        call.take(mesh, buf, timeout, "all_gather")
        if nbytes < 0 or <size_t>nbytes * <size_t>mesh.n > <size_t>call.view.len:
            raise InvalidBufferError(f"all_gather: {mesh.n} parts of {nbytes} bytes do not fit a "
                                     f"{call.view.len}-byte buffer")
        if mesh.n < 2 or nbytes == 0:
            return
        rc = _all_gather_locked(mesh, <unsigned char*>call.view.buf, <size_t>nbytes, fingerprint, timeout, &s, &r)
    finally:
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "all_gather", timeout)


cdef int _broadcast_tree(ConnState** conns, int rank, int n, int root, unsigned char* buf, size_t nbytes,
                         size_t segment, uint64_t fingerprint, int64_t deadline, SendOp* s,
                         RecvOp* r) except -1 nogil:
    """Binomial tree: receive once from the parent, then send to each child; log2(n) rounds (``schedule.h``)."""
    cdef ferro_plan plan
    ferro_plan_init_broadcast(&plan, FERRO_PLAN_BINOMIAL_TREE, rank, n, root, nbytes, segment)
    return _run_plan(conns, &plan, buf, NULL, 1, -1, NULL, NULL, segment, 0, fingerprint, deadline, s, r)


cdef int _broadcast_chain(ConnState** conns, int rank, int n, int root, unsigned char* buf, size_t nbytes,
                          size_t segment, uint64_t fingerprint, int64_t deadline, SendOp* s,
                          RecvOp* r) except -1 nogil:
    """Pipelined chain root -> root+1 -> ...: forward segment i-1 while segment i arrives (``schedule.h``)."""
    cdef ferro_plan plan
    ferro_plan_init_broadcast(&plan, FERRO_PLAN_CHAIN, rank, n, root, nbytes, segment)
    return _run_plan(conns, &plan, buf, NULL, 1, -1, NULL, NULL, segment, 0, fingerprint, deadline, s, r)


cdef int _broadcast_scatter_all_gather(Mesh mesh, int root, unsigned char* buf, size_t nbytes, size_t segment,
                                       uint64_t fingerprint, int64_t deadline, SendOp* s, RecvOp* r) except -1 nogil:
    """A binomial scatter of the message's n parts, then the ring's all-gather of them (``schedule.h``)."""
    cdef ferro_plan plan
    cdef size_t* parts = <size_t*>malloc(2 * <size_t>mesh.n * sizeof(size_t))
    cdef int rc
    if parts == NULL:
        with gil:
            raise MemoryError()
    try:
        ferro_plan_init_scatter_all_gather(&plan, mesh.rank, mesh.n, root, nbytes, parts, parts + mesh.n)
        rc = _run_plan(mesh.states, &plan, buf, NULL, 1, -1, NULL, NULL, segment, 0, fingerprint, deadline, s, r)
    finally:
        free(parts)  # _run_plan raises for a peer the call did not connect
    return rc


cdef int _broadcast_locked(Mesh mesh, int root, unsigned char* buf, size_t nbytes, size_t segment,
                           uint64_t fingerprint, int64_t deadline, SendOp* s, RecvOp* r, int plan=-1) except -1 nogil:
    if plan < 0:
        plan = mesh.broadcast_plan(nbytes)
    if plan == FERRO_PLAN_CHAIN:
        return _broadcast_chain(mesh.states, mesh.rank, mesh.n, root, buf, nbytes,
                                ferro_chain_segment(nbytes, mesh.n, mesh.latency_bytes, CHAIN_SMALLEST,
                                                    CHAIN_LARGEST), _with_plan(fingerprint, 2), deadline, s, r)
    if plan == FERRO_PLAN_SCATTER_ALL_GATHER:
        return _broadcast_scatter_all_gather(mesh, root, buf, nbytes, segment, _with_plan(fingerprint, 3), deadline,
                                             s, r)
    return _broadcast_tree(mesh.states, mesh.rank, mesh.n, root, buf, nbytes, segment, _with_plan(fingerprint, 1),
                           deadline, s, r)


def broadcast(Mesh mesh, buf, int root, uint64_t fingerprint, double timeout,
              Py_ssize_t segment_bytes=0, int algorithm=-1) -> None:
    """Broadcast ``buf`` (bytes) from ``root`` in place: binomial tree, pipelined chain, or a scatter and all-gather
    (see :class:`Mesh`), or ``algorithm`` (one of :data:`BROADCAST_PLANS`, the same on every rank) when not -1.

    The tree's frames are ``segment_bytes`` long; the chain's segment is :func:`chain_segment`'s.
    """
    cdef _Call call = _Call()
    cdef SendOp s
    cdef RecvOp r
    cdef int rc = 0
    cdef int64_t deadline
    cdef size_t segment = _segment_size(segment_bytes or <Py_ssize_t>mesh.segment_bytes, 1)
    if algorithm != -1 and algorithm not in _BROADCAST_PLAN_NAMES:
        raise ValueError(f"broadcast: no plan with code {algorithm}")
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    try:
        call.take(mesh, buf, timeout, "broadcast")
        if mesh.n < 2 or call.view.len == 0:
            return
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            rc = _broadcast_locked(mesh, root, <unsigned char*>call.view.buf, <size_t>call.view.len, segment,
                                   fingerprint, deadline, &s, &r, algorithm)
    finally:
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "broadcast", timeout)


cdef size_t _prepare_reduce(Mesh mesh, ferro_plan* plan, int algorithm, int root, size_t count, size_t itemsize,
                            bint divides) except 0:
    """Fill ``plan`` for a reduce of ``count`` elements by ``algorithm`` and size the mesh's scratch for it.

    The mesh's locks must be held (its scratch and bounds are the call's). Returns the plan's segment.
    """
    cdef size_t nbytes = count * itemsize
    cdef size_t segment = mesh.segment_bytes
    if algorithm == FERRO_PLAN_REDUCE_CHAIN:  # one frame per step, as the chain's form counts
        segment = ferro_chain_segment(nbytes, mesh.n, mesh.latency_bytes, CHAIN_SMALLEST, CHAIN_LARGEST)
    segment = max(segment - segment % itemsize, itemsize)
    if algorithm == FERRO_PLAN_REDUCE_RING_GATHER:
        mesh.prepare_allreduce(count, itemsize, RING, segment)
    else:
        mesh.scratch_for(min(segment, nbytes))
    ferro_plan_init_reduce(plan, algorithm, mesh.rank, mesh.n, root, count, itemsize, mesh.bounds, mesh.bounds + 1,
                           divides, segment)
    return segment


def reduce(Mesh mesh, buf, int root, int dtype, int op, Py_ssize_t itemsize, uint64_t fingerprint, double timeout,
           double divisor=0, int algorithm=-1) -> None:
    """Reduce every rank's ``buf`` into ``buf`` on ``root``; the others' ``buf`` is scratch (left partly reduced).

    The binomial tree (log2(n) rounds of the whole message) for small messages; for large ones the pipelined
    chain (each link carries the message once) or the ring's reduce-scatter and a gather of its chunks to the
    root: the mesh's cost forms choose (:func:`choose`), or ``algorithm`` (one of :data:`REDUCE_PLANS`) when not
    -1. The reduction order is fixed, so the root's result is the same bits on every run.

    Args:
        mesh: The group's mesh.
        buf: A writable C-contiguous buffer of ``itemsize``-byte elements.
        root: The rank that ends with the result.
        dtype: The dtype code (``reduce_kernels.h``).
        op: The kernel's op code.
        itemsize: Bytes per element.
        fingerprint: The call's fingerprint, carried by every frame.
        timeout: Seconds for the whole collective.
        divisor: When not 0, the root's result is divided by it (MEAN), each element once.
        algorithm: Force a plan (every rank must force the same), or -1.

    Raises:
        The transport's errors, InvalidBufferError for a bad buffer, ValueError for a bad root or algorithm.
    """
    cdef _Call call = _Call()
    cdef SendOp s
    cdef RecvOp r
    cdef ferro_reduce_fn kernel = ferro_reduce_kernel(dtype, op)
    cdef size_t count, segment
    cdef int64_t deadline
    cdef int rc = 0
    cdef ferro_plan plan
    if kernel == NULL:
        raise ValueError(f"no reduction kernel for dtype code {dtype} and op code {op}")
    if not 0 <= root < mesh.n:
        raise ValueError(f"reduce: root {root} is not a rank of a group of {mesh.n}")
    if algorithm != -1 and algorithm not in _REDUCE_PLAN_NAMES:
        raise ValueError(f"reduce: no plan with code {algorithm}")
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    try:
        call.take_view(mesh, buf)
        if algorithm == -1:
            algorithm = mesh.reduce_plan(<size_t>call.view.len)
        # The ring-and-gather's gather reaches the root from every rank: it is held too.
        call.hold(timeout, "reduce", root if algorithm == FERRO_PLAN_REDUCE_RING_GATHER else -1)
        count = <size_t>call.elements("reduce", itemsize)
        if mesh.n < 2 or count == 0:
            return
        segment = _prepare_reduce(mesh, &plan, algorithm, root, count, <size_t>itemsize, divisor != 0)
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            rc = _run_plan(mesh.states, &plan, <unsigned char*>call.view.buf, NULL, itemsize, dtype, kernel,
                           mesh.scratch, segment, divisor, fingerprint, deadline, &s, &r)
    finally:
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "reduce", timeout)


cdef int _pairwise_windows(ConnState** conns, ferro_plan* plan, const unsigned char* out, unsigned char* into,
                           SendOp* sends, RecvOp* recvs, pollfd* fds, size_t window_bytes, uint64_t fingerprint,
                           int64_t deadline, SendOp* s, RecvOp* r, size_t budget, double pace) except -1 nogil:
    """Run the pairwise exchange's steps in a sliding window of up to ``PAIRWISE_WINDOW``, each block one frame.

    Every step touches its own pair of peers, so the steps in flight share no connection's direction. ``sends``
    and ``recvs`` hold ``PAIRWISE_WINDOW`` slots each, a step in the same slot of both. A step starts as soon as
    the steps in flight leave it room, so a link never waits for the slowest flow of a batch:

    * a small block (fewer bytes than ``window_bytes``; under a budget, than ``BUDGETED_LARGE_BYTES`` too) when
      the steps in flight hold no more than ``window_bytes`` with it (one always may start);
    * a large one when fewer than ``LARGE_STEPS_IN_FLIGHT`` steps are in flight (under a budget; without one,
      ``PAIRWISE_WINDOW``).

    With a ``budget`` (bytes; 0: none, see :func:`_flight_budget`) the sends hold at most that many unacknowledged
    together (``run_until``'s budget; ``pace``, bytes per second, is how fast they drain), counted over the flows
    of the last ``PAIRWISE_WINDOW`` steps: slots are reused in turn, the one whose flow ended longest ago first.

    On a failure, ``s`` and ``r`` receive the ops that failed first (not the ones stopped because of them).
    """
    cdef ferro_step step
    cdef int i, running = 0, next_slot = 0
    cdef bint have = False   # ``step`` came from the plan and has not started
    cdef bint room
    cdef size_t moving = 0, size = 0
    cdef size_t large_from = min(window_bytes, BUDGETED_LARGE_BYTES) if budget > 0 else window_bytes
    cdef int large_steps = LARGE_STEPS_IN_FLIGHT if budget > 0 else PAIRWISE_WINDOW
    cdef bint busy[PAIRWISE_WINDOW]
    cdef size_t slot_bytes[PAIRWISE_WINDOW]
    for i in range(PAIRWISE_WINDOW):
        sends[i].status = ST_OK
        sends[i].conn = NULL  # no flow yet: the budget counts none here
        recvs[i].status = ST_OK
        busy[i] = False
    while True:
        if not have:
            have = ferro_plan_next(plan, &step)
            if have:
                size = max(step.send_len, step.recv_len)
        if have:
            if size < large_from:
                room = running < PAIRWISE_WINDOW and (running == 0 or moving + size <= window_bytes)
            else:
                room = running < large_steps
            if room:
                i = next_slot
                while busy[i]:
                    i = (i + 1) % PAIRWISE_WINDOW
                next_slot = (i + 1) % PAIRWISE_WINDOW
                _prepare_send(&sends[i], conns[step.send_peer], out + step.send_off, step.send_len, fingerprint)
                _prepare_recv(&recvs[i], conns[step.recv_peer], into + step.recv_off, step.recv_len, fingerprint)
                sends[i].status = ST_AGAIN
                recvs[i].status = ST_AGAIN
                busy[i] = True
                slot_bytes[i] = size
                moving += size
                running += 1
                have = False
                continue
        if running == 0:
            return 0
        # Wait for one step to end (room for the next), or for all (at the end).
        if run_until(sends, PAIRWISE_WINDOW, recvs, PAIRWISE_WINDOW, fds, deadline, have, budget, pace) < 0:
            return -1
        if _window_failed(sends, recvs, PAIRWISE_WINDOW, s, r):
            return 1
        for i in range(PAIRWISE_WINDOW):
            if busy[i] and sends[i].status != ST_AGAIN and recvs[i].status != ST_AGAIN:
                busy[i] = False
                moving -= slot_bytes[i]
                running -= 1


cdef size_t _flight_budget(double pace, size_t sending) noexcept nogil:
    """The bytes a pairwise all_to_all that sends ``sending`` bytes may hold unacknowledged at a share of ``pace``
    bytes per second of its link (``FLIGHT_BUDGET_S`` of it, at least ``FLIGHT_BUDGET_FLOOR``); 0, no budget,
    without a pace or where the call's bytes fit in it: its flows then cannot hold more, and a budget costs a
    system call per flow each time the sends look. At 32x1@100mbit a 64 KiB call under the budget it could not
    exceed took 23.8 ms against 12.8 without one (32 ranks' system calls on 2 cores)."""
    if pace <= 0:
        return 0
    cdef size_t budget = max(<size_t>(pace * FLIGHT_BUDGET_S), FLIGHT_BUDGET_FLOOR)
    return budget if sending > budget else 0


cdef bint _window_failed(SendOp* sends, RecvOp* recvs, int count, SendOp* s, RecvOp* r) noexcept nogil:
    """Whether any of these ops failed; if so ``s`` and ``r`` receive the first failures (see :func:`_first_failed`)."""
    cdef int failed_send = _first_failed(sends, NULL, count)
    cdef int failed_recv = _first_failed(NULL, recvs, count)
    if failed_send >= 0:
        memcpy(s, &sends[failed_send], sizeof(SendOp))
    if failed_recv >= 0:
        memcpy(r, &recvs[failed_recv], sizeof(RecvOp))
    return failed_send >= 0 or failed_recv >= 0


cdef int _first_failed(SendOp* sends, RecvOp* recvs, int count) noexcept nogil:
    """The index of the op whose failure stopped the others (else of the first failed one), or -1.

    An op still running (``ST_AGAIN``, in a sliding window) has not failed.
    """
    cdef int i, status, first = -1
    for i in range(count):
        status = sends[i].status if sends != NULL else recvs[i].status
        if status == ST_OK or status == ST_AGAIN:
            continue
        if status != ST_ABORTED:
            return i
        if first < 0:
            first = i
    return first


cdef int _all_to_all_held(Mesh mesh, const unsigned char* out, unsigned char* into, size_t* send_at, size_t* recv_at,
                          bint even, uint64_t fingerprint, int64_t deadline, SendOp* s, RecvOp* r) except -1:
    """Run an all_to_all on a mesh whose locks are held; return the transport's code (0: done).

    ``even``: the blocks are equal (``send_at`` and ``recv_at`` both ``i * block``) on every rank, so Bruck's
    rounds may run where the mesh prefers them; otherwise the pairwise exchange's sliding windows.
    """
    cdef int rc = 0, n = mesh.n, rank = mesh.rank, i
    cdef size_t block = send_at[1] - send_at[0], budget
    cdef bint uniform = even and mesh.bruck_all_to_all(<size_t>n * block)
    cdef unsigned char* work = NULL
    cdef ferro_plan plan
    cdef SendOp* sends = NULL
    cdef RecvOp* recvs = NULL
    cdef pollfd* fds = NULL
    fingerprint = _with_plan(fingerprint, 2 if uniform else 1)
    try:
        if uniform:  # Bruck: the rotated blocks, and room to pack half of them each way
            work = mesh.scratch_for(<size_t>n * block + 2 * <size_t>((n + 1) // 2) * block)
        else:
            sends = <SendOp*>malloc(PAIRWISE_WINDOW * sizeof(SendOp))
            recvs = <RecvOp*>malloc(PAIRWISE_WINDOW * sizeof(RecvOp))
            fds = <pollfd*>malloc(2 * PAIRWISE_WINDOW * sizeof(pollfd))
            if sends == NULL or recvs == NULL or fds == NULL:
                raise MemoryError()
        with nogil:
            if uniform:
                for i in range(n):  # block i is bound for rank + i
                    memcpy(work + <size_t>i * block, out + <size_t>((rank + i) % n) * block, block)
                ferro_plan_init_all_to_all(&plan, FERRO_PLAN_BRUCK_ALL_TO_ALL, rank, n, NULL, NULL, block)
                rc = _run_plan(mesh.states, &plan, work, NULL, 1, -1, NULL, work + <size_t>n * block,
                               mesh.segment_bytes, 0, fingerprint, deadline, s, r)
                if rc == 0:
                    for i in range(n):  # and block i came from rank - i
                        memcpy(into + <size_t>((rank - i + n) % n) * block, work + <size_t>i * block, block)
            else:
                memcpy(into + recv_at[rank], out + send_at[rank], send_at[rank + 1] - send_at[rank])
                ferro_plan_init_all_to_all(&plan, FERRO_PLAN_PAIRWISE, rank, n, send_at, recv_at, 0)
                budget = _flight_budget(mesh.pace_bytes, send_at[n] - (send_at[rank + 1] - send_at[rank]))
                rc = _pairwise_windows(mesh.states, &plan, out, into, sends, recvs, fds, mesh.window_bytes,
                                       fingerprint, deadline, s, r, budget, mesh.pace_bytes)
    finally:
        free(sends)
        free(recvs)
        free(fds)
    return rc


def all_to_all(Mesh mesh, send_buf, object send_offsets, recv_buf, object recv_offsets,
               uint64_t fingerprint, double timeout, bint even=False) -> None:
    """Exchange blocks: bytes ``[send_offsets[j], send_offsets[j+1])`` go to rank ``j``.

    ``recv_offsets`` say where each source's block lands in ``recv_buf``. ``even`` (every
    rank's blocks equal, as ``ferro.all_to_all`` guarantees: every rank must pass the same)
    takes Bruck's ceil(log2 n) rounds where the mesh's cost forms say so (see :class:`Mesh`);
    otherwise the pairwise exchange: in step ``k`` rank ``r``
    sends to ``r+k`` and receives from ``r-k``, both at once (``schedule.h``).
    """
    cdef _Call call = _Call()
    cdef SendOp s
    cdef RecvOp r
    cdef int rc = 0, n = mesh.n, rank = mesh.rank, i
    cdef size_t block
    cdef size_t* send_at = NULL
    cdef size_t* recv_at = NULL
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    if len(send_offsets) != n + 1 or len(recv_offsets) != n + 1:
        raise ValueError(f"all_to_all: {n + 1} offsets needed on each side")
    try:
        call.take(mesh, recv_buf, timeout, "all_to_all")
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
        block = send_at[1] - send_at[0]
        for i in range(n + 1):  # every rank must take the same plan: an even call's blocks are equal everywhere
            if even and (send_at[i] != i * block or recv_at[i] != i * block):
                raise ValueError(f"all_to_all: even=True needs {n} equal blocks on each side; offsets differ at {i}")
        rc = _all_to_all_held(mesh, <const unsigned char*>call.input.buf, <unsigned char*>call.view.buf, send_at,
                              recv_at, even, fingerprint, monotonic_ns() + <int64_t>(timeout * 1e9), &s, &r)
    finally:
        free(send_at)
        free(recv_at)
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "all_to_all", timeout)


cdef int _barrier_locked(Mesh mesh, int64_t deadline, SendOp* s, RecvOp* r) except -1 nogil:
    """Dissemination: in round k signal rank+2^k and wait for rank-2^k (empty barrier frames)."""
    cdef ferro_plan plan
    cdef ferro_step step
    ferro_plan_init(&plan, FERRO_PLAN_DISSEMINATION, mesh.rank, mesh.n, 0, 1, NULL, NULL, NULL, 0, 0, 0)
    while ferro_plan_next(&plan, &step):
        if _exchange(s, mesh.states[step.send_peer], NULL, 0, r, mesh.states[step.recv_peer], NULL, 0, 0, deadline,
                     KIND_BARRIER):
            return 1
    return 0


def barrier(Mesh mesh, double timeout) -> None:
    """Dissemination barrier: in round k signal rank+2^k and wait for rank-2^k (empty barrier frames)."""
    cdef _Call call = _Call()
    cdef SendOp s
    cdef RecvOp r
    cdef int rc = 0
    cdef int64_t deadline
    cdef bytearray nothing = bytearray(1)
    memset(&s, 0, sizeof(SendOp))
    memset(&r, 0, sizeof(RecvOp))
    try:
        call.take(mesh, nothing, timeout, "barrier")
        deadline = monotonic_ns() + <int64_t>(timeout * 1e9)
        with nogil:
            rc = _barrier_locked(mesh, deadline, &s, &r)
    finally:
        call.release()
    if rc:
        raise_failure(&s if s.conn != NULL else NULL, &r if r.conn != NULL else NULL, "barrier", timeout)


# --- the direct paths (see ferro._core.direct) ------------------------------------------

cdef int _fail_call(SendOp* s, RecvOp* r, str op, double timeout) except -1:
    return raise_failure(s if s.conn != NULL else NULL, r if r.conn != NULL else NULL, op, timeout)


cdef class _MeshCall(DirectCall):
    """A direct path over a :class:`Mesh` (its ``engine``)."""

    cdef Mesh mesh
    cdef object empty

    def __cinit__(self, *args, Mesh engine=None, empty=None, **kwargs):
        self.mesh = engine
        self.empty = empty

    cdef object take_result(self, x, out, object shape, Py_buffer* into):
        """The array a call with a separate output writes: ``out`` if it is of ``shape`` and ``x``'s dtype,
        else (None given) a new one; its buffer taken into ``into``. None, with nothing taken, for the full path.
        """
        if out is None:
            result = self.empty(shape, x.dtype)
        elif out.dtype == x.dtype and out.shape == shape:
            result = out
        else:
            return None
        try:
            PyObject_GetBuffer(result, into, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        except (BufferError, ValueError, TypeError):
            return None
        return result


cdef class DirectMeshAllreduce(_MeshCall):
    """``ferro.allreduce``'s direct path on a TCP group: ``(x, op, timeout) -> bool``.

    ``make_plan`` returns ``(dtype code, kernel code, fingerprint, divisor, itemsize,
    algorithm code)``: the algorithm the full path would choose for that size (:data:`ALGORITHMS`).
    """

    def __call__(self, x, op, timeout) -> bool:
        cdef Py_buffer view
        cdef tuple plan
        cdef SendOp s
        cdef RecvOp r
        cdef Mesh mesh = self.mesh
        cdef ferro_reduce_fn kernel
        cdef double seconds, divisor
        cdef size_t itemsize, count, segment = 0
        cdef uint64_t fingerprint
        cdef int rc = 0, dtype, algorithm
        cdef int64_t deadline
        if not self.may_take(x):
            return False
        try:
            PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        except (BufferError, ValueError, TypeError):
            return False  # read-only or not contiguous: the full path explains
        try:
            if view.len == 0 or not self.find_plan(x, op, &view):
                return False
            plan = self.plan
            seconds = self.seconds(timeout)
            if not self.may_take(x):
                return False  # the plan or the timeout ran Python code, and another thread took the group
            dtype, fingerprint, divisor, itemsize = plan[0], plan[2], plan[3], plan[4]
            kernel = ferro_reduce_kernel(dtype, plan[1])
            algorithm = plan[5]
            count = <size_t>view.len // itemsize
            segment = mesh.segment_bytes - mesh.segment_bytes % itemsize
            memset(&s, 0, sizeof(SendOp))
            memset(&r, 0, sizeof(RecvOp))
            self.begin(fingerprint, <uint64_t>view.len, READ_CLOCK)
            try:
                if mesh.n > 1:  # every op of one rank is the identity (MEAN divides by 1)
                    mesh.acquire(seconds, "allreduce", -1, <size_t>view.len)
                    try:
                        mesh.prepare_allreduce(count, itemsize, algorithm, segment)
                        deadline = monotonic_ns() + <int64_t>(seconds * 1e9)
                        with nogil:
                            rc = _allreduce_locked(mesh, <unsigned char*>view.buf, count, itemsize, dtype, kernel,
                                                   fingerprint, deadline, algorithm, segment, divisor, &s, &r)
                    finally:
                        mesh.release()
                    if rc:
                        _fail_call(&s, &r, "allreduce", seconds)
            except BaseException as exc:
                self.end(False, 0, READ_CLOCK)
                self.fail(exc)
                raise
            self.end(True, 0, READ_CLOCK)
            return True
        finally:
            PyBuffer_Release(&view)


cdef class DirectMeshBroadcast(_MeshCall):
    """``ferro.broadcast``'s direct path on a TCP group: ``(x, root, timeout) -> bool``.

    ``make_plan`` returns ``(fingerprint, root)`` (root as an int in the group), or False.
    """

    def __call__(self, x, root, timeout) -> bool:
        cdef Py_buffer view
        cdef tuple plan
        cdef SendOp s
        cdef RecvOp r
        cdef Mesh mesh = self.mesh
        cdef double seconds
        cdef uint64_t fingerprint
        cdef int rc = 0, root_rank
        cdef int64_t deadline
        if type(root) is not int or not self.may_take(x):
            return False  # a numpy integer (or a bool, which would share int's plan key) takes the full path
        try:
            PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS)  # writable is checked below, where it matters
        except (BufferError, ValueError, TypeError):
            return False
        try:
            if view.len == 0 or not self.find_plan(x, root, &view):
                return False
            plan = self.plan
            fingerprint, root_rank = plan[0], plan[1]
            if view.readonly and mesh.rank != root_rank:
                return False  # a receiving rank's read-only array: the full path explains
            seconds = self.seconds(timeout)
            if not self.may_take(x):
                return False
            memset(&s, 0, sizeof(SendOp))
            memset(&r, 0, sizeof(RecvOp))
            self.begin(fingerprint, <uint64_t>view.len, READ_CLOCK)
            try:
                if mesh.n > 1:
                    mesh.acquire(seconds, "broadcast", -1, <size_t>view.len)
                    try:
                        deadline = monotonic_ns() + <int64_t>(seconds * 1e9)
                        with nogil:
                            rc = _broadcast_locked(mesh, root_rank, <unsigned char*>view.buf, <size_t>view.len,
                                                   mesh.segment_bytes, fingerprint, deadline, &s, &r)
                    finally:
                        mesh.release()
                    if rc:
                        _fail_call(&s, &r, "broadcast", seconds)
            except BaseException as exc:
                self.end(False, 0, READ_CLOCK)
                self.fail(exc)
                raise
            self.end(True, 0, READ_CLOCK)
            return True
        finally:
            PyBuffer_Release(&view)


cdef class DirectMeshReduce(_MeshCall):
    """``ferro.reduce``'s direct path on a TCP group: ``(x, dst, op, timeout) -> bool``.

    ``make_plan`` (keyed by ``(dst, op)``) returns ``(dtype code, kernel code, fingerprint, divisor, itemsize,
    root)`` (root as an int in the group), or False. It runs the full path's plan (:func:`reduce`, the mesh's
    choice for the size): on the root in ``x``, elsewhere in a copy of ``x``, which the reduce leaves as scratch,
    so that ``x`` stays as it was there, as the full path leaves it.
    """

    def __call__(self, x, dst, op, timeout) -> bool:
        cdef Py_buffer view
        cdef tuple plan
        cdef SendOp s
        cdef RecvOp r
        cdef ferro_plan steps
        cdef Mesh mesh = self.mesh
        cdef ferro_reduce_fn kernel
        cdef double seconds, divisor
        cdef size_t itemsize, count, segment
        cdef uint64_t fingerprint
        cdef unsigned char* work = NULL
        cdef unsigned char* copy = NULL
        cdef int rc = 0, dtype, root, algorithm
        cdef int64_t deadline
        if type(dst) is not int or not self.may_take(x):
            return False  # a numpy integer (or a bool, which would share int's plan key) takes the full path
        # The last call's (dst, op), when this one repeats it: find_plan then knows it by identity, with no key to
        # build and no ReduceOp to hash.
        extra = self.last_extra
        if extra is None or (<tuple>extra)[1] is not op or (<tuple>extra)[0] != dst:
            extra = (dst, op)
        try:
            PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)  # the full path wants it writable
        except (BufferError, ValueError, TypeError):
            return False
        try:
            if view.len == 0 or not self.find_plan(x, extra, &view):
                return False
            plan = self.plan
            dtype, fingerprint, divisor, itemsize, root = plan[0], plan[2], plan[3], plan[4], plan[5]
            seconds = self.seconds(timeout)
            if not self.may_take(x):
                return False
            kernel = ferro_reduce_kernel(dtype, plan[1])
            count = <size_t>view.len // itemsize
            memset(&s, 0, sizeof(SendOp))
            memset(&r, 0, sizeof(RecvOp))
            self.begin(fingerprint, <uint64_t>view.len, READ_CLOCK)
            try:
                if mesh.n > 1:  # a group of one: x is the result (MEAN divides by 1)
                    work = <unsigned char*>view.buf
                    if mesh.rank != root:
                        copy = <unsigned char*>malloc(<size_t>view.len)
                        if copy == NULL:
                            raise MemoryError()
                        memcpy(copy, view.buf, <size_t>view.len)
                        work = copy
                    algorithm = mesh.reduce_plan(<size_t>view.len)
                    try:
                        # The ring-and-gather's gather reaches the root from every rank: it is held too.
                        mesh.acquire(seconds, "reduce", root if algorithm == FERRO_PLAN_REDUCE_RING_GATHER else -1,
                                     <size_t>view.len)
                        try:
                            segment = _prepare_reduce(mesh, &steps, algorithm, root, count, itemsize, divisor != 0)
                            deadline = monotonic_ns() + <int64_t>(seconds * 1e9)
                            with nogil:
                                rc = _run_plan(mesh.states, &steps, work, NULL, itemsize, dtype, kernel, mesh.scratch,
                                               segment, divisor, fingerprint, deadline, &s, &r)
                        finally:
                            mesh.release()
                    finally:
                        free(copy)
                    if rc:
                        _fail_call(&s, &r, "reduce", seconds)
            except BaseException as exc:
                self.end(False, 0, READ_CLOCK)
                self.fail(exc)
                raise
            self.end(True, 0, READ_CLOCK)
            return True
        finally:
            PyBuffer_Release(&view)


cdef class DirectMeshAllToAll(_MeshCall):
    """``ferro.all_to_all``'s direct path on a TCP group: ``(x, out, timeout) -> result or None``.

    ``make_plan`` returns ``(fingerprint,)``, or False (a 0-d ``x`` or an axis 0 that does not split into equal
    blocks: the full path explains). ``out`` must be a NumPy array of ``x``'s shape and dtype that does not overlap
    ``x`` (else the full path checks it); without one, the result is a new array. It runs the full path's plan
    (Bruck's rounds or the pairwise windows, as the mesh chooses for equal blocks). None means the full path must
    take the call.
    """

    def __call__(self, x, out, timeout):
        cdef Py_buffer view, into
        cdef SendOp s
        cdef RecvOp r
        cdef Mesh mesh = self.mesh
        cdef double seconds
        cdef uint64_t fingerprint
        cdef size_t block, i
        cdef int rc = 0
        cdef bint has_into = False
        if not self.may_take(x) or (out is not None and type(out) is not self.ndarray):
            return None
        try:
            PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS)  # the input is only read
        except (BufferError, ValueError, TypeError):
            return None
        try:
            if view.len == 0 or view.ndim == 0 or not self.find_plan(x, None, &view):
                return None
            fingerprint = self.plan[0]
            result = self.take_result(x, out, x.shape, &into)
            if result is None:
                return None  # the full path says what is wrong with out
            has_into = True
            if <unsigned char*>into.buf < <unsigned char*>view.buf + view.len \
                    and <unsigned char*>view.buf < <unsigned char*>into.buf + into.len:
                return None  # out overlaps x: the full path refuses it
            seconds = self.seconds(timeout)
            if not self.may_take(x):
                return None
            block = <size_t>view.len // <size_t>mesh.n
            memset(&s, 0, sizeof(SendOp))
            memset(&r, 0, sizeof(RecvOp))
            self.begin(fingerprint, <uint64_t>view.len, READ_CLOCK)
            try:
                if mesh.n > 1:
                    mesh.acquire(seconds, "all_to_all")
                    try:
                        for i in range(<size_t>mesh.n + 1):  # the mesh's n + 1 bounds are the call's while it holds it
                            mesh.bounds[i] = i * block
                        rc = _all_to_all_held(mesh, <const unsigned char*>view.buf, <unsigned char*>into.buf,
                                              mesh.bounds, mesh.bounds, True, fingerprint,
                                              monotonic_ns() + <int64_t>(seconds * 1e9), &s, &r)
                    finally:
                        mesh.release()
                    if rc:
                        _fail_call(&s, &r, "all_to_all", seconds)
                else:
                    memcpy(into.buf, view.buf, <size_t>view.len)
            except BaseException as exc:
                self.end(False, 0, READ_CLOCK)
                self.fail(exc)
                raise
            self.end(True, 0, READ_CLOCK)
            return result
        finally:
            PyBuffer_Release(&view)
            if has_into:
                PyBuffer_Release(&into)


cdef class DirectMeshAllGather(_MeshCall):
    """``ferro.all_gather``'s direct path on a TCP group: ``(x, out, tag, timeout) -> result or None``.

    ``make_plan`` returns ``(fingerprint, gathered shape)``, or False. ``out`` must be a
    NumPy array of exactly that shape and ``x``'s dtype (else the full path checks it);
    without one, the result is a new array (``empty``, the engine's second argument,
    is ``numpy.empty``). None means the full path must take the call.
    """

    def __call__(self, x, out, tag, timeout):
        cdef Py_buffer view, into
        cdef tuple plan
        cdef SendOp s
        cdef RecvOp r
        cdef Mesh mesh = self.mesh
        cdef double seconds
        cdef uint64_t fingerprint
        cdef size_t nbytes
        cdef int rc = 0
        cdef bint has_into = False
        if type(tag) is not int or not self.may_take(x) or (out is not None and type(out) is not self.ndarray):
            return None
        try:
            PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS)
        except (BufferError, ValueError, TypeError):
            return None
        try:
            if view.len == 0 or not self.find_plan(x, tag, &view):
                return None
            plan = self.plan
            fingerprint, shape = plan[0], plan[1]
            result = self.take_result(x, out, shape, &into)
            if result is None:
                return None  # the full path says what is wrong with out
            has_into = True
            nbytes = <size_t>view.len
            seconds = self.seconds(timeout)
            if not self.may_take(x):
                return None
            memset(&s, 0, sizeof(SendOp))
            memset(&r, 0, sizeof(RecvOp))
            self.begin(fingerprint, <uint64_t>nbytes, READ_CLOCK)
            try:
                # memmove: x may be this rank's part of out (an in-place gather).
                memmove(<unsigned char*>into.buf + mesh.rank * nbytes, view.buf, nbytes)
                if mesh.n > 1:
                    mesh.acquire(seconds, "all_gather", -1, <size_t>nbytes * mesh.n)
                    try:
                        rc = _all_gather_locked(mesh, <unsigned char*>into.buf, nbytes, fingerprint, seconds, &s, &r)
                    finally:
                        mesh.release()
                    if rc:
                        _fail_call(&s, &r, "all_gather", seconds)
            except BaseException as exc:
                self.end(False, 0, READ_CLOCK)
                self.fail(exc)
                raise
            self.end(True, 0, READ_CLOCK)
            return result
        finally:
            PyBuffer_Release(&view)
            if has_into:
                PyBuffer_Release(&into)


cdef class DirectMeshReduceScatter(_MeshCall):
    """``ferro.reduce_scatter``'s direct path on a TCP group: ``(x, op, out, tag, timeout) -> part or None``.

    ``make_plan`` returns ``(dtype code, kernel code, fingerprint, divisor, itemsize,
    part shape, bounds)`` -- ``bounds`` the ``n + 1`` element offsets of the parts, cut
    along axis 0 as ``numpy.array_split`` cuts -- or False, as it does for inputs larger
    than :data:`DIRECT_REDUCE_SCATTER_BYTES`. It runs the full path's ring, reading the
    input in place, in the mesh's scratch; the result is ``out`` (an array of the part's
    shape and ``x``'s dtype, else the full path checks it) or a new array. Only calls
    with tag 0 are taken. None means the full path must take the call.
    """

    def __call__(self, x, op, out, tag, timeout):
        cdef Py_buffer view, into
        cdef tuple plan, bounds
        cdef SendOp s
        cdef RecvOp r
        cdef Mesh mesh = self.mesh
        cdef ferro_reduce_fn kernel
        cdef double seconds, divisor
        cdef size_t itemsize, nbytes, largest = 0, segment = 0, first, last
        cdef uint64_t fingerprint
        cdef unsigned char* work
        cdef int rc = 0, dtype, i
        cdef int64_t deadline
        cdef bint has_into = False
        if type(tag) is not int or tag != 0 or not self.may_take(x) \
                or (out is not None and type(out) is not self.ndarray):
            return None
        try:
            PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS)  # the input is only read
        except (BufferError, ValueError, TypeError):
            return None
        try:
            if view.len == 0 or view.ndim == 0 or not self.find_plan(x, op, &view):
                return None
            plan = self.plan
            dtype, fingerprint, divisor, itemsize, shape, bounds = plan[0], plan[2], plan[3], plan[4], plan[5], plan[6]
            result = self.take_result(x, out, shape, &into)
            if result is None:
                return None  # the full path says what is wrong with out
            has_into = True
            seconds = self.seconds(timeout)
            if not self.may_take(x):
                return None
            kernel = ferro_reduce_kernel(dtype, plan[1])
            nbytes = <size_t>view.len
            segment = mesh.segment_bytes - mesh.segment_bytes % itemsize
            first = <size_t>bounds[mesh.rank] * itemsize
            last = <size_t>bounds[mesh.rank + 1] * itemsize
            memset(&s, 0, sizeof(SendOp))
            memset(&r, 0, sizeof(RecvOp))
            self.begin(fingerprint, <uint64_t>nbytes, READ_CLOCK)
            try:
                if mesh.n > 1:
                    mesh.acquire(seconds, "reduce_scatter", -1, nbytes)
                    try:
                        for i in range(mesh.n + 1):
                            mesh.bounds[i] = <size_t>bounds[i]
                            if i and (mesh.bounds[i] - mesh.bounds[i - 1]) * itemsize > largest:
                                largest = (mesh.bounds[i] - mesh.bounds[i - 1]) * itemsize
                        # The ring's work buffer (the input's size: the parts it reduces land there), then
                        # the segment that arrives before it is reduced.
                        work = mesh.scratch_for(nbytes + min(segment, largest))
                        deadline = monotonic_ns() + <int64_t>(seconds * 1e9)
                        with nogil:
                            rc = _ring(mesh.states, mesh.rank, mesh.n, work, mesh.bounds, mesh.bounds + 1, itemsize,
                                       kernel, work + nbytes, segment, fingerprint, deadline, &s, &r,
                                       PHASE_REDUCE_SCATTER, dtype, divisor, <const unsigned char*>view.buf,
                                       mesh.piece_bytes)
                            if rc == 0:
                                memcpy(into.buf, work + first, last - first)
                    finally:
                        mesh.release()
                    if rc:
                        _fail_call(&s, &r, "reduce_scatter", seconds)
                else:
                    memcpy(into.buf, <unsigned char*>view.buf + first, last - first)  # MEAN of one: itself
            except BaseException as exc:
                self.end(False, 0, READ_CLOCK)
                self.fail(exc)
                raise
            self.end(True, 0, READ_CLOCK)
            return result
        finally:
            PyBuffer_Release(&view)
            if has_into:
                PyBuffer_Release(&into)


cdef class DirectMeshBarrier(_MeshCall):
    """``ferro.barrier``'s direct path on a TCP group: ``(timeout) -> bool``."""

    def __call__(self, timeout) -> bool:
        cdef SendOp s
        cdef RecvOp r
        cdef Mesh mesh = self.mesh
        cdef double seconds
        cdef int rc = 0
        cdef int64_t deadline
        if not self.may_take(None):
            return False
        seconds = self.seconds(timeout)
        if not self.may_take(None):
            return False
        memset(&s, 0, sizeof(SendOp))
        memset(&r, 0, sizeof(RecvOp))
        self.begin(0, 0, READ_CLOCK)
        try:
            if mesh.n > 1:
                mesh.acquire(seconds, "barrier")
                try:
                    deadline = monotonic_ns() + <int64_t>(seconds * 1e9)
                    with nogil:
                        rc = _barrier_locked(mesh, deadline, &s, &r)
                finally:
                    mesh.release()
                if rc:
                    _fail_call(&s, &r, "barrier", seconds)
        except BaseException as exc:
            self.end(False, 0, READ_CLOCK)
            self.fail(exc)
            raise
        self.end(True, 0, READ_CLOCK)
        return True
