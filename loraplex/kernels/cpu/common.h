/* What the CPU kernels share (lora.c, attention.c, ops.c, linear.c): float32 and bfloat16
 * helpers, written out with AVX2 / AVX-512 where the target has them, and AMX's tile setup.
 *
 * The kernels are built and loaded by cpu_lora.py with the machine's own compiler (-O3
 * -march=native -fopenmp; every .c file of this folder into one library), called through
 * ctypes. The OpenMP runtime is the one torch already loaded (same soname), so the two share
 * one thread pool. Arithmetic is float32 whatever the storage dtype; bfloat16 results are
 * rounded to nearest even. Each file chooses its paths by what the compiler targets. */
#ifndef LORAPLEX_CPU_COMMON_H
#define LORAPLEX_CPU_COMMON_H
#define _GNU_SOURCE /* syscall, for AMX's permission */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RANK 1024
#define MAX_MODULES 8

/* NAME(x, a, n) = x . a over n elements for the plain builds (no AVX2), a's elements read as
 * float by READ: eight sums in the source's order, which the compiler may run side by side but
 * not reorder, then paired. An omp simd reduction's order is the compiler's, and may differ from
 * one place it is inlined to another, so a sequence's attention could take other bits in
 * another batch. */
#define DEFINE_ORDERED_DOT(NAME, T, READ)                                                       \
    static inline float NAME(const float *x, const T *a, int64_t n) {                          \
        float acc[8] = {0.0f};                                                                  \
        int64_t k = 0;                                                                          \
        for (; k + 8 <= n; k += 8)                                                              \
            for (int i = 0; i < 8; i++) acc[i] += x[k + i] * READ(a[k + i]);                    \
        float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])); \
        for (; k < n; k++) sum += x[k] * READ(a[k]);                                            \
        return sum;                                                                             \
    }
#define AS_FLOAT(v) (v)

/* float32 dot product, y += v * b and exp. GCC compiles ISO C without fused multiply-adds and
 * left the plain loops of the attention kernel scalar on AVX2, so where the target has AVX2 and
 * FMA they are written out, two accumulators for the dot product (with the attention changes
 * in attention.c, its float32 decode 2.4x faster on keys in cache, 1.28x on keys in memory). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* the largest of v's 8 lanes */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* x . a; with `ahead` (else NULL), the line of ahead at each line of a read brought into L1
 * meanwhile. Its order is the float32 LoRA call's shrink's: lora.c's shrink4_f32 sums four rows
 * at once in this order in the AVX2 and AVX-512 builds, and fetches the rows of the token a
 * thread takes next as this fetches `ahead`, at the pace it reads its own (into L1 in the AVX2
 * build, into L2 in the AVX-512 one). Issued a whole row at a time, 120 calls of a decode step
 * of 32 all-module adapters took 1.03-1.04x as long (2-core Xeon with AMX). Into L1 rather than
 * L2, a call of 32 tokens on 32 q,v adapters (2-core Zen 5, medians of 300 calls, when every
 * build took this path): rows in L3 50.4 -> 46.6-47.9 us, from memory 53.0 -> 48.5-49.4 us. */
static inline float dot_f32_ahead(const float *x, const float *a, int64_t n, const float *ahead) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        if (ahead != NULL) __builtin_prefetch(ahead + k, 0, 3);
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(a + k), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(a + k + 8), acc1);
    }
    if (k + 8 <= n) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(a + k), acc0);
        k += 8;
    }
    if (ahead != NULL && k < n) __builtin_prefetch(ahead + k, 0, 3);
    float acc = hsum8(_mm256_add_ps(acc0, acc1));
    for (; k < n; k++) acc += x[k] * a[k];
    return acc;
}

/* y += v * b; with `ahead`, as dot_f32_ahead */
static inline void axpy_f32_ahead(float *y, float v, const float *b, int64_t n,
                                  const float *ahead) {
    const __m256 vv = _mm256_set1_ps(v);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        if (ahead != NULL && k % 16 == 0) __builtin_prefetch(ahead + k, 0, 3);
        _mm256_storeu_ps(y + k, _mm256_fmadd_ps(vv, _mm256_loadu_ps(b + k), _mm256_loadu_ps(y + k)));
    }
    if (ahead != NULL && k < n) __builtin_prefetch(ahead + k, 0, 3);
    for (; k < n; k++) y[k] += v * b[k];
}

