/* A bfloat16 LoRA call (lora.c), which the projection also makes in its own native call
 * (linear.c: linear_lora_bf16). */
#ifndef LORAPLEX_CPU_LORA_H
#define LORAPLEX_CPU_LORA_H
#include "common.h"

/* A bfloat16 LoRA call's arguments, as lora_apply_bf16 takes them. */
typedef struct {
    const uint16_t *x;
    int64_t x_stride;
    uint16_t *y;
    int64_t y_stride, n, fin, modules;
    const int64_t *mods, *cols, *fouts;
    const uint16_t *pool;
    const int64_t *a_rows, *b_rows;
    int64_t mstride;
    const int64_t *slots;
    int64_t r;
    const float *scales;
} LoRACall;

/* Thread th of nt's share of a call (lora_apply_bf16 runs it on each thread of its team). */
__attribute__((visibility("hidden"))) void lora_thread_bf16(const LoRACall *call, int64_t th,
                                                            int64_t nt);

#endif
