/* Element-wise reduction kernels: dst[i] = dst[i] OP src[i], one loop per dtype and op.
 *
 * The loops are plain C over restrict pointers so the compiler vectorises them at -O3.
 * float16 and bfloat16 are widened to float32, combined, and rounded back to nearest-even,
 * so each pairwise step is computed in float32.
 *
 * MIN and MAX propagate NaN (like numpy.minimum/maximum) and are written so that
 * op(a, b) == op(b, a) bit for bit: ranks that combine the same partials in another order
 * still agree exactly.
 */
#ifndef FERRO_REDUCE_KERNELS_H
#define FERRO_REDUCE_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum ferro_dtype {
    FERRO_F16 = 0, FERRO_BF16 = 1, FERRO_F32 = 2, FERRO_F64 = 3,
    FERRO_I8 = 4, FERRO_I16 = 5, FERRO_I32 = 6, FERRO_I64 = 7,
    FERRO_U8 = 8, FERRO_U16 = 9, FERRO_U32 = 10, FERRO_U64 = 11,
    FERRO_DTYPE_COUNT = 12
};

enum ferro_op {
    FERRO_SUM = 0, FERRO_PRODUCT = 1, FERRO_MIN = 2, FERRO_MAX = 3,
    FERRO_BAND = 4, FERRO_BOR = 5, FERRO_BXOR = 6, FERRO_OP_COUNT = 7
};

/* ---- 16-bit float conversions (portable, round to nearest even) ---- */

static inline float ferro_bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t ferro_f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float ferro_bf16_to_f32(uint16_t h) { return ferro_bits_to_f32((uint32_t)h << 16); }

