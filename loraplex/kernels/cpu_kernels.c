/* The CPU kernels: batched LoRA (lora_apply_*), attention of one query row per token over the
 * paged KV cache (attend_decode_*: decode tokens, and prompt tokens in bfloat16), two small ops
 * of bfloat16 models (rms_norm_bf16, rope_write_bf16), greedy sampling's argmax
 * (argmax_rows_f32), and, at the end, bfloat16 dense projections for decode steps on CPUs with
 * AMX or AVX512-BF16 (linear_bf16), which bring the next LoRA call's adapter rows into cache.
 *
 * Batched LoRA on CPU: y[t] += scale[s] * (x[t] @ A_s^T) @ B_s for each token t of run s, every
 * adapter row read straight from the page pool, once per token (a token sorted next to tokens of
 * the same adapter finds its rows in cache).
 *
 * Built and loaded by cpu_lora.py with the machine's own compiler (-O3 -march=native -fopenmp),
 * called through ctypes. The OpenMP runtime is the one torch already loaded (same soname), so the
 * two share one thread pool.
 *
 *   x       [n, fin]    row stride x_stride        the layer input
 *   y       [n, *]      row stride y_stride        accumulated into: output i (one module) at
 *                                                  columns cols[i] .. cols[i] + fouts[i]
 *   mods    [modules]   output i's module: its rows are those of row mods[i] of a_rows, b_rows
 *   a_rows  [*, mstride] flat pool offset of row j of run s's lora_A, at [m, s * r + j]
 *                        (fin elements long)
 *   b_rows  [*, mstride] the same for lora_B^T (fouts[i] elements long)
 *   slots   [n]         the run s of token t (the tokens of a prefill span share one)
 *   scales  [runs]      float32
 *   r       <= MAX_RANK, modules <= MAX_MODULES (else nothing is done and 1 is returned)
 *
 * The modules that read one input (q, k and v; gate and up) go in one call: one pass over the
 * tokens, one thread team, one call's fixed cost instead of three.
 *
 * Arithmetic is float32 whatever the storage dtype; bfloat16 results are rounded to nearest even.
 */
#define _GNU_SOURCE /* syscall, for AMX's permission */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RANK 1024
#define MAX_MODULES 8

/* float32 dot product, y += v * b and exp. GCC compiles ISO C without fused multiply-adds and
 * left the plain loops of the attention kernel scalar on AVX2, so where the target has AVX2 and
 * FMA they are written out, two accumulators for the dot product (with the attention changes
 * below, its float32 decode 2.4x faster on keys in cache, 1.28x on keys in memory). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float dot_f32(const float *x, const float *a, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(a + k), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(a + k + 8), acc1);
    }
    if (k + 8 <= n) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(a + k), acc0);
        k += 8;
    }
    float acc = hsum8(_mm256_add_ps(acc0, acc1));
    for (; k < n; k++) acc += x[k] * a[k];
    return acc;
}

static inline void axpy_f32(float *y, float v, const float *b, int64_t n) {
    const __m256 vv = _mm256_set1_ps(v);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(y + k, _mm256_fmadd_ps(vv, _mm256_loadu_ps(b + k), _mm256_loadu_ps(y + k)));
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
static inline float dot_f32(const float *x, const float *a, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < n; k++) acc += x[k] * a[k];
    return acc;
}

static inline void axpy_f32(float *y, float v, const float *b, int64_t n) {
#pragma omp simd
    for (int64_t k = 0; k < n; k++) y[k] += v * b[k];
}

static inline float exp_shifted(float *x, int64_t n, float shift) {
    float total = 0.0f;
    for (int64_t i = 0; i < n; i++) x[i] = expf(x[i] - shift), total += x[i];
    return total;
}
#endif

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

/* Into L2, ahead of use: the rows of the token a thread takes next (static schedule: t + 1),
 * while it works on token t. Each token's rows lie elsewhere in the pool (its own adapter), and
 * without the hint a thread waits on memory at every row it starts. */
static inline void prefetch_l2(const void *p, size_t n) {
    for (size_t at = 0; at < n; at += 64) __builtin_prefetch((const char *)p + at, 0, 2);
}

/* float32: each thread takes whole tokens, shrink into v, then expand straight into y, with no
 * barrier in between. A token's rows are streamed front to back, which the prefetcher follows. */
int lora_apply_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t n,
                   int64_t fin, int64_t modules, const int64_t *mods, const int64_t *cols,
                   const int64_t *fouts, const float *pool, const int64_t *a_rows,
                   const int64_t *b_rows, int64_t mstride, const int64_t *slots, int64_t r,
                   const float *scales, int num_threads) {
    if (r > MAX_RANK || modules > MAX_MODULES) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const int64_t s = slots[t];
        const int64_t later = t + 1 < n && slots[t + 1] != s ? slots[t + 1] : -1;
        const float *xt = x + t * x_stride;
        float v[MAX_RANK];
        for (int64_t i = 0; i < modules; i++) {
            const int64_t *at = a_rows + mods[i] * mstride + s * r;
            const int64_t *bt = b_rows + mods[i] * mstride + s * r;
            float *yt = y + t * y_stride + cols[i];
            const int64_t fout = fouts[i], ahead = (later - s) * r;
            for (int64_t j = 0; j < r; j++) {
                if (later >= 0) prefetch_l2(pool + at[ahead + j], fin * sizeof(float));
                v[j] = dot_f32(xt, pool + at[j], fin) * scales[s];
            }
            for (int64_t j = 0; j < r; j++) {
                if (later >= 0) prefetch_l2(pool + bt[ahead + j], fout * sizeof(float));
                axpy_f32(yt, v[j], pool + bt[j], fout);
            }
        }
    }
    return 0;
}

/* bfloat16 helpers: a dot product with a float32 vector and y += v * b, for the attention
 * passes below. With AVX-512 the inner loops are written out (a bfloat16 load widened by a
 * shift, two accumulators for the dot product); compilers do not vectorize the plain loops as
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
static inline float dot_bf16(const float *x, const uint16_t *a, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < n; k++) acc += x[k] * bf16_to_f32(a[k]);
    return acc;
}

static inline void axpy_bf16(float *acc, float v, const uint16_t *b, int64_t n) {
#pragma omp simd
    for (int64_t k = 0; k < n; k++) acc[k] += v * bf16_to_f32(b[k]);
}
#endif

/* bfloat16 LoRA: per token (or block of a span's tokens) and module, the r shrink products of
 * the bfloat16 input row with the A rows, then the output row's columns 32 at a time, each held
 * in float32 registers while the r B rows are added in, rounded once to bfloat16 and stored.
 *
 * With AVX-512 a vector of 32 bfloat16 is taken as its even and its odd elements, each widened
 * to float32 by one shift or mask (the high half of a float32 is a bfloat16): no conversion
 * instruction, and the output's even and odd sums are put back together only when stored.
 * Where the CPU has AVX512-BF16, the shrink multiplies bfloat16 pairs directly (vdpbf16ps:
 * exact products, float32 sums), but in the build for CPUs that run it at half their FMA rate
 * (BF16_BY_FMA: prompt spans' LoRA calls 23.2 against 21.5 ms a step on a 2-core Xeon, decode
 * level). The shrink takes four A rows at a time, sharing each load of x.
 * While a thread works on a token it prefetches, into L2 and at the same pace, the rows of the
 * token it takes next; without that every row of every token started with a wait on memory.
 * Measured on a 2-core Zen 4 (30 layers, 32 tokens on 32 all-module rank-16 adapters, 298 MiB
 * of rows a step, 33 GB/s of read bandwidth): 21.8 ms a step with the float32-chunk loops this
 * replaces, 17.3 ms with these loops, 12.8 ms with the prefetch. A prefill span's tokens go
 * LORA_BLOCK at a time, each row loaded once for them (all 120 calls of a prefill step of 4
 * prompts of 64 tokens on 4 all-module adapters, 2-core Xeon: 25.8 ms token by token, 23.1 ms
 * in blocks; the products, not the reads, bound it there). */
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
static int amx_granted(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused; a race asks twice, harmlessly */
    if (state == 0)
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                        18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return state > 0;
}

static void set_tile(TileConfig *c, int tile, int rows, int bytes) {
    c->rows[tile] = (uint8_t)rows;
    c->bytes_per_row[tile] = (uint16_t)(rows > 0 ? bytes : 0);
}
#endif

/* A block: up to LORA_BLOCK consecutive tokens of one run (a prefill span), which share their
 * adapter rows: each row is read once for all of them. Decode tokens are blocks of one. */
#if defined(__AVX512BF16__)
#define LORA_BLOCK 4
#else
#define LORA_BLOCK 2 /* the even and odd sums of four tokens would not fit the registers */
#endif

