/* How a rank waits on shared memory: the one schedule the rings and the arena share.
 *
 * A rank with a core of its own (spin_ns > 0) spins for spin_ns after the last progress (a
 * peer on another core usually answers within microseconds), then naps 20 us between looks.
 * It never yields: with compute threads on the cores (a training job's normal state) a
 * sched_yield hands the core to one of them for a whole time slice, and the answer that
 * arrives meanwhile waits milliseconds; a nap ends in a wake-up that the scheduler serves
 * first. Measured (2-core VM, 2 ranks, 4 B allreduce, one or two matmul threads per rank):
 * a 50 us spin then yields averaged 13-25 us per call with a 3.7-8 ms tail at p99.9;
 * spin then nap, 1.4-2.0 us with 4.5-6 us at p99.9 (Open MPI's shared memory: 2.7-151 us).
 * Ranks that outnumber the cores (spin_ns == 0) yield instead for yield_ns (a millisecond, up to
 * four ranks a core), so that the peer sharing this core runs at once, then nap. Past four a
 * core they nap at once (yield_ns 0, the backends' default_yield_us): with many waiters a core,
 * the yielders churn through the run queue and hold off the ranks with work and the kernel's
 * network processing. Among 8 emulated hosts of 2 ranks (16 ranks, 2 cores), the hierarchy's
 * host members yielding while their leaders crossed the links took a 4 B allreduce to 3.3 ms.
 * Every millisecond it is due to look at the peers (alive? gave up? this rank closed?)
 * and every 100 ms at signals (Ctrl-C). The caller does the looking; this only paces.
 */
#ifndef FERRO_PACE_H
#define FERRO_PACE_H

#include <stdint.h>
#include <sched.h>
#include <time.h>

#define FERRO_PACE_LOOK_NS 1000000LL       /* look at the peers every millisecond of waiting */
#define FERRO_PACE_SIGNALS_NS 100000000LL  /* and at signals every 100 ms */
#define FERRO_PACE_DOZE_NS 20000L          /* for 20 us */

typedef struct {
    int64_t last_progress;  /* when the wait last saw progress (or began) */
    int64_t next_look;
    int64_t next_signals;
    int64_t spin_ns;
    int64_t yield_ns;       /* without a spin: how long a quiet wait yields before it naps */
} ferro_pace;

static inline void ferro_pace_start(ferro_pace *p, int64_t now, int64_t spin_ns, int64_t yield_ns) {
    p->last_progress = now;
    p->next_look = now + FERRO_PACE_LOOK_NS;
    p->next_signals = now + FERRO_PACE_SIGNALS_NS;
    p->spin_ns = spin_ns;
    p->yield_ns = yield_ns;
}

static inline void ferro_pace_progress(ferro_pace *p, int64_t now) { p->last_progress = now; }

/* 1 when it is time to look at the peers (and the next look is scheduled). */
static inline int ferro_pace_look_due(ferro_pace *p, int64_t now) {
    if (now < p->next_look) return 0;
    p->next_look = now + FERRO_PACE_LOOK_NS;
    return 1;
}

/* 1 when it is time to check for signals (and the next check is scheduled). */
static inline int ferro_pace_signals_due(ferro_pace *p, int64_t now) {
    if (now < p->next_signals) return 0;
    p->next_signals = now + FERRO_PACE_SIGNALS_NS;
    return 1;
}

/* Spin, yield or nap, by how long the wait has been quiet. */
static inline void ferro_pace_rest(ferro_pace *p, int64_t now) {
    int64_t quiet = now - p->last_progress;
    if (quiet <= p->spin_ns)
        return;  /* spin */
    if (p->spin_ns == 0 && quiet <= p->yield_ns) {
        sched_yield();  /* ranks outnumber cores: let the peer on this core run */
        return;
    }
    struct timespec doze = {0, FERRO_PACE_DOZE_NS};
    nanosleep(&doze, NULL);
}

#endif
