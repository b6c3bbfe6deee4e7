#include "common.h"

/* A greedy step's picks without all of its float32 logits (cpu_screen.py): the tokens that the
 * float32 LM head (linear_f32.c) and the argmax after it would pick, found by screening every
 * token's logit in 8-bit integers and computing in float32 only those the screen cannot rule out.
 *
 * A logit is x . w_v (x a row of the final hidden states, w_v the token's row of the head). The
 * screen splits x into its SCREEN_OUTLIERS largest inputs (x_o) and the rest (x_r), quantizes
 * each by its own step (x~ = x~_r + x~_o, SCREEN_LEVELS steps a side) and each w_v by its own
 * (w~_v):
 *
 *     a_v = x~ . w~_v                             in integers, then scaled by the steps
 *     x . w_v - a_v = x . (w_v - w~_v) + (x - x~) . w~_v
 *     |x . w_v - a_v| <= |x| |w_v - w~_v| + |x - x~| |w~_v|       (Cauchy-Schwarz, 2-norms)
 *
 * and the float32 logit f_v differs from x . w_v by at most gamma_k |x| |w_v| (k products summed
 * in order, each rounded: gamma_k = k u / (1 - k u), u = 2^-24; taken twice). With B_v the sum
 * of those bounds, padded for the float32 arithmetic of a_v and B_v themselves, f_v lies within
 * a_v +- B_v: no token whose a_v + B_v falls below the largest a_u - B_u can be the argmax. The
 * rest (a few to about a hundred of SmolLM2's 49,152) are computed as the packed head computes
 * them, from the same weights in the same order (one FMA an input, from 0), so the pick and its
 * ties' first index are the full head's.
 *
 * Outliers: quantized with the rest, the row's largest input would set the step of all; SmolLM2's
 * final hidden states reach about 11 times their root mean square, and the screen then ruled out
 * nothing in most rows. Both operands keep 8 bits with vpmaddubsw taking |x~| against w~ with
 * x~'s signs (vpsignb): a pair of products stays within 2 * 127 * 127 and never saturates.
 *
 * With AVX512-VNNI (the wide tile) one vpdpbusd makes a group of 4 inputs' products of 16 tokens
 * and adds them: it takes unsigned bytes against signed ones, so x~_r's levels go in offset by
 * 128 (1 .. 255), and each token's sum starts from -128 times the sum of its levels, which that
 * offset adds; x~_o's few groups keep |x~_o| against w~ with x~_o's signs. Both ways the sums are
 * the same integers.
 *
 * Packed: the screen's weights in blocks of SCREEN_COLS tokens, each [k4 / 4][SCREEN_COLS][4]
 * (k4: k rounded up to 4), for each group of 4 inputs 4 bytes a token, 8 tokens a vector (16 in
 * the wide tile); meta [SCREEN_META][n_pad] float: each token's step, |w_v - w~_v|, |w~_v| and 2
 * gamma_k |w_v|, each rounded up, then (int32) -128 times the sum of w~_v's levels. */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SCREEN_WIDE 1
#define SCREEN_COLS 48 /* 3 vectors of 16 tokens */
#define SCREEN_ROWS 4  /* rows of x a tile takes at once */
#else
#define SCREEN_COLS 24 /* 3 vectors of 8 tokens */
#define SCREEN_ROWS 2
#endif
#define SCREEN_VECS 3
#define SCREEN_META 5
#define SCREEN_OUTLIERS 16
#define SCREEN_LEVELS 127

int64_t screen_columns(int64_t n) { return (n + SCREEN_COLS - 1) / SCREEN_COLS * SCREEN_COLS; }

static int64_t screen_k4(int64_t k) { return (k + 3) / 4 * 4; }

int64_t screen_packed_bytes(int64_t n, int64_t k) { return screen_columns(n) * screen_k4(k); }

int64_t screen_meta_floats(int64_t n) { return SCREEN_META * screen_columns(n); }

/* The floats of work a call on m rows takes: each token's a_v + B_v, each block's largest, and
 * room to align the first to 64 bytes */