/* out[i][j] = x_i . rows[j] (n elements) for tokens i < T (x_i = x + i * x_stride), j < 4 */
static inline __attribute__((always_inline)) void shrink4_bf16(
    const uint16_t *x, int64_t x_stride, const int T, const uint16_t *const *rows,
    const uint16_t *const *ahead, int64_t n, float out[][4]) {
    __m512 acc[LORA_BLOCK][4];
#if !defined(__AVX512BF16__)
    __m512 odd[LORA_BLOCK][4];
#endif
    for (int i = 0; i < T; i++)
        for (int j = 0; j < 4; j++) {
            acc[i][j] = _mm512_setzero_ps();
#if !defined(__AVX512BF16__)
            odd[i][j] = _mm512_setzero_ps();
#endif
        }
    for (int64_t k = 0; k < n; k += 32) {
        const __mmask32 m = tail_mask32(n - k);
        __m512i xv[LORA_BLOCK];
        for (int i = 0; i < T; i++) xv[i] = _mm512_maskz_loadu_epi16(m, x + i * x_stride + k);
        for (int j = 0; j < 4; j++) {
            if (ahead != NULL) __builtin_prefetch(ahead[j] + k, 0, 2);
            const __m512i a = _mm512_maskz_loadu_epi16(m, rows[j] + k);
            for (int i = 0; i < T; i++) {
#if defined(BF16_BY_FMA)
                acc[i][j] = _mm512_fmadd_ps(bf16_even(xv[i]), bf16_even(a), acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(bf16_odd(xv[i]), bf16_odd(a), acc[i][j]);
#elif defined(__AVX512BF16__)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv[i], (__m512bh)a);
#else
                acc[i][j] = _mm512_fmadd_ps(bf16_even(xv[i]), bf16_even(a), acc[i][j]);
                odd[i][j] = _mm512_fmadd_ps(bf16_odd(xv[i]), bf16_odd(a), odd[i][j]);
#endif
            }
        }
    }
    for (int i = 0; i < T; i++)
        for (int j = 0; j < 4; j++) {
#if !defined(__AVX512BF16__)
            acc[i][j] = _mm512_add_ps(acc[i][j], odd[i][j]);
#endif
            out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
        }
}

/* v[i][j] = x_i . A row j for tokens i < T, j < r */
static inline __attribute__((always_inline)) void shrink_block(
    const uint16_t *x, int64_t x_stride, const int T, const uint16_t *pool, const int64_t *rows,
    const int64_t *ahead, int64_t r, int64_t n, float v[][MAX_RANK]) {
    for (int64_t j = 0; j < r; j += 4) {
        const uint16_t *four[4], *later[4];
        for (int i = 0; i < 4; i++) {
            const int64_t row = j + i < r ? j + i : j; /* past r: row j again, result dropped */
            four[i] = pool + rows[row];
            later[i] = ahead != NULL ? pool + ahead[row] : NULL;
        }
        float out[LORA_BLOCK][4];
        shrink4_bf16(x, x_stride, T, four, ahead != NULL ? later : NULL, n, out);
        for (int t = 0; t < T; t++)
            for (int i = 0; i < 4 && j + i < r; i++) v[t][j + i] = out[t][i];
    }
}

/* y_i[k] += sum over j of v[i][j] * rows[j][k] for k < n, tokens i < T (y_i = y + i * y_stride),
 * in float32, each y rounded once */
static inline __attribute__((always_inline)) void expand_block(
    uint16_t *y, int64_t y_stride, const int T, float v[][MAX_RANK], const uint16_t *pool,
    const int64_t *rows, const int64_t *ahead, int64_t r, int64_t n) {
    for (int64_t k = 0; k < n; k += 32) {
        const __mmask32 m = tail_mask32(n - k);
        __m512 even[LORA_BLOCK], odd[LORA_BLOCK];
        for (int i = 0; i < T; i++) {
            const __m512i yv = _mm512_maskz_loadu_epi16(m, y + i * y_stride + k);
            even[i] = bf16_even(yv), odd[i] = bf16_odd(yv);
        }
        for (int64_t j = 0; j < r; j++) {
            if (ahead != NULL) __builtin_prefetch(pool + ahead[j] + k, 0, 2);
            const __m512i b = _mm512_maskz_loadu_epi16(m, pool + rows[j] + k);
            const __m512 be = bf16_even(b), bo = bf16_odd(b);
            for (int i = 0; i < T; i++) {
                const __m512 vj = _mm512_set1_ps(v[i][j]);
                even[i] = _mm512_fmadd_ps(vj, be, even[i]);
                odd[i] = _mm512_fmadd_ps(vj, bo, odd[i]);
            }
        }
        for (int i = 0; i < T; i++) {
            const __m512i high =
                _mm512_and_si512(round_bf16(odd[i]), _mm512_set1_epi32((int)0xffff0000u));
            const __m512i packed = _mm512_or_si512(_mm512_srli_epi32(round_bf16(even[i]), 16), high);
            _mm512_mask_storeu_epi16(y + i * y_stride + k, m, packed);
        }
    }
}
#else
/* Without AVX-512: token by token, through float32 chunks of x and y on the thread's stack. */
#define LORA_BLOCK 1
#define CHUNK 512

static void shrink_block(const uint16_t *x, int64_t x_stride, const int T, const uint16_t *pool,
                         const int64_t *rows, const int64_t *ahead, int64_t r, int64_t n,
                         float v[][MAX_RANK]) {
    (void)x_stride, (void)T, (void)ahead;
    float buf[CHUNK];
    for (int64_t j = 0; j < r; j++) v[0][j] = 0.0f;
    for (int64_t lo = 0; lo < n; lo += CHUNK) {
        const int64_t w = n - lo < CHUNK ? n - lo : CHUNK;
        for (int64_t k = 0; k < w; k++) buf[k] = bf16_to_f32(x[lo + k]);
        for (int64_t j = 0; j < r; j++) v[0][j] += dot_bf16(buf, pool + rows[j] + lo, w);
    }
}

static void expand_block(uint16_t *y, int64_t y_stride, const int T, float v[][MAX_RANK],
                         const uint16_t *pool, const int64_t *rows, const int64_t *ahead,
                         int64_t r, int64_t n) {
    (void)y_stride, (void)T, (void)ahead;
    float buf[CHUNK];
    for (int64_t lo = 0; lo < n; lo += CHUNK) {
        const int64_t w = n - lo < CHUNK ? n - lo : CHUNK;
        for (int64_t k = 0; k < w; k++) buf[k] = bf16_to_f32(y[lo + k]);
        for (int64_t j = 0; j < r; j++) axpy_bf16(buf, v[0][j], pool + rows[j] + lo, w);
        for (int64_t k = 0; k < w; k++) y[lo + k] = f32_to_bf16(buf[k]);
    }
}
#endif

/* One block of T tokens from token t on (run s), every module; the rows of run `later` (-1:
 * none) prefetched meanwhile. */
static inline __attribute__((always_inline)) void lora_block_bf16(
    const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, int64_t t, const int T,
    int64_t s, int64_t later, int64_t fin, int64_t modules, const int64_t *mods,
    const int64_t *cols, const int64_t *fouts, const uint16_t *pool, const int64_t *a_rows,
    const int64_t *b_rows, int64_t mstride, int64_t r, float scale) {
    float v[LORA_BLOCK][MAX_RANK];
    for (int64_t i = 0; i < modules; i++) {
        const int64_t at = mods[i] * mstride + s * r, ahead = mods[i] * mstride + later * r;
        shrink_block(x + t * x_stride, x_stride, T, pool, a_rows + at,
                     later < 0 ? NULL : a_rows + ahead, r, fin, v);
        for (int b = 0; b < T; b++)
            for (int64_t j = 0; j < r; j++) v[b][j] *= scale;
        expand_block(y + t * y_stride + cols[i], y_stride, T, v, pool, b_rows + at,
                     later < 0 ? NULL : b_rows + ahead, r, fouts[i]);
    }
}

#if defined(HAVE_AMX)
/* With AMX, a prefill span's tokens 16 at a time through tiles, where AVX-512 is bound by its
 * products (one 512-bit FMA a cycle on the 2-core Xeons measured): per module, A's rows laid out
 * once a span as input pairs by rank (a tile's B operand) and B's rows as rank pairs by 16
 * columns, in a buffer the thread keeps; then per 16 tokens the shrink's sums [16, r] over k,
 * 32 inputs a tile, and the expand 32 columns at a time, added to y in float32 and rounded once.
 * Tiles take bfloat16 operands, so v (times the scale) goes in as the sum of two bfloat16, its
 * rounded value and the rest, against B's pairs stacked twice: one product, v kept to about 16
 * bits (v rounded once to bfloat16 missed the float32 reference by 14 rounding steps of y on a
 * test's large deltas). The rest of a span, and decode tokens, take the AVX-512 blocks. For ranks
 * up to 16 (even) and input widths a multiple of 32. Measured on a 2-core Xeon: a prefill step's
 * LoRA calls (4 prompts of 64 tokens on all-module adapters) 23.7 -> 13.0 ms; 16 prompts of 448
 * tokens on 8 adapters, 4 new tokens each, 3.22 -> 3.01 s.
 *
 * Tiles: 0 x [16 tokens, 32 inputs]; 1 A's pairs [16, r]; 2 the shrink's sums [16, r] float32;
 * 3 v's halves [16, 2r] bfloat16; 4 and 6 B's pairs, twice [r, 16 columns]; 5 and 7 the
 * expand's sums [16, 16] float32. */
#define AMX_SPAN 16

static int amx_takes(int64_t fin, int64_t r) {
    return fin % 32 == 0 && r % 2 == 0 && r > 0 && r <= 16 && amx_granted();
}

static void load_span_tiles(int64_t r) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    set_tile(&c, 0, 16, 64);
    set_tile(&c, 1, 16, (int)(4 * r));
    set_tile(&c, 2, 16, (int)(4 * r));
    set_tile(&c, 3, 16, (int)(4 * r));
    set_tile(&c, 4, (int)r, 64);
    set_tile(&c, 5, 16, 64);
    set_tile(&c, 6, (int)r, 64);
    set_tile(&c, 7, 16, 64);
    _tile_loadconfig(&c);
}

/* bfloat16 elements of the buffer a span of one module needs */
static int64_t span_work(int64_t fin, int64_t fout, int64_t r) {
    return fin * r + 2 * r * ((fout + 15) / 16 * 16);
}

/* The calling thread's span buffer, at least `numel` long; kept for its later calls (a buffer
 * allocated and freed each call, past malloc's mmap threshold, cost the page faults of a fresh
 * mapping every time). NULL if it cannot grow. */
static uint16_t *span_buffer(int64_t numel) {
    static __thread uint16_t *buffer;
    static __thread int64_t size;
    if (numel > size) {
        uint16_t *grown = realloc(buffer, sizeof(uint16_t) * (size_t)numel);
        if (grown == NULL) return NULL;
        buffer = grown, size = numel;
    }
    return buffer;
}

/* `blocks` blocks of 16 tokens from token t on, all of run s, every module */
static void lora_span_amx(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride,
                          int64_t t, int64_t blocks, int64_t s, int64_t fin, int64_t modules,
                          const int64_t *mods, const int64_t *cols, const int64_t *fouts,
                          const uint16_t *pool, const int64_t *a_rows, const int64_t *b_rows,
                          int64_t mstride, int64_t r, float scale, uint16_t *work) {
    for (int64_t i = 0; i < modules; i++) {
        const int64_t at = mods[i] * mstride + s * r, fout = fouts[i], chunks = (fout + 15) / 16;
        uint16_t *a_pairs = work;          /* [fin / 2][r][2] */
        uint16_t *b_pairs = work + fin * r; /* [chunks][2][r / 2][16][2] */
        const uint32_t *rows[16];
        for (int64_t j = 0; j < r; j++) rows[j] = (const uint32_t *)(pool + a_rows[at + j]);
        for (int64_t p = 0; p < fin / 2; p++) /* a row's pairs are 4-byte aligned: fin is even */
            for (int64_t j = 0; j < r; j++) memcpy(a_pairs + (p * r + j) * 2, rows[j] + p, 4);
        /* each pair: the two rows' elements of a column side by side */
        const __m512i interleave = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
            19, 3, 18, 2, 17, 1, 16, 0);
        for (int64_t p = 0; p < r / 2; p++) {
            const uint16_t *even = pool + b_rows[at + 2 * p], *odd = pool + b_rows[at + 2 * p + 1];
            for (int64_t c = 0; c < chunks; c++) {
                const __mmask16 m = tail_mask(fout - c * 16);
                const __m256i e = _mm256_maskz_loadu_epi16(m, even + c * 16);
                const __m256i o = _mm256_maskz_loadu_epi16(m, odd + c * 16);
                const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(e), o, 1);
                const __m512i pairs = _mm512_permutexvar_epi16(interleave, both);
                _mm512_storeu_si512(b_pairs + (c * r + p) * 32, pairs); /* for v's high halves */
                _mm512_storeu_si512(b_pairs + (c * r + r / 2 + p) * 32, pairs); /* and low */
            }
        }
        for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *xb = x + (t + b * AMX_SPAN) * x_stride;
            uint16_t *yb = y + (t + b * AMX_SPAN) * y_stride + cols[i];
            _tile_zero(2);
            for (int64_t k = 0; k < fin; k += 32) {
                _tile_loadd(0, xb + k, x_stride * 2);
                _tile_loadd(1, a_pairs + k * r, 4 * r);
                _tile_dpbf16ps(2, 0, 1);
            }
            float v[AMX_SPAN * 16];
            uint16_t v_split[AMX_SPAN * 32]; /* per token: v's high bfloat16 halves, then low */
            _tile_stored(2, v, 4 * r);
            const __m512 times = _mm512_set1_ps(scale);
            const __mmask16 ranks = tail_mask(r);
            for (int u = 0; u < AMX_SPAN; u++) {
                const __m512 f = _mm512_mul_ps(_mm512_maskz_loadu_ps(ranks, v + u * r), times);
                const __m256i high = narrow_bf16(f);
                const __m256i low = narrow_bf16(_mm512_sub_ps(f, bf16_widen(high)));
                _mm256_mask_storeu_epi16(v_split + u * 2 * r, ranks, high);
                _mm256_mask_storeu_epi16(v_split + u * 2 * r + r, ranks, low);
            }
            _tile_loadd(3, v_split, 4 * r);
            /* 32 columns at a time (tiles 4, 5 and 6, 7), a whole cache line of each row of y
             * read and written once; a pass's sums are read back from memory only after the next
             * pass's products are under way */
            float sums[2][AMX_SPAN][32];
            const int64_t passes = (chunks + 1) / 2;
            for (int64_t c = 0; c <= passes; c++) {
                if (c < passes) {
                    _tile_loadd(4, b_pairs + 2 * c * r * 32, 64);
                    _tile_zero(5);
                    _tile_dpbf16ps(5, 3, 4);
                    _tile_stored(5, sums[c % 2][0], 128);
                    if (2 * c + 1 < chunks) { /* else columns past fout, which no store keeps */
                        _tile_loadd(6, b_pairs + (2 * c + 1) * r * 32, 64);
                        _tile_zero(7);
                        _tile_dpbf16ps(7, 3, 6);
                        _tile_stored(7, sums[c % 2][0] + 16, 128);
                    }
                }
                if (c + 1 < passes) /* y's lines two passes on, another core's since the projection */
                    for (int u = 0; u < AMX_SPAN; u++)
                        __builtin_prefetch(yb + u * y_stride + (c + 1) * 32, 1, 3);
                if (c == 0) continue;
                const int64_t done = c - 1;
                const __mmask32 m = tail_mask32(fout - done * 32);
                for (int u = 0; u < AMX_SPAN; u++) {
                    uint16_t *out = yb + u * y_stride + done * 32;
                    const __m512i yv = _mm512_maskz_loadu_epi16(m, out);
                    const __m512 low = _mm512_add_ps(
                        bf16_widen(_mm512_castsi512_si256(yv)), _mm512_loadu_ps(sums[done % 2][u]));
                    const __m512 high = _mm512_add_ps(bf16_widen(_mm512_extracti64x4_epi64(yv, 1)),
                                                      _mm512_loadu_ps(sums[done % 2][u] + 16));
                    const __m512i both = _mm512_inserti64x4(
                        _mm512_castsi256_si512(narrow_bf16(low)), narrow_bf16(high), 1);
                    _mm512_mask_storeu_epi16(out, m, both);
                }
            }
        }
    }
}
#endif