/* exp of eight lanes: 2^n * e^r, r = x - n ln 2 in [-ln2/2, ln2/2], e^r by its Taylor series
 * to the 7th power (error under 1e-8 relative before rounding); x clamped to [-87, 88]. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                             _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* x[i] = exp(x[i] - shift) for i < n; -> their sum. */
static inline float exp_shifted(float *x, int64_t n, float shift) {
    const __m256 s = _mm256_set1_ps(shift);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
        _mm256_storeu_ps(x + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum8(sum);
    for (; i < n; i++) x[i] = expf(x[i] - shift), total += x[i];
    return total;
}
#else
DEFINE_ORDERED_DOT(dot_f32_ordered, float, AS_FLOAT)

static inline float dot_f32_ahead(const float *x, const float *a, int64_t n, const float *ahead) {
    if (ahead != NULL)
        for (int64_t k = 0; k < n; k += 16) __builtin_prefetch(ahead + k, 0, 3);
    return dot_f32_ordered(x, a, n);
}

static inline void axpy_f32_ahead(float *y, float v, const float *b, int64_t n,
                                  const float *ahead) {
    if (ahead != NULL)
        for (int64_t k = 0; k < n; k += 16) __builtin_prefetch(ahead + k, 0, 3);
#pragma omp simd
    for (int64_t k = 0; k < n; k++) y[k] += v * b[k];
}

static inline float exp_shifted(float *x, int64_t n, float shift) {
    float total = 0.0f;
    for (int64_t i = 0; i < n; i++) x[i] = expf(x[i] - shift), total += x[i];
    return total;
}
#endif

static inline float dot_f32(const float *x, const float *a, int64_t n) {
    return dot_f32_ahead(x, a, n, NULL);
}

static inline void axpy_f32(float *y, float v, const float *b, int64_t n) {
    axpy_f32_ahead(y, v, b, n, NULL);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t nan = (bits >> 16) | 0x40u; /* quiet */
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded); /* no branch: SIMD */
}

/* bfloat16 helpers: a dot product with a float32 vector and y += v * b, for the attention
 * passes (attention.c). With AVX-512 the inner loops are written out (a bfloat16 load widened by
 * a shift, two accumulators for the dot product); compilers do not vectorize the plain loops as
 * well. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

static inline __m512 bf16x16(const uint16_t *p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

static inline float dot_bf16(const float *x, const uint16_t *a, int64_t n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), bf16x16(a + k, 0xffff), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), bf16x16(a + k + 16, 0xffff), acc1);
    }
    for (; k < n; k += 16) {
        __mmask16 m = tail_mask(n - k);
        acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), bf16x16(a + k, m), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

static inline void axpy_bf16(float *acc, float v, const uint16_t *b, int64_t n) {
    const __m512 vv = _mm512_set1_ps(v);
    for (int64_t k = 0; k < n; k += 16) {
        __mmask16 m = tail_mask(n - k);
        __m512 sum = _mm512_fmadd_ps(vv, bf16x16(b + k, m), _mm512_maskz_loadu_ps(m, acc + k));
        _mm512_mask_storeu_ps(acc + k, m, sum);
    }
}
#else
#if defined(__AVX2__) && defined(__FMA__)
/* With AVX2 the dot product is written out too, its sum in one order. The order of a plain
 * loop's vectorized sum (`omp simd reduction`, as it was) is the compiler's, and once the
 * attention passes around it changed, a sequence's scores took other bits in a batch of two
 * (split by kv head between the threads) than in a batch of seven, the same query and keys.
 * With attention.c's change to its fetches, a bfloat16 call on 32 sequences of 300 tokens took
 * 0.687x as long in this build, run on a Zen 4 (benchmarks/attention_ab.py --march x86-64-v3). */
static inline __m256 bf16x8(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline float dot_bf16(const float *x, const uint16_t *a, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), bf16x8(a + k), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), bf16x8(a + k + 8), acc1);
    }
    float sum = hsum8(_mm256_add_ps(acc0, acc1));
    for (; k < n; k++) sum += x[k] * bf16_to_f32(a[k]);
    return sum;
}
#else
DEFINE_ORDERED_DOT(dot_bf16, uint16_t, bf16_to_f32)
#endif

/* element by element: no sum whose order the compiler could choose */
static inline void axpy_bf16(float *acc, float v, const uint16_t *b, int64_t n) {
#pragma omp simd
    for (int64_t k = 0; k < n; k++) acc[k] += v * bf16_to_f32(b[k]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __m512 bf16_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }

static inline __m512 bf16_odd(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

static inline __mmask32 tail_mask32(int64_t left) {
    return left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
}

/* float32 lanes -> their bfloat16 in the high half of each lane, rounded to nearest even; a NaN
 * made quiet and not rounded (rounding a NaN's payload could carry into its sign bit and leave
 * -0), as f32_to_bf16 does. The low half is garbage. */
static inline __m512i round_bf16(__m512 f) {
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x00400000));
}

