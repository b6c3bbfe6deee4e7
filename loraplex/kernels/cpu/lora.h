/* The LoRA calls (lora.c), which the projections also make in their own native call (linear.c:
 * linear_lora_bf16, linear_f32.c: linear_lora_f32). */
#ifndef LORAPLEX_CPU_LORA_H
#define LORAPLEX_CPU_LORA_H
#include "common.h"

/* A LoRA call's arguments but its input and output, bound once per (layer, projection input) and
 * batch (cpu_lora.BoundLoRA): the kernel takes rows start .. end of x and y. Passed as one
 * pointer, where its 14 values as arguments of their own cost about 1.7 us of ctypes a call. */
typedef struct {
    int64_t start, end, modules;
    const int64_t *mods, *cols, *fouts;
    const void *pool; /* float or uint16_t, as x and y */
    const int64_t *a_rows, *b_rows;
    int64_t mstride;
    const int64_t *slots;
    int64_t r;
    const float *scales;
    int64_t num_threads;
} LoRABinding;

/* A float32 LoRA call: the call `bound` on x [*, fin] and y, rows x_stride and y_stride apart
 * from row 0. */
typedef struct {
    const float *x;
    int64_t x_stride;
    float *y;
    int64_t y_stride, fin;
    const LoRABinding *bound;
} LoRACallF32;

/* Thread th of nt's share of a float32 call; lora_apply_f32 runs it on each thread of its team,
 * and the float32 projection (linear_f32.c: linear_lora_f32) after its own share where it cannot
 * take it in passes. */
__attribute__((visibility("hidden"))) void lora_thread_f32(const LoRACallF32 *call, int64_t th,
                                                           int64_t nt);

/* A bfloat16 LoRA call (lora_thread_bf16): the call `bound` on x [*, fin] and y, rows x_stride
 * and y_stride apart from row 0; rows_fetched: its rows were brought into cache before it (the
 * call in linear_lora_bf16, after the projection of a decode step or of a step with a prompt
 * chunk). */
typedef struct {
    const uint16_t *x;
    int64_t x_stride;
    uint16_t *y;
    int64_t y_stride, fin;
    const LoRABinding *bound;
    int rows_fetched;
} LoRACall;

/* Thread th of nt's share of a call (lora_apply_bf16 runs it on each thread of its team). */
__attribute__((visibility("hidden"))) void lora_thread_bf16(const LoRACall *call, int64_t th,
                                                            int64_t nt);

/* Thread th of nt's share of a call in two passes (lora_passes_begin, lora.c): the shrinks,
 * block after block (lora_shrink_next; `shrunk` of `blocks` done), then the expands
 * (lora_expands). A bfloat16 call (`call`; not in the AMX build) or a float32 one (`call_f32`,
 * whose blocks are single tokens; lora_passes_begin_f32). */
typedef struct {
    const LoRACall *call;
    const LoRACallF32 *call_f32;
    int64_t first, last; /* the thread's tokens */
    int64_t next;        /* the first token of the next block to shrink */
    int64_t blocks, shrunk;
    float *v; /* each token's shrink results, scaled: [token][module][r] */
} LoRAPasses;

/* 0 if the thread cannot take its share in passes (no memory for v). */
__attribute__((visibility("hidden"))) int lora_passes_begin(LoRAPasses *p, const LoRACall *call,
                                                            int64_t th, int64_t nt);
__attribute__((visibility("hidden"))) int lora_passes_begin_f32(LoRAPasses *p,
                                                                const LoRACallF32 *call,
                                                                int64_t th, int64_t nt);
__attribute__((visibility("hidden"))) void lora_shrink_next(LoRAPasses *p);
__attribute__((visibility("hidden"))) void lora_expands(LoRAPasses *p);

/* The LoRA call `bound` on x [*, fin] and y (lora.c), as CpuLoRAKernel calls it; layers.c makes
 * it after a projection whose LoRA takes more than one call */
int lora_apply_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride,
                    int64_t fin, const LoRABinding *bound);
int lora_apply_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t fin,
                   const LoRABinding *bound);

/* The projection x -> y and then the LoRA call `bound` on (x, y) in one parallel region (linear.c,
 * linear_f32.c; layers.c makes it for each projection whose LoRA is one call) */
int linear_lora_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                     const uint16_t *packed, int64_t n, const uint16_t *bias, uint16_t *y,
                     int64_t y_stride, const int64_t *fetch_at, const int64_t *fetch_bytes,
                     int64_t fetches, const LoRABinding *bound);
int linear_lora_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed,
                    int64_t n, const float *bias, float *y, int64_t y_stride,
                    const int64_t *fetch_at, const int64_t *fetch_bytes, int64_t fetches,
                    const LoRABinding *bound);

#endif
