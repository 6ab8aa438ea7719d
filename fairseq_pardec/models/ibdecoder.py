"""IBDecoder family: several target words per decoding step with a standard Transformer decoder.

One model class covers (``--ib-directions h``, ``--ib-words-per-direction c``,
``--ib-positions``):

* h = 2, c = 1, signed positions: IBDecoder (Zhang, Titov, Sennrich 2020, Eq. 6-8);
* h = 2, c > 1: IBDecoder + SA (Eq. 12);      h = 1, c > 1: vanilla SA (Wang et al. 2018);
* even h > 2: IMDecoder (Eq. 9-11): step positions plus trainable direction embeddings;
* h = 2, c = 1, learned positions: head-and-tail double-token decoding (EOD = EOS padding);
* h = 1, c = 1, vanilla positions: an ordinary Transformer.

IBDecoder itself adds no parameters (IMDecoder adds h direction embeddings). The target order is
``fairseq_pardec.models.interleaving``'s. The model reorders its training data itself: ``forward`` takes
fairseq's usual ``prev_output_tokens`` (EOS + target) and ``get_targets`` reorders the targets,
so the stock ``label_smoothed_cross_entropy`` and both translation tasks train it unchanged.
Decoding goes through ``--generator interleaved``, which feeds interleaved tokens to the decoder,
z = h * c slots per incremental step.
"""

import math

import torch
import torch.nn as nn

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerModel,
    base_architecture,
    transformer_vaswani_wmt_en_de_big,
)

from fairseq_pardec.models import interleaving
from fairseq_pardec.models.decoder_inputs import encoder_states, final_features
from fairseq_pardec.errors import UsageError
from fairseq_pardec.models.loading import built_from_checkpoint, init_from_checkpoint
from fairseq_pardec.models.sizes import tiny_sizes

POSITION_KINDS = ("signed", "vanilla", "learned")


def sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """fairseq's sinusoid layout (sines, then cosines) for any integer positions, negative too."""
    half = dim // 2
    scale = math.log(10000) / max(half - 1, 1)
    freq = torch.exp(torch.arange(half, device=positions.device, dtype=torch.float) * -scale)
    angles = positions.float().unsqueeze(-1) * freq
    out = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    if dim % 2:
        out = torch.cat([out, out.new_zeros(out.shape[:-1] + (1,))], dim=-1)
    return out