int64_t screen_work_floats(int64_t m, int64_t n) {
    return m * (screen_columns(n) + screen_columns(n) / SCREEN_COLS) + 16;
}

static double rounded_up(double v) { return v * (1.0 + 1e-6) + 1e-30; }

/* gamma_k: the relative bound on a float32 sum of k products, one rounding each */
static double gamma_of(int64_t k) {
    const double u = ldexp(1.0, -24);
    return k * u / (1.0 - k * u);
}

/* v / step to the nearest level, within SCREEN_LEVELS a side */
static long level_of(float v, float step) {
    const long level = lrintf(v / step);
    return level > SCREEN_LEVELS ? SCREEN_LEVELS : level < -SCREEN_LEVELS ? -SCREEN_LEVELS : level;
}

/* w [n, k] float32 -> q (screen_packed_bytes) and meta; 1 where a weight is not finite */
int screen_pack_f32(const float *w, int64_t n, int64_t k, int8_t *q, float *meta) {
    const int64_t k4 = screen_k4(k), n_pad = screen_columns(n);
    const double gamma = gamma_of(k);
    for (int64_t v = 0; v < n_pad; v++) {
        const float *row = w + v * k;
        float top = 0.0f;
        for (int64_t p = 0; v < n && p < k; p++) {
            if (!isfinite(row[p])) return 1;
            top = fmaxf(top, fabsf(row[p]));
        }
        const float step = top > 0.0f ? top / SCREEN_LEVELS : 1.0f;
        double lost = 0.0, kept = 0.0, whole = 0.0;
        int32_t levels = 0;
        int8_t *block = q + v / SCREEN_COLS * SCREEN_COLS * k4;
        for (int64_t p = 0; p < k4; p++) {
            const long level = v < n && p < k ? level_of(row[p], step) : 0;
            if (v < n && p < k) {
                const double approx = (double)step * (double)level;
                lost += (row[p] - approx) * (row[p] - approx);
                kept += approx * approx;
                whole += (double)row[p] * row[p];
                levels += (int32_t)level;
            }
            block[p / 4 * SCREEN_COLS * 4 + v % SCREEN_COLS * 4 + p % 4] = (int8_t)level;
        }
        meta[v] = step;
        meta[n_pad + v] = (float)rounded_up(sqrt(lost));
        meta[2 * n_pad + v] = (float)rounded_up(sqrt(kept));
        meta[3 * n_pad + v] = (float)rounded_up(2.0 * gamma * sqrt(whole));
        const int32_t start = -128 * levels; /* int32 bits in a float's place */
        memcpy(meta + 4 * n_pad + v, &start, sizeof start);
    }
    return 0;
}

/* The largest |w_v| of a packed head, from meta's 2 gamma_k |w_v| (once, for screen_greedy_f32) */
float screen_weight_norm(const float *meta, int64_t n, int64_t k) {
    float top = 0.0f;
    for (int64_t v = 0; v < n; v++) top = fmaxf(top, meta[3 * screen_columns(n) + v]);
    return (float)(top / (2.0 * gamma_of(k)));
}

#if defined(__AVX2__) && defined(__FMA__)
int screen_native_f32(void) { return 1; }

#ifdef SCREEN_WIDE
int screen_wide(void) { return 1; }
#else
int screen_wide(void) { return 0; }
#endif

/* One row of x as the screen takes it: the steps of x~_r and x~_o, |x| and |x - x~|, and the
 * groups of 4 inputs holding x~_o (their index and 4 levels) */
typedef struct {
    float rest_step, outlier_step, norm, error_norm;
    int groups;
    int64_t group[SCREEN_OUTLIERS];
    int32_t levels[SCREEN_OUTLIERS];
} ScreenRow;

