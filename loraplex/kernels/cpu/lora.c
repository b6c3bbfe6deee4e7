/* Batched LoRA on CPU (lora_apply_f32, lora_apply_bf16): y[t] += scale[s] * (x[t] @ A_s^T) @ B_s
 * for each token t of run s, every adapter row read straight from the page pool, once per token
 * or per block of tokens on the same rows (a token sorted next to tokens of the same adapter
 * finds its rows in cache). A call takes x, y and the input width, and the rest bound once
 * (LoRABinding, lora.h): rows start .. end of x and y, and
 *
 *   x       [*, fin]    row stride x_stride        the layer input
 *   y       [*, *]      row stride y_stride        accumulated into: output i (one module) at
 *                                                  columns cols[i] .. cols[i] + fouts[i]
 *   mods    [modules]   output i's module: its rows are those of row mods[i] of a_rows, b_rows
 *   a_rows  [*, mstride] flat pool offset of row j of run s's lora_A, at [m, s * r + j]
 *                        (fin elements long)
 *   b_rows  [*, mstride] the same for lora_B^T (fouts[i] elements long)
 *   slots   [end - start] the run s of token t (the tokens of a prefill span share one)
 *   scales  [runs]      float32
 *   r       <= MAX_RANK, modules <= MAX_MODULES (else nothing is done and 1 is returned)
 *
 * The modules that read one input (q, k and v; gate and up) go in one call: one pass over the
 * tokens, one thread team, one call's fixed cost instead of three. */
#include "lora.h"

/* float32: each thread takes whole tokens, shrink into v, then expand straight into y, with no
 * barrier in between. The rows of the token the thread takes next (static schedule: t + 1, each
 * token's rows elsewhere in the pool) are brought into cache at the pace its own are read:
 * without, a thread waits on memory at every row it starts. */
#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* With AVX-512 a token's A rows go four at a time and its B rows all at once, 16 columns of y
 * held in a register (EXPAND_VECTORS such registers at once) while every row is added in, so
 * that many rows stream from memory at once where row after row (dot_f32_ahead,
 * axpy_f32_ahead) kept two going; the next token's rows into L2 rather than L1, as many lines
 * at once. Each sum is those helpers' arithmetic in their order (a 512-bit accumulator is
 * their two 256-bit ones side by side; an element of y takes the rows' products in turn), so
 * the bits are theirs. On a 2-core Xeon (family 6, model 207), decode steps of 32 sequences,
 * the builds swapped step by step (benchmarks/kernel_ab.py): 32 all-module adapters 31.7 ->
 * 30.1 ms of extra over base, 32 q,v adapters 6.48 -> 6.31 ms. */
#define F32_AHEAD_HINT 2 /* __builtin_prefetch's locality for the next token's rows: into L2 */
/* The expand's columns of y held at once, 16 a vector: each vector's sums are a chain of r
 * dependent FMAs, and four chains keep the FMA units busy where one waited on the last (2-core
 * Xeon, family 6, model 85, 32 sequences on 32 rank-16 adapters, builds swapped step by step,
 * benchmarks/kernel_ab.py: extra over base -0.90 and -1.43 ms a step all-module, -0.94 ms q,v,
 * paired medians of 60-100). */
#define EXPAND_VECTORS 4

/* out[i] = x . rows[i] (n elements) for i < 4, each as dot_f32_ahead sums it; the same lines of
 * ahead[i] (NULL: none) brought into cache meanwhile */
static inline void shrink4_f32(const float *x, const float *const *rows,
                               const float *const *ahead, int64_t n, float out[4]) {
    __m512 acc[4];
    for (int i = 0; i < 4; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        for (int i = 0; i < 4; i++) {
            if (ahead != NULL) __builtin_prefetch(ahead[i] + k, 0, F32_AHEAD_HINT);
            acc[i] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(rows[i] + k), acc[i]);
        }
    }
    if (k + 8 <= n) { /* the first accumulator's lanes alone */
        const __m512 xv = _mm512_maskz_loadu_ps(0xff, x + k);
        for (int i = 0; i < 4; i++)
            acc[i] = _mm512_mask3_fmadd_ps(xv, _mm512_maskz_loadu_ps(0xff, rows[i] + k), acc[i],
                                           0xff);
        k += 8;
    }
    for (int i = 0; i < 4; i++) {
        if (ahead != NULL && k < n) __builtin_prefetch(ahead[i] + k, 0, F32_AHEAD_HINT);
        float sum = hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[i]),
                                        _mm512_extractf32x8_ps(acc[i], 1)));
        for (int64_t e = k; e < n; e++) sum += x[e] * rows[i][e];
        out[i] = sum;
    }
}

/* y += sum over j < r of v[j] * rows[j] (n elements), each element as r axpy_f32_ahead calls
 * in turn give it; ahead as shrink4_f32 */
