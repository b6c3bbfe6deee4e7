/* Batched LoRA on CPU for decode tokens: y[t] += scale[t] * (x[t] @ A_t^T) @ B_t, every adapter
 * row read straight from the page pool, once per token (a token sorted next to tokens of the same
 * adapter finds its rows in cache).
 *
 * Built and loaded by cpu_lora.py with the machine's own compiler (-O3 -march=native -fopenmp),
 * called through ctypes. The OpenMP runtime is the one torch already loaded (same soname), so the
 * two share one thread pool.
 *
 *   x       [n, fin]    row stride x_stride        the layer input
 *   y       [n, fout]   row stride y_stride        accumulated into
 *   a_rows  [n * r]     flat pool offset of row j of token t's lora_A   (fin elements long)
 *   b_rows  [n * r]     flat pool offset of row j of token t's lora_B^T (fout elements long)
 *   scales  [n]         float32
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
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#define LOAD_f32(p) (p)
#define LOAD_bf16(p) bf16_to_f32(p)
#define STORE_f32(f) (f)
#define STORE_bf16(f) f32_to_bf16(f)

/* Each thread takes whole tokens: shrink into v (on its stack), then expand, with no barrier in
 * between. Rows are streamed whole, front to back, which the hardware prefetcher follows. */
#define DEFINE_LORA_APPLY(NAME, T)                                                              \
    int lora_apply_##NAME(const T *x, int64_t x_stride, T *y, int64_t y_stride, int64_t n,       \
                          int64_t fin, int64_t fout, const T *pool, const int64_t *a_rows,      \
                          const int64_t *b_rows, int64_t r, const float *scales,                \
                          int num_threads) {                                                    \
        if (r > MAX_RANK) return 1;                                                             \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                   \
        for (int64_t t = 0; t < n; t++) {                                                       \
            const T *xt = x + t * x_stride;                                                     \
            const int64_t *at = a_rows + t * r, *bt = b_rows + t * r;                           \
            float v[MAX_RANK];                                                                  \
            for (int64_t j = 0; j < r; j++) {                                                   \
                const T *a = pool + at[j];                                                      \
                float acc = 0.0f;                                                               \
                _Pragma("omp simd reduction(+ : acc)")                                          \
                for (int64_t k = 0; k < fin; k++) acc += LOAD_##NAME(xt[k]) * LOAD_##NAME(a[k]); \
                v[j] = acc * scales[t];                                                         \
            }                                                                                   \
            T *yt = y + t * y_stride;                                                           \
            if (sizeof(T) == sizeof(float)) {                                                   \
                float *yf = (float *)yt;                                                        \
                for (int64_t j = 0; j < r; j++) {                                               \
                    const T *b = pool + bt[j];                                                  \
                    _Pragma("omp simd")                                                         \
                    for (int64_t k = 0; k < fout; k++) yf[k] += v[j] * LOAD_##NAME(b[k]);       \
                }                                                                               \
            } else {                                                                            \
                float acc[256];                                                                 \
                for (int64_t lo = 0; lo < fout; lo += 256) {                                    \
                    int64_t width = fout - lo < 256 ? fout - lo : 256;                          \
                    for (int64_t k = 0; k < width; k++) acc[k] = LOAD_##NAME(yt[lo + k]);      \
                    for (int64_t j = 0; j < r; j++) {                                           \
                        const T *b = pool + bt[j] + lo;                                         \
                        _Pragma("omp simd")                                                     \
                        for (int64_t k = 0; k < width; k++) acc[k] += v[j] * LOAD_##NAME(b[k]); \
                    }                                                                           \
                    for (int64_t k = 0; k < width; k++) yt[lo + k] = STORE_##NAME(acc[k]);      \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        return 0;                                                                               \
    }

DEFINE_LORA_APPLY(f32, float)
DEFINE_LORA_APPLY(bf16, uint16_t)
