import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from helpers import collate, make_dictionary, make_task, tiny_transformer  # noqa: E402
# the command-line tests' fixtures: built once per test run, defined once for every module that uses them
from cli_setup import (  # noqa: E402,F401
    blockwise_checkpoint, cli_data, drafter_checkpoint, ibdecoder_checkpoint, stock_checkpoint,
)
from serve_setup import served  # noqa: E402,F401  (the server tests' server process)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one); pytest -m cuda")
    config.addinivalue_line(
        "markers", "full_calibration: measures margins in force on as many positions as decoding does")
    config.addinivalue_line(
        "markers",
        "trains: trains a model in the test process or uses a fixture that does; what it learns "
        "depends on the CPU's kernels, so make test runs these a second time with other ones",
    )


# Fixtures that train a model in the test process: a test using one needs the trains marker.
TRAINING_FIXTURES = {
    "copy_model", "trained_heads", "trained_light_heads", "trained_recurrent_heads",
    "trained_drafter", "trained_causal_drafter", "trained_ibdecoder",
}


def pytest_collection_modifyitems(config, items):
    # a test left out of `-m trains` would go unchecked on the second kernel family
    unmarked = [item.nodeid for item in items
                if TRAINING_FIXTURES & set(item.fixturenames) and not item.get_closest_marker("trains")]
    if unmarked:
        raise pytest.UsageError("tests using a training fixture need @pytest.mark.trains: "
                                + ", ".join(unmarked))


@pytest.fixture(scope="session")
def copy_model():
    """A tiny transformer trained in-process on a near-copy task (GEC-like: ~10% edits)."""
    d = make_dictionary(30)
    task = make_task(d)
    model = tiny_transformer(task, seed=0, encoder_layers=1, decoder_layers=2)
    lo, hi = d.nspecial, len(d)
    g = torch.Generator().manual_seed(0)

    def pair(n):
        src = torch.randint(lo, hi, (n,), generator=g)
        tgt = src.clone()
        edits = torch.rand(n, generator=g) < 0.1
        # deterministic edit: a word becomes its successor (learnable)
        tgt[edits] = lo + (tgt[edits] - lo + 1) % (hi - lo)
        eos = torch.tensor([d.eos()])
        return torch.cat([src, eos]), torch.cat([tgt, eos])

    def make_batch(batch_size):
        pairs = [pair(int(torch.randint(3, 16, (1,), generator=g))) for _ in range(batch_size)]
        return collate(d, [s for s, _ in pairs], targets=[t for _, t in pairs])

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        sample = make_batch(32)
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        loss = torch.nn.functional.nll_loss(
            lprobs.view(-1, lprobs.size(-1)), sample["target"].view(-1), ignore_index=d.pad()
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    def make_sample(batch_size, seed):
        g.manual_seed(seed)
        return make_batch(batch_size)

    return model, d, make_sample


@pytest.fixture(autouse=True)
def small_margin_calibration(request, monkeypatch):
    """A guarded generator measures its step on the model before its first batch
    (decoding/step/calibration.py): 8 rows of 32 tokens of fairseq's greedy steps, a few tenths
    of a second on a tiny model, which a suite that builds hundreds of models would pay each
    time. Tests measure 2 rows of 8 tokens, the same code on fewer positions, unless marked
    ``full_calibration`` (the tests of the measurement itself)."""
    if request.node.get_closest_marker("full_calibration") is None:
        from fairseq_pardec.decoding.step import calibration

        monkeypatch.setattr(calibration, "ROWS", 2)
        monkeypatch.setattr(calibration, "TOKENS", 8)
