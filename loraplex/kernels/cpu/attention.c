#include "common.h"

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
 * keys not in cache: bfloat16 1.49x / 1.23x / 1.21x faster at 50-100 / 150-300 / 250-500 tokens;
 * float32, whose passes do more arithmetic a byte, 1.01x / 0.96x / 0.98x, so float32 fetches
 * nothing ahead there; decode steps of 32 sequences of 64-340 tokens took 1.003x the time with the
 * fetch on the base model and 1.009x on 32 q,v adapters (family 26, model 2; layers_ab.py --dtype
 * float32 --define F32_FETCH_NEXT, medians of 100 pairs). Intel's Xeons, whose cores each read
 * memory at about half the box's rate, Zen 3 and Zen 4 fetch in float32 too (F32_FETCH_NEXT,
 * cpu_lora.build_flags): on a 2-core Xeon (family 6, model 207, float32 served; 2 MB of L2 a core),
 * a layer's call took 0.863x / 0.889-0.927x / 0.974-0.983x as long at 30 / 100 / 300 tokens, 1.003x
 * at 600 (past the limit, fetching nothing), the same bits (benchmarks/attention_ab.py --dtype
 * float32), and a decode step of 32 sequences on the base model 0.983x (benchmarks/layers_ab.py
 * --dtype float32). On a 2-core Zen 4 (family 25, model 17; 1 MB of L2 a core), a layer's call
 * 0.815x / 0.90-0.92x / 0.96-1.07x / 0.89-1.13x at 30 / 100-128 / 200-256 / 300 tokens, but decode
 * steps of 32 sequences of 150-260 tokens 0.954-0.970x the time on the base model, 0.967-0.970x on
 * 32 q,v adapters, 0.961x on 32 all-module ones (layers_ab.py, medians of 100 alternated pairs). On
 * a 2-core Zen 3 (family 25, model 1; 512 KB of L2 a core), a layer's call 0.89x / 0.94-0.95x /
 * 1.06x / 1.03-1.12x at 30-64 / 100-128 / 200 / 300 tokens, decode steps 0.980x, 0.983x and 0.996x
 * on the base model, 0.989x on 32 q,v adapters, 0.981x on 32 all-module ones. On the Xeon of model
 * 207 offering AVX512-FP16 and AMX, 0.984x at 300 tokens. Cascade Lake and Zen 2 have not been
 * measured with it. */
#define UPCOMING_BF16 (512 << 10)
#if defined(F32_FETCH_NEXT)
#define UPCOMING_F32 UPCOMING_BF16
#else
#define UPCOMING_F32 0
#endif

/* Into L2, not L1: the first pass over a sequence fetches whole rows (every kv head's key and
 * value), most of which the later passes read, after L1 would have dropped them; into L1 the
 * prefetches of a cold layer waited on each other (30 layers of 32 sequences of 96 tokens,
 * 2-core Xeon: 4.70 ms into L1, 4.29 ms into L2). */
static inline void prefetch_bytes(const void *p, size_t n) {
    for (size_t at = 0; at < n; at += 64) __builtin_prefetch((const char *)p + at, 0, 2);
}

/* What a pass brings into cache while it works, as it goes through its tokens in order (fetch_at,
 * once a token): after `skip` tokens, at one token in `every`, `bytes` from `offset` into the
 * next of `rows`, `left` of them. Where every pass first listed the row it fetched at each of its
 * tokens (NULL where none), the lists took 1.7% of a bfloat16 decode step's samples on a 2-core
 * Zen 4 (perf; 32 sequences of about 300 tokens). Without them a layer's call on 32 sequences of
 * 300 tokens took 0.946-0.959x as long in bfloat16, 0.988x in float32, the same bits
 * (benchmarks/attention_ab.py); a whole bfloat16 decode step 0.986-1.006x in six runs, 0.994x
 * and 0.995x in the two of 300 rounds (benchmarks/layers_ab.py). */
