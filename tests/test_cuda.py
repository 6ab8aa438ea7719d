"""The lossless contract on a GPU, and the float16 divergence audit (skipped without CUDA).

Run on a GPU machine with ``pytest -m cuda tests``. In float32 the engine must equal fairseq
greedy on CUDA as on the CPU; in float16 a verified block and a one-token step use different
kernels and can round differently, so that test measures and prints how often the output
differs (the README's contract), and only checks that the audit runs on real decoding.
"""

import copy

import pytest
import torch

from fairseq_pardec.benchmark.runner import divergence
from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.fairseq_rules import running_scores
from fairseq_pardec.decoding.draft_verify.drafters.lookup import LookupDrafter, NgramTable

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer
from test_engine_lossless import RandomDrafter, lengths

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def to_cuda(sample):
    from fairseq import utils

    return utils.move_to_cuda(sample)


def test_running_scores_on_cuda_equal_cpu():
    g = torch.Generator().manual_seed(0)
    start, steps = -30 * torch.rand(7, generator=g), -5 * torch.rand(7, 33, generator=g)
    assert torch.equal(running_scores(start.cuda(), steps.cuda()).cpu(), running_scores(start, steps))


@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_random_model_lossless_fp32(batch_size):
    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=batch_size).cuda()
    sample = to_cuda(random_batch(d, lengths(batch_size), seed=batch_size))
    expected = fairseq_greedy(model, d, sample, max_len_a=1.2, max_len_b=10)
    table = NgramTable([h[0]["tokens"][:-1].tolist() for h in expected], len(d), d.eos(), d.eos())
    for drafter in (CopyDrafter(d, d), RandomDrafter(len(d), d.pad()),
                    LookupDrafter(d, d, table, adaptive=True)):
        generator = DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), max_len_a=1.2, max_len_b=10)
        assert by_id(sample, generator.generate([model], sample)) == by_id(sample, expected)


@pytest.mark.trains
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_trained_copy_model_lossless_fp32(copy_model, batch_size):
    model, d, make_sample = copy_model
    model = copy.deepcopy(model).cuda()
    sample = to_cuda(make_sample(batch_size, seed=200 + batch_size))
    expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=10)
    generator = DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(), max_len_a=1.0, max_len_b=10)
    assert by_id(sample, generator.generate([model], sample)) == by_id(sample, expected)


@pytest.mark.trains
def test_fp16_divergence_audit(copy_model):
    model, d, make_sample = copy_model
    model = copy.deepcopy(model).cuda().half()
    outputs, reference = {}, {}
    for seed in range(8):
        sample = to_cuda(make_sample(64, seed=300 + seed))
        ids = [int(i) + 1000 * seed for i in sample["id"]]
        expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=10)
        got = DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(),
                                   max_len_a=1.0, max_len_b=10).generate([model], sample)
        for i, e, o in zip(ids, expected, got):
            reference[i], outputs[i] = e[0]["tokens"].cpu(), o[0]["tokens"].cpu()
    identical, first = divergence(outputs, reference)
    print("fp16 iad vs fp16 greedy on %s: %.2f%% identical, first difference at token %s"
          % (torch.cuda.get_device_name(0), 100 * identical, first))
    assert len(outputs) == 8 * 64
    assert identical > 0.5  # a decisive (trained) model: rounding flips few choices