static inline void expand_f32(float *y, const float *v, const float *pool, const int64_t *rows,
                              const int64_t *ahead, int64_t r, int64_t n) {
    const int64_t body = n - n % 8; /* axpy_f32_ahead's vector part; the rest is scalar */
    for (int64_t k = 0; k < body; k += 16 * EXPAND_VECTORS) {
        __mmask16 m[EXPAND_VECTORS];
        __m512 yv[EXPAND_VECTORS];
        for (int c = 0; c < EXPAND_VECTORS; c++) {
            const int64_t left = body - k - 16 * c;
            m[c] = left > 0 ? tail_mask(left) : 0;
            yv[c] = _mm512_maskz_loadu_ps(m[c], y + k + 16 * c);
        }
        for (int64_t j = 0; j < r; j++) {
            const float *row = pool + rows[j] + k;
            const __m512 vj = _mm512_set1_ps(v[j]);
            for (int c = 0; c < EXPAND_VECTORS; c++) {
                if (ahead != NULL && m[c])
                    __builtin_prefetch(pool + ahead[j] + k + 16 * c, 0, F32_AHEAD_HINT);
                yv[c] = _mm512_fmadd_ps(vj, _mm512_maskz_loadu_ps(m[c], row + 16 * c), yv[c]);
            }
        }
        for (int c = 0; c < EXPAND_VECTORS; c++) _mm512_mask_storeu_ps(y + k + 16 * c, m[c], yv[c]);
    }
    for (int64_t j = 0; j < r && body < n; j++) {
        if (ahead != NULL) __builtin_prefetch(pool + ahead[j] + body, 0, F32_AHEAD_HINT);
        for (int64_t e = body; e < n; e++) y[e] += v[j] * pool[rows[j] + e];
    }
}

#define SHRINK_FOUR    /* shrink_f32 below takes four A rows at a time through shrink4_f32 */
#define EXPAND_AT_ONCE /* this build has its own expand_f32; the others take B row after row */
#elif defined(__AVX2__) && defined(__FMA__)
/* With AVX2 a token's A rows go four at a time too: eight sums in flight, where dot_f32_ahead
 * kept two waiting on each FMA's latency, and four rows streaming at once. Each sum is
 * dot_f32_ahead's, in its order, so the bits are its own; the next token's rows into L1, as it
 * brings them. Its B rows stay row after row (axpy_f32_ahead): y held in registers while every
 * row is added in, as the AVX-512 expand does, measured slower here. On a 2-core Zen 3 (family
 * 25, model 1), 32 sequences on 32 rank-16 adapters, the builds swapped step by step
 * (benchmarks/kernel_ab.py --dtype float32, paired medians of 120): all-module extra over base
 * -3.52, -4.53 and -3.65 ms a step (of 43-46), q,v +0.44 and -0.77 ms (of 8.7-10.0), the same
 * tokens and logprobs to the bit; with y in 8 registers as well, all-module +0.56 and +1.56 ms,
 * q,v -1.69 ms; in 4, all-module -0.65 ms, q,v +0.06 ms. */
static inline void shrink4_f32(const float *x, const float *const *rows,
                               const float *const *ahead, int64_t n, float out[4]) {
    __m256 lo[4], hi[4]; /* dot_f32_ahead's acc0 and acc1 of each row */
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            if (ahead != NULL) __builtin_prefetch(ahead[i] + k, 0, 3);
            lo[i] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(rows[i] + k), lo[i]);
            hi[i] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(rows[i] + k + 8), hi[i]);
        }
    }
    if (k + 8 <= n) {
        const __m256 x0 = _mm256_loadu_ps(x + k);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            lo[i] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(rows[i] + k), lo[i]);
        k += 8;
    }
    for (int i = 0; i < 4; i++) {
        if (ahead != NULL && k < n) __builtin_prefetch(ahead[i] + k, 0, 3);
        float sum = hsum8(_mm256_add_ps(lo[i], hi[i]));
        for (int64_t e = k; e < n; e++) sum += x[e] * rows[i][e];
        out[i] = sum;
    }
}
#define SHRINK_FOUR
#endif

#if defined(SHRINK_FOUR)
/* v[j] = x . A row j, j < r */
static inline void shrink_f32(const float *x, const float *pool, const int64_t *rows,
                              const int64_t *ahead, int64_t r, int64_t n, float *v) {
    for (int64_t j = 0; j < r; j += 4) {
        const float *four[4], *later[4];
        for (int i = 0; i < 4; i++) {
            const int64_t row = j + i < r ? j + i : j; /* past r: row j again, result dropped */
            four[i] = pool + rows[row];
            later[i] = ahead != NULL ? pool + ahead[row] : NULL;
        }
        float out[4];
        shrink4_f32(x, four, ahead != NULL ? later : NULL, n, out);
        for (int i = 0; i < 4 && j + i < r; i++) v[j + i] = out[i];
    }
}
#else
static inline void shrink_f32(const float *x, const float *pool, const int64_t *rows,
                              const int64_t *ahead, int64_t r, int64_t n, float *v) {
    for (int64_t j = 0; j < r; j++)
        v[j] = dot_f32_ahead(x, pool + rows[j], n, ahead != NULL ? pool + ahead[j] : NULL);
}
#endif

#if !defined(EXPAND_AT_ONCE)
static inline void expand_f32(float *y, const float *v, const float *pool, const int64_t *rows,
                              const int64_t *ahead, int64_t r, int64_t n) {
    for (int64_t j = 0; j < r; j++)
        axpy_f32_ahead(y, v[j], pool + rows[j], n, ahead != NULL ? pool + ahead[j] : NULL);
}
#endif

/* The offsets of run s's rows of output i in a row table (a_rows or b_rows); NULL for s < 0 */
static inline const int64_t *run_rows(const LoRABinding *bound, const int64_t *table, int64_t i,
                                      int64_t s) {
    return s < 0 ? NULL : table + bound->mods[i] * bound->mstride + s * bound->r;
}

/* Token t's rows of output i in a row table (a_rows or b_rows), and those of the next token
 * where it is on another run (to prefetch meanwhile; else NULL) */
static inline const int64_t *token_rows(const LoRABinding *b, const int64_t *table, int64_t t,
                                        int64_t i, const int64_t **ahead) {
    const int64_t n = b->end - b->start, s = b->slots[t];
    *ahead = run_rows(b, table, i, t + 1 < n && b->slots[t + 1] != s ? b->slots[t + 1] : -1);
    return run_rows(b, table, i, s);
}