typedef struct {
    const void *const *rows;
    size_t offset, bytes;
    int64_t every, skip, left;
} Fetch;

#define NO_FETCH ((Fetch){NULL, 0, 0, 1, 0, 0})

static inline void fetch_at(Fetch *fetch) {
    if (fetch->left <= 0) return;
    if (fetch->skip > 0) {
        fetch->skip--;
        return;
    }
    prefetch_bytes((const char *)fetch->rows[0] + fetch->offset, fetch->bytes);
    fetch->rows++, fetch->left--, fetch->skip = fetch->every - 1;
}

/* The two passes over one group's keys and values, written with the storage type's dot product
 * and axpy: scores[h * len + t] = qf_h . key_t and top[h] = their maximum; then acc_h = sum over
 * t of scores[h * len + t] value_t (a value row lies to_value elements after its key row). */
#define DEFINE_PASSES(SCORES, VALUES, T, DOT, AXPY)                                             \
    static void SCORES(const float *qf, const T *const *keys, Fetch fetch, int64_t len,       \
                       int64_t g, int64_t dim, float *scores, float *top) {                   \
        for (int64_t h = 0; h < g; h++) top[h] = -INFINITY;                                   \
        for (int64_t t = 0; t < len; t++) {                                                   \
            fetch_at(&fetch);                                                                 \
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
            fetch_at(&fetch);                                                                 \
            const T *value = keys[t] + to_value;                                              \
            for (int64_t h = 0; h < g; h++) AXPY(acc + h * dim, scores[h * len + t], value, dim); \
        }                                                                                     \
    }

DEFINE_PASSES(scores_f32_any, values_f32_any, float, dot_f32, axpy_f32)
DEFINE_PASSES(scores_bf16_any, values_bf16_any, uint16_t, dot_bf16, axpy_bf16)

/* The largest of x[0 .. n), NaNs passed over (-INFINITY if all are); with AVX-512 sixteen at a
 * time, where the one-by-one loop's chain of dependent comparisons took a tenth of a prompt
 * token's attention (a token attends to few keys, and the loop ran for each of its heads); with
 * AVX2 eight at a time, where that loop took 4.4% of a float32 decode call's samples (perf, 32
 * sequences of 128 tokens, their rows in cache) on a 2-core Zen 3 (family 25, model 1): a call
 * then took 0.965x as long, its keys in cache or not (0.957x and 0.979x in a first harness), and
 * 0.983x and 0.985x at 128 and 300 tokens (benchmarks/attention_ab.py); a decode step was level
 * (1.005x, layers_ab.py). The same bits: a zero's sign, the one thing the order can change,
 * leaves the exponentials' as they were. */
static inline float max_of(const float *x, int64_t n) {
    int64_t i = 0;
    float top = -INFINITY;
#if defined(__AVX512F__)
    __m512 tops = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) tops = _mm512_max_ps(_mm512_loadu_ps(x + i), tops);
    top = _mm512_reduce_max_ps(tops);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 tops = _mm256_set1_ps(-INFINITY); /* a NaN loaded loses to the lane's top */
    for (; i + 8 <= n; i += 8) tops = _mm256_max_ps(_mm256_loadu_ps(x + i), tops);
    top = hmax8(tops);
#endif
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}

#if defined(__AVX2__) && defined(__FMA__)
/* float32 heads a multiple of 64 wide, with AVX2: head by head, 64 elements at a time, the
 * query's (scores) or the sum's (values) 64 elements held in eight registers while the group's
 * keys or values stream past; the per-token loop above keeps its sums in memory, which on AVX2
 * measured 1.6x slower. The passes go F32_TOKENS tokens at a time, each chunk for all the
 * group's heads, so that the heads after the first find its rows in L1 (each sum's terms in the
 * same order: the same bits). On a 2-core Zen 3 (family 25, model 1; 512 KB of L2 a core), a
 * layer's call on 32 sequences of 260 tokens took 0.885x as long as head by head over all the
 * tokens (chunks of 8 and 32: 0.900x, 0.893x; benchmarks/attention_ab.py), a base decode step
 * 0.977x (benchmarks/layers_ab.py). */
