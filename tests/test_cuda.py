"""The static step on a GPU, the lossless contract there, and the float16 divergence audit
(skipped without CUDA).

Run on a GPU machine with ``pytest -m cuda tests``. The static step's CUDA graphs replay what the
same code computes eagerly (the code tests/test_static_step.py checks on the CPU), with bucket
padding and rows leaving mid-bucket, and never read the device inside a call. In float32 the
engine on it must equal fairseq greedy on CUDA as on the CPU; in float16 a verified block and a
one-token step use different kernels and can round differently, so that test measures and prints
how often the output differs (the README's contract), and only checks that the audit runs on
real decoding.
"""

import copy

import pytest
import torch

from fairseq_pardec.benchmark.runner import divergence
from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.draft_verify.drafters.lookup import LookupDrafter, NgramTable
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.cuda.static import StaticBlockDecoder

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer
from test_engine_lossless import RandomDrafter, lengths

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def to_cuda(sample):
    from fairseq import utils

    return utils.move_to_cuda(sample)


def test_capture_beside_a_thread_reading_the_device():
    """A thread that reads the device (``.tolist()``) while another records its graphs breaks
    neither: captures are thread-local, and the recorded calls equal the eager ones."""
    import threading

    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=63).cuda()
    sample = to_cuda(random_batch(d, lengths(8), seed=8))
    stop = threading.Event()
    probe = torch.arange(1000, device="cuda")

    def read():
        while not stop.is_set():
            probe.add(1).tolist()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        _replay_equals_eager(model, sample, seed=8)
    finally:
        stop.set()
        reader.join()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_graphs_on_a_second_gpu():
    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=64).to("cuda:1")
    from fairseq import utils

    sample = utils.move_to_cuda(random_batch(d, lengths(8), seed=8),
                                device=torch.device("cuda:1"))
    _replay_equals_eager(model, sample, seed=8)


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
        assert isinstance(generator.block_decoder, StaticBlockDecoder)
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


def _schedule(step, model, sample, seed, shrink=True):
    """A random block / rollback / rows-leaving schedule on CUDA (ragged blocks of 1-6
    positions); every call's features, padding zeroed. The same seed gives the same schedule."""
    device = next(model.parameters()).device
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    bsz = sample["net_input"]["src_tokens"].size(0)
    vocab = model.decoder.embed_tokens.num_embeddings
    g = torch.Generator().manual_seed(seed)
    state = step.new_state()
    start = torch.zeros(bsz, dtype=torch.long)
    last = torch.full((bsz,), 2, dtype=torch.long)
    features = []
    with torch.no_grad():
        for it in range(10):
            width = int(torch.randint(1, 7, (1,), generator=g))
            lens = torch.randint(1, width + 1, (start.numel(),), generator=g)
            block = torch.randint(4, vocab, (start.numel(), width), generator=g)
            block[:, 0] = last
            block_pad = torch.arange(width).unsqueeze(0) >= lens.unsqueeze(1)
            x = step.forward_block(block.to(device), start.to(device), block_pad.to(device),
                                   encoder_out, state)
            features.append(x.masked_fill(block_pad.to(device).unsqueeze(-1), 0.0).cpu())
            keep = torch.stack([torch.randint(1, int(n) + 1, (1,), generator=g)[0] for n in lens])
            step.rollback(state, width, keep.to(device),
                          keep_range=(int(keep.min()), int(keep.max())))
            last = block[torch.arange(start.numel()), keep - 1]
            start = start + keep
            if shrink and it in (3, 6) and start.numel() > 1:  # rows finish mid-bucket
                alive = torch.arange(start.numel())[start.numel() // 3:]
                start, last = start[alive], last[alive]
                step.reorder(state, alive.to(device))
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, alive.to(device))
    return features


def _replay_equals_eager(model, sample, seed):
    graphed, eager = StaticBlockDecoder(model.decoder), StaticBlockDecoder(model.decoder, graphs=False)
    for _ in range(2):  # the second pass replays the graphs the first recorded
        for x, y in zip(_schedule(graphed, model, sample, seed), _schedule(eager, model, sample, seed)):
            # the same kernels on the same shapes; a tolerance all the same (cuBLAS may pick
            # another algorithm inside a capture)
            assert torch.allclose(x, y, rtol=0, atol=1e-5)
    assert graphed.graph_count() > 0 and eager.graph_count() == 0


@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_graph_replay_equals_eager_random_model(batch_size):
    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=60 + batch_size).cuda()
    sample = to_cuda(random_batch(d, lengths(batch_size), seed=batch_size))
    _replay_equals_eager(model, sample, seed=batch_size)


