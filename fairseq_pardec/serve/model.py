"""The model a server replica decodes with, and its text in and out, as fairseq-interactive has
them: the same task set-up, checkpoint loading, generator, tokenizer and BPE, the same encoding
of a line (``task.get_interactive_tokens_and_lengths``), batches from the task's own
``build_dataset_for_inference`` (``--truncate-source`` included) and the same post-processing of a
hypothesis (``utils.post_process_prediction``'s text, then BPE and tokenizer decoding). Only the
loop around them differs: requests instead of standard input.
"""

import ast
import logging
import math
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from fairseq_pardec.decoding.draft_verify.engine import DraftVerifyGenerator
from fairseq_pardec.decoding.step import calibration
from fairseq_pardec.tasks.warm_up import decode_quietly

logger = logging.getLogger("fairseq_pardec.serve")


@dataclass
class Output:
    """One decoded text: what fairseq-interactive prints as D- (``text``), H- (``tokens``, the
    hypothesis before BPE and tokenizer decoding) and its score and P- (base 2, as printed)."""

    text: str
    tokens: List[str]
    score: Optional[float]  # None where the generator gives none (CTranslate2's)
    positional_scores: List[float]


class LoadedModel:
    """Everything fairseq-interactive builds before its loop, built once from its config."""

    def __init__(self, args):
        from fairseq import checkpoint_utils, tasks, utils
        from fairseq.dataclass.utils import convert_namespace_to_omegaconf
        from fairseq_cli.generate import get_symbols_to_strip_from_output

        cfg = convert_namespace_to_omegaconf(args)
        utils.import_user_module(cfg.common)
        if cfg.common.seed is not None and not cfg.generation.no_seed_provided:
            np.random.seed(cfg.common.seed)  # --sampling draws as fairseq-interactive's do
            utils.set_torch_seed(cfg.common.seed)
        self.cfg = cfg
        self.use_cuda = torch.cuda.is_available() and not cfg.common.cpu
        task = tasks.setup_task(cfg.task)
        task.report_summary = False  # the server's metrics report, not a summary at exit
        # a draft-and-verify generator decodes one synthetic sentence when built, so that its
        # one-time set-up is not paid by the first request (tasks/warm_up.py)
        task.warm_up_generators = True
        overrides = ast.literal_eval(cfg.common_eval.model_overrides)
        models, _ = checkpoint_utils.load_model_ensemble(
            utils.split_paths(cfg.common_eval.path), arg_overrides=overrides, task=task,
            suffix=cfg.checkpoint.checkpoint_suffix,
            strict=(cfg.checkpoint.checkpoint_shard_count == 1),
            num_shards=cfg.checkpoint.checkpoint_shard_count,
        )
        for model in models:
            if cfg.common.fp16:
                model.half()
            if self.use_cuda:
                model.cuda()
            model.prepare_for_inference_(cfg)
        self.task, self.models = task, models
        self.src_dict, self.tgt_dict = task.source_dictionary, task.target_dictionary
        self.generator = task.build_generator(models, cfg.generation)
        self.tokenizer = task.build_tokenizer(cfg.tokenizer)
        self.bpe = task.build_bpe(cfg.bpe)
        self.align_dict = utils.load_align_dict(cfg.generation.replace_unk)
        self.strip = get_symbols_to_strip_from_output(self.generator)
        max_positions = utils.resolve_max_positions(
            task.max_positions(), *[model.max_positions() for model in models])
        self.source_limit = _source_limit(max_positions)
        self.truncates = bool(getattr(cfg.task, "truncate_source", False))
        self.nbest = cfg.generation.nbest
        self._warm_fairseq_search()
        self.margin_rows = self._measure_margins()

    # ------------------------------------------------------------------ text in
    def encode_text(self, text: str) -> str:
        if self.tokenizer is not None:
            text = self.tokenizer.encode(text)
        if self.bpe is not None:
            text = self.bpe.encode(text)
        return text

    def encode(self, text: str) -> torch.Tensor:
        """The source token ids of one line (EOS last), as fairseq-interactive makes them."""
        tokens, _ = self.task.get_interactive_tokens_and_lengths([text], self.encode_text)
        return tokens[0]

    def too_long(self, source: torch.Tensor) -> bool:
        """Whether the model cannot take ``source``: fairseq-interactive refuses such a line,
        unless --truncate-source cuts it (the task's build_dataset_for_inference)."""
        return self.source_limit is not None and not self.truncates and len(source) > self.source_limit

    # ------------------------------------------------------------------ decoding
    def batch(self, sources: List[torch.Tensor]) -> dict:
        """A batch of ``sources`` (sample ids = their positions in the list), on the device."""
        from fairseq import utils

        dataset = self.task.build_dataset_for_inference(sources, [len(s) for s in sources])
        sample = dataset.collater([dataset[i] for i in range(len(sources))])
        return utils.move_to_cuda(sample) if self.use_cuda else sample

    def decode(self, sample: dict) -> list:
        """The generator's hypotheses for ``sample``, one list per sentence in the sample's order
        (``sample["id"]`` maps them back)."""
        with torch.no_grad():
            return self.task.inference_step(self.generator, self.models, sample)

    def _measure_margins(self) -> int:
        """A guarded draft-and-verify generator measures its margins on the model's first rows
        of real text before it decides with them (step/calibration.py), at batch 1 a row a
        batch: each of a server's first requests would wait for a row's measurement. Where
        DATA holds a binarized split (valid, else test), its first rows are decoded here, once,
        before the server says it is ready. Returns how many rows were decoded (0: none, the
        first requests measure)."""
        from fairseq import utils

        generator = self.generator
        if not isinstance(generator, DraftVerifyGenerator) or not generator._guarded():
            return 0
        for split in ("valid", "test"):
            try:
                self.task.load_dataset(split)
            except Exception as error:  # no such split (FileNotFoundError), or none readable
                logger.debug("no %s split to measure the margins on: %s", split, error)
                continue
            dataset = self.task.dataset(split)
            rows = min(calibration.ROWS, len(dataset))
            if rows == 0:
                continue
            sample = dataset.collater([dataset[i] for i in range(rows)])
            if self.use_cuda:
                sample = utils.move_to_cuda(sample)
            if decode_quietly(generator, self.models[0], sample):
                logger.info("margins measured on the first %d sentences of DATA's %s split "
                            "before serving", rows, split)
                return rows
        logger.info("DATA holds no binarized valid or test split: the margins are measured on the "
                    "first requests (each of the first %d waits for a row's measurement)",
                    calibration.ROWS)
        return 0

    def _warm_fairseq_search(self):
        """fairseq's own search (beam, greedy) is not warmed by the task: one short decode of
        the first dictionary words here, so that readiness means warm for every generator.
        Stateless: a draft-and-verify generator was warmed without drafting when built."""
        if isinstance(self.generator, DraftVerifyGenerator):
            return
        first = self.src_dict.nspecial
        words = torch.arange(first, min(first + 8, len(self.src_dict)))
        self.decode(self.batch([torch.cat([words, torch.tensor([self.src_dict.eos()])])]))

    # ------------------------------------------------------------------ text out
    def output(self, source: torch.Tensor, hypothesis: dict) -> Output:
        """fairseq-interactive's D-, H- and P- lines of one hypothesis of ``source``.

        The hypothesis's text is ``utils.post_process_prediction``'s, without its last step: it
        encodes that text again with ``add_if_not_exist=True``, which adds every new word of
        an output (BPE removed) to the target dictionary. A command decoding a file forgets
        that; a server would keep every word it ever output, and the dictionary would no
        longer be the model's."""
        from fairseq import utils

        post_process = self.cfg.common_eval.post_process
        # a list: the dictionary reads it as the tensor, without a tensor per token
        hypo_str = self.tgt_dict.string(hypothesis["tokens"].tolist(), post_process,
                                        extra_symbols_to_ignore=self.strip)
        if self.align_dict is not None:  # --replace-unk
            src_str = self.src_dict.string(utils.strip_pad(source, self.src_dict.pad()),
                                           post_process)
            hypo_str = utils.replace_unk(hypo_str, src_str, hypothesis.get("alignment"),
                                         self.align_dict, self.tgt_dict.unk_string())
        text = hypo_str
        if self.bpe is not None:
            text = self.bpe.decode(text)
        if self.tokenizer is not None:
            text = self.tokenizer.decode(text)
        positional = hypothesis.get("positional_scores")
        return Output(
            text=text, tokens=hypo_str.split(),
            score=None if "score" not in hypothesis else float(hypothesis["score"]) / math.log(2),
            positional_scores=[] if positional is None
            else [round(x / math.log(2), 4) for x in positional.tolist()],
        )

    @property
    def shares_vocabulary(self) -> bool:
        """Source and target in one vocabulary (GEC, post-editing): the page shows the edits."""
        return self.src_dict.symbols == self.tgt_dict.symbols


def _source_limit(max_positions) -> Optional[int]:
    if isinstance(max_positions, (tuple, list)):
        max_positions = max_positions[0]
    return None if max_positions is None else int(max_positions)