#define F32_TOKENS 16

static void scores_f32(const float *qf, const float *const *keys, Fetch fetch, int64_t len,
                       int64_t g, int64_t dim, float *scores, float *top) {
    if (dim % 64 != 0) {
        scores_f32_any(qf, keys, fetch, len, g, dim, scores, top);
        return;
    }
    for (int64_t t0 = 0; t0 < len; t0 += F32_TOKENS) {
        const int64_t t1 = t0 + F32_TOKENS < len ? t0 + F32_TOKENS : len;
        for (int64_t h = 0; h < g; h++) {
            float *sh = scores + h * len;
            for (int64_t off = 0; off < dim; off += 64) {
                __m256 q[8];
                for (int i = 0; i < 8; i++) q[i] = _mm256_loadu_ps(qf + h * dim + off + 8 * i);
                for (int64_t t = t0; t < t1; t++) {
                    if (h == 0 && off == 0) fetch_at(&fetch);
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
        }
    }
    for (int64_t h = 0; h < g; h++) top[h] = max_of(scores + h * len, len);
}

static void values_f32(float *acc, const float *scores, const float *const *keys, Fetch fetch,
                       int64_t to_value, int64_t len, int64_t g, int64_t dim) {
    if (dim % 64 != 0) {
        values_f32_any(acc, scores, keys, fetch, to_value, len, g, dim);
        return;
    }
    for (int64_t k = 0; k < g * dim; k++) acc[k] = 0.0f;
    for (int64_t t0 = 0; t0 < len; t0 += F32_TOKENS) {
        const int64_t t1 = t0 + F32_TOKENS < len ? t0 + F32_TOKENS : len;
        for (int64_t h = 0; h < g; h++) {
            for (int64_t off = 0; off < dim; off += 64) {
                float *out = acc + h * dim + off;
                __m256 sum[8];
                for (int i = 0; i < 8; i++) sum[i] = _mm256_loadu_ps(out + 8 * i);
                for (int64_t t = t0; t < t1; t++) {
                    if (h == 0 && off == 0) fetch_at(&fetch);
                    const __m256 weight = _mm256_set1_ps(scores[h * len + t]);
                    const float *v = keys[t] + to_value + off;
                    for (int i = 0; i < 8; i++)
                        sum[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * i), sum[i]);
                }
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + 8 * i, sum[i]);
            }
        }
    }
}
#else
#define scores_f32 scores_f32_any
#define values_f32 values_f32_any
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BF16_BLOCKS(dim) ((dim) % 64 == 0) /* whether the passes below take heads dim wide */
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

/* The scores of G heads over a group's len tokens (keys, fetch, len, off, scores as the passes
 * below take them), sixteen tokens at a time: PARTS(G, u, t) sets parts[h][u] for each head h to
 * a vector whose lanes sum to its score of token t; the sixteen vectors are folded at once
 * (sums16), SCALED, and stored at scores[h * len + t] (added to what the row's earlier 64-wide
 * blocks left there where off != 0). */
#define SCORES_BY_SIXTEEN(G, PARTS, SCALED)                                                     \
    for (int64_t first = 0; first < len; first += 16) {                                        \
        const int count = len - first < 16 ? (int)(len - first) : 16;                          \
        __m512 parts[G][16];                                                                   \
        for (int u = 0; u < 16; u++) {                                                         \
            if (u >= count) {                                                                  \
                for (int h = 0; h < G; h++) parts[h][u] = _mm512_setzero_ps();                 \
                continue;                                                                      \
            }                                                                                  \
            const int64_t t = first + u;                                                       \
            if (off == 0) fetch_at(&fetch);                                                   \
            PARTS(G, u, t)                                                                     \
        }                                                                                      \
        const __mmask16 m = tail_mask(count);                                                  \
        for (int h = 0; h < G; h++) {                                                          \
            float *at = scores + h * len + first;                                              \
            __m512 sum = SCALED(sums16(parts[h]));                                             \
            if (off != 0) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(m, at));              \
            _mm512_mask_storeu_ps(at, m, sum);                                                 \
        }                                                                                      \
    }

