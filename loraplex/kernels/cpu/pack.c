#include "common.h"

/* An adapter's matrices, from the bytes of its safetensors file into the pages of its pool image
 * in the serving dtype, in one call that holds no Python lock (cpu_lora.CpuPacker). Each entry of
 * `table` is a run of rows of one matrix, written one row after another at its destination:
 *
 *   [source byte offset, source dtype (PACK_F32, PACK_BF16, PACK_F16), the source's element
 *    stride from one of the run's rows to the next, from one column to the next, rows, columns,
 *    destination element offset]
 *
 * A row of B^T is a column of the file's B [out_features, rank]: strides (1, rank). Values are
 * converted as torch converts them (widened exactly, then bfloat16 rounded to nearest even).
 * Returns the first entry holding a value that is not finite in the serving dtype (the adapter is
 * refused, so the rest is left unwritten), or -1. One thread: readers run beside a step's team.
 * Sources may be unaligned (safetensors aligns nothing), so they are read with memcpy. */

enum { PACK_F32 = 0, PACK_BF16 = 1, PACK_F16 = 2, PACK_FIELDS = 7, PACK_BLOCK = 256 };

/* IEEE half to float32, exactly (subnormal halves are normal float32s) */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0) {
        const float f = (float)mantissa * 0x1p-24f;
        return sign ? -f : f;
    }
    const uint32_t bits =
        sign | (exponent == 0x1fu ? 0x7f800000u : (exponent + 112u) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* n values `stride` elements apart, widened to float32 */
static void widen(const uint8_t *src, int64_t dtype, int64_t stride, int64_t n, float *out) {
    if (dtype == PACK_F32) {
        for (int64_t k = 0; k < n; k++) memcpy(&out[k], src + 4 * k * stride, 4);
        return;
    }
    for (int64_t k = 0; k < n; k++) {
        uint16_t h;
        memcpy(&h, src + 2 * k * stride, 2);
        out[k] = dtype == PACK_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
}

#define DEFINE_PACK(NAME, T, STORE, EXPONENT)                                                    \
    int64_t NAME(const uint8_t *src, T *dst, const int64_t *table, int64_t entries) {            \
        float block[PACK_BLOCK];                                                                 \
        for (int64_t e = 0; e < entries; e++) {                                                  \
            const int64_t *t = table + e * PACK_FIELDS;                                          \
            const int64_t dtype = t[1], row_stride = t[2], col_stride = t[3], cols = t[5];       \
            const int64_t size = dtype == PACK_F32 ? 4 : 2;                                      \
            T *out = dst + t[6];                                                                 \
            uint32_t exponents = 0; /* an all-ones exponent: infinity or NaN */                  \
            for (int64_t r = 0; r < t[4]; r++) {                                                 \
                for (int64_t c = 0; c < cols; c += PACK_BLOCK) {                                 \
                    const int64_t n = cols - c < PACK_BLOCK ? cols - c : PACK_BLOCK;             \
                    widen(src + t[0] + (r * row_stride + c * col_stride) * size, dtype,          \
                          col_stride, n, block);                                                 \
                    for (int64_t k = 0; k < n; k++) {                                            \
                        const T v = STORE(block[k]);                                             \
                        exponents |= ((uint32_t)v & EXPONENT) == EXPONENT;                       \
                        out[k] = v;                                                              \
                    }                                                                            \
                    out += n;                                                                    \
                }                                                                                \
            }                                                                                    \
            if (exponents) return e;                                                             \
        }                                                                                        \
        return -1;                                                                               \
    }

static inline uint32_t f32_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}
DEFINE_PACK(pack_matrices_bf16, uint16_t, f32_to_bf16, 0x7f80u)
DEFINE_PACK(pack_matrices_f32, uint32_t, f32_bits, 0x7f800000u)
#undef DEFINE_PACK
