/* The native kernels' parallel loops on a borrowed OpenMP runtime (see native/kernels.h).
 *
 * GOMP_parallel is the entry point GCC itself compiles ``#pragma omp parallel`` into; libgomp,
 * LLVM's libomp and Intel's libiomp5 all export it, so whichever runtime torch was built with
 * runs the loops, on the same threads as torch's own kernels. The split is schedule(static)'s:
 * the loops below were compiled with ``#pragma omp parallel for schedule(static)`` before, and
 * every output is computed by one thread either way.
 */

#include <stddef.h>
#include <time.h>

#define PARDEC_ANY_ISA /* one copy for every variant */
#include "kernels.h"

typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_query_fn)(void);

/* set once by native/library.py, before any kernel runs; NULL: no runtime, one thread */
static gomp_parallel_fn gomp_parallel;
static omp_query_fn thread_number, thread_count;

/* The least time an empty parallel region of two threads took, in microseconds, and whether the
 * loops run on the calling thread alone because of it. Where the runtime's threads wait spinning
 * (OpenMP's default) a region costs well under a microsecond; where they sleep between regions
 * (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=0) each region wakes them, tens of microseconds, and a
 * decoder step opens one per product: several times slower than one thread. */
static double region_microseconds = 0;
static int serial_loops = 0;
#define SLEEPING_REGION_MICROSECONDS 10.0

static void nothing(void *data) { (void)data; }

static double now_microseconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static void measure_regions(void) {
    double least = -1;
    for (int i = 0; i < 20; i++) {
        const double start = now_microseconds();
        gomp_parallel(nothing, NULL, 2, 0);
        const double took = now_microseconds() - start;
        if (i >= 4 && (least < 0 || took < least)) least = took; /* the first 4 start the team */
    }
    region_microseconds = least;
    serial_loops = least > SLEEPING_REGION_MICROSECONDS;
}

int pardec_use_openmp(void *parallel, void *get_thread_num, void *get_num_threads) {
    if (!parallel || !get_thread_num || !get_num_threads) {
        gomp_parallel = NULL;
        thread_number = thread_count = NULL;
        region_microseconds = 0;
        serial_loops = 0;
        return 0;
    }
    thread_number = (omp_query_fn)get_thread_num;
    thread_count = (omp_query_fn)get_num_threads;
    gomp_parallel = (gomp_parallel_fn)parallel;
    measure_regions();
    return 1;
}

double pardec_region_microseconds(void) { return region_microseconds; }

int pardec_serial_loops(void) { return serial_loops; }

struct loop {
    int64_t count;
    pardec_range_fn body;
    void *context;
};

static void run_share(void *data) {
    const struct loop *loop = data;
    const int64_t threads = thread_count(), me = thread_number();
    int64_t share = loop->count / threads, extra = loop->count % threads, begin;
    if (me < extra) {
        share++;
        begin = me * share;
    } else {
        begin = me * share + extra;
    }
    if (share > 0) loop->body(loop->context, begin, begin + share);
}

void pardec_parallel_for(int64_t count, int threads, pardec_range_fn body, void *context) {
    if (threads <= 1 || count <= 1 || gomp_parallel == NULL || serial_loops) {
        if (count > 0) body(context, 0, count);
        return;
    }
    struct loop loop = {count, body, context};
    gomp_parallel(run_share, &loop, (unsigned)threads, 0);
}