/* Token t's key row widened, times the query q [G][4] held widened in the same order */
#define WIDENED_PARTS(G, u, t)                                                                  \
    const __m512i k0 = _mm512_loadu_si512(keys[t] + off);                                      \
    const __m512i k1 = _mm512_loadu_si512(keys[t] + off + 32);                                 \
    const __m512 k[4] = {bf16_even(k0), bf16_odd(k0), bf16_even(k1), bf16_odd(k1)};           \
    for (int h = 0; h < G; h++) {                                                              \
        __m512 a = _mm512_mul_ps(q[h][0], k[0]), b = _mm512_mul_ps(q[h][1], k[1]);             \
        a = _mm512_fmadd_ps(q[h][2], k[2], a);                                                 \
        b = _mm512_fmadd_ps(q[h][3], k[3], b);                                                 \
        parts[h][u] = _mm512_add_ps(a, b);                                                     \
    }
#define SUM_AS_IS(sum) (sum)

#define DEFINE_BF16_SCORES(G)                                                                   \
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
        SCORES_BY_SIXTEEN(G, WIDENED_PARTS, SUM_AS_IS)                                         \
    }

#define DEFINE_BF16_VALUES(G)                                                                   \
    static void values_bf16_##G(float *acc, const float *scores, const uint16_t *const *keys,  \
                                Fetch fetch, int64_t to_value, int64_t len, int64_t dim,       \
                                int64_t off) {                                                 \
        __m512 sum[G][4];                                                                      \
        for (int h = 0; h < G; h++)                                                            \
            for (int i = 0; i < 4; i++) sum[h][i] = _mm512_setzero_ps();                       \
        for (int64_t t = 0; t < len; t++) {                                                    \
            if (off == 0) fetch_at(&fetch);                                                   \
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

#if defined(__AVX512BF16__) && !defined(BF16_BY_FMA)
#define SCORES_BY_DOT
/* Where vdpbf16ps runs at the FMAs' rate (AMX's Xeons, Zen 4 and 5), the scores pass takes a
 * key row's 64 bfloat16 times the query's, as both are stored, in two dot-product instructions
 * a head, nothing widened; the products are exact in float32 (as the widened ones are), the
 * scale multiplies each score once, after its sum, and the values pass stays as it is. On a
 * 2-core Zen 4 (family 25, model 17), 30 layers of 32 sequences, SmolLM2's heads, keys not in
 * cache, medians of 15 alternated: 3.93 against 4.19 ms at 72-120 tokens, 8.65 against 9.25 at
 * 176-224 (the widened scores pass below, which the FMA build keeps). */
/* Token t's key row as stored, through dot products with the query qv [G][2] as stored */
#define DOT_PARTS(G, u, t)                                                                      \
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys[t] + off);                           \
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keys[t] + off + 32);                      \
    for (int h = 0; h < G; h++)                                                                \
        parts[h][u] =                                                                          \
            _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qv[h][0], k0), qv[h][1], k1);
#define SCALED_BY_SCALE(sum) _mm512_mul_ps(sum, scale_v)

