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

/* The thread's share of `fetches` ranges (split in order, as evenly as their count), spread
 * over `steps` steps of its work. */
static inline Ranges thread_ranges(const int64_t *at, const int64_t *bytes, int64_t fetches,
                                   int64_t t, int64_t nt, int64_t steps) {
    Ranges r = {at, bytes, fetches * t / nt, fetches * (t + 1) / nt, 0, 0, 0};
    int64_t lines = 0;
    for (int64_t i = r.next; i < r.end; i++) lines += (bytes[i] + 63) / 64;
    r.pace = steps > 0 ? (lines * PACE_ONE + steps - 1) / steps : 0;
    return r;
}

/* With `lora` (the fused call's LoRA in two passes, lora.c), the thread's shrinks go between
 * its items of the projection, as evenly: those due once `done` of its `items` are; with items
 * 0, all that are left (after a thread's last item, or for a thread without any). */
static inline void shrinks_due(LoRAPasses *lora, int64_t done, int64_t items) {
    if (lora == NULL) return;
    const int64_t due = items > 0 ? lora->blocks * done / items : lora->blocks;
    while (lora->shrunk < due) lora_shrink_next(lora);
}

#endif
