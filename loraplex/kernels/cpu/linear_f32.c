#include "linear.h"

/* float32 dense projections for decode steps: y = x W^T (+ bias), W packed once at load, and the
 * LoRA call after it in the same native call, its adapter rows brought into cache during the
 * projection (linear_lora_f32).
 *
 * Packed: W [n, k] as blocks of F32_COLS output columns, each [k][F32_COLS]: a row of a block is
 * the weights of its columns for one input; columns past n are zeros. A tile of F32_ROWS rows of
 * x by one block keeps its sums in registers over all of k (24 with AVX-512: per input, 3 loads
 * of W and 8 broadcasts of x, or 6 and 4, for 24 FMAs); each sum is x's inputs in order, one FMA
 * each, the bias added last. Work is (block, tile of rows) items in block order, split evenly
 * between the threads, each fetching its next block of W while it works on one, as the bfloat16
 * projection does.
 *
 * On AMD's CPUs a decode step's products are bound by arithmetic, and leave most of the memory
 * bandwidth unused (on Intel's Xeons, by what a core reads while it computes: below), while the
 * LoRA call after them is bound by memory: oneDNN's products cannot fetch its rows meanwhile, this
 * one can. On a 2-core Zen 4 (family 25, model 17), SmolLM2's four projections of 30 layers of
 * distinct weights at 32 rows took 38.7 against oneDNN's 48.9 ms (175 against 139 GFLOP/s; medians
 * of 15 alternated passes), 0.80x by the best of 7 (benchmarks/prompt_projection.py --dtype
 * float32). Larger batches gain less: 0.86-0.96x at 33-256 rows by the best of 7, but 1.08-1.13x at
 * 256 by the median of 15, so prompt chunks keep oneDNN's (and its copy of W). The AVX2 build's
 * tiles are narrower (below): on a 2-core Zen 3 (family 25, model 1), 74.4 against oneDNN's 105.7
 * ms at 32 rows (0.70x), 0.80x at 64, and on another 0.84x / 0.94x / 1.13x / 1.23x / 1.13x at 32 /
 * 64 / 128 / 256 / 512 rows (best of 7); on a third 0.75x-0.95x at 32-512 rows, but there whole
 * prefills of 32 prompts took 1.09x the time on the base model and 1.12x on 32 adapters with this
 * projection taking the chunks (benchmarks/prompt_chunks.py, medians of 6 alternated rounds), so
 * prompt chunks keep oneDNN's on Zen 3. On a 2-core Zen 2 (family 23, model 49), 0.74x at 32 rows
 * and 0.89-0.93x at 256-512, so there it takes prompt chunks too (cpu_lora.CpuLinearF32.any_rows).
 */

/* The vectors a tile works in, by build: F32_LANES floats each; a tail's mask (the lanes before
 * `left`), and loads and stores of those lanes alone. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* Intel's Xeons and Zen 5 (-DF32_TALL_TILE, cpu_lora.build_flags): 8 rows by 48 columns, a block
 * read from L2 once for 8 rows where 4 rows by 96 columns read it twice as often for the same
 * FMAs. At 32 rows the projections are bound by what each core reads while it computes: on a
 * 2-core Xeon (family 6, model 207) offering AVX-512 without AVX512-BF16, AMX or AVX512-FP16,
 * SmolLM2's four projections of 30 layers took 34.9-35.7 against 38.9-39.9 ms
 * (benchmarks/prompt_projection.py --dtype float32, 191-195 against 170-175 GFLOP/s; 0.74-0.75x
 * oneDNN's time against 0.80-0.81x), and decode steps of 32 sequences 0.950x the time on the
 * base model, 0.959x on 32 q,v adapters and 0.956x on 32 all-module ones
 * (benchmarks/layers_ab.py --dtype float32, medians of 60 alternated pairs). At 1-16 rows level
 * or better (0.76-0.88x oneDNN's time against 0.79-0.88x), at 256 rows level with oneDNN
 * (1.00-1.03x its time against 0.93-0.96x). The same model offering AVX512-FP16 and AMX too:
 * decode steps 0.951x the time on the base model (layers_ab.py --undefine F32_TALL_TILE, medians
 * of 100 pairs), the projections at 32 rows 0.68x oneDNN's time. On a 2-core Zen 5 (family 26,
 * model 2), decode steps 0.942x and 0.946x the time on the base model, 0.951x on 32 q,v adapters
 * and 0.953x on 32 all-module ones (layers_ab.py --define F32_TALL_TILE, medians of 100-150
 * pairs: 2.0-2.6 ms less of 38-55). Cascade Lake has not been measured with 8 by 48.
 * Zen 4: 4 rows by 96 columns. Its projections are bound by arithmetic, and there 8 by 48 made
 * decode steps of 32 sequences slower in all but one run (2-core, family 25, model 17;
 * layers_ab.py --dtype float32, medians of 60-100 alternated pairs): on the base model by 0.15
 * to 2.0 ms of 65-76 (6 runs), on 32 q,v adapters by 0.72 to 1.14 ms (4), on 32 all-module
 * ones by -1.07 to +1.34 ms of 87-97 (3). */
