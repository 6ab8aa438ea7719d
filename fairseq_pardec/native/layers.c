/* A whole decoder call's layers in one native call: a Transformer decoder layer stack (fairseq's
 * TransformerDecoderLayer, post- or pre-norm, ReLU feed-forward) over the packed rows of a verify
 * block, on the fast step's static key/value cache (cpu/fast.py). With D_ENCODER set, the same code
 * runs an encoder's layers (fairseq's TransformerEncoderLayer: attention over every real source
 * position, no encoder attention) over a batch's rows, batch-major, with the keys and values in
 * a scratch buffer (cpu/fast_encoder.py).
 *
 * The fast step in torch issues about thirty operations per layer (norms, views, cache writes,
 * attention, packing), each a few microseconds of dispatch at batch 1, and the attention kernel
 * alone cost 20 us for a block of 6 queries over 40 keys (4 heads of 64) where its arithmetic
 * takes 1 us. Here a layer is its products (pardec_linear, native/linear.c), its layer norms, the
 * cache writes and the attention, with no dispatch between them.
 *
 * Rounding: layer norms accumulate in double; an attention score sums its head_dim products in
 * SIMD lanes; softmax subtracts the row's maximum, takes a polynomial exp (exp_nonpositive) and
 * divides the weighted sum of values by the sum of weights. All of it differs from torch's rounding by about 1e-6 relative in float32, which
 * the fast step's margin guard covers (cpu/fast.py, DEFAULT_MARGIN; tests/test_fast_step.py).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

void PARDEC_API(pardec_linear)(const float *x, int64_t M, int64_t K, const float *panels,
                               const float *bias, const float *add, float *y, int64_t N,
                               int relu, int threads);
/* the product of this file's instruction set */
#define pardec_linear PARDEC_API(pardec_linear)

/* dims, in this order */
enum { D_LAYERS, D_ROWS, D_BATCH, D_LENGTH, D_FIRST, D_CAPACITY, D_MODEL, D_HEADS, D_HEAD_DIM,
       D_CROSS_HEADS, D_CROSS_HEAD_DIM, D_FFN, D_SOURCE, D_PRE_NORM, D_THREADS, D_ENCODER,
       D_COUNT };

/* per layer, in this order, in the weights table: panels then bias of each product, then the
 * weight and bias of each layer norm (self-attention, encoder attention, feed-forward) */
enum { W_QKV, W_QKV_B, W_OUT, W_OUT_B, W_CQ, W_CQ_B, W_CO, W_CO_B, W_FC1, W_FC1_B, W_FC2,
       W_FC2_B, W_N0, W_N0_B, W_N1, W_N1_B, W_N2, W_N2_B, W_COUNT };

/* per layer, in the state table: self keys, self values (slots, heads, capacity, head_dim),
 * encoder keys, encoder values (slots, cross heads, S, head_dim) */
enum { S_KEYS, S_VALUES, S_ENC_KEYS, S_ENC_VALUES, S_COUNT };

/* pardec_attention's dims, in this order */
enum { A_ROWS, A_BATCH, A_HEADS, A_DIM, A_ENTRIES, A_THREADS, A_MODE, A_COUNT };
/* pardec_attention's modes */
enum { A_DECODER_SELF, A_DECODER_CROSS, A_ENCODER_SELF };

int PARDEC_API(pardec_layers_abi)(void) {
    return A_COUNT * 1000000 + D_COUNT * 10000 + W_COUNT * 100 + S_COUNT;
}

#define PTR(table, i) ((const float *)(intptr_t)(table)[i])

static void layer_norm(float *x, int64_t rows, int64_t width, const float *weight,
                       const float *bias, double eps) {
    for (int64_t n = 0; n < rows; n++) {
        float *row = x + n * width;
        double sum = 0.0;
        for (int64_t c = 0; c < width; c++) sum += row[c];
        const double mean = sum / width;
        double squares = 0.0;
        for (int64_t c = 0; c < width; c++) {
            const double d = row[c] - mean;
            squares += d * d;
        }
        const double inv = 1.0 / sqrt(squares / width + eps);
        for (int64_t c = 0; c < width; c++)
            row[c] = (float)((row[c] - mean) * inv) * weight[c] + bias[c];
    }
}