static inline uint16_t ferro_f32_to_bf16(float f) {
    uint32_t u = ferro_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float ferro_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) /* inf or NaN */
        return ferro_bits_to_f32(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        if (mantissa == 0) return ferro_bits_to_f32(sign);
        /* subnormal half: value = mantissa * 2^-24, exact in float32 */
        float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    return ferro_bits_to_f32(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

static inline uint16_t ferro_f32_to_f16(float f) {
    uint32_t u = ferro_f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t magnitude = u & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u;           /* NaN */
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u;          /* rounds to inf (>= 65520) */
    if (magnitude < 0x38800000u) {                               /* below the smallest normal half */
        /* subnormal: round magnitude / 2^-24 to nearest even */
        float scaled = ferro_bits_to_f32(magnitude) * 16777216.0f; /* exact: power of two */
        float rounded = nearbyintf(scaled);                        /* default mode: nearest even */
        return sign | (uint16_t)rounded;
    }
    /* normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even */
    uint32_t half = ((magnitude >> 13) - (112u << 10));
    uint32_t rest = magnitude & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half += 1u;
    return sign | (uint16_t)half;
}

/* ---- combining two values ---- */

#define FERRO_SUM_OF(a, b) ((a) + (b))
#define FERRO_PRODUCT_OF(a, b) ((a) * (b))
#define FERRO_BAND_OF(a, b) ((a) & (b))
#define FERRO_BOR_OF(a, b) ((a) | (b))
#define FERRO_BXOR_OF(a, b) ((a) ^ (b))
#define FERRO_IMIN_OF(a, b) ((b) < (a) ? (b) : (a))
#define FERRO_IMAX_OF(a, b) ((b) > (a) ? (b) : (a))
/* NaN-propagating and symmetric: a NaN on either side wins; +-0 compare equal, so the
 * sign of a zero could depend on order -- break that tie on the bit pattern. */
#define FERRO_FMIN_OF(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : (a) < (b) ? (a) : (b) < (a) ? (b) : ((a) == 0 ? ((signbit(a) ? (a) : (b))) : (a)))
#define FERRO_FMAX_OF(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : (a) > (b) ? (a) : (b) > (a) ? (b) : ((a) == 0 ? ((signbit(a) ? (b) : (a))) : (a)))

#define FERRO_LOOP(name, T, COMBINE)                                                         \
    static void name(void *restrict dst_, const void *restrict src_, size_t n) {             \
        T *restrict dst = (T *)dst_;                                                         \
        const T *restrict src = (const T *)src_;                                             \
        for (size_t i = 0; i < n; i++) dst[i] = COMBINE(dst[i], src[i]);                     \
    }

#define FERRO_LOOP16(name, TO32, FROM32, COMBINE)                                            \
    static void name(void *restrict dst_, const void *restrict src_, size_t n) {             \
        uint16_t *restrict dst = (uint16_t *)dst_;                                           \
        const uint16_t *restrict src = (const uint16_t *)src_;                               \
        for (size_t i = 0; i < n; i++) {                                                     \
            float a = TO32(dst[i]), b = TO32(src[i]);                                        \
            dst[i] = FROM32(COMBINE(a, b));                                                  \
        }                                                                                    \
    }

#define FERRO_FLOAT_LOOPS(prefix, T)                                                         \
    FERRO_LOOP(prefix##_sum, T, FERRO_SUM_OF)                                                \
    FERRO_LOOP(prefix##_product, T, FERRO_PRODUCT_OF)                                        \
    FERRO_LOOP(prefix##_min, T, FERRO_FMIN_OF)                                               \
    FERRO_LOOP(prefix##_max, T, FERRO_FMAX_OF)

#define FERRO_INT_LOOPS(prefix, T)                                                           \
    FERRO_LOOP(prefix##_sum, T, FERRO_SUM_OF)                                                \
    FERRO_LOOP(prefix##_product, T, FERRO_PRODUCT_OF)                                        \
    FERRO_LOOP(prefix##_min, T, FERRO_IMIN_OF)                                               \
    FERRO_LOOP(prefix##_max, T, FERRO_IMAX_OF)                                               \
    FERRO_LOOP(prefix##_band, T, FERRO_BAND_OF)                                              \
    FERRO_LOOP(prefix##_bor, T, FERRO_BOR_OF)                                                \
    FERRO_LOOP(prefix##_bxor, T, FERRO_BXOR_OF)

#define FERRO_HALF_LOOPS(prefix, TO32, FROM32)                                               \
    FERRO_LOOP16(prefix##_sum, TO32, FROM32, FERRO_SUM_OF)                                   \
    FERRO_LOOP16(prefix##_product, TO32, FROM32, FERRO_PRODUCT_OF)                           \
    FERRO_LOOP16(prefix##_min, TO32, FROM32, FERRO_FMIN_OF)                                  \
    FERRO_LOOP16(prefix##_max, TO32, FROM32, FERRO_FMAX_OF)

FERRO_HALF_LOOPS(ferro_f16, ferro_f16_to_f32, ferro_f32_to_f16)
FERRO_HALF_LOOPS(ferro_bf16, ferro_bf16_to_f32, ferro_f32_to_bf16)
FERRO_FLOAT_LOOPS(ferro_f32, float)
FERRO_FLOAT_LOOPS(ferro_f64, double)
FERRO_INT_LOOPS(ferro_i8, int8_t)
FERRO_INT_LOOPS(ferro_i16, int16_t)
FERRO_INT_LOOPS(ferro_i32, int32_t)
FERRO_INT_LOOPS(ferro_i64, int64_t)
FERRO_INT_LOOPS(ferro_u8, uint8_t)
FERRO_INT_LOOPS(ferro_u16, uint16_t)
FERRO_INT_LOOPS(ferro_u32, uint32_t)
FERRO_INT_LOOPS(ferro_u64, uint64_t)

typedef void (*ferro_reduce_fn)(void *restrict, const void *restrict, size_t);

#define FERRO_FLOAT_ROW(prefix) {prefix##_sum, prefix##_product, prefix##_min, prefix##_max, NULL, NULL, NULL}
#define FERRO_INT_ROW(prefix) {prefix##_sum, prefix##_product, prefix##_min, prefix##_max, prefix##_band, prefix##_bor, prefix##_bxor}

static ferro_reduce_fn const ferro_reduce_table[FERRO_DTYPE_COUNT][FERRO_OP_COUNT] = {
    FERRO_FLOAT_ROW(ferro_f16), FERRO_FLOAT_ROW(ferro_bf16), FERRO_FLOAT_ROW(ferro_f32), FERRO_FLOAT_ROW(ferro_f64),
    FERRO_INT_ROW(ferro_i8), FERRO_INT_ROW(ferro_i16), FERRO_INT_ROW(ferro_i32), FERRO_INT_ROW(ferro_i64),
    FERRO_INT_ROW(ferro_u8), FERRO_INT_ROW(ferro_u16), FERRO_INT_ROW(ferro_u32), FERRO_INT_ROW(ferro_u64),
};

static const size_t ferro_dtype_size[FERRO_DTYPE_COUNT] = {2, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8};

/* The kernel for (dtype, op), or NULL when the op does not apply to the dtype. */
static inline ferro_reduce_fn ferro_reduce_kernel(int dtype, int op) {
    if (dtype < 0 || dtype >= FERRO_DTYPE_COUNT || op < 0 || op >= FERRO_OP_COUNT) return NULL;
    return ferro_reduce_table[dtype][op];
}

/* buf[i] /= divisor for floating dtypes (MEAN = SUM / world size); 16-bit floats via float32. */
static inline int ferro_divide(void *buf, size_t n, int dtype, double divisor) {
    size_t i;
    switch (dtype) {
    case FERRO_F32: { float *p = (float *)buf; float d = (float)divisor; for (i = 0; i < n; i++) p[i] /= d; return 0; }
    case FERRO_F64: { double *p = (double *)buf; for (i = 0; i < n; i++) p[i] /= divisor; return 0; }
    case FERRO_F16: { uint16_t *p = (uint16_t *)buf; float d = (float)divisor;
        for (i = 0; i < n; i++) p[i] = ferro_f32_to_f16(ferro_f16_to_f32(p[i]) / d); return 0; }
    case FERRO_BF16: { uint16_t *p = (uint16_t *)buf; float d = (float)divisor;
        for (i = 0; i < n; i++) p[i] = ferro_f32_to_bf16(ferro_bf16_to_f32(p[i]) / d); return 0; }
    default: return -1;
    }
}

#endif
