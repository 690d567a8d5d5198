/* The schedules of ferro's collectives, described once.
 *
 * A schedule is what one rank does, step by step: send this byte range to that peer while receiving that range
 * from another, and reduce what arrives or let it land. It is a pure iterator over (algorithm, rank, world size,
 * byte bounds): no I/O, no allocation, O(1) state whatever the world size. The compiled executor
 * (collectives.pyx: _run_plan) runs these steps on the mesh's connections, and `ferro bench --simulate` replays the
 * very same steps (through collectives.plan_steps) on a model of the network: there is no second description of
 * an algorithm anywhere.
 *
 * Byte offsets index the collective's working buffer. A step with STEP_REDUCE has what arrives reduced into
 * [recv_off, recv_off + recv_len) (through the executor's scratch, segment by segment); without it the bytes land
 * there. STEP_SEND_SOURCE: the sent bytes come from the call's read-only input instead (an out-of-place
 * reduce-scatter's first step), and STEP_RECV_BASE: the receiving range starts as a copy of the input (see
 * _exchange_segments' `base`). STEP_DIVIDE: after the step, MEAN divides [divide_off, divide_off + divide_len),
 * the chunk this rank completed, once.
 */
#ifndef FERRO_SCHEDULE_H
#define FERRO_SCHEDULE_H

#include <stddef.h>
#include <stdint.h>
#include <math.h>

enum {
    FERRO_PLAN_RING = 0,
    FERRO_PLAN_RECURSIVE_DOUBLING = 1,
    FERRO_PLAN_HALVING_DOUBLING = 2,
    FERRO_PLAN_BINOMIAL_TREE = 3,   /* broadcast: receive from the parent, then send to each child */
    FERRO_PLAN_CHAIN = 4,           /* broadcast: root -> root + 1 -> ..., segment i - 1 forwarded as i arrives */
    FERRO_PLAN_BRUCK = 5,           /* all_gather: ceil(log2 n) rounds, blocks in this rank's rotated order */
    FERRO_PLAN_PAIRWISE = 6,        /* all_to_all: n - 1 steps, step k to rank + k while rank - k's arrives */
    FERRO_PLAN_BRUCK_ALL_TO_ALL = 7,/* all_to_all of equal blocks: ceil(log2 n) rounds of packed blocks */
    FERRO_PLAN_DISSEMINATION = 8,   /* barrier: round k signals rank + 2^k and waits for rank - 2^k */
    FERRO_PLAN_REDUCE_TREE = 9,     /* reduce: each child's partial result reduced in, then sent to the parent */
    FERRO_PLAN_REDUCE_RING_GATHER = 10, /* reduce: the ring's reduce-scatter, then each rank's chunk to the root */
    FERRO_PLAN_REDUCE_CHAIN = 11,   /* reduce: root <- root + 1 <- ..., segment i - 1 reduced, passed on as i arrives */
    FERRO_PLAN_SCATTER_ALL_GATHER = 12, /* broadcast: a binomial scatter of n parts, then the ring's all-gather */
};

enum {
    FERRO_PHASE_REDUCE_SCATTER = 1,
    FERRO_PHASE_ALL_GATHER = 2,
};

enum {
    FERRO_STEP_REDUCE = 1,
    FERRO_STEP_SEND_SOURCE = 2,
    FERRO_STEP_RECV_BASE = 4,
    FERRO_STEP_DIVIDE = 8,
    FERRO_STEP_PACK = 16,       /* Bruck's all_to_all: the blocks whose index has bit `pack_bit` set */
};

typedef struct {
    int send_peer;          /* -1: nothing to send */
    int recv_peer;          /* -1: nothing to receive */
    size_t send_off, send_len;
    size_t recv_off, recv_len;
    unsigned flags;
    size_t divide_off, divide_len;
    size_t pack_bit;        /* FERRO_STEP_PACK: send (and receive into) blocks j with j & pack_bit, packed */
} ferro_step;

typedef struct {
    int algorithm, rank, n;
    /* ring: chunk i is [starts[i], ends[i]) in elements; halving-doubling: `bounds`, the power-of-two chunks'
     * byte offsets (power + 1 of them, filled by ferro_plan_init); recursive doubling: the whole [0, nbytes). */
    const size_t *starts, *ends, *bounds;
    size_t nbytes, itemsize;
    int phases;             /* the ring's: FERRO_PHASE_* */
    int mean;               /* divide once, where the algorithm completes a chunk */
    int source;             /* the ring's first reduce-scatter step reads the input (out of place) */
    int root;               /* broadcast's */
    size_t segment;         /* the chain's segment */
    size_t block;           /* Bruck's: bytes per rank's block */
    const size_t *send_bounds, *recv_bounds;  /* pairwise all_to_all: rank j's block, n + 1 byte offsets each */
    int part;               /* a plan of two: 0 its first (the scatter), 1 its second (the ring) */
    /* progress */
    int stage, index;
    int power, extra, virtual_rank, mask, lo, hi;
} ferro_plan;

