"""The fast layouts follow the model's weights, however they change between two ``generate``
calls (step/weights_key.py), and building a generator puts its model in eval mode."""

import copy
import io

import pytest
import torch

from fairseq_pardec.decoding.draft_verify.drafters import NoDrafter
from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.cpu.fast import FastBlockDecoder
from fairseq_pardec.decoding.cpu.fast_encoder import FastEncoder
from fairseq_pardec.decoding.step.output_projection import OutputProjection
from fairseq_pardec.decoding.step.weights_key import WeightsKey

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer

LIMITS = dict(max_len_a=1.2, max_len_b=10)


def _setting(seed=0):
    d = make_dictionary(40)
    task = make_task(d)
    model = tiny_transformer(task, seed=seed, encoder_layers=1, decoder_layers=2)
    other = tiny_transformer(task, seed=seed + 100, encoder_layers=1, decoder_layers=2)
    sample = random_batch(d, [3, 9, 6, 12, 1], seed=seed)
    return d, model, other, sample


def _generator(model, d, drafter=None):
    generator = DraftVerifyGenerator([model], d, drafter or NoDrafter(), ExactAcceptance(), **LIMITS)
    assert isinstance(generator.block_decoder, FastBlockDecoder)  # the step that caches weights
    assert isinstance(generator.encode, FastEncoder)
    return generator


def _decode(generator, model, sample):
    with torch.no_grad():
        return by_id(sample, generator.generate([model], sample))


def _greedy(model, d, sample):
    return by_id(sample, fairseq_greedy(model, d, sample, **LIMITS))


def _follows(generator, model, d, sample, change):
    """Decode, change the weights with ``change()``, decode again: the second output must be
    fairseq's greedy output with the new weights, and differ from the first (or the check
    would prove nothing)."""
    before = _decode(generator, model, sample)
    assert before == _greedy(model, d, sample)
    change()
    expected = _greedy(model, d, sample)
    assert expected != before, "the change must change fairseq's own outputs"
    assert _decode(generator, model, sample) == expected


@pytest.mark.parametrize("drafter", ["lean_greedy", "iad"])
def test_writes_through_data_are_followed(drafter):
    d, model, other, sample = _setting()
    generator = _generator(model, d, CopyDrafter(d, d) if drafter == "iad" else None)

    def copy_through_data():  # fairseq's optimizers write through p.data, as this does
        for p, q in zip(model.parameters(), other.parameters()):
            p.data.copy_(q.data)

    _follows(generator, model, d, sample, copy_through_data)


@pytest.mark.parametrize("part", ["encoder", "decoder layers", "output projection"])
def test_a_write_to_one_part_is_followed(part):
    d, model, other, sample = _setting(seed=1)
    generator = _generator(model, d)
    modules = {"encoder": (model.encoder.layers, other.encoder.layers),
               "decoder layers": (model.decoder.layers, other.decoder.layers),
               "output projection": (model.decoder.output_projection,
                                     other.decoder.output_projection)}[part]

    def change():
        for p, q in zip(modules[0].parameters(), modules[1].parameters()):
            p.data.copy_(q.data)

    _follows(generator, model, d, sample, change)


def test_ema_in_eval_mode_is_followed():
    d, model, other, sample = _setting(seed=2)
    generator = _generator(model, d)

    def ema():  # an EMA step as many training loops write it, with the model in eval mode
        for p, q in zip(model.parameters(), other.parameters()):
            p.data.mul_(0.1).add_(q.data, alpha=0.9)

    _follows(generator, model, d, sample, ema)


def test_an_alias_taken_before_is_followed():
    """``w = p.data`` taken before the generator's last look, written after it."""
    d, model, other, sample = _setting(seed=3)
    generator = _generator(model, d)
    aliases = [p.data for p in model.parameters()]
    _decode(generator, model, sample)

    def write_aliases():
        for w, q in zip(aliases, other.parameters()):
            w.copy_(q.detach())

    _follows(generator, model, d, sample, write_aliases)


def test_load_state_dict_and_in_place_updates_are_followed():
    d, model, other, sample = _setting(seed=4)
    generator = _generator(model, d)
    _follows(generator, model, d, sample, lambda: model.load_state_dict(other.state_dict()))
    third = tiny_transformer(make_task(d), seed=7, encoder_layers=1, decoder_layers=2)
    _follows(generator, model, d, sample,
             lambda: torch.nn.Module.load_state_dict(model, third.state_dict(), assign=True))

    def under_no_grad():
        with torch.no_grad():
            for p, q in zip(model.parameters(), other.parameters()):
                p.copy_(q)

    _follows(generator, model, d, sample, under_no_grad)


