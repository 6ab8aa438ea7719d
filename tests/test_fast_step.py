"""The fast decoder step computes fairseq's decoder within a measured bound, and the margin guard
keeps the engine's outputs equal to fairseq greedy wherever that bound could change a choice."""

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.draft_verify import margin_guard
from fairseq_pardec.decoding.draft_verify.margin_guard import fairseq_decision, lead_is_certain
from fairseq_pardec.decoding.cpu.fast import DEFAULT_MARGIN, FastBlockDecoder
from fairseq_pardec.decoding.step.block_decoder import BlockDecoder
from fairseq_pardec.decoding.cpu.fast_encoder import FastEncoder, fast_encoder_supported
from fairseq_pardec.decoding.step_factory import block_decoder_for
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder
from fairseq_pardec.decoding.step.onednn import packs_on_onednn
from fairseq_pardec.native.library import native_kernel, native_unavailable_reason
from fairseq_pardec.decoding.cpu.products import (KERNEL_VARIABLE, KERNELS, MKL, NATIVE, ONEDNN,
                                                  KernelChoice, Linear)
from fairseq_pardec.errors import UsageError

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer
from test_beam_one import twin_vocabulary_model
from test_lean_decoder import _drive

ARCHITECTURES = [
    {},
    {"decoder_normalize_before": True, "encoder_normalize_before": True},
    {"decoder_learned_pos": True},
    {"no_scale_embedding": True, "layernorm_embedding": True},
]


def _log_probs(blocks, features):
    with torch.no_grad():
        return blocks.log_probs(features.reshape(-1, features.size(-1)))



def _never(decoder) -> bool:
    return False


def _none(*args, **kwargs):
    return None


def _searched(monkeypatch, generator, src, decided):
    """fairseq_decision by fairseq's SequenceGenerator itself: the replay declines a decoder
    the lean step does not support."""
    with monkeypatch.context() as patch:
        patch.setattr(margin_guard, "lean_supported", _never)
        return fairseq_decision(generator, src, decided)

@pytest.mark.parametrize("overrides", ARCHITECTURES)
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("kernel", [MKL, ONEDNN, NATIVE, "native products", "torch attention",
                                    None],
                         ids=["addmm", "onednn", "native", "native-products", "torch-attention",
                              "measured"])
def test_fast_log_probs_within_the_guards_bound(overrides, ragged, kernel):
    """Through blocks, rollbacks to rows' own lengths and shrinking batches, the fast step's
    log-probabilities, on the fast encoder's output, stay within a tenth of the guard's margin
    of fairseq's module path on fairseq's encoder, with each kernel for the products (the
    output projection's included) and with the one measured fastest per row count. On the
    native kernel the layers run as one native call (cpu/layer_stack.py), or, with that call
    turned off, as torch operations around native products; the attention runs on the native
    kernel between library products, or in torch operations."""
    stack = kernel not in ("native products", "torch attention")
    attention = kernel != "torch attention"
    kernel = {"native products": NATIVE, "torch attention": MKL}.get(kernel, kernel)
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=31, **overrides)
    sample = random_batch(d, [4, 9, 1, 15, 6, 3, 22, 2], seed=7)
    fast = block_decoder_for(model.decoder, fast=True)
    assert isinstance(fast, FastBlockDecoder)
    if kernel == ONEDNN and not packs_on_onednn():
        pytest.skip("this torch has no oneDNN packed product")
    if kernel == NATIVE and native_kernel() is None:
        pytest.skip("no native kernel here: %s" % native_unavailable_reason())
    if kernel is not None:
        fast.pin_kernel(kernel)
    fast.native_stack = stack
    fast.native_attention = attention
    module = BlockDecoder(model.decoder)
    worst = 0.0
    encode = FastEncoder(model.encoder, fast.kernels)
    for x, y in zip(_drive(fast, model, sample, seed=5, ragged=ragged, encode=encode),
                    _drive(module, model, sample, seed=5, ragged=ragged)):
        worst = max(worst, float((_log_probs(fast, x) - _log_probs(module, y)).abs().max()))
    assert worst < DEFAULT_MARGIN / 10
    if kernel == NATIVE:
        assert fast._weights.stack is not None  # these layers are ones the native call computes


@pytest.mark.parametrize("overrides", ARCHITECTURES)
@pytest.mark.parametrize("kernel", [None, NATIVE, "native products", "torch attention"],
                         ids=["measured", "native", "native-products", "torch-attention"])