static inline size_t ferro_plan_bound(size_t total, int parts, int i) {
    /* Chunk i starts here when total elements split as numpy.array_split does. */
    size_t base = total / (size_t)parts, extra = total % (size_t)parts;
    return (size_t)i * base + ((size_t)i < extra ? (size_t)i : extra);
}

static inline int ferro_plan_folded_partner(int virtual_rank, int extra) {
    /* The real rank of a virtual one, once the first 2 * extra ranks have folded in pairs. */
    return virtual_rank < extra ? virtual_rank * 2 + 1 : virtual_rank + extra;
}

static inline void ferro_plan_clear(ferro_step *step) {
    step->send_peer = -1;
    step->recv_peer = -1;
    step->send_off = step->send_len = step->recv_off = step->recv_len = 0;
    step->flags = 0;
    step->divide_off = step->divide_len = 0;
    step->pack_bit = 0;
}

/* Start a plan. For the ring, `starts`/`ends` are the n chunks' element bounds; for halving-doubling `bounds` must
 * hold room for power + 1 entries (power: the largest power of two <= n), filled here from `count` elements of
 * `itemsize` bytes; recursive doubling needs neither. */
static inline void ferro_plan_init(ferro_plan *plan, int algorithm, int rank, int n, size_t count, size_t itemsize,
                                   const size_t *starts, const size_t *ends, size_t *bounds, int phases, int mean,
                                   int source) {
    int i;
    plan->algorithm = algorithm;
    plan->rank = rank;
    plan->n = n;
    plan->starts = starts;
    plan->ends = ends;
    plan->bounds = bounds;
    plan->nbytes = count * itemsize;
    plan->itemsize = itemsize;
    plan->phases = phases;
    plan->mean = mean;
    plan->source = source;
    plan->root = 0;
    plan->segment = 0;
    plan->block = 0;
    plan->send_bounds = plan->recv_bounds = NULL;
    plan->stage = 0;
    plan->index = 0;
    plan->part = 0;
    plan->power = 1;
    while (plan->power * 2 <= n)
        plan->power *= 2;
    plan->extra = n - plan->power;
    plan->virtual_rank = rank < 2 * plan->extra ? rank / 2 : rank - plan->extra;
    plan->mask = 0;
    plan->lo = 0;
    plan->hi = plan->power;
    if (algorithm == FERRO_PLAN_HALVING_DOUBLING && bounds != NULL)
        for (i = 0; i <= plan->power; i++)
            bounds[i] = ferro_plan_bound(count, plan->power, i) * itemsize;
}

static int ferro_plan_next_ring(ferro_plan *p, ferro_step *step) {
    int n = p->n, rank = p->rank, phase, send_idx, recv_idx, at;
    for (;;) {
        phase = p->stage;  /* 0: reduce-scatter, 1: all-gather, 2: done */
        if (phase >= 2 || n < 2)
            return 0;
        if (!(p->phases & (phase == 0 ? FERRO_PHASE_REDUCE_SCATTER : FERRO_PHASE_ALL_GATHER)) || p->index >= n - 1) {
            p->stage++;
            p->index = 0;
            continue;
        }
        at = p->index++;
        ferro_plan_clear(step);
        step->send_peer = (rank + 1) % n;
        step->recv_peer = (rank - 1 + n) % n;
        if (phase == 0) {  /* reduce-scatter: afterwards chunk `rank` is complete here */
            send_idx = (rank - at - 1 + 2 * n) % n;
            recv_idx = (rank - at - 2 + 2 * n) % n;
            step->flags |= FERRO_STEP_REDUCE;
            if (p->source) {
                step->flags |= FERRO_STEP_RECV_BASE;
                if (at == 0)
                    step->flags |= FERRO_STEP_SEND_SOURCE;
            }
            if (at == n - 2 && p->mean) {  /* the chunk this rank completed: divide it once, in cache */
                step->flags |= FERRO_STEP_DIVIDE;
                step->divide_off = p->starts[rank] * p->itemsize;
                step->divide_len = (p->ends[rank] - p->starts[rank]) * p->itemsize;
            }
        } else {           /* all-gather: pass the complete chunks around */
            send_idx = (rank - at + 2 * n) % n;
            recv_idx = (rank - at - 1 + 2 * n) % n;
        }
        step->send_off = p->starts[send_idx] * p->itemsize;
        step->send_len = (p->ends[send_idx] - p->starts[send_idx]) * p->itemsize;
        step->recv_off = p->starts[recv_idx] * p->itemsize;
        step->recv_len = (p->ends[recv_idx] - p->starts[recv_idx]) * p->itemsize;
        return 1;
    }
}

