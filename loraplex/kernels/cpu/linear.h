/* What the native projections share (linear.c: bfloat16, linear_f32.c: float32): the memory
 * ranges a thread brings into cache while it computes, the adapter rows of the LoRA call made
 * after the projection in the same native call; and that call's shrinks between its items. */
#ifndef LORAPLEX_CPU_LINEAR_H
#define LORAPLEX_CPU_LINEAR_H
#include "lora.h"

/* Memory ranges a thread brings into cache while it computes, evenly over its steps of k: the
 * rows of the adapters the next LoRA call reads (see linear_bf16, linear_f32). The pace is in
 * 1/PACE_ONE lines a step, so that a range no larger than the work is spread over all of it: a
 * whole line a step at least issued 1 MB of rows in the first 44% of a 32-row gate_up
 * projection of SmolLM2, and the projection slowed where the reads bunched. */
#define PACE_ONE 65536
typedef struct {
    const int64_t *at, *bytes; /* each range's address and length */
    int64_t next, end;         /* the thread's ranges left: next .. end */
    int64_t offset;            /* within range `next` */
    int64_t pace, credit;      /* lines a step, and lines due, in 1/PACE_ONE */
} Ranges;

static inline void fetch_ranges(Ranges *r) {
    for (r->credit += r->pace; r->credit >= PACE_ONE && r->next < r->end; r->credit -= PACE_ONE) {
        __builtin_prefetch((const char *)r->at[r->next] + r->offset, 0, 2);
        r->offset += 64;
        if (r->offset >= r->bytes[r->next]) r->offset = 0, r->next++;
    }
}

/* Ranges next .. end of at and bytes, spread over `steps` steps of the thread's work. */
static inline Ranges ranges_between(const int64_t *at, const int64_t *bytes, int64_t next,
                                    int64_t end, int64_t steps) {
    Ranges r = {at, bytes, next, end, 0, 0, 0};
    int64_t lines = 0;
    for (int64_t i = r.next; i < r.end; i++) lines += (bytes[i] + 63) / 64;
    r.pace = steps > 0 ? (lines * PACE_ONE + steps - 1) / steps : 0;
    return r;
}

/* The thread's share of `fetches` ranges (split in order, as evenly as their count), spread
 * over `steps` steps of its work. */
static inline Ranges thread_ranges(const int64_t *at, const int64_t *bytes, int64_t fetches,
                                   int64_t t, int64_t nt, int64_t steps) {
    return ranges_between(at, bytes, fetches * t / nt, fetches * (t + 1) / nt, steps);
}

/* The run of a call's slots (runs 0, 1, ... in order) that begins at or after token t */
static inline int64_t run_from(const LoRABinding *b, int64_t t) {
    const int64_t n = b->end - b->start;
    if (t >= n) return b->slots[n - 1] + 1;
    return t == 0 || b->slots[t - 1] != b->slots[t] ? b->slots[t] : b->slots[t] + 1;
}

/* A thread's share of a fused call's fetch ranges. With `lora` (the thread's share of that
 * call's tokens), where the ranges are the call's rows, run after run, as many ranges a run (the
 * engine's: a projection fetches its own call's rows), those of the runs that begin among the
 * thread's tokens: each thread brings in the rows it reads itself. Split by count instead
 * (thread_ranges, which takes the rest), a step's decode tokens (a run each) beside a prompt
 * span had their rows fetched by both threads, while the tokens went to one. */
static inline Ranges call_ranges(const int64_t *at, const int64_t *bytes, int64_t fetches,
                                 const LoRAPasses *lora, int64_t t, int64_t nt, int64_t steps) {
    const LoRABinding *b = lora == NULL ? NULL
                           : lora->call != NULL ? lora->call->bound
                                                : lora->call_f32->bound;
    const int64_t n = b != NULL ? b->end - b->start : 0;
    const int64_t runs = n > 0 ? b->slots[n - 1] + 1 : 0;
    if (runs <= 0 || fetches % runs != 0) return thread_ranges(at, bytes, fetches, t, nt, steps);
    const int64_t per = fetches / runs;
    int64_t first = run_from(b, lora->first), last = run_from(b, lora->last);
    first = first > runs ? runs : first; /* slots out of order (not the engine's): in bounds */
    last = last < first ? first : last > runs ? runs : last;
    return ranges_between(at, bytes, first * per, last * per, steps);
}

