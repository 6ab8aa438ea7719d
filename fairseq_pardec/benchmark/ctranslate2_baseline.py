"""CTranslate2 next to our generators in the benchmark (``--generators ct2 ct2:compute_type=int8``).

Users who want a fairseq transformer to decode fast on a CPU today convert it to CTranslate2, so
the benchmark shows it on the same checkpoint, sentences and batches. The ``--path`` checkpoint is
converted once with CTranslate2's own fairseq converter (our plugin is its ``user_dir``, since a
checkpoint trained with ``--task translation_pardec`` names our task) and cached under the
benchmark's output folder. The length limit is fairseq's: at most
``min(max_len_a * src_len + max_len_b, max_positions - 1)`` tokens before EOS, ``src_len`` the
padded source length of the batch, and EOS barred at the first step (fairseq's ``--min-len 1``).
"""

import hashlib
import os
import pickle
import subprocess
import sys
import weakref

import torch

from fairseq_pardec.errors import UsageError
from fairseq_pardec.decoding.decode_stats import DecodeStats, count_hypotheses

INSTALL = "pip install ctranslate2 (or pip install -e '.[ct2]' in the project's folder)"
INSTALL_HINT = "CTranslate2 is not installed, and the ct2 generator needs it: " + INSTALL
OPTIONS = ("beam", "compute_type")


def import_ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    return ctranslate2


def check_options(options):
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise UsageError(
            "ct2 takes only %s; %s is not a CTranslate2 option here"
            % (" and ".join(OPTIONS), ", ".join(unknown))
        )
    beam = options.get("beam", 1)
    if type(beam) is not int or beam < 1:
        raise UsageError("ct2 beam=%r: the beam must be an integer >= 1" % (beam,))


def convert(model, checkpoint, data_dir, cache_root, source_lang=None, target_lang=None):
    """Convert ``checkpoint`` (whose loaded ``model`` is given) once; returns the model folder."""
    ctranslate2 = import_ctranslate2()
    if type(model).__module__.startswith("fairseq_pardec"):
        raise UsageError(
            "ct2 converts fairseq transformers; %s is a fairseq_pardec architecture (%s) that "
            "CTranslate2 cannot run" % (checkpoint, type(model).__name__)
        )
    info = os.stat(checkpoint)
    key = "%s|%d|%d" % (os.path.abspath(checkpoint), info.st_size, info.st_mtime_ns)
    out = os.path.join(cache_root, "ct2-" + hashlib.sha1(key.encode()).hexdigest()[:12])
    if os.path.isfile(os.path.join(out, "model.bin")):
        return out
    converter = ctranslate2.converters.FairseqConverter(
        checkpoint,
        data_dir,
        source_lang=source_lang,
        target_lang=target_lang,
        user_dir=os.path.dirname(os.path.abspath(__file__)),
    )
    tmp = out + ".tmp"
    try:
        converter.convert(tmp, force=True)
    except (ValueError, NotImplementedError) as error:  # the converter's configuration checks
        raise UsageError("CTranslate2 cannot convert %s: %s" % (checkpoint, str(error).splitlines()[0]))
    os.replace(tmp, out)
    return out


class CTranslate2Generator:
    """fairseq's generator interface over a ``ctranslate2.Translator`` in a process of its own
    (ctranslate2_worker.py): the same sentences, batches and threads, without torch's thread pool
    on the same cores.

    Times ``translate_batch`` only, inside the worker: turning ids into the token strings
    CTranslate2 takes, and back, and passing them between processes, is batching work that the
    other rows do not pay either.
    """

    def __init__(self, model_dir, src_dict, tgt_dict, beam=1, compute_type="default",
                 threads=1, device="cpu", max_len_a=0.0, max_len_b=200, max_positions=1024):
        import_ctranslate2()  # the install hint here, rather than from the worker
        self._worker = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "ctranslate2_worker.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        weakref.finalize(self, _stop, self._worker)
        self._request({"model_dir": model_dir, "device": device, "compute_type": compute_type,
                       "threads": threads},
                      "loading %s with compute_type=%s on %s" % (model_dir, compute_type, device))
        self.src_dict, self.tgt_dict = src_dict, tgt_dict
        self.beam = beam
        self.max_len_a, self.max_len_b, self.max_positions = max_len_a, max_len_b, max_positions
        self.stats = DecodeStats()
        self._skip = {src_dict.pad(), src_dict.eos()}  # CTranslate2 appends the source EOS itself

    def _request(self, message, what):
        """Send one message to the worker; its answer's payload, or a UsageError."""
        try:
            pickle.dump(message, self._worker.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._worker.stdin.flush()
            kind, payload = pickle.load(self._worker.stdout)
        except (EOFError, BrokenPipeError, pickle.UnpicklingError):
            raise UsageError("ct2: the CTranslate2 worker process ended (exit code %s)"
                             % self._worker.poll()) from None
        if kind == "missing":
            raise UsageError(
                "ct2: CTranslate2 is not installed for %s, which runs the ct2 worker (import "
                "ctranslate2: %s): %s" % (sys.executable, payload, INSTALL))
        if kind == "error":
            raise UsageError("ct2: %s (%s)" % (payload, what))
        return payload

    def _source_symbols(self, ids):
        return [self.src_dict[i] for i in ids if i not in self._skip]

    def _target_ids(self, symbols):
        pad = self.tgt_dict.pad()
        ids = [pad if s == "<blank>" else self.tgt_dict.index(s) for s in symbols]
        return torch.tensor(ids + [self.tgt_dict.eos()], dtype=torch.long)

    def generate(self, models, sample, **unused):
        src_tokens = sample["net_input"]["src_tokens"]
        src_len = src_tokens.size(1)
        max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_positions - 1)
        sources = [self._source_symbols(row) for row in src_tokens.tolist()]
        options = dict(beam_size=self.beam, max_decoding_length=max_len, min_decoding_length=1,
                       max_batch_size=0)
        best, seconds = self._request((sources, options), "translate_batch")
        self.stats.wall_time += seconds
        hypos = [[{"tokens": self._target_ids(symbols)}] for symbols in best]
        count_hypotheses(self.stats, hypos)
        # one token per decoding step: a sentence takes part in as many steps as it has tokens
        steps = max(len(h[0]["tokens"]) for h in hypos)
        self.stats.decoder_calls += steps
        self.stats.row_iterations += sum(len(h[0]["tokens"]) for h in hypos)
        return hypos


def _stop(worker):
    """End the worker: closing its input ends its loop; kill it if it does not."""
    try:
        worker.stdin.close()
        worker.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        worker.kill()