static inline int ferro_plan_divide_all(ferro_plan *p, ferro_step *step) {
    /* A step that moves nothing: MEAN divides the whole result once (recursive doubling). */
    ferro_plan_clear(step);
    step->flags = FERRO_STEP_DIVIDE;
    step->divide_len = p->nbytes;
    return 1;
}

/* Recursive doubling and halving-doubling share the fold: ranks beyond the power of two hand their data to a
 * partner first (stage 0) and get the result back last (stage 3). */
static int ferro_plan_next_doubling(ferro_plan *p, ferro_step *step) {
    int rank = p->rank, extra = p->extra, power = p->power, partner, mid, width;
    int halving = p->algorithm == FERRO_PLAN_HALVING_DOUBLING;
    int folded_out = rank < 2 * extra && rank % 2 == 0;   /* hands its data over and waits */
    const size_t *b = p->bounds;
    for (;;) {
        ferro_plan_clear(step);
        switch (p->stage) {
        case 0:  /* the fold */
            p->stage = 1;
            if (rank < 2 * extra) {
                if (folded_out) {
                    step->send_peer = rank + 1;
                    step->send_len = p->nbytes;
                    p->stage = 3;
                } else {
                    step->recv_peer = rank - 1;
                    step->recv_len = p->nbytes;
                    step->flags = FERRO_STEP_REDUCE;
                }
                return 1;
            }
            continue;
        case 1:  /* recursive doubling's exchanges, or halving's */
            if (!halving) {
                if (p->mask == 0)
                    p->mask = 1;
                if (p->mask >= power) {
                    p->stage = 3;
                    if (p->mean)
                        return ferro_plan_divide_all(p, step);
                    continue;
                }
                partner = ferro_plan_folded_partner(p->virtual_rank ^ p->mask, extra);
                step->send_peer = step->recv_peer = partner;
                step->send_len = step->recv_len = p->nbytes;
                step->flags = FERRO_STEP_REDUCE;
                p->mask <<= 1;
                return 1;
            }
            if (p->mask == 0)
                p->mask = power >> 1;
            if (p->mask == 0) {  /* power 1: nothing to halve */
                p->stage = 2;
                p->mask = 1;
                continue;
            }
            partner = ferro_plan_folded_partner(p->virtual_rank ^ p->mask, extra);
            mid = p->lo + (p->hi - p->lo) / 2;
            step->send_peer = step->recv_peer = partner;
            if (p->virtual_rank & p->mask) {  /* keep the upper half, send the lower */
                step->send_off = b[p->lo];
                step->send_len = b[mid] - b[p->lo];
                p->lo = mid;
            } else {
                step->send_off = b[mid];
                step->send_len = b[p->hi] - b[mid];
                p->hi = mid;
            }
            step->recv_off = b[p->lo];
            step->recv_len = b[p->hi] - b[p->lo];
            step->flags = FERRO_STEP_REDUCE;
            p->mask >>= 1;
            if (p->mask == 0) {
                p->stage = 2;
                p->mask = 1;
                if (p->mean) {  /* this rank's chunk is complete: divide it once, while it is in cache */
                    step->flags |= FERRO_STEP_DIVIDE;
                    step->divide_off = b[p->lo];
                    step->divide_len = b[p->hi] - b[p->lo];
                }
            }
            return 1;
        case 2:  /* halving-doubling's gather: swap ranges with the partner next to this one's */
            if (p->mask >= power) {
                p->stage = 3;
                continue;
            }
            partner = ferro_plan_folded_partner(p->virtual_rank ^ p->mask, extra);
            width = p->hi - p->lo;
            step->send_peer = step->recv_peer = partner;
            step->send_off = b[p->lo];
            step->send_len = b[p->hi] - b[p->lo];
            if (p->virtual_rank & p->mask) {
                step->recv_off = b[p->lo - width];
                step->recv_len = b[p->lo] - b[p->lo - width];
                p->lo -= width;
            } else {
                step->recv_off = b[p->hi];
                step->recv_len = b[p->hi + width] - b[p->hi];
                p->hi += width;
            }
            p->mask <<= 1;
            return 1;
        case 3:  /* the unfold: the result goes back to (or comes back from) the folded partner */
            p->stage = 4;
            if (rank < 2 * extra) {
                if (folded_out) {
                    step->recv_peer = rank + 1;
                    step->recv_len = p->nbytes;
                } else {
                    step->send_peer = rank - 1;
                    step->send_len = p->nbytes;
                }
                return 1;
            }
            continue;
        default:
            return 0;
        }
    }
}

