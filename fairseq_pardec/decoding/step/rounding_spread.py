"""How far a decoder step's log-probabilities stray from fairseq's own arithmetic, on the model's
own input: the measurement behind the margins in force (step/margins.py,
:func:`margins.margins_in_force`) and behind examples/margin_spread.py.

The reference is fairseq's greedy search at batch 1 in its own arithmetic: its encoder, then the
one-row steps (step/one_row_steps.py, bit for bit fairseq's incremental decoder) and its output
layer, one token a step, each step's best token fed to the next. Along that path the step under
test computes the same log-probabilities three ways, and the guard's teacher-forced pass a
fourth:

* ``step``: one position a call, the rows together (lean_greedy at batch R; cut to the shortest
  row's path);
* ``block``: each row's whole path as one block at batch 1 (a verified draft);
* ``step, batch 1``: one position a call at batch 1;
* ``pass``: the lean step over each row's path as one block on fairseq's encoder output (the
  margin guard's first try at a close call, draft_verify/margin_guard.py).

Each way keeps the largest |difference| over every position and the whole vocabulary (-inf on
both sides counts as none), and the largest at fairseq's best two tokens, which the guard's
choice reads.
"""

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder, lean_supported
from fairseq_pardec.decoding.step.one_row_steps import OneRowSteps, one_row_supported


class Spread:
    """The largest differences of one way over the positions it computed."""

    def __init__(self):
        self.per_position: List[float] = []
        self.at_best_two = 0.0

    def add(self, got: Tensor, expected: Tensor):
        diff = (got.float() - expected.float()).abs()
        diff[~torch.isfinite(diff)] = 0  # -inf on both sides
        best = expected.topk(min(2, expected.size(-1)), dim=-1).indices
        self.per_position += diff.max(dim=-1).values.tolist()
        self.at_best_two = max(self.at_best_two, float(diff.gather(1, best).max()))

    @property
    def positions(self) -> int:
        return len(self.per_position)

    @property
    def largest(self) -> float:
        return max(self.per_position, default=0.0)

    def quantile(self, q: float) -> float:
        if not self.per_position:
            return 0.0
        return float(torch.tensor(self.per_position).quantile(q))


def fairseq_log_probs(model, features: Tensor) -> Tensor:
    """fairseq's normalised log-probabilities of ``features`` (T, C), as its step computes them:
    the decoder's output layer, then the model's normalisation."""
    logits = model.decoder.output_layer(features.unsqueeze(1))
    return model.get_normalized_probs((logits, None), log_probs=True)[:, -1, :]


def fairseq_greedy_path(model, net_input, bos: int, eos: int, pad: int,
                        max_tokens: int) -> Tuple[List[int], Tensor]:
    """fairseq's greedy path for one source row (``net_input`` at batch 1): the tokens fed (BOS
    first, the output less its EOS) and the ``(T, V)`` log-probabilities after each, computed
    one token a step in fairseq's arithmetic."""
    encoder_out = model.encoder.forward_torchscript(net_input)
    # the one-row steps compute fairseq's steps with less Python where they cover the decoder;
    # elsewhere fairseq's incremental decoder itself runs
    steps = OneRowSteps(model.decoder, encoder_out) if one_row_supported(model.decoder) else None
    state: dict = {}
    tokens, rows = [bos], []
    while True:
        if steps is not None:
            lprobs = fairseq_log_probs(model, steps.run(tokens)[-1])
        else:
            prefix = torch.tensor([tokens], device=net_input["src_tokens"].device)
            logits, _ = model.decoder(prefix, encoder_out=encoder_out, incremental_state=state)
            lprobs = model.get_normalized_probs((logits[:, -1:, :], None), log_probs=True)[:, -1, :]
        rows.append(lprobs)
        choice = lprobs[0].clone()
        choice[pad] = -float("inf")  # fairseq's greedy never emits padding
        token = int(choice.argmax())
        if token == eos or len(tokens) >= max_tokens:
            return tokens, torch.cat(rows)
        tokens.append(token)


