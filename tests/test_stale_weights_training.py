"""``fairseq-train --eval-bleu`` with a fast generator validates with the weights of that epoch:
fairseq's Adam writes the parameters through ``p.data``, which the fast layouts must follow
(step/weights_key.py). Run in-process through fairseq's own ``cli_main``."""

import os
import random
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.path.join(ROOT, "fairseq_pardec")


def _cli(module, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [module.__name__] + [str(a) for a in argv])
    module.cli_main()


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory):
    """A toy copy task (target = source) of 240 training and 24 validation sentences."""
    from fairseq_cli import preprocess

    root = tmp_path_factory.mktemp("eval-bleu")
    rng = random.Random(0)
    words = ["w%d" % i for i in range(24)]
    for split, n in (("train", 240), ("valid", 24)):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(n)]
        for side in ("src", "tgt"):
            (root / ("%s.%s" % (split, side))).write_text("\n".join(lines) + "\n")
    data = root / "bin"
    with pytest.MonkeyPatch.context() as monkeypatch:
        _cli(preprocess, ["--source-lang", "src", "--target-lang", "tgt", "--trainpref",
                          root / "train", "--validpref", root / "valid", "--destdir", data,
                          "--joined-dictionary", "--workers", 1], monkeypatch)
    return data


def _validations(data, generator, save_dir, extra=(), steps=None):
    """Train two epochs with ``--eval-bleu --generator GENERATOR`` (and ``extra`` options);
    every hypothesis each validation decoded, in order, per validation. ``steps``: a list the
    type of each validation batch's decoder step is appended to (draft-and-verify generators)."""
    from fairseq.tasks.translation import TranslationTask
    from fairseq_cli import train

    decoded = []
    inference_step = TranslationTask.inference_step

    def recorded(self, generator, models, sample, prefix_tokens=None, constraints=None):
        out = inference_step(self, generator, models, sample, prefix_tokens, constraints)
        if steps is not None:
            steps.append(type(generator.block_decoder))
        decoded.append({int(i): h[0]["tokens"].tolist() for i, h in zip(sample["id"], out)})
        return out

    epochs = []
    validate = train.validate

    def per_epoch(*args, **kwargs):
        decoded.clear()
        result = validate(*args, **kwargs)
        epochs.append(list(decoded))
        return result

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(TranslationTask, "inference_step", recorded)
        monkeypatch.setattr(train, "validate", per_epoch)
        try:
            _cli(train, [
                data, "--user-dir", PLUGIN, "--task", "translation_pardec", "--generator", generator,
                "--arch", "transformer", "--encoder-layers", 1, "--decoder-layers", 1,
                "--encoder-embed-dim", 32, "--decoder-embed-dim", 32, "--encoder-ffn-embed-dim", 64,
                "--decoder-ffn-embed-dim", 64, "--encoder-attention-heads", 2,
                "--decoder-attention-heads", 2, "--share-all-embeddings", "--dropout", 0.1,
                "--optimizer", "adam", "--lr", 0.01, "--batch-size", 16, "--max-epoch", 2,
                "--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_a": 1.2, "max_len_b": 10}',
                "--no-save", "--save-dir", save_dir, "--no-progress-bar", "--log-format", "simple",
                "--num-workers", 0, "--seed", 1, "--cpu", "--required-batch-size-multiple", 1,
                *extra,
            ], monkeypatch)
        finally:
            torch.set_num_threads(threads)  # fairseq's training sets its own
    return epochs


@pytest.mark.trains
def test_every_validation_of_a_fast_generator_is_greedys(copy_data, tmp_path):
    greedy = _validations(copy_data, "greedy", tmp_path / "greedy")
    lean = _validations(copy_data, "lean_greedy", tmp_path / "lean")
    assert len(greedy) >= 2 and all(greedy)  # a validation or more per epoch
    # the check means something only where the weights moved the outputs between epochs
    assert greedy[0] != greedy[-1]
    assert lean == greedy


@pytest.mark.trains
def test_validations_decode_with_the_step_for_the_model_as_moved(copy_data, tmp_path):
    """fairseq builds the --eval-bleu generator before it moves the model (to the GPU, or with
    --fp16 to float16): each validation decodes with the step chosen for the model as it is
    then (factory.StepChoice), the lean step in float16, not the float32 CPU step the model
    had when the generator was built. (In float16 no output is claimed identical to
    fairseq's: step/margins.py.)"""
    from fairseq_pardec.decoding.step.lean import LeanBlockDecoder

    steps = []
    # (fairseq's flattened float32 copy of the parameters is made on CUDA only)
    epochs = _validations(copy_data, "lean_greedy", tmp_path / "fp16",
                          extra=["--fp16", "--fp16-no-flatten-grads"], steps=steps)
    assert len(epochs) >= 2 and all(epochs)
    assert steps and set(steps) == {LeanBlockDecoder}
