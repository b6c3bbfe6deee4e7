#include "linear.h"

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
 * 10% of the rate at which the cores' prefetches alone bring W in.
 *
 * Larger batches (prompt chunks) take the same blocks 32 rows at a time, so this takes every
 * product and oneDNN keeps no copy of W (SmolLM2 resident: 3,265 -> 2,978 MiB). On a 2-core Xeon
 * with AMX (family 6, model 167 as its hypervisor shows it), SmolLM2's four projections of 30
 * layers of distinct weights took 0.80-0.84x oneDNN's time (its AMX kernels) at 33-64 rows and
 * 0.90-1.07x at 100-256 rows, about 1.25 TFLOP/s at 256 (benchmarks/prompt_projection.py); a
 * prefill of 16 prompts of 256 tokens 0.95x. One kernel for every batch also makes a row's
 * product the same bits in any batch. */
/* The tiles, by number (the intrinsics take literal numbers): 0, 1 x's rows 0-15 and 16-31; 2, 3
 * W's columns 0-15 and 16-31; 4, 5 the sums of rows 0-15 (columns 0-15, 16-31); 6, 7 of rows
 * 16-31. */

int linear_native_bf16(void) { return amx_granted(); }
int linear_any_rows_bf16(void) { return 1; }
/* Whether linear_bf16 takes memory ranges to fetch: not with AMX, whose products are bound by
 * memory, as the LoRA call's rows are (fetching them during the products slows these by more
 * than it speeds the LoRA call: 11.5 ms against 4.9 ms a step of 32 all-module adapters; on 32
 * q,v adapters +1.24 ms a step fetched by the q,k,v projection, +0.75 ms its A rows alone,
 * +1.53 ms by the layer before's gate_up, on a 2-core Xeon of model 207). */
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

/* The tiles shaped for `rows` (1 to 32) rows of x */
static void configure_rows(int rows) {
    const int low = rows < 16 ? rows : 16, high = rows - low;
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    set_tile(&config, 0, low, 64), set_tile(&config, 1, high, 64);
    set_tile(&config, 2, 16, 64), set_tile(&config, 3, 16, 64);
    set_tile(&config, 4, low, 64), set_tile(&config, 5, low, 64);
    set_tile(&config, 6, high, 64), set_tile(&config, 7, high, 64);
    _tile_loadconfig(&config);
}

/* Rows row .. row + rows (at most 32) of block b, the tiles shaped for them; W's next lines
 * fetched meanwhile (the block's later row groups find them in cache) */
static void amx_group(const LinearCall *call, int64_t b, int64_t row, int rows) {
    const int64_t x_stride = call->x_stride, k = call->k, n = call->n, steps = k / 32;
    const uint16_t *x = call->x + row * x_stride;
    const int high = rows > 16 ? rows - 16 : 0;
    const int64_t x_bytes = x_stride * 2, step_bytes = 16 * LINEAR_COLS * 2 * 2;
    const uint16_t *w = call->packed + b * LINEAR_COLS * k;
    float sums[32 * 32];
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
    if (k % 32) tail_pairs(sums, rows, x, x_stride, w, steps * 16, k % 32 / 2);
    const int64_t col = b * LINEAR_COLS;
    for (int c = 0; c < 2 && col + c * 16 < n; c++) {
        const __mmask16 mask = tail_mask(n - col - c * 16);
        const __m512 bv =
            call->bias != NULL ? bf16x16(call->bias + col + c * 16, mask) : _mm512_setzero_ps();
        for (int64_t i = 0; i < rows; i++)
            store_bf16x16(call->y + (row + i) * call->y_stride + col + c * 16, mask,
                          _mm512_add_ps(_mm512_loadu_ps(sums + i * 32 + c * 16), bv));
    }
}

/* Thread th of nt's share of a projection: its run of the blocks, split evenly, each block's
 * rows 32 at a time (the block, 32 columns of k, stays in L1 for its later groups), the tiles
 * shaped again only where the rows of a group change (a batch's last group). */