/* sixteen float32 lanes rounded to bfloat16, and sixteen bfloat16 widened to float32 */
static inline __m256i narrow_bf16(__m512 f) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16(f), 16));
}

static inline __m512 bf16_widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* float32 lanes rounded to bfloat16, as float32 */
static inline __m512 rounded_bf16(__m512 f) {
    return _mm512_castsi512_ps(_mm512_and_si512(round_bf16(f), _mm512_set1_epi32((int)0xffff0000u)));
}

/* the sixteen lanes (m of them) rounded to bfloat16 and stored at p */
static inline void store_bf16x16(uint16_t *p, __mmask16 m, __m512 f) {
    _mm256_mask_storeu_epi16(p, m, narrow_bf16(f));
}

/* AMX (Intel since Sapphire Rapids): eight tile registers of up to 16 rows of 64 bytes, shaped by
 * a configuration each thread loads; tdpbf16ps adds A [M rows, K bfloat16] times B [K / 2 rows
 * of N bfloat16 pairs] into C [M rows, N float32], the pairs of B those of A's consecutive K. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Linux gives AMX's tile state only to a process that asks for it (arch_prctl); torch's oneDNN
 * has usually asked already. */
static inline int amx_granted(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused; a race asks twice, harmlessly */
    if (state == 0)
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                        18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return state > 0;
}

static inline void set_tile(TileConfig *c, int tile, int rows, int bytes) {
    c->rows[tile] = (uint8_t)rows;
    c->bytes_per_row[tile] = (uint16_t)(rows > 0 ? bytes : 0);
}
#endif
#endif /* AVX-512 */


/* The entry points layers.c calls in turn (linear.c, linear_f32.c, ops.c, attention.c),
 * declared here so that each definition is checked against what its callers are compiled with */
int linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                const uint16_t *packed, int64_t n, const uint16_t *bias, uint16_t *y,
                int64_t y_stride, const int64_t *fetch_at, const int64_t *fetch_bytes,
                int64_t fetches, int num_threads);
int rope_write_bf16(const uint16_t *qkv, int64_t qkv_stride, int64_t n, int64_t heads,
                    int64_t kv_heads, int64_t dim, const uint16_t *cos, const uint16_t *sin,
                    int64_t max_positions, const int64_t *positions, uint16_t *q_out, uint16_t *kv,
                    int64_t page_stride, const int64_t *slot_pages, const int64_t *slot_offsets,
                    int num_threads);
int attend_decode_bf16(const uint16_t *q, uint16_t *out, const uint16_t *kv, int64_t page_stride,
                       const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t n,
                       int64_t heads, int64_t kv_heads, int64_t dim, int64_t page_size,
                       float scale, int num_threads);
void add_rms_norm_bf16(uint16_t *hidden, const uint16_t *delta, const uint16_t *w, uint16_t *out,
                       int64_t n, int64_t dim, float eps, int num_threads);
void silu_mul_bf16(const uint16_t *gate_up, int64_t stride, int64_t n, int64_t inter,
                   uint16_t *out, int num_threads);
int linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed,
               int64_t n, const float *bias, float *y, int64_t y_stride, const int64_t *fetch_at,
               const int64_t *fetch_bytes, int64_t fetches, int num_threads);
int rope_write_f32(const float *qkv, int64_t qkv_stride, int64_t n, int64_t heads,
                   int64_t kv_heads, int64_t dim, const float *cos, const float *sin,
                   int64_t max_positions, const int64_t *positions, float *q_out, float *kv,
                   int64_t page_stride, const int64_t *slot_pages, const int64_t *slot_offsets,
                   int num_threads);
int attend_decode_f32(const float *q, float *out, const float *kv, int64_t page_stride,
                      const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t n,
                      int64_t heads, int64_t kv_heads, int64_t dim, int64_t page_size,
                      float scale, int num_threads);
void add_rms_norm_f32(float *hidden, const float *delta, const float *w, float *out, int64_t n,
                      int64_t dim, float eps, int num_threads);
void silu_mul_f32(const float *gate_up, int64_t stride, int64_t n, int64_t inter, float *out,
                  int num_threads);

#endif
