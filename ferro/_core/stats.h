/* Per-group communication counters, kept where the bytes move.
 *
 * A group owns one table; every transport of the group (TCP connections, shared-memory
 * rings, the arena) holds a pointer to it and adds the payload bytes of each frame it
 * completes to the slot of the operation the frame belongs to. The slot is the collective
 * id in the fingerprint's top 6 bits (ferro.types.COLLECTIVE_IDS); barrier frames carry
 * no fingerprint and count as the barrier's id; abort notices are not counted.
 * Increments are relaxed atomics: a group's transports may run on several threads.
 */
#ifndef FERRO_STATS_H
#define FERRO_STATS_H

#include <stdint.h>
#include "frame.h"

#define FERRO_STAT_SLOTS 64
#define FERRO_STAT_BARRIER 13 /* ferro.types.COLLECTIVE_IDS["barrier"] */

typedef struct {
    uint64_t calls[FERRO_STAT_SLOTS];
    uint64_t sent[FERRO_STAT_SLOTS];
    uint64_t received[FERRO_STAT_SLOTS];
} ferro_stats;

static inline int ferro_stat_slot(uint32_t kind, uint64_t fingerprint) {
    if (kind == FERRO_KIND_ABORT) return -1;
    if (kind == FERRO_KIND_BARRIER) return FERRO_STAT_BARRIER;
    return (int)(fingerprint >> 58);
}

static inline void ferro_stat_add(uint64_t *table, int slot, uint64_t n) {
    if (slot >= 0 && slot < FERRO_STAT_SLOTS && n) __atomic_fetch_add(&table[slot], n, __ATOMIC_RELAXED);
}

static inline void ferro_count_sent(ferro_stats *s, int slot, uint64_t n) {
    if (s) ferro_stat_add(s->sent, slot, n);
}

static inline void ferro_count_received(ferro_stats *s, int slot, uint64_t n) {
    if (s) ferro_stat_add(s->received, slot, n);
}

static inline void ferro_count_call(ferro_stats *s, int slot) {
    if (s && slot >= 0 && slot < FERRO_STAT_SLOTS) __atomic_fetch_add(&s->calls[slot], 1, __ATOMIC_RELAXED);
}

#endif