static void linear_thread_amx(const LinearCall *call, int64_t th, int64_t nt) {
    const int64_t m = call->m, blocks = (call->n + LINEAR_COLS - 1) / LINEAR_COLS;
    const int64_t first = blocks * th / nt, last = blocks * (th + 1) / nt;
    if (first == last) return;
    int shaped = 0; /* the rows the tiles are shaped for */
    for (int64_t b = first; b < last; b++)
        for (int64_t row = 0; row < m; row += 32) {
            const int rows = m - row < 32 ? (int)(m - row) : 32;
            if (rows != shaped) configure_rows(rows), shaped = rows;
            amx_group(call, b, row, rows);
        }
    _tile_release();
}

/* 1 if the call does not fit (k odd, or fetches: linear_fetches_bf16), 2 without the tiles,
 * else 0. */
static int linear_refuses(const LinearCall *call) {
    if (call->k % 2 != 0 || call->fetches > 0) return 1;
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
/* Whether the projection is the faster one for any number of rows, not for decode steps only,
 * as far as the build can tell: in the FMA build, where oneDNN's bfloat16 kernels take the slow
 * vdpbf16ps (below). The vdpbf16ps build is also faster for any number of rows on Zen 4 but not
 * on Zen 5, a choice by CPU model that cpu_lora.CpuLinearBf16 adds (zen4_bf16). */
#if defined(BF16_BY_FMA)
int linear_any_rows_bf16(void) { return 1; }
#else
int linear_any_rows_bf16(void) { return 0; }
#endif

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

#define LINEAR_SHRINKS /* linear_thread_shrinking: the projection with the LoRA call's shrinks */
#if defined(BF16_BY_FMA)
/* Where vdpbf16ps runs at half the rate of float32 FMAs (Intel's cores without AMX): W's
 * bfloat16 widened to float32, FMA_CHUNK input pairs of a block at a time, into a buffer L1
 * holds; then each tile of LINEAR_ROWS rows takes that chunk through FMAs, its 6 x 4 sums in
 * registers over the chunk and in `sums` [rows][LINEAR_COLS] between chunks. The widening is
 * paid once a chunk for up to FMA_GROUP rows, where a tile that widened its own W (the vdpbf16ps
 * tile's shape) spent one instruction in five on it. On a 2-core Xeon (family 6, model 207), products of SmolLM2's
 * shapes at 270-390 GFLOP/s, decode steps' 32 rows at the low end (oneDNN's bfloat16 kernels
 * 160-220, its float32 270-410). */
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
            acc[i][c] =
                first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + i * LINEAR_COLS + c * 16);
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
        for (int c = 0; c < 6; c++) _mm512_storeu_ps(sums + i * LINEAR_COLS + c * 16, acc[i][c]);
}

/* Rows row .. row + rows (at most FMA_GROUP) of block b; the thread's next block brought into
 * cache (*fetch .. fetch_end) `pace` lines a step of a tile meanwhile. */
static void fma_group(const LinearCall *call, int64_t b, int64_t row, int64_t rows,
                      const char **fetch, const char *fetch_end, int64_t pace, Ranges *extra) {
    const int64_t k = call->k, pairs = k / 2, col = b * LINEAR_COLS;
    const uint16_t *block = call->packed + b * LINEAR_COLS * k;
    float wf[FMA_CHUNK * 12 * 16] __attribute__((aligned(64)));
    float sums[FMA_GROUP * LINEAR_COLS];
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
    fma_tile(xr, call->x_stride, R_, chunk, wf, sums + i * LINEAR_COLS, p0 == 0, fetch, fetch_end, \
             pace, extra)
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
                          _mm512_add_ps(_mm512_loadu_ps(sums + i * LINEAR_COLS + c * 16), bv));
    }
}

