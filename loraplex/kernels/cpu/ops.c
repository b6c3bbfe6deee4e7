#include "common.h"

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

/* The same in float32 (a float32 model's steps): the reference's ops, x * (1 / sqrt(mean(x^2) +
 * eps)) and then the weight times that, each rounded once as torch's float32 ops round; only the
 * sum of squares goes in the vector loop's order, not torch's (a few units in the last place now
 * and then). */
__attribute__((noinline)) static void norm_row_f32(const float *xi, const float *w, float *oi,
                                                   int64_t dim, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < dim; k++) ss += xi[k] * xi[k];
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int64_t k = 0; k < dim; k++) oi[k] = w[k] * (xi[k] * r);
}

/* rows a thread takes at least: fewer (a decode step's) go on one thread as soon as below two
 * threads' worth, where waking the other costs more than it saves */
#define NORM_ROWS_A_THREAD 16

void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t n, int64_t dim,
                   float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 2 * NORM_ROWS_A_THREAD)
    for (int64_t i = 0; i < n; i++) norm_row_bf16(x + i * dim, w, out + i * dim, dim, eps);
}

void rms_norm_f32(const float *x, const float *w, float *out, int64_t n, int64_t dim, float eps,
                  int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 2 * NORM_ROWS_A_THREAD)
    for (int64_t i = 0; i < n; i++) norm_row_f32(x + i * dim, w, out + i * dim, dim, eps);
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

/* The same in float32, as rms_norm_f32 */
void add_rms_norm_f32(float *hidden, const float *delta, const float *w, float *out, int64_t n,
                      int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 2 * NORM_ROWS_A_THREAD)
    for (int64_t i = 0; i < n; i++) {
        float *hi = hidden + i * dim;
        const float *di = delta + i * dim;
#pragma omp simd
        for (int64_t k = 0; k < dim; k++) hi[k] += di[k];
        norm_row_f32(hi, w, out + i * dim, dim, eps);
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

static void silu_mul_row_f32(const float *g, const float *u, float *o, int64_t inter) {
    for (int64_t k = 0; k < inter; k += 16) {
        const __mmask16 m = tail_mask(inter - k);
        const __m512 gate = _mm512_maskz_loadu_ps(m, g + k);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
        const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(o + k, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + k)));
    }
}
#else
static inline float silu_f32(float g) { return g / (1.0f + expf(-g)); }

#if defined(__AVX2__) && defined(__FMA__)
/* float32 eight at a time, exp by exp8 (exp16's series: the same bits up to 88), infinity past
 * 88 (exp8 clamps there), so that silu of a gate below -88 is -0, as torch's. Where each silu
 * called expf, that was 5% of a float32 decode step's samples on a 2-core Zen 3 (family 25,
 * model 1). */
static void silu_mul_row_f32(const float *g, const float *u, float *o, int64_t inter) {
    const __m256 one = _mm256_set1_ps(1.0f), far = _mm256_set1_ps(88.0f);
    int64_t k = 0;
    for (; k + 8 <= inter; k += 8) {
        const __m256 gate = _mm256_loadu_ps(g + k);
        const __m256 minus = _mm256_sub_ps(_mm256_setzero_ps(), gate);
        const __m256 e = _mm256_blendv_ps(exp8(minus), _mm256_set1_ps(INFINITY),
                                          _mm256_cmp_ps(minus, far, _CMP_GT_OQ));
        const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + k, _mm256_mul_ps(silu, _mm256_loadu_ps(u + k)));
    }
    for (; k < inter; k++) o[k] = silu_f32(g[k]) * u[k];
}
#else
static void silu_mul_row_f32(const float *g, const float *u, float *o, int64_t inter) {
    for (int64_t k = 0; k < inter; k++) o[k] = silu_f32(g[k]) * u[k];
}
#endif

static void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t inter) {
    for (int64_t k = 0; k < inter; k++) {
        const float silu = bf16_to_f32(f32_to_bf16(silu_f32(bf16_to_f32(g[k]))));
        o[k] = f32_to_bf16(silu * bf16_to_f32(u[k]));
    }
}

#endif

/* gate_up [n, rows stride apart] -> out [n, inter], a row at a time (the same in float32, whose
 * silu and product are torch's ops but for the exp's series) */
