/* The collective arena of a shared-memory segment: one control block and one
 * data slot per rank.
 *
 * A rank publishes progress through a single counter, `step`: the number of
 * collective phases it has completed, ever. Every rank runs the same sequence
 * of phases, so "rank j has reached step v" means the same thing everywhere.
 * A rank writes its slot, then publishes the step with release order; a peer
 * loads the step with acquire order before it reads that slot, so it sees the
 * bytes. Nothing else is shared: there are no locks in the segment.
 *
 * Each call also records (call number, kind, fingerprint) in a small history
 * indexed by call number, so a peer can check that both ranks made the same
 * call. A peer can be at most a few calls ahead (it cannot reuse a slot
 * buffer before everyone has read it), far fewer than the history holds.
 *
 * A rank that gives up writes an abort notice into its block and then sets
 * `abort_len`; peers waiting on it read the notice and raise what it says.
 */
#ifndef FERRO_ARENA_H
#define FERRO_ARENA_H

#include <stdint.h>

#define FERRO_ARENA_HISTORY 8
#define FERRO_ARENA_NOTICE_BYTES 4096

typedef struct {
    uint64_t call;
    uint64_t kind;
    uint64_t fingerprint;
} ferro_arena_call;

typedef struct {
    uint64_t step;                                  /* phases completed, ever (release-stored) */
    uint64_t calls;                                 /* collectives started, ever (for diagnostics) */
    char pad_step[48];
    ferro_arena_call history[FERRO_ARENA_HISTORY];  /* the calls this rank made, by call % HISTORY */
    char pad_history[64 - (FERRO_ARENA_HISTORY * 24) % 64];
    uint32_t abort_len;                             /* non-zero: the rank gave up; notice holds why */
    char pad_abort[60];
    unsigned char notice[FERRO_ARENA_NOTICE_BYTES];
} ferro_arena_ctl;

#endif
