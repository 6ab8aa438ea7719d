"""Variant (c) of the load benchmark: CTranslate2 float32 behind the same HTTP front, batching
per request, as a user who converts the model would serve it.

``python -m fairseq_pardec.benchmark.ct2_server DATA --path CKPT [fairseq-pardec-serve's
options]``: fairseq-pardec-serve's app, limits and text handling with ``--batching buffer``
forced, whose decoding is CTranslate2's ``translate_batch`` (greedy, float32) in its own process
(benchmark/ctranslate2_baseline.py), on the checkpoint converted once into ``--ct2-cache``.
"""

import os
import sys


def main(argv=None):
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from fairseq_pardec.benchmark.ctranslate2_baseline import CTranslate2Generator, convert
    from fairseq_pardec.errors import exit_in_one_line
    from fairseq_pardec.serve.__main__ import build_service
    from fairseq_pardec.serve.options import parse_args
    from fairseq_pardec.serve.server import serve

    import argparse

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--ct2-cache", default="benchmark-out/ct2-cache",
                     help="where the converted model is kept (converted once per checkpoint)")
    options, argv = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv + ["--batching", "buffer"])
        service = build_service(args)
        model = service.model
        model_dir = convert(model.models[0], args.path, args.data, options.ct2_cache,
                            args.source_lang, args.target_lang)
        model.generator = CTranslate2Generator(
            model_dir, model.src_dict, model.tgt_dict, beam=1, compute_type="float32",
            threads=int(os.environ.get("OMP_NUM_THREADS", "1")), max_len_a=args.max_len_a,
            max_len_b=args.max_len_b, max_positions=model.models[0].max_decoder_positions())
        serve(service, args.host, args.port, args.drain_timeout, log_level="warning")
    except Exception as error:
        exit_in_one_line(error)


if __name__ == "__main__":
    main()
