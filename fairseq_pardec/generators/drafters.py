"""Drafters propose the next tokens of each row for the verifier to check.

A drafter gets the batch once (``start``) and is then asked, every iteration, for up to
``max_len[b]`` draft tokens per active row given the tokens accepted so far.
"""

import logging
import threading
from typing import List

import torch
from torch import Tensor
from ..errors import UsageError
from .output_projection import (
    ShortlistProjection,
    base_projection,
    draft_projection,
    plain_output_projection,
)

logger = logging.getLogger(__name__)


def pad_drafts(drafts: List[List[int]], pad: int, device) -> (Tensor, Tensor):
    """Ragged python drafts -> (B, K) padded tensor and (B,) lengths."""
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    width = int(lengths.max()) if len(drafts) else 0
    out = torch.full((len(drafts), width), pad, dtype=torch.long)
    for row, draft in enumerate(drafts):
        if draft:
            out[row, : len(draft)] = torch.tensor(draft, dtype=torch.long)
    return out.to(device), lengths.to(device)


_THREADS_LOCK = threading.Lock()


class _BatchState:
    """One thread's per-batch values of a drafter (see ``Drafter.BATCH_STATE``)."""


class Drafter:
    """Interface of the draft step of the draft-and-verify engine.

    With ``--sampling`` (speculative sampling) a drafter that draws its drafts from a
    distribution sets ``draft_probs`` in ``propose``: (B, K, V), the distribution each draft
    token was drawn from. ``None`` (the default) declares the drafts deterministic (one-hot q).
    """

    sampler = None
    temperature = 1.0

    # The attributes a drafter sets per batch (in ``start``, ``propose``, ``observe``), with
    # their values before any is set. They live in an object of the calling thread, so threads
    # that share one generator, and so its drafter, each decode their own batch.
    BATCH_STATE = {"draft_probs": None}

    def _batch_state(self):
        local = self.__dict__.get("_threads")
        if local is None:
            with _THREADS_LOCK:
                local = self.__dict__.setdefault("_threads", threading.local())
        state = getattr(local, "state", None)
        if state is None:
            state = local.state = _BatchState()
        return state

    def __getattr__(self, name):  # only for names that plain lookup does not find
        defaults = type(self).BATCH_STATE
        if name in defaults:
            return getattr(self._batch_state(), name, defaults[name])
        raise AttributeError("%r object has no attribute %r" % (type(self).__name__, name))

    def __setattr__(self, name, value):
        if name in type(self).BATCH_STATE:
            setattr(self._batch_state(), name, value)
        else:
            object.__setattr__(self, name, value)

    def set_sampler(self, sampler, temperature: float = 1.0):
        """Called once by a sampling engine: draw drafts with ``sampler`` (its filter and its
        seeded generator) at the verifier's temperature."""
        self.sampler, self.temperature = sampler, temperature

    def _draw(self, logits: Tensor):
        """(..., V) logits -> drawn tokens (...) and the filtered distribution (..., V)."""
        lprobs = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        probs = self.sampler.filter.probs(lprobs)
        flat = probs.reshape(-1, probs.size(-1))
        tokens = self.sampler.sample(flat).view(probs.shape[:-1])
        return tokens, probs

    def start(self, sample, encoder_out, bos: int):
        """Called once per batch, before the first iteration."""

    def propose(self, rows: Tensor, tokens: Tensor, n_out: Tensor, max_len: Tensor):
        """Draft tokens for the active rows.

        Args:
            rows: (B,) indices of the active rows in the batch given to ``start``.
            tokens: (B, T) decoder inputs so far: BOS then the accepted tokens.
            n_out: (B,) number of accepted tokens per row.
            max_len: (B,) the most draft tokens each row may use.
        Returns:
            (B, K) drafts padded with ``pad`` and (B,) their lengths.
        """
        raise NotImplementedError

    def observe(self, rows: Tensor, features: Tensor, last: Tensor, tokens: Tensor = None):
        """Called after each verification with the verifier's (B, d) features after each row's
        last kept token, per row that token's block position (= draft tokens accepted), and
        (B,) the verifier's token chosen from those features (the row's newest token). Most
        drafters ignore the features and tokens."""


class NoDrafter(Drafter):
    """Drafts nothing: every iteration is one greedy step of the lean engine (``lean_greedy``)."""

    def propose(self, rows, tokens, n_out, max_len):
        empty = tokens.new_zeros(rows.numel(), 0)
        return empty, tokens.new_zeros(rows.numel())


