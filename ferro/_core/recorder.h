/* The flight recorder of one group: a ring of its most recent calls, written where the calls run.
 *
 * Every collective and point-to-point call of a group takes the next record: its sequence number in the group
 * (the same on every rank, since a group's calls happen in one order everywhere), the collective id and frame
 * fingerprint (what the ranks compare), the bytes it passes, the peer, the times it was queued, started and
 * ended, its state and the user's call site. A record is written by the thread that holds the group (the
 * caller, or the group's worker for queued calls) with the GIL held, and read under the GIL by the dump; so it
 * needs no atomics. A call's record costs about 10 ns (one cache line, the call site) plus its clock reads.
 *
 * Times are CLOCK_MONOTONIC nanoseconds, and a record takes them from clock reads its engine makes anyway where
 * it can: the shared-memory arena reads the clock only while it waits for a peer, so its calls carry the first
 * and last moments they waited (a call that never waited carries none: it finished in the time the arena spins
 * before it looks at the clock, and it was the last to arrive). Two more reads per call would cost 2 % of a
 * 4-byte shared-memory allreduce (measured in bench/bench_flight_recorder.py); the other paths, ten times
 * slower, read the clock at both ends. A call still running has no start yet when its engine sets none; the
 * hang watch (ferro.collective.hang_watch) sees since when it runs by sampling the group's progress.
 */
#ifndef FERRO_RECORDER_H
#define FERRO_RECORDER_H

#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include "callsite.h"

static inline int64_t ferro_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

enum { FERRO_REC_EMPTY = 0, FERRO_REC_QUEUED = 1, FERRO_REC_RUNNING = 2, FERRO_REC_DONE = 3, FERRO_REC_FAILED = 4 };
enum { FERRO_REC_COLLECTIVE = 0, FERRO_REC_SEND = 1, FERRO_REC_RECV = 2, FERRO_REC_SENDRECV = 3 };

/* One cache line per call: the ring is walked in order, and a record never straddles two lines. */
typedef struct {
    uint64_t seq;          /* the call's number in its group, from 1 */
    uint64_t fingerprint;  /* what every frame of the call carries (0: a call that sends none) */
    uint64_t nbytes;       /* bytes this rank passes in */
    int64_t started;       /* ns: when it began to run (until then, when it was made); 0: not known */
    int64_t ended;         /* when it finished; 0: not yet, or not known */
    PyObject *code;        /* the user's code object at the call (a strong reference), or NULL */
    int32_t waited;        /* how long it was queued before it started, in units of FERRO_WAIT_UNIT ns */
    int32_t offset;        /* bytes into code's instructions */
    int32_t peer;          /* point-to-point peer, -1 for none */
    int16_t collective;    /* ferro.types.COLLECTIVE_IDS */
    int8_t state;          /* FERRO_REC_* */
    int8_t kind;           /* a collective, or which side of point-to-point */
} __attribute__((aligned(64))) ferro_record;

#define FERRO_WAIT_UNIT 1000

typedef struct {
    ferro_record *ring;    /* capacity records, allocated at the first call */
    void *block;           /* what was allocated (ring is its first aligned address) */
    uint64_t capacity;     /* a power of two; 0: the recorder is off */
    uint64_t seq;          /* calls recorded so far */
    uint64_t completed;    /* calls that ended (done or failed) */
    uint64_t collectives;  /* collective calls recorded so far: their numbers agree across ranks, while a rank's
                            * point-to-point calls (a state transfer: one rank sends to several) differ */
} ferro_recorder;

/* Take the next record and fill in what is known when the call is made (at time made, 0: not known).
 * Returns its seq (counted when the recorder is off too). */
static inline uint64_t ferro_rec_begin(ferro_recorder *r, ferro_callsite_table *sites, int collective, int kind,
                                       uint64_t fingerprint, uint64_t nbytes, int peer, int running,
                                       int64_t made) {
    ferro_record *e;
    PyObject *code;
    int offset;
    if (kind == FERRO_REC_COLLECTIVE) r->collectives++;
    if (r->capacity == 0) return ++r->seq;  /* off: still counted, the hang watch reads progress from it */
    if (r->ring == NULL) {
        r->block = PyMem_Calloc((size_t)r->capacity + 1, sizeof(ferro_record));
        if (r->block == NULL) { r->capacity = 0; return 0; }
        r->ring = (ferro_record *)(((uintptr_t)r->block + 63) & ~(uintptr_t)63);
    }
    e = &r->ring[r->seq & (r->capacity - 1)];
    /* The next call's line, for writing: its fetch overlaps this call instead of stalling the next one (a ring
     * of a few thousand records outgrows the L1 cache, and a write to a line not in it waited for the line). */
    __builtin_prefetch(&r->ring[(r->seq + 1) & (r->capacity - 1)], 1, 0);
    e->seq = ++r->seq;
    e->fingerprint = fingerprint;
    e->nbytes = nbytes;
    e->collective = (int16_t)collective;
    e->kind = (int8_t)kind;
    e->peer = peer;
    e->started = made;
    e->ended = 0;
    e->waited = 0;
    e->state = running ? FERRO_REC_RUNNING : FERRO_REC_QUEUED;
    ferro_callsite(sites, &code, &offset);
    e->offset = offset;
    if (code != e->code) {  /* the same call site as the last lap's keeps its reference */
        PyObject *old = e->code;
        Py_XINCREF(code);
        e->code = code;
        Py_XDECREF(old);
    }
    return e->seq;
}

/* The record of call seq, or NULL once the ring has moved past it. */
static inline ferro_record *ferro_rec_find(ferro_recorder *r, uint64_t seq) {
    ferro_record *e;
    if (seq == 0 || r->ring == NULL || r->capacity == 0) return NULL;
    e = &r->ring[(seq - 1) & (r->capacity - 1)];
    return e->seq == seq ? e : NULL;
}

static inline void ferro_rec_start(ferro_recorder *r, uint64_t seq) {
    ferro_record *e = ferro_rec_find(r, seq);
    int64_t now, units;
    if (!e) return;
    now = ferro_now_ns();
    units = e->started ? (now - e->started) / FERRO_WAIT_UNIT : 0;
    e->waited = (int32_t)(units > INT32_MAX ? INT32_MAX : units);
    e->started = now;
    e->state = FERRO_REC_RUNNING;
}

/* Call seq ended; started (if not 0) replaces its start, ended is its end (0: not known). */
static inline void ferro_rec_end(ferro_recorder *r, uint64_t seq, int ok, int64_t started, int64_t ended) {
    ferro_record *e = ferro_rec_find(r, seq);
    if (seq == 0) return;
    r->completed++;
    if (e) {
        if (started) e->started = started;
        e->ended = ended;
        e->state = ok ? FERRO_REC_DONE : FERRO_REC_FAILED;
    }
}

/* Drop every record (and the code objects they hold); the recorder keeps its capacity. */
static inline void ferro_rec_clear(ferro_recorder *r) {
    uint64_t i;
    if (r->ring != NULL) {
        for (i = 0; i < r->capacity; i++) Py_XDECREF(r->ring[i].code);
        PyMem_Free(r->block);
        r->ring = NULL;
        r->block = NULL;
    }
}

#endif