/* The indices of x's SCREEN_OUTLIERS largest inputs by magnitude (fewer where k is smaller) */
static int find_outliers(const float *x, int64_t k, int64_t *dims) {
    int count = 0;
    for (int64_t p = 0; p < k; p++) {
        const float a = fabsf(x[p]);
        if (count == SCREEN_OUTLIERS && a <= fabsf(x[dims[count - 1]])) continue;
        int at = count < SCREEN_OUTLIERS ? count++ : SCREEN_OUTLIERS - 1;
        for (; at > 0 && fabsf(x[dims[at - 1]]) < a; at--) dims[at] = dims[at - 1];
        dims[at] = p;
    }
    return count;
}

/* x [k] -> xq [k4] (x~_r's levels, offset by 128 in the wide tile) and its ScreenRow; 1 where x
 * is not all finite or so large that its logits might not be (w_norm: the largest |w_v|) */
static int screen_row(const float *x, int64_t k, float w_norm, int8_t *xq, ScreenRow *r) {
    int64_t dims[SCREEN_OUTLIERS];
    const int outliers = find_outliers(x, k, dims);
    char *outlier = calloc(k, 1);
    if (outlier == NULL) return 1;
    double whole = 0.0, error = 0.0;
    float rest_top = 0.0f, outlier_top = 0.0f;
    for (int i = 0; i < outliers; i++) outlier[dims[i]] = 1;
    for (int64_t p = 0; p < k; p++) {
        whole += (double)x[p] * x[p];
        if (outlier[p]) outlier_top = fmaxf(outlier_top, fabsf(x[p]));
        else rest_top = fmaxf(rest_top, fabsf(x[p]));
    }
    r->rest_step = rest_top > 0.0f ? rest_top / SCREEN_LEVELS : 1.0f;
    r->outlier_step = outlier_top > 0.0f ? outlier_top / SCREEN_LEVELS : 1.0f;
    r->groups = 0;
    for (int64_t p = 0; p < screen_k4(k); p++) {
        const int is_outlier = p < k && outlier[p];
        const float v = p < k ? x[p] : 0.0f, step = is_outlier ? r->outlier_step : r->rest_step;
        const long level = level_of(v, step);
        const double left = v - (double)step * (double)level;
        error += left * left;
#ifdef SCREEN_WIDE
        xq[p] = (int8_t)(uint8_t)((is_outlier ? 0 : level) + 128);
#else
        xq[p] = is_outlier ? 0 : (int8_t)level;
#endif
        if (!is_outlier) continue;
        if (r->groups == 0 || r->group[r->groups - 1] != p / 4)
            r->group[r->groups] = p / 4, r->levels[r->groups++] = 0;
        uint8_t *bytes = (uint8_t *)&r->levels[r->groups - 1];
        bytes[p % 4] = (uint8_t)(int8_t)level;
    }
    free(outlier);
    r->norm = (float)rounded_up(sqrt(whole));
    r->error_norm = (float)rounded_up(sqrt(error));
    /* |x . w_v| <= |x| |w_v|: logits and bounds finite with room to spare (false where x is not
     * finite: neither is its norm) */
    return !((double)r->norm * w_norm < 1e36);
}

/* A screen's arguments and the state its threads share */
typedef struct {
    const float *x;
    int64_t x_stride, m, k, k4, n, n_pad;
    const int8_t *q;
    const float *meta;
    const float *weight; /* the float32 head's rows [n, k] */
    int64_t budget;
    const int8_t *xq;
    const ScreenRow *rows;
    float *high;       /* [m][n_pad]: each token's a_v + B_v */
    float *block_high; /* [m][n_pad / SCREEN_COLS]: the largest of a block's */
    float *low;        /* [threads][m]: each thread's largest a_v - B_v a row */
    float *best;       /* [threads][m]: each thread's best float32 logit a row */
    int64_t *picked;   /* [threads][m]: its token */
    int declined;
} Screen;

/* a_v + B_v of 8 tokens from v, returned; a_v - B_v into low_max; rest and outlier: their
 * integer dot products */
