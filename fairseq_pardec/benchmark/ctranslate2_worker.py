"""CTranslate2 in a process of its own, for the benchmark's ``ct2`` rows.

In one process with torch, CTranslate2's thread pool and torch's share the cores and CTranslate2
ran several times slower than alone; a user who converts a model runs it alone. So the benchmark
starts this file as a script (it imports neither torch nor the plugin) and talks to it over its
standard input and output with pickled messages:

* first ``{"model_dir", "device", "compute_type", "threads"}``, answered ``("ready", None)``,
  ``("missing", message)`` where ctranslate2 cannot be imported here, or ``("error", message)``;
* then ``(source token lists, translate_batch keyword arguments)`` per batch, answered
  ``("ok", (best hypothesis per sentence, seconds spent in translate_batch))`` or
  ``("error", message)``.

The parent waits while the worker decodes, so the worker has the cores to itself.
"""

import pickle
import sys
import time


def _send(out, message):
    pickle.dump(message, out, protocol=pickle.HIGHEST_PROTOCOL)
    out.flush()


def _reason(error):
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def serve(inp, out):
    try:
        import ctranslate2
    except ImportError as error:
        # told before the first message is read: this interpreter lacks the package (or a
        # library it links), whatever the configuration asks
        _send(out, ("missing", _reason(error)))
        return
    try:
        config = pickle.load(inp)
        translator = ctranslate2.Translator(
            config["model_dir"], device=config["device"], compute_type=config["compute_type"],
            inter_threads=1, intra_threads=config["threads"],
        )
    except EOFError:
        return
    except Exception as error:  # reported to the parent, which raises it as a usage error
        _send(out, ("error", _reason(error)))
        return
    _send(out, ("ready", None))
    while True:
        try:
            sources, options = pickle.load(inp)
        except EOFError:
            return
        try:
            start = time.perf_counter()
            results = translator.translate_batch(sources, **options)
            seconds = time.perf_counter() - start
        except Exception as error:
            _send(out, ("error", _reason(error)))
            continue
        _send(out, ("ok", ([r.hypotheses[0] for r in results], seconds)))


if __name__ == "__main__":
    # the protocol owns stdout: anything else printed goes to stderr
    protocol_out = sys.stdout.buffer
    sys.stdout = sys.stderr
    serve(sys.stdin.buffer, protocol_out)