/* Start a broadcast of `nbytes` from `root`: a binomial tree, or a chain of `segment`-byte pieces. */
static inline void ferro_plan_init_broadcast(ferro_plan *plan, int algorithm, int rank, int n, int root, size_t nbytes,
                                             size_t segment) {
    ferro_plan_init(plan, algorithm, rank, n, nbytes, 1, NULL, NULL, NULL, 0, 0, 0);
    plan->root = root;
    plan->segment = segment ? segment : 1;
    plan->virtual_rank = (rank - root + n) % n;
    plan->mask = 1;
}

static int ferro_plan_next_tree(ferro_plan *p, ferro_step *step) {
    int v = p->virtual_rank, n = p->n;
    ferro_plan_clear(step);
    if (p->stage == 0) {  /* find the parent: the lowest set bit of the virtual rank */
        p->stage = 1;
        while (p->mask < n) {
            if (v & p->mask) {
                step->recv_peer = (v - p->mask + p->root) % n;
                step->recv_len = p->nbytes;
                p->mask >>= 1;
                return 1;
            }
            p->mask <<= 1;
        }
        p->mask >>= 1;
    }
    while (p->mask > 0) {  /* the children, farthest first */
        int child = v + p->mask;
        p->mask >>= 1;
        if (child < n) {
            step->send_peer = (child + p->root) % n;
            step->send_len = p->nbytes;
            return 1;
        }
    }
    return 0;
}

static int ferro_plan_next_chain(ferro_plan *p, ferro_step *step) {
    int v = p->virtual_rank, n = p->n;
    size_t count = (p->nbytes + p->segment - 1) / p->segment, i, start, length;
    for (;;) {
        i = (size_t)p->index;
        if (i > count)
            return 0;
        p->index++;
        ferro_plan_clear(step);
        start = i * p->segment;
        length = i < count ? (p->nbytes - start < p->segment ? p->nbytes - start : p->segment) : 0;
        if (v == 0) {  /* the root sends segment i; it has nothing to receive */
            if (i < count && v != n - 1) {
                step->send_peer = (p->rank + 1) % n;
                step->send_off = start;
                step->send_len = length;
                return 1;
            }
            continue;
        }
        if (i > 0 && v != n - 1) {  /* forward segment i - 1 ... */
            step->send_peer = (p->rank + 1) % n;
            step->send_off = (i - 1) * p->segment;
            step->send_len = p->nbytes - step->send_off < p->segment ? p->nbytes - step->send_off : p->segment;
        }
        if (i < count) {            /* ... while segment i arrives */
            step->recv_peer = (p->rank - 1 + n) % n;
            step->recv_off = start;
            step->recv_len = length;
        }
        if (step->send_peer >= 0 || step->recv_peer >= 0)
            return 1;
    }
}

/* Start a reduce of `count` elements into `root`. The binomial tree mirrors the broadcast's: a rank reduces its
 * children's partial results into its own (nearest child first, so the order is fixed), then sends the sum to its
 * parent; log2(n) rounds of the whole message. The ring-and-gather form (Rabenseifner's reduce, with the ring
 * where he halves) runs the ring's reduce-scatter over chunks `starts`/`ends` (elements), after which each rank's
 * chunk is complete, and sends every chunk to the root: 2(n - 1)/n of the message through each link where the
 * tree moves log2(n) whole ones. The pipelined chain is the broadcast's chain run backwards: the rank farthest
 * from the root sends its segments, each rank reduces every arriving segment into its own and passes it on while
 * the next arrives, so each link carries the message once and the root's link is busy from the first segment to
 * the last: m + (n - 2) s bytes' time, against the ring's 2(n - 1)/n m. `segment` (the chain's, a whole number of
 * elements) is what ferro_chain_segment gives. MEAN divides the root's whole result (the tree, the chain) or each
 * chunk (the ring) once. */