static inline __m256 screen_bounds(const Screen *s, const ScreenRow *row, int64_t v, __m256i rest,
                                   __m256i outlier, __m256 *low_max) {
    const float *meta = s->meta + v;
    const __m256 rests = _mm256_mul_ps(_mm256_cvtepi32_ps(rest), _mm256_set1_ps(row->rest_step));
    const __m256 x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(outlier),
                                     _mm256_set1_ps(row->outlier_step), rests);
    const __m256 a = _mm256_mul_ps(x, _mm256_loadu_ps(meta));
    const __m256 norm = _mm256_set1_ps(row->norm);
    __m256 bound = _mm256_mul_ps(norm, _mm256_loadu_ps(meta + 3 * s->n_pad));
    bound = _mm256_fmadd_ps(_mm256_set1_ps(row->error_norm), _mm256_loadu_ps(meta + 2 * s->n_pad),
                            bound);
    bound = _mm256_fmadd_ps(norm, _mm256_loadu_ps(meta + s->n_pad), bound);
    /* float32's rounding in a_v (its two parts' conversions and steps, up to u |x~_r . w~_v|
     * and u |x~_o . w~_v| where they cancel) lies within the second gamma_k |x| |w_v| of
     * meta's fourth row: that factor 2 is load-bearing. B_v's own, and a_v +- B_v's, within
     * 2^-10 of B_v and 2^-16 of (|a_v| + 1). */
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 magnitude = _mm256_add_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a), one);
    bound = _mm256_fmadd_ps(bound, _mm256_set1_ps(1.0f + 1.0f / 1024),
                            _mm256_mul_ps(magnitude, _mm256_set1_ps(1.0f / 65536)));
    /* tokens past n take no part */
    const __m256i lanes = _mm256_add_epi32(_mm256_set1_epi32((int)v),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 real =
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)s->n), lanes));
    const __m256 none = _mm256_set1_ps(-INFINITY);
    const __m256 top = _mm256_blendv_ps(none, _mm256_add_ps(a, bound), real);
    *low_max = _mm256_max_ps(*low_max, _mm256_blendv_ps(none, _mm256_sub_ps(a, bound), real));
    return top;
}

#ifdef SCREEN_WIDE
/* Half h of 16 lanes */
static inline __m256i half_of(__m512i v, int h) {
    return h == 0 ? _mm512_castsi512_si256(v) : _mm512_extracti64x4_epi64(v, 1);
}

/* Rows i .. i + rows (1 to SCREEN_ROWS) of block b: each token's a_v + B_v into `high` (the
 * largest into block_high), the largest a_v - B_v of each row into lows */