#define DEFINE_SILU_MUL(NAME, T, ROW)                                                            \
    void NAME(const T *gate_up, int64_t stride, int64_t n, int64_t inter, T *out,              \
              int num_threads) {                                                               \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                  \
        for (int64_t t = 0; t < n; t++)                                                        \
            ROW(gate_up + t * stride, gate_up + t * stride + inter, out + t * inter, inter);   \
    }
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, silu_mul_row_bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, silu_mul_row_f32)

/* Rotary embedding and the KV write (rope_write_bf16, rope_write_f32), in one pass instead of
 * torch's dozen small ops a layer. For each token t, from its fused row qkv[t] = [q heads | k
 * heads | v heads]: the q and k heads rotated by the angles of position positions[t]
 * (rotate-half form: out = x * cos + rotate_half(x) * sin, each product and the sum rounded as
 * torch's ops of the dtype round them, so the result is the same bits), q into q_out [n, heads,
 * dim]; the rotated k and the v heads into the token's slot of the layer's paged cache (as in
 * attend_decode: [pages, page_size, 2, kv_heads, dim], pages page_stride apart).
 *   cos, sin  [max_positions, dim] of the tokens' dtype
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

/* float32: the same ops, unrounded (torch's float32 mul and add, so the same bits) */
static inline void rope_head_f32(const float *x, const float *c, const float *s, int64_t dim,
                                 float *out) {
    const int64_t half = dim / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * c[i] + -x[half + i] * s[i];
#pragma omp simd
    for (int64_t i = half; i < dim; i++) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

#define DEFINE_ROPE_WRITE(NAME, T, HEAD)                                                         \
    int NAME(const T *qkv, int64_t qkv_stride, int64_t n, int64_t heads, int64_t kv_heads,     \
             int64_t dim, const T *cos, const T *sin, int64_t max_positions,                   \
             const int64_t *positions, T *q_out, T *kv, int64_t page_stride,                   \
             const int64_t *slot_pages, const int64_t *slot_offsets, int num_threads) {        \
        for (int64_t t = 0; t < n; t++)                                                        \
            if (positions[t] < 0 || positions[t] >= max_positions) return 1;                   \
        const int64_t kv_width = kv_heads * dim;                                               \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (n >= 2 * NORM_ROWS_A_THREAD)") \
        for (int64_t t = 0; t < n; t++) {                                                      \
            const T *row = qkv + t * qkv_stride;                                               \
            const T *c = cos + positions[t] * dim, *s = sin + positions[t] * dim;              \
            T *slot = kv + slot_pages[t] * page_stride + slot_offsets[t] * 2 * kv_width;       \
            for (int64_t h = 0; h < heads; h++)                                                \
                HEAD(row + h * dim, c, s, dim, q_out + (t * heads + h) * dim);                 \
            for (int64_t h = 0; h < kv_heads; h++)                                             \
                HEAD(row + (heads + h) * dim, c, s, dim, slot + h * dim);                      \
            memcpy(slot + kv_width, row + (heads + kv_heads) * dim, (size_t)kv_width * sizeof(T)); \
        }                                                                                      \
        return 0;                                                                              \
    }
DEFINE_ROPE_WRITE(rope_write_bf16, uint16_t, rope_head_bf16)
DEFINE_ROPE_WRITE(rope_write_f32, float, rope_head_f32)

/* Greedy sampling's pick: out[i] = the index of the largest element of row i of x [n, vocab]
 * (rows row_stride apart): the first of equal ones, or the first NaN of a row that has one, as
 * torch.max(dim=-1) picks. torch's max with indices is a scalar loop on CPU (0.4 ms for 32 rows
 * of a 49,152-token vocabulary in cache, against 0.04 ms for a max without them); here the
 * vector lanes (sixteen with AVX-512, eight with AVX2) each keep their own first best and its
 * index, and the lanes are compared once at the end.
 *
 * With `finite` (else NULL), finite[i] = whether every element of row i is finite, from the same
 * pass: the runner fails a sequence whose logits hold a NaN or an infinity and samples the
 * others. bfloat16 rows are read widened to float32, which is exact, so the pick is the one over
 * their float32 copy; a greedy step then needs neither that copy nor a pass of its own to find
 * rows that are not finite. On a 2-core Xeon with AMX, 32 rows of SmolLM2's vocabulary read
 * from L3 (3 MiB of bfloat16 logits, more than a core's L2): the copy, a sum a row and the
 * float32 argmax 0.87 ms, this pass 0.19 ms (the AVX-512 build); a decode step 1.25-1.45 ms
 * shorter (benchmarks/greedy_pick.py). */
static inline float f32_at(const float *x, int64_t k) { return x[k]; }
static inline float bf16_at(const uint16_t *x, int64_t k) { return bf16_to_f32(x[k]); }
/* The vector builds' loads of a row's next lanes, as float32 (the same guards as common.h's
 * bf16x16 and bf16x8, which widen bfloat16) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ARGMAX_AVX512
static inline __m512 bf16_16(const uint16_t *x) { return bf16x16(x, 0xffff); }
#elif defined(__AVX2__) && defined(__FMA__)
#define ARGMAX_AVX2
#endif

#define DEFINE_ARGMAX_ROW(NAME, T, AT, LOAD)                                                     \
    static int64_t NAME##_first_nan(const T *x, int64_t n) {                                     \
        for (int64_t k = 0; k < n; k++)                                                          \
            if (isnan(AT(x, k))) return k;                                                       \
        return -1;                                                                               \
    }                                                                                            \
                                                                                                 \
    /* the row's pick, and in *finite whether all of it is finite */                             \
    static int64_t NAME(const T *x, int64_t n, int *finite) {                                    \
        int64_t best = 0, k = 1;                                                                 \
        float top = AT(x, 0);                                                                    \
        int nan = isnan(top), infinite = isinf(top);                                             \
        VECTOR_PART(LOAD)                                                                        \
        for (; k < n && !nan; k++) {                                                             \
            const float v = AT(x, k);                                                            \
            nan = isnan(v), infinite |= isinf(v);                                                \
            if (v > top) {                                                                       \
                top = v;                                                                         \
                best = k;                                                                        \
            }                                                                                    \
        }                                                                                        \
        *finite = !nan && !infinite;                                                             \
        return nan ? NAME##_first_nan(x, n) : best;                                              \
    }

/* VECTOR_PART(LOAD): the row's first elements, sixteen lanes at a time (eight with AVX2) while as
 * many are left, from inside a row's function (DEFINE_ARGMAX_ROW): reads x and n, leaves k at
 * the first element left, and sets best, top, nan and infinite for the elements read. A NaN or
 * an infinity is flagged by its magnitude, which is not below infinity. Lane indices are int32:
 * CpuArgmax takes no wider row. */
#if defined(ARGMAX_AVX512)
#define VECTOR_PART(LOAD)                                                                        \
    if (n >= 32) {                                                                               \
        __m512 tops = LOAD(x);                                                                   \
        const __m512i sixteen = _mm512_set1_epi32(16);                                           \
        const __m512 inf = _mm512_set1_ps(INFINITY);                                             \
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);    \
        __m512i where = at;                                                                      \
        __mmask16 nans = _mm512_cmp_ps_mask(tops, tops, _CMP_UNORD_Q);                           \
        __mmask16 not_finite = _mm512_cmp_ps_mask(_mm512_abs_ps(tops), inf, _CMP_NLT_UQ);        \
        for (k = 16; k + 16 <= n; k += 16) {                                                     \
            const __m512 v = LOAD(x + k);                                                        \
            at = _mm512_add_epi32(at, sixteen);                                                  \
            const __mmask16 above = _mm512_cmp_ps_mask(v, tops, _CMP_GT_OQ);                     \
            nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                      \
            not_finite |= _mm512_cmp_ps_mask(_mm512_abs_ps(v), inf, _CMP_NLT_UQ);                \
            tops = _mm512_mask_mov_ps(tops, above, v);                                           \
            where = _mm512_mask_mov_epi32(where, above, at);                                     \
        }                                                                                        \
        top = _mm512_reduce_max_ps(tops);                                                        \
        const __mmask16 equal = _mm512_cmp_ps_mask(tops, _mm512_set1_ps(top), _CMP_EQ_OQ);       \
        best = _mm512_mask_reduce_min_epi32(equal, where);                                       \
        nan = nans != 0, infinite = not_finite != 0;                                             \
    }
DEFINE_ARGMAX_ROW(argmax_row_f32, float, f32_at, _mm512_loadu_ps)
DEFINE_ARGMAX_ROW(argmax_row_bf16, uint16_t, bf16_at, bf16_16)
#elif defined(ARGMAX_AVX2)
/* Without AVX-512 (Zen 2 and 3, whose float32 steps take the pass too): eight lanes. 32 rows of
 * SmolLM2's vocabulary in float32, read from L3, in the x86-64-v3 build (the path Zen 2 and 3
 * take) on a 2-core Xeon with AMX: 0.43 ms, against 1.03 ms a scalar loop
 * (benchmarks/greedy_pick.py). */
#define VECTOR_PART(LOAD)                                                                        \
    if (n >= 16) {                                                                               \
        __m256 tops = LOAD(x);                                                                   \
        const __m256i eight = _mm256_set1_epi32(8);                                              \
        const __m256 inf = _mm256_set1_ps(INFINITY);                                             \
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));             \
        __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                                  \
        __m256i where = at;                                                                      \
        __m256 nans = _mm256_cmp_ps(tops, tops, _CMP_UNORD_Q);                                   \
        __m256 not_finite = _mm256_cmp_ps(_mm256_and_ps(tops, magnitude), inf, _CMP_NLT_UQ);     \
        for (k = 8; k + 8 <= n; k += 8) {                                                        \
            const __m256 v = LOAD(x + k);                                                        \
            at = _mm256_add_epi32(at, eight);                                                    \
            const __m256 above = _mm256_cmp_ps(v, tops, _CMP_GT_OQ);                             \
            nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));                        \
            not_finite = _mm256_or_ps(                                                           \
                not_finite, _mm256_cmp_ps(_mm256_and_ps(v, magnitude), inf, _CMP_NLT_UQ));       \
            tops = _mm256_blendv_ps(tops, v, above);                                             \
            where = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(where),             \
                                                         _mm256_castsi256_ps(at), above));       \
        }                                                                                        \
        float lane_tops[8];                                                                      \
        int32_t lane_where[8];                                                                   \
        _mm256_storeu_ps(lane_tops, tops);                                                       \
        _mm256_storeu_si256((__m256i *)lane_where, where);                                       \
        top = lane_tops[0];                                                                      \
        for (int lane = 1; lane < 8; lane++)                                                     \
            top = lane_tops[lane] > top ? lane_tops[lane] : top;                                 \
        best = n;                                                                                \
        for (int lane = 0; lane < 8; lane++)                                                     \
            if (lane_tops[lane] == top && lane_where[lane] < best) best = lane_where[lane];      \
        nan = _mm256_movemask_ps(nans) != 0, infinite = _mm256_movemask_ps(not_finite) != 0;     \
    }