class IBDecoderDecoder(TransformerDecoderBase):
    """A Transformer decoder over interleaved targets: z = h * c words per step."""

    def __init__(self, cfg, dictionary, embed_tokens, h, c, positions, relaxed_mask=True, **kwargs):
        super().__init__(cfg, dictionary, embed_tokens, **kwargs)
        self.h, self.c, self.z = h, c, h * c
        self.position_kind = positions
        self.relaxed_mask = relaxed_mask
        if positions == "signed":
            self.embed_positions = None  # replaced by signed / step sinusoids below
        embed_dim = cfg.decoder.embed_dim
        self.direction_embeddings = nn.Embedding(h, embed_dim) if h > 2 else None
        if self.direction_embeddings is not None:
            nn.init.normal_(self.direction_embeddings.weight, mean=0, std=embed_dim ** -0.5)

    def _slot_embeddings(self, slots, like, tokens):
        """Position (+ direction) embeddings of flat slots (B, L) for the current inputs."""
        h, c = self.h, self.c
        dim = like.size(-1)
        if self.position_kind == "signed":
            if h > 2:
                pos = sinusoid(interleaving.step_positions(slots, h, c), dim)
            else:
                pos = sinusoid(interleaving.signed_positions(slots, h, c), dim)
            pos = pos.to(like)
        else:
            pos = None  # fairseq's own table, applied by the caller
        if self.direction_embeddings is not None:
            direction = self.direction_embeddings(interleaving.slot_direction(slots, h, c))
            pos = direction if pos is None else pos + direction
        return pos

    def _self_attn_mask(self, first, length, like, incremental):
        """Rows ``first .. length - 1`` of the training mask: M(h, c) (Eq. 4), or M(1, 1) for the
        ablation "vanilla mask". None where every query sees every key.

        An incremental step queries the last z slots over the whole cache, so it needs the same
        rows of the same mask as training: under M(h, c) the cached slots are of earlier steps
        and the z new ones see each other (nothing to mask); under M(1, 1) a new slot must not
        see the new slots after it.
        """
        h, c = (self.h, self.c) if self.relaxed_mask else (1, 1)
        if incremental and h * c >= self.z:
            return None
        mask = interleaving.relaxed_causal_mask(length, h, c, device=like.device, dtype=like.dtype)
        return mask[first:]

    def extract_features_scriptable(self, prev_output_tokens, encoder_out=None,
                                    incremental_state=None, full_context_alignment=False,
                                    alignment_layer=None, alignment_heads=None):
        bsz, length = prev_output_tokens.size()
        enc, enc_pad = encoder_states(encoder_out)
        # vanilla / learned positions: fairseq's table over the flat index
        table = self.embed_positions(prev_output_tokens) if self.embed_positions is not None else None
        first = 0
        if incremental_state is not None:
            # one decoding step: the last z slots, on top of the cache
            first = length - self.z
            prev_output_tokens = prev_output_tokens[:, first:]
            table = table[:, first:] if table is not None else None
        slots = torch.arange(first, length, device=prev_output_tokens.device).unsqueeze(0)
        slots = slots.expand(bsz, -1)

        x = self.embed_scale * self.embed_tokens(prev_output_tokens.contiguous())
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if table is not None:
            x += table
        extra = self._slot_embeddings(slots, x, prev_output_tokens)
        if extra is not None:
            x = x + extra
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x)
        x = x.transpose(0, 1)

        self_attn_padding_mask = None
        if prev_output_tokens.eq(self.padding_idx).any():
            self_attn_padding_mask = prev_output_tokens.eq(self.padding_idx)
        self_attn_mask = None
        if not full_context_alignment:
            self_attn_mask = self._self_attn_mask(first, length, x, incremental_state is not None)

        inner_states = [x]
        for layer in self.layers:
            x, _, _ = layer(x, enc, enc_pad, incremental_state, self_attn_mask=self_attn_mask,
                            self_attn_padding_mask=self_attn_padding_mask)
            inner_states.append(x)
        return final_features(self, x, time_major=True), {"attn": [None], "inner_states": inner_states}