static inline __attribute__((always_inline)) void screen_tile(const Screen *s, int64_t b,
                                                              int64_t i, const int rows,
                                                              float *lows) {
    const int8_t *block = s->q + b * SCREEN_COLS * s->k4;
    const int32_t *start = (const int32_t *)(s->meta + 4 * s->n_pad) + b * SCREEN_COLS;
    __m512i rest[SCREEN_ROWS][SCREEN_VECS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < SCREEN_VECS; c++) rest[r][c] = _mm512_loadu_si512(start + c * 16);
    for (int64_t g = 0; g < s->k4 / 4; g++) {
        const __m512i *wg = (const __m512i *)(block + g * SCREEN_COLS * 4);
        __m512i w[SCREEN_VECS];
        for (int c = 0; c < SCREEN_VECS; c++) w[c] = _mm512_loadu_si512(wg + c);
        for (int r = 0; r < rows; r++) {
            int32_t levels; /* x~_r's 4 levels, offset by 128 */
            memcpy(&levels, s->xq + (i + r) * s->k4 + g * 4, 4);
            const __m512i four = _mm512_set1_epi32(levels);
            for (int c = 0; c < SCREEN_VECS; c++)
                rest[r][c] = _mm512_dpbusd_epi32(rest[r][c], four, w[c]);
        }
    }
    for (int r = 0; r < rows; r++) {
        const ScreenRow *row = s->rows + i + r;
        __m512i outlier[SCREEN_VECS];
        for (int c = 0; c < SCREEN_VECS; c++) outlier[c] = _mm512_setzero_si512();
        for (int o = 0; o < row->groups; o++) { /* the block is in L1 still */
            const __m512i *wg = (const __m512i *)(block + row->group[o] * SCREEN_COLS * 4);
            const __m512i four = _mm512_set1_epi32(row->levels[o]);
            const __m512i magnitude = _mm512_abs_epi8(four);
            const __mmask64 negative = _mm512_movepi8_mask(four);
            for (int c = 0; c < SCREEN_VECS; c++) {
                const __m512i w = _mm512_loadu_si512(wg + c);
                const __m512i zero = _mm512_setzero_si512();
                const __m512i signed_w = _mm512_mask_sub_epi8(w, negative, zero, w);
                outlier[c] = _mm512_dpbusd_epi32(outlier[c], magnitude, signed_w);
            }
        }
        __m256 top = _mm256_set1_ps(-INFINITY), low_max = _mm256_set1_ps(-INFINITY);
        for (int c = 0; c < SCREEN_VECS; c++)
            for (int h = 0; h < 2; h++) {
                const int64_t v = b * SCREEN_COLS + c * 16 + h * 8;
                const __m256 tops = screen_bounds(s, row, v, half_of(rest[r][c], h),
                                                  half_of(outlier[c], h), &low_max);
                /* past the caches: only the blocks that reach a row's floor are read again */
                _mm256_stream_ps(s->high + (i + r) * s->n_pad + v, tops);
                top = _mm256_max_ps(top, tops);
            }
        s->block_high[(i + r) * (s->n_pad / SCREEN_COLS) + b] = hmax8(top);
        lows[r] = hmax8(low_max);
    }
}
#else
/* sum += the 4-input dot products of x~'s four levels `four` (broadcast) with each of 8 tokens
 * of w: |x~| against w~ with x~'s signs, in pairs (never saturating), then in fours */
static inline __m256i dot_fours(__m256i sum, __m256i four, __m256i magnitude, __m256i w) {
    const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w, four));
    return _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* Rows i .. i + rows (1 to SCREEN_ROWS) of block b: each token's a_v + B_v into `high` (the
 * largest into block_high), the largest a_v - B_v of each row into lows */
static inline __attribute__((always_inline)) void screen_tile(const Screen *s, int64_t b,
                                                              int64_t i, const int rows,
                                                              float *lows) {
    const int8_t *block = s->q + b * SCREEN_COLS * s->k4;
    __m256i rest[SCREEN_ROWS][SCREEN_VECS];
    for (int r = 0; r < SCREEN_ROWS; r++)
        for (int c = 0; c < SCREEN_VECS; c++) rest[r][c] = _mm256_setzero_si256();
    for (int64_t g = 0; g < s->k4 / 4; g++) {
        const __m256i *wg = (const __m256i *)(block + g * SCREEN_COLS * 4);
        for (int r = 0; r < rows; r++) {
            int32_t levels;
            memcpy(&levels, s->xq + (i + r) * s->k4 + g * 4, 4);
            const __m256i four = _mm256_set1_epi32(levels), magnitude = _mm256_abs_epi8(four);
            for (int c = 0; c < SCREEN_VECS; c++)
                rest[r][c] = dot_fours(rest[r][c], four, magnitude, _mm256_loadu_si256(wg + c));
        }
    }
    for (int r = 0; r < rows; r++) {
        const ScreenRow *row = s->rows + i + r;
        __m256i outlier[SCREEN_VECS];
        for (int c = 0; c < SCREEN_VECS; c++) outlier[c] = _mm256_setzero_si256();
        for (int o = 0; o < row->groups; o++) { /* the block is in L1 still */
            const __m256i *wg = (const __m256i *)(block + row->group[o] * SCREEN_COLS * 4);
            const __m256i four = _mm256_set1_epi32(row->levels[o]);
            const __m256i magnitude = _mm256_abs_epi8(four);
            for (int c = 0; c < SCREEN_VECS; c++)
                outlier[c] = dot_fours(outlier[c], four, magnitude, _mm256_loadu_si256(wg + c));
        }
        __m256 top = _mm256_set1_ps(-INFINITY), low_max = _mm256_set1_ps(-INFINITY);
        for (int c = 0; c < SCREEN_VECS; c++) {
            const int64_t v = b * SCREEN_COLS + c * 8;
            const __m256 tops = screen_bounds(s, row, v, rest[r][c], outlier[c], &low_max);
            _mm256_storeu_ps(s->high + (i + r) * s->n_pad + v, tops);
            top = _mm256_max_ps(top, tops);
        }
        s->block_high[(i + r) * (s->n_pad / SCREEN_COLS) + b] = hmax8(top);
        lows[r] = hmax8(low_max);
    }
}
#endif