class SourceVocabularyMap:
    """Maps source token ids to target ids by their string (for separate dictionaries).

    Tokens with no target counterpart map to -1: copy drafts leave them out.
    """

    def __init__(self, src_dict, tgt_dict):
        self.identity = src_dict is tgt_dict or src_dict.symbols == tgt_dict.symbols
        if self.identity:
            self.table = None
            return
        table = torch.full((len(src_dict),), -1, dtype=torch.long)
        for idx, symbol in enumerate(src_dict.symbols):
            tgt = tgt_dict.index(symbol)
            if tgt != tgt_dict.unk() or symbol == tgt_dict.unk_word:
                table[idx] = tgt
        for special in ("bos", "pad", "eos", "unk"):
            table[getattr(src_dict, special)()] = getattr(tgt_dict, special)()
        self.table = table
        mapped = int((table >= 0).sum())
        logger.info(
            "copy drafter: source and target dictionaries differ; %d of %d source types map to "
            "target types by string", mapped, len(src_dict)
        )

    def __call__(self, src_ids: Tensor) -> Tensor:
        if self.identity:
            return src_ids
        return self.table.to(src_ids.device)[src_ids]


class CopyDrafter(Drafter):
    """Input-guided aggressive decoding (IAD): draft by copying the source.

    Matching rule (Algorithm 1 of Sun et al. 2021, made a little more aggressive): take the
    shortest suffix of the output (BOS included) that occurs exactly once in [BOS] + source, and
    draft the source tokens that follow that occurrence. When every suffix is ambiguous (a
    repeated token such as a comma), the paper falls back to one greedy step; we instead pick the
    occurrence nearest to where the previous match predicts it (previous match position plus the
    tokens output since then: GEC output follows the source left to right). A suffix whose last token does not occur in the source gives no draft
    (one plain greedy step). Any draft is safe: exact verification keeps the output identical to
    greedy decoding; the rule only changes how many tokens are accepted.
    """

    # Ceiling of the adaptive caps on the CPU (--block-size not given). There a verified position
    # costs compute once the batch is compute-bound, so the ceiling shrinks with the number of
    # active rows: CPU_POSITIONS block positions per iteration shared by the rows, each row's
    # ceiling within [CPU_MIN_CEILING, CPU_MAX_CEILING] (16 for 1-4 rows, 8 for 8, 6 from 11).
    # Measured with true batch sizes (UA-GEC test, d256 3+3 model after 7 epochs, 2 threads,
    # median of 3; docs/results.md "iad draft-cap sweep"): batch 1 (80 sentences), adaptive
    # under 6/10/16/32: 3.51/3.90/4.30/4.31x greedy, fixed 4/10: 2.76/3.84x; batch 32 (300
    # sentences), adaptive under 6/10/16/32: 1.65/1.62/1.56/1.41x, fixed 4/10: 1.40/1.40x.
    CPU_POSITIONS = 64
    CPU_MIN_CEILING = 6
    CPU_MAX_CEILING = 16
    # On a GPU a longer block costs about as much as one token, so rows may draft what remains
    # of their source, within a budget of block positions per iteration: the verifier holds a
    # (positions, vocabulary) tensor of log-probabilities, and 64 rows x 200 source positions x
    # 32k words would be 1.6 GB of it. GPU_POSITIONS are shared by the active rows, each row's
    # ceiling at least GPU_MIN_CEILING (32 for 64 rows; 2048 for one row).
    GPU_POSITIONS = 2048
    GPU_MIN_CEILING = 16

    BATCH_STATE = dict(Drafter.BATCH_STATE, on_cpu=True, sources=None, positions=None,
                       last_match=None, outputs=None, mean_accepted=None, _drafted=None)

    def __init__(self, src_dict, tgt_dict, block_size=None, adaptive=False):
        self.vocab_map = SourceVocabularyMap(src_dict, tgt_dict)
        self.src_pad = src_dict.pad()
        self.pad = tgt_dict.pad()
        self.block_size = block_size
        # per-row caps from each row's recent acceptance (see _row_cap)
        self.adaptive = adaptive

    def start(self, sample, encoder_out, bos: int):
        src = sample["net_input"]["src_tokens"]
        self.on_cpu = src.device.type == "cpu"
        mapped = self.vocab_map(src).tolist()
        self.sources, self.positions, self.last_match = [], [], []
        for row, ids in zip(src.tolist(), mapped):
            # a source token the target dictionary lacks cannot be drafted: it is left out,
            # and copying goes on with the tokens after it
            source = [bos] + [t for s, t in zip(row, ids) if s != self.src_pad and t != -1]
            where = {}
            for i, token in enumerate(source):
                where.setdefault(token, []).append(i)
            self.sources.append(source)
            self.positions.append(where)
            self.last_match.append((0, 0))  # (source index, output length) of the last match
        # BOS + the accepted tokens seen so far, per row: accepted tokens never change, so each
        # iteration reads only the new ones from the engine's buffer
        self.outputs = [[bos] for _ in self.sources]
        self.mean_accepted = [None] * len(self.sources)
        self._drafted = None


    def _match(self, row: int, output: List[int]):
        """Index in the source of the match of the output's last token, or None."""
        source = self.sources[row]
        candidates = self.positions[row].get(output[-1])
        if not candidates:
            return None
        q = 0
        while len(candidates) > 1 and q + 1 < len(output):
            q += 1
            longer = [i for i in candidates if i >= q and source[i - q] == output[-1 - q]]
            if not longer:
                break
            candidates = longer
        if len(candidates) > 1:
            at, n_then = self.last_match[row]
            expected = at + len(output) - 1 - n_then
            return min(candidates, key=lambda i: (abs(i - expected), i))
        return candidates[0]

    def _ceiling(self, active_rows: int):
        """The cap every row drafts under this iteration."""
        if self.block_size is not None:
            return self.block_size
        if not self.on_cpu:
            return max(self.GPU_MIN_CEILING, self.GPU_POSITIONS // max(1, active_rows))
        share = self.CPU_POSITIONS // max(1, active_rows)
        return max(self.CPU_MIN_CEILING, min(self.CPU_MAX_CEILING, share))

    def _row_cap(self, row: int, room: int, limit) -> int:
        """Most draft tokens for this row now.

        Adaptive: twice the row's recent mean of accepted draft tokens, plus one (an exponential
        mean, weight 1/2 on the last iteration), within the fixed cap. A row whose copies keep
        being rejected (translation, a heavy rewrite) drafts one token, so its iterations cost
        about a greedy step; a row that copies long runs drafts up to the cap.
        """
        cap = room if limit is None else min(room, limit)
        mean = self.mean_accepted[row]
        if self.adaptive and mean is not None:
            cap = min(cap, int(2 * mean) + 1)
        return cap

    def _read_new_tokens(self, row_ids: List[int], tokens: Tensor, n_out: List[int]):
        """Append each row's tokens accepted since the last call (one small gather)."""
        known = [len(self.outputs[row]) for row in row_ids]
        new = [n + 1 - k for n, k in zip(n_out, known)]
        width = max(new, default=0)
        if width <= 0:
            return
        cols = torch.tensor(known, device=tokens.device).unsqueeze(1) + torch.arange(
            width, device=tokens.device)
        fresh = tokens.gather(1, cols.clamp(max=tokens.size(1) - 1)).tolist()
        for row, count, values in zip(row_ids, new, fresh):
            if count > 0:
                self.outputs[row].extend(values[:count])

    def propose(self, rows, tokens, n_out, max_len):
        drafts = []
        row_ids, lengths = rows.tolist(), n_out.tolist()
        self._read_new_tokens(row_ids, tokens, lengths)
        ceiling = self._ceiling(len(row_ids))
        for row, n, room in zip(row_ids, lengths, max_len.tolist()):
            limit = self._row_cap(row, room, ceiling)
            output = self.outputs[row]
            at = self._match(row, output) if limit > 0 else None
            if at is None:
                drafts.append([])
                continue
            self.last_match[row] = (at, n)
            drafts.append(self.sources[row][at + 1 : at + 1 + limit])
        self._drafted = (row_ids, [len(d) for d in drafts])
        return pad_drafts(drafts, self.pad, tokens.device)

    def observe(self, rows, features, last, tokens=None):
        if not self.adaptive or self._drafted is None:
            return
        row_ids, lengths = self._drafted
        for row, drafted, accepted in zip(row_ids, lengths, last.tolist()):
            if drafted:  # no draft (no match) says nothing about how well this row copies
                mean = self.mean_accepted[row]
                accepted = min(accepted, drafted)
                self.mean_accepted[row] = accepted if mean is None else 0.5 * (mean + accepted)
        self._drafted = None


class HeadsDrafter(Drafter):
    """Blockwise parallel decoding: the proposal heads p_2..p_k, read at the last kept position
    of the previous verification (merged invocation, § 4), are the next draft.

    The first iteration has no proposals yet: it verifies nothing and takes p_1's token (and
    the heads' first proposals) from the same call.

    ``adaptive``: each row drafts at most twice its recent mean of accepted draft tokens, plus
    one (as iad's and GAD's drafters), so a row whose proposals keep being rejected verifies
    short blocks; heads no row will use are not computed.
    """

    BATCH_STATE = dict(Drafter.BATCH_STATE, next_draft=None, next_len=None, next_probs=None,
                       mean_accepted=None, drafted=None)

    def __init__(self, decoder, pad: int, block_size: int, adaptive: bool = False,
                 dictionary=None, draft_vocab=None):
        self.decoder, self.pad = decoder, pad
        self.width = block_size - 1  # heads 2..block_size
        self.adaptive = adaptive
        # the heads share the base's vocabulary projection (p_1's own output layer may differ)
        self.project = draft_projection(base_projection(decoder), dictionary, draft_vocab)

    def start(self, sample, encoder_out, bos: int):
        src = sample["net_input"]["src_tokens"]
        self.next_draft = src.new_full((src.size(0), max(self.width, 0)), self.pad)
        self.next_len = src.new_zeros(src.size(0))
        self.next_probs = None
        self.mean_accepted = torch.full((src.size(0),), float(self.width), device=src.device)
        self.drafted = None

    def propose(self, rows, tokens, n_out, max_len):
        lengths = torch.minimum(self.next_len[rows], max_len)
        width = int(lengths.max()) if lengths.numel() else 0
        draft = self.next_draft[rows, :width]
        cols = torch.arange(width, device=draft.device)
        draft = draft.masked_fill(cols.unsqueeze(0) >= lengths.unsqueeze(1), self.pad)
        if self.sampler is not None:
            if self.next_probs is None:  # nothing proposed yet: an empty draft
                self.draft_probs = None
            else:
                self.draft_probs = self.next_probs[rows, :width]
        self.drafted = lengths
        return draft, lengths

    def _width(self, mean_accepted):
        """How many heads to run (n) and each row's cap (None: not adaptive)."""
        n, caps = self.width, None
        if self.adaptive and self.sampler is None:
            caps = (2 * mean_accepted).long() + 1
            n = max(1, min(self.width, int(caps.max())))
        return n, caps

    def _project(self, hidden):
        """(..., d) head outputs -> (..., V) logits, padding never proposed."""
        if self.project is None:
            logits = self.decoder.base_logits(hidden)
        else:
            flat = self.project(hidden.reshape(-1, hidden.size(-1)))
            logits = flat.view(hidden.shape[:-1] + (-1,))
        logits[..., self.pad] = float("-inf")
        return logits

    def _choose(self, logits):
        """Proposals from (..., V) logits: the best tokens, or drawn ones with the
        distributions drawn from (speculative sampling)."""
        if self.sampler is None:
            return logits.argmax(dim=-1), None
        return self._draw(logits)

    def _recurrent(self, features, tokens, n):
        """Recurrent heads: each proposal from the state and token of the one before it,
        starting at the verifier's features and its token. (B, n) proposals, (B, n, V) or
        None."""
        if tokens is None:
            raise UsageError("recurrent proposal heads need the verifier's newest tokens")
        state, token, chosen, dists = features, tokens, [], []
        shortlist = self.sampler is None and isinstance(self.project, ShortlistProjection)
        for _ in range(n):
            state = self.decoder.proposal_step(state, token)
            if shortlist:  # padding is never shortlisted
                token, probs = self.project.best(state), None
            else:
                token, probs = self._choose(self._project(state))
            chosen.append(token)
            dists.append(probs)
        return torch.stack(chosen, 1), None if self.sampler is None else torch.stack(dists, 1)

    def observe(self, rows, features, last, tokens=None):
        if self.width <= 0:
            return
        if self.adaptive and self.drafted is not None:
            accepted = torch.minimum(last, self.drafted).float()
            mean = self.mean_accepted[rows]
            self.mean_accepted[rows] = torch.where(self.drafted > 0, 0.5 * (mean + accepted), mean)
        self.drafted = None
        n, caps = self._width(self.mean_accepted[rows])
        if self.decoder.proposals_read_tokens:
            drafted, probs = self._recurrent(features, tokens, n)
        else:
            drafted, probs = self._choose(self._project(self.decoder.proposal_features(features, n)))
        self.next_draft[rows, :n] = drafted
        if probs is not None:  # speculative sampling: keep the distributions drawn from
            if self.next_probs is None:
                self.next_probs = probs.new_zeros((self.next_draft.size(0),) + probs.shape[1:])
            self.next_probs[rows] = probs
        self.next_len[rows] = n if caps is None else caps.clamp(max=n)


class NARDrafter(Drafter):
    """GAD: a non-autoregressive block drafter (``glat_drafter``) predicts the next k tokens
    from [BOS, accepted prefix, MASK x k]; its encoder runs once per batch (none at all when it
    reads the verifier's encoder output, ``--drafter-encoder verifier``).

    The bidirectional drafter re-reads the prefix every iteration (nothing can be cached); see
    :class:`CachedNARDrafter` for the block-causal one. A draft stops after its first EOS.
    """

    BATCH_STATE = dict(Drafter.BATCH_STATE, encoder_out=None, rows=None, active_encoder_out=None)

    def __init__(self, model, block_size: int, eos: int, pad: int, dictionary=None,
                 draft_vocab=None):
        self.model, self.k, self.eos, self.pad = model, block_size, eos, pad
        # --draft-vocab: the slots score a shortlist of frequent types only
        self.project = draft_projection(plain_output_projection(model.decoder), dictionary,
                                        draft_vocab)

    def _slot_logits(self, features):
        """(B, k, d) slot features -> (B, k, V) logits."""
        if self.project is None:
            return self.model.decoder.output_layer(features)
        flat = self.project(features.reshape(-1, features.size(-1)))
        return flat.view(features.shape[:-1] + (-1,))

    def _encoder_out(self, sample, verifier_encoder_out):
        if self.model.reads_verifier_encoder:
            return verifier_encoder_out
        net = sample["net_input"]
        return self.model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])

    def start(self, sample, encoder_out, bos: int):
        self.encoder_out = self._encoder_out(sample, encoder_out)
        self.rows = None
        self.active_encoder_out = self.encoder_out

    def propose(self, rows, tokens, n_out, max_len):
        if self.rows is None or not torch.equal(rows, self.rows):
            self.active_encoder_out = self.model.encoder.reorder_encoder_out(self.encoder_out, rows)
            self.rows = rows
        inputs, slots = self.model.draft_inputs(tokens, n_out, self.k)
        logits = self._slot_logits(self.model.slot_features(inputs, slots, self.active_encoder_out))
        return self._finish(logits, max_len)

    def _finish(self, logits, max_len):
        """(B, k, V) slot logits -> drafts cut after their first EOS and at ``max_len``."""
        logits[..., self.pad] = float("-inf")
        if self.sampler is None:
            draft = logits.argmax(dim=-1)
        else:  # speculative sampling: draw every slot from the drafter's own distribution
            draft, self.draft_probs = self._draw(logits)
        width = draft.size(1)
        cols = torch.arange(width, device=draft.device).unsqueeze(0)
        first_eos = torch.where(draft.eq(self.eos), cols, width).min(dim=1).values
        lengths = torch.minimum(torch.clamp(first_eos + 1, max=width), max_len)
        draft = draft.masked_fill(cols >= lengths.unsqueeze(1), self.pad)
        if self.draft_probs is not None:
            self.draft_probs = self.draft_probs[:, : int(lengths.max()) if lengths.numel() else 0]
            draft = draft[:, : self.draft_probs.size(1)]
        return draft, lengths