def single_rows(net_input, pad: int, rows: int) -> List[dict]:
    """The first ``rows`` sources of a batch, each as a batch of one without its padding."""
    out = []
    for r in range(min(rows, net_input["src_tokens"].size(0))):
        src = net_input["src_tokens"][r]
        src = src[src != pad].unsqueeze(0)
        lengths = torch.tensor([src.size(1)], device=src.device)
        out.append({"src_tokens": src, "src_lengths": lengths})
    return out


def left_padded(rows: List[dict], pad: int) -> dict:
    """Single-row sources as one left-padded batch, as fairseq batches them."""
    width = max(r["src_tokens"].size(1) for r in rows)
    device = rows[0]["src_tokens"].device
    src = torch.full((len(rows), width), pad, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        src[i, width - r["src_tokens"].size(1):] = r["src_tokens"][0]
    lengths = torch.tensor([r["src_tokens"].size(1) for r in rows], device=device)
    return {"src_tokens": src, "src_lengths": lengths}


def _one_position_calls(step, encoder_out, paths: List[List[int]], length: int,
                        device) -> Tensor:
    """(R, length, V) log-probabilities of ``step`` fed ``paths`` one position a call, the rows
    together."""
    bsz = len(paths)
    cache = step.new_state(max_len=length + 2)
    dense = BlockLayout(torch.zeros(bsz, 1, dtype=torch.bool, device=device), dense=True)
    out = []
    for t in range(length):
        column = torch.tensor([[p[t]] for p in paths], device=device)
        start = torch.full((bsz,), t, dtype=torch.long, device=device)
        features = step.forward_packed(column, start, dense, encoder_out, cache)
        out.append(step.log_probs(features, state=cache))
    return torch.stack(out, dim=1)


def _one_block(step, encoder_out, path: List[int], device) -> Tensor:
    """(T, V) log-probabilities of ``step`` over ``path`` as one block at batch 1."""
    cache = step.new_state(max_len=len(path) + 2)
    block = BlockLayout(torch.zeros(1, len(path), dtype=torch.bool, device=device), dense=True)
    features = step.forward_packed(torch.tensor([path], device=device),
                                   torch.zeros(1, dtype=torch.long, device=device), block,
                                   encoder_out, cache)
    return step.log_probs(features, state=cache)


@torch.no_grad()
def measure(model, step, encode: Callable, sources: List[dict], bos: int, eos: int, pad: int,
            max_tokens: int, ways=("step", "block", "step, batch 1", "pass"),
            paths: Optional[List[Tuple[List[int], Tensor]]] = None,
            src_pad: Optional[int] = None) -> Dict[str, Spread]:
    """The spread of every way in ``ways`` over ``sources`` (single rows, :func:`single_rows`),
    along fairseq's greedy paths (computed here unless given as ``paths``: (tokens, log-probs)
    per source). ``encode``: the encoder that goes with ``step`` (step_factory.py); ``pad``,
    ``src_pad``: the target's and the source's padding (the same by default)."""
    src_pad = pad if src_pad is None else src_pad
    device = sources[0]["src_tokens"].device
    if paths is None:
        paths = [fairseq_greedy_path(model, s, bos, eos, pad, max_tokens) for s in sources]
    spreads = {way: Spread() for way in ways}
    # the guard's pass runs the lean step, on the decoders it covers only
    lean = LeanBlockDecoder(model.decoder) if "pass" in ways else None
    for source, (tokens, expected) in zip(sources, paths):
        if "block" in ways or "step, batch 1" in ways:
            encoder_out = encode(source)
            if "block" in ways:
                spreads["block"].add(_one_block(step, encoder_out, tokens, device), expected)
            if "step, batch 1" in ways:
                got = _one_position_calls(step, encoder_out, [tokens], len(tokens), device)[0]
                spreads["step, batch 1"].add(got, expected)
        if lean is not None:
            plain = model.encoder.forward_torchscript(source)
            spreads["pass"].add(_one_block(lean, plain, tokens, device), expected)
    if "step" in ways:
        length = min(len(tokens) for tokens, _ in paths)
        got = _one_position_calls(step, encode(left_padded(sources, src_pad)),
                                  [tokens for tokens, _ in paths], length, device)
        for r, (_, expected) in enumerate(paths):
            spreads["step"].add(got[r], expected[:length])
    return spreads
