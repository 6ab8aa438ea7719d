"""``fairseq-pardec-serve DATA --path CKPT --generator auto [fairseq-interactive's options]``
(also ``python -m fairseq_pardec.serve``): one replica. Errors before it serves are one line and
exit status 1; after a drain (SIGTERM) it exits 0."""

import logging
import os
import sys


def build_service(args):
    from fairseq_pardec.serve.app import Service
    from fairseq_pardec.serve.batcher import Batcher, Buffer, JoinNow
    from fairseq_pardec.serve.limits import Limits
    from fairseq_pardec.serve.metrics import Metrics
    from fairseq_pardec.serve.model import LoadedModel
    from fairseq_pardec.serve.page import render
    from fairseq_pardec.serve.running_batch import running_batch_for

    model = LoadedModel(args)
    metrics = Metrics()
    admission = (JoinNow() if args.batching in ("join", "rounds")
                 else Buffer(args.batch_size, args.batch_wait_ms / 1000.0))
    running = running_batch_for(model, args.batch_size, args.batching, args.prepare_rows)
    batcher = Batcher(running, admission,
                      args.max_pending_rows, metrics)
    page = render(args.path, str(getattr(args, "generator", "beam")), model.shares_vocabulary)
    return Service(model=model, batcher=batcher, limits=Limits.from_args(args, model),
                   metrics=metrics, page=page)


def cli_main(argv=None):
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S",
                        level=os.environ.get("LOGLEVEL", "INFO").upper(), stream=sys.stderr)
    from fairseq_pardec.errors import exit_in_one_line
    from fairseq_pardec.serve.options import parse_args
    from fairseq_pardec.serve.server import serve

    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        service = build_service(args)
        serve(service, args.host, args.port, args.drain_timeout)
    except Exception as error:  # the command line's boundary: known user errors in one line
        exit_in_one_line(error)


if __name__ == "__main__":
    cli_main()
