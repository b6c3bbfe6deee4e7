/* Batched LoRA on CPU: y[t] += scale[s] * (x[t] @ A_s^T) @ B_s for each token t of run s, every
 * adapter row read straight from the page pool, once per token (a token sorted next to tokens of
 * the same adapter finds its rows in cache).
 *
 * Built and loaded by cpu_lora.py with the machine's own compiler (-O3 -march=native -fopenmp),
 * called through ctypes. The OpenMP runtime is the one torch already loaded (same soname), so the
 * two share one thread pool.
 *
 *   x       [n, fin]    row stride x_stride        the layer input
 *   y       [n, fout]   row stride y_stride        accumulated into
 *   a_rows  [runs * r]  flat pool offset of row j of run s's lora_A     (fin elements long)
 *   b_rows  [runs * r]  flat pool offset of row j of run s's lora_B^T   (fout elements long)
 *   slots   [n]         the run s of token t (the tokens of a prefill span share one)
 *   scales  [runs]      float32
 *   r       <= MAX_RANK (else nothing is done and 1 is returned)
 *
 * Arithmetic is float32 whatever the storage dtype; bfloat16 results are rounded to nearest even.
 */
#include <stdint.h>
#include <string.h>

#define MAX_RANK 1024

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

/* float32: each thread takes whole tokens, shrink into v, then expand straight into y, with no
 * barrier in between. A token's rows are streamed front to back, which the prefetcher follows. */
int lora_apply_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t n,
                   int64_t fin, int64_t fout, const float *pool, const int64_t *a_rows,
                   const int64_t *b_rows, const int64_t *slots, int64_t r, const float *scales,
                   int num_threads) {
    if (r > MAX_RANK) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const int64_t s = slots[t];
        const int64_t *at = a_rows + s * r, *bt = b_rows + s * r;
        const float *xt = x + t * x_stride;
        float *yt = y + t * y_stride;
        float v[MAX_RANK];
        for (int64_t j = 0; j < r; j++) {
            const float *a = pool + at[j];
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < fin; k++) acc += xt[k] * a[k];
            v[j] = acc * scales[s];
        }
        for (int64_t j = 0; j < r; j++) {
            const float *b = pool + bt[j];
#pragma omp simd
            for (int64_t k = 0; k < fout; k++) yt[k] += v[j] * b[k];
        }
    }
    return 0;
}

/* bfloat16: the same, through float32 chunks of x and y on the thread's stack. With AVX-512 the
 * inner loops are written out (a bfloat16 load widened by a shift, two accumulators for the
 * dot product); compilers do not vectorize the plain loops as well. */
#define CHUNK 512

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

int lora_apply_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride,
                    int64_t n, int64_t fin, int64_t fout, const uint16_t *pool,
                    const int64_t *a_rows, const int64_t *b_rows, const int64_t *slots, int64_t r,
                    const float *scales, int num_threads) {
    if (r > MAX_RANK) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const int64_t s = slots[t];
        const int64_t *at = a_rows + s * r, *bt = b_rows + s * r;
        float v[MAX_RANK], buf[CHUNK];
        for (int64_t j = 0; j < r; j++) v[j] = 0.0f;
        for (int64_t lo = 0; lo < fin; lo += CHUNK) {
            const int64_t w = fin - lo < CHUNK ? fin - lo : CHUNK;
            const uint16_t *xt = x + t * x_stride + lo;
            for (int64_t k = 0; k < w; k++) buf[k] = bf16_to_f32(xt[k]);
            for (int64_t j = 0; j < r; j++) v[j] += dot_bf16(buf, pool + at[j] + lo, w);
        }
        for (int64_t j = 0; j < r; j++) v[j] *= scales[s];
        for (int64_t lo = 0; lo < fout; lo += CHUNK) {
            const int64_t w = fout - lo < CHUNK ? fout - lo : CHUNK;
            uint16_t *yt = y + t * y_stride + lo;
            for (int64_t k = 0; k < w; k++) buf[k] = bf16_to_f32(yt[k]);
            for (int64_t j = 0; j < r; j++) axpy_bf16(buf, v[j], pool + bt[j] + lo, w);
            for (int64_t k = 0; k < w; k++) yt[k] = f32_to_bf16(buf[k]);
        }
    }
    return 0;
}
