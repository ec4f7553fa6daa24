/* One pass of Adam / AdamW over a chunk on the CPU, for zero-shard's host share.
 *
 * Reads the model-dtype grad straight from the pinned staging buffer (first multiplied by an
 * optional grad factor as a clip's `_foreach_mul_` multiplies it, on the CPU or on CUDA by a
 * factor of the grads' dtype: the fp32 product rounded back to the model dtype; then
 * multiplied in fp32 by an optional grad scale, as torch's path multiplies the fp32 main grad),
 * updates the fp32 main weight and both moments, and writes the model-dtype weight back into
 * the same staging slot, so the grad cast and the weight cast cost no pass of their own over
 * host memory. The math
 * is torch's fused CPU Adam/AdamW operation for operation, with its fused multiply-adds where
 * torch's build has them (the lerp of exp_avg, the grad term of exp_avg_sq, Adam's L2 term) and
 * none elsewhere (-ffp-contract=off): on whole vectors the results were the same bits as torch
 * 2.13's (tests/optimizers/test_cpu_kernel.py). Coefficients are computed in double, as there.
 *
 * Built by optimizers/_cpu_kernel.py with the host's C compiler (-O3 -march=native -fopenmp
 * -ffp-contract=off -fno-math-errno: IEEE arithmetic, but sqrtf need not set errno, so the loop
 * vectorizes) and
 * called through ctypes, which releases the GIL for the call.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* Round to nearest even, as torch does; NaN stays a (quiet) NaN. Branch-free, so it vectorizes. */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (bits >> 16) | 0x0040u;
    return (uint16_t)(((bits & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded);
}

/* Coefficients are computed in double by the caller and rounded once, as torch does. */
struct adam_args {
    float one_minus_beta1, beta2, one_minus_beta2, eps;
    float l2;      /* weight_decay for Adam (added to the grad), 0 for AdamW */
    float decay;   /* 1 - lr * weight_decay for AdamW, 1 for Adam */
    float step_size;             /* lr / bias_correction1 */
    float bias_correction2_sqrt;
    float grad_factor;  /* each grad is first multiplied by it, the fp32 product rounded to the
                         * model dtype (1: none) */
    float grad_scale;   /* then multiplied by it in fp32 (1: none) */
};

/* The update of one element, the same operations in every loop below: `grad` (scaled), `weight`,
 * `m` and `v` (the state before the step) in; `weight`, `m`, `v` (after it) out. */
#define ADAM_UPDATE(add_l2)                                                                    \
    if (add_l2) grad = fmaf(weight, l2, grad);                                                \
    weight *= decay;                                                                          \
    m = fmaf(one_minus_beta1, grad - m, m);                                                   \
    v = fmaf(one_minus_beta2 * grad, grad, v * beta2);                                        \
    {                                                                                         \
        float denom = sqrtf(v) / bc2_sqrt + eps;                                              \
        weight -= step_size * m / denom;                                                      \
    }

#define ADAM_LOCALS                                                                            \
    const float l2 = a.l2, decay = a.decay, one_minus_beta1 = a.one_minus_beta1;              \
    const float beta2 = a.beta2, one_minus_beta2 = a.one_minus_beta2, eps = a.eps;            \
    const float step_size = a.step_size, bc2_sqrt = a.bias_correction2_sqrt;                  \
    const float grad_factor = a.grad_factor, grad_scale = a.grad_scale;                       \
    (void)grad_factor;                                                                        \
    (void)l2;

/* One thread's contiguous range; restrict and local scalars let the compiler vectorize. Adam's
 * L2 term is compiled in or out (add_l2), not multiplied by zero: inf * 0 would make a NaN where
 * torch leaves an inf weight alone. In place: the state is updated where it is, and the weights
 * replace the grads in the staging slots. */
#define ADAM_RANGE(name, grad_t, add_l2, load_grad, store_weight)                              \
    static void name(float *restrict param, float *restrict exp_avg,                          \
                     float *restrict exp_avg_sq, grad_t *restrict staging, int64_t begin,     \
                     int64_t end, struct adam_args a) {                                       \
        ADAM_LOCALS                                                                           \
        for (int64_t i = begin; i < end; ++i) {                                               \
            float grad = (load_grad) * grad_scale;                                            \
            float weight = param[i], m = exp_avg[i], v = exp_avg_sq[i];                       \
            ADAM_UPDATE(add_l2)                                                               \
            param[i] = weight;                                                                \
            exp_avg[i] = m;                                                                   \
            exp_avg_sq[i] = v;                                                                \
            store_weight;                                                                     \
        }                                                                                     \
    }

/* Streaming stores go straight to memory, not through the cache: a buffer written in full costs
 * its writes alone (no read of its lines first), and the lines just read stay in cache. Each range
 * that streams ends with stream_fence(); the buffers are read only after the parallel region. */
static inline void stream_copy(float *restrict dst, const float *restrict src, int64_t n) {
#if defined(__SSE2__)
    int64_t i = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 15u) != 0; ++i) dst[i] = src[i];
    for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
    for (; i < n; ++i) dst[i] = src[i];