/* Token t's shrink for output i of a float32 call, into v (scaled) */
static inline void token_shrink_f32(const LoRACallF32 *call, int64_t t, int64_t i, float *v) {
    const LoRABinding *b = call->bound;
    const int64_t *ahead, *rows = token_rows(b, b->a_rows, t, i, &ahead);
    shrink_f32(call->x + (b->start + t) * call->x_stride, b->pool, rows, ahead, b->r, call->fin,
               v);
    for (int64_t j = 0; j < b->r; j++) v[j] *= b->scales[b->slots[t]];
}

/* Token t's expand for output i from v */
static inline void token_expand_f32(const LoRACallF32 *call, int64_t t, int64_t i, const float *v) {
    const LoRABinding *b = call->bound;
    const int64_t *ahead, *rows = token_rows(b, b->b_rows, t, i, &ahead);
    expand_f32(call->y + (b->start + t) * call->y_stride + b->cols[i], v, b->pool, rows, ahead,
               b->r, b->fouts[i]);
}

/* The end of the run of slots (consecutive tokens on one slot) that starts at token t */
static inline int64_t run_end(const int64_t *slots, int64_t t, int64_t n) {
    int64_t u = t + 1;
    while (u < n && slots[u] == slots[t]) u++;
    return u;
}

/* Thread th of nt's share of a call's n tokens: *first .. *last, split as evenly as their reads
 * go, a run of L tokens counting as ceil(L / block): with decode tokens alone, runs of one, that
 * is the split by count. By count, a step with a prompt chunk beside decode tokens put every
 * decode token (they come first) on the first thread, each reading its adapter's rows from
 * memory or L3, while the other took the span's tokens, whose rows stay in L1. Where the split
 * falls inside a span, each thread reads its rows; a token's arithmetic does not depend on the
 * thread that takes it.
 *
 * bfloat16 (block LORA_BLOCK, the tokens a block's rows are read once for): on a 2-core Zen 4
 * (family 25, model 17), 30 layers of q,k,v projections, each with its q,v LoRA call and that
 * call's rows fetched during it, the two builds alternated (scratch, medians of 60): the calls'
 * extra over the projections alone 2.72 -> 2.22 ms on 95 rows (31 decode tokens on adapters of
 * their own beside a 64-token prompt span), 5.91 -> 4.70 ms on 256 (28 beside 4 spans), level
 * on a decode step's 32 (1.54, 1.50 ms). A request arriving every step (benchmarks/mixed_steps.py
 * --against the split by count, medians of 8 alternated runs): the split by count 1.044x the time
 * on all-module adapters, 1.020x on q,v ones. In the AMX build, whose tiles take a thread's spans
 * 16 tokens at a time from its first token, which tokens go through tiles depends on the split
 * (as it did by count); there a tile block counts as one (BF16_SHARE_BLOCK). float32:
 * F32_SHARE_BLOCK. */
static void share_of(const LoRABinding *b, int64_t th, int64_t nt, int64_t block, int64_t *first,
                     int64_t *last) {
    const int64_t n = b->end - b->start, *slots = b->slots;
    int64_t total = 0;
    for (int64_t t = 0, u; t < n; t = u) {
        u = run_end(slots, t, n);
        total += (u - t + block - 1) / block;
    }
    const int64_t from = total * th / nt, to = total * (th + 1) / nt; /* in blocks */
    *first = *last = n;
    for (int64_t t = 0, u, done = 0; t < n; t = u) {
        u = run_end(slots, t, n);
        const int64_t blocks = (u - t + block - 1) / block;
        if (*first == n && done + blocks > from) *first = t + (from - done) * block;
        if (done + blocks > to) {
            *last = t + (to - done) * block;
            return;
        }
        done += blocks;
    }
}

/* A float32 call's tokens are shared as if a span's F32_SHARE_BLOCK tokens read its rows once
 * (share_of), though each token is a block of its own: a decode token's rows come from memory,
 * a span's after its first from L1. On a 2-core Zen 3 (family 25, model 1; AVX2), where oneDNN's
 * projection takes a step with a prompt chunk and the call follows it, a request arriving every
 * step (a 64-token prompt beside about 31 decode tokens on 32 distinct q,v adapters; scratch
 * timers around the calls, runs of 120 steps): the calls 14.5 ms a step by count, 9.4-9.9 with
 * 4, 11.1-11.6 with 8, 13.3-13.8 with 2; alternated with the split by count in one process,
 * 11.80 against 15.38 ms (medians of 5). */
#ifndef F32_SHARE_BLOCK
#define F32_SHARE_BLOCK 4
#endif

/* Thread th of nt's share of a float32 call: its part of the tokens (share_of, F32_SHARE_BLOCK),
 * each token a block of its own (a call fused with the projection before it, linear_f32.c, finds
 * in cache the rows that projection fetched for the thread's tokens: linear.h, call_ranges) */
void lora_thread_f32(const LoRACallF32 *call, int64_t th, int64_t nt) {
    int64_t first, last;
    share_of(call->bound, th, nt, F32_SHARE_BLOCK, &first, &last);
    for (int64_t t = first; t < last; t++)
        for (int64_t i = 0; i < call->bound->modules; i++) {
            float v[MAX_RANK];
            token_shrink_f32(call, t, i, v);
            token_expand_f32(call, t, i, v);
        }
}