@pytest.mark.trains
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_graph_replay_equals_eager_trained_model(copy_model, batch_size):
    model, d, make_sample = copy_model
    model = copy.deepcopy(model).cuda()
    sample = to_cuda(make_sample(batch_size, seed=500 + batch_size))
    _replay_equals_eager(model, sample, seed=batch_size)


def test_bucket_padding_on_cuda():
    """Five rows replayed on a graph of eight equal each row replayed alone (a graph of one),
    and stay finite with the padding rows' buffers poisoned."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=61).cuda()
    sample = to_cuda(random_batch(d, [5, 11, 2, 8, 14], seed=9))
    enc = model.encoder.forward_torchscript(sample["net_input"])
    step = StaticBlockDecoder(model.decoder)
    g = torch.Generator().manual_seed(1)
    first = torch.randint(4, 40, (5, 4), generator=g).cuda()
    second = torch.randint(4, 40, (5, 3), generator=g).cuda()
    kept = torch.tensor([4, 2, 3, 1, 4]).cuda()
    with torch.no_grad():
        for _ in range(2):  # record, then replay
            state = step.new_state()
            step.forward_block(first, torch.zeros_like(kept), torch.zeros_like(first, dtype=torch.bool),
                               enc, state)
            step.rollback(state, 4, kept, keep_range=(1, 4))
            for t in state.slot.keys + state.slot.values + state.slot.enc_keys + state.slot.enc_values:
                t[5:] = float("nan")
            together = step.forward_block(second, kept, torch.zeros_like(second, dtype=torch.bool),
                                          enc, state)
        assert together.isfinite().all()
        for r in range(5):
            alone = step.new_state()
            enc_r = model.encoder.reorder_encoder_out(enc, torch.tensor([r]).cuda())
            n = int(kept[r])
            step.forward_block(first[r:r + 1, :n], torch.zeros(1, dtype=torch.long).cuda(),
                               torch.zeros(1, n, dtype=torch.bool).cuda(), enc_r, alone)
            out = step.forward_block(second[r:r + 1], kept[r:r + 1],
                                     torch.zeros(1, 3, dtype=torch.bool).cuda(), enc_r, alone)
            assert torch.allclose(together[r], out[0], rtol=0, atol=1e-5)


def test_a_call_never_reads_the_device():
    """Replayed or eager, a call of the static step and its rollback queue work and return:
    torch's sync debug mode raises on any operation that waits for the GPU."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=62).cuda()
    sample = to_cuda(random_batch(d, [5, 11, 2, 8, 14, 3], seed=9))
    enc = model.encoder.forward_torchscript(sample["net_input"])
    block = torch.randint(4, 40, (6, 4), generator=torch.Generator().manual_seed(2)).cuda()
    pad = torch.zeros(6, 4, dtype=torch.bool).cuda()
    pad[1, 2:] = True
    layout = BlockLayout(pad)
    start = torch.zeros(6, dtype=torch.long).cuda()
    keep = torch.ones(6, dtype=torch.long).cuda()
    for graphs in (True, False):
        step = StaticBlockDecoder(model.decoder, graphs=graphs)
        with torch.no_grad():
            state = step.new_state()
            for _ in range(3):  # the first call starts the batch and records the graph
                step.log_probs(step.forward_packed(block, start, layout, enc, state), state=state)
                step.rollback(state, 4, keep, keep_range=(1, 1))
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):
                    step.log_probs(step.forward_packed(block, start, layout, enc, state), state=state)
                    step.rollback(state, 4, keep, keep_range=(1, 1))
            finally:
                torch.cuda.set_sync_debug_mode("default")


def test_slot_budget_bounds_memory_on_cuda():
    """Batches of six source buckets on a budget of two slots: at most two slots and their
    graphs stay, the device memory returns to the same level once the budget is full, and
    every replay equals the eager calls."""
    from fairseq_pardec.decoding.cuda.slot_pool import SlotBudget

    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=65).cuda()
    graphed = StaticBlockDecoder(model.decoder, budget=SlotBudget(slots=2, graphs=64))
    eager = StaticBlockDecoder(model.decoder, graphs=False)
    held = []
    for i, source in enumerate((10, 20, 40, 70, 130, 260, 10, 20, 40)):
        sample = to_cuda(random_batch(d, [source, max(1, source // 2)], seed=i))
        for x, y in zip(_schedule(graphed, model, sample, i, shrink=False),
                        _schedule(eager, model, sample, i, shrink=False)):
            assert torch.allclose(x, y, rtol=0, atol=1e-5)
        assert graphed.slot_count() <= 2 and graphed.graph_count() <= 64
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    assert graphed._pool.evictions > 0
    assert held[-1] <= max(held[:6])  # revisited buckets bring no growth