/* e^x for x <= 0 (a score minus its row's maximum; -inf gives 0): 2^n p(r) with
 * r = x - n ln 2 in [-ln2/2, ln2/2] and p Cephes' expf polynomial, within 2 ulp of expf; in
 * SIMD lanes, where a call of libm's expf per key cost more than the rest of the attention */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(clamped * 1.44269504088896341f);
    const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return x < -87.0f ? 0.0f : p * scale.f;
}

/* ask for one key's or value's row (a cache line is 16 floats) */
static inline void prefetch_row(const float *row, int64_t dim) {
    for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(row + d, 0, 3);
}

/* softmax(q . k_j) v_j over the keys j < count; flags (or NULL: every key) mark the keys to
 * skip (flags_skip = 1: a nonzero flag skips the key) or to read (flags_skip = 0). q is already
 * scaled; keys and values are (count, DIM) rows; scores: count floats of scratch. DIM is a
 * constant where it can be (the sums of a head stay in registers), else ``dim``. */
#define ATTEND(NAME, DIM)                                                                       \
    static void NAME(const float *restrict q, const float *restrict keys,                     \
                     const float *restrict values, int64_t count, int64_t dim,                \
                     const uint8_t *flags, int flags_skip, float *restrict scores,            \
                     float *restrict out, const float *next_keys, const float *next_values,   \
                     int64_t next_count) {                                                    \
        (void)dim;                                                                             \
        float best = -INFINITY;                                                                \
        for (int64_t j = 0; j < count; j++) {                                                  \
            if (j < next_count) prefetch_row(next_keys + j * (DIM), (DIM));                    \
            if (flags && ((flags[j] != 0) == flags_skip)) {                                    \
                scores[j] = -INFINITY;                                                         \
                continue;                                                                      \
            }                                                                                  \
            const float *k = keys + j * (DIM);                                                 \
            float s = 0.f;                                                                     \
            _Pragma("omp simd reduction(+ : s)")                                               \
            for (int64_t d = 0; d < (DIM); d++) s += q[d] * k[d];                              \
            scores[j] = s;                                                                     \
            if (s > best) best = s;                                                            \
        }                                                                                      \
        float total = 0.f;                                                                     \
        _Pragma("omp simd reduction(+ : total)")                                               \
        for (int64_t j = 0; j < count; j++) {                                                  \
            const float p = exp_nonpositive(scores[j] - best);                                 \
            scores[j] = p;                                                                     \
            total += p;                                                                        \
        }                                                                                      \
        float sum[(DIM) > 0 ? (DIM) : 1];                                                      \
        for (int64_t d = 0; d < (DIM); d++) sum[d] = 0.f;                                      \
        for (int64_t j = 0; j < count; j++) {                                                  \
            const float p = scores[j];                                                         \
            if (p == 0.f) continue; /* a skipped key (or one e^-87 below the best) */          \
            const float *v = values + j * (DIM);                                               \
            if (j < next_count) prefetch_row(next_values + j * (DIM), (DIM));                  \
            _Pragma("omp simd")                                                                \
            for (int64_t d = 0; d < (DIM); d++) sum[d] += p * v[d];                            \
        }                                                                                      \
        for (int64_t j = count; j < next_count; j++) prefetch_row(next_values + j * (DIM), (DIM)); \
        const float inv = 1.f / total;                                                         \
        for (int64_t d = 0; d < (DIM); d++) out[d] = sum[d] * inv;                             \
    }

ATTEND(attend_64, 64)
ATTEND(attend_32, 32)
ATTEND(attend_any, dim)

static void attend(const float *q, const float *keys, const float *values, int64_t count,
                   int64_t dim, const uint8_t *flags, int flags_skip, float *scores, float *out,
                   const float *next_keys, const float *next_values, int64_t next_count) {
    if (dim == 64)
        attend_64(q, keys, values, count, dim, flags, flags_skip, scores, out, next_keys,
                  next_values, next_count);
    else if (dim == 32)
        attend_32(q, keys, values, count, dim, flags, flags_skip, scores, out, next_keys,
                  next_values, next_count);
    else
        attend_any(q, keys, values, count, dim, flags, flags_skip, scores, out, next_keys,
                   next_values, next_count);
}

