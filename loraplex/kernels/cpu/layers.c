#include "lora.h"

/* A step's decoder layers (bfloat16: decode_layers_bf16; float32: decode_layers_f32), every row
 * a query row of the attention kernel, in one native call: per layer the calls the model makes
 * one by one from Python (model.py, CausalLM.forward), in its order, on the same buffers'
 * contents, so the same bits; with adapters, each projection makes its LoRA calls as the model's
 * would: one in its own native call (linear_lora_bf16, linear_lora_f32), or several after it.
 * One call instead of about eight a layer, each with its own ctypes and Python cost. On a 2-core
 * Zen 4 (family 25, model 17) the main thread of 32 sequences decoding spent 11.6% of its samples
 * outside the native calls, of one sequence 20.7% (py-spy); benchmarks/fused_layers.py, the two
 * ways alternated in one process: 32 requests of 64 + 64 tokens 1.055x the tokens/s, one of
 * 64 + 256 1.25x, the same tokens and logprobs; in float32 1.035x on the base model, 1.076x on
 * 32 q,v adapters, 1.073x on 32 all-module ones. On a 2-core Xeon with AMX (family 6, model
 * 207), bfloat16: 32 requests 1.17x on the base model, 1.14x on 32 q,v adapters, 1.17x on 32
 * all-module ones. */

/* Built with LAYER_STAGE_TIMERS (benchmarks/step_stages.py's build, never the engine's): the
 * nanoseconds each stage of a layer took (the q,k,v projection with its LoRA, the rotary write,
 * the attention, o, the norm, gate_up, SiLU, down, the next norm), summed over every layer and
 * call since the caller cleared them. */
#if defined(LAYER_STAGE_TIMERS)
#define LAYER_STAGES 9
#include <time.h> /* clock_gettime: declared under -std=c11 by common.h's _GNU_SOURCE, above */
int layer_stages(void) { return LAYER_STAGES; }
int64_t layer_stage_nanoseconds[LAYER_STAGES];
int64_t *layer_stage_timers(void) { return layer_stage_nanoseconds; }
static inline int64_t stage_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
#define STAGE_START int64_t stage_clock = stage_now();
#define STAGE_END(i)                                                                             \
    {                                                                                            \
        const int64_t stage_then = stage_clock;                                                  \
        stage_clock = stage_now();                                                               \
        layer_stage_nanoseconds[i] += stage_clock - stage_then;                                  \
    }
#else
#define STAGE_START
#define STAGE_END(i)
#endif

/* One layer's weights, of the step's dtype: its projections packed for the native projection
 * (linear_bf16, linear_f32; biases or NULL), the norm after attention, the next layer's input
 * norm (NULL on the last layer) and the layer's KV cache. */
typedef struct {
    const void *qkv, *qkv_bias, *o, *gate_up, *down;
    const void *post_attention_norm, *next_input_norm;
    void *kv;
} DecoderLayer;

/* The model's shapes and its rotary tables (of the step's dtype) */
typedef struct {
    int64_t hidden, heads, kv_heads, dim, inter, page_size, page_stride, max_positions;
    const void *cos, *sin;
    float eps, scale;
} DecoderShape;

/* A step's m rows: their positions, KV slots and attention tables, and its buffers (of the
 * step's dtype), each contiguous: x [m, hidden] the first layer's normed input, and each layer's
 * after it; hidden [m, hidden] the residual stream, added to in place; then scratch of each
 * layer's stages. After the call, down holds the last layer's MLP output (not yet added to
 * hidden). */
typedef struct {
    int64_t m, table_stride;
    const int64_t *positions, *slot_pages, *slot_offsets, *tables, *lens;
    void *x, *hidden, *qkv, *q, *attended, *o, *gate_up, *act, *down;
} DecoderStep;

/* What a projection does in a step besides its product: its LoRA, either one call in the
 * projection's own native call (lora) or calls after it (calls of them in after, none empty),
 * and the memory ranges it brings into cache meanwhile, where the build fetches (its own call's
 * adapter rows, or the next layer's q,k,v ones; fetches 0: none) */
typedef struct {
    const LoRABinding *lora;
    const LoRABinding *const *after;
    int64_t calls;
    const int64_t *fetch_at, *fetch_bytes;
    int64_t fetches;
} StepProjection;