/* A bfloat16 LoRA call's arguments, as lora_apply_bf16 takes them. */
typedef struct {
    const uint16_t *x;
    int64_t x_stride;
    uint16_t *y;
    int64_t y_stride, n, fin, modules;
    const int64_t *mods, *cols, *fouts;
    const uint16_t *pool;
    const int64_t *a_rows, *b_rows;
    int64_t mstride;
    const int64_t *slots;
    int64_t r;
    const float *scales;
} LoRACall;

/* Thread th of nt's share of a call: its part of the tokens split in halves (a static schedule),
 * taken in blocks. A block's arithmetic is each of its tokens' on its own, in the same order:
 * the results do not depend on the blocking. */
static void lora_thread_bf16(const LoRACall *call, int64_t th, int64_t nt) {
    const uint16_t *x = call->x, *pool = call->pool;
    uint16_t *y = call->y;
    const int64_t x_stride = call->x_stride, y_stride = call->y_stride, n = call->n;
    const int64_t fin = call->fin, modules = call->modules, mstride = call->mstride, r = call->r;
    const int64_t *mods = call->mods, *cols = call->cols, *fouts = call->fouts;
    const int64_t *a_rows = call->a_rows, *b_rows = call->b_rows, *slots = call->slots;
    const int64_t last = n * (th + 1) / nt;
#if defined(HAVE_AMX)
    int64_t work_numel = 0; /* the span buffer, for the widest module */
    for (int64_t i = 0; i < modules; i++)
        if (span_work(fin, fouts[i], r) > work_numel) work_numel = span_work(fin, fouts[i], r);
    uint16_t *work = NULL; /* had, and the tiles shaped, at the thread's first span */
    int tiles = amx_takes(fin, r);
#endif
    for (int64_t t = n * th / nt; t < last;) {
        const int64_t s = call->slots[t];
#if defined(HAVE_AMX)
        int64_t len = 1;
        while (tiles && len < AMX_SPAN && t + len < last && slots[t + len] == s) len++;
        if (tiles && len == AMX_SPAN) {
            if (work == NULL) {
                work = span_buffer(work_numel);
                tiles = work != NULL;
                if (tiles) load_span_tiles(r);
            }
            if (tiles) {
                while (t + len < last && slots[t + len] == s) len++;
                const int64_t blocks = len / AMX_SPAN;
                lora_span_amx(x, x_stride, y, y_stride, t, blocks, s, fin, modules, mods, cols,
                              fouts, pool, a_rows, b_rows, mstride, r, call->scales[s], work);
                t += blocks * AMX_SPAN;
                continue;
            }
        }
#endif
        int T = 1;
        while (T < LORA_BLOCK && t + T < last && slots[t + T] == s) T++;
        /* the rows of the thread's next block, unless the same run's */
        const int64_t later = t + T < last && slots[t + T] != s ? slots[t + T] : -1;
        const float scale = call->scales[s];
#define LORA_BLOCK_OF(T_)                                                                      \
    lora_block_bf16(x, x_stride, y, y_stride, t, T_, s, later, fin, modules, mods, cols, fouts, \
                    pool, a_rows, b_rows, mstride, r, scale)
        switch (T) { /* specialised for each block size */
#if LORA_BLOCK >= 4
        case 4: LORA_BLOCK_OF(4); break;
        case 3: LORA_BLOCK_OF(3); break;
#endif
#if LORA_BLOCK >= 2
        case 2: LORA_BLOCK_OF(2); break;
#endif
        default: LORA_BLOCK_OF(1);
        }
#undef LORA_BLOCK_OF
        t += T;
    }
#if defined(HAVE_AMX)
    if (work != NULL) _tile_release();
#endif
}