static inline void ferro_plan_init_reduce(ferro_plan *plan, int algorithm, int rank, int n, int root, size_t count,
                                          size_t itemsize, const size_t *starts, const size_t *ends, int mean,
                                          size_t segment) {
    ferro_plan_init(plan, algorithm, rank, n, count, itemsize, starts, ends, NULL, FERRO_PHASE_REDUCE_SCATTER, mean,
                    0);
    plan->root = root;
    plan->segment = segment ? segment : 1;
    plan->virtual_rank = (rank - root + n) % n;
    plan->mask = 1;
}

static int ferro_plan_next_reduce_tree(ferro_plan *p, ferro_step *step) {
    int v = p->virtual_rank, n = p->n, mask;
    while (p->stage == 0 && p->mask < n) {
        mask = p->mask;
        p->mask <<= 1;
        ferro_plan_clear(step);
        if (v & mask) {        /* the partial result goes to the parent, and this rank is done */
            p->stage = 2;
            step->send_peer = (v - mask + p->root) % n;
            step->send_len = p->nbytes;
            return 1;
        }
        if (v + mask < n) {    /* a child's partial result, reduced in */
            step->recv_peer = (v + mask + p->root) % n;
            step->recv_len = p->nbytes;
            step->flags = FERRO_STEP_REDUCE;
            return 1;
        }
    }
    if (p->stage == 0) {       /* the root, with every child reduced in */
        p->stage = 2;
        if (p->mean)
            return ferro_plan_divide_all(p, step);
    }
    return 0;
}

static int ferro_plan_next_reduce_chain(ferro_plan *p, ferro_step *step) {
    int v = p->virtual_rank, n = p->n;
    size_t count = (p->nbytes + p->segment - 1) / p->segment, i, start;
    for (;;) {
        i = (size_t)p->index;
        if (i > count) {
            if (v == 0 && p->mean && p->stage == 0) {  /* the root's result, divided once */
                p->stage = 1;
                return ferro_plan_divide_all(p, step);
            }
            return 0;
        }
        p->index++;
        ferro_plan_clear(step);
        start = i * p->segment;
        if (v == n - 1) {          /* the chain's far end sends its own segment i; nothing arrives */
            if (i < count) {
                step->send_peer = (p->rank - 1 + n) % n;
                step->send_off = start;
                step->send_len = p->nbytes - start < p->segment ? p->nbytes - start : p->segment;
                return 1;
            }
            continue;
        }
        if (i > 0 && v != 0) {     /* pass segment i - 1 on, reduced ... */
            step->send_peer = (p->rank - 1 + n) % n;
            step->send_off = (i - 1) * p->segment;
            step->send_len = p->nbytes - step->send_off < p->segment ? p->nbytes - step->send_off : p->segment;
        }
        if (i < count) {           /* ... while segment i arrives and is reduced into this rank's */
            step->recv_peer = (p->rank + 1) % n;
            step->recv_off = start;
            step->recv_len = p->nbytes - start < p->segment ? p->nbytes - start : p->segment;
            step->flags = FERRO_STEP_REDUCE;
        }
        if (step->send_peer >= 0 || step->recv_peer >= 0)
            return 1;
    }
}

static int ferro_plan_next_reduce_ring_gather(ferro_plan *p, ferro_step *step) {
    int n = p->n, j;
    if (p->stage < 2) {        /* the ring's stages: 0 reduce-scatter, 1 (skipped) all-gather, 2 done */
        if (ferro_plan_next_ring(p, step))
            return 1;
        p->stage = 3;
        p->index = 1;
    }
    if (p->index >= n)
        return 0;
    ferro_plan_clear(step);
    if (p->rank != p->root) {  /* this rank's complete chunk, to the root */
        p->index = n;
        step->send_peer = p->root;
        step->send_off = p->starts[p->rank] * p->itemsize;
        step->send_len = (p->ends[p->rank] - p->starts[p->rank]) * p->itemsize;
        return 1;
    }
    j = (p->root + p->index++) % n;  /* the root takes them in turn, from root + 1 on */
    step->recv_peer = j;
    step->recv_off = p->starts[j] * p->itemsize;
    step->recv_len = (p->ends[j] - p->starts[j]) * p->itemsize;
    return 1;
}