def test_dtype_round_trips_are_followed():
    """``.half().float()`` rounds every weight to half precision and usually puts the new
    float32 storage where the old one was: the layouts follow the rounded weights."""
    d, model, _, sample = _setting(seed=5)
    generator = _generator(model, d)
    for _ in range(3):
        before = _decode(generator, model, sample)
        assert before == _greedy(model, d, sample)
        model.half().float()
        assert _decode(generator, model, sample) == _greedy(model, d, sample)
        model.double().float()  # exact: nothing to follow, but no stale copy either
        assert _decode(generator, model, sample) == _greedy(model, d, sample)
        with torch.no_grad():
            for p in model.parameters():
                p.data.mul_(1.5)


def test_nothing_changed_nothing_rebuilt():
    """Decoding, and use of the model that writes nothing (state_dict, a forward in eval mode,
    another model's writes) keeps the layouts: they are rebuilt only where a weight may have
    changed."""
    d, model, _, sample = _setting(seed=6)
    generator = _generator(model, d)
    _decode(generator, model, sample)
    step, encoder = generator.block_decoder._weights, generator.encode._weights
    _decode(generator, model, sample)
    model.state_dict()
    clone = copy.deepcopy(model)  # reads each p.data: counted as a possible write, one rebuild
    _decode(generator, model, sample)
    assert generator.block_decoder._weights is not step
    step, encoder = generator.block_decoder._weights, generator.encode._weights
    with torch.no_grad():
        model(**sample["net_input"], prev_output_tokens=sample["net_input"]["src_tokens"])
        for p in clone.parameters():
            p.data.mul_(0.0)  # another model's parameters
    _decode(generator, model, sample)
    assert generator.block_decoder._weights is step
    assert generator.encode._weights is encoder
    assert _decode(generator, model, sample) == _greedy(model, d, sample)


def test_watched_parameters_stay_parameters():
    """Watching ``p.data`` leaves a parameter what it was to torch: an ``nn.Parameter`` that
    optimizers update, and a whole-module ``torch.save`` loads without this package."""
    d, model, _, _ = _setting(seed=8)
    key = WeightsKey(model)
    first = key.key()
    for p in model.parameters():
        assert isinstance(p, torch.nn.Parameter)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sample = random_batch(d, [4, 5], seed=1)
    out, _ = model(**sample["net_input"], prev_output_tokens=sample["net_input"]["src_tokens"])
    out.sum().backward()
    optimizer.step()
    assert key.key() != first
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert all(type(p) is torch.nn.Parameter for p in loaded.parameters())


def test_output_projection_follows_data_writes():
    d, model, other, _ = _setting(seed=9)
    projection = OutputProjection(model.decoder.output_projection)
    x = torch.randn(3, model.decoder.embed_dim)
    with torch.no_grad():
        first = projection(x)
        assert torch.allclose(first, model.decoder.output_projection(x), atol=1e-5)
        model.decoder.output_projection.weight.data.copy_(other.decoder.output_projection.weight)
        assert torch.allclose(projection(x), other.decoder.output_projection(x), atol=1e-5)


def test_building_a_generator_puts_the_model_in_eval_mode():
    """As fairseq's SequenceGenerator does: with dropout left on, outputs would be noisy."""
    from argparse import Namespace
    from dataclasses import asdict

    from fairseq.dataclass.configs import GenerationConfig

    d = make_dictionary(40)
    task = make_task(d, generator="lean_greedy")
    model = tiny_transformer(task, seed=10, dropout=0.3, encoder_layers=1, decoder_layers=2)
    sample = random_batch(d, [5, 8, 3, 11], seed=10)
    expected = _greedy(model, d, sample)
    model.train()
    generator = DraftVerifyGenerator([model], d, NoDrafter(), ExactAcceptance(), **LIMITS)
    assert not any(module.training for module in model.modules())
    assert _decode(generator, model, sample) == expected
    model.train()  # through the task, as a library caller builds one
    args = Namespace(**dict(asdict(GenerationConfig()), beam=1, **LIMITS))
    generator = task.build_generator([model], args)
    assert not any(module.training for module in model.modules())
    assert _decode(generator, model, sample) == expected