/* One attention per (row, head) task: the self-attention's (causal over the row's own cache
 * entries, or every entry for an encoder) or the encoder attention's (every real source
 * position). A packed row n reads the buffers of its slot, row_slot[n]: a batch row is a slot of
 * the cache, wherever it sits in the batch. */
struct attention {
    int64_t heads, dim;
    int64_t entries; /* entries per (slot, head) in keys and values */
    int64_t keys;    /* keys every query reads, or -1: causal, up to its own entry row_at[n] */
    const float *queries, *keys_at, *values_at;
    int64_t query_stride, out_stride; /* floats from one row's queries (outputs) to the next */
    const uint8_t *flags; /* (slots, entries), or NULL */
    int flags_skip;
    const int64_t *row_slot, *row_at;
    float *out;
    int64_t tasks;
};

static inline int64_t keys_read(const struct attention *a, int64_t n) {
    return a->keys >= 0 ? a->keys : a->row_at[n] + 1;
}

static void attention_tasks(void *context, int64_t first_task, int64_t last_task) {
    const struct attention *a = context;
    for (int64_t task = first_task; task < last_task; task++) {
        const int64_t n = task / a->heads, h = task % a->heads;
        const int64_t s = a->row_slot[n];
        const int64_t count = keys_read(a, n);
        float scores[count];
        const int64_t from = (s * a->heads + h) * a->entries * a->dim;
        /* the next task's keys and values are asked for while this one computes */
        int64_t next_count = 0, next_from = 0;
        if (task + 1 < a->tasks) {
            const int64_t n1 = (task + 1) / a->heads, h1 = (task + 1) % a->heads;
            next_count = keys_read(a, n1);
            next_from = (a->row_slot[n1] * a->heads + h1) * a->entries * a->dim;
        }
        attend(a->queries + n * a->query_stride + h * a->dim, a->keys_at + from,
               a->values_at + from, count, a->dim, a->flags ? a->flags + s * a->entries : NULL,
               a->flags_skip, scores, a->out + n * a->out_stride + h * a->dim,
               a->keys_at + next_from, a->values_at + next_from, next_count);
    }
}

/* Where each packed row's query sits: its slot, and the cache entry its own key goes to (a
 * decoder's: its batch row's first entry + its time in the block; an encoder's: its time).
 * Returns the most entries a query reads. */
static int64_t place_rows(int64_t rows, const int64_t *index, int64_t batch, int64_t length,
                          int encoder, int64_t first, const int64_t *row_first,
                          const int64_t *slot_of, int64_t *row_slot, int64_t *row_at) {
    int64_t most = 0;
    for (int64_t n = 0; n < rows; n++) {
        const int64_t place = index ? index[n] : n;
        const int64_t t = encoder ? place % length : place / batch;
        const int64_t b = encoder ? place / length : place % batch;
        row_slot[n] = slot_of ? slot_of[b] : b;
        row_at[n] = encoder ? t : (row_first ? row_first[b] : first) + t;
        if (row_at[n] + 1 > most) most = row_at[n] + 1;
    }
    return encoder ? length : most;
}

/* attention is a few microseconds of arithmetic at batch 1: threads only for batches */
static inline int attention_threads(int64_t rows, int64_t heads, int64_t keys, int64_t dim,
                                    int threads) {
    return threads > 1 && rows * heads * keys * dim > (1 << 17) ? threads : 1;
}

/* The self-attention of packed rows whose queries, keys and values are ``qkv`` (rows, 3 *
 * heads * dim): the keys and values go to their slots' cache entries first, then each query
 * attends (keys: every query reads that many entries, or -1: causal). */