/* Thread t of nt's share of a projection: its run of the blocks, split evenly, every row of
 * each; the fetches as in the vdpbf16ps build's (below). With `lora`, its shrinks between its
 * blocks, a block behind shrinks_due's pace, so that they read the A rows fetched during the
 * block before. On a 2-core Xeon (family 6, model 207), against the call made whole after the
 * projection (benchmarks/kernel_ab.py, extra over base a decode step): 32 all-module adapters
 * -1.10 ms (-0.53 ms at shrinks_due's own pace), 32 q,v adapters -0.22 and +0.07 ms (+0.23 ms at
 * its own pace). */
static void linear_thread_shrinking(const LinearCall *call, int64_t t, int64_t nt,
                                    LoRAPasses *lora) {
    const int64_t k = call->k, m = call->m, blocks = (call->n + LINEAR_COLS - 1) / LINEAR_COLS;
    const int64_t tiles = (m + LINEAR_ROWS - 1) / LINEAR_ROWS;
    const int64_t block_numel = LINEAR_COLS * k, block_lines = block_numel * 2 / 64;
    const int64_t steps = tiles * (k / 2), pace = (block_lines + steps - 1) / steps;
    const int64_t first = blocks * t / nt, last = blocks * (t + 1) / nt;
    Ranges extra = call_ranges(call->fetch_at, call->fetch_bytes, call->fetches, lora, t, nt,
                               (last - first) * steps);
    for (int64_t b = first; b < last; b++) {
        const char *next = (const char *)(call->packed + (b + 1) * block_numel);
        const char *fetch = b + 1 < last ? next : NULL;
        const char *fetch_end = b + 1 < last ? next + block_numel * 2 : NULL;
        for (int64_t row = 0; row < m; row += FMA_GROUP)
            fma_group(call, b, row, m - row < FMA_GROUP ? m - row : FMA_GROUP, &fetch, fetch_end,
                      pace, &extra);
        shrinks_due(lora, b - first, last - first);
    }
    shrinks_due(lora, 0, 0);
}
#else
/* Thread th of nt's share of a projection. Work is (block, tile of rows) items in block order,
 * split evenly between the threads, so each thread reads its run of blocks once from memory (a
 * block stays in L2 across its row tiles).
 *
 * The call's fetch ranges are split between the threads, each taking the rows of the LoRA
 * tokens it takes (call_ranges, linear.h; by count without a LoRA call of its own), and spread
 * over each thread's work. The engine passes the adapter rows of the LoRA call that follows, in
 * the order of its tokens: a decode step's dense products are bound by arithmetic and leave most
 * of the memory bandwidth unused, and the LoRA kernel, which is bound by memory, then finds its
 * rows in cache.
 *
 * With `lora` (the fused call's LoRA in two passes, lora.c), the thread's shrinks go between
 * the items of the second half of its work, twice as fast as its items go: spread over all of
 * them, a token's shrink came just as the fetch ranges' even pace was bringing its A rows in,
 * and waited on them. On a 2-core Zen 4 (family 25, model 17), benchmarks/kernel_ab.py, extra
 * over base a decode step: 32 all-module adapters -0.85 and -0.79 ms (of 8.7-9.7), 32 q,v
 * adapters -0.22 and -0.17 ms (of 1.9-2.3); starting a quarter or three quarters in measured
 * as the half does in a call's own timing (30 layers of q,k,v with a q,v call, rows fetched
 * during the projection: 54-55 against 65 us over the projection alone). */