#if defined(F32_TALL_TILE)
#define F32_COLS 48
#define F32_ROWS 8
#else
#define F32_COLS 96
#define F32_ROWS 4
#endif
#define F32_LANES 16
typedef __m512 F32Vec;
typedef __mmask16 F32Tail;
static inline F32Vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline F32Vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline F32Vec vec_broadcast(const float *p) { return _mm512_set1_ps(*p); }
static inline F32Vec vec_fma(F32Vec a, F32Vec b, F32Vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline F32Vec vec_add(F32Vec a, F32Vec b) { return _mm512_add_ps(a, b); }
static inline F32Tail vec_tail(int64_t left) { return tail_mask(left); }
static inline F32Vec vec_load_tail(const float *p, F32Tail m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void vec_store_tail(float *p, F32Tail m, F32Vec v) { _mm512_mask_storeu_ps(p, m, v); }

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2's 16 registers: a tile of F32_ROWS rows by a block of 24 columns keeps its 12 sums in
 * registers, with the block's 3 vectors of an input and x's broadcast: per input, 3 loads of W
 * and 4 broadcasts for 12 FMAs. */
#define F32_COLS 24
#define F32_ROWS 4
#define F32_LANES 8
typedef __m256 F32Vec;
typedef __m256i F32Tail;
static inline F32Vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline F32Vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline F32Vec vec_broadcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline F32Vec vec_fma(F32Vec a, F32Vec b, F32Vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline F32Vec vec_add(F32Vec a, F32Vec b) { return _mm256_add_ps(a, b); }
static inline F32Tail vec_tail(int64_t left) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)), lanes);
}
static inline F32Vec vec_load_tail(const float *p, F32Tail m) { return _mm256_maskload_ps(p, m); }
static inline void vec_store_tail(float *p, F32Tail m, F32Vec v) { _mm256_maskstore_ps(p, m, v); }
#endif

#if defined(F32_COLS)
#define F32_VECS (F32_COLS / F32_LANES)

/* Rows x[0 .. rows) of one block: y[i][0 .. cols) = x[i] . W's columns (+ bias). `fetch` ..
 * `fetch_end`: the thread's next block, `pace` lines a step of k; `extra`: the call's ranges. */
static inline __attribute__((always_inline)) void tile_f32(
    const float *x, int64_t x_stride, const int rows, int64_t k, const float *block,
    const float *bias, float *y, int64_t y_stride, int64_t cols, const char *fetch,
    const char *fetch_end, int64_t pace, Ranges *extra) {
    F32Vec acc[F32_ROWS][F32_VECS];
    for (int i = 0; i < F32_ROWS; i++)
        for (int c = 0; c < F32_VECS; c++) acc[i][c] = vec_zero();
    for (int64_t p = 0; p < k; p++) {
        const float *w = block + p * F32_COLS;
        F32Vec wv[F32_VECS];
        for (int c = 0; c < F32_VECS; c++) wv[c] = vec_load(w + c * F32_LANES);
        for (int64_t f = 0; f < pace && fetch < fetch_end; f++, fetch += 64)
            __builtin_prefetch(fetch, 0, 2);
        fetch_ranges(extra);
        for (int i = 0; i < rows; i++) {
            const F32Vec xv = vec_broadcast(x + i * x_stride + p);
            for (int c = 0; c < F32_VECS; c++) acc[i][c] = vec_fma(xv, wv[c], acc[i][c]);
        }
    }
    for (int c = 0; c < F32_VECS && c * F32_LANES < cols; c++) {
        const F32Tail m = vec_tail(cols - c * F32_LANES);
        const F32Vec b = bias != NULL ? vec_load_tail(bias + c * F32_LANES, m) : vec_zero();
        for (int i = 0; i < rows; i++)
            vec_store_tail(y + i * y_stride + c * F32_LANES, m, vec_add(acc[i][c], b));
    }
}