int lora_apply_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride,
                    int64_t n, int64_t fin, int64_t modules, const int64_t *mods,
                    const int64_t *cols, const int64_t *fouts, const uint16_t *pool,
                    const int64_t *a_rows, const int64_t *b_rows, int64_t mstride,
                    const int64_t *slots, int64_t r, const float *scales, int num_threads) {
    if (r > MAX_RANK || modules > MAX_MODULES) return 1;
    const LoRACall call = {x,    x_stride, y,      y_stride, n,       fin,   modules, mods, cols,
                           fouts, pool,    a_rows, b_rows,   mstride, slots, r,       scales};
#pragma omp parallel num_threads(num_threads)
    lora_thread_bf16(&call, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

/* Row attention: out[b, h] = softmax(scale * q[b, h] . K_b) V_b for each query row b (a decode
 * token, or a prompt token: its sequence's table and its own position + 1 as length), keys and
 * values read in place from the pages of its block table (no gather into a buffer, no upcast
 * copy), scores and sums in float32.
 *
 *   q, out   [n, heads, dim]                       contiguous, the storage dtype
 *   kv       [pages, page_size, 2, kv_heads, dim]  the layer's cache: pages page_stride apart,
 *                                                  each page contiguous
 *   tables   [n, table_stride] int64              page ids, in order
 *   lens     [n] int64                              context length (>= 1) of each sequence
 *
 * Work is split over sequences, each taking its kv heads in turn: the heads / kv_heads query
 * heads of a group share each key and value read, and a sequence's pages are brought into cache
 * once for all its kv heads. Returns 1 (nothing done) past MAX_GROUP query heads a group or
 * MAX_DIM. */
#define MAX_GROUP 16
#define MAX_DIM 512

/* Keys and values are read a row (one token, one kv head) at a time from pages scattered in
 * memory; without a hint the loads of a cold layer wait on memory one row after another, so
 * each row is prefetched AHEAD tokens before it is read (in bfloat16 on Zen 4, 24 tokens ahead
 * measured 1.1x faster than 6; float32 the same). */
#define AHEAD 24
/* The most of a thread's next sequence fetched while it works on one (plan_fetches), by storage
 * type. Measured on a 2-core Zen 5 (1 MB of L2 a core), 32 sequences, SmolLM2's heads, a layer's
 * keys not in cache: bfloat16 1.49x / 1.23x / 1.21x faster at 50-100 / 150-300 / 250-500
 * tokens; float32, whose passes do more arithmetic a byte, 1.01x / 0.96x / 0.98x, so float32
 * fetches nothing ahead. */
#define UPCOMING_BF16 (512 << 10)
#define UPCOMING_F32 0

/* Into L2, not L1: the first pass over a sequence fetches whole rows (every kv head's key and
 * value), most of which the later passes read, after L1 would have dropped them; into L1 the
 * prefetches of a cold layer waited on each other (30 layers of 32 sequences of 96 tokens,
 * 2-core Xeon: 4.70 ms into L1, 4.29 ms into L2). */
static inline void prefetch_bytes(const void *p, size_t n) {
    for (size_t at = 0; at < n; at += 64) __builtin_prefetch((const char *)p + at, 0, 2);
}

/* What a pass brings into cache while it works: at its token t, `bytes` from rows[t] (NULL:
 * nothing at that token; rows NULL: nothing at all). */
typedef struct {
    const void *const *rows;
    size_t bytes;
} Fetch;

#define NO_FETCH ((Fetch){NULL, 0})

static inline void fetch_at(Fetch fetch, int64_t t) {
    if (fetch.rows != NULL && fetch.rows[t] != NULL) prefetch_bytes(fetch.rows[t], fetch.bytes);
}

/* The two passes over one group's keys and values, written with the storage type's dot product
 * and axpy: scores[h * len + t] = qf_h . key_t and top[h] = their maximum; then acc_h = sum over
 * t of scores[h * len + t] value_t (a value row lies to_value elements after its key row). */
#define DEFINE_PASSES(SCORES, VALUES, T, DOT, AXPY)                                             \
    static void SCORES(const float *qf, const T *const *keys, Fetch fetch, int64_t len,       \
                       int64_t g, int64_t dim, float *scores, float *top) {                   \
        for (int64_t h = 0; h < g; h++) top[h] = -INFINITY;                                   \
        for (int64_t t = 0; t < len; t++) {                                                   \
            fetch_at(fetch, t);                                                               \
            for (int64_t h = 0; h < g; h++) {                                                 \
                const float s = DOT(qf + h * dim, keys[t], dim);                              \
                scores[h * len + t] = s;                                                      \
                top[h] = s > top[h] ? s : top[h];                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    static void VALUES(float *acc, const float *scores, const T *const *keys, Fetch fetch,    \
                       int64_t to_value, int64_t len, int64_t g, int64_t dim) {               \
        for (int64_t k = 0; k < g * dim; k++) acc[k] = 0.0f;                                  \
        for (int64_t t = 0; t < len; t++) {                                                   \
            fetch_at(fetch, t);                                                               \
            const T *value = keys[t] + to_value;                                              \
            for (int64_t h = 0; h < g; h++) AXPY(acc + h * dim, scores[h * len + t], value, dim); \
        }                                                                                     \
    }

DEFINE_PASSES(scores_f32_any, values_f32_any, float, dot_f32, axpy_f32)
DEFINE_PASSES(scores_bf16_any, values_bf16_any, uint16_t, dot_bf16, axpy_bf16)

static inline float max_of(const float *x, int64_t n) {
    float top = -INFINITY;
    for (int64_t i = 0; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}

#if defined(__AVX2__) && defined(__FMA__)
/* float32 heads a multiple of 64 wide, with AVX2: head by head, 64 elements at a time, the
 * query's (scores) or the sum's (values) 64 elements held in eight registers while the group's
 * keys or values stream past; the per-token loop above keeps its sums in memory, which on AVX2
 * measured 1.6x slower. */
static void scores_f32(const float *qf, const float *const *keys, Fetch fetch, int64_t len,
                       int64_t g, int64_t dim, float *scores, float *top) {
    if (dim % 64 != 0) {
        scores_f32_any(qf, keys, fetch, len, g, dim, scores, top);
        return;
    }
    for (int64_t h = 0; h < g; h++) {
        float *sh = scores + h * len;
        for (int64_t off = 0; off < dim; off += 64) {
            __m256 q[8];
            for (int i = 0; i < 8; i++) q[i] = _mm256_loadu_ps(qf + h * dim + off + 8 * i);
            for (int64_t t = 0; t < len; t++) {
                if (h == 0 && off == 0) fetch_at(fetch, t);
                const float *k = keys[t] + off;
                __m256 a = _mm256_mul_ps(q[0], _mm256_loadu_ps(k));
                __m256 b = _mm256_mul_ps(q[1], _mm256_loadu_ps(k + 8));
                for (int i = 2; i < 8; i += 2) {
                    a = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(k + 8 * i), a);
                    b = _mm256_fmadd_ps(q[i + 1], _mm256_loadu_ps(k + 8 * i + 8), b);
                }
                const float part = hsum8(_mm256_add_ps(a, b));
                sh[t] = off == 0 ? part : sh[t] + part;
            }
        }
        top[h] = max_of(sh, len);
    }
}

static void values_f32(float *acc, const float *scores, const float *const *keys, Fetch fetch,
                       int64_t to_value, int64_t len, int64_t g, int64_t dim) {
    if (dim % 64 != 0) {
        values_f32_any(acc, scores, keys, fetch, to_value, len, g, dim);
        return;
    }
    for (int64_t h = 0; h < g; h++) {
        for (int64_t off = 0; off < dim; off += 64) {
            __m256 sum[8];
            for (int i = 0; i < 8; i++) sum[i] = _mm256_setzero_ps();
            for (int64_t t = 0; t < len; t++) {
                if (h == 0 && off == 0) fetch_at(fetch, t);
                const __m256 weight = _mm256_set1_ps(scores[h * len + t]);
                const float *v = keys[t] + to_value + off;
                for (int i = 0; i < 8; i++)
                    sum[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * i), sum[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + h * dim + off + 8 * i, sum[i]);
        }
    }
}
#else
#define scores_f32 scores_f32_any
#define values_f32 values_f32_any
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* bfloat16 heads a multiple of 64 wide, with AVX-512: 64 elements at a time, G query heads
 * (up to 4) at a time, so that each key or value row is loaded once for the G heads. A row's 64
 * bfloat16 are two vectors, each taken as its even and its odd elements widened to float32 (one
 * shift or mask, as in the LoRA kernel); the query's elements (scores) and the sums (values) are
 * held in registers in the same even/odd order, put back in order once per block. The per-token
 * loops above, sixteen bfloat16 widened by a conversion at a time, took 1.4x as long (Zen 4,
 * 30 layers of 32 sequences of 91 tokens: 7.9 against 11.0 ms). */
/* The sums of the lanes of each of sixteen vectors, as one vector (lane u: x[u]'s sum): four
 * levels of pairwise folds, 15 shuffle pairs and adds for all sixteen, where a reduction of each
 * on its own takes about eight instructions. */
static inline __m512 fold_blocks(__m512 a, __m512 b) { /* [a's 8 partial sums | b's 8] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}

static inline __m512 fold_halves(__m512 a, __m512 b) { /* block i: vector i's 4 partial sums */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __m512 sums16(const __m512 *x) {
    __m512 quads[4];
    for (int i = 0; i < 4; i++)
        quads[i] = fold_halves(fold_blocks(x[4 * i], x[4 * i + 1]),
                               fold_blocks(x[4 * i + 2], x[4 * i + 3]));
    /* quads[i], block j: the 4 partial sums of x[4i + j]; fold within blocks twice */
    const __m512 pairs0 = _mm512_add_ps(_mm512_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                        _mm512_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 pairs1 = _mm512_add_ps(_mm512_shuffle_ps(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                        _mm512_shuffle_ps(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs0, pairs1, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(pairs0, pairs1, _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane 4j + i: x[j + 4i]'s sum */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, sums);
}

#define DEFINE_BF16_PASSES(G)                                                                   \
    static void scores_bf16_##G(const float *qf, const uint16_t *const *keys, Fetch fetch,     \
                                int64_t len, int64_t dim, int64_t off, float *scores) {         \
        __m512 q[G][4];                                                                        \
        for (int h = 0; h < G; h++) {                                                          \
            float lanes[4][16];                                                                \
            for (int i = 0; i < 32; i++) {                                                     \
                lanes[2 * (i / 16)][i % 16] = qf[h * dim + off + 2 * i];                       \
                lanes[2 * (i / 16) + 1][i % 16] = qf[h * dim + off + 2 * i + 1];               \
            }                                                                                  \
            for (int i = 0; i < 4; i++) q[h][i] = _mm512_loadu_ps(lanes[i]);                   \
        }                                                                                      \
        for (int64_t first = 0; first < len; first += 16) {                                    \
            const int count = len - first < 16 ? (int)(len - first) : 16;                      \
            __m512 parts[G][16];                                                               \
            for (int u = 0; u < 16; u++) {                                                     \
                if (u >= count) {                                                              \
                    for (int h = 0; h < G; h++) parts[h][u] = _mm512_setzero_ps();             \
                    continue;                                                                  \
                }                                                                              \
                const int64_t t = first + u;                                                   \
                if (off == 0) fetch_at(fetch, t);                                              \
                const __m512i k0 = _mm512_loadu_si512(keys[t] + off);                          \
                const __m512i k1 = _mm512_loadu_si512(keys[t] + off + 32);                     \
                const __m512 k[4] = {bf16_even(k0), bf16_odd(k0), bf16_even(k1), bf16_odd(k1)}; \
                for (int h = 0; h < G; h++) {                                                  \
                    __m512 a = _mm512_mul_ps(q[h][0], k[0]), b = _mm512_mul_ps(q[h][1], k[1]); \
                    a = _mm512_fmadd_ps(q[h][2], k[2], a);                                     \
                    b = _mm512_fmadd_ps(q[h][3], k[3], b);                                     \
                    parts[h][u] = _mm512_add_ps(a, b);                                         \
                }                                                                              \
            }                                                                                  \
            const __mmask16 m = tail_mask(count);                                              \
            for (int h = 0; h < G; h++) {                                                      \
                float *at = scores + h * len + first;                                          \
                __m512 sum = sums16(parts[h]);                                                 \
                if (off != 0) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(m, at));          \
                _mm512_mask_storeu_ps(at, m, sum);                                             \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    static void values_bf16_##G(float *acc, const float *scores, const uint16_t *const *keys,  \
                                Fetch fetch, int64_t to_value, int64_t len, int64_t dim,       \
                                int64_t off) {                                                 \
        __m512 sum[G][4];                                                                      \
        for (int h = 0; h < G; h++)                                                            \
            for (int i = 0; i < 4; i++) sum[h][i] = _mm512_setzero_ps();                       \
        for (int64_t t = 0; t < len; t++) {                                                    \
            if (off == 0) fetch_at(fetch, t);                                                  \
            const uint16_t *value = keys[t] + to_value + off;                                  \
            const __m512i v0 = _mm512_loadu_si512(value), v1 = _mm512_loadu_si512(value + 32);  \
            const __m512 v[4] = {bf16_even(v0), bf16_odd(v0), bf16_even(v1), bf16_odd(v1)};    \
            for (int h = 0; h < G; h++) {                                                      \
                const __m512 weight = _mm512_set1_ps(scores[h * len + t]);                     \
                for (int i = 0; i < 4; i++) sum[h][i] = _mm512_fmadd_ps(weight, v[i], sum[h][i]); \
            }                                                                                  \
        }                                                                                      \
        for (int h = 0; h < G; h++) {                                                          \
            float lanes[4][16];                                                                \
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(lanes[i], sum[h][i]);                 \
            for (int i = 0; i < 32; i++) {                                                     \
                acc[h * dim + off + 2 * i] = lanes[2 * (i / 16)][i % 16];                      \
                acc[h * dim + off + 2 * i + 1] = lanes[2 * (i / 16) + 1][i % 16];              \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_BF16_PASSES(1)
DEFINE_BF16_PASSES(2)
DEFINE_BF16_PASSES(3)
DEFINE_BF16_PASSES(4)

/* The passes by the number of heads they take, less one */
typedef void (*ScoresPass)(const float *, const uint16_t *const *, Fetch, int64_t, int64_t,
                           int64_t, float *);
typedef void (*ValuesPass)(float *, const float *, const uint16_t *const *, Fetch, int64_t,
                           int64_t, int64_t, int64_t);
static const ScoresPass SCORES_BF16[4] = {scores_bf16_1, scores_bf16_2, scores_bf16_3,
                                          scores_bf16_4};
static const ValuesPass VALUES_BF16[4] = {values_bf16_1, values_bf16_2, values_bf16_3,
                                          values_bf16_4};

/* Heads in chunks of up to four, each 64-wide block of the row in turn. */
static void scores_bf16(const float *qf, const uint16_t *const *keys, Fetch fetch, int64_t len,
                        int64_t g, int64_t dim, float *scores, float *top) {
    if (dim % 64 != 0) {
        scores_bf16_any(qf, keys, fetch, len, g, dim, scores, top);
        return;
    }
    for (int64_t h = 0; h < g; h += 4) {
        const ScoresPass pass = SCORES_BF16[(g - h < 4 ? g - h : 4) - 1];
        for (int64_t off = 0; off < dim; off += 64)
            pass(qf + h * dim, keys, h == 0 ? fetch : NO_FETCH, len, dim, off, scores + h * len);
    }
    for (int64_t h = 0; h < g; h++) top[h] = max_of(scores + h * len, len);
}

static void values_bf16(float *acc, const float *scores, const uint16_t *const *keys,
                        Fetch fetch, int64_t to_value, int64_t len, int64_t g, int64_t dim) {
    if (dim % 64 != 0) {
        values_bf16_any(acc, scores, keys, fetch, to_value, len, g, dim);
        return;
    }
    for (int64_t h = 0; h < g; h += 4) {
        const ValuesPass pass = VALUES_BF16[(g - h < 4 ? g - h : 4) - 1];
        for (int64_t off = 0; off < dim; off += 64)
            pass(acc + h * dim, scores + h * len, keys, h == 0 ? fetch : NO_FETCH, to_value, len,
                 dim, off);
    }
}
#else
#define scores_bf16 scores_bf16_any
#define values_bf16 values_bf16_any
#endif

/* rows[t] = where token t's row (every kv head's key and value) starts, t < len, for a sequence
 * with block table `table` in a cache of pages page_bytes apart, rows row_bytes apart */
static void list_rows(const char *cache, size_t page_bytes, size_t row_bytes, int64_t page_size,
                      const int64_t *table, int64_t len, const void **rows) {
    for (int64_t t = 0, p = 0; t < len; p++) {
        const char *page = cache + (size_t)table[p] * page_bytes;
        for (int64_t slot = 0; slot < page_size && t < len; slot++) rows[t++] = page + slot * row_bytes;
    }
}

/* What the two passes of kv head kvh of a sequence fetch, at each of its len tokens (`keys`:
 * the head's key rows; its value rows to_value bytes on). Each pass fetches its own rows AHEAD
 * tokens before use; kv head 0 reads the sequence from memory, and its scores pass fetches
 * whole token rows (every kv head's keys and values), which the later passes find in L2. With
 * the rows of the thread's next sequence given (upcoming, next_len rows), the later heads'
 * passes, which do little but arithmetic on rows in cache, fetch those instead, spread evenly
 * over all of them, and the next sequence's kv head 0 in turn finds its rows in cache. Measured
 * on a 2-core Zen 5 (32 sequences of 50-100 tokens, SmolLM2's heads, bfloat16, a layer's keys
 * not in cache): 119 -> 83 us a call. */
static void plan_fetches(const void *const *keys, int64_t len, size_t to_value, size_t head_bytes,
                         size_t row_bytes, const void *const *upcoming, int64_t next_len,
                         int64_t kvh, int64_t kv_heads, Fetch *scores, Fetch *values) {
    const void **scores_rows = (const void **)scores->rows;
    const void **values_rows = (const void **)values->rows;
    if (kvh == 0 || upcoming == NULL) {
        for (int64_t t = 0; t < len; t++) {
            const char *key = t + AHEAD < len ? keys[t + AHEAD] : NULL;
            scores_rows[t] = key;
            values_rows[t] = key != NULL ? key + to_value : NULL;
        }
        scores->bytes = kvh == 0 ? row_bytes : head_bytes;
        values->bytes = head_bytes;
        return;
    }
    const int64_t span = 2 * (kv_heads - 1) * len; /* tokens of the later heads' passes */
    const int64_t every = next_len > 0 && span > next_len ? span / next_len : 1;
    const int64_t at = 2 * (kvh - 1) * len; /* this head's first token among them */
    int64_t row = at / every, phase = at % every; /* one row of the next sequence every `every` */
    for (int64_t pass = 0; pass < 2; pass++) {
        const void **rows = pass == 0 ? scores_rows : values_rows;
        for (int64_t t = 0; t < len; t++) {
            rows[t] = phase == 0 && row < next_len ? upcoming[row] : NULL;
            if (++phase == every) phase = 0, row++;
        }
    }
    scores->bytes = values->bytes = row_bytes;
}

/* One (sequence, kv head): qf [g, dim] float32, already scaled, in; acc [g, dim] float32 out.
 * The key rows' addresses are listed first, page by page (a division per token to find its page
 * cost more than the dot products); a token's value row follows its key row kv_heads * dim
 * elements on. Two passes: every key's scores (kept for the softmax), then the values weighted.
 * -> 0, or 1 if the scratch buffer could not be had. */
#define DEFINE_ATTEND_GROUP(NAME, T, SCORES, VALUES)                                            \
    static int NAME(const float *qf, float *acc, const T *kv, const int64_t *table,           \
                    int64_t len, const void *const *upcoming, int64_t next_len, int64_t g,    \
                    int64_t kv_heads, int64_t kvh, int64_t dim, int64_t page_size,            \
                    int64_t page_stride) {                                                    \
        void *scratch = malloc((sizeof(float) * (size_t)g + 3 * sizeof(void *)) * (size_t)len); \
        if (scratch == NULL) return 1;                                                         \
        const T **keys = scratch;                                                             \
        const void **scores_rows = (const void **)(keys + len), **values_rows = scores_rows + len; \
        float *scores = (float *)(values_rows + len);                                         \
        const int64_t row = 2 * kv_heads * dim; /* one token's keys and values */             \
        list_rows((const char *)(kv + kvh * dim), (size_t)page_stride * sizeof(T),            \
                  (size_t)row * sizeof(T), page_size, table, len, (const void **)keys);       \
        Fetch scores_fetch = {scores_rows, 0}, values_fetch = {values_rows, 0};               \
        plan_fetches((const void *const *)keys, len, (size_t)(kv_heads * dim) * sizeof(T),    \
                     (size_t)dim * sizeof(T), (size_t)row * sizeof(T), upcoming, next_len,    \
                     kvh, kv_heads, &scores_fetch, &values_fetch);                            \
        float top[MAX_GROUP], total[MAX_GROUP];                                               \
        SCORES(qf, keys, scores_fetch, len, g, dim, scores, top);                             \
        for (int64_t h = 0; h < g; h++) total[h] = exp_shifted(scores + h * len, len, top[h]); \
        VALUES(acc, scores, keys, values_fetch, kv_heads * dim, len, g, dim);                 \
        for (int64_t h = 0; h < g; h++)                                                       \
            for (int64_t k = 0; k < dim; k++) acc[h * dim + k] /= total[h];                   \
        free(scratch);                                                                        \
        return 0;                                                                             \
    }

DEFINE_ATTEND_GROUP(attend_group_f32, float, scores_f32, values_f32)
DEFINE_ATTEND_GROUP(attend_group_bf16, uint16_t, scores_bf16, values_bf16)

static inline float f32_identity(float v) { return v; }

/* The entry point for one storage type: each query row on its own (a decode token, or a prompt
 * token), its kv heads in turn (each kv head on its own when there are few rows), each group's
 * queries widened and scaled into float32, the result rounded back. A thread claims its next
 * item before it starts on the one in hand (first come, first served, as a dynamic schedule),
 * so that it can fetch the next one's rows while it works (plan_fetches). */
#define DEFINE_ATTEND_DECODE(NAME, T, GROUP, TO_F32, FROM_F32, UPCOMING)                                \
    int NAME(const T *q, T *out, const T *kv, int64_t page_stride, const int64_t *tables,     \
             int64_t table_stride, const int64_t *lens, int64_t n, int64_t heads,              \
             int64_t kv_heads, int64_t dim, int64_t page_size, float scale, int num_threads) { \
        const int64_t g = heads / kv_heads;                                                   \
        if (g > MAX_GROUP || dim > MAX_DIM || g * kv_heads != heads) return 1;                \
        int failed = 0;                                                                       \
        /* fewer sequences than two a thread: items of one kv head, to keep every thread busy */ \
        const int64_t split = n < 2 * num_threads ? kv_heads : 1, items = n * split;          \
        int64_t claimed = 0;                                                                  \
        const int64_t row_bytes = 2 * kv_heads * dim * (int64_t)sizeof(T);                    \
        _Pragma("omp parallel num_threads(num_threads) reduction(| : failed)")                \
        {                                                                                     \
            int64_t item = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);                 \
            while (item < items) {                                                            \
                const int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);       \
                const int64_t b = item / split, part = kv_heads / split;                      \
                const int64_t *table = tables + b * table_stride;                             \
                /* the next item's rows are fetched ahead if it is a whole sequence (an item of \
                 * one kv head fetches nothing), another one (a prompt's next token finds its   \
                 * rows in cache) and no more than L2 keeps beside the one in hand */          \
                const int64_t *next_table = split == 1 && next < items ? tables + next * table_stride : NULL; \
                const int fetch_next = next_table != NULL && next_table[0] != table[0] &&     \
                                       lens[next] * row_bytes <= UPCOMING;                    \
                const int64_t next_len = fetch_next ? lens[next] : 0;                         \
                const void **upcoming = next_len > 0 ? malloc(sizeof(void *) * (size_t)next_len) : NULL; \
                if (upcoming != NULL)                                                         \
                    list_rows((const char *)kv, (size_t)page_stride * sizeof(T),              \
                              (size_t)row_bytes, page_size,                                  \
                              next_table, next_len, upcoming);                                \
                for (int64_t kvh = item % split * part; kvh < (item % split + 1) * part; kvh++) { \
                    const int64_t first = (b * heads + kvh * g) * dim; /* the group's first */ \
                    float qf[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM];                  \
                    for (int64_t k = 0; k < g * dim; k++) qf[k] = TO_F32(q[first + k]) * scale; \
                    failed |= GROUP(qf, acc, kv, table, lens[b], upcoming,                    \
                                    next_len, g, kv_heads, kvh, dim, page_size, page_stride);  \
                    for (int64_t k = 0; k < g * dim; k++) out[first + k] = FROM_F32(acc[k]);  \
                }                                                                             \
                free(upcoming);                                                               \
                item = next;                                                                  \
            }                                                                                 \
        }                                                                                     \
        return failed ? 2 : 0;                                                                \
    }

DEFINE_ATTEND_DECODE(attend_decode_f32, float, attend_group_f32, f32_identity, f32_identity,
                     UPCOMING_F32)
DEFINE_ATTEND_DECODE(attend_decode_bf16, uint16_t, attend_group_bf16, bf16_to_f32, f32_to_bf16,
                     UPCOMING_BF16)

/* RMSNorm of each bfloat16 row, as the reference computes it: in float32, the normalized row
 * rounded to bfloat16, then multiplied by the weight and rounded again (float32 models keep
 * torch's ops, whose sum order this does not follow).
 *   x, out  [n, dim] contiguous; w [dim]
 * A prompt chunk's rows go on every thread (256 rows of 576: 36 -> 19 us); a decode step's few
 * rows on one, where waking the other costs more than it saves. */
/* not inlined: one compiled body, so both entry points sum a row in the same order. The sum
 * stays the compiler's vector loop (torch's bits in the tests' cases); the rest, element by
 * element, is written out in AVX-512 where the target has it. */
__attribute__((noinline)) static void norm_row_bf16(const uint16_t *xi, const uint16_t *w,
                                                    uint16_t *oi, int64_t dim, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < dim; k++) {
        const float v = bf16_to_f32(xi[k]);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m512 rv = _mm512_set1_ps(r);
    for (int64_t k = 0; k < dim; k += 16) {
        const __mmask16 m = tail_mask(dim - k);
        const __m512 normed = rounded_bf16(_mm512_mul_ps(bf16x16(xi + k, m), rv));
        store_bf16x16(oi + k, m, _mm512_mul_ps(bf16x16(w + k, m), normed));
    }
#else
#pragma omp simd
    for (int64_t k = 0; k < dim; k++) {
        const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(xi[k]) * r));
        oi[k] = f32_to_bf16(bf16_to_f32(w[k]) * normed);
    }
#endif
}

/* rows a thread takes at least: fewer (a decode step's) go on one thread as soon as below two
 * threads' worth, where waking the other costs more than it saves */
#define NORM_ROWS_A_THREAD 16

void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t n, int64_t dim,
                   float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 2 * NORM_ROWS_A_THREAD)
    for (int64_t i = 0; i < n; i++) norm_row_bf16(x + i * dim, w, out + i * dim, dim, eps);
}

/* The residual add and the next norm in one pass: hidden += delta (rounded to bfloat16, as
 * torch's add rounds), then out = RMSNorm(hidden) as rms_norm_bf16. hidden, delta, out [n, dim]
 * contiguous. */
void add_rms_norm_bf16(uint16_t *hidden, const uint16_t *delta, const uint16_t *w, uint16_t *out,
                       int64_t n, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 2 * NORM_ROWS_A_THREAD)
    for (int64_t i = 0; i < n; i++) {
        uint16_t *hi = hidden + i * dim;
        const uint16_t *di = delta + i * dim;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        for (int64_t k = 0; k < dim; k += 16) {
            const __mmask16 m = tail_mask(dim - k);
            store_bf16x16(hi + k, m, _mm512_add_ps(bf16x16(hi + k, m), bf16x16(di + k, m)));
        }
#else
#pragma omp simd
        for (int64_t k = 0; k < dim; k++) hi[k] = f32_to_bf16(bf16_to_f32(hi[k]) + bf16_to_f32(di[k]));
#endif
        norm_row_bf16(hi, w, out + i * dim, dim, eps);
    }
}

/* SwiGLU's product of bfloat16 rows: out[t] = silu(gate) * up, gate_up[t] = [gate | up] (inter
 * each, rows stride apart), out [n, inter] contiguous; silu rounded to bfloat16, then the
 * product, as torch's silu and multiply round. One pass instead of two ops and the temporary
 * between them. With AVX-512 the exp is a series (within 1e-7 relative of expf: it moves a
 * rounded silu by one bfloat16 step only at a rounding boundary). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* exp of sixteen lanes, as exp8 computes eight (2^n e^r, e^r by its series to the 7th power),
 * but past 88 infinity, as expf gives (silu of a very negative gate is then -0, as torch's) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t inter) {
    for (int64_t k = 0; k < inter; k += 16) {
        const __mmask16 m = tail_mask(inter - k);
        const __m512 gate = bf16x16(g + k, m);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
        const __m512 silu = rounded_bf16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        store_bf16x16(o + k, m, _mm512_mul_ps(silu, bf16x16(u + k, m)));
    }
}
#else
static inline float silu_f32(float g) { return g / (1.0f + expf(-g)); }

static void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t inter) {
    for (int64_t k = 0; k < inter; k++) {
        const float silu = bf16_to_f32(f32_to_bf16(silu_f32(bf16_to_f32(g[k]))));
        o[k] = f32_to_bf16(silu * bf16_to_f32(u[k]));
    }
}
#endif

void silu_mul_bf16(const uint16_t *gate_up, int64_t stride, int64_t n, int64_t inter,
                   uint16_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; t++)
        silu_mul_row_bf16(gate_up + t * stride, gate_up + t * stride + inter, out + t * inter, inter);
}

/* Rotary embedding and the KV write of bfloat16 tokens, in one pass instead of torch's dozen
 * small ops a layer. For each token t, from its fused row qkv[t] = [q heads | k heads | v heads]:
 * the q and k heads rotated by the angles of position positions[t] (rotate-half form: out =
 * x * cos + rotate_half(x) * sin, each product and the sum rounded to bfloat16 as torch's
 * bfloat16 ops round them, so the result is the same bits), q into q_out [n, heads, dim]; the
 * rotated k and the v heads into the token's slot of the layer's paged cache (as in
 * attend_decode: [pages, page_size, 2, kv_heads, dim], pages page_stride apart).
 *   cos, sin  [max_positions, dim] bfloat16
 * -> 0, or 1 (nothing done) if a position is past max_positions. */
static inline void rope_head_bf16(const uint16_t *x, const uint16_t *c, const uint16_t *s,
                                  int64_t dim, uint16_t *out) {
    const int64_t half = dim / 2;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (half % 16 == 0) { /* sixteen at a time: each half's lanes against the other half's */
        const __m512 minus = _mm512_set1_ps(-0.0f);
        for (int64_t i = 0; i < half; i += 16) {
            const __m512 first = bf16x16(x + i, 0xffff), second = bf16x16(x + half + i, 0xffff);
            const __m512 c1 = bf16x16(c + i, 0xffff), c2 = bf16x16(c + half + i, 0xffff);
            const __m512 s1 = bf16x16(s + i, 0xffff), s2 = bf16x16(s + half + i, 0xffff);
            const __m512 a1 = rounded_bf16(_mm512_mul_ps(first, c1));
            const __m512 b1 = rounded_bf16(_mm512_mul_ps(_mm512_xor_ps(second, minus), s1));
            const __m512 a2 = rounded_bf16(_mm512_mul_ps(second, c2));
            const __m512 b2 = rounded_bf16(_mm512_mul_ps(first, s2));
            store_bf16x16(out + i, 0xffff, _mm512_add_ps(a1, b1));
            store_bf16x16(out + half + i, 0xffff, _mm512_add_ps(a2, b2));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < dim; i++) {
        const float rotated = i < half ? -bf16_to_f32(x[i + half]) : bf16_to_f32(x[i - half]);
        const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * bf16_to_f32(c[i])));
        const float b = bf16_to_f32(f32_to_bf16(rotated * bf16_to_f32(s[i])));
        out[i] = f32_to_bf16(a + b);
    }
}

int rope_write_bf16(const uint16_t *qkv, int64_t qkv_stride, int64_t n, int64_t heads,
                    int64_t kv_heads, int64_t dim, const uint16_t *cos, const uint16_t *sin,
                    int64_t max_positions, const int64_t *positions, uint16_t *q_out, uint16_t *kv,
                    int64_t page_stride, const int64_t *slot_pages, const int64_t *slot_offsets,
                    int num_threads) {
    for (int64_t t = 0; t < n; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return 1;
    const int64_t kv_width = kv_heads * dim;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 2 * NORM_ROWS_A_THREAD)
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *row = qkv + t * qkv_stride;
        const uint16_t *c = cos + positions[t] * dim, *s = sin + positions[t] * dim;
        uint16_t *slot = kv + slot_pages[t] * page_stride + slot_offsets[t] * 2 * kv_width;
        for (int64_t h = 0; h < heads; h++)
            rope_head_bf16(row + h * dim, c, s, dim, q_out + (t * heads + h) * dim);
        for (int64_t h = 0; h < kv_heads; h++)
            rope_head_bf16(row + (heads + h) * dim, c, s, dim, slot + h * dim);
        memcpy(slot + kv_width, row + (heads + kv_heads) * dim, (size_t)kv_width * sizeof(uint16_t));
    }
    return 0;
}

/* Greedy sampling's pick: out[i] = the index of the largest element of row i of x [n, vocab]
 * (rows row_stride apart): the first of equal ones, or the first NaN of a row that has one, as
 * torch.max(dim=-1) picks. torch's max with indices is a scalar loop on CPU (0.4 ms for 32 rows
 * of a 49,152-token vocabulary, against 0.04 ms for a max without them); here sixteen lanes
 * each keep their own first best and its index, and the lanes are compared once at the end. */
static int64_t first_nan(const float *x, int64_t n) {
    for (int64_t k = 0; k < n; k++)
        if (isnan(x[k])) return k;
    return -1;
}

static int64_t argmax_row(const float *x, int64_t n) {
    int64_t best = 0, k = 1;
    float top = x[0];
    int nan = isnan(top);
#if defined(__AVX512F__)
    if (n >= 32) {
        __m512 tops = _mm512_loadu_ps(x);
        const __m512i sixteen = _mm512_set1_epi32(16);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i where = at;
        __mmask16 nans = _mm512_cmp_ps_mask(tops, tops, _CMP_UNORD_Q);
        for (k = 16; k + 16 <= n; k += 16) {
            const __m512 v = _mm512_loadu_ps(x + k);
            at = _mm512_add_epi32(at, sixteen);
            const __mmask16 above = _mm512_cmp_ps_mask(v, tops, _CMP_GT_OQ);
            nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            tops = _mm512_mask_mov_ps(tops, above, v);
            where = _mm512_mask_mov_epi32(where, above, at);
        }
        top = _mm512_reduce_max_ps(tops);
        const __mmask16 equal = _mm512_cmp_ps_mask(tops, _mm512_set1_ps(top), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(equal, where);
        nan = nans != 0;
    }
#endif
    for (; k < n && !nan; k++) {
        nan = isnan(x[k]);
        if (x[k] > top) {
            top = x[k];
            best = k;
        }
    }
    return nan ? first_nan(x, n) : best;
}

void argmax_rows_f32(const float *x, int64_t n, int64_t vocab, int64_t row_stride, int64_t *out,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 4)
    for (int64_t i = 0; i < n; i++) out[i] = argmax_row(x + i * row_stride, vocab);
}

/* bfloat16 dense projections for decode steps: y = x W^T (+ bias), W packed once at load.
 *
 * Packed: W [n, k] (k even) as blocks of LINEAR_COLS output columns, each [k / 2][LINEAR_COLS][2]:
 * the two weights of each column for inputs 2p and 2p + 1 side by side, which is the operand
 * vdpbf16ps takes and, sixteen pairs by sixteen columns at a time, an AMX tile of W; columns past
 * n are zeros. Sums are float32 (exact products of bfloat16), each output rounded once to
 * bfloat16 with the bias added in float32 first.
 *
 * With AMX (Intel since Sapphire Rapids): blocks of 32 columns, below. Without it, with
 * AVX512-BF16 (AMD Zen 4 and 5): blocks of 96 columns, a tile of LINEAR_ROWS rows by one block
 * keeping its 24 float32 sums in registers over all of k: per input pair, 6 loads of W and 4
 * broadcasts of x for 24 products of 32 pairs. oneDNN's kernels for these CPUs reach 440-740
 * GFLOP/s on a decode step's 32-row products of SmolLM2's shapes on a 2-core Zen 5; this one
 * 800-890, and it fetches each thread's next block of W while it works on one, so W streams from
 * memory at the pace of the arithmetic. Built with -DBF16_BY_FMA (cpu_lora.py does, where the
 * CPU runs vdpbf16ps at half its FMA rate), the same blocks go through float32 FMAs instead. */
#if defined(HAVE_AMX)
#define LINEAR_COLS 32
#else
#define LINEAR_COLS 96
#endif
#define LINEAR_ROWS 4

int64_t linear_packed_numel_bf16(int64_t n, int64_t k) {
    return (n + LINEAR_COLS - 1) / LINEAR_COLS * LINEAR_COLS * k;
}

/* w [n, k] contiguous -> packed (linear_packed_numel_bf16 elements); 1 if k is odd */
int linear_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    if (k % 2 != 0) return 1;
    for (int64_t first = 0; first < n; first += LINEAR_COLS) {
        uint16_t *block = packed + first * k;
        for (int64_t p = 0; p < k / 2; p++)
            for (int64_t c = 0; c < LINEAR_COLS; c++)
                for (int64_t e = 0; e < 2; e++)
                    block[(p * LINEAR_COLS + c) * 2 + e] =
                        first + c < n ? w[(first + c) * k + 2 * p + e] : 0;
    }
    return 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* A projection's arguments: x [m, k] (rows x_stride apart) -> y [m, n] (rows y_stride apart);
 * bias [n] or NULL; fetch_at, fetch_bytes [fetches]: memory ranges to bring into cache meanwhile
 * (only where linear_fetches_bf16). */
typedef struct {
    const uint16_t *x;
    int64_t x_stride, m, k;
    const uint16_t *packed;
    int64_t n;
    const uint16_t *bias;
    uint16_t *y;
    int64_t y_stride;
    const int64_t *fetch_at, *fetch_bytes;
    int64_t fetches;
} LinearCall;

#if defined(HAVE_AMX)
/* AMX: tiles of up to 16 rows of 64 bytes; tdpbf16ps adds A [16 rows, 32 bfloat16] times B [16
 * input pairs, 16 columns of pairs] into C [16 rows, 16 float32].
 *
 * A block of 32 columns for up to 32 rows keeps its sums in four C tiles (rows 0-15 and 16-31
 * by columns 0-15 and 16-31) over all of k; per 32 inputs, two tiles of x (from cache) and two
 * of W, 2 KiB that stream from memory: W's next 2 KiB is prefetched into L1 a step ahead and the
 * 2 KiB eight steps ahead into L2 (without, each tile load waits on memory; the tile registers
 * are not renamed, so nothing else overlaps the wait). The last k % 32 inputs go through
 * vdpbf16ps on the stored sums. Measured on a 2-core Xeon with AMX (SmolLM2's four projections
 * of 30 layers, 32 rows): 10.3-10.9 ms against oneDNN's 13.7-15.0 (its AMX kernels), within
 * 10% of the rate at which the cores' prefetches alone bring W in. */
/* The tiles, by number (the intrinsics take literal numbers): 0, 1 x's rows 0-15 and 16-31; 2, 3
 * W's columns 0-15 and 16-31; 4, 5 the sums of rows 0-15 (columns 0-15, 16-31); 6, 7 of rows
 * 16-31. */

int linear_native_bf16(void) { return amx_granted(); }
int linear_any_rows_bf16(void) { return 0; }
/* Whether linear_bf16 takes memory ranges to fetch: not with AMX, whose products are bound by
 * memory, as the LoRA call's rows are (fetching them during the products slows these by more
 * than it speeds the LoRA call: 11.5 ms against 4.9 ms a step of 32 all-module adapters). */
int linear_fetches_bf16(void) { return 0; }

/* Sums [rows][32] of one block (row stride 32) += the last `pairs` input pairs from `first` on
 * (w: the block), through vdpbf16ps. */
static void tail_pairs(float *sums, int64_t rows, const uint16_t *x, int64_t x_stride,
                       const uint16_t *w, int64_t first, int64_t pairs) {
    for (int64_t i = 0; i < rows; i++) {
        __m512 left = _mm512_loadu_ps(sums + i * 32), right = _mm512_loadu_ps(sums + i * 32 + 16);
        for (int64_t p = first; p < first + pairs; p++) {
            int32_t pair;
            memcpy(&pair, x + i * x_stride + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            left = _mm512_dpbf16_ps(left, xv, (__m512bh)_mm512_loadu_si512(w + p * 64));
            right = _mm512_dpbf16_ps(right, xv, (__m512bh)_mm512_loadu_si512(w + p * 64 + 32));
        }
        _mm512_storeu_ps(sums + i * 32, left);
        _mm512_storeu_ps(sums + i * 32 + 16, right);
    }
}

/* Thread th of nt's share of a projection: its run of the blocks, split evenly. */
static void linear_thread_amx(const LinearCall *call, int64_t th, int64_t nt) {
    const uint16_t *x = call->x;
    const int64_t x_stride = call->x_stride, m = call->m, k = call->k, n = call->n;
    const int64_t blocks = (n + LINEAR_COLS - 1) / LINEAR_COLS, steps = k / 32;
    const int64_t first = blocks * th / nt, last = blocks * (th + 1) / nt;
    if (first == last) return;
    const int low = m < 16 ? (int)m : 16, high = (int)m - low;
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    set_tile(&config, 0, low, 64), set_tile(&config, 1, high, 64);
    set_tile(&config, 2, 16, 64), set_tile(&config, 3, 16, 64);
    set_tile(&config, 4, low, 64), set_tile(&config, 5, low, 64);
    set_tile(&config, 6, high, 64), set_tile(&config, 7, high, 64);
    const int64_t x_bytes = x_stride * 2, step_bytes = 16 * LINEAR_COLS * 2 * 2;
    float sums[32 * 32];
    _tile_loadconfig(&config);
    for (int64_t b = first; b < last; b++) {
        const uint16_t *w = call->packed + b * LINEAR_COLS * k;
        _tile_zero(4);
        _tile_zero(5);
        if (high > 0) {
            _tile_zero(6);
            _tile_zero(7);
        }
        for (int64_t s = 0; s < steps; s++) {
            const uint16_t *ws = w + s * 16 * LINEAR_COLS * 2;
            const char *ahead = (const char *)ws + step_bytes; /* past the block: the next */
            for (int64_t at = 0; at < step_bytes; at += 64) {
                __builtin_prefetch(ahead + at, 0, 3);
                __builtin_prefetch(ahead + 7 * step_bytes + at, 0, 2);
            }
            _tile_loadd(2, ws, LINEAR_COLS * 4);
            _tile_loadd(3, ws + 32, LINEAR_COLS * 4);
            _tile_loadd(0, x + s * 32, x_bytes);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            if (high > 0) {
                _tile_loadd(1, x + 16 * x_stride + s * 32, x_bytes);
                _tile_dpbf16ps(6, 1, 2);
                _tile_dpbf16ps(7, 1, 3);
            }
        }
        _tile_stored(4, sums, 128);
        _tile_stored(5, sums + 16, 128);
        if (high > 0) {
            _tile_stored(6, sums + 16 * 32, 128);
            _tile_stored(7, sums + 16 * 32 + 16, 128);
        }
        if (k % 32) tail_pairs(sums, m, x, x_stride, w, steps * 16, k % 32 / 2);
        const int64_t col = b * LINEAR_COLS;
        for (int c = 0; c < 2 && col + c * 16 < n; c++) {
            const __mmask16 mask = tail_mask(n - col - c * 16);
            const __m512 bv =
                call->bias != NULL ? bf16x16(call->bias + col + c * 16, mask) : _mm512_setzero_ps();
            for (int64_t i = 0; i < m; i++)
                store_bf16x16(call->y + i * call->y_stride + col + c * 16, mask,
                              _mm512_add_ps(_mm512_loadu_ps(sums + i * 32 + c * 16), bv));
        }
    }
    _tile_release();
}

/* 1 if the call does not fit (k odd, more than 32 rows, or fetches: linear_fetches_bf16), 2
 * without the tiles, else 0. */
static int linear_refuses(const LinearCall *call) {
    if (call->k % 2 != 0 || call->m > 32 || call->fetches > 0) return 1;
    return amx_granted() ? 0 : 2;
}

static int linear_threads(const LinearCall *call, int num_threads) {
    (void)call;
    return num_threads;
}

#define linear_thread linear_thread_amx
#else
int linear_native_bf16(void) { return 1; }
int linear_fetches_bf16(void) { return 1; }
/* Whether the projection is the faster one for any number of rows, not for decode steps only:
 * in the FMA build, where oneDNN's bfloat16 kernels take the slow vdpbf16ps (below). */
#if defined(BF16_BY_FMA)
int linear_any_rows_bf16(void) { return 1; }
#else
int linear_any_rows_bf16(void) { return 0; }
#endif

/* Memory ranges a thread brings into cache while it computes, `pace` lines a step of k: the
 * rows of the adapters the next LoRA call reads (see linear_bf16). */
typedef struct {
    const int64_t *at, *bytes; /* each range's address and length */
    int64_t next, end;         /* the thread's ranges left: next .. end */
    int64_t offset, pace;      /* within range `next`; lines a step */
} Ranges;

static inline void fetch_ranges(Ranges *r) {
    for (int64_t f = 0; f < r->pace && r->next < r->end; f++) {
        __builtin_prefetch((const char *)r->at[r->next] + r->offset, 0, 2);
        r->offset += 64;
        if (r->offset >= r->bytes[r->next]) r->offset = 0, r->next++;
    }
}

/* The thread's share of `fetches` ranges (split in order, as evenly as their count), spread
 * over `steps` steps of its work. */
static Ranges thread_ranges(const int64_t *at, const int64_t *bytes, int64_t fetches, int64_t t,
                            int64_t nt, int64_t steps) {
    Ranges r = {at, bytes, fetches * t / nt, fetches * (t + 1) / nt, 0, 0};
    int64_t lines = 0;
    for (int64_t i = r.next; i < r.end; i++) lines += (bytes[i] + 63) / 64;
    r.pace = steps > 0 ? (lines + steps - 1) / steps : 0;
    return r;
}

/* Rows x[0 .. rows) of one block: y[i][0 .. cols) = x[i] . W's columns. `fetch` is the thread's
 * next block, brought into cache `pace` lines a step of k. */
static inline __attribute__((always_inline)) void linear_tile(
    const uint16_t *x, int64_t x_stride, const int rows, int64_t k, const uint16_t *block,
    const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t cols, const char *fetch,
    const char *fetch_end, int64_t pace, Ranges *extra) {
    __m512 acc[LINEAR_ROWS][6];
    for (int i = 0; i < LINEAR_ROWS; i++)
        for (int c = 0; c < 6; c++) acc[i][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        const uint16_t *w = block + p * LINEAR_COLS * 2;
        __m512bh wv[6];
        for (int c = 0; c < 6; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * 32);
        for (int64_t f = 0; f < pace && fetch < fetch_end; f++, fetch += 64)
            __builtin_prefetch(fetch, 0, 2);
        fetch_ranges(extra);
        for (int i = 0; i < rows; i++) {
            int32_t pair;
            memcpy(&pair, x + i * x_stride + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < 6; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], xv, wv[c]);
        }
    }
    for (int c = 0; c < 6 && c * 16 < cols; c++) {
        const __mmask16 m = tail_mask(cols - c * 16);
        const __m512 b = bias != NULL ? bf16x16(bias + c * 16, m) : _mm512_setzero_ps();
        for (int i = 0; i < rows; i++)
            store_bf16x16(y + i * y_stride + c * 16, m, _mm512_add_ps(acc[i][c], b));
    }
}

#if defined(BF16_BY_FMA)
/* Where vdpbf16ps runs at half the rate of float32 FMAs (Intel's cores without AMX): W's
 * bfloat16 widened to float32, FMA_CHUNK input pairs of a block at a time, into a buffer L1
 * holds; then each tile of LINEAR_ROWS rows takes that chunk through FMAs, its 6 x 4 sums in
 * registers over the chunk and in `sums` between chunks. The widening is paid once a chunk for
 * up to FMA_GROUP rows, where a tile that widened its own W (the vdpbf16ps tile's shape) spent
 * one instruction in five on it. On a 2-core Xeon (family 6, model 207), products of SmolLM2's
 * shapes at 320-390 GFLOP/s (oneDNN's bfloat16 kernels 170-220, its float32 310-410). */
#define FMA_CHUNK 32
#define FMA_GROUP 64

static inline __attribute__((always_inline)) void fma_tile(
    const uint16_t *x, int64_t x_stride, const int R, int64_t pairs, const float *wf,
    float *sums, int first, const char **fetch, const char *fetch_end, int64_t pace,
    Ranges *extra) {
    __m512 acc[LINEAR_ROWS][6];
    float xf[LINEAR_ROWS][2 * FMA_CHUNK];
    for (int i = 0; i < R; i++) {
        for (int c = 0; c < 6; c++)
            acc[i][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + i * 96 + c * 16);
        for (int64_t e = 0; e < 2 * pairs; e += 16) {
            const __mmask16 m = tail_mask(2 * pairs - e);
            _mm512_mask_storeu_ps(xf[i] + e, m, bf16x16(x + i * x_stride + e, m));
        }
    }
    for (int64_t p = 0; p < pairs; p++) {
        for (int64_t f = 0; f < pace && *fetch < fetch_end; f++, *fetch += 64)
            __builtin_prefetch(*fetch, 0, 2);
        fetch_ranges(extra);
        for (int e = 0; e < 2; e++) { /* the pair's first inputs, then its second: 29 registers */
            __m512 xv[LINEAR_ROWS];
            for (int i = 0; i < R; i++) xv[i] = _mm512_set1_ps(xf[i][2 * p + e]);
            for (int c = 0; c < 6; c++) {
                const __m512 w = _mm512_load_ps(wf + (p * 12 + 2 * c + e) * 16);
                for (int i = 0; i < R; i++) acc[i][c] = _mm512_fmadd_ps(xv[i], w, acc[i][c]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int c = 0; c < 6; c++) _mm512_storeu_ps(sums + i * 96 + c * 16, acc[i][c]);
}

/* Rows row .. row + rows (at most FMA_GROUP) of block b; the thread's next block brought into
 * cache (*fetch .. fetch_end) `pace` lines a step of a tile meanwhile. */
static void fma_group(const LinearCall *call, int64_t b, int64_t row, int64_t rows,
                      const char **fetch, const char *fetch_end, int64_t pace, Ranges *extra) {
    const int64_t k = call->k, pairs = k / 2, col = b * LINEAR_COLS;
    const uint16_t *block = call->packed + b * LINEAR_COLS * k;
    float wf[FMA_CHUNK * 12 * 16] __attribute__((aligned(64)));
    float sums[FMA_GROUP * 96];
    for (int64_t p0 = 0; p0 < pairs; p0 += FMA_CHUNK) {
        const int64_t chunk = pairs - p0 < FMA_CHUNK ? pairs - p0 : FMA_CHUNK;
        for (int64_t p = 0; p < chunk; p++)
            for (int c = 0; c < 6; c++) {
                const __m512i wv = _mm512_loadu_si512(block + (p0 + p) * LINEAR_COLS * 2 + c * 32);
                _mm512_store_ps(wf + (p * 12 + 2 * c) * 16, bf16_even(wv));
                _mm512_store_ps(wf + (p * 12 + 2 * c + 1) * 16, bf16_odd(wv));
            }
        for (int64_t i = 0; i < rows; i += LINEAR_ROWS) {
            const uint16_t *xr = call->x + (row + i) * call->x_stride + 2 * p0;
#define FMA_TILE_OF(R_)                                                                         \
    fma_tile(xr, call->x_stride, R_, chunk, wf, sums + i * 96, p0 == 0, fetch, fetch_end, pace, \
             extra)
            switch (rows - i < LINEAR_ROWS ? rows - i : LINEAR_ROWS) {
            case 4: FMA_TILE_OF(4); break;
            case 3: FMA_TILE_OF(3); break;
            case 2: FMA_TILE_OF(2); break;
            default: FMA_TILE_OF(1);
            }
#undef FMA_TILE_OF
        }
    }
    const int64_t cols = call->n - col < LINEAR_COLS ? call->n - col : LINEAR_COLS;
    for (int c = 0; c < 6 && c * 16 < cols; c++) {
        const __mmask16 m = tail_mask(cols - c * 16);
        const __m512 bv =
            call->bias != NULL ? bf16x16(call->bias + col + c * 16, m) : _mm512_setzero_ps();
        for (int64_t i = 0; i < rows; i++)
            store_bf16x16(call->y + (row + i) * call->y_stride + col + c * 16, m,
                          _mm512_add_ps(_mm512_loadu_ps(sums + i * 96 + c * 16), bv));
    }
}

/* Thread t of nt's share of a projection: its run of the blocks, split evenly, every row of
 * each; the fetches as in the vdpbf16ps build's (below). */
static void linear_thread(const LinearCall *call, int64_t t, int64_t nt) {
    const int64_t k = call->k, m = call->m, blocks = (call->n + LINEAR_COLS - 1) / LINEAR_COLS;
    const int64_t tiles = (m + LINEAR_ROWS - 1) / LINEAR_ROWS;
    const int64_t block_numel = LINEAR_COLS * k, block_lines = block_numel * 2 / 64;
    const int64_t steps = tiles * (k / 2), pace = (block_lines + steps - 1) / steps;
    const int64_t first = blocks * t / nt, last = blocks * (t + 1) / nt;
    Ranges extra = thread_ranges(call->fetch_at, call->fetch_bytes, call->fetches, t, nt,
                                 (last - first) * steps);
    for (int64_t b = first; b < last; b++) {
        const char *next = (const char *)(call->packed + (b + 1) * block_numel);
        const char *fetch = b + 1 < last ? next : NULL;
        const char *fetch_end = b + 1 < last ? next + block_numel * 2 : NULL;
        for (int64_t row = 0; row < m; row += FMA_GROUP)
            fma_group(call, b, row, m - row < FMA_GROUP ? m - row : FMA_GROUP, &fetch, fetch_end,
                      pace, &extra);
    }
}
#else
/* Thread th of nt's share of a projection. Work is (block, tile of rows) items in block order,
 * split evenly between the threads, so each thread reads its run of blocks once from memory (a
 * block stays in L2 across its row tiles).
 *
 * The call's fetch ranges are split between the threads in order as evenly as their count, and
 * spread over each thread's work. The engine passes the adapter rows of the LoRA call that
 * follows, in the order of its tokens: a decode step's dense products are bound by arithmetic
 * and leave most of the memory bandwidth unused, and the LoRA kernel, which is bound by memory,
 * then finds its rows in cache (each thread the rows of the tokens it takes, the kernel
 * splitting tokens in halves as this splits ranges). */
static void linear_thread(const LinearCall *call, int64_t t, int64_t nt) {
    const uint16_t *x = call->x, *packed = call->packed, *bias = call->bias;
    const int64_t x_stride = call->x_stride, m = call->m, k = call->k, n = call->n;
    const int64_t blocks = (n + LINEAR_COLS - 1) / LINEAR_COLS;
    const int64_t tiles = (m + LINEAR_ROWS - 1) / LINEAR_ROWS, items = blocks * tiles;
    const int64_t block_numel = LINEAR_COLS * k, block_lines = block_numel * 2 / 64;
    /* lines of the next block a step of k: all of it over this block's tiles */
    const int64_t steps = tiles * (k / 2), pace = (block_lines + steps - 1) / steps;
    const int64_t first = items * t / nt, last = items * (t + 1) / nt;
    Ranges extra = thread_ranges(call->fetch_at, call->fetch_bytes, call->fetches, t, nt,
                                 (last - first) * (k / 2));
    for (int64_t item = first; item < last; item++) {
        const int64_t b = item / tiles, tile = item % tiles;
        const int64_t row = tile * LINEAR_ROWS, col = b * LINEAR_COLS;
        const int rows = m - row < LINEAR_ROWS ? (int)(m - row) : LINEAR_ROWS;
        const int64_t cols = n - col < LINEAR_COLS ? n - col : LINEAR_COLS;
        const int fetch = b + 1 < blocks && (last - 1) / tiles > b;
        const char *next = (const char *)(packed + (b + 1) * block_numel);
        const char *from = fetch ? next + tile * (k / 2) * pace * 64 : NULL;
        const char *to = fetch ? next + block_numel * 2 : NULL;
        const uint16_t *xr = x + row * x_stride, *block = packed + b * block_numel;
        const uint16_t *bias_b = bias != NULL ? bias + col : NULL;
        uint16_t *yr = call->y + row * call->y_stride + col;
        const int64_t y_stride = call->y_stride;
        switch (rows) { /* the tile specialised for each row count */
        case 4: linear_tile(xr, x_stride, 4, k, block, bias_b, yr, y_stride, cols, from, to, pace, &extra); break;
        case 3: linear_tile(xr, x_stride, 3, k, block, bias_b, yr, y_stride, cols, from, to, pace, &extra); break;
        case 2: linear_tile(xr, x_stride, 2, k, block, bias_b, yr, y_stride, cols, from, to, pace, &extra); break;
        default: linear_tile(xr, x_stride, 1, k, block, bias_b, yr, y_stride, cols, from, to, pace, &extra);
        }
    }
}

#endif /* BF16_BY_FMA */

static int linear_refuses(const LinearCall *call) { return call->k % 2 != 0; }

/* no more threads than work items (a narrow product of a few rows on one) */
static int linear_threads(const LinearCall *call, int num_threads) {
    const int64_t blocks = (call->n + LINEAR_COLS - 1) / LINEAR_COLS;
#if defined(BF16_BY_FMA)
    const int64_t items = blocks;
#else
    const int64_t items = blocks * ((call->m + LINEAR_ROWS - 1) / LINEAR_ROWS);
#endif
    return items < num_threads ? (int)items : num_threads;
}
#endif /* HAVE_AMX */

/* x [m, k] -> y [m, n], as LinearCall describes them; 0, or linear_refuses's refusal. */
int linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                const uint16_t *packed, int64_t n, const uint16_t *bias, uint16_t *y,
                int64_t y_stride, const int64_t *fetch_at, const int64_t *fetch_bytes,
                int64_t fetches, int num_threads) {
    const LinearCall call = {x, x_stride, m, k, packed, n, bias, y, y_stride,
                             fetch_at, fetch_bytes, fetches};
    const int refused = linear_refuses(&call);
    if (refused || m <= 0 || n <= 0) return refused; /* no rows or columns: nothing to do */
#pragma omp parallel num_threads(linear_threads(&call, num_threads))
    linear_thread(&call, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

/* The projection x -> y (its fetch ranges brought into cache meanwhile) and then a LoRA call
 * on rows of them (its arguments as lora_apply_bf16 takes them, lx and ly within x and y), in
 * one parallel region, the threads meeting between the two; wherever linear_bf16 runs. Apart,
 * a decode step's projection and the LoRA call after it each cost a ctypes call and an OpenMP
 * region of their own, about 6 us, 120 times a step of all-module adapters. */
int linear_lora_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                     const uint16_t *packed, int64_t n, const uint16_t *bias, uint16_t *y,
                     int64_t y_stride, const int64_t *fetch_at, const int64_t *fetch_bytes,
                     int64_t fetches, const uint16_t *lx, int64_t lx_stride, uint16_t *ly,
                     int64_t ly_stride, int64_t ln, int64_t fin, int64_t modules,
                     const int64_t *mods, const int64_t *cols, const int64_t *fouts,
                     const uint16_t *pool, const int64_t *a_rows, const int64_t *b_rows,
                     int64_t mstride, const int64_t *slots, int64_t r, const float *scales,
                     int num_threads) {
    const LinearCall linear = {x, x_stride, m, k, packed, n, bias, y, y_stride,
                               fetch_at, fetch_bytes, fetches};
    const int refused = linear_refuses(&linear);
    if (refused || r > MAX_RANK || modules > MAX_MODULES) return refused ? refused : 1;
    if (m <= 0 || n <= 0) return 0; /* no rows or columns: nothing to do (nor any LoRA rows) */
    const LoRACall lora = {lx,    lx_stride, ly,     ly_stride, ln,      fin,   modules, mods, cols,
                           fouts, pool,      a_rows, b_rows,    mstride, slots, r,       scales};
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t th = omp_get_thread_num(), nt = omp_get_num_threads();
        linear_thread(&linear, th, nt);
#pragma omp barrier
        lora_thread_bf16(&lora, th, nt);
    }
    return 0;
}
#else
int linear_native_bf16(void) { return 0; }
int linear_fetches_bf16(void) { return 0; }
int linear_any_rows_bf16(void) { return 0; }

int linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                const uint16_t *packed, int64_t n, const uint16_t *bias, uint16_t *y,
                int64_t y_stride, const int64_t *fetch_at, const int64_t *fetch_bytes,
                int64_t fetches, int num_threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y;
    (void)y_stride, (void)fetch_at, (void)fetch_bytes, (void)fetches, (void)num_threads;
    return 2;
}
#endif