static void self_attention(int64_t rows, int64_t heads, int64_t dim, int64_t entries,
                           int64_t keys, const int64_t *row_slot, const int64_t *row_at,
                           float *cache_keys, float *cache_values, const float *qkv,
                           const uint8_t *masked, float *attended, int threads) {
    const int64_t width = heads * dim;
    for (int64_t n = 0; n < rows; n++) {
        const float *row = qkv + n * 3 * width;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t to = ((row_slot[n] * heads + h) * entries + row_at[n]) * dim;
            memcpy(cache_keys + to, row + width + h * dim, sizeof(float) * dim);
            memcpy(cache_values + to, row + 2 * width + h * dim, sizeof(float) * dim);
        }
    }
    struct attention self = {heads, dim, entries, keys, qkv, cache_keys, cache_values,
                             3 * width, width, masked, 1, row_slot, row_at, attended,
                             rows * heads};
    pardec_parallel_for(self.tasks, threads, attention_tasks, &self);
}

/* The encoder attention of packed rows' queries ``q`` (rows, heads * dim) over their slots'
 * ``source`` encoder keys and values (enc_attend: (slots, source) nonzero where real). */
static void cross_attention(int64_t rows, int64_t heads, int64_t dim, int64_t source,
                            const int64_t *row_slot, const int64_t *row_at,
                            const float *enc_keys, const float *enc_values,
                            const uint8_t *enc_attend, const float *q, float *attended,
                            int threads) {
    struct attention cross = {heads, dim, source, source, q, enc_keys, enc_values, heads * dim,
                              heads * dim, enc_attend, 0, row_slot, row_at, attended,
                              rows * heads};
    pardec_parallel_for(cross.tasks, threads, attention_tasks, &cross);
}

/* dims: D_COUNT values (see the enum); weights: W_COUNT pointers per layer; eps: 3 per layer;
 * state: S_COUNT pointers per layer; index: (rows) the packed rows' places in the time-major
 * (length, batch) grid, or NULL for a dense block; masked: (batch, capacity) nonzero for cache
 * entries no query may attend to, or NULL; enc_attend: (slots, S) nonzero for real source
 * positions, or NULL; x: (rows, model) the layer stack's input, overwritten with its output.
 * row_first: (batch) each batch row's first cache entry for the block (NULL: D_FIRST for
 * every row); slot_of: (batch) the slot of the buffers each batch row owns (NULL: its own
 * index). Each row's block entries are written at its [first, first + length).
 * An encoder (D_ENCODER): rows are batch-major (batch, length), every row attends to all
 * length entries not masked, and the encoder-attention weights and state are not read. */