int linear_native_f32(void) { return 1; }

/* A projection's arguments, as linear_bf16's (linear.c) in float32 */
typedef struct {
    const float *x;
    int64_t x_stride, m, k;
    const float *packed;
    int64_t n;
    const float *bias;
    float *y;
    int64_t y_stride;
    const int64_t *fetch_at, *fetch_bytes;
    int64_t fetches;
} LinearCallF32;

int64_t linear_packed_numel_f32(int64_t n, int64_t k) {
    return (n + F32_COLS - 1) / F32_COLS * F32_COLS * k;
}

/* w [n, k] contiguous -> packed (linear_packed_numel_f32 elements) */
int linear_pack_f32(const float *w, int64_t n, int64_t k, float *packed) {
    for (int64_t first = 0; first < n; first += F32_COLS) {
        float *block = packed + first * k;
        for (int64_t p = 0; p < k; p++)
            for (int64_t c = 0; c < F32_COLS; c++)
                block[p * F32_COLS + c] = first + c < n ? w[(first + c) * k + p] : 0.0f;
    }
    return 0;
}

/* Thread t of nt's share of a projection: its run of the items, the call's fetch ranges split
 * between the threads in order and spread over each thread's work (linear.h); with `lora`, the
 * LoRA call's shrinks (a token each) between its items at the same even pace, F32_SHRINK_LAG
 * tokens behind: the fetch ranges are the tokens' rows in order, so a token's shrink reads the
 * rows brought in two tokens' worth of items before, where at the vdpbf16ps build's pace (the
 * second half of the items, twice as fast as they go; linear.c) the first tokens' rows came
 * in half a projection before. On a 2-core Zen 4 (family 25, model 17), 32 sequences on 32
 * rank-16 adapters, benchmarks/kernel_ab.py --dtype float32 against that pace, extra over base
 * a decode step: q,v -0.43 and -0.35 ms (of 3.7-4.4), all-module -0.74 and -2.12 ms (of
 * 15-17); one token behind -0.64 ms q,v, -1.81 and -0.59 ms all-module; four behind against
 * one +0.16 ms q,v, +1.53 ms all-module. The vdpbf16ps build measured level at this pace
 * (q,v +0.21 and -0.29 ms, all-module +0.74 and -0.66 ms) and keeps its own. */
#define F32_SHRINK_LAG 2
static void linear_thread_f32(const LinearCallF32 *call, int64_t t, int64_t nt,
                              LoRAPasses *lora) {
    const int64_t x_stride = call->x_stride, y_stride = call->y_stride, k = call->k;
    const Items s = thread_items(call->m, call->n, F32_COLS, F32_ROWS, k, call->packed,
                                 F32_COLS * k * 4, t, nt);
    Ranges extra = call_ranges(call->fetch_at, call->fetch_bytes, call->fetches, lora, t, nt,
                               (s.last - s.first) * s.steps);
    for (int64_t item = s.first; item < s.last; item++) {
        const Item it = item_at(&s, item);
        const float *xr = call->x + it.row * x_stride;
        const float *block = call->packed + it.block * F32_COLS * k;
        const float *bias = call->bias != NULL ? call->bias + it.col : NULL;
        float *yr = call->y + it.row * y_stride + it.col;
#define TILE_OF(R_)                                                                            \
    tile_f32(xr, x_stride, R_, k, block, bias, yr, y_stride, it.cols, it.from, it.to, s.pace,    \
             &extra)
        switch (it.rows) { /* the tile specialised for each row count */
#if F32_ROWS > 4
        case 8: TILE_OF(8); break;
        case 7: TILE_OF(7); break;
        case 6: TILE_OF(6); break;
        case 5: TILE_OF(5); break;
#endif
        case 4: TILE_OF(4); break;
        case 3: TILE_OF(3); break;
        case 2: TILE_OF(2); break;
        default: TILE_OF(1);
        }
#undef TILE_OF
        shrinks_behind(lora, &s, item, F32_SHRINK_LAG);
    }
    shrinks_due(lora, 0, 0);
}