#else
    memcpy(dst, src, (size_t)n * sizeof *dst);
#endif
}

static inline void stream_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* From: the step taken from one state (the live one, read only) into another (its twins: a
 * speculative step, whose results become the live state only if the step stands), the weights
 * to their own buffer, so the grads stay in staging. The new state is written whole, so it is
 * streamed out from a tile small enough for the first-level cache (no read of its lines first). */
#define FROM_TILE 512
#define ADAM_RANGE_FROM(name, grad_t, add_l2, load_grad, store_weight)                         \
    static void name(float *restrict param, float *restrict exp_avg,                          \
                     float *restrict exp_avg_sq, const float *restrict from_param,            \
                     const float *restrict from_exp_avg, const float *restrict from_exp_avg_sq, \
                     const grad_t *restrict staging, grad_t *restrict weights, int64_t begin, \
                     int64_t end, struct adam_args a) {                                       \
        ADAM_LOCALS                                                                           \
        float tile_param[FROM_TILE], tile_exp_avg[FROM_TILE], tile_exp_avg_sq[FROM_TILE];     \
        for (int64_t first = begin; first < end; first += FROM_TILE) {                        \
            const int64_t last = first + FROM_TILE < end ? first + FROM_TILE : end;           \
            for (int64_t i = first; i < last; ++i) {                                          \
                float grad = (load_grad) * grad_scale;                                        \
                float weight = from_param[i], m = from_exp_avg[i], v = from_exp_avg_sq[i];    \
                ADAM_UPDATE(add_l2)                                                           \
                tile_param[i - first] = weight;                                               \
                tile_exp_avg[i - first] = m;                                                  \
                tile_exp_avg_sq[i - first] = v;                                               \
                store_weight;                                                                 \
            }                                                                                 \
            stream_copy(param + first, tile_param, last - first);                             \
            stream_copy(exp_avg + first, tile_exp_avg, last - first);                         \
            stream_copy(exp_avg_sq + first, tile_exp_avg_sq, last - first);                   \
        }                                                                                     \
        stream_fence();                                                                       \
    }

#define LOAD_BF16 bf16_to_float(staging[i])
#define LOAD_BF16_FACTOR bf16_to_float(float_to_bf16(bf16_to_float(staging[i]) * grad_factor))
#define STORE_BF16 staging[i] = float_to_bf16(weight)
#define OUT_BF16 weights[i] = float_to_bf16(weight)
#define LOAD_F32_FACTOR staging[i] * grad_factor
/* Every variant: in place and from; model dtype bf16 or fp32; L2 or not; a grad factor or
 * not. */