DEFINE_ARGMAX_ROW(argmax_row_f32, float, f32_at, _mm256_loadu_ps)
DEFINE_ARGMAX_ROW(argmax_row_bf16, uint16_t, bf16_at, bf16x8)
#else
#define VECTOR_PART(LOAD)
DEFINE_ARGMAX_ROW(argmax_row_f32, float, f32_at, )
DEFINE_ARGMAX_ROW(argmax_row_bf16, uint16_t, bf16_at, )
#endif
#undef VECTOR_PART
#undef ARGMAX_AVX512
#undef ARGMAX_AVX2

#define DEFINE_ARGMAX_ROWS(NAME, T, ROW)                                                         \
    void NAME(const T *x, int64_t n, int64_t vocab, int64_t row_stride, int64_t *out,            \
              uint8_t *finite, int num_threads) {                                                \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (n >= 4)")       \
        for (int64_t i = 0; i < n; i++) {                                                        \
            int all_finite;                                                                      \
            out[i] = ROW(x + i * row_stride, vocab, &all_finite);                                \
            if (finite != NULL) finite[i] = (uint8_t)all_finite;                                 \
        }                                                                                        \
    }
DEFINE_ARGMAX_ROWS(argmax_rows_f32, float, argmax_row_f32)
DEFINE_ARGMAX_ROWS(argmax_rows_bf16, uint16_t, argmax_row_bf16)
