/* The native library's exported names, bound to the kernels compiled for the running CPU.
 *
 * The build compiles each kernel source once per variant (native/kernels.h) and lists the
 * variants, best first, in PARDEC_VARIANTS as X(name) entries: X(x86_64_v4) X(x86_64_v3)
 * X(x86_64) for the installed library on x86-64, one entry (native, generic) for a build that
 * targets one machine. At load time the first variant the CPU runs is bound; pardec_select
 * binds another, capped at an x86-64 level (the test suite's AVX2 pass). A variant is chosen
 * for the whole library, never per call: its products, layers and scores then round alike.
 *
 * Why whole copies rather than target_clones on the hot functions: the copies are the same
 * translation units the compiler sees with one -march, with every helper inlined for that
 * target (layer norms, the attention's exp, the panel kernels), and no function needs a
 * per-compiler attribute syntax; the cost is a library about three times as large (~100 KB).
 * This file itself is compiled for the baseline of its architecture.
 */

#include <stddef.h>
#include <stdint.h>

#ifndef PARDEC_VARIANTS
#error "PARDEC_VARIANTS lists the variants compiled into the library (setup.py, native/library.py)"
#endif

typedef void (*linear_fn)(const float *, int64_t, int64_t, const float *, const float *,
                          const float *, float *, int64_t, int, int);
typedef void (*layers_fn)(const int64_t *, const int64_t *, const double *, const int64_t *,
                          const int64_t *, const uint8_t *, const uint8_t *, const int64_t *,
                          const int64_t *, float *);
typedef void (*attention_fn)(const int64_t *, const int64_t *, const int64_t *, const int64_t *,
                             float *, float *, const uint8_t *, const float *, float *);
typedef int (*embed_fn)(const int64_t *, const int64_t *, const int64_t *, int64_t, int64_t,
                        int64_t, int64_t, float, const float *, int64_t, const float *, int64_t,
                        int64_t, float *);
typedef void (*best_two_fn)(float *, int64_t, int64_t, float *, int64_t *, const int64_t *,
                            float, int);
typedef int (*count_fn)(void);

struct variant {
    const char *name;
    int level; /* the x86-64 level (1, 3, 4); 0 where none applies */
    int (*runs_here)(void);
    linear_fn linear;
    layers_fn layers;
    attention_fn attention;
    embed_fn embed;
    best_two_fn best_two;
    count_fn panel_width, layers_abi;
};

#if defined(__x86_64__) || defined(__i386__)
__attribute__((unused)) static int runs_x86_64(void) { return 1; }

/* x86-64-v3 as the kernels use it: AVX2, FMA (and BMI2, F16C, which the compiler may emit);
 * libgcc's and compiler-rt's checks include the OS's support for the AVX registers */
__attribute__((unused)) static int runs_x86_64_v3(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c");
}

/* x86-64-v4: AVX-512 F, BW, CD, DQ and VL on top of v3 */
__attribute__((unused)) static int runs_x86_64_v4(void) {
    return runs_x86_64_v3() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512cd") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
#endif

/* built on and for this machine, or for the architecture's baseline */
__attribute__((unused)) static int runs_native(void) { return 1; }
__attribute__((unused)) static int runs_generic(void) { return 1; }

enum { LEVEL_x86_64 = 1, LEVEL_x86_64_v3 = 3, LEVEL_x86_64_v4 = 4, LEVEL_native = 0,
       LEVEL_generic = 0 };

#define X(isa)                                                                                 \
    void pardec_linear_##isa(const float *, int64_t, int64_t, const float *, const float *,   \
                             const float *, float *, int64_t, int, int);                       \
    void pardec_decoder_layers_##isa(const int64_t *, const int64_t *, const double *,       \
                                     const int64_t *, const int64_t *, const uint8_t *,       \
                                     const uint8_t *, const int64_t *, const int64_t *,       \
                                     float *);                                                 \
    void pardec_attention_##isa(const int64_t *, const int64_t *, const int64_t *,            \
                                const int64_t *, float *, float *, const uint8_t *,           \
                                const float *, float *);                                      \
    int pardec_embed_block_##isa(const int64_t *, const int64_t *, const int64_t *, int64_t,  \
                                 int64_t, int64_t, int64_t, float, const float *, int64_t,    \
                                 const float *, int64_t, int64_t, float *);                   \
    void pardec_best_two_##isa(float *, int64_t, int64_t, float *, int64_t *, const int64_t *, \
                               float, int);                                                    \
    int pardec_panel_width_##isa(void);                                                        \
    int pardec_layers_abi_##isa(void);