/* screen_tile with the number of rows known to the compiler */
static void screen_tiles(const Screen *s, int64_t b, int64_t i, int rows, float *lows) {
    switch (rows) {
#if SCREEN_ROWS > 2
    case 4: screen_tile(s, b, i, 4, lows); break;
    case 3: screen_tile(s, b, i, 3, lows); break;
#endif
    case 2: screen_tile(s, b, i, 2, lows); break;
    default: screen_tile(s, b, i, 1, lows);
    }
}

/* The float32 logits of up to 8 tokens (count) for x, as the packed head computes them (one
 * FMA an input, from 0) */
static void head_logits(const Screen *s, const float *x, const int64_t *tokens, int count,
                        float *out) {
    int32_t at[8];
    for (int l = 0; l < 8; l++) at[l] = (int32_t)(tokens[l < count ? l : 0] * s->k);
    __m256i index = _mm256_loadu_si256((const __m256i *)at);
    const __m256i next = _mm256_set1_epi32(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t p = 0; p < s->k; p++, index = _mm256_add_epi32(index, next))
        acc = _mm256_fmadd_ps(_mm256_set1_ps(x[p]), _mm256_i32gather_ps(s->weight, index, 4), acc);
    float sums[8];
    _mm256_storeu_ps(sums, acc);
    for (int l = 0; l < count; l++) out[l] = sums[l];
}

/* A thread's candidates of one row, computed 8 at a time in ascending order: the best so far
 * (ties keep the first) and the logits spent */
typedef struct {
    int64_t tokens[8], pick, spent;
    int count;
    float best;
} Candidates;

/* The candidates taken so far computed; 0, or 1 where the thread has spent its budget or
 * another thread declined */
static int take_candidates(Screen *s, const float *x, Candidates *c) {
    if ((c->spent += c->count) > s->budget || __atomic_load_n(&s->declined, __ATOMIC_RELAXED)) {
        __atomic_store_n(&s->declined, 1, __ATOMIC_RELAXED); /* the caller runs the head */
        return 1;
    }
    float logits[8];
    head_logits(s, x, c->tokens, c->count, logits);
    for (int l = 0; l < c->count; l++)
        if (c->pick < 0 || logits[l] > c->best) c->best = logits[l], c->pick = c->tokens[l];
    c->count = 0;
    return 0;
}

/* Thread t of nt: its blocks' screen; then, all threads' lows known, the float32 logits of its
 * candidates (in the blocks whose largest a_v + B_v reaches the row's floor), the best of each
 * row into best and picked (-1 where it had none) */
