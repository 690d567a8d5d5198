/* Copying bytes between ranks' buffers in shared memory.
 *
 * glibc's memcpy moves mid-sized blocks with `rep movsb`. On AMD Zen CPUs that
 * instruction slows down about 15x when the destination lies just above the
 * source modulo 4 KiB (measured on this project's EPYC VM: 3 GB/s instead of
 * 50 GB/s for 16 KiB to 256 KiB, and 4 instead of 14 GB/s at 256 MiB). Whether
 * a copy hits that case depends only on where the caller's array happens to sit
 * in memory, so a collective's speed would change from run to run. A plain
 * SSE2 loop (baseline on every x86-64) has no such cliff and matches memcpy
 * elsewhere; other architectures use memcpy.
 */
#ifndef FERRO_COPY_H
#define FERRO_COPY_H

#include <stddef.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>

static inline void ferro_copy(void *restrict dst, const void *restrict src, size_t n) {
    unsigned char *d = (unsigned char *)dst;
    const unsigned char *s = (const unsigned char *)src;
    size_t i = 0;
    if (n >= 512) {
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_storeu_si128((__m128i *)(d + i), a);
            _mm_storeu_si128((__m128i *)(d + i + 16), b);
            _mm_storeu_si128((__m128i *)(d + i + 32), c);
            _mm_storeu_si128((__m128i *)(d + i + 48), e);
        }
    }
    memcpy(d + i, s + i, n - i);  /* the tail (or a small copy): below rep movsb's threshold */
}
#else
static inline void ferro_copy(void *restrict dst, const void *restrict src, size_t n) { memcpy(dst, src, n); }
#endif

#endif
