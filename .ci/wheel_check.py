"""Run by .ci/wheel-check.sh with the interpreter of a fresh venv holding the package's wheel,
from outside the checkout: the native kernels load from the installed package, built at install
time (nothing is compiled now), and a tiny lean_greedy decode on them gives fairseq's greedy
output."""

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from fairseq.data import Dictionary, LanguagePairDataset
from fairseq.dataclass.configs import GenerationConfig
from fairseq.models.transformer import TransformerModel, base_architecture
from fairseq.sequence_generator import SequenceGenerator

import fairseq_pardec
from fairseq_pardec.native import library as native
from fairseq_pardec.decoding.cpu.products import NATIVE
from fairseq_pardec.tasks.translation_pardec import TranslationPardecConfig, TranslationPardecTask


def fail(message):
    print("wheel check: FAILED: " + message, file=sys.stderr)
    sys.exit(1)


def main():
    checkout = Path(sys.argv[1]).resolve()
    package = Path(fairseq_pardec.__file__).resolve().parent
    if checkout in package.parents:
        fail("fairseq_pardec imported from the checkout (%s), not from the wheel" % package)
    kernel = native.native_kernel()
    if kernel is None:
        fail("no native kernel: %s" % native.native_unavailable_reason())
    if not kernel.installed or kernel.path.parent != package / "native":
        fail("the native kernel was not the installed one: %s" % kernel.path)
    built = list(Path(os.environ["FAIRSEQ_PARDEC_CACHE"]).glob("native-*.so"))
    if built:
        fail("something was compiled at run time: %s" % built)

    d = Dictionary()
    for i in range(40):
        d.add_symbol("w%d" % i)
    d.finalize(padding_factor=1)
    task = TranslationPardecTask(TranslationPardecConfig(generator="lean_greedy"), d, d)
    args = argparse.Namespace(encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_layers=2,
                              encoder_attention_heads=4, decoder_embed_dim=32,
                              decoder_ffn_embed_dim=64, decoder_layers=2,
                              decoder_attention_heads=4, dropout=0.0, max_source_positions=256,
                              max_target_positions=256, share_all_embeddings=False,
                              share_decoder_input_output_embed=True)
    base_architecture(args)
    torch.manual_seed(0)
    model = TransformerModel.build_model(args, task).eval()
    g = torch.Generator().manual_seed(0)
    sources = [torch.cat([torch.randint(d.nspecial, len(d), (n,), generator=g),
                          torch.tensor([d.eos()])]) for n in (5, 9, 3, 12)]
    limits = dict(max_len_a=1.2, max_len_b=10)
    expected, got = [], []
    for source in sources:  # batch 1, as a CLI run with --batch-size 1
        dataset = LanguagePairDataset([source], [len(source)], d, left_pad_source=True)
        sample = dataset.collater([dataset[0]])
        with torch.no_grad():
            greedy = SequenceGenerator([model], d, beam_size=1, **limits)
            expected.append(greedy.generate([model], sample)[0][0]["tokens"].tolist())
            generator = task.build_generator(
                [model], argparse.Namespace(**dict(asdict(GenerationConfig()), beam=1, **limits)))
            got.append(generator.generate([model], sample)[0][0]["tokens"].tolist())
    if got != expected:
        fail("lean_greedy differs from fairseq's greedy: %s against %s" % (got, expected))
    step = generator.block_decoder
    if type(step).__name__ != "FastBlockDecoder" or step.kernels.kernel_for(1) != NATIVE:
        fail("the decode did not run on the native kernel (%s, %s)"
             % (type(step).__name__, step.kernels.chosen()))
    print("wheel check: fairseq_pardec from %s; native kernel %s (%s, OpenMP: %s); a lean_greedy "
          "decode on it equals fairseq's greedy" % (package, kernel.path.name, kernel.variant,
                                                     kernel.openmp))


if __name__ == "__main__":
    main()
