"""A/B of two native kernel libraries in one process: the products and best-two calls of a
decoding step timed alternately, library by library, median per shape.

    python examples/native_kernel_ab.py A.so B.so [C.so ...] [--rounds 30] [--calls 20]

A library built before the OpenMP runtime was borrowed (linked with -fopenmp) runs as it is; one
of this version (native/dispatch.c) gets torch's runtime handed over as native/library.py does. Timings
on a machine others use are noisy: compare only within one run, the libraries alternating.
"""

import argparse
import ctypes
import statistics
import time

import numpy as np
import torch

from fairseq_pardec.native import library as native


def load(path):
    library = ctypes.CDLL(path)
    if hasattr(library, "pardec_use_openmp"):
        native._bind_openmp(library, native._torch_openmp(native.openmp_runtimes()))
    library.pardec_linear.restype = None
    library.pardec_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    library.pardec_best_two.restype = None
    library.pardec_best_two.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return library


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("libraries", nargs="+")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    libraries = [load(path) for path in args.libraries]
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    # a d512 decoder layer's products and an 8k-type projection, at batch-1 and batch-32 rows
    shapes = [(rows, n, k) for rows in (1, 8, 32) for n, k in
              ((1536, 512), (2048, 512), (512, 2048), (8496, 512))]
    cases = []
    for rows, n, k in shapes:
        weight = torch.randn(n, k, generator=g)
        count = -(-n // 32)
        panels = torch.zeros(count * 32, k)
        panels[:n] = weight
        panels = panels.view(count, 32, k).transpose(1, 2).contiguous()
        x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
        out = torch.empty(rows, n)

        def product(library, x=x, panels=panels, bias=bias, out=out, n=n):
            library.pardec_linear(x.data_ptr(), x.size(0), x.size(1), panels.data_ptr(),
                                  bias.data_ptr(), None, out.data_ptr(), n, 0, threads)

        cases.append(("linear %2d x %5d x %4d" % (rows, n, k), product))
    for rows in (1, 6, 32):
        scores = torch.randn(rows, 8496, generator=g)
        values, best = np.empty((rows, 2), np.float32), np.empty(rows, np.int64)

        def best_two(library, scores=scores, values=values, best=best):
            library.pardec_best_two(scores.data_ptr(), scores.size(0), scores.size(1),
                                    values.ctypes.data, best.ctypes.data, threads)

        cases.append(("best_two %2d x 8496" % rows, best_two))
    print("threads %d; median us per call over %d rounds of %d calls, libraries alternating"
          % (threads, args.rounds, args.calls))
    print("%-26s" % "" + "".join("%14s" % path.split("/")[-1][:13] for path in args.libraries))
    for name, call in cases:
        times = [[] for _ in libraries]
        for library in libraries:
            for _ in range(3):
                call(library)
        for _ in range(args.rounds):
            for i, library in enumerate(libraries):
                start = time.perf_counter()
                for _ in range(args.calls):
                    call(library)
                times[i].append((time.perf_counter() - start) / args.calls * 1e6)
        medians = [statistics.median(t) for t in times]
        print("%-26s" % name + "".join("%14.1f" % m for m in medians)
              + "   B/A %.3f" % (medians[1] / medians[0]) if len(medians) > 1 else "")


if __name__ == "__main__":
    main()
