/* What the native kernel sources (native/linear.c, native/layers.c, native/scores.c) share.
 *
 * Exported names per instruction set. The installed library holds each source compiled once
 * per x86-64 level (x86-64, x86-64-v3 with AVX2 and FMA, x86-64-v4 with AVX-512), each copy's
 * names suffixed with its level (PARDEC_ISA, set by the build: pardec_linear_x86_64_v3), and
 * native/dispatch.c exports the plain names, bound at load time to the copy the CPU runs. A
 * build for one target (the run-time build's -march=native) has a single copy.
 *
 * Threads, borrowed. The kernels run their parallel loops on the OpenMP runtime torch has
 * loaded, found by native/library.py and handed over with pardec_use_openmp (native/parallel.c): the
 * library itself links no OpenMP runtime, so it can never bring a second one into the process
 * (two runtimes' threads would spin against each other on the same cores), whatever name
 * torch's copy carries. Without one, every loop runs on the calling thread.
 */

#ifndef PARDEC_NATIVE_KERNELS_H
#define PARDEC_NATIVE_KERNELS_H

#include <stdint.h>

#if !defined(PARDEC_ISA) && !defined(PARDEC_ANY_ISA)
#error "PARDEC_ISA names the instruction set a kernel source is compiled for (setup.py, native/library.py)"
#endif

#define PARDEC_JOIN2(name, isa) name##_##isa
#define PARDEC_JOIN(name, isa) PARDEC_JOIN2(name, isa)
#define PARDEC_API(name) PARDEC_JOIN(name, PARDEC_ISA)

/* body(context, begin, end): the iterations [begin, end) of a loop of ``count`` */
typedef void (*pardec_range_fn)(void *context, int64_t begin, int64_t end);

/* The loop split as OpenMP's schedule(static) splits it, over ``threads`` threads of the
 * borrowed runtime; on the calling thread alone where threads <= 1, count <= 1, there is no
 * runtime, or the runtime's threads sleep between parallel regions (native/parallel.c). */
void pardec_parallel_for(int64_t count, int threads, pardec_range_fn body, void *context);

#endif
