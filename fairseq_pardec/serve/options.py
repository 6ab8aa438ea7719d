"""The server's command line: fairseq-interactive's own parser (DATA, --path, -s/-t, --bpe,
--tokenizer, --remove-bpe, --generator, --cpu, --fp16, ...) with one group of serving options.

fairseq's ``--batch-size`` is the most rows decoded together (default 32: fairseq-interactive's
default of 1 would decode one row at a time).
"""

import argparse

from fairseq_pardec.errors import UsageError

DEFAULT_BATCH_ROWS = 32
BATCHING_MODES = ("join", "rounds", "buffer")


def add_serve_args(parser):
    group = parser.add_argument_group("serving (fairseq-pardec-serve)")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    group.add_argument("--port", type=int, default=8000,
                       help="port to listen on (default 8000; 0: any free port, printed at start)")
    group.add_argument("--batching", choices=BATCHING_MODES, default="join",
                       help="join: waiting rows join the running batch at its next iteration "
                       "(a draft-and-verify --generator on the CPU's lean or fast step; others "
                       "between two decoding rounds); rounds: waiting rows join between two "
                       "rounds, each decoded to its end; buffer: gather up to --batch-size rows "
                       "or --batch-wait-ms, then decode that batch to its end, as TorchServe and "
                       "CTranslate2's buffer do (default join)")
    group.add_argument("--prepare-rows", type=int, default=None,
                       help="--batching join: when more texts wait than the running batch has "
                       "free places, up to this many more are encoded in the same call and "
                       "join as places free up, so that a queue is encoded a batch at a time "
                       "(default: --batch-size; 0: each text is encoded as it joins)")
    group.add_argument("--batch-wait-ms", type=float, default=10.0,
                       help="--batching buffer: how long the first waiting row waits for others "
                       "(default 10)")
    group.add_argument("--max-pending-rows", type=int, default=1024,
                       help="texts waiting or decoding at once; past it a request gets 503 with "
                       "Retry-After (default 1024)")
    group.add_argument("--max-texts", type=int, default=128,
                       help="texts in one request; more: 413 (default 128)")
    group.add_argument("--max-request-bytes", type=int, default=1 << 20,
                       help="size of a request's body; larger: 413 (default 1 MiB)")
    group.add_argument("--request-timeout", type=float, default=60.0,
                       help="seconds a request may take, unless it asks for less (timeout_ms); "
                       "past it: 504 (default 60)")
    group.add_argument("--drain-timeout", type=float, default=120.0,
                       help="on SIGTERM, seconds to let running requests finish before those "
                       "left get 503 and the process exits (default 120)")
    return parser


def build_parser():
    from fairseq import options

    parser = options.get_interactive_generation_parser(default_task="translation_pardec")
    parser.prog = "fairseq-pardec-serve"
    return add_serve_args(parser)


def parse_args(argv):
    """fairseq's namespace for ``argv`` (its two-stage parse: task and architecture options
    included), with the serving options checked."""
    from fairseq import options

    import fairseq_pardec  # noqa: F401  (registers the task before fairseq's parser asks for it)

    args = options.parse_args_and_arch(build_parser(), argv)
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH_ROWS
    check(args)
    return args


def check(args: argparse.Namespace):
    for flag in ("batch_size", "max_pending_rows", "max_texts", "max_request_bytes"):
        if getattr(args, flag) < 1:
            raise UsageError("--%s must be >= 1 (got %s)" % (flag.replace("_", "-"), getattr(args, flag)))
    for flag in ("request_timeout", "drain_timeout"):
        if not getattr(args, flag) > 0:
            raise UsageError("--%s must be > 0 seconds (got %s)" % (flag.replace("_", "-"), getattr(args, flag)))
    if args.prepare_rows is not None and args.prepare_rows < 0:
        raise UsageError("--prepare-rows must be >= 0 (got %s)" % args.prepare_rows)
    if args.batch_wait_ms < 0:
        raise UsageError("--batch-wait-ms must be >= 0 (got %s)" % args.batch_wait_ms)
    if args.max_texts > args.max_pending_rows:
        raise UsageError("--max-texts %d is more than --max-pending-rows %d: such a request could "
                         "never be taken; raise --max-pending-rows or lower --max-texts"
                         % (args.max_texts, args.max_pending_rows))
    if not 0 <= args.port <= 65535:
        raise UsageError("--port must be in 0..65535 (got %d)" % args.port)
