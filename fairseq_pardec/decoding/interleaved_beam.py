"""Beam search emitting z = h * c words per step (IBDecoder's Algorithm 1; DOUBLETOPK).

Per hypothesis and step the decoder gives z distributions (one per slot). Candidates are the
best combinations of one word per slot: each slot's top-K words, combined slot by slot with an
outer sum and pruned to the top K after each slot (exact for the top K of the full outer sum:
a top-K combination has a top-K prefix). K = ``candidates`` x beam: 2 reproduces fairseq's
beam search at z = 1; 3 is the double-token paper's DOUBLETOPK rule (3W candidates so that W
unfinished ones remain).

Across the beam the rules are fairseq ``SequenceGenerator``'s: the top K candidates of a sentence
are ranked; those among its first ``beam`` that contain an EOS are finished (IBDecoder § 4.2: a
hypothesis ends once any emitted word is EOS), the first ``beam`` others continue; a sentence is
done with ``beam`` finished hypotheses or at the length limit, where EOS is forced. Scores are
summed log-probabilities normalised by (content length + 1) ** lenpen. Finished hypotheses are
de-interleaved, so fairseq-generate prints them in reading order.
"""

import math

import torch

from fairseq_pardec.models import interleaving
from fairseq_pardec.errors import UsageError
from fairseq_pardec.decoding.fairseq_rules import token_rules
from fairseq_pardec.decoding.options import (build_through_fairseq, refuse_unknown_arguments, sampling_of,
                                 set_output_symbols)
from fairseq_pardec.decoding.step.output_projection import OutputProjection, plain_output_projection
from fairseq_pardec.decoding.decode_stats import DecodeStats, StatsGenerator


