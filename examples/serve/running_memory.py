"""Whether the server's running batch holds on to memory: its resident memory, tensors and cache
shape after each lap of a batch that never empties, without HTTP, a client or threads.

    python examples/serve/running_memory.py DATA --path CKPT --input FILE [--sentences 300]
        [--laps 10] [--batch-size 32] [fairseq-pardec-serve's options]

The server's ``IterationBatch`` decodes the first ``--sentences`` lines of ``--input`` over and
over: whenever it has room, the next lines (in a cycle) are admitted, up to 8 at a time, as
requests arriving one by one would be, so that rows keep joining a batch that keeps running.
After every lap (``--sentences`` rows finished) it prints the process's resident memory
(``VmRSS``), the number of live tensors, and the fast step's cache (slots, positions a slot,
source positions), and how often the batch ran empty. A flat line here and a growing one in the
load benchmark's soak (``python -m fairseq_pardec.benchmark.serve --soak``) put the growth
outside the running batch: in the server around it, or in the allocator.
"""

import gc
import itertools
import os
import sys

from saturation import loaded


def main(argv=None):
    mine, args, model, rows_of = loaded(argv, laps=10)

    import torch
    from fairseq_pardec.benchmark.serve import resident_mb
    from fairseq_pardec.serve.running_batch import IterationBatch, Row

    batch = IterationBatch(model, args.batch_size, args.prepare_rows)
    arriving = itertools.cycle(range(len(rows_of)))
    finished = empties = 0
    with torch.no_grad():
        for lap in range(mine.laps):
            while finished < (lap + 1) * len(rows_of):
                room = min(batch.room(), 8)
                if room:
                    batch.admit([Row(source=rows_of[i], job=None, index=i)
                                 for i in itertools.islice(arriving, room)])
                finished += len(batch.step().finished)
                empties += not batch.running()
            gc.collect()
            cache = getattr(batch._batch, "cache", None)
            shape = ("%d slots x %d positions, %d source positions"
                     % (cache.slots, cache.capacity, cache.enc_keys[0].size(2))
                     if getattr(cache, "enc_keys", None) else "-")
            tensors = sum(isinstance(o, torch.Tensor) for o in gc.get_objects())
            print("lap %2d: RSS %7.1f MiB, %d tensors, cache %s, ran empty %d times"
                  % (lap, resident_mb(os.getpid()), tensors, shape, empties), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