class CachedNARDrafter(NARDrafter):
    """GAD with a block-causal drafter (``--drafter-attention block-causal``): the prefix's
    keys/values are cached like the verifier's.

    Each iteration feeds ``[MASK x k, tokens accepted since the last call]`` on top of the
    drafter's cache (the slots attend to the cache, the new tokens and each other; the new
    tokens attend causally to the cache and each other, never to the slots), reads the k slots,
    then drops the slots' entries: the cache holds BOS and every accepted token. The block has
    the slot-first layout the drafter was trained on, so the drafts equal the full forward's
    (tests/test_gad_cached.py).
    """

    BATCH_STATE = dict(NARDrafter.BATCH_STATE, cache=None, n_cached=None, mean_accepted=None,
                       drafted=None)

    def __init__(self, model, block_size: int, eos: int, pad: int, adaptive: bool = False,
                 dictionary=None, draft_vocab=None):
        super().__init__(model, block_size, eos, pad, dictionary, draft_vocab)
        from .lean_decoder import LeanBlockDecoder, lean_supported

        # adaptive: a row drafts at most twice its recent mean of accepted draft tokens, plus
        # one (as iad's copy drafter); slots no row drafts are not computed at all
        self.adaptive = adaptive
        if not lean_supported(model.decoder):
            raise UsageError(
                "the block-causal drafter's decoder layers use options its cached step does not "
                "reproduce (NormFormer, bias_kv, ...); train it without them")
        self.blocks = LeanBlockDecoder(model.decoder)
        self.mask_token = model.mask_index()
        self.max_step = model.max_decoder_positions() - 1

    def start(self, sample, encoder_out, bos: int):
        self.encoder_out = self._encoder_out(sample, encoder_out)
        bsz = sample["net_input"]["src_tokens"].size(0)
        device = sample["net_input"]["src_tokens"].device
        self.cache = self.blocks.new_state()
        self.rows = torch.arange(bsz, device=device)
        self.n_cached = torch.zeros(bsz, dtype=torch.long, device=device)  # BOS + tokens cached
        self.mean_accepted = torch.full((bsz,), float(self.k), device=device)
        self.drafted = None

    def _follow(self, rows):
        """Drop the cache rows of sentences that left the batch (rows only ever shrink)."""
        if rows.numel() == self.rows.numel():
            return
        keep = torch.searchsorted(self.rows, rows)
        self.blocks.reorder(self.cache, keep)
        self.n_cached = self.n_cached[keep]
        self.rows = rows

    def propose(self, rows, tokens, n_out, max_len):
        from .block_layout import BlockLayout

        self._follow(rows)
        device = tokens.device
        b = rows.numel()
        # adaptive: only the slots some row will draft are fed (k = the widest row's cap); the
        # drafter was trained with k slots, fewer mask slots are a shorter block of the same kind
        cap, k = max_len, self.k
        if self.adaptive and self.sampler is None:
            cap = torch.minimum((2 * self.mean_accepted[rows]).long() + 1, max_len)
            k = max(1, min(self.k, int(cap.max())))
        new = n_out + 1 - self.n_cached  # >= 1: every iteration gains a token (BOS first)
        width = int(new.max())
        cols = torch.arange(width, device=device).unsqueeze(0)
        fresh = tokens.gather(1, (self.n_cached.unsqueeze(1) + cols).clamp(max=tokens.size(1) - 1))
        fresh_pad = cols >= new.unsqueeze(1)
        block = torch.cat([tokens.new_full((b, k), self.mask_token),
                           fresh.masked_fill(fresh_pad, self.pad)], 1)
        block_pad = torch.cat([fresh_pad.new_zeros(b, k), fresh_pad], 1)
        slot_cols = torch.arange(k, device=device).unsqueeze(0)
        steps = torch.cat([n_out.unsqueeze(1) + 1 + slot_cols, self.n_cached.unsqueeze(1) + cols], 1)
        # slots past the drafter's last position (drafts near max length) share that position
        steps = steps.clamp(max=self.max_step)
        layout = BlockLayout(block_pad)
        first = self.blocks.cache_length(self.cache)
        mask = self.model.block_causal_mask(k, k + width, self.blocks.decoder.embed_tokens.weight)
        features = self.blocks.forward_packed(block, self.n_cached, layout, self.encoder_out,
                                              self.cache, steps=steps, block_mask=mask)
        logits = self._slot_logits(features[layout.pos[:, :k].reshape(-1)].view(b, k, -1))
        self.blocks.drop_columns(self.cache, first, k)
        self.blocks.compact(self.cache)  # holes left by ragged new tokens
        self.n_cached = n_out + 1
        draft, lengths = self._finish(logits, cap)
        self.drafted = lengths
        return draft, lengths

    def observe(self, rows, features, last, tokens=None):
        if not self.adaptive or self.drafted is None:
            return
        drafted = self.drafted
        accepted = torch.minimum(last, drafted).float()
        mean = self.mean_accepted[rows]
        self.mean_accepted[rows] = torch.where(drafted > 0, 0.5 * (mean + accepted), mean)
        self.drafted = None
