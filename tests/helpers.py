"""Tiny in-process models and batches for tests (no network, no ../shared)."""

import argparse

import torch
from fairseq.data import Dictionary, LanguagePairDataset
from fairseq.models.transformer import TransformerModel, base_architecture
from fairseq.sequence_generator import SequenceGenerator

from fairseq_pardec.tasks.translation_pardec import TranslationPardecConfig, TranslationPardecTask


def make_dictionary(n_words=40, prefix="w"):
    d = Dictionary()
    for i in range(n_words):
        d.add_symbol("%s%d" % (prefix, i))
    d.finalize(padding_factor=1)
    return d


def make_task(src_dict, tgt_dict=None, **cfg_overrides):
    cfg = TranslationPardecConfig(**cfg_overrides)
    return TranslationPardecTask(cfg, src_dict, tgt_dict or src_dict)


def tiny_args(**overrides):
    args = argparse.Namespace(
        encoder_embed_dim=32,
        encoder_ffn_embed_dim=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        decoder_embed_dim=32,
        decoder_ffn_embed_dim=64,
        decoder_layers=2,
        decoder_attention_heads=4,
        dropout=0.0,
        max_source_positions=256,
        max_target_positions=256,
        share_all_embeddings=False,
        share_decoder_input_output_embed=True,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    base_architecture(args)
    return args


def tiny_transformer(task, seed=0, **overrides):
    torch.manual_seed(seed)
    model = TransformerModel.build_model(tiny_args(**overrides), task)
    model.eval()
    return model


def random_batch(src_dict, lengths, seed=0, tgt_dict=None, vocab_range=None):
    """A fairseq sample of random sentences with the given source lengths (EOS added)."""
    g = torch.Generator().manual_seed(seed)
    lo = src_dict.nspecial
    hi = len(src_dict) if vocab_range is None else lo + vocab_range
    sources = [
        torch.cat([torch.randint(lo, hi, (n,), generator=g), torch.tensor([src_dict.eos()])])
        for n in lengths
    ]
    return collate(src_dict, sources, tgt_dict)


def collate(src_dict, sources, tgt_dict=None, targets=None):
    tgt_dict = tgt_dict or src_dict
    sizes = [len(s) for s in sources]
    dataset = LanguagePairDataset(
        sources, sizes, src_dict, tgt=targets, tgt_sizes=None if targets is None else [len(t) for t in targets],
        tgt_dict=tgt_dict, left_pad_source=True,
    )
    return dataset.collater([dataset[i] for i in range(len(sources))])


def fairseq_greedy(model, tgt_dict, sample, **kwargs):
    generator = SequenceGenerator([model], tgt_dict, beam_size=1, **kwargs)
    with torch.no_grad():
        return generator.generate([model], sample)


def by_id(sample, hypos):
    """{sentence id: token list} of the best hypothesis of each sentence."""
    return {int(i): h[0]["tokens"].tolist() for i, h in zip(sample["id"], hypos)}


def pooled(make_sample, batch_size, first_seed, sentences=64):
    """Batches of ``batch_size`` holding ``sentences`` sentences in all, the first one seeded
    ``first_seed``. Quality thresholds (tokens per iteration of a trained drafter) are checked
    on all of them: on one sentence a single token accepted more or less moves the ratio by
    0.1 or more, as the CPU's kernels round a trained model's weights differently."""
    return [make_sample(batch_size, seed=first_seed + k) for k in range(max(1, sentences // batch_size))]