void PARDEC_API(pardec_decoder_layers)(const int64_t *dims, const int64_t *weights,
                                        const double *eps, const int64_t *state,
                                        const int64_t *index, const uint8_t *masked,
                                        const uint8_t *enc_attend, const int64_t *row_first,
                                        const int64_t *slot_of, float *x) {
    const int64_t layers = dims[D_LAYERS], rows = dims[D_ROWS], batch = dims[D_BATCH];
    const int64_t first = dims[D_FIRST], capacity = dims[D_CAPACITY], model = dims[D_MODEL];
    const int64_t heads = dims[D_HEADS], head_dim = dims[D_HEAD_DIM];
    const int64_t cross_heads = dims[D_CROSS_HEADS], cross_dim = dims[D_CROSS_HEAD_DIM];
    const int64_t ffn = dims[D_FFN], source = dims[D_SOURCE];
    const int pre_norm = (int)dims[D_PRE_NORM], threads = (int)dims[D_THREADS];
    const int encoder = (int)dims[D_ENCODER];
    const int64_t length = dims[D_LENGTH];
    const int64_t self_width = heads * head_dim, cross_width = cross_heads * cross_dim;
    const int64_t widest = ffn > 3 * self_width ? ffn : 3 * self_width;

    float *normed = malloc(sizeof(float) * rows * model);
    float *wide = malloc(sizeof(float) * rows * (widest > model ? widest : model));
    float *attended = malloc(sizeof(float) * rows *
                             (self_width > cross_width ? self_width : cross_width));
    float *next = malloc(sizeof(float) * rows * model);
    int64_t *row_slot = malloc(sizeof(int64_t) * rows), *row_at = malloc(sizeof(int64_t) * rows);
    const int64_t keys_seen = place_rows(rows, index, batch, length, encoder, first, row_first,
                                         slot_of, row_slot, row_at);
    const int attention_team = attention_threads(rows, heads, keys_seen, head_dim, threads);

    for (int64_t i = 0; i < layers; i++) {
        const int64_t *w = weights + i * W_COUNT;
        const int64_t *s = state + i * S_COUNT;
        const double *e = eps + 3 * i;
        float *cache_keys = (float *)(intptr_t)s[S_KEYS];
        float *cache_values = (float *)(intptr_t)s[S_VALUES];
        const float *enc_keys = PTR(s, S_ENC_KEYS), *enc_values = PTR(s, S_ENC_VALUES);
        float *in;

        /* self-attention: queries, keys, values in one product; the block's keys and values
         * go to the cache before any query reads it */
        in = x;
        if (pre_norm) {
            memcpy(normed, x, sizeof(float) * rows * model);
            layer_norm(normed, rows, model, PTR(w, W_N0), PTR(w, W_N0_B), e[0]);
            in = normed;
        }
        pardec_linear(in, rows, model, PTR(w, W_QKV), PTR(w, W_QKV_B), NULL, wide,
                      3 * self_width, 0, threads);
        self_attention(rows, heads, head_dim, capacity, encoder ? keys_seen : -1, row_slot,
                       row_at, cache_keys, cache_values, wide, masked, attended,
                       attention_team);
        pardec_linear(attended, rows, self_width, PTR(w, W_OUT), PTR(w, W_OUT_B), x, next, model,
                      0, threads);
        memcpy(x, next, sizeof(float) * rows * model);
        if (!pre_norm) layer_norm(x, rows, model, PTR(w, W_N0), PTR(w, W_N0_B), e[0]);

        /* encoder attention over keys and values projected once per batch (a decoder's) */
        if (!encoder) {
            in = x;
            if (pre_norm) {
                memcpy(normed, x, sizeof(float) * rows * model);
                layer_norm(normed, rows, model, PTR(w, W_N1), PTR(w, W_N1_B), e[1]);
                in = normed;
            }
            pardec_linear(in, rows, model, PTR(w, W_CQ), PTR(w, W_CQ_B), NULL, wide, cross_width,
                          0, threads);
            cross_attention(rows, cross_heads, cross_dim, source, row_slot, row_at, enc_keys,
                            enc_values, enc_attend, wide, attended, attention_team);
            pardec_linear(attended, rows, cross_width, PTR(w, W_CO), PTR(w, W_CO_B), x, next,
                          model, 0, threads);
            memcpy(x, next, sizeof(float) * rows * model);
            if (!pre_norm) layer_norm(x, rows, model, PTR(w, W_N1), PTR(w, W_N1_B), e[1]);
        }

        /* feed-forward, ReLU fused into the first product */
        in = x;
        if (pre_norm) {
            memcpy(normed, x, sizeof(float) * rows * model);
            layer_norm(normed, rows, model, PTR(w, W_N2), PTR(w, W_N2_B), e[2]);
            in = normed;
        }
        pardec_linear(in, rows, model, PTR(w, W_FC1), PTR(w, W_FC1_B), NULL, wide, ffn, 1,
                      threads);
        pardec_linear(wide, rows, ffn, PTR(w, W_FC2), PTR(w, W_FC2_B), x, next, model, 0,
                      threads);
        memcpy(x, next, sizeof(float) * rows * model);
        if (!pre_norm) layer_norm(x, rows, model, PTR(w, W_N2), PTR(w, W_N2_B), e[2]);
    }
    free(normed);
    free(wide);
    free(attended);
    free(next);
    free(row_slot);
    free(row_at);
}

