/* An iteration's decisions on the host, row by row, for the engine (draft_verify/decisions.py).
 *
 * The engine reads per verified position the best token after fairseq's edits, its
 * log-probability and the runner-up's. For a row whose every position is plain (no forced prefix
 * token, a lossless acceptance rule) the decision is a walk along its block: the verifier's token
 * at each position, kept while it equals the draft, up to the first EOS; the float32 running
 * score after every token; the tokens and scores written into the host's tables. Python's per-row
 * walk (decisions.py) made the same decisions at 1-2 us a position plus a few per row; here a
 * row costs nanoseconds.
 *
 * A row where the verifier's choice needs more than the two values is left to that walk
 * untouched (its length, score and last token unchanged): where adding the hypothesis score ties
 * the best two (fairseq's topk order decides: fairseq_rules.beam_one), and where the margin guard
 * finds the lead not certain (draft_verify/margin_guard.py, lead_is_certain: the same formula, in
 * double precision as Python computes it).
 *
 * Scalar code, compiled once for every CPU: it runs after the read on the CPU and on CUDA alike.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* float32's unit roundoff, doubled (margin_guard._ADD_ROUNDING). A power of two: its product
 * is exact, so a fused multiply-add rounds the guard's bound as Python's two operations do. */
#define ADD_ROUNDING 0x1p-23

/* The argument table's slots (decisions.py, NativeDecisions fills it), in order. Pointers as
 * int64. Written once: the enum and the names native/library.py checks its own table against
 * (pardec_decide_slot_names) both come from this list.
 *   TOP          (N, 2) float32: best and second log-probability per packed position
 *   BEST         (N,) int64: the first token holding the best
 *   ROWS         active rows
 *   WIDTH        draft width of the block: positions per row are WIDTH + 1
 *   POS          (ROWS, WIDTH + 1) int64: packed position of each row's block position; NULL
 *                for a dense block (every row drafts WIDTH tokens): position j of row r is
 *                packed at j * ROWS + r
 *   BLOCK        (ROWS, WIDTH + 1) int64: each row's last token, then its draft, padded
 *   LENGTHS      (ROWS,) int64: each row's draft length; NULL: WIDTH for every row
 *   EOS          the end-of-sentence token
 *   PREV_SCORE   (ROWS,) float32 in/out: the running score of each row's last token
 *   N_OUT        (ROWS,) int64 in/out: tokens accepted so far
 *   LAST         (ROWS,) int64 in/out: each row's last accepted token
 *   TOKENS       (ROWS, TOKENS_STRIDE) int64: BOS, then the accepted tokens
 *   SCORES       (ROWS, SCORES_STRIDE) float32: the running scores
 *   GAINED       (ROWS,) int64 out: tokens the row keeps in this iteration
 *   ACCEPTED     (ROWS,) int64 out: draft tokens among them
 *   ENDED        (ROWS,) uint8 out: whether the last is EOS
 *   LAST_POS     (ROWS,) int64 out: the packed position of the last kept token
 *   LEFT         (ROWS,) uint8 out: 1 where the row is left to the caller
 *   LONGEST      in/out: the most tokens any row has accepted (rows decided here) */
#define DECIDE_SLOTS(X) \
    X(TOP) X(BEST) X(ROWS) X(WIDTH) X(POS) X(BLOCK) X(LENGTHS) X(EOS) \
    X(PREV_SCORE) X(N_OUT) X(LAST) X(TOKENS) X(TOKENS_STRIDE) X(SCORES) X(SCORES_STRIDE) \
    X(GAINED) X(ACCEPTED) X(ENDED) X(LAST_POS) X(LEFT) X(LONGEST)

#define AS_ENUM(name) name,
#define AS_NAME(name) #name " "
enum { DECIDE_SLOTS(AS_ENUM) SLOTS };
static const char slot_names[] = DECIDE_SLOTS(AS_NAME);

#define AT(type, slot) ((type *)(intptr_t)args[slot])

/* margin_guard.lead_is_certain, the same formula (its docstring derives it): ``score_bound``
 * bounds |fairseq's hypothesis score| (the row's score plus a margin a decided token). */
static int lead_is_certain(double first, double second, double score_bound, double margin) {
    if (isinf(second) && second < 0) return 1;
    const double rounding = ADD_ROUNDING * (score_bound + margin + (fabs(first) + fabs(second)) / 2);
    return first - second > 2 * margin + rounding;
}

/* lead_is_certain for the test that holds it against margin_guard.lead_is_certain on random
 * inputs (tests/test_decisions.py). */
int pardec_lead_is_certain(double first, double second, double score_bound, double margin) {
    return lead_is_certain(first, second, score_bound, margin);
}

/* The slots' names in their order, separated by spaces: native/library.py checks them against its own. */
const char *pardec_decide_slot_names(void) { return slot_names; }

/* Decide every row it can (see above); ``margin`` < 0: no guard. Returns the rows left to the
 * caller, plus 2**32 times the rows decided here that ended (the engine then retires rows
 * without looking through ENDED). */
int64_t pardec_decide_rows(int64_t *args, double margin) {
    const float *top = AT(const float, TOP);
    const int64_t *best = AT(const int64_t, BEST);
    const int64_t rows = args[ROWS], width = args[WIDTH], eos = args[EOS];
    const int64_t tokens_stride = args[TOKENS_STRIDE], scores_stride = args[SCORES_STRIDE];
    const int guard = margin >= 0;
    int64_t left_rows = 0, ended_rows = 0, longest = args[LONGEST];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t *pos = args[POS] ? AT(const int64_t, POS) + r * (width + 1) : NULL;
        const int64_t *draft = AT(const int64_t, BLOCK) + r * (width + 1) + 1;
        const int64_t length = args[LENGTHS] ? AT(const int64_t, LENGTHS)[r] : width;
        const int64_t start = AT(int64_t, N_OUT)[r];
        int64_t *tokens = AT(int64_t, TOKENS) + r * tokens_stride + start + 1;
        float *scores = AT(float, SCORES) + r * scores_stride + start;
        float score = AT(float, PREV_SCORE)[r];
        int64_t j = 0, at = 0, token = 0, accepted = 0;
        int left = 0;
        for (;; j++) {
            at = pos ? pos[j] : j * rows + r;
            const float first = top[2 * at], second = top[2 * at + 1];
            /* float + float: rounded to float32, as fairseq's running score is */
            const float ahead = first + score, behind = second + score;
            const double score_bound = fabs((double)score) + (double)(start + j + 1) * margin;
            if (!(ahead > behind) ||
                (guard && !lead_is_certain(first, second, score_bound, margin))) {
                left = 1;
                break;
            }
            token = best[at];
            const int kept = j < length && draft[j] == token;
            score = ahead;
            tokens[j] = token;
            scores[j] = score;
            accepted += kept;
            if (token == eos || !kept) break;
        }
        AT(uint8_t, LEFT)[r] = (uint8_t)left;
        if (left) {
            left_rows++;
            continue;
        }
        AT(int64_t, GAINED)[r] = j + 1;
        AT(int64_t, ACCEPTED)[r] = accepted;
        AT(uint8_t, ENDED)[r] = token == eos;
        ended_rows += token == eos;
        AT(int64_t, LAST_POS)[r] = at;
        AT(float, PREV_SCORE)[r] = score;
        AT(int64_t, LAST)[r] = token;
        AT(int64_t, N_OUT)[r] = start + j + 1;
        if (start + j + 1 > longest) longest = start + j + 1;
    }
    ((int64_t *)args)[LONGEST] = longest;
    return left_rows | ended_rows << 32;
}