/* A layer's projections in a step with adapters */
typedef struct {
    StepProjection qkv, o, gate_up, down;
} LayerLoRA;

/* Memory ranges of every layer: layer i's `fetches` ranges start at at + i * stride (their
 * lengths the same in every layer) */
typedef struct {
    const int64_t *at, *bytes;
    int64_t fetches, stride;
} StridedFetch;

/* A projection's LoRA in every layer of a step where it is one call in the projection's own
 * native call, the same in every layer but for its row tables: layer i's is `lora` with
 * a_rows and b_rows rows_stride bytes on per layer (NULL: no call in any layer); and the
 * ranges it fetches meanwhile */
typedef struct {
    const LoRABinding *lora;
    int64_t rows_stride;
    StridedFetch fetch;
} StridedProjection;

/* A step's LoRA where each projection's is the same in every layer but for where its tables and
 * ranges are (the usual batch: adapters of one shape on every layer): what the engine binds once
 * for all layers. Python making a LayerLoRA a layer instead took 0.65 ms more at each change of
 * the batch's adapters on 32 q,v adapters, 2.8 ms more on 32 all-module ones (2-core Zen 4,
 * benchmarks/step_bookkeeping.py). With `ahead` ranges, each layer's gate_up fetches the next
 * layer's and that layer's q,k,v projection none of its own (CausalLM._next_qkv_rows). */
typedef struct {
    StridedProjection qkv, o, gate_up, down;
    StridedFetch ahead;
} StridedLoRA;

static StepProjection strided_step(const StridedProjection *p, int64_t i, LoRABinding *bound) {
    StepProjection s = {NULL, NULL, 0, NULL, NULL, 0};
    if (p->lora != NULL) {
        *bound = *p->lora;
        bound->a_rows = (const int64_t *)((const char *)bound->a_rows + i * p->rows_stride);
        bound->b_rows = (const int64_t *)((const char *)bound->b_rows + i * p->rows_stride);
        s.lora = bound;
    }
    if (p->fetch.fetches > 0) {
        s.fetch_at = p->fetch.at + i * p->fetch.stride;
        s.fetch_bytes = p->fetch.bytes;
        s.fetches = p->fetch.fetches;
    }
    return s;
}

/* Layer i of num_layers's projections of `s`, their bindings in `bound` (4) */
static LayerLoRA strided_layer(const StridedLoRA *s, int64_t i, int64_t num_layers,
                               LoRABinding *bound) {
    LayerLoRA a = {strided_step(&s->qkv, i, &bound[0]), strided_step(&s->o, i, &bound[1]),
                   strided_step(&s->gate_up, i, &bound[2]), strided_step(&s->down, i, &bound[3])};
    if (s->ahead.fetches > 0 && i > 0) { /* fetched by the layer before's gate_up */
        a.qkv.fetch_at = NULL;
        a.qkv.fetch_bytes = NULL;
        a.qkv.fetches = 0;
    }
    if (s->ahead.fetches > 0 && i + 1 < num_layers) {
        a.gate_up.fetch_at = s->ahead.at + (i + 1) * s->ahead.stride;
        a.gate_up.fetch_bytes = s->ahead.bytes;
        a.gate_up.fetches = s->ahead.fetches;
    }
    return a;
}

/* The entry point of one dtype T, whose calls end in S (bf16, f32):
 *
 * project: x [m, k] -> y [m, n] (both contiguous), and what `p` adds to the product (NULL:
 * nothing).
 *
 * NAME -> 0, or the first failing call's status (nothing more done after it). lora: each layer's
 * projections' LoRA calls and fetches, or else strided: all layers' in one (both NULL: a step
 * without adapters). */