/* One layer's attention alone, for the fast step and the fast encoder where a library kernel
 * runs the products (cpu/fast.py, cpu/fast_encoder.py): the same cache, slots and arithmetic as
 * pardec_decoder_layers. dims: A_COUNT values (see the enum). By A_MODE:
 * - A_DECODER_SELF: ``in`` is a block's packed rows' (rows, 3 * heads * dim) queries, keys and
 *   values; index, row_first, slot_of as for pardec_decoder_layers. The keys and values are
 *   written to ``keys``/``values`` (slots, heads, A_ENTRIES, dim) and each query attends
 *   causally to its row's entries; flags: NULL.
 * - A_DECODER_CROSS: ``in`` is the rows' (rows, heads * dim) queries, attending to all
 *   A_ENTRIES source positions of their slots' encoder keys and values; flags: (slots,
 *   A_ENTRIES) nonzero where real, or NULL.
 * - A_ENCODER_SELF: ``in`` is an encoder layer's (rows, 3 * heads * dim) queries, keys and
 *   values at the places ``index`` (NULL: every place) of the batch-major (A_BATCH, A_ENTRIES)
 *   grid; the keys and values go to ``keys``/``values`` (A_BATCH, heads, A_ENTRIES, dim), and
 *   each query attends to its sentence's positions; flags: (A_BATCH, A_ENTRIES) nonzero at
 *   padding (never read, written or not), or NULL; row_first, slot_of: NULL.
 * out: (rows, heads * dim). */
void PARDEC_API(pardec_attention)(const int64_t *dims, const int64_t *index,
                                   const int64_t *row_first, const int64_t *slot_of,
                                   float *keys, float *values, const uint8_t *flags,
                                   const float *in, float *out) {
    const int64_t rows = dims[A_ROWS], heads = dims[A_HEADS], dim = dims[A_DIM];
    const int64_t entries = dims[A_ENTRIES], mode = dims[A_MODE];
    const int encoder = mode == A_ENCODER_SELF;
    int64_t *row_slot = malloc(sizeof(int64_t) * rows), *row_at = malloc(sizeof(int64_t) * rows);
    const int64_t keys_seen = place_rows(rows, index, dims[A_BATCH], entries, encoder, 0,
                                         row_first, slot_of, row_slot, row_at);
    const int team = attention_threads(rows, heads, mode == A_DECODER_CROSS ? entries : keys_seen,
                                       dim, (int)dims[A_THREADS]);
    if (mode == A_DECODER_CROSS)
        cross_attention(rows, heads, dim, entries, row_slot, row_at, keys, values, flags, in,
                        out, team);
    else
        self_attention(rows, heads, dim, entries, encoder ? entries : -1, row_slot, row_at,
                       keys, values, in, encoder ? flags : NULL, out, team);
    free(row_slot);
    free(row_at);
}

/* The decoder's input for the packed rows of a block: scale * tokens' embedding + their
 * positions' embedding, as fairseq adds them (a learned or a sinusoidal table: rows of the
 * table either way). tokens: (batch, length) contiguous; start: (batch,) each row's first
 * decoder step; index: as for pardec_decoder_layers (NULL: dense); positions: (position_rows,
 * model) or NULL; x: (rows, model), written. A row's position is its step + offset (fairseq's
 * padding index + 1). Returns 0, or -1 (nothing written) where a token or a position falls
 * outside its table. */
/* no fused multiply-add: fairseq rounds the scaled embedding before adding the position */
__attribute__((optimize("fp-contract=off")))
int PARDEC_API(pardec_embed_block)(const int64_t *tokens, const int64_t *start,
                                   const int64_t *index, int64_t rows, int64_t batch,
                                   int64_t length, int64_t offset, float scale,
                                   const float *embeddings, int64_t vocabulary,
                                   const float *positions, int64_t position_rows, int64_t model,
                                   float *x) {
    for (int64_t n = 0; n < rows; n++) {
        const int64_t place = index ? index[n] : n;
        const int64_t t = place / batch, b = place % batch;
        const int64_t token = tokens[b * length + t], position = start[b] + t + offset;
        if (token < 0 || token >= vocabulary) return -1;
        if (positions && (position < 0 || position >= position_rows)) return -1;
    }
    for (int64_t n = 0; n < rows; n++) {
        const int64_t place = index ? index[n] : n;
        const int64_t t = place / batch, b = place % batch;
        const float *e = embeddings + tokens[b * length + t] * model;
        float *out = x + n * model;
        if (positions) {
            const float *p = positions + (start[b] + t + offset) * model;
            for (int64_t c = 0; c < model; c++) out[c] = scale * e[c] + p[c];
        } else {
            for (int64_t c = 0; c < model; c++) out[c] = scale * e[c];
        }
    }
    return 0;
}
