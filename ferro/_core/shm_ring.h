/* Single-producer single-consumer byte rings in a shared-memory segment.
 *
 * One ring per ordered pair of ranks. The producer alone writes `head` and the
 * consumer alone writes `tail`; both only grow (byte counts since the start),
 * so `head - tail` is the number of unread bytes. Stores use release order and
 * loads of the other side's counter use acquire order: bytes copied into the
 * ring happen before the head that publishes them is seen, and bytes copied
 * out happen before the tail that frees their space is seen.
 *
 * Each counter sits on its own cache line, so producer and consumer never
 * write the same line.
 */
#ifndef FERRO_SHM_RING_H
#define FERRO_SHM_RING_H

#include <stdint.h>
#include <string.h>

#include "copy.h"

#define FERRO_CACHE_LINE 64

typedef struct {
    uint64_t head;                        /* bytes written, ever (producer) */
    char pad_head[FERRO_CACHE_LINE - 8];
    uint64_t tail;                        /* bytes read, ever (consumer) */
    char pad_tail[FERRO_CACHE_LINE - 8];
} ferro_ring_ctl;

typedef struct {
    int32_t pid;                          /* the rank's process, for liveness checks */
    uint32_t closed;                      /* set when the rank closed the group */
    char pad[FERRO_CACHE_LINE - 8];
} ferro_rank_ctl;

static inline uint64_t ferro_load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void ferro_store_release(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline uint32_t ferro_load_acquire32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void ferro_store_release32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* Copy up to `len` bytes into the ring; return how many fit. */
static inline size_t ferro_ring_write(ferro_ring_ctl *ctl, unsigned char *data, size_t capacity,
                                      const unsigned char *src, size_t len) {
    uint64_t head = ctl->head;                        /* ours: no ordering needed */
    uint64_t tail = ferro_load_acquire(&ctl->tail);
    size_t free_bytes = capacity - (size_t)(head - tail);
    size_t n = len < free_bytes ? len : free_bytes;
    if (n == 0) return 0;
    size_t at = (size_t)(head % capacity);
    size_t first = capacity - at < n ? capacity - at : n;
    ferro_copy(data + at, src, first);
    ferro_copy(data, src + first, n - first);
    ferro_store_release(&ctl->head, head + n);
    return n;
}

/* Bytes available to read. */
static inline size_t ferro_ring_available(ferro_ring_ctl *ctl) {
    return (size_t)(ferro_load_acquire(&ctl->head) - ctl->tail);
}

/* Copy `len` bytes starting `skip` bytes past the read position, without consuming them. */
static inline void ferro_ring_peek(ferro_ring_ctl *ctl, const unsigned char *data, size_t capacity, size_t skip,
                                   unsigned char *dst, size_t len) {
    size_t at = (size_t)((ctl->tail + skip) % capacity);
    size_t first = capacity - at < len ? capacity - at : len;
    ferro_copy(dst, data + at, first);
    ferro_copy(dst + first, data, len - first);
}

/* Mark `len` bytes as read, freeing their space for the producer. */
static inline void ferro_ring_consume(ferro_ring_ctl *ctl, size_t len) {
    ferro_store_release(&ctl->tail, ctl->tail + len);
}

#endif