#define DEFINE_DOT_SCORES(G)                                                                    \
    static void scores_dot_##G(const uint16_t *q, float scale, const uint16_t *const *keys,    \
                               Fetch fetch, int64_t len, int64_t dim, int64_t off,             \
                               float *scores) {                                                \
        __m512bh qv[G][2];                                                                     \
        for (int h = 0; h < G; h++)                                                            \
            for (int i = 0; i < 2; i++)                                                        \
                qv[h][i] = (__m512bh)_mm512_loadu_si512(q + h * dim + off + 32 * i);           \
        const __m512 scale_v = _mm512_set1_ps(scale);                                          \
        SCORES_BY_SIXTEEN(G, DOT_PARTS, SCALED_BY_SCALE)                                       \
    }

DEFINE_DOT_SCORES(1)
DEFINE_DOT_SCORES(2)
DEFINE_DOT_SCORES(3)
DEFINE_DOT_SCORES(4)

/* The passes by the number of heads they take, less one */
typedef void (*DotScoresPass)(const uint16_t *, float, const uint16_t *const *, Fetch, int64_t,
                              int64_t, int64_t, float *);
static const DotScoresPass SCORES_DOT[4] = {scores_dot_1, scores_dot_2, scores_dot_3,
                                            scores_dot_4};
#else
DEFINE_BF16_SCORES(1)
DEFINE_BF16_SCORES(2)
DEFINE_BF16_SCORES(3)
DEFINE_BF16_SCORES(4)

typedef void (*ScoresPass)(const float *, const uint16_t *const *, Fetch, int64_t, int64_t,
                           int64_t, float *);
static const ScoresPass SCORES_BF16[4] = {scores_bf16_1, scores_bf16_2, scores_bf16_3,
                                          scores_bf16_4};
#endif

DEFINE_BF16_VALUES(1)
DEFINE_BF16_VALUES(2)
DEFINE_BF16_VALUES(3)
DEFINE_BF16_VALUES(4)

typedef void (*ValuesPass)(float *, const float *, const uint16_t *const *, Fetch, int64_t,
                           int64_t, int64_t, int64_t);
static const ValuesPass VALUES_BF16[4] = {values_bf16_1, values_bf16_2, values_bf16_3,
                                          values_bf16_4};

/* Heads in chunks of up to four, each 64-wide block of the row in turn; from the query as
 * stored (q, scores times scale after) where SCORES_BY_DOT, else from qf (q times scale, in
 * float32). */
static void scores_bf16(const float *qf, const uint16_t *q, float scale,
                        const uint16_t *const *keys, Fetch fetch, int64_t len, int64_t g,
                        int64_t dim, float *scores, float *top) {
    if (!BF16_BLOCKS(dim)) {
        scores_bf16_any(qf, keys, fetch, len, g, dim, scores, top);
        return;
    }
    for (int64_t h = 0; h < g; h += 4) {
        const int64_t heads = g - h < 4 ? g - h : 4;
        const Fetch first = h == 0 ? fetch : NO_FETCH;
        for (int64_t off = 0; off < dim; off += 64) {
#if defined(SCORES_BY_DOT)
            (void)qf;
            SCORES_DOT[heads - 1](q + h * dim, scale, keys, first, len, dim, off, scores + h * len);
#else
            (void)q, (void)scale;
            SCORES_BF16[heads - 1](qf + h * dim, keys, first, len, dim, off, scores + h * len);
#endif
        }
    }
    for (int64_t h = 0; h < g; h++) top[h] = max_of(scores + h * len, len);
}

