/* Each row's best two scores over the vocabulary, for the engine's decisions on the host, after
 * fairseq's first edits of a step's log-probabilities where asked (fairseq_rules.token_rules:
 * NaN becomes -inf, padding is never chosen, the unknown word pays --unkpen), made in place in
 * the same pass over the row instead of three passes of torch's.
 *
 * torch's topk(2) over a verify block's log-probabilities (rows of ~8k) cost 50 us for 6 rows
 * and 180 us for 32 (2 threads, AVX-512 EPYC): it selects with a heap per row. The best two are
 * three passes in SIMD lanes: the maximum, the first column holding it, the maximum of the other
 * columns. Nothing is rounded: the values are the row's own.
 */

#include <math.h>
#include <stdint.h>

#include "kernels.h"

struct scores {
    float *x;
    int64_t cols;
    float *values;
    int64_t *best;
    const int64_t *rules; /* NULL, or {pad, unk}: apply fairseq's edits first */
    float unk_penalty;
};

static void token_rules(float *row, int64_t cols, const int64_t *rules, float unk_penalty) {
    int nan = 0;
#pragma omp simd reduction(| : nan)
    for (int64_t c = 0; c < cols; c++) nan |= row[c] != row[c];
    if (nan)
        for (int64_t c = 0; c < cols; c++)
            if (row[c] != row[c]) row[c] = -INFINITY;
    row[rules[0]] = -INFINITY;
    if (unk_penalty != 0) row[rules[1]] -= unk_penalty;
}

static void best_two_rows(void *context, int64_t first, int64_t last) {
    const struct scores *s = context;
    const int64_t cols = s->cols;
    for (int64_t n = first; n < last; n++) {
        float *row = s->x + n * cols;
        if (s->rules) token_rules(row, cols, s->rules, s->unk_penalty);
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t c = 0; c < cols; c++) top = row[c] > top ? row[c] : top;
        int64_t at = 0;
        while (at < cols - 1 && !(row[at] == top)) at++;
        float second = -INFINITY;
#pragma omp simd reduction(max : second)
        for (int64_t c = 0; c < at; c++) second = row[c] > second ? row[c] : second;
#pragma omp simd reduction(max : second)
        for (int64_t c = at + 1; c < cols; c++) second = row[c] > second ? row[c] : second;
        s->values[2 * n] = top;
        s->values[2 * n + 1] = second;
        s->best[n] = at;
    }
}

/* x: (rows, cols); per row the largest value, the first column holding it, and the largest value
 * of the other columns (values: (rows, 2), best: (rows,)). cols >= 2. ``rules``: NULL, or
 * {pad, unk}: fairseq's edits (with ``unk_penalty``) are made in ``x`` first. Threads only past
 * 4 rows: below, waking them costs more than the rows. */
void PARDEC_API(pardec_best_two)(float *x, int64_t rows, int64_t cols, float *values,
                                 int64_t *best, const int64_t *rules, float unk_penalty,
                                 int threads) {
    struct scores scores = {x, cols, values, best, rules, unk_penalty};
    pardec_parallel_for(rows, rows > 4 ? threads : 1, best_two_rows, &scores);
}