static void screen_thread(Screen *s, int64_t t, int64_t nt) {
    const int64_t blocks = s->n_pad / SCREEN_COLS;
    const int64_t first = blocks * t / nt, last = blocks * (t + 1) / nt;
    float *low = s->low + t * s->m;
    for (int64_t i = 0; i < s->m; i++) low[i] = -INFINITY;
    for (int64_t b = first; b < last; b++)
        for (int64_t i = 0; i < s->m; i += SCREEN_ROWS) {
            const int rows = s->m - i < SCREEN_ROWS ? (int)(s->m - i) : SCREEN_ROWS;
            float lows[SCREEN_ROWS];
            screen_tiles(s, b, i, rows, lows);
            for (int r = 0; r < rows; r++) low[i + r] = fmaxf(low[i + r], lows[r]);
        }
#ifdef SCREEN_WIDE
    /* the streamed a_v + B_v: only this thread reads them again, which x86 orders for it
     * anyway; fenced all the same before the barrier */
    _mm_sfence();
#endif
#pragma omp barrier
    Candidates c = {.spent = 0};
    for (int64_t i = 0; i < s->m; i++) {
        float floor = -INFINITY;
        for (int64_t u = 0; u < nt; u++) floor = fmaxf(floor, s->low[u * s->m + i]);
        if (!isfinite(floor)) { /* an a_v - B_v overflowed: screen_row should have declined */
            __atomic_store_n(&s->declined, 1, __ATOMIC_RELAXED);
            return;
        }
        const float *high = s->high + i * s->n_pad, *block_high = s->block_high + i * blocks;
        const float *x = s->x + i * s->x_stride;
        c.pick = -1, c.count = 0, c.best = -INFINITY;
        for (int64_t b = first; b < last; b++) {
            if (block_high[b] < floor) continue;
            for (int64_t v = b * SCREEN_COLS; v < (b + 1) * SCREEN_COLS && v < s->n; v++) {
                if (high[v] < floor) continue;
                c.tokens[c.count++] = v;
                if (c.count == 8 && take_candidates(s, x, &c)) return;
            }
        }
        if (c.count > 0 && take_candidates(s, x, &c)) return;
        s->best[t * s->m + i] = c.best;
        s->picked[t * s->m + i] = c.pick;
    }
}

/* x [m, k] (rows x_stride apart) -> out [m], each row's greedy token; 0, or 1 where it
 * declines (a row of x not finite, more than `budget` float32 logits for a thread to compute,
 * no memory): out is then not written. weight: the float32 head's rows [n, k]; q and meta:
 * theirs packed by screen_pack_f32, w_norm their screen_weight_norm; work:
 * screen_work_floats(m, n) floats. */
int screen_greedy_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const int8_t *q,
                      const float *meta, float w_norm, const float *weight, int64_t n,
                      int64_t budget, float *work, int64_t *out, int num_threads) {
    if (m <= 0) return 1;
    const int64_t k4 = screen_k4(k), n_pad = screen_columns(n);
    int8_t *xq = malloc(m * k4);
    ScreenRow *rows = malloc(m * sizeof(ScreenRow));
    float *shared = malloc(2 * (size_t)num_threads * m * sizeof(float));
    int64_t *picked = malloc((size_t)num_threads * m * sizeof(int64_t));
    int status = xq == NULL || rows == NULL || shared == NULL || picked == NULL;
    for (int64_t i = 0; i < m && !status; i++)
        status = screen_row(x + i * x_stride, k, w_norm, xq + i * k4, rows + i);
    work = (float *)(((uintptr_t)work + 63) & ~(uintptr_t)63); /* for the wide tile's stores */
    if (!status) {
        Screen s = {x, x_stride, m, k, k4, n, n_pad, q, meta, weight, budget, xq, rows, work,
                    work + m * n_pad, shared, shared + (size_t)num_threads * m, picked, 0};
        int threads = num_threads;
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp single nowait
            threads = omp_get_num_threads();
            screen_thread(&s, omp_get_thread_num(), omp_get_num_threads());
        }
        status = s.declined;
        for (int64_t i = 0; i < m && !status; i++) {
            float best = -INFINITY;
            out[i] = -1;
            for (int t = 0; t < threads; t++) /* the threads' tokens in order: ties keep first */
                if (picked[t * m + i] >= 0 && (out[i] < 0 || s.best[t * m + i] > best))
                    best = s.best[t * m + i], out[i] = picked[t * m + i];
        }
    }
    free(xq), free(rows), free(shared), free(picked);
    return status;
}
#else
/* Without AVX2 and FMA there is no screen: cpu_screen binds only these there. */
int screen_native_f32(void) { return 0; }
int screen_wide(void) { return 0; }
#endif