static void values_bf16(float *acc, const float *scores, const uint16_t *const *keys,
                        Fetch fetch, int64_t to_value, int64_t len, int64_t g, int64_t dim) {
    if (!BF16_BLOCKS(dim)) {
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
static void scores_bf16(const float *qf, const uint16_t *q, float scale,
                        const uint16_t *const *keys, Fetch fetch, int64_t len, int64_t g,
                        int64_t dim, float *scores, float *top) {
    (void)q, (void)scale;
    scores_bf16_any(qf, keys, fetch, len, g, dim, scores, top);
}
#define values_bf16 values_bf16_any
#endif

/* float32 scores take qf alone (q times scale) */
static void scores_f32_of(const float *qf, const float *q, float scale, const float *const *keys,
                          Fetch fetch, int64_t len, int64_t g, int64_t dim, float *scores,
                          float *top) {
    (void)q, (void)scale;
    scores_f32(qf, keys, fetch, len, g, dim, scores, top);
}

/* rows[t] = where token t's row (every kv head's key and value) starts, t < len, for a sequence
 * with block table `table` in a cache of pages page_bytes apart, rows row_bytes apart */
static void list_rows(const char *cache, size_t page_bytes, size_t row_bytes, int64_t page_size,
                      const int64_t *table, int64_t len, const void **rows) {
    for (int64_t t = 0, p = 0; t < len; p++) {
        const char *page = cache + (size_t)table[p] * page_bytes;
        for (int64_t slot = 0; slot < page_size && t < len; slot++) rows[t++] = page + slot * row_bytes;
    }
}

/* What the two passes of kv head kvh of a sequence fetch, over its len tokens (`keys`: the
 * head's key rows; its value rows to_value bytes on). Each pass fetches its own rows AHEAD
 * tokens before use; kv head 0 reads the sequence from memory, and its scores pass fetches
 * whole token rows (every kv head's keys and values), which the later passes find in L2. With
 * the rows of the thread's next sequence given (upcoming, next_len > 0 rows), the later heads'
 * passes, which do little but arithmetic on rows in cache, fetch those instead, spread evenly
 * over all of them, and the next sequence's kv head 0 in turn finds its rows in cache. Measured
 * on a 2-core Zen 5 (32 sequences of 50-100 tokens, SmolLM2's heads, bfloat16, a layer's keys
 * not in cache): 119 -> 83 us a call. */
static void plan_fetches(const void *const *keys, int64_t len, size_t to_value, size_t head_bytes,
                         size_t row_bytes, const void *const *upcoming, int64_t next_len,
                         int64_t kvh, int64_t kv_heads, Fetch *scores, Fetch *values) {
    if (kvh == 0 || next_len == 0) {
        const int64_t left = len > AHEAD ? len - AHEAD : 0;
        const void *const *ahead = left > 0 ? keys + AHEAD : keys;
        *scores = (Fetch){ahead, 0, kvh == 0 ? row_bytes : head_bytes, 1, 0, left};
        *values = (Fetch){ahead, to_value, head_bytes, 1, 0, left};
        return;
    }
    const int64_t span = 2 * (kv_heads - 1) * len; /* tokens of the later heads' passes */
    const int64_t every = next_len > 0 && span > next_len ? span / next_len : 1;
    /* one row of the next sequence every `every` of those tokens, from their first on */
    for (int64_t pass = 0; pass < 2; pass++) {
        const int64_t at = (2 * (kvh - 1) + pass) * len; /* the pass's first token among them */
        const int64_t row = (at + every - 1) / every;    /* the first row it fetches */
        const int64_t left = next_len - row < 0 ? 0 : next_len - row;
        const void *const *first = left > 0 ? upcoming + row : upcoming;
        const Fetch fetch = {first, 0, row_bytes, every, row * every - at, left};
        *(pass == 0 ? scores : values) = fetch;
    }
}

/* One (sequence, kv head): qf [g, dim] float32, already scaled, in; acc [g, dim] float32 out;
 * keys[t] = where token t's key row of this kv head starts (its value row follows kv_heads * dim
 * elements on); scores, room for g * len floats. Two passes: every key's scores (kept for the
 * softmax), then the values weighted. */
#define DEFINE_ATTEND_GROUP(NAME, T, SCORES, VALUES)                                            \
    static void NAME(const float *qf, const T *q, float scale, float *acc,                   \
                     const T *const *keys, float *scores, int64_t len,                        \
                     const void *const *upcoming, int64_t next_len, int64_t g,                \
                     int64_t kv_heads, int64_t kvh, int64_t dim) {                            \
        const size_t row_bytes = (size_t)(2 * kv_heads * dim) * sizeof(T);                   \
        Fetch scores_fetch, values_fetch;                                                     \
        plan_fetches((const void *const *)keys, len, (size_t)(kv_heads * dim) * sizeof(T),    \
                     (size_t)dim * sizeof(T), row_bytes, upcoming, next_len, kvh, kv_heads,   \
                     &scores_fetch, &values_fetch);                                           \
        float top[MAX_GROUP], total[MAX_GROUP];                                               \
        SCORES(qf, q, scale, keys, scores_fetch, len, g, dim, scores, top);                   \
        for (int64_t h = 0; h < g; h++) total[h] = exp_shifted(scores + h * len, len, top[h]); \
        VALUES(acc, scores, keys, values_fetch, kv_heads * dim, len, g, dim);                 \
        for (int64_t h = 0; h < g; h++)                                                       \
            for (int64_t k = 0; k < dim; k++) acc[h * dim + k] /= total[h];                   \
    }

DEFINE_ATTEND_GROUP(attend_group_f32, float, scores_f32_of, values_f32)
DEFINE_ATTEND_GROUP(attend_group_bf16, uint16_t, scores_bf16, values_bf16)

static inline float f32_identity(float v) { return v; }

/* The entry point for one storage type: each query row on its own (a decode token, or a prompt
 * token), its kv heads in turn (each kv head on its own when there are few rows), each group's
 * queries widened and scaled into float32 where its scores pass takes them so (TAKES_QF), the
 * result rounded back. A thread claims its next item before it starts on the one in hand
 * (first come, first served, as a dynamic schedule), so that it can fetch the next one's rows
 * while it works (plan_fetches). An item's rows are listed once, page by page (a division per
 * token to find its page cost more than the dot products), and moved on by dim for each later
 * kv head; the list of the next item's rows, made for the fetches, is that item's list, and a
 * thread's scratch is had once a call. Where each (sequence, kv head) listed its rows again
 * into scratch malloc'ed for it, on a 2-core Zen 5 (family 26, model 2) a layer's call on 32
 * sequences of 300 tokens took 0.956x as long in bfloat16 and 0.968x in float32, 0.977x and
 * 0.983x built for x86-64-v3, the same bits (benchmarks/attention_ab.py); a whole bfloat16 decode
 * step 0.989x and 0.996x, float32 1.000x (benchmarks/layers_ab.py). */
#define DEFINE_ATTEND_DECODE(NAME, T, GROUP, TO_F32, FROM_F32, UPCOMING, TAKES_QF)                \
    int NAME(const T *q, T *out, const T *kv, int64_t page_stride, const int64_t *tables,     \
             int64_t table_stride, const int64_t *lens, int64_t n, int64_t heads,              \
             int64_t kv_heads, int64_t dim, int64_t page_size, float scale, int num_threads) { \
        const int64_t g = heads / kv_heads;                                                   \
        if (g > MAX_GROUP || dim > MAX_DIM || g * kv_heads != heads) return 1;                \
        int failed = 0;                                                                       \
        /* fewer sequences than two a thread: items of one kv head, to keep every thread busy */ \
        const int64_t split = n < 2 * num_threads ? kv_heads : 1, items = n * split;          \
        int64_t claimed = 0, longest = 1;                                                     \
        for (int64_t b = 0; b < n; b++) longest = lens[b] > longest ? lens[b] : longest;      \
        const int64_t row_bytes = 2 * kv_heads * dim * (int64_t)sizeof(T);                    \
        const size_t page_bytes = (size_t)page_stride * sizeof(T);                            \
        _Pragma("omp parallel num_threads(num_threads) reduction(| : failed)")                \
        {                                                                                     \
            /* the scores, on a cache line of their own (at 16 bytes into one, the bfloat16      \
             * passes of the AVX2 build took 1.02-1.03x as long), then the item's rows and the   \
             * next item's */                                                                 \
            const size_t score_bytes = (sizeof(float) * (size_t)(g * longest) + 63) / 64 * 64; \
            const size_t list_bytes = (2 * sizeof(void *) * (size_t)longest + 63) / 64 * 64;  \
            void *scratch = aligned_alloc(64, score_bytes + list_bytes);                      \
            float *scores = scratch;                                                          \
            const T **keys = (const T **)((char *)scratch + score_bytes), **upcoming = keys + longest; \
            int listed = 0; /* whether keys holds the item's rows already */                  \
            failed |= scratch == NULL;                                                        \
            int64_t item = scratch == NULL ? items : __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED); \
            while (item < items) {                                                            \
                const int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);       \
                const int64_t b = item / split, part = kv_heads / split, from = item % split * part; \
                const int64_t *table = tables + b * table_stride;                             \
                if (!listed)                                                                  \
                    list_rows((const char *)(kv + from * dim), page_bytes, (size_t)row_bytes, \
                              page_size, table, lens[b], (const void **)keys);                \
                /* the next item's rows are fetched ahead if it is a whole sequence (an item of \
                 * one kv head fetches nothing), another one (a prompt's next token finds its   \
                 * rows in cache) and no more than L2 keeps beside the one in hand */          \
                const int64_t *next_table = split == 1 && next < items ? tables + next * table_stride : NULL; \
                const int fetch_next = next_table != NULL && next_table[0] != table[0] &&     \
                                       lens[next] * row_bytes <= UPCOMING;                    \
                const int64_t next_len = fetch_next ? lens[next] : 0;                         \
                if (next_len > 0)                                                             \
                    list_rows((const char *)kv, page_bytes, (size_t)row_bytes, page_size,     \
                              next_table, next_len, (const void **)upcoming);                 \
                for (int64_t kvh = from; kvh < from + part; kvh++) {                          \
                    const int64_t first = (b * heads + kvh * g) * dim; /* the group's first */ \
                    float qf[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM];                  \
                    if (kvh > from)                                                           \
                        for (int64_t t = 0; t < lens[b]; t++) keys[t] += dim;                 \
                    if (TAKES_QF(dim))                                                        \
                        for (int64_t k = 0; k < g * dim; k++) qf[k] = TO_F32(q[first + k]) * scale; \
                    GROUP(qf, q + first, scale, acc, keys, scores, lens[b],                   \
                          (const void *const *)upcoming, next_len, g, kv_heads, kvh, dim);    \
                    for (int64_t k = 0; k < g * dim; k++) out[first + k] = FROM_F32(acc[k]);  \
                }                                                                             \
                if (next_len > 0) { /* the next item's list is made */                        \
                    const T **swap = keys;                                                    \
                    keys = upcoming, upcoming = swap;                                         \
                }                                                                             \
                listed = next_len > 0;                                                        \
                item = next;                                                                  \
            }                                                                                 \
            free(scratch);                                                                    \
        }                                                                                     \
        return failed ? 2 : 0;                                                                \
    }

/* Whether a group's scores pass takes the query widened and scaled (qf): not the bfloat16 one
 * through dot products (SCORES_BY_DOT), which takes it as stored */
#define ALWAYS_QF(dim) 1
#if defined(SCORES_BY_DOT)
#define BF16_QF(dim) (!BF16_BLOCKS(dim)) /* the passes for other widths take qf */
#else
#define BF16_QF(dim) 1
#endif

DEFINE_ATTEND_DECODE(attend_decode_f32, float, attend_group_f32, f32_identity, f32_identity,
                     UPCOMING_F32, ALWAYS_QF)
DEFINE_ATTEND_DECODE(attend_decode_bf16, uint16_t, attend_group_bf16, bf16_to_f32, f32_to_bf16,
                     UPCOMING_BF16, BF16_QF)