#define ADAM_VARIANTS(kind, suffix, store_bf16, store_f32)                                     \
    kind(adam##suffix##_bf16, uint16_t, 0, LOAD_BF16, store_bf16)                             \
    kind(adam##suffix##_bf16_l2, uint16_t, 1, LOAD_BF16, store_bf16)                          \
    kind(adam##suffix##_bf16_factor, uint16_t, 0, LOAD_BF16_FACTOR, store_bf16)               \
    kind(adam##suffix##_bf16_l2_factor, uint16_t, 1, LOAD_BF16_FACTOR, store_bf16)            \
    kind(adam##suffix##_f32, float, 0, staging[i], store_f32)                                 \
    kind(adam##suffix##_f32_l2, float, 1, staging[i], store_f32)                              \
    kind(adam##suffix##_f32_factor, float, 0, LOAD_F32_FACTOR, store_f32)                     \
    kind(adam##suffix##_f32_l2_factor, float, 1, LOAD_F32_FACTOR, store_f32)
ADAM_VARIANTS(ADAM_RANGE, _range, STORE_BF16, staging[i] = weight)
ADAM_VARIANTS(ADAM_RANGE_FROM, _from, OUT_BF16, weights[i] = weight)

/* One piece of a chunk: its fp32 weight and moments, its staging slots, and its coefficients
 * (pieces of one chunk may be at different step counts). */
struct adam_piece {
    float *param, *exp_avg, *exp_avg_sq;
    void *staging;
    int64_t numel;
    struct adam_args args;
    /* From only: the state read, and the weights' own buffer. */
    const float *from_param, *from_exp_avg, *from_exp_avg_sq;
    void *weights;
};

/* The piece holding `block`: the last one whose first block is at most `block` (empty pieces
 * share their successor's first block, so the last of equals is the one with elements). */
static inline int64_t piece_of_block(const int64_t *first_block, int64_t num_pieces,
                                     int64_t block) {
    int64_t lo = 0, hi = num_pieces - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (first_block[mid] <= block)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Every piece of a chunk in one parallel region: one call (one GIL release) per chunk, however
 * many small params it holds, instead of one per piece. Blocks of 32K elements are handed out
 * dynamically: when a core is taken for a while (the main thread queuing copies, the CUDA
 * driver), the other threads take its share instead of all waiting for it at the end of the
 * parallel region, as a static split would. Returns 0, or -1 if the block table could not be
 * allocated (nothing was stepped then). */
#define ADAM_BLOCK 32768
#define CALL_IN_PLACE(range, piece, grad_t, begin, end)                                       \
    range(piece->param, piece->exp_avg, piece->exp_avg_sq, (grad_t *)piece->staging, begin,  \
          end, piece->args)
#define CALL_FROM(range, piece, grad_t, begin, end)                                            \
    range(piece->param, piece->exp_avg, piece->exp_avg_sq, piece->from_param,                 \
          piece->from_exp_avg, piece->from_exp_avg_sq, (const grad_t *)piece->staging,        \
          (grad_t *)piece->weights, begin, end, piece->args)
#define ADAM_ENTRY(name, range, grad_t, call)                                                   \
    int name(const struct adam_piece *pieces, int64_t num_pieces, int num_threads) {           \
        int64_t *first_block = malloc((size_t)(num_pieces + 1) * sizeof *first_block);          \
        if (first_block == NULL) return -1;                                                    \
        first_block[0] = 0;                                                                    \
        for (int64_t p = 0; p < num_pieces; ++p)                                               \
            first_block[p + 1] = first_block[p] + (pieces[p].numel + ADAM_BLOCK - 1) / ADAM_BLOCK; \
        const int64_t num_blocks = first_block[num_pieces];                                    \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")              \
        for (int64_t block = 0; block < num_blocks; ++block) {                                 \
            const struct adam_piece *piece =                                                   \
                &pieces[piece_of_block(first_block, num_pieces, block)];                       \
            int64_t begin = (block - first_block[piece - pieces]) * ADAM_BLOCK;                \
            int64_t end = begin + ADAM_BLOCK < piece->numel ? begin + ADAM_BLOCK : piece->numel; \
            const int l2 = piece->args.l2 != 0.0f, factor = piece->args.grad_factor != 1.0f;   \
            if (l2 && factor)                                                                  \
                call(range##_l2_factor, piece, grad_t, begin, end);                            \
            else if (l2)                                                                       \
                call(range##_l2, piece, grad_t, begin, end);                                   \
            else if (factor)                                                                   \
                call(range##_factor, piece, grad_t, begin, end);                               \
            else                                                                               \
                call(range, piece, grad_t, begin, end);                                        \
        }                                                                                      \
        free(first_block);                                                                     \
        return 0;                                                                              \
    }

/* In place: grads in, weights out through the same staging slots (bf16 or fp32). */
ADAM_ENTRY(zero_shard_adam_bf16, adam_range_bf16, uint16_t, CALL_IN_PLACE)
ADAM_ENTRY(zero_shard_adam_f32, adam_range_f32, float, CALL_IN_PLACE)
/* From: the step from the live state into its twins, the weights to their own buffer. */
ADAM_ENTRY(zero_shard_adam_from_bf16, adam_from_bf16, uint16_t, CALL_FROM)
ADAM_ENTRY(zero_shard_adam_from_f32, adam_from_f32, float, CALL_FROM)