/* Start a broadcast as a scatter and an all-gather (van de Geijn's; MPICH's for medium messages): the message is cut
 * into n parts, part v for the rank v places after the root (numpy.array_split's cut of the bytes). A binomial
 * scatter hands every rank its part (the root sends each subtree its parts, the larger half first), then the
 * ring's all-gather passes the parts around: 2 (n - 1)/n of the message through each link in log2(n) + n - 1
 * messages, where the tree sends the whole message log2(n) times. `starts` and `ends` (n entries each, filled
 * here) hold the parts' byte ranges by the rank that owns them, for the ring. */
static inline void ferro_plan_init_scatter_all_gather(ferro_plan *plan, int rank, int n, int root, size_t nbytes,
                                                      size_t *starts, size_t *ends) {
    int r, v;
    ferro_plan_init(plan, FERRO_PLAN_SCATTER_ALL_GATHER, rank, n, nbytes, 1, starts, ends, NULL,
                    FERRO_PHASE_ALL_GATHER, 0, 0);
    for (r = 0; r < n; r++) {
        v = (r - root + n) % n;
        starts[r] = ferro_plan_bound(nbytes, n, v);
        ends[r] = ferro_plan_bound(nbytes, n, v + 1);
    }
    plan->root = root;
    plan->virtual_rank = (rank - root + n) % n;
    plan->mask = 1;
}

static int ferro_plan_next_scatter_all_gather(ferro_plan *p, ferro_step *step) {
    int v = p->virtual_rank, n = p->n, child, last;
    if (p->part == 0) {
        ferro_plan_clear(step);
        if (p->stage == 0) {  /* the parent (the lowest set bit of v) sends this rank's subtree's parts */
            p->stage = 1;
            while (p->mask < n && !(v & p->mask))
                p->mask <<= 1;
            if (v) {
                last = v + p->mask < n ? v + p->mask : n;
                step->recv_peer = (v - p->mask + p->root) % n;
                step->recv_off = ferro_plan_bound(p->nbytes, n, v);
                step->recv_len = ferro_plan_bound(p->nbytes, n, last) - step->recv_off;
            }
            p->mask >>= 1;  /* the children sit below the parent's bit (the root's: below n) */
            if (step->recv_len)
                return 1;
        }
        while (p->mask > 0) {  /* each child its subtree's parts, the farthest (largest) first */
            ferro_plan_clear(step);
            child = v + p->mask;
            last = child + p->mask < n ? child + p->mask : n;
            p->mask >>= 1;
            if (child < n) {
                step->send_peer = (child + p->root) % n;
                step->send_off = ferro_plan_bound(p->nbytes, n, child);
                step->send_len = ferro_plan_bound(p->nbytes, n, last) - step->send_off;
                if (step->send_len)
                    return 1;
            }
        }
        p->part = 1;  /* the ring's all-gather, over the parts by owner */
        p->stage = 0;
        p->index = 0;
    }
    return ferro_plan_next_ring(p, step);
}

/* Start Bruck's all_gather of `block` bytes per rank. The working buffer holds the n blocks in this rank's order
 * (block j is rank + j's): the executor puts this rank's own first and rotates them into rank order at the end. */
static inline void ferro_plan_init_bruck(ferro_plan *plan, int rank, int n, size_t block) {
    ferro_plan_init(plan, FERRO_PLAN_BRUCK, rank, n, 0, 1, NULL, NULL, NULL, 0, 0, 0);
    plan->block = block;
    plan->index = 1;  /* blocks held so far */
}

static int ferro_plan_next_bruck(ferro_plan *p, ferro_step *step) {
    /* Round k sends the first min(2^k, n - 2^k) blocks to rank - 2^k while as many arrive from rank + 2^k. */
    size_t have = (size_t)p->index, count;
    int n = p->n, rank = p->rank;
    if (have >= (size_t)n)
        return 0;
    count = have < (size_t)n - have ? have : (size_t)n - have;
    ferro_plan_clear(step);
    step->send_peer = (int)((rank - (long)have % n + n) % n);
    step->send_len = count * p->block;
    step->recv_peer = (int)((rank + have) % (size_t)n);
    step->recv_off = have * p->block;
    step->recv_len = count * p->block;
    p->index = (int)(have + count);
    return 1;
}

/* Start an all_to_all: the pairwise exchange over `send_bounds`/`recv_bounds` (n + 1 byte offsets each: rank j's
 * block to send, and where rank j's lands), or Bruck's over equal `block`-byte blocks. Bruck's working buffer holds
 * the n blocks rotated: block j is bound for rank + j, and at the end came from rank - j (the executor rotates). */
