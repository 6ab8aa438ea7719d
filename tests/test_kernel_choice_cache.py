"""The product kernel choice that does not flip: decided by rule where the native kernel runs a
layer stack at few rows, kept unless another kernel is faster beyond the noise, stored per
machine next to the kernel build and read back by later processes, made once when threads ask
together. No timing is asserted: the timings are replaced where a test needs them."""

import json
import threading

import pytest
import torch

from fairseq_pardec.native import cache as native_cache
from fairseq_pardec.decoding.cpu import products
from fairseq_pardec.native.library import native_kernel
from fairseq_pardec.decoding.cpu.products import (MKL, NATIVE, ONEDNN, KernelChoice, Linear,
                                                   _decide)


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv(native_cache.CACHE_VARIABLE, str(tmp_path))
    monkeypatch.delenv(products.KERNEL_VARIABLE, raising=False)
    return tmp_path


def _chain(layers=2, width=16):
    g = torch.Generator().manual_seed(0)
    return [[Linear(torch.randn(3 * width, width, generator=g), None),
             Linear(torch.randn(width, width, generator=g), torch.randn(width, generator=g))]
            for _ in range(layers)]


def _timings(monkeypatch, fastest=None):
    """Replace the timing: ``fastest`` (or the first kernel) takes 1, the others 2; the row
    counts timed are recorded."""
    timed = []

    def fake(maps, kernels, between, rows, rounds, calls, warmup):
        timed.append(rows)
        best = fastest if fastest in kernels else kernels[0]
        return {k: [1.0 if k == best else 2.0] * 5 for k in kernels}

    monkeypatch.setattr(products, "_timed", fake)
    return timed


def _stored(cache_dir):
    files = list(cache_dir.glob("choices-*.json"))
    assert len(files) == 1
    return json.loads(files[0].read_text())


def test_kept_within_the_noise_replaced_beyond_it():
    preferred = (NATIVE, ONEDNN, MKL)
    close = {NATIVE: [1.00, 1.02, 0.98, 1.01, 0.99], ONEDNN: [0.92, 0.93, 0.91, 0.92, 0.94]}
    assert _decide(close, preferred) == NATIVE  # 8% faster: within the margin
    clear = {NATIVE: [1.00, 1.02, 0.98, 1.01, 0.99], ONEDNN: [0.60, 0.61, 0.59, 0.62, 0.60]}
    assert _decide(clear, preferred) == ONEDNN
    # 30% faster, but each kernel's own times spread by more than that: kept
    noisy = {NATIVE: [0.5, 1.0, 1.5, 1.0, 0.6, 1.4], ONEDNN: [0.4, 0.7, 1.1, 0.7, 0.3, 1.0]}
    assert _decide(noisy, preferred) == NATIVE
    # the preferred kernel does not run here: the next one in line is kept
    assert _decide({ONEDNN: [1.0] * 5, MKL: [0.95] * 5}, preferred) == ONEDNN


def test_few_rows_of_a_layer_stack_by_rule_and_the_choice_stored(monkeypatch, cache):
    chain = _chain()
    kernels = set(chain[0][0].kernels())
    if len(kernels) < 2:
        pytest.skip("one product kernel here: nothing to choose")
    timed = _timings(monkeypatch, fastest=MKL)
    choice = KernelChoice()
    choice.measure(chain)
    if NATIVE in kernels:
        # one row and a few: the native kernel, untimed (it runs the whole stack there)
        assert choice.chosen()[:2] == (NATIVE, NATIVE) and timed == [32, 256]
    else:
        assert timed == [1, 8, 32, 256]
    assert choice.chosen()[2:] == (MKL, MKL)  # clearly faster than the preferred kernels
    stored = _stored(cache)
    assert list(stored.values()) == [list(choice.chosen())]
    build = native_kernel()
    assert list(cache.glob("choices-*.json"))[0].name == "choices-%s.json" % (
        build.build_id if build is not None else "library-kernels")


def test_a_later_process_reads_the_stored_choice(monkeypatch, cache):
    chain = _chain()
    if len(chain[0][0].kernels()) < 2:
        pytest.skip("one product kernel here: nothing to choose")
    _timings(monkeypatch, fastest=MKL)
    first = KernelChoice()
    first.measure(chain)
    timed = _timings(monkeypatch, fastest=ONEDNN)  # would choose otherwise if measured
    later = KernelChoice()  # a new decoder, as in a new process
    later.measure(_chain())
    assert timed == [] and later.chosen() == first.chosen()
    assert not later.stale()


def test_another_thread_count_or_shape_is_another_choice(monkeypatch, cache):
    chain = _chain()
    if len(chain[0][0].kernels()) < 2:
        pytest.skip("one product kernel here: nothing to choose")
    timed = _timings(monkeypatch)
    choice = KernelChoice()
    choice.measure(chain)
    count = len(timed)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert choice.stale()
        choice.measure(chain)
        assert not choice.stale() and len(timed) == 2 * count
    finally:
        torch.set_num_threads(threads)
    KernelChoice().measure(_chain(width=24))
    assert len(timed) == 3 * count
    assert len(_stored(cache)) == 3


def test_an_output_projection_alone_is_timed_at_every_row_count(monkeypatch, cache):
    """The rule is for layer stacks; a projection's products are all there is to time."""
    vocab = Linear(torch.randn(50, 16), None)
    if len(vocab.kernels()) < 2:
        pytest.skip("one product kernel here: nothing to choose")
    timed = _timings(monkeypatch)
    KernelChoice().measure([[vocab]])
    assert timed == [1, 8, 32, 256]


def test_threads_asking_together_choose_once(monkeypatch, cache):
    """A cold start: threads finding the choice stale at once wait for one measurement and all
    read the same choice (published whole: no thread sees half of it)."""
    chain = _chain()
    if len(chain[0][0].kernels()) < 2:
        pytest.skip("one product kernel here: nothing to choose")
    timed = _timings(monkeypatch)
    choice = KernelChoice()
    start = threading.Barrier(4)
    seen = []

    def first_step():
        start.wait()
        if choice.stale():
            choice.measure(chain)
        seen.append((choice.chosen(), choice.kernel_for(1), choice.stale()))

    threads = [threading.Thread(target=first_step) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 4 and len(set(seen)) == 1 and seen[0][2] is False
    assert timed == ([32, 256] if NATIVE in chain[0][0].kernels() else [1, 8, 32, 256])


def test_an_unwritable_cache_means_measuring_again(monkeypatch, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(native_cache.CACHE_VARIABLE, str(blocked / "cache"))
    monkeypatch.delenv(products.KERNEL_VARIABLE, raising=False)
    chain = _chain()
    if len(chain[0][0].kernels()) < 2:
        pytest.skip("one product kernel here: nothing to choose")
    _timings(monkeypatch)
    choice = KernelChoice()
    choice.measure(chain)
    assert not choice.stale()