/* The fused call's shrinks (its LoRA in two passes, lora.c) up to the first `due` blocks */
static inline void shrinks_to(LoRAPasses *lora, int64_t due) {
    while (lora->shrunk < due) lora_shrink_next(lora);
}

/* With `lora`, the thread's shrinks go between its items of the projection, as evenly: those
 * due once `done` of its `items` are; with items 0, all that are left (after a thread's last
 * item, or for a thread without any). */
static inline void shrinks_due(LoRAPasses *lora, int64_t done, int64_t items) {
    if (lora != NULL) shrinks_to(lora, items > 0 ? lora->blocks * done / items : lora->blocks);
}

/* A thread's share of a projection: (block, tile of rows) items in block order, split evenly
 * between the threads, so that each reads its run of blocks once from memory (a block stays in
 * L2 across its row tiles); an item fetches its part of the thread's next block, all of it over
 * the block's tiles. The vdpbf16ps build's and the float32 projection's work (linear.c,
 * linear_f32.c). */
typedef struct {
    int64_t m, n, block_cols, tile_rows; /* the product's rows and columns, an item's at most */
    int64_t blocks, tiles, first, last;  /* the thread's items: first .. last */
    int64_t steps, pace;                 /* steps of k a tile; lines of the next block a step */
    const char *packed;                  /* the packed W */
    int64_t block_bytes;
} Items;

typedef struct {
    int64_t block, tile, row, col, cols;
    int rows;
    const char *from, *to; /* the part of the next block to fetch during the item (or NULL) */
} Item;

/* The threads a product takes: no more than its items (a narrow product of a few rows on one) */
static inline int item_threads(int64_t m, int64_t n, int64_t block_cols, int64_t tile_rows,
                               int num_threads) {
    const int64_t items = (n + block_cols - 1) / block_cols * ((m + tile_rows - 1) / tile_rows);
    return items < num_threads ? (int)items : num_threads;
}

static inline Items thread_items(int64_t m, int64_t n, int64_t block_cols, int64_t tile_rows,
                                 int64_t steps, const void *packed, int64_t block_bytes,
                                 int64_t t, int64_t nt) {
    const int64_t blocks = (n + block_cols - 1) / block_cols;
    const int64_t tiles = (m + tile_rows - 1) / tile_rows, items = blocks * tiles;
    const int64_t lines = block_bytes / 64, work = tiles * steps; /* steps of a block */
    const int64_t pace = work > 0 ? (lines + work - 1) / work : 0;
    const Items s = {m, n, block_cols, tile_rows, blocks, tiles, items * t / nt,
                     items * (t + 1) / nt, steps, pace, packed, block_bytes};
    return s;
}

static inline Item item_at(const Items *s, int64_t item) {
    Item it;
    it.block = item / s->tiles, it.tile = item % s->tiles;
    it.row = it.tile * s->tile_rows, it.col = it.block * s->block_cols;
    it.rows = (int)(s->m - it.row < s->tile_rows ? s->m - it.row : s->tile_rows);
    it.cols = s->n - it.col < s->block_cols ? s->n - it.col : s->block_cols;
    const int fetch = it.block + 1 < s->blocks && (s->last - 1) / s->tiles > it.block;
    const char *next = s->packed + (it.block + 1) * s->block_bytes;
    it.from = fetch ? next + it.tile * s->steps * s->pace * 64 : NULL;
    it.to = fetch ? next + s->block_bytes : NULL;
    return it;
}

/* With `lora`, the shrinks due once `item` is done: in the second half of the thread's items,
 * twice as fast as they go (see linear_thread_shrinking, linear.c) */
static inline void shrinks_after(LoRAPasses *lora, const Items *s, int64_t item) {
    const int64_t twice = 2 * (item - s->first + 1), count = s->last - s->first;
    shrinks_due(lora, twice > count ? twice - count : 0, count);
}

/* With `lora`, the shrinks due once `item` is done at the even pace of the thread's items, but
 * `lag` blocks behind it (see linear_thread_f32, linear_f32.c) */
static inline void shrinks_behind(LoRAPasses *lora, const Items *s, int64_t item, int64_t lag) {
    if (lora != NULL)
        shrinks_to(lora, lora->blocks * (item - s->first + 1) / (s->last - s->first) - lag);
}

#endif