static inline void ferro_plan_init_all_to_all(ferro_plan *plan, int algorithm, int rank, int n,
                                              const size_t *send_bounds, const size_t *recv_bounds, size_t block) {
    ferro_plan_init(plan, algorithm, rank, n, 0, 1, NULL, NULL, NULL, 0, 0, 0);
    plan->send_bounds = send_bounds;
    plan->recv_bounds = recv_bounds;
    plan->block = block;
    plan->index = 1;
}

static inline size_t ferro_plan_blocks_with_bit(int n, size_t bit) {
    /* How many of the indices 0 .. n - 1 have `bit` set. */
    size_t full = (size_t)n / (2 * bit), rest = (size_t)n % (2 * bit);
    return full * bit + (rest > bit ? rest - bit : 0);
}

static int ferro_plan_next_all_to_all(ferro_plan *p, ferro_step *step) {
    int n = p->n, rank = p->rank, dst, src;
    size_t bit;
    ferro_plan_clear(step);
    if (p->algorithm == FERRO_PLAN_PAIRWISE) {
        if (p->index >= n)
            return 0;
        dst = (rank + p->index) % n;
        src = (rank - p->index + n) % n;
        p->index++;
        step->send_peer = dst;
        step->send_off = p->send_bounds[dst];
        step->send_len = p->send_bounds[dst + 1] - p->send_bounds[dst];
        step->recv_peer = src;
        step->recv_off = p->recv_bounds[src];
        step->recv_len = p->recv_bounds[src + 1] - p->recv_bounds[src];
        step->flags = FERRO_STEP_SEND_SOURCE;
        return 1;
    }
    bit = (size_t)p->index;  /* Bruck: a block at index j still has j's unprocessed bits to travel */
    if (bit >= (size_t)n)
        return 0;
    p->index = (int)(bit * 2);
    step->send_peer = (int)((rank + bit) % (size_t)n);
    step->recv_peer = (int)((rank - (long)bit % n + n) % n);
    step->send_len = step->recv_len = ferro_plan_blocks_with_bit(n, bit) * p->block;
    step->flags = FERRO_STEP_PACK;
    step->pack_bit = bit;
    return 1;
}

static int ferro_plan_next_dissemination(ferro_plan *p, ferro_step *step) {
    /* Empty messages: after round k every rank has heard, through some path, from the 2^(k+1) ranks before it. */
    int distance = p->index ? p->index : 1;
    if (distance >= p->n)
        return 0;
    ferro_plan_clear(step);
    step->send_peer = (p->rank + distance) % p->n;
    step->recv_peer = (p->rank - distance + p->n) % p->n;
    p->index = distance * 2;
    return 1;
}

/* The next step of the plan into `step`: 1, or 0 when the plan is done. */
static inline int ferro_plan_next(ferro_plan *plan, ferro_step *step) {
    if (plan->n < 2)
        return 0;
    switch (plan->algorithm) {
    case FERRO_PLAN_RING: return ferro_plan_next_ring(plan, step);
    case FERRO_PLAN_BINOMIAL_TREE: return ferro_plan_next_tree(plan, step);
    case FERRO_PLAN_CHAIN: return ferro_plan_next_chain(plan, step);
    case FERRO_PLAN_BRUCK: return ferro_plan_next_bruck(plan, step);
    case FERRO_PLAN_PAIRWISE:
    case FERRO_PLAN_BRUCK_ALL_TO_ALL: return ferro_plan_next_all_to_all(plan, step);
    case FERRO_PLAN_DISSEMINATION: return ferro_plan_next_dissemination(plan, step);
    case FERRO_PLAN_REDUCE_TREE: return ferro_plan_next_reduce_tree(plan, step);
    case FERRO_PLAN_REDUCE_RING_GATHER: return ferro_plan_next_reduce_ring_gather(plan, step);
    case FERRO_PLAN_REDUCE_CHAIN: return ferro_plan_next_reduce_chain(plan, step);
    case FERRO_PLAN_SCATTER_ALL_GATHER: return ferro_plan_next_scatter_all_gather(plan, step);
    default: return ferro_plan_next_doubling(plan, step);  /* recursive doubling, halving-doubling */
    }
}

