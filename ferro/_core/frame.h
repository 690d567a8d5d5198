/* The frame header of ferro's wire format: 32 bytes, little-endian on every host.
 *
 *   offset 0  u32  magic       "FRO" + protocol version byte
 *   offset 4  u32  kind        what the frame is for (data, barrier, ...)
 *   offset 8  u64  length      payload bytes that follow the header
 *   offset 16 u64  seq         per-connection, per-direction sequence number
 *   offset 24 u64  fingerprint the sender's call (op, dtype, count) for mismatch checks
 *
 * Packing byte by byte keeps the format independent of host endianness; compilers
 * turn these loops into single loads and stores on little-endian machines.
 */
#ifndef FERRO_FRAME_H
#define FERRO_FRAME_H

#include <stdint.h>

#define FERRO_HEADER_SIZE 32
#define FERRO_PROTOCOL_VERSION 1u
#define FERRO_FRAME_MAGIC (0x4F5246u | (FERRO_PROTOCOL_VERSION << 24)) /* "FRO\x01" */

/* Frame kinds (mirrored as KIND_* in transport.pyx). */
#define FERRO_KIND_DATA 1u
#define FERRO_KIND_BARRIER 2u
#define FERRO_KIND_COLLECTIVE 3u
#define FERRO_KIND_ABORT 4u

static inline void ferro_put_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline void ferro_put_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline uint32_t ferro_get_u32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static inline uint64_t ferro_get_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static inline void ferro_pack_header(unsigned char *h, uint32_t kind, uint64_t length,
                                     uint64_t seq, uint64_t fingerprint) {
    ferro_put_u32(h, FERRO_FRAME_MAGIC);
    ferro_put_u32(h + 4, kind);
    ferro_put_u64(h + 8, length);
    ferro_put_u64(h + 16, seq);
    ferro_put_u64(h + 24, fingerprint);
}

#endif