static void linear_thread_shrinking(const LinearCall *call, int64_t t, int64_t nt,
                                    LoRAPasses *lora) {
    const int64_t x_stride = call->x_stride, y_stride = call->y_stride, k = call->k;
    const Items s = thread_items(call->m, call->n, LINEAR_COLS, LINEAR_ROWS, k / 2, call->packed,
                                 LINEAR_COLS * k * 2, t, nt);
    Ranges extra = call_ranges(call->fetch_at, call->fetch_bytes, call->fetches, lora, t, nt,
                               (s.last - s.first) * s.steps);
    for (int64_t item = s.first; item < s.last; item++) {
        const Item it = item_at(&s, item);
        const uint16_t *xr = call->x + it.row * x_stride;
        const uint16_t *block = call->packed + it.block * LINEAR_COLS * k;
        const uint16_t *bias = call->bias != NULL ? call->bias + it.col : NULL;
        uint16_t *yr = call->y + it.row * y_stride + it.col;
#define TILE_OF(R_)                                                                            \
    linear_tile(xr, x_stride, R_, k, block, bias, yr, y_stride, it.cols, it.from, it.to, s.pace, \
                &extra)
        switch (it.rows) { /* the tile specialised for each row count */
        case 4: TILE_OF(4); break;
        case 3: TILE_OF(3); break;
        case 2: TILE_OF(2); break;
        default: TILE_OF(1);
        }
#undef TILE_OF
        shrinks_after(lora, &s, item);
    }
    shrinks_due(lora, 0, 0);
}
#endif /* BF16_BY_FMA */

static void linear_thread(const LinearCall *call, int64_t t, int64_t nt) {
    linear_thread_shrinking(call, t, nt, NULL);
}

static int linear_refuses(const LinearCall *call) { return call->k % 2 != 0; }

/* no more threads than work items (a narrow product of a few rows on one) */
static int linear_threads(const LinearCall *call, int num_threads) {
#if defined(BF16_BY_FMA)
    const int64_t tile_rows = call->m > 0 ? call->m : 1; /* a block's every row is one item */
#else
    const int64_t tile_rows = LINEAR_ROWS;
#endif
    return item_threads(call->m, call->n, LINEAR_COLS, tile_rows, num_threads);
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

/* The projection x -> y (its fetch ranges brought into cache meanwhile) and then the LoRA call
 * `bound` on (x, y), in one parallel region, the threads meeting between the two; wherever
 * linear_bf16 runs. Apart, a decode step's projection and the LoRA call after it each cost a
 * ctypes call and an OpenMP region of their own, about 6 us, 120 times a step of all-module
 * adapters. */
int linear_lora_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                     const uint16_t *packed, int64_t n, const uint16_t *bias, uint16_t *y,
                     int64_t y_stride, const int64_t *fetch_at, const int64_t *fetch_bytes,
                     int64_t fetches, const LoRABinding *bound) {
    const LinearCall linear = {x, x_stride, m, k, packed, n, bias, y, y_stride,
                               fetch_at, fetch_bytes, fetches};
    const int refused = linear_refuses(&linear);
    if (refused) return refused;
    if (bound->r > MAX_RANK || bound->modules > MAX_MODULES) return 1;
    if (m <= 0 || n <= 0) return 0; /* no rows or columns: nothing to do (nor any LoRA rows) */
    /* its rows fetched, where it matters (lora.c: ROW_BY_ROW), by this projection or the gate_up
     * before it (model.py) */
    const LoRACall lora = {x, x_stride, y, y_stride, k, bound, 1};
#pragma omp parallel num_threads((int)bound->num_threads)
    {
        const int64_t th = omp_get_thread_num(), nt = omp_get_num_threads();
#if defined(LINEAR_SHRINKS)
        LoRAPasses passes;
        const int split = lora_passes_begin(&passes, &lora, th, nt);
        linear_thread_shrinking(&linear, th, nt, split ? &passes : NULL);
#pragma omp barrier
        if (split)
            lora_expands(&passes);
        else
            lora_thread_bf16(&lora, th, nt);
#else
        linear_thread(&linear, th, nt);
#pragma omp barrier
        lora_thread_bf16(&lora, th, nt);
#endif
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

/* refused as linear_bf16 is: no bfloat16 projection in this build (layers.c calls it) */
int linear_lora_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                     const uint16_t *packed, int64_t n, const uint16_t *bias, uint16_t *y,
                     int64_t y_stride, const int64_t *fetch_at, const int64_t *fetch_bytes,
                     int64_t fetches, const LoRABinding *bound) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y;
    (void)y_stride, (void)fetch_at, (void)fetch_bytes, (void)fetches, (void)bound;
    return 2;
}
#endif