PARDEC_VARIANTS
#undef X

#define X(isa)                                                                                 \
    {#isa, LEVEL_##isa, runs_##isa, pardec_linear_##isa, pardec_decoder_layers_##isa,         \
     pardec_attention_##isa, pardec_embed_block_##isa, pardec_best_two_##isa,                \
     pardec_panel_width_##isa, pardec_layers_abi_##isa},
static const struct variant VARIANTS[] = {PARDEC_VARIANTS};
#undef X

#define VARIANT_COUNT ((int)(sizeof(VARIANTS) / sizeof(VARIANTS[0])))

static const struct variant *bound;

/* Bind the best variant this CPU runs whose x86-64 level is at most ``cap`` (variants
 * without a level always qualify). Returns its index, or -1 (nothing bound, nothing changed)
 * where none does. */
int pardec_select(int cap) {
    for (int i = 0; i < VARIANT_COUNT; i++) {
        if (VARIANTS[i].level <= cap && VARIANTS[i].runs_here()) {
            bound = &VARIANTS[i];
            return i;
        }
    }
    return -1;
}

__attribute__((constructor)) static void bind_at_load(void) { pardec_select(1 << 20); }

const char *pardec_variant(void) { return bound ? bound->name : NULL; }

/* the variants compiled in, comma-separated, best first */
const char *pardec_variants(void) {
#define X(isa) #isa ","
    return PARDEC_VARIANTS;
#undef X
}

void pardec_linear(const float *x, int64_t M, int64_t K, const float *panels, const float *bias,
                   const float *add, float *y, int64_t N, int relu, int threads) {
    bound->linear(x, M, K, panels, bias, add, y, N, relu, threads);
}

void pardec_decoder_layers(const int64_t *dims, const int64_t *weights, const double *eps,
                           const int64_t *state, const int64_t *index, const uint8_t *masked,
                           const uint8_t *enc_attend, const int64_t *row_first,
                           const int64_t *slot_of, float *x) {
    bound->layers(dims, weights, eps, state, index, masked, enc_attend, row_first, slot_of, x);
}

void pardec_attention(const int64_t *dims, const int64_t *index, const int64_t *row_first,
                      const int64_t *slot_of, float *keys, float *values, const uint8_t *flags,
                      const float *in, float *out) {
    bound->attention(dims, index, row_first, slot_of, keys, values, flags, in, out);
}

int pardec_embed_block(const int64_t *tokens, const int64_t *start, const int64_t *index,
                       int64_t rows, int64_t batch, int64_t length, int64_t offset, float scale,
                       const float *embeddings, int64_t vocabulary, const float *positions,
                       int64_t position_rows, int64_t model, float *x) {
    return bound->embed(tokens, start, index, rows, batch, length, offset, scale, embeddings,
                        vocabulary, positions, position_rows, model, x);
}

void pardec_best_two(float *x, int64_t rows, int64_t cols, float *values, int64_t *best,
                     const int64_t *rules, float unk_penalty, int threads) {
    bound->best_two(x, rows, cols, values, best, rules, unk_penalty, threads);
}

int pardec_panel_width(void) { return bound->panel_width(); }

int pardec_layers_abi(void) { return bound->layers_abi(); }

/* the digest of the sources this library was compiled from (native/library.py compares it with the
 * sources next to it: an in-place build left behind by an edit is not loaded) */
const char *pardec_source_digest(void) {
#ifdef PARDEC_SOURCE_DIGEST
    return PARDEC_SOURCE_DIGEST;
#else
    return "";
#endif
}