#define DEFINE_DECODE_LAYERS(NAME, T, S)                                                         \
    static int project_##S(const T *x, int64_t m, int64_t k, const T *packed, int64_t n,       \
                           const T *bias, T *y, const StepProjection *p, int num_threads) {    \
        if (p == NULL)                                                                         \
            return linear_##S(x, k, m, k, packed, n, bias, y, n, NULL, NULL, 0, num_threads);  \
        if (p->lora != NULL)                                                                   \
            return linear_lora_##S(x, k, m, k, packed, n, bias, y, n, p->fetch_at,             \
                                   p->fetch_bytes, p->fetches, p->lora);                       \
        int status = linear_##S(x, k, m, k, packed, n, bias, y, n, p->fetch_at, p->fetch_bytes, \
                                p->fetches, num_threads);                                      \
        for (int64_t i = 0; i < p->calls && status == 0; i++)                                  \
            status = lora_apply_##S(x, k, y, n, k, p->after[i]);                               \
        return status;                                                                         \
    }                                                                                          \
                                                                                               \
    int NAME(const DecoderLayer *layers, int64_t num_layers, const DecoderShape *s,            \
             const DecoderStep *step, const LayerLoRA *lora, const StridedLoRA *strided,      \
             int num_threads) {                                                                \
        const int64_t m = step->m, hidden = s->hidden, q_size = s->heads * s->dim;             \
        const int64_t qkv_size = q_size + 2 * s->kv_heads * s->dim, inter = s->inter;          \
        T *x = step->x, *residual = step->hidden, *qkv = step->qkv, *q = step->q;              \
        T *attended = step->attended, *o = step->o, *gate_up = step->gate_up;                  \
        T *act = step->act, *down = step->down;                                                \
        int status;                                                                            \
        for (int64_t i = 0; i < num_layers; i++) {                                             \
            const DecoderLayer *l = &layers[i];                                                \
            LoRABinding bound[4];                                                              \
            const LayerLoRA layer_lora =                                                       \
                strided != NULL ? strided_layer(strided, i, num_layers, bound) : (LayerLoRA){0}; \
            const LayerLoRA *a = lora != NULL ? &lora[i] : strided != NULL ? &layer_lora : NULL; \
            STAGE_START                                                                        \
            OR_RETURN(project_##S(x, m, hidden, l->qkv, qkv_size, l->qkv_bias, qkv,            \
                                  a != NULL ? &a->qkv : NULL, num_threads));                   \
            STAGE_END(0)                                                                       \
            OR_RETURN(rope_write_##S(qkv, qkv_size, m, s->heads, s->kv_heads, s->dim, s->cos,  \
                                     s->sin, s->max_positions, step->positions, q, l->kv,      \
                                     s->page_stride, step->slot_pages, step->slot_offsets,     \
                                     num_threads));                                            \
            STAGE_END(1)                                                                       \
            OR_RETURN(attend_decode_##S(q, attended, l->kv, s->page_stride, step->tables,      \
                                        step->table_stride, step->lens, m, s->heads,           \
                                        s->kv_heads, s->dim, s->page_size, s->scale,           \
                                        num_threads));                                         \
            STAGE_END(2)                                                                       \
            OR_RETURN(project_##S(attended, m, q_size, l->o, hidden, NULL, o,                  \
                                  a != NULL ? &a->o : NULL, num_threads));                     \
            STAGE_END(3)                                                                       \
            add_rms_norm_##S(residual, o, l->post_attention_norm, x, m, hidden, s->eps,        \
                             num_threads);                                                     \
            STAGE_END(4)                                                                       \
            OR_RETURN(project_##S(x, m, hidden, l->gate_up, 2 * inter, NULL, gate_up,          \
                                  a != NULL ? &a->gate_up : NULL, num_threads));               \
            STAGE_END(5)                                                                       \
            silu_mul_##S(gate_up, 2 * inter, m, inter, act, num_threads);                      \
            STAGE_END(6)                                                                       \
            OR_RETURN(project_##S(act, m, inter, l->down, hidden, NULL, down,                  \
                                  a != NULL ? &a->down : NULL, num_threads));                  \
            STAGE_END(7)                                                                       \
            if (l->next_input_norm != NULL)                                                    \
                add_rms_norm_##S(residual, down, l->next_input_norm, x, m, hidden, s->eps,     \
                                 num_threads);                                                 \
            STAGE_END(8)                                                                       \
        }                                                                                      \
        return 0;                                                                              \
    }

#define OR_RETURN(CALL)                                                                          \
    if ((status = (CALL)) != 0) return status
DEFINE_DECODE_LAYERS(decode_layers_bf16, uint16_t, bf16)
DEFINE_DECODE_LAYERS(decode_layers_f32, float, f32)
#undef OR_RETURN