/* --- Choosing among the plans ------------------------------------------------------------------------------
 *
 * The closed forms of the schedules above under the alpha-beta model, in units of one byte on the wire: a message
 * costs `latency_bytes` (alpha / beta: what a link moves in one message's fixed cost) plus its bytes, and a byte
 * copied locally costs `copy_ratio` (memcpy's seconds per byte / beta). Every rank evaluates the same doubles in
 * the same order, so every rank chooses alike. A third number, `partner_ratio`, scales the bytes of plans whose
 * every step talks to a new partner (the tree's root, Bruck's rounds, the pairwise exchange) against those that
 * keep streaming to one (the ring, the chain): on the emulated 100 Mbit clusters such steps ran 1.1-1.8x slower per
 * byte, which a fitted model measures as halving-doubling's time over the ring's at each size it timed (the mesh
 * interpolates it by the call's size: Mesh.partner). ferro.backend.cost_model
 * derives the numbers from a fitted model (or its defaults, which reproduce the thresholds measured on loopback)
 * and the tests hold these forms to the simulator's replay of the plans themselves.
 */

static inline double ferro_log2_rounds(int n) {
    int rounds = 0;
    while ((1 << rounds) < n)
        rounds++;
    return (double)rounds;
}

/* The chain's segment for `nbytes` among n ranks: sqrt(m L / (n - 2)) minimises (n - 2 + m / s) (L + s). */
static inline size_t ferro_chain_segment(size_t nbytes, int n, double latency_bytes, size_t smallest,
                                         size_t largest) {
    double best = n > 2 ? sqrt((double)nbytes * latency_bytes / (double)(n - 2)) : (double)largest;
    size_t segment = best >= (double)largest ? largest : (size_t)best;
    segment = segment < smallest ? smallest : segment;
    if (segment > 4096)
        segment -= segment % 4096;  /* whole pages */
    return segment ? segment : 1;
}

static inline double ferro_cost_tree(size_t nbytes, int n, double latency_bytes, double partner_ratio) {
    return ferro_log2_rounds(n) * (latency_bytes + partner_ratio * (double)nbytes);
}

/* The scatter's log2(n) rounds from the root, each to a new partner, then the ring's n - 1 steps of a part. */
static inline double ferro_cost_scatter_all_gather(size_t nbytes, int n, double latency_bytes, double partner_ratio) {
    return ferro_log2_rounds(n) * latency_bytes + partner_ratio * (double)nbytes * (n - 1) / n
           + (double)(n - 1) * (latency_bytes + (double)nbytes / n);
}

static inline double ferro_cost_chain(size_t nbytes, int n, double latency_bytes, size_t segment) {
    double pieces = (double)((nbytes + segment - 1) / segment);
    double piece = (double)(nbytes < segment ? nbytes : segment);
    return ((double)(n - 2) + pieces) * (latency_bytes + piece);
}

/* Reduce of `nbytes`: the tree moves the whole message log2(n) times, in turn (its cost is the broadcast tree's,
 * ferro_cost_tree); the ring and the gather move 2(n - 1) chunks of m / n, each a message. */
static inline double ferro_cost_reduce_ring_gather(size_t nbytes, int n, double latency_bytes) {
    return 2.0 * (double)(n - 1) * (latency_bytes + (double)nbytes / n);
}

/* All_gather of `total` bytes in all: the ring's n - 1 steps of a block, or Bruck's ceil(log2 n) rounds that move
 * the same bytes but copy them twice (into rotated order and back). */
static inline double ferro_cost_all_gather_ring(size_t total, int n, double latency_bytes) {
    return (double)(n - 1) * (latency_bytes + (double)total / n);
}

static inline double ferro_cost_all_gather_bruck(size_t total, int n, double latency_bytes, double copy_ratio,
                                                  double partner_ratio) {
    return ferro_log2_rounds(n) * latency_bytes + partner_ratio * (double)(n - 1) / n * (double)total
           + 2.0 * copy_ratio * total;
}

/* All_to_all of `total` bytes per rank (n equal blocks): pairwise n - 1 steps, or Bruck's rounds of about half
 * the blocks each, packed and unpacked every round and rotated twice. */
static inline double ferro_cost_all_to_all_pairwise(size_t total, int n, double latency_bytes,
                                                    double partner_ratio) {
    return (double)(n - 1) * (latency_bytes + partner_ratio * (double)total / n);
}

static inline double ferro_cost_all_to_all_bruck(size_t total, int n, double latency_bytes, double copy_ratio,
                                                 double partner_ratio) {
    double rounds = ferro_log2_rounds(n), moved = 0.0, block = (double)total / n;
    size_t bit;
    for (bit = 1; bit < (size_t)n; bit <<= 1)
        moved += (double)ferro_plan_blocks_with_bit(n, bit) * block;
    return rounds * latency_bytes + partner_ratio * moved + copy_ratio * (2.0 * moved + 2.0 * (double)total);
}

#endif