@register_model("ibdecoder")
class IBDecoderModel(TransformerModel):
    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--ib-directions", type=int, metavar="H",
                            help="generation directions h: 1, 2 (IBDecoder) or even > 2 (IMDecoder)")
        parser.add_argument("--ib-words-per-direction", type=int, metavar="C",
                            help="words per direction per step c (> 1: semi-autoregressive, +SA)")
        parser.add_argument("--ib-positions", choices=POSITION_KINDS,
                            help="signed (Eq. 7; step + direction for h > 2), vanilla (flat "
                                 "index, sinusoid) or learned (flat index; double-token)")
        parser.add_argument("--init-from-transformer", metavar="PATH",
                            help="start from a trained fairseq transformer of the same sizes: "
                                 "IBDecoder reuses every parameter (direction embeddings and "
                                 "learned positions, where used, start fresh), then fine-tunes "
                                 "on the interleaved order")
        parser.add_argument("--ib-vanilla-mask", action="store_true",
                            help="ablation: the standard causal mask M(1,1) instead of M(h,c)")

    @classmethod
    def build_model(cls, args, task):
        try:
            interleaving.check_directions(args.ib_directions, args.ib_words_per_direction)
        except ValueError as error:
            raise UsageError(str(error))
        if args.ib_positions not in POSITION_KINDS:
            raise UsageError("--ib-positions must be one of %s" % ", ".join(POSITION_KINDS))
        args.decoder_learned_pos = args.ib_positions == "learned"
        model = super().build_model(args, task)
        path = getattr(args, "init_from_transformer", None)
        if path and not built_from_checkpoint(args):  # a trained model's checkpoint holds every weight
            # a transformer's sinusoid buffer has no place in signed positions; learned positions
            # and direction embeddings are new parameters
            init_from_checkpoint(model, path, "--init-from-transformer",
                                 may_differ=("decoder.embed_positions.", "decoder.direction_embeddings."))
        return model

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return IBDecoderDecoder(cfg, tgt_dict, embed_tokens, args.ib_directions,
                                args.ib_words_per_direction, args.ib_positions,
                                relaxed_mask=not args.ib_vanilla_mask,
                                no_encoder_attn=cfg.no_cross_attention)

    @property
    def words_per_step(self):
        return self.decoder.z

    def max_target_tokens(self) -> int:
        """Longest target (words + EOS) whose interleaved layout fits the decoder's positions:
        n words take num_steps(n) * h * c slots, up to z more than n + 1 (12 words: 14 slots
        at h = 2, 16 at h = 4)."""
        h, c = self.decoder.h, self.decoder.c
        limit = self.max_decoder_positions()
        n = limit
        while n > 0 and interleaving.num_steps(n, h, c) * h * c > limit:
            n -= 1
        return n + 1

    def max_positions(self):
        """fairseq filters (or, in training, skips) examples by this, so a target that fits
        ``--max-target-positions`` but not its interleaved layout never reaches ``forward``."""
        return (self.encoder.max_positions(), self.max_target_tokens())

    # ---------------------------------------------------------------- training data layout
    def interleave_targets(self, target):
        """fairseq targets (content + EOS, right-padded) -> flat interleaved targets."""
        dictionary = self.decoder.dictionary
        pad, eos = dictionary.pad(), dictionary.eos()
        lengths = (target.ne(pad) & target.ne(eos)).sum(1)
        flat = interleaving.interleave(target, lengths, self.decoder.h, self.decoder.c, eos, pad)
        limit = self.max_decoder_positions()
        if flat.size(1) > limit:  # fairseq filters by max_positions(); direct callers may not
            raise ValueError(
                "a target of %d tokens needs %d interleaved slots, more than the decoder's "
                "--max-target-positions %d; raise it or filter long sentences" %
                (int(lengths.max()), flat.size(1), limit)
            )
        return flat

    def interleaved_inputs(self, flat):
        """Decoder inputs: z start symbols, then the flat targets shifted by z (Sec. 4, fn. 3)."""
        dictionary = self.decoder.dictionary
        z = self.decoder.z
        start = flat.new_full((flat.size(0), z), dictionary.eos())
        return torch.cat([start, flat[:, :-z]], dim=1)

    def forward(self, src_tokens, src_lengths, prev_output_tokens, **kwargs):
        # prev_output_tokens is fairseq's [EOS, y_1 .. y_n]: rebuild the target, reorder it.
        dictionary = self.decoder.dictionary
        target = torch.cat([prev_output_tokens[:, 1:], prev_output_tokens.new_full(
            (prev_output_tokens.size(0), 1), dictionary.pad())], dim=1)
        lengths = target.ne(dictionary.pad()).sum(1)
        target = target.scatter(1, lengths.unsqueeze(1), dictionary.eos())
        inputs = self.interleaved_inputs(self.interleave_targets(target))
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        return self.decoder(inputs, encoder_out=encoder_out, src_lengths=src_lengths)

    def get_targets(self, sample, net_output):
        return self.interleave_targets(sample["target"])


def _defaults(args, h=2, c=1, positions="signed"):
    args.ib_directions = getattr(args, "ib_directions", h)
    args.ib_words_per_direction = getattr(args, "ib_words_per_direction", c)
    args.ib_positions = getattr(args, "ib_positions", positions)
    args.ib_vanilla_mask = getattr(args, "ib_vanilla_mask", False)


@register_model_architecture("ibdecoder", "ibdecoder")
def ibdecoder(args):
    _defaults(args)
    base_architecture(args)


@register_model_architecture("ibdecoder", "ibdecoder_base")
def ibdecoder_base(args):
    ibdecoder(args)


@register_model_architecture("ibdecoder", "ibdecoder_big")
def ibdecoder_big(args):
    _defaults(args)
    transformer_vaswani_wmt_en_de_big(args)


@register_model_architecture("ibdecoder", "ibdecoder_tiny")
def ibdecoder_tiny(args):
    tiny_sizes(args)
    ibdecoder(args)