def test_fast_encoder_output_is_fairseqs(overrides, kernel):
    """The fast encoder's dictionary is fairseq's: the same entries, masks and lengths, states
    within float32 rounding, on padded batches and on one sentence; the engine encodes with it
    only where it computes fairseq's function. With the native kernel the layers run as one
    native call (cpu/layer_stack.py), or as torch operations around native products and native
    attention; with a library kernel, the attention is native or torch's. Where a
    batch is mostly padding its products run on the real positions alone, and its padding
    positions hold zeros (every reader masks them)."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=34, **overrides)
    assert fast_encoder_supported(model.encoder)
    encode = FastEncoder(model.encoder)
    if kernel == "torch attention":
        encode.kernels.pin(MKL)
        encode.native_attention = False
    elif kernel is not None:
        if native_kernel() is None:
            pytest.skip("no native kernel here: %s" % native_unavailable_reason())
        encode.kernels.pin(NATIVE)
        encode.native_stack = kernel == NATIVE
    for lengths in ([4, 9, 1, 15], [6]):
        net_input = random_batch(d, lengths, seed=3)["net_input"]
        with torch.no_grad():
            expected = model.encoder.forward_torchscript(net_input)
        got = encode(net_input)
        assert set(got) == set(expected)
        real = ~expected["encoder_padding_mask"][0].t()  # (S, B)
        for key, values in expected.items():
            assert len(got[key]) == len(values)
            for e, g in zip(values, got[key]):
                assert e.shape == g.shape and e.dtype == g.dtype
                if key == "encoder_out":
                    # torch layers on a batch with 29 of its 60 positions real: packed
                    packed = kernel == "native products" and len(lengths) > 1
                    assert not packed or float(g[~real].abs().max()) == 0.0
                    e, g = e[real], g[real]
                if e.is_floating_point():
                    assert torch.allclose(e, g, atol=1e-5), key
                else:
                    assert torch.equal(e, g), key
    if kernel is not None:  # one unpadded sentence: its input in one native call where plain
        x, _ = encode._one_sentence_embedding(encode._prepared().stack, net_input["src_tokens"])
        assert (x is not None) == (not overrides.get("layernorm_embedding", False))
    if kernel == NATIVE:
        assert encode._weights.stack is not None  # these layers are ones the native call computes
    generator = _iad(model, d)
    assert isinstance(generator.encode, FastEncoder)
    model.double()
    assert not fast_encoder_supported(model.encoder)
    assert not isinstance(_iad(model, d).encode, FastEncoder)


def test_rejected_entries_are_overwritten():
    """A block after a rollback sees exactly the kept entries: its features equal those of a
    fresh cache fed the kept tokens."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=32)
    sample = random_batch(d, [7, 12, 3], seed=8)
    enc = model.encoder.forward_torchscript(sample["net_input"])
    fast = FastBlockDecoder(model.decoder)
    g = torch.Generator().manual_seed(0)
    kept = torch.randint(4, 40, (3, 3), generator=g)
    rejected = torch.randint(4, 40, (3, 4), generator=g)
    nxt = torch.randint(4, 40, (3, 2), generator=g)
    no_pad = torch.zeros(3, 3, dtype=torch.bool)
    with torch.no_grad():
        state = fast.new_state()
        fast.forward_block(kept, torch.zeros(3, dtype=torch.long), no_pad, enc, state)
        fast.forward_block(rejected, torch.full((3,), 3), torch.zeros(3, 4, dtype=torch.bool), enc, state)
        fast.rollback(state, 4, torch.zeros(3, dtype=torch.long))
        assert fast.cache_length(state) == 3
        after = fast.forward_block(nxt, torch.full((3,), 3), torch.zeros(3, 2, dtype=torch.bool), enc, state)
        fresh_state = fast.new_state()
        fast.forward_block(kept, torch.zeros(3, dtype=torch.long), no_pad, enc, fresh_state)
        fresh = fast.forward_block(nxt, torch.full((3,), 3), torch.zeros(3, 2, dtype=torch.bool), enc,
                                   fresh_state)
    # bitwise by construction: the same decoder (so the same kernel choice) computes both from
    # buffers of the same capacity and shapes, whose entries in use hold the same values
    assert torch.equal(after, fresh)


