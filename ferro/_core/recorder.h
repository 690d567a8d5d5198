/* The flight recorder of one group: a ring of its most recent calls, written where the calls run.
 *
 * Every collective and point-to-point call of a group takes the next record: its sequence number in the group
 * (the same on every rank, since a group's calls happen in one order everywhere), the collective id and frame
 * fingerprint (what the ranks compare), the bytes it passes, the peer, the times it was queued, started and
 * ended, its state and the user's call site. A record is written by the thread that holds the group (the
 * caller, or the group's worker for queued calls) with the GIL held, and read under the GIL by the dump; so it
 * needs no atomics.
 *
 * Times are ticks: the time-stamp counter where the CPU has an invariant one (a read costs about 12 ns on the
 * development VM, against 30 ns for clock_gettime), else CLOCK_MONOTONIC nanoseconds. The dump converts them
 * to wall-clock time with a calibration taken when it runs (ferro._core.state.tick_calibration).
 */
#ifndef FERRO_RECORDER_H
#define FERRO_RECORDER_H

#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include "callsite.h"

#if defined(__x86_64__) || defined(__i386__)
#  include <x86intrin.h>
#  define FERRO_TICKS_ARE_TSC 1
static inline int64_t ferro_ticks(void) { return (int64_t)__rdtsc(); }
#else
#  define FERRO_TICKS_ARE_TSC 0
static inline int64_t ferro_ticks(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
#endif

enum { FERRO_REC_EMPTY = 0, FERRO_REC_QUEUED = 1, FERRO_REC_RUNNING = 2, FERRO_REC_DONE = 3, FERRO_REC_FAILED = 4 };
enum { FERRO_REC_COLLECTIVE = 0, FERRO_REC_SEND = 1, FERRO_REC_RECV = 2, FERRO_REC_SENDRECV = 3 };

typedef struct {
    uint64_t seq;          /* the call's number in its group, from 1 */
    uint64_t fingerprint;  /* what every frame of the call carries (0: a call that sends none) */
    uint64_t nbytes;       /* bytes this rank passes in */
    int64_t queued;        /* ticks: when the call was made */
    int64_t started;       /* when it began to run (0: not yet) */
    int64_t ended;         /* when it finished (0: not yet) */
    PyObject *code;        /* the user's code object at the call (a strong reference), or NULL */
    int32_t offset;        /* bytes into code's instructions */
    int16_t collective;    /* ferro.types.COLLECTIVE_IDS */
    int16_t state;         /* FERRO_REC_* */
    int32_t peer;          /* point-to-point peer or root, -1 for none */
    int32_t kind;          /* FERRO_REC_* of the call's kind: a collective, or which side of point-to-point */
} ferro_record;

typedef struct {
    ferro_record *ring;    /* capacity records, allocated at the first call */
    uint64_t capacity;     /* a power of two; 0: the recorder is off */
    uint64_t seq;          /* calls recorded so far */
    uint64_t completed;    /* calls that ended (done or failed) */
    int64_t last_ended;    /* ticks of the latest end */
} ferro_recorder;

/* Take the next record and fill in what is known when the call is made. Returns its seq, 0 when off. */
static inline uint64_t ferro_rec_begin(ferro_recorder *r, ferro_callsite_table *sites, int collective, int kind,
                                       uint64_t fingerprint, uint64_t nbytes, int peer, int running) {
    ferro_record *e;
    PyObject *old;
    if (r->capacity == 0) return 0;
    if (r->ring == NULL) {
        r->ring = (ferro_record *)PyMem_Calloc((size_t)r->capacity, sizeof(ferro_record));
        if (r->ring == NULL) { r->capacity = 0; return 0; }
    }
    e = &r->ring[r->seq & (r->capacity - 1)];
    old = e->code;
    e->seq = ++r->seq;
    e->fingerprint = fingerprint;
    e->nbytes = nbytes;
    e->collective = (int16_t)collective;
    e->kind = kind;
    e->peer = peer;
    e->queued = ferro_ticks();
    e->started = running ? e->queued : 0;
    e->ended = 0;
    e->state = running ? FERRO_REC_RUNNING : FERRO_REC_QUEUED;
    ferro_callsite(sites, &e->code, &e->offset);
    Py_XDECREF(old);
    return e->seq;
}

/* The record of call seq, or NULL once the ring has moved past it. */
static inline ferro_record *ferro_rec_find(ferro_recorder *r, uint64_t seq) {
    ferro_record *e;
    if (seq == 0 || r->ring == NULL) return NULL;
    e = &r->ring[(seq - 1) & (r->capacity - 1)];
    return e->seq == seq ? e : NULL;
}

static inline void ferro_rec_start(ferro_recorder *r, uint64_t seq) {
    ferro_record *e = ferro_rec_find(r, seq);
    if (e) { e->started = ferro_ticks(); e->state = FERRO_REC_RUNNING; }
}

static inline void ferro_rec_end(ferro_recorder *r, uint64_t seq, int ok) {
    ferro_record *e = ferro_rec_find(r, seq);
    int64_t now;
    if (seq == 0) return;
    now = ferro_ticks();
    r->completed++;
    r->last_ended = now;
    if (e) { e->ended = now; e->state = ok ? FERRO_REC_DONE : FERRO_REC_FAILED; }
}

/* Drop every record (and the code objects they hold); the recorder keeps its capacity. */
static inline void ferro_rec_clear(ferro_recorder *r) {
    uint64_t i;
    if (r->ring != NULL) {
        for (i = 0; i < r->capacity; i++) Py_XDECREF(r->ring[i].code);
        PyMem_Free(r->ring);
        r->ring = NULL;
    }
}

#endif
