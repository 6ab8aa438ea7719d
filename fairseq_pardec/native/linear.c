/* y = x W^T + b (+ add) (then ReLU), float32, for the few rows a decoding step multiplies.
 *
 * At one to a few rows a decoder's products are bound by reading the weight, and what the
 * library kernels add around that read (oneDNN's primitive lookup, MKL's dispatch: 10-20 us a
 * call on a 2-core AMD EPYC) costs more than the read of a d256 layer's weights. This kernel is
 * the read and nothing else: the weight is stored once in panels of PANEL columns, each panel
 * its K rows of PANEL contiguous floats, so every call streams memory in order; each panel
 * keeps up to 8 rows' sums in registers, with a kernel for every row count from 1 to 8 (21 rows
 * are 8 + 8 + 5, three reads of the panel, not 8 + 8 + 4 + 1); while a panel's first rows are
 * computed, the next panel is prefetched into L2 (the weights of a decoding step do not stay in
 * this machine's caches from one step to the next: without it a product of 8 rows waited on
 * memory at every panel). The panels are shared among torch's OpenMP threads (borrowed:
 * native/kernels.h).
 *
 * Measured against the kernel with rows in 8, 4, 2, 1 and no prefetch (AMD EPYC, 2 threads,
 * alternating calls, median of 150; cold: a 48 MB buffer written before each call): an 8496 x 256
 * projection of 1 / 8 / 21 / 32 rows took 73 / 170 / 445 / 721 us against 104 / 183 / 594 / 790
 * hot, and 367 / 685 / 899 against 543 / 909 / 1101 us cold at 8 / 21 / 32 rows. Every output's
 * sum is the same sequence of operations either way: the results are bit for bit the same.
 *
 * Each output sums its K products in order k = 0 .. K-1 (fused multiply-add where the machine
 * has it): another rounding than MKL's or oneDNN's, by about 1e-6 relative in float32, which
 * the fast step's margin guard covers (cpu/fast.py, DEFAULT_MARGIN). Compiled once per x86-64
 * level and chosen for the CPU at load time (setup.py, native/dispatch.c), or for the machine
 * that runs it where the package came without its build (native/library.py).
 */

#include <stdint.h>

#include "kernels.h"

#define PANEL 32

int PARDEC_API(pardec_panel_width)(void) { return PANEL; }

/* prefetch: where the next panel is, or NULL; each k step asks for the same offset of it, so
 * that the panel is on its way to L2 while this one is computed */
#define PANEL_KERNEL(ROWS)                                                                     \
    static void panel_##ROWS(const float *restrict x, int64_t K, const float *restrict panel,  \
                             const float *prefetch, float *restrict acc) {                      \
        float sum[ROWS][PANEL];                                                                \
        for (int m = 0; m < ROWS; m++)                                                         \
            for (int j = 0; j < PANEL; j++) sum[m][j] = 0.f;                                   \
        for (int64_t k = 0; k < K; k++) {                                                      \
            const float *w = panel + k * PANEL;                                                \
            if (prefetch) {                                                                    \
                __builtin_prefetch(prefetch + k * PANEL, 0, 2);                                \
                __builtin_prefetch(prefetch + k * PANEL + 16, 0, 2);                           \
            }                                                                                  \
            for (int m = 0; m < ROWS; m++) {                                                   \
                const float xk = x[m * K + k];                                                 \
                for (int j = 0; j < PANEL; j++) sum[m][j] += xk * w[j];                        \
            }                                                                                  \
        }                                                                                      \
        for (int m = 0; m < ROWS; m++)                                                         \
            for (int j = 0; j < PANEL; j++) acc[m * PANEL + j] = sum[m][j];                    \
    }

PANEL_KERNEL(1)
PANEL_KERNEL(2)
PANEL_KERNEL(3)
PANEL_KERNEL(4)
PANEL_KERNEL(5)
PANEL_KERNEL(6)
PANEL_KERNEL(7)
PANEL_KERNEL(8)

typedef void (*panel_fn)(const float *restrict, int64_t, const float *restrict, const float *,
                         float *restrict);
static const panel_fn PANELS[9] = {0, panel_1, panel_2, panel_3, panel_4,
                                   panel_5, panel_6, panel_7, panel_8};

struct product {
    const float *x, *panels, *bias, *add;
    float *y;
    int64_t M, K, N, count;
    int relu;
};

/* the panels [first_panel, last_panel) of a product, every row */
static void product_panels(void *context, int64_t first_panel, int64_t last_panel) {
    const struct product *c = context;
    const float *x = c->x, *bias = c->bias, *add = c->add;
    const int64_t M = c->M, K = c->K, N = c->N, count = c->count;
    float *y = c->y;
    for (int64_t p = first_panel; p < last_panel; p++) {
        float acc[8 * PANEL];
        const float *panel = c->panels + p * K * PANEL;
        const int64_t first = p * PANEL;
        const int64_t width = N - first < PANEL ? N - first : PANEL;
        const float *next = p + 1 < count ? panel + K * PANEL : 0;
        for (int64_t m0 = 0; m0 < M;) {
            const int rows = M - m0 >= 8 ? 8 : (int)(M - m0);
            PANELS[rows](x + m0 * K, K, panel, m0 == 0 ? next : 0, acc);
            for (int m = 0; m < rows; m++) {
                float *out = y + (m0 + m) * N + first;
                const float *extra = add ? add + (m0 + m) * N + first : 0;
                for (int64_t j = 0; j < width; j++) {
                    float v = acc[m * PANEL + j];
                    if (bias) v += bias[first + j];
                    if (extra) v += extra[j];
                    if (c->relu && v < 0.f) v = 0.f;
                    out[j] = v;
                }
            }
            m0 += rows;
        }
    }
}

/* x: (M, K) rows, contiguous; panels: ceil(N / PANEL) panels of (K, PANEL), the columns past N
 * zero; bias: (N,) or NULL; add: (M, N) contiguous or NULL (a residual added after the bias);
 * y: (M, N) contiguous, written. The panels are split among ``threads`` threads. */
void PARDEC_API(pardec_linear)(const float *x, int64_t M, int64_t K, const float *panels,
                               const float *bias, const float *add, float *y, int64_t N,
                               int relu, int threads) {
    struct product product = {x, panels, bias, add, y, M, K, N, (N + PANEL - 1) / PANEL, relu};
    pardec_parallel_for(product.count, threads, product_panels, &product);
}