def test_lead_is_certain():
    lprobs = torch.log_softmax(torch.tensor([
        [3.0, 1.0, 0.0],                # a clear lead
        [1.0, 1.0 - 1e-5, 0.0],         # within the margin
        [0.0, float("-inf"), float("-inf")],  # one candidate left (EOS forced): never close
    ]), dim=-1)
    top = lprobs.topk(2, dim=-1).values.tolist()
    assert [lead_is_certain(a, b, 0.0, margin=1e-4) for a, b in top] == [True, False, True]
    # a large cumulative score widens the slack by the rounding of adding it
    assert not lead_is_certain(top[0][0], top[0][1], 1e8, margin=1e-4)
    # the rounding counts both candidates' sizes and the margin (about 4.8e-6 here), not the
    # best one's alone (6e-8)
    first, second = -0.5, -40.0
    lead = first - second
    assert lead_is_certain(first, second, 0.0, margin=(lead - 1e-5) / 2)
    assert not lead_is_certain(first, second, 0.0, margin=(lead - 1e-6) / 2)


def _iad(model, d, **kwargs):
    return DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(), **kwargs)


@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_fast_engine_equals_fairseq(batch_size):
    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=40 + batch_size)
    sample = random_batch(d, [1 + (i * 13) % 45 for i in range(batch_size)], seed=batch_size)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.2, max_len_b=10)
    generator = _iad(model, d, max_len_a=1.2, max_len_b=10)
    assert isinstance(generator.block_decoder, FastBlockDecoder)
    assert by_id(sample, generator.generate([model], sample)) == by_id(sample, expected)


@pytest.mark.trains
def test_guard_hands_every_close_call_to_fairseq(copy_model):
    """With a margin so wide that every position is a close call, each is decided by fairseq's
    own search: outputs stay fairseq's, with length cut-offs and forced prefixes. (A trained
    model's confidence depends on the CPU's kernels: a margin of 0.5 gave no close call at all on
    an AVX-512 machine, so the margin here leaves nothing to the model.)"""
    from fairseq.sequence_generator import SequenceGenerator

    model, d, make_sample = copy_model
    sample = make_sample(4, seed=7)
    for prefix in (None, sample["target"][:, :2]):
        for kwargs in ({"max_len_a": 1.0, "max_len_b": 10}, {"max_len_a": 0.0, "max_len_b": 6}):
            search = SequenceGenerator([model], d, beam_size=1, **kwargs)
            with torch.no_grad():
                expected = search.generate([model], sample, prefix_tokens=prefix)
            generator = _iad(model, d, margin=1e3, **kwargs)
            got = generator.generate([model], sample, prefix_tokens=prefix)
            assert by_id(sample, got) == by_id(sample, expected)
            assert generator.stats.close_calls > 0


def test_fast_step_only_where_it_computes_fairseqs_function():
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=33)
    assert isinstance(block_decoder_for(model.decoder, fast=True), FastBlockDecoder)
    assert type(block_decoder_for(model.decoder)) is LeanBlockDecoder  # not asked for
    model.double()
    assert type(block_decoder_for(model.decoder, fast=True)) is LeanBlockDecoder


@pytest.mark.parametrize("drafter", ["lean_greedy", "iad"])
def test_the_step_follows_the_models_dtype(drafter):
    """A model moved to another dtype after its generator was built (as fairseq moves the
    --eval-bleu generator's model, or a user calls ``.double()``) is decoded by the step
    chosen for that dtype, and then again by the fast step back in float32; in float32 and
    float64 the outputs are fairseq's greedy ones. In bfloat16 the lean step runs without a
    guard (no bound is claimed there, step/margins.py)."""
    from fairseq_pardec.decoding.draft_verify.drafters import NoDrafter

    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=35)
    sample = random_batch(d, [3, 9, 6, 12, 1], seed=6)
    limits = dict(max_len_a=1.2, max_len_b=10)
    generator = DraftVerifyGenerator([model], d, NoDrafter() if drafter == "lean_greedy"
                                     else CopyDrafter(d, d), ExactAcceptance(), **limits)
    assert isinstance(generator.block_decoder, FastBlockDecoder)
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float32):
        model.to(dtype)
        fast = dtype == torch.float32
        assert type(generator.block_decoder) is (FastBlockDecoder if fast else LeanBlockDecoder)
        assert isinstance(generator.encode, FastEncoder) == fast
        assert (generator.block_decoder.margin is None) == (dtype == torch.bfloat16)
        got = by_id(sample, generator.generate([model], sample))
        if dtype != torch.bfloat16:
            assert got == by_id(sample, fairseq_greedy(model, d, sample, **limits))
    # a steady run keeps its step (and the weights it prepared)
    step = generator.block_decoder
    generator.generate([model], sample)
    assert generator.block_decoder is step


