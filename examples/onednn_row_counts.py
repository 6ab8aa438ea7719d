"""What a new row count costs oneDNN's packed product: the memory its primitive keeps, and the
first call's wait for the build.

    python examples/onednn_row_counts.py [--out 1024] [--in 256] [--counts 20] [--threads 2]

For row counts near 8, 32, 100, 400, 1600 and 4000, ``--counts`` new counts each are multiplied
once (on ``torch.ops.mkldnn._linear_pointwise`` as it is, not through step/onednn.py's padding)
and again: the growth of glibc's in-use memory (``mallinfo2``) per new count, and the mean time
of a first and of a second call. Linux with glibc only.
"""

import argparse
import ctypes
import gc
import time

import torch


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=int, default=1024)
    parser.add_argument("--in", dest="inputs", type=int, default=256)
    parser.add_argument("--counts", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def in_use_mib() -> float:
        info = libc.mallinfo2()
        return (info.uordblks + info.hblkhd) / 2 ** 20

    weight = torch.randn(args.out, args.inputs)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def product(x):
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    print("weight %d x %d, %d threads" % (args.out, args.inputs, args.threads))
    for near in (8, 32, 100, 400, 1600, 4000):
        xs = [torch.randn(near + j, args.inputs) for j in range(args.counts)]
        gc.collect()
        before = in_use_mib()
        started = time.perf_counter()
        for x in xs:
            product(x)
        first = (time.perf_counter() - started) / len(xs)
        gc.collect()
        grown = (in_use_mib() - before) / len(xs)
        started = time.perf_counter()
        for x in xs:
            product(x)
        again = (time.perf_counter() - started) / len(xs)
        print("rows ~%4d: %.3f MiB kept per new count; first call %.2f ms, second %.2f ms"
              % (near, grown, 1e3 * first, 1e3 * again))


if __name__ == "__main__":
    main()