/* x [m, k] -> y [m, n], as LinearCallF32 describes them, the fetch ranges brought into cache
 * meanwhile; 0 */
int linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed,
               int64_t n, const float *bias, float *y, int64_t y_stride, const int64_t *fetch_at,
               const int64_t *fetch_bytes, int64_t fetches, int num_threads) {
    const LinearCallF32 call = {x, x_stride, m, k, packed, n, bias, y, y_stride,
                                fetch_at, fetch_bytes, fetches};
    if (m <= 0 || n <= 0) return 0;
#pragma omp parallel num_threads(item_threads(m, n, F32_COLS, F32_ROWS, num_threads))
    linear_thread_f32(&call, omp_get_thread_num(), omp_get_num_threads(), NULL);
    return 0;
}

/* The projection x -> y (its fetch ranges brought into cache meanwhile) and then the LoRA call
 * `bound` on (x, y), in one parallel region, the threads meeting between the two (as
 * linear_lora_bf16): the shrinks during the projection, the expands after. On a 2-core Zen 4,
 * 30 layers of 32 rows on 32 distinct rank-16 adapters, rows fetched during the projection, the
 * call's extra over the projection alone (medians of 11-15 alternated passes, 30 GB/s read):
 * all-module 22.3 ms with the shrinks during the projection against 23.7 ms with the whole call
 * after it, q,v 3.25 against 4.10 ms. */
int linear_lora_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed,
                    int64_t n, const float *bias, float *y, int64_t y_stride,
                    const int64_t *fetch_at, const int64_t *fetch_bytes, int64_t fetches,
                    const LoRABinding *bound) {
    const LinearCallF32 call = {x, x_stride, m, k, packed, n, bias, y, y_stride,
                                fetch_at, fetch_bytes, fetches};
    const LoRACallF32 lora = {x, x_stride, y, y_stride, k, bound};
    if (bound->r > MAX_RANK || bound->modules > MAX_MODULES) return 1;
    if (m <= 0 || n <= 0) return 0;
#pragma omp parallel num_threads((int)bound->num_threads)
    {
        const int64_t th = omp_get_thread_num(), nt = omp_get_num_threads();
        LoRAPasses passes;
        const int split = lora_passes_begin_f32(&passes, &lora, th, nt);
        linear_thread_f32(&call, th, nt, split ? &passes : NULL);
#pragma omp barrier
        if (split)
            lora_expands(&passes);
        else
            lora_thread_f32(&lora, th, nt);
    }
    return 0;
}
#else
/* Without AVX2 and FMA the library has no float32 projection: cpu_lora binds none of its functions
 * where linear_native_f32() says so, and these refuse (layers.c calls them). */
int linear_native_f32(void) { return 0; }

int linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed,
               int64_t n, const float *bias, float *y, int64_t y_stride, const int64_t *fetch_at,
               const int64_t *fetch_bytes, int64_t fetches, int num_threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y;
    (void)y_stride, (void)fetch_at, (void)fetch_bytes, (void)fetches, (void)num_threads;
    return 2;
}

int linear_lora_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed,
                    int64_t n, const float *bias, float *y, int64_t y_stride,
                    const int64_t *fetch_at, const int64_t *fetch_bytes, int64_t fetches,
                    const LoRABinding *bound) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y;
    (void)y_stride, (void)fetch_at, (void)fetch_bytes, (void)fetches, (void)bound;
    return 2;
}
#endif