def test_a_given_step_is_kept_across_dtypes():
    """A step assigned to the generator decodes every batch (tests run the engine on a given
    step), the encoder still following the model."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=36)
    generator = _iad(model, d)
    given = LeanBlockDecoder(model.decoder)
    generator.block_decoder = given
    model.double()
    assert generator.block_decoder is given
    assert not isinstance(generator.encode, FastEncoder)
    model.float()
    assert generator.block_decoder is given and isinstance(generator.encode, FastEncoder)


def test_products_agree_across_kernels_and_the_choice_follows_the_thread_count():
    """Every kernel computes x W^T + b (+ a residual, ReLU fused or not) within float32
    rounding, at every row count the native kernel unrolls and past a ragged last panel; the
    kernel choice is measured per row-count regime among the kernels that run here, without
    moving the global random state, and again when the thread count changes, never once
    pinned."""
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 16, generator=g), torch.randn(40, generator=g)
    for relu in (False, True):
        linear = Linear(weight, bias, relu=relu)
        assert set(linear.kernels()) == {MKL} | ({ONEDNN} if packs_on_onednn() else set()) | (
            {NATIVE} if native_kernel() is not None else set())
        for rows in (1, 2, 3, 5, 8, 13, 40):
            x = torch.randn(rows, 16, generator=g)
            residual = torch.randn(rows, 40, generator=g)
            expected = torch.nn.functional.linear(x, weight, bias)
            for kernel in KERNELS:
                if relu:
                    assert torch.allclose(linear(x, kernel), expected.relu(), atol=1e-5)
                    with pytest.raises(ValueError):
                        linear(x, kernel, add=residual)
                else:
                    assert torch.allclose(linear(x, kernel), expected, atol=1e-5)
                    assert torch.allclose(linear(x, kernel, add=residual), expected + residual,
                                          atol=1e-5)
    choice = KernelChoice()
    assert choice.stale()
    chain = [[Linear(weight, bias), Linear(torch.randn(16, 40, generator=g), None)]]
    rng = torch.get_rng_state()
    choice.measure(chain, rounds=1, calls=1)
    assert torch.equal(torch.get_rng_state(), rng)  # --sampling's draws stay fairseq's
    assert not choice.stale()
    assert set(choice.chosen()) <= set(chain[0][0].kernels())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert choice.stale()
        choice.pin(MKL)
        assert not choice.stale()
        choice.measure(chain, rounds=1, calls=1)
        assert choice.chosen() == (MKL,) * 4
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError):
        choice.pin("blas")


@pytest.mark.parametrize("model_kind", ["plain", "pre-norm", "learned-positions",
                                        "embedding-norm", "twin-tokens"])
def test_replayed_decision_is_sequence_generators(model_kind, monkeypatch):
    """A close call's decision replayed with the lean step (margin_guard._replayed_decision)
    is the one fairseq's SequenceGenerator makes, with --unkpen, --min-len (above the step,
    where SequenceGenerator alone needs a longer search) and a temperature; on the twin-token
    model many of these decisions are exact ties broken by rounding. With a bound on the
    prefix's score from the caller (the prefix steps then only fill the cache), tight or loose,
    the decision is the same."""
    if model_kind == "twin-tokens":
        model, d = twin_vocabulary_model(seed=4)
    else:
        overrides = dict(zip(["plain", "pre-norm", "learned-positions", "embedding-norm"],
                             ARCHITECTURES))[model_kind]
        d = make_dictionary(40)
        model = tiny_transformer(make_task(d), seed=35, **overrides)
    model.eval()
    sample = random_batch(d, [7, 12], seed=3)
    g = torch.Generator().manual_seed(1)
    in_one_pass = 0
    for unk_penalty, min_len, temperature in [(0.0, 1, 1.0), (0.5, 6, 0.7)]:
        generator = DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(),
                                         max_len_a=1.2, max_len_b=10, unk_penalty=unk_penalty,
                                         min_len=min_len, temperature=temperature)
        for row in range(2):
            src = sample["net_input"]["src_tokens"][row]
            for steps in range(0, 12, 2):
                decided = torch.randint(4, len(d), (steps,), generator=g)
                with torch.no_grad():
                    replayed, bounded = [], []
                    for one_row in (True, False):  # the one-row steps, the lean step
                        with monkeypatch.context() as patch:
                            if not one_row:
                                patch.setattr(margin_guard, "one_row_supported", _never)
                            replayed.append(fairseq_decision(generator, src, decided))
                            # with the teacher-forced pass first, and replayed step by step only
                            for teacher_forced in (True, False):
                                if not teacher_forced:
                                    patch.setattr(margin_guard, "_teacher_forced_choice", _none)
                                bounded += [fairseq_decision(generator, src, decided,
                                                             score_bound=bound)
                                            for bound in (prefix_score(generator, src, decided)
                                                          + 1e-3, 1e4)]
                    searched = _searched(monkeypatch, generator, src, decided)
                assert replayed == [searched] * 2, (unk_penalty, min_len, steps)
                assert bounded == [searched] * 8, (unk_penalty, min_len, steps)
        in_one_pass += generator.stats.close_calls_in_one_pass
    # the teacher-forced pass decided some, where its lead is clear of its margin; the twin-token
    # model's ties all went on to the replay
    assert (in_one_pass > 0) == (model_kind != "twin-tokens")


@pytest.mark.parametrize("overrides", ARCHITECTURES)
def test_teacher_forced_log_probs_within_their_margin(overrides):
    """The lean step's pass over a whole prefix, the margin guard's first try at a close call,
    gives log-probabilities within a tenth of its declared margin of fairseq's one-token steps
    (the one-row steps: bit for bit fairseq's, above), after prefixes of every length; no
    margin is claimed on CUDA or in half precision."""
    from fairseq_pardec.decoding.step.block_layout import BlockLayout
    from fairseq_pardec.decoding.step.margins import teacher_forced_margin
    from fairseq_pardec.decoding.step.one_row_steps import OneRowSteps

    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=38, **overrides).eval()
    decoder = model.decoder
    margin = teacher_forced_margin("cpu", torch.float32)
    assert teacher_forced_margin("cuda", torch.float32) is None
    assert teacher_forced_margin("cpu", torch.float16) is None

    def log_probs(features):
        logits = decoder.output_layer(features.view(1, 1, -1))
        return model.get_normalized_probs((logits, None), log_probs=True).view(-1)

    worst = 0.0
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for sentence in range(3):
            sample = random_batch(d, [5 + 7 * sentence], seed=8 + sentence)
            encoder_out = model.encoder.forward_torchscript(sample["net_input"])
            tokens = [d.eos()] + torch.randint(4, len(d), (24,), generator=g).tolist()
            exact = OneRowSteps(decoder, encoder_out).run(tokens, features_of_all=True)
            for end in range(1, len(tokens) + 1):
                step = LeanBlockDecoder(decoder)
                layout = BlockLayout(torch.zeros(1, end, dtype=torch.bool), dense=True)
                features = step.forward_packed(torch.tensor([tokens[:end]]),
                                               torch.zeros(1, dtype=torch.long), layout,
                                               encoder_out, step.new_state())
                difference = log_probs(features[-1]) - log_probs(exact[end - 1])
                worst = max(worst, float(difference.abs().max()))
    assert worst < margin / 10


@pytest.mark.parametrize("overrides", ARCHITECTURES)
def test_one_row_steps_are_the_lean_steps(overrides):
    """The replay's one-row steps compute the lean step's features bit for bit, one token a
    step at batch 1 (the same operations on the same shapes: equal floats are the contract),
    after the last token or after every one, also when asked afterwards of a cache fed only
    (``features_of_fed``); a hooked module sends the replay to the lean step."""
    from fairseq_pardec.decoding.step.block_layout import BlockLayout
    from fairseq_pardec.decoding.step.one_row_steps import OneRowSteps, one_row_supported

    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=36, **overrides).eval()
    sample = random_batch(d, [9], seed=5)
    tokens = [d.eos()] + torch.randint(4, len(d), (13,),
                                       generator=torch.Generator().manual_seed(2)).tolist()
    decoder = model.decoder
    assert one_row_supported(decoder)
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        lean = LeanBlockDecoder(decoder)
        cache = lean.new_state()
        one = BlockLayout(torch.zeros(1, 1, dtype=torch.bool), dense=True)
        expected = [lean.forward_packed(torch.tensor([[token]]), torch.tensor([t]), one,
                                        encoder_out, cache) for t, token in enumerate(tokens)]
        every = OneRowSteps(decoder, encoder_out).run(tokens, features_of_all=True)
        last = OneRowSteps(decoder, encoder_out).run(tokens)
        # the features after every token, afterwards, from a cache fed in two runs
        resumed = OneRowSteps(decoder, encoder_out)
        resumed.run(tokens[:6])
        resumed.run(tokens)
        of_fed = resumed.features_of_fed()
    assert len(every) == len(tokens) and len(last) == 1 and len(of_fed) == len(tokens)
    assert all(torch.equal(a, b) for a, b in zip(every, expected))
    assert torch.equal(last[0], expected[-1])
    assert all(torch.equal(a, b) for a, b in zip(of_fed, expected))
    handle = decoder.layers[0].fc1.register_forward_hook(lambda *args: None)
    try:
        assert not one_row_supported(decoder)
    finally:
        handle.remove()


def test_a_rows_replays_resume_where_the_last_stopped(monkeypatch):
    """A row's later close calls feed only the tokens decided since its last replay: the
    features are bit for bit a fresh run's (the same operations on the same shapes), the
    decisions are SequenceGenerator's, a prefix that does not extend the cache's starts over,
    and a run cut short leaves no cache behind."""
    from fairseq_pardec.decoding.step.one_row_steps import OneRowSteps

    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=37).eval()
    sample = random_batch(d, [8], seed=6)
    src = sample["net_input"]["src_tokens"][0]
    g = torch.Generator().manual_seed(3)
    tokens = [d.eos()] + torch.randint(4, len(d), (15,), generator=g).tolist()
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        steps = OneRowSteps(model.decoder, encoder_out)
        for end in (4, 9, 16):
            resumed = steps.run(tokens[:end])
            assert steps.fed == tokens[:end] and len(resumed) == 1
            fresh = OneRowSteps(model.decoder, encoder_out).run(tokens[:end])
            assert torch.equal(resumed[0], fresh[0])
        other = tokens[:6] + [4]  # not an extension: a fresh run
        assert not steps.continues(other)
        assert torch.equal(steps.run(other)[0],
                           OneRowSteps(model.decoder, encoder_out).run(other)[0])
        cut = OneRowSteps(model.decoder, encoder_out)
        cut.run(tokens[:5])
        calls = []

        def failing(*args, **kwargs):  # a run cut short between two of its steps
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("interrupted")
            return OneRowSteps._keys_values(*args, **kwargs)

        monkeypatch.setattr(cut, "_keys_values", failing)
        with pytest.raises(RuntimeError):
            cut.run(tokens[:9])
        monkeypatch.undo()
        assert cut.fed == []
        assert torch.equal(cut.run(tokens[:9])[0],
                           OneRowSteps(model.decoder, encoder_out).run(tokens[:9])[0])

        generator = DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(),
                                         max_len_a=1.2, max_len_b=10)
        replay = margin_guard.RowReplay()
        decided = torch.tensor(tokens[1:], dtype=torch.long)
        # the step-by-step replay's resumption: no teacher-forced pass decides first
        monkeypatch.setattr(margin_guard, "_teacher_forced_choice", _none)
        for steps_decided in (2, 5, 11, 14):
            resumed = fairseq_decision(generator, src, decided[:steps_decided], resume=replay,
                                       score_bound=1e4)
            searched = _searched(monkeypatch, generator, src, decided[:steps_decided])
            assert resumed == searched, steps_decided
        assert replay.steps.fed == tokens[:15]


def prefix_score(generator, src, decided) -> float:
    """The size of fairseq's own score of the forced tokens ``decided``: its positional scores
    (the forced tokens' log-probabilities as its search computes them), summed."""
    if decided.numel() == 0:
        return 0.0
    search = SequenceGenerator(
        [generator.model], generator.tgt_dict, beam_size=1, max_len_a=0,
        max_len_b=max(decided.numel() + 1, generator.min_len), min_len=generator.min_len,
        unk_penalty=generator.unk_penalty, temperature=generator.temperature)
    src = src[src.ne(generator.src_pad)].unsqueeze(0)
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([src.size(1)])}}
    hypo = search.generate([generator.model], sample, prefix_tokens=decided.unsqueeze(0))[0][0]
    return float(hypo["positional_scores"][: decided.numel()].sum().abs())


def test_kernel_pinned_from_the_environment(monkeypatch):
    """$FAIRSEQ_PARDEC_KERNEL pins every product to one kernel (runs then print the same
    scores); a name that is no kernel is a one-line usage error naming the variable."""
    monkeypatch.setenv(KERNEL_VARIABLE, ONEDNN)
    choice = KernelChoice()
    assert choice.chosen() == (ONEDNN,) * 4 and not choice.stale()
    monkeypatch.setenv(KERNEL_VARIABLE, "blas")
    with pytest.raises(UsageError, match="FAIRSEQ_PARDEC_KERNEL=blas"):
        KernelChoice()