class InterleavedBeamSearch(StatsGenerator):
    def __init__(self, models, tgt_dict, beam_size=4, max_len_a=0.0, max_len_b=200, min_len=1,
                 normalize_scores=True, len_penalty=1.0, unk_penalty=0.0, candidates=2):
        if len(models) != 1:
            raise UsageError("--generator interleaved decodes with one model; give one checkpoint")
        model = models[0]
        if not hasattr(model, "words_per_step"):
            raise UsageError(
                "--generator interleaved needs an ibdecoder model (--arch ibdecoder*); "
                "%s is not one: use --generator beam or greedy" % type(model).__name__
            )
        self.model = model
        model.eval()  # as fairseq's SequenceGenerator: no dropout while decoding
        self.h, self.c, self.z = model.decoder.h, model.decoder.c, model.decoder.z
        self.tgt_dict = tgt_dict
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.vocab_size = len(tgt_dict)
        self.beam_size = max(1, min(beam_size, self.vocab_size - 1))
        self.max_len_a, self.max_len_b, self.min_len = max_len_a, max_len_b, min_len
        self.normalize_scores, self.len_penalty = normalize_scores, len_penalty
        self.unk_penalty = unk_penalty
        self.candidates = candidates
        self.stats = DecodeStats()
        self.symbols_to_strip_from_output = {self.eos}
        # the vocabulary projection of a step's N x z rows through oneDNN's packed weight on
        # the CPU (output_projection.py); a decoder with another output layer keeps its own
        projection = plain_output_projection(model.decoder)
        self._projection = OutputProjection(projection) if projection is not None else None

    unsupported_kwargs = {"constraints": "--constraints", "prefix_tokens": "--prefix-size"}
    name = "interleaved"

    # ------------------------------------------------------------------ candidates
    def _combine(self, lprobs, k):
        """(N, z, V) slot log-probs -> top-k (N, k) summed scores and (N, k, z) words."""
        values, words = lprobs.topk(k, dim=-1)  # (N, z, k)
        scores, chosen = values[:, 0], words[:, 0].unsqueeze(-1)  # (N, k), (N, k, 1)
        for slot in range(1, lprobs.size(1)):
            total = scores.unsqueeze(2) + values[:, slot].unsqueeze(1)  # (N, k, k)
            scores, flat = total.view(total.size(0), -1).topk(k, dim=-1)
            prev, new = flat // k, flat % k
            chosen = torch.cat([chosen.gather(1, prev.unsqueeze(-1).expand(-1, -1, chosen.size(2))),
                                words[:, slot].gather(1, new).unsqueeze(-1)], dim=2)
        return scores, chosen

    def _step_logits(self, tokens, encoder_out, state):
        """(N, z, V) logits of one incremental decoder step."""
        if self._projection is None:
            return self.model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)[0]
        features, _ = self.model.decoder(tokens, encoder_out=encoder_out, incremental_state=state,
                                         features_only=True)
        rows = self._projection(features.reshape(-1, features.size(-1)))
        return rows.view(features.shape[:-1] + rows.shape[-1:])

    # ------------------------------------------------------------------ search
    def _generate(self, sample, **unused):
        model, z, beam = self.model, self.z, self.beam_size
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        bsz, src_len = src_tokens.size()[:2]
        device = src_tokens.device
        max_words = int(self.max_len_a * src_len + self.max_len_b)
        # flat slots are positions: stay inside the decoder's table
        max_steps = max(1, min(math.ceil((max_words + 1) / z), model.max_decoder_positions() // z))

        encoder_out = model.encoder.forward_torchscript(net_input)
        order = torch.arange(bsz, device=device).repeat_interleave(beam)
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, order)
        n = bsz * beam
        tokens = torch.full((n, (max_steps + 1) * z), self.pad, dtype=torch.long, device=device)
        tokens[:, :z] = self.eos
        slot_lp = torch.zeros(n, max_steps * z, device=device)
        scores = torch.zeros(bsz, beam, device=device)
        scores[:, 1:] = -math.inf  # at the start every beam is the same hypothesis
        scores = scores.view(-1)
        k = min(self.candidates * beam, self.vocab_size - 1)
        finalized = [[] for _ in range(bsz)]
        sent_ids = torch.arange(bsz, device=device)  # active sentence -> batch row
        state = {}
        model.decoder.set_beam_size(1)

        for step in range(max_steps):
            width = (step + 1) * z
            logits = self._step_logits(tokens[:, :width], encoder_out, state)
            lprobs = torch.log_softmax(logits.float(), dim=-1)  # (N, z, V)
            self.stats.decoder_calls += 1
            self.stats.row_iterations += sent_ids.numel()
            token_rules(lprobs, self.pad, self.unk, self.unk_penalty)
            if step == max_steps - 1:  # length limit: every slot ends
                eos_lp = lprobs[:, :, self.eos].clone()
                lprobs.fill_(-math.inf)
                lprobs[:, :, self.eos] = eos_lp
            elif step * z < self.min_len:
                lprobs[:, :, self.eos] = -math.inf

            cand_scores, cand_words = self._combine(lprobs, k)  # (N, k), (N, k, z)
            active = sent_ids.numel()
            total = (scores.unsqueeze(1) + cand_scores).view(active, beam * k)
            top_scores, top_idx = total.topk(k, dim=1)  # rank a sentence's candidates
            src_beam = top_idx // k  # which hypothesis of the sentence
            src_cand = top_idx % k
            src_row = src_beam + (torch.arange(active, device=device) * beam).unsqueeze(1)
            words = cand_words[src_row, src_cand]  # (active, k, z)
            word_lp = lprobs[src_row.unsqueeze(-1), torch.arange(z, device=device), words]
            has_eos = words.eq(self.eos).any(-1) & top_scores.ne(-math.inf)

            # finish EOS candidates ranked within the first `beam`
            # one device-to-host copy per step (not one per sentence): sentence ids, and the
            # source rows of the finished candidates only when there are some
            done_sents = []
            sents = sent_ids.tolist()
            fin = has_eos[:, :beam].nonzero().tolist()
            fin_rows = src_row[:, :beam].tolist() if fin else None
            for a, j in fin:
                sent = sents[a]
                if len(finalized[sent]) >= beam:
                    continue
                row = fin_rows[a][j]
                flat = tokens[row, z:width].tolist() + words[a, j].tolist()
                flat_lp = torch.cat([slot_lp[row, : step * z], word_lp[a, j]])
                finalized[sent].append(self._hypothesis(flat, flat_lp, top_scores[a, j]))
            for a in range(active):
                if len(finalized[sents[a]]) >= beam or step == max_steps - 1:
                    done_sents.append(a)
            if len(done_sents) == active:
                break

            # the first `beam` candidates without EOS continue
            rank = torch.arange(k, device=device).unsqueeze(0) + has_eos.long() * k
            keep = rank.topk(beam, dim=1, largest=False).indices  # (active, beam)
            alive = torch.ones(active, dtype=torch.bool, device=device)
            if done_sents:
                alive[done_sents] = False
            keep = keep[alive]
            rows = src_row[alive].gather(1, keep).view(-1)
            new_words = words[alive].gather(1, keep.unsqueeze(-1).expand(-1, -1, z)).view(-1, z)
            new_lp = word_lp[alive].gather(1, keep.unsqueeze(-1).expand(-1, -1, z)).view(-1, z)
            scores = top_scores[alive].gather(1, keep).view(-1)
            tokens = tokens[rows]
            tokens[:, width : width + z] = new_words
            slot_lp = slot_lp[rows]
            slot_lp[:, step * z : width] = new_lp
            sent_ids = sent_ids[alive]
            model.decoder.reorder_incremental_state_scripting(state, rows)
            encoder_out = model.encoder.reorder_encoder_out(encoder_out, rows)

        for sent in range(bsz):
            finalized[sent].sort(key=lambda hyp: float(hyp["score"]), reverse=True)
        return finalized

    def _hypothesis(self, flat, flat_lp, total_score):
        """Flat decoded slots -> fairseq hypothesis in reading order."""
        words = interleaving.deinterleave(flat, self.h, self.c, self.eos)
        indices = interleaving.interleave_indices(len(words), self.h, self.c)
        # per-word scores in reading order (a word's slot), EOS slots summed at the end
        lp = flat_lp.tolist()
        by_word = [0.0] * len(words)
        eos_lp = 0.0
        for slot, source in enumerate(indices):
            if slot >= len(lp):
                break
            if source >= 0:
                by_word[source] = lp[slot]
            else:
                eos_lp += lp[slot]
        length = len(words) + 1
        score = total_score.clone()
        if self.normalize_scores:
            score /= length ** self.len_penalty
        device = total_score.device
        return {
            "tokens": torch.tensor(words + [self.eos], dtype=torch.long, device=device),
            "score": score,
            "attention": torch.empty(0),
            "alignment": torch.empty(0),
            "positional_scores": torch.tensor(by_word + [eos_lp], device=device),
        }


def build_interleaved(task, models, args, extra_gen_cls_kwargs=None, **kwargs):
    """Build through fairseq's own mapping of the generation config (options.py)."""
    decoder = getattr(models[0], "decoder", None) if models else None
    candidates = task.cfg.interleaved_candidates
    if candidates is None:  # DOUBLETOPK for the double-token variant, fairseq's 2x otherwise
        candidates = 3 if getattr(decoder, "position_kind", None) == "learned" else 2
    return build_through_fairseq(task, models, args, _from_fairseq, extra_gen_cls_kwargs,
                                 candidates=candidates)


def _from_fairseq(models, tgt_dict, *, search_strategy, beam_size, candidates, temperature=1.0,
                  match_source_len=False, no_repeat_ngram_size=0, eos=None,
                  symbols_to_strip_from_output=None, tokens_to_suppress=(), **mapped):
    """fairseq's generator arguments -> InterleavedBeamSearch (its options were refused)."""
    refuse_unknown_arguments(InterleavedBeamSearch, mapped, tokens_to_suppress)
    sampling_of(search_strategy)  # plain beam search only
    return set_output_symbols(
        InterleavedBeamSearch(models, tgt_dict, beam_size=beam_size, candidates=candidates,
                              **mapped), eos, symbols_to_strip_from_output)