int lora_apply_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t fin,
                   const LoRABinding *bound) {
    if (bound->r > MAX_RANK || bound->modules > MAX_MODULES) return 1;
    const LoRACallF32 call = {x, x_stride, y, y_stride, fin, bound};
#pragma omp parallel num_threads((int)bound->num_threads)
    lora_thread_f32(&call, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

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
 * While a thread works on a token it prefetches, at the same pace, the rows of the token it
 * takes next; without that every row of every token started with a wait on memory.
 * Measured on a 2-core Zen 4 (30 layers, 32 tokens on 32 all-module rank-16 adapters, 298 MiB
 * of rows a step, 33 GB/s of read bandwidth): 21.8 ms a step with the float32-chunk loops this
 * replaces, 17.3 ms with these loops, 12.8 ms with the prefetch (into L2). Into L1 (AHEAD_HINT)
 * on a 2-core Zen 5, a call of 32 tokens on 32 q,v adapters after a decode step's projection:
 * with its rows in L3, 27-29 -> 21-24 us; from memory, 41 -> 34-36 us (medians of 300 calls,
 * alternated builds). A prefill span's tokens go
 * LORA_BLOCK at a time, each row loaded once for them (all 120 calls of a prefill step of 4
 * prompts of 64 tokens on 4 all-module adapters, 2-core Xeon: 25.8 ms token by token, 23.1 ms
 * in blocks; the products, not the reads, bound it there). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* __builtin_prefetch's locality for the next block's rows. In the AMX build (Intel since
 * Sapphire Rapids), where nothing fetches a decode call's rows before it, into L2, as the
 * float32 calls' (F32_AHEAD_HINT): on a 2-core Xeon with AMX (family 6, model 167), 32 sequences
 * on 32 rank-16 adapters, the builds swapped step by step (benchmarks/kernel_ab.py), extra over
 * base -0.68 and -0.88 ms a step all-module (of 15.8), -0.36 ms q,v (of 3.5), paired medians of
 * 60-80. Into L1 elsewhere (the Zen 5 figures above). */
#if defined(HAVE_AMX)
#define AHEAD_HINT 2
#else
#define AHEAD_HINT 3
#endif

/* A block: up to LORA_BLOCK consecutive tokens on the same adapter rows (a prefill span's, or
 * decode tokens of one adapter: block_at): each row is read once for all of them. A decode
 * token next to no other of its adapter is a block of one. */
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
            if (ahead != NULL) __builtin_prefetch(ahead[j] + k, 0, AHEAD_HINT);
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

#if defined(__AVX512BF16__) && !defined(BF16_BY_FMA) && !defined(HAVE_AMX)
/* In the vdpbf16ps build (AMD's Zen 4 and 5), a decode token (a block of one) of a call whose
 * rows nothing fetched before it (a call on its own: the decode tokens of a step too large for
 * the native projection) reads them one at a time, front to back, the same row of the token
 * next prefetched alongside: two streams from memory, where the blocks' order (the shrink four
 * rows at a time, the expand every row at each 32 columns) keeps 8 to 32 going at once. On a
 * 2-core Zen 5, a call of 32 tokens on 32 q,v adapters, 2 MB of rows from memory: 57-60 ->
 * 49-50 us (33-35 -> 39-40 GB/s; a streaming read 48 GB/s then). With the rows in cache the
 * blocks' order is the faster (in L3 18 against 22 us, in L1 15 against 20 us), so the call
 * after a decode step's projection, whose rows that projection or one before it fetched, keeps
 * it. Every result is the bits the block of one gives. */
#define ROW_BY_ROW 1
#define ROW_BY_ROW_COLS 16384 /* the widest output so taken: its float32 sums on the stack */

/* v[j] = x . rows[j], j < r, each as shrink4_bf16 sums it */
static inline __attribute__((always_inline)) void shrink_rows(
    const uint16_t *x, const uint16_t *pool, const int64_t *rows, const int64_t *ahead,
    int64_t r, int64_t n, float *v) {
    for (int64_t j = 0; j < r; j++) {
        const uint16_t *row = pool + rows[j], *later = ahead != NULL ? pool + ahead[j] : NULL;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < n; k += 32) {
            const __mmask32 m = tail_mask32(n - k);
            if (later != NULL) __builtin_prefetch(later + k, 0, AHEAD_HINT);
            const __m512i xv = _mm512_maskz_loadu_epi16(m, x + k);
            const __m512i a = _mm512_maskz_loadu_epi16(m, row + k);
            acc = _mm512_dpbf16_ps(acc, (__m512bh)xv, (__m512bh)a);
        }
        v[j] = _mm512_reduce_add_ps(acc);
    }
}

/* y[k] += sum over j of v[j] * rows[j][k] for k < n (n <= ROW_BY_ROW_COLS), as expand_block
 * sums it: y's even and odd elements in float32 on the stack, the rows added in one at a time,
 * each y rounded once */
static inline __attribute__((always_inline)) void expand_rows(
    uint16_t *y, const float *v, const uint16_t *pool, const int64_t *rows, const int64_t *ahead,
    int64_t r, int64_t n) {
    float even[ROW_BY_ROW_COLS / 2] __attribute__((aligned(64)));
    float odd[ROW_BY_ROW_COLS / 2] __attribute__((aligned(64)));
    const int64_t chunks = (n + 31) / 32;
    for (int64_t c = 0; c < chunks; c++) {
        const __m512i yv = _mm512_maskz_loadu_epi16(tail_mask32(n - 32 * c), y + 32 * c);
        _mm512_store_ps(even + 16 * c, bf16_even(yv));
        _mm512_store_ps(odd + 16 * c, bf16_odd(yv));
    }
    for (int64_t j = 0; j < r; j++) {
        const uint16_t *row = pool + rows[j], *later = ahead != NULL ? pool + ahead[j] : NULL;
        const __m512 vj = _mm512_set1_ps(v[j]);
        for (int64_t c = 0; c < chunks; c++) {
            if (later != NULL) __builtin_prefetch(later + 32 * c, 0, AHEAD_HINT);
            const __m512i b = _mm512_maskz_loadu_epi16(tail_mask32(n - 32 * c), row + 32 * c);
            float *e = even + 16 * c, *o = odd + 16 * c;
            _mm512_store_ps(e, _mm512_fmadd_ps(vj, bf16_even(b), _mm512_load_ps(e)));
            _mm512_store_ps(o, _mm512_fmadd_ps(vj, bf16_odd(b), _mm512_load_ps(o)));
        }
    }
    for (int64_t c = 0; c < chunks; c++) {
        const __m512i high = _mm512_and_si512(round_bf16(_mm512_load_ps(odd + 16 * c)),
                                              _mm512_set1_epi32((int)0xffff0000u));
        const __m512i low = _mm512_srli_epi32(round_bf16(_mm512_load_ps(even + 16 * c)), 16);
        _mm512_mask_storeu_epi16(y + 32 * c, tail_mask32(n - 32 * c), _mm512_or_si512(low, high));
    }
}
#endif

/* v[i][j] = x_i . A row j for tokens i < T, j < r */
static inline __attribute__((always_inline)) void shrink_block(
    const uint16_t *x, int64_t x_stride, const int T, const uint16_t *pool, const int64_t *rows,
    const int64_t *ahead, int64_t r, int64_t n, float v[][MAX_RANK], const int by_rows) {
#if defined(ROW_BY_ROW)
    if (T == 1 && by_rows) {
        shrink_rows(x, pool, rows, ahead, r, n, v[0]);
        return;
    }
#else
    (void)by_rows;
#endif
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
    const int64_t *rows, const int64_t *ahead, int64_t r, int64_t n, const int by_rows) {
#if defined(ROW_BY_ROW)
    if (T == 1 && by_rows && n <= ROW_BY_ROW_COLS) {
        expand_rows(y, v[0], pool, rows, ahead, r, n);
        return;
    }
#else
    (void)by_rows;
#endif
    for (int64_t k = 0; k < n; k += 32) {
        const __mmask32 m = tail_mask32(n - k);
        __m512 even[LORA_BLOCK], odd[LORA_BLOCK];
        for (int i = 0; i < T; i++) {
            const __m512i yv = _mm512_maskz_loadu_epi16(m, y + i * y_stride + k);
            even[i] = bf16_even(yv), odd[i] = bf16_odd(yv);
        }
        for (int64_t j = 0; j < r; j++) {
            if (ahead != NULL) __builtin_prefetch(pool + ahead[j] + k, 0, AHEAD_HINT);
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
                         float v[][MAX_RANK], const int by_rows) {
    (void)x_stride, (void)T, (void)ahead, (void)by_rows;
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
                         int64_t r, int64_t n, const int by_rows) {
    (void)y_stride, (void)T, (void)ahead, (void)by_rows;
    float buf[CHUNK];
    for (int64_t lo = 0; lo < n; lo += CHUNK) {
        const int64_t w = n - lo < CHUNK ? n - lo : CHUNK;
        for (int64_t k = 0; k < w; k++) buf[k] = bf16_to_f32(y[lo + k]);
        for (int64_t j = 0; j < r; j++) axpy_bf16(buf, v[0][j], pool + rows[j] + lo, w);
        for (int64_t k = 0; k < w; k++) y[lo + k] = f32_to_bf16(buf[k]);
    }
}
#endif

/* Module i of a block of T tokens from token t on (run s): the shrink (v, scaled), and the
 * expand into y; the rows of run `later` (-1: none) prefetched meanwhile; a block of one row by
 * row where the build does so (ROW_BY_ROW) and the call's rows were not fetched before it. */
static inline __attribute__((always_inline)) void module_shrink(
    const LoRACall *call, int64_t i, int64_t t, const int T, int64_t s, int64_t later,
    float v[][MAX_RANK]) {
    const LoRABinding *b = call->bound;
    shrink_block(call->x + (b->start + t) * call->x_stride, call->x_stride, T, b->pool,
                 run_rows(b, b->a_rows, i, s), run_rows(b, b->a_rows, i, later), b->r, call->fin,
                 v, !call->rows_fetched);
    const float scale = b->scales[s];
    for (int u = 0; u < T; u++)
        for (int64_t j = 0; j < b->r; j++) v[u][j] *= scale;
}

static inline __attribute__((always_inline)) void module_expand(
    const LoRACall *call, int64_t i, int64_t t, const int T, int64_t s, int64_t later,
    float v[][MAX_RANK]) {
    const LoRABinding *b = call->bound;
    expand_block(call->y + (b->start + t) * call->y_stride + b->cols[i], call->y_stride, T, v,
                 b->pool, run_rows(b, b->b_rows, i, s), run_rows(b, b->b_rows, i, later), b->r,
                 b->fouts[i], !call->rows_fetched);
}

/* One block of T tokens from token t on (run s), every module in turn. */
static inline __attribute__((always_inline)) void lora_block_bf16(
    const LoRACall *call, int64_t t, const int T, int64_t s, int64_t later) {
    float v[LORA_BLOCK][MAX_RANK];
    for (int64_t i = 0; i < call->bound->modules; i++) {
        module_shrink(call, i, t, T, s, later, v);
        module_expand(call, i, t, T, s, later, v);
    }
}

/* Whether runs s and u read the same rows with the same scale: one run, or two runs of one
 * adapter (the engine makes each decode token a run of its own; an adapter's rows lie in its
 * own pages, so its first A row tells it apart) */
static inline int same_rows(const LoRABinding *b, int64_t s, int64_t u) {
    const int64_t *first = b->a_rows + b->mods[0] * b->mstride;
    return s == u || (first[s * b->r] == first[u * b->r] && b->scales[s] == b->scales[u]);
}

/* The size of the block at token t (up to LORA_BLOCK consecutive tokens on the same rows,
 * before `last`: a prefill span's, or decode tokens of one adapter); *later: the run of the
 * block after it, unless on the same rows (else -1). A block's arithmetic is each of its
 * tokens' on its own, so decode tokens blocked together get the bits they get alone, each row
 * loaded (and in the expand widened) once for the block. Each decode token stays a run of its
 * own, so AMX's spans (runs of 16), whose sums run in another order, never take one. On a
 * 2-core Xeon with AMX (family 6, model 167), 32 sequences decoding in bfloat16, the builds
 * swapped step by step (benchmarks/kernel_ab.py --adapters N, paired medians of 60), extra
 * over base: on one all-module rank-16 adapter 6.61 -> 4.49 ms a step, on one q,v adapter 2.03
 * -> 1.26 ms, on 8 all-module adapters 8.44 -> 6.38 ms; on 32 distinct adapters level (-0.18 ms
 * q,v, -0.16 ms all-module). On a 2-core Zen 4 (family 25, model 17; the vdpbf16ps build, whose
 * fused projections take the blocks in their two passes), the same measurements: 3.74 -> 2.79,
 * 0.82 -> 0.58 and 3.52 -> 2.54 ms; level on 32 distinct adapters (-0.08 ms q,v, -0.20 ms
 * all-module). */
static inline int block_at(const LoRABinding *b, int64_t t, int64_t last, int64_t *later) {
    const int64_t *slots = b->slots, s = slots[t];
    int T = 1;
    while (T < LORA_BLOCK && t + T < last && same_rows(b, s, slots[t + T])) T++;
    *later = t + T < last && !same_rows(b, s, slots[t + T]) ? slots[t + T] : -1;
    return T;
}

/* `body` with the block's size T as a constant, a copy specialised for each size */
#if LORA_BLOCK >= 4
#define FOR_BLOCK_SIZE(T, body)                                                                \
    switch (T) {                                                                               \
    case 4: body(4); break;                                                                    \
    case 3: body(3); break;                                                                    \
    case 2: body(2); break;                                                                    \
    default: body(1);                                                                          \
    }
#elif LORA_BLOCK >= 2
#define FOR_BLOCK_SIZE(T, body)                                                                \
    switch (T) {                                                                               \
    case 2: body(2); break;                                                                    \
    default: body(1);                                                                          \
    }
#else
#define FOR_BLOCK_SIZE(T, body)                                                                \
    do {                                                                                       \
        (void)(T);                                                                             \
        body(1);                                                                               \
    } while (0);
#endif

/* The calling thread's buffer, at least `bytes` long; kept for its later calls (a buffer
 * allocated and freed each call, past malloc's mmap threshold, cost the page faults of a fresh
 * mapping every time). NULL if it cannot grow. One a thread, for one use at a time: AMX's spans
 * in that build (lora_span_amx), and the two passes' shrink results (LoRAPasses: bfloat16 calls
 * but in the AMX build, float32 ones in any). */
static void *thread_buffer(size_t bytes) {
    static __thread void *buffer;
    static __thread size_t size;
    if (bytes > size) {
        void *grown = realloc(buffer, bytes);
        if (grown == NULL) return NULL;
        buffer = grown, size = bytes;
    }
    return buffer;
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
 * tokens on 8 adapters, 4 new tokens each, 3.22 -> 3.01 s. With A's layout by transposes and y
 * rounded 32 lanes an instruction (a_pairs_of, narrow_bf16x32), the same bits: a q,v call on 256
 * tokens in 4 spans of 64, 39.1-39.5 -> 32.2-33.2 us; in 16 spans of 16, 65-73 -> 55-57 us
 * (2-core Xeon, family 6, model 167 as its hypervisor shows it; the call alone, its rows in L2).
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

/* thirty-two float32 lanes, low's then high's, rounded to bfloat16 in one instruction
 * (vcvtne2ps2bf16: to nearest even, NaNs made quiet as round_bf16 does), where narrow_bf16's
 * integer form is eight for each half. It reads a float32 below 2^-126 as 0, where the integer
 * form keeps a subnormal bfloat16: y here, a projection's output plus a LoRA delta, is not that
 * small in a model's layers. */
static inline __m512i narrow_bf16x32(__m512 low, __m512 high) {
    return (__m512i)_mm512_cvtne2ps_pbh(high, low);
}

/* The 16 x 16 four-byte elements of m transposed in place: m[i] holds element i of each row */
static inline void transpose_16x16(__m512i m[16]) {
    __m512i a[16];
    for (int k = 0; k < 8; k++) { /* within 128-bit lanes: rows 2k, 2k + 1 interleaved */
        a[2 * k] = _mm512_unpacklo_epi32(m[2 * k], m[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(m[2 * k], m[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) { /* lane l of m[4k + c]: rows 4k .. 4k + 3 of column 4l + c */
        m[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
        m[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
        m[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        m[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
    for (int c = 0; c < 4; c++) { /* lane l of the four rows' blocks: column 4l + c */
        const __m512i even0 = _mm512_shuffle_i32x4(m[c], m[4 + c], 0x88);
        const __m512i odd0 = _mm512_shuffle_i32x4(m[c], m[4 + c], 0xDD);
        const __m512i even1 = _mm512_shuffle_i32x4(m[8 + c], m[12 + c], 0x88);
        const __m512i odd1 = _mm512_shuffle_i32x4(m[8 + c], m[12 + c], 0xDD);
        a[c] = _mm512_shuffle_i32x4(even0, even1, 0x88);
        a[8 + c] = _mm512_shuffle_i32x4(even0, even1, 0xDD);
        a[4 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0x88);
        a[12 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0xDD);
    }
    for (int i = 0; i < 16; i++) m[i] = a[i];
}

/* A's r rows (fin each; fin a multiple of 32) as input pairs by rank, a tile's B operand:
 * pairs[p][j] = elements 2p and 2p + 1 of row j, for 16 pairs at a time a 16 x 16 transpose of
 * four-byte pairs (rows past r read as zeros, kept out of the stores), where a copy a pair took
 * r loads and stores for every 2 inputs. */
static void a_pairs_of(const uint16_t *const *rows, int64_t r, int64_t fin, uint16_t *pairs) {
    const __mmask16 ranks = tail_mask(r);
    for (int64_t p = 0; p < fin / 2; p += 16) {
        __m512i m[16];
        for (int64_t j = 0; j < 16; j++)
            m[j] = j < r ? _mm512_loadu_si512(rows[j] + 2 * p) : _mm512_setzero_si512();
        transpose_16x16(m);
        for (int64_t c = 0; c < 16; c++)
            _mm512_mask_storeu_epi32(pairs + (p + c) * r * 2, ranks, m[c]);
    }
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
        const uint16_t *rows[16];
        for (int64_t j = 0; j < r; j++) rows[j] = pool + a_rows[at + j];
        a_pairs_of(rows, r, fin, a_pairs);
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
                    _mm512_mask_storeu_epi16(out, m, narrow_bf16x32(low, high));
                }
            }
        }
    }
}
#endif

/* The tokens of a run that count as one decode token's reads in a bfloat16 call's split
 * (share_of, in lora_thread_bf16 and lora_passes_begin): a block's (LORA_BLOCK), but in the AMX
 * build, whose tiles take a span 16 tokens at a time, its rows in L1 after the first, a tile
 * block's. On a 2-core Xeon with AMX (family 6, model 167 as its hypervisor shows it), a request
 * arriving every step (a 64-token prompt beside about 31 decode tokens on 32 distinct rank-16
 * adapters), builds swapped step by step in one process (scratch, medians of 150 steps each):
 * all-module 60.05 and 60.00 ms a step with 4 (two builds of it), 56.77 with 16, 56.78 with 64;
 * q,v 44.12 and 44.23 with 4, 43.65 with 16, 43.74 with 32. With 4 the first thread took 23
 * decode tokens, each reading its rows from memory, and the second 8 and the span, which its
 * tiles finish in a few microseconds. Elsewhere each block of a span reads its rows again (from
 * L2 where they outgrow L1: SmolLM2-135M's q,v rows are 61 KB an adapter in bfloat16). On a
 * 2-core Zen 4, under the same arrivals (benchmarks/mixed_steps.py, 6 rounds, medians of the
 * rounds' ratios), 8 took 1.005x the time of 4 on q,v and 1.008x all-module, 16 1.004x and
 * 1.013x. */
#ifndef BF16_SHARE_BLOCK
#if defined(HAVE_AMX)
#define BF16_SHARE_BLOCK AMX_SPAN
#else
#define BF16_SHARE_BLOCK LORA_BLOCK
#endif
#endif

/* Thread th of nt's share of a call: its part of the tokens (share_of), taken in blocks. A
 * block's arithmetic is each of its tokens' on its own, in the same order: the results do not
 * depend on the blocking. */
void lora_thread_bf16(const LoRACall *call, int64_t th, int64_t nt) {
    const LoRABinding *bound = call->bound;
    int64_t first, last;
    share_of(bound, th, nt, BF16_SHARE_BLOCK, &first, &last);
    const int64_t *slots = bound->slots;
#if defined(HAVE_AMX)
    const int64_t x_stride = call->x_stride, y_stride = call->y_stride, fin = call->fin;
    const uint16_t *x = call->x + bound->start * x_stride, *pool = bound->pool;
    uint16_t *y = call->y + bound->start * y_stride;
    const int64_t modules = bound->modules, r = bound->r;
    const int64_t mstride = bound->mstride, *mods = bound->mods, *cols = bound->cols;
    const int64_t *fouts = bound->fouts, *a_rows = bound->a_rows, *b_rows = bound->b_rows;
    const float *scales = bound->scales;
    int64_t work_numel = 0; /* the span buffer, for the widest module */
    for (int64_t i = 0; i < modules; i++)
        if (span_work(fin, fouts[i], r) > work_numel) work_numel = span_work(fin, fouts[i], r);
    uint16_t *work = NULL; /* had, and the tiles shaped, at the thread's first span */
    int tiles = amx_takes(fin, r);
#endif
    for (int64_t t = first; t < last;) {
        const int64_t s = slots[t];
#if defined(HAVE_AMX)
        int64_t len = 1;
        while (tiles && len < AMX_SPAN && t + len < last && slots[t + len] == s) len++;
        if (tiles && len == AMX_SPAN) {
            if (work == NULL) {
                work = thread_buffer(sizeof(uint16_t) * (size_t)work_numel);
                tiles = work != NULL;
                if (tiles) load_span_tiles(r);
            }
            if (tiles) {
                while (t + len < last && slots[t + len] == s) len++;
                const int64_t blocks = len / AMX_SPAN;
                lora_span_amx(x, x_stride, y, y_stride, t, blocks, s, fin, modules, mods, cols,
                              fouts, pool, a_rows, b_rows, mstride, r, scales[s], work);
                t += blocks * AMX_SPAN;
                continue;
            }
        }
#endif
        int64_t later;
        const int T = block_at(bound, t, last, &later);
#define LORA_BLOCK_OF(T_) lora_block_bf16(call, t, T_, s, later)
        FOR_BLOCK_SIZE(T, LORA_BLOCK_OF)
#undef LORA_BLOCK_OF
        t += T;
    }
#if defined(HAVE_AMX)
    if (work != NULL) _tile_release();
#endif
}

#if !defined(HAVE_AMX)
/* A thread's share of a call in two passes, for the fused projection (linear.c): the shrinks,
 * which read only x, between the thread's items of the projection, then the expands into its
 * output once the threads have met. A shrink's loads of A rows (60% of a q,v call's rows) then
 * wait on memory beside the projection's arithmetic, where the call after the projection had
 * nothing else to do meanwhile. Per block the arithmetic of lora_block_bf16, in the same order:
 * the same bits. Decode steps (in-process, the two builds swapped step by step, as
 * benchmarks/kernel_ab.py does; paired medians, 2-core Zen 5): 32 q,v adapters 0.33-0.50 ms a
 * step less in three runs, 32 all-module 1.01-1.29 ms less; in the FMA build, between its
 * blocks (linear.c). Not with AMX's spans, which that build keeps. */
int lora_passes_begin(LoRAPasses *p, const LoRACall *call, int64_t th, int64_t nt) {
    const LoRABinding *bound = call->bound;
    p->call = call, p->call_f32 = NULL;
    share_of(bound, th, nt, BF16_SHARE_BLOCK, &p->first, &p->last);
    p->next = p->first;
    p->blocks = p->shrunk = 0;
    for (int64_t t = p->first, later; t < p->last; t += block_at(bound, t, p->last, &later))
        p->blocks++;
    const int64_t numel = (p->last - p->first) * bound->modules * bound->r;
    p->v = thread_buffer(sizeof(float) * (size_t)numel);
    return p->blocks == 0 || p->v != NULL;
}
#endif

/* A float32 call's share in passes (linear_f32.c), each token a block: per token the arithmetic
 * of lora_thread_f32, in the same order, so the same bits. */
int lora_passes_begin_f32(LoRAPasses *p, const LoRACallF32 *call, int64_t th, int64_t nt) {
    p->call = NULL, p->call_f32 = call;
    share_of(call->bound, th, nt, F32_SHARE_BLOCK, &p->first, &p->last);
    p->next = p->first;
    p->blocks = p->last - p->first, p->shrunk = 0;
    const int64_t numel = p->blocks * call->bound->modules * call->bound->r;
    p->v = thread_buffer(sizeof(float) * (size_t)numel);
    return p->blocks == 0 || p->v != NULL;
}

/* The next block's shrinks, every module, into p->v */
void lora_shrink_next(LoRAPasses *p) {
    if (p->call_f32 != NULL) {
        const int64_t t = p->next, modules = p->call_f32->bound->modules, r = p->call_f32->bound->r;
        for (int64_t i = 0; i < modules; i++)
            token_shrink_f32(p->call_f32, t, i, p->v + ((t - p->first) * modules + i) * r);
        p->next++, p->shrunk++;
        return;
    }
#if !defined(HAVE_AMX)
    const LoRABinding *bound = p->call->bound;
    const int64_t t = p->next, s = bound->slots[t], modules = bound->modules, r = bound->r;
    int64_t later;
    const int T = block_at(bound, t, p->last, &later);
    float *out = p->v + (t - p->first) * modules * r;
    float v[LORA_BLOCK][MAX_RANK];
#define SHRINK_OF(T_)                                                                          \
    for (int64_t i = 0; i < modules; i++) {                                                    \
        module_shrink(p->call, i, t, T_, s, later, v);                                         \
        for (int b = 0; b < T_; b++)                                                           \
            memcpy(out + (b * modules + i) * r, v[b], sizeof(float) * (size_t)r);              \
    }
    FOR_BLOCK_SIZE(T, SHRINK_OF)
#undef SHRINK_OF
    p->next += T, p->shrunk++;
#endif
}

/* Every block's expands, from p->v (each block shrunk before) */
void lora_expands(LoRAPasses *p) {
    if (p->call_f32 != NULL) {
        const int64_t modules = p->call_f32->bound->modules, r = p->call_f32->bound->r;
        for (int64_t t = p->first; t < p->last; t++)
            for (int64_t i = 0; i < modules; i++)
                token_expand_f32(p->call_f32, t, i, p->v + ((t - p->first) * modules + i) * r);
        return;
    }
#if !defined(HAVE_AMX)
    const LoRABinding *bound = p->call->bound;
    const int64_t modules = bound->modules, r = bound->r;
    float v[LORA_BLOCK][MAX_RANK];
    for (int64_t t = p->first; t < p->last;) {
        const int64_t s = bound->slots[t];
        int64_t later;
        const int T = block_at(bound, t, p->last, &later);
        const float *in = p->v + (t - p->first) * modules * r;
#define EXPAND_OF(T_)                                                                          \
    for (int64_t i = 0; i < modules; i++) {                                                    \
        for (int b = 0; b < T_; b++)                                                           \
            memcpy(v[b], in + (b * modules + i) * r, sizeof(float) * (size_t)r);               \
        module_expand(p->call, i, t, T_, s, later, v);                                         \
    }
        FOR_BLOCK_SIZE(T, EXPAND_OF)
#undef EXPAND_OF
        t += T;
    }
#endif
}

int lora_apply_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride,
                    int64_t fin, const LoRABinding *bound) {
    if (bound->r > MAX_RANK || bound->modules > MAX_MODULES) return 1;
    const LoRACall call = {x, x_stride, y, y_stride, fin, bound, 0};
#pragma omp parallel num_threads((int)bound->num_threads)
    lora_thread_bf16(&call, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}
