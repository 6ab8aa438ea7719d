"""GAD's non-autoregressive block drafter (Xia et al., "Lossless Speedup of Autoregressive
Translation with Generalized Aggressive Decoding", § 3.1).

A Transformer encoder-decoder whose decoder is *not* causal: its input is
``[BOS, y_1 .. y_p, MASK x k]`` (the accepted prefix, then k mask slots) and it predicts the next k
tokens at the mask slots in parallel. The mask slot is the dictionary's ``<unk>`` token, so the
drafter shares its dictionary with the verifier unchanged (the copy of ``<unk>`` in a real prefix
is rare with BPE, and the slots are told apart by their positions).

Training (``--criterion glat_loss``) samples a random prefix per target and uses glancing
(Qian et al. 2021); see ``fairseq_pardec/criterions/glat_loss.py``.

Options that make the drafter cheap to run next to a trained verifier (ours, not the paper's):

* ``--drafter-attention block-causal``: prefix positions attend causally (as the verifier's
  decoder does), the k mask slots attend to the whole prefix and to each other. The prefix's
  keys/values then never depend on the slots, so decoding caches them: each iteration feeds only
  the newly accepted tokens plus k slots and drops the slots afterwards
  (``decoding/draft_verify/drafters/``, ``CachedNARDrafter``). The slots come *first* in the input,
  ``[MASK x k, BOS, y_1 .. y_p, pad ..]``, with explicit positions (slot j at step p + 1 + j),
  so one (T, T) attention mask serves every row of a batch whatever its prefix length.
* ``--drafter-encoder verifier``: the encoder is the verifier's (copied by
  ``--init-from-verifier``, frozen, run without dropout), so decoding reads the verifier's encoder
  output instead of running a second encoder.
* ``--init-drafter-decoder``: every decoder layer (the verifier's first N) starts from the
  verifier's decoder, not from scratch.
"""

import logging
from typing import Optional

import torch

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerModel,
    base_architecture,
    transformer_vaswani_wmt_en_de_big,
)

from fairseq_pardec.errors import UsageError
from fairseq_pardec.models.decoder_inputs import embed_at, encoder_states, final_features
from fairseq_pardec.models.loading import built_from_checkpoint, init_from_checkpoint
from fairseq_pardec.models.sizes import tiny_sizes

logger = logging.getLogger(__name__)


@register_model("glat_drafter")
class GlatDrafterModel(TransformerModel):
    """Encoder + bidirectional decoder over [prefix; k masks] (``--drafter-block-size k``)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--drafter-block-size", type=int, metavar="K",
                            help="mask slots per training example (the paper's block size k)")
        parser.add_argument("--init-from-verifier", metavar="PATH",
                            help="initialise the encoder and the embeddings from a trained "
                                 "autoregressive transformer checkpoint of the same sizes")
        parser.add_argument("--drafter-attention", choices=["bidirectional", "block-causal"],
                            help="bidirectional (the paper) or block-causal: causal over the "
                                 "prefix, so decoding caches it and feeds only new tokens")
        parser.add_argument("--drafter-encoder", choices=["own", "verifier"],
                            help="verifier: use the verifier's encoder (copied by "
                                 "--init-from-verifier and frozen); decoding then reads the "
                                 "verifier's encoder output instead of running a second encoder")
        parser.add_argument("--init-drafter-decoder", action="store_true",
                            help="with --init-from-verifier: also initialise the decoder layers "
                                 "(the verifier's first --decoder-layers) from the verifier")

    @classmethod
    def build_model(cls, args, task):
        if getattr(args, "drafter_block_size", 0) < 1:
            raise UsageError("--drafter-block-size must be >= 1 for --arch glat_drafter*")
        path = getattr(args, "init_from_verifier", None)
        if not path and not built_from_checkpoint(args):
            for flag, used in (("--drafter-encoder verifier", getattr(args, "drafter_encoder", "own") == "verifier"),
                               ("--init-drafter-decoder", getattr(args, "init_drafter_decoder", False))):
                if used:
                    raise UsageError("%s needs --init-from-verifier PATH (the verifier's "
                                     "checkpoint)" % flag)
        model = super().build_model(args, task)
        if path and not built_from_checkpoint(args):
            cls._init_from_verifier(model, path, getattr(args, "init_drafter_decoder", False))
        if getattr(args, "drafter_encoder", "own") == "verifier":
            for param in model.encoder.parameters():
                param.requires_grad = False
        return model

    @staticmethod
    def _init_from_verifier(model, path, with_decoder):
        # the verifier may have more decoder layers than the drafter (its first N are copied)
        own_layers = len(model.decoder.layers)
        extra = tuple("decoder.layers.%d." % i for i in range(own_layers, 64))
        decoder_parts = ("decoder.layers.", "decoder.layer_norm.", "decoder.embed_positions.",
                         "decoder.layernorm_embedding.")
        init_from_checkpoint(
            model, path, "--init-from-verifier",
            may_differ=extra + (() if with_decoder else decoder_parts),
            skip=() if with_decoder else decoder_parts,
        )
        logger.info("initialised the drafter's encoder, embeddings%s from %s",
                    " and decoder" if with_decoder else "", path)

    @property
    def block_size(self):
        return self.args.drafter_block_size

    @property
    def block_causal(self) -> bool:
        return getattr(self.args, "drafter_attention", "bidirectional") == "block-causal"

    @property
    def reads_verifier_encoder(self) -> bool:
        return getattr(self.args, "drafter_encoder", "own") == "verifier"

    def mask_index(self):
        return self.decoder.dictionary.unk()

    def encode(self, src_tokens, src_lengths):
        """The encoder output the drafter reads. A verifier's encoder (``--drafter-encoder
        verifier``) is frozen and runs as at decoding time: no dropout, no gradient."""
        if not self.reads_verifier_encoder:
            return self.encoder(src_tokens, src_lengths=src_lengths)
        mode = self.encoder.training
        self.encoder.eval()
        try:
            with torch.no_grad():
                return self.encoder(src_tokens, src_lengths=src_lengths)
        finally:
            self.encoder.train(mode)

    def forward(self, src_tokens, src_lengths, prev_output_tokens, slots=None, encoder_out=None,
                **kwargs):
        """Decoding of ``prev_output_tokens`` (prefix and mask slots): all logits; with ``slots``
        (B, k), the logits (B, k, V) at the slots only (:meth:`slot_logits`). ``encoder_out``: an
        encoder output of ``src_tokens`` already computed (by :meth:`encode`).

        ``glat_loss`` takes its gradient pass through here, not through :meth:`slot_logits`:
        torch's DistributedDataParallel (``--ddp-backend pytorch_ddp``, fairseq's default) only
        all-reduces the gradients of a backward pass whose forward went through the wrapped
        model's ``forward``; methods reached through fairseq's wrapper bypass it, and each
        process would keep its own gradient (fairseq on GPUs: "gradients are inconsistent
        between workers")."""
        if encoder_out is None:
            encoder_out = self.encode(src_tokens, src_lengths)
        if slots is not None:
            return self.slot_logits(prev_output_tokens, slots, encoder_out)
        if self.block_causal:
            features = self.block_causal_features(prev_output_tokens, encoder_out)
            return self.decoder.output_layer(features), None
        return self.decode(prev_output_tokens, encoder_out)

    def decode(self, tokens, encoder_out):
        """(B, T) [BOS, prefix, masks, pad...] -> (B, T, V) logits, no causal mask."""
        return self.decoder(tokens, encoder_out=encoder_out, full_context_alignment=True)

    def slot_logits(self, tokens, slots, encoder_out):
        """Logits (B, k, V) at the mask slots only: the vocabulary projection of the prefix
        positions, which nobody reads, is skipped (about half of it with a long prefix)."""
        return self.decoder.output_layer(self.slot_features(tokens, slots, encoder_out))

    def slot_features(self, tokens, slots, encoder_out):
        """Decoder features (B, k, d) at the mask slots, before the vocabulary projection."""
        if self.block_causal:
            features = self.block_causal_features(tokens, encoder_out)
        else:
            features = self.decoder(tokens, encoder_out=encoder_out, full_context_alignment=True,
                                    features_only=True)[0]
        return features.gather(1, slots.unsqueeze(-1).expand(-1, -1, features.size(-1)))

    # ------------------------------------------------------------------ block-causal layout
    def block_causal_steps(self, tokens):
        """Decoder step of each position of ``[MASK x k, BOS, y_1 .. y_p, pad ..]``: slot j is
        step p + 1 + j, prefix position i is step i; padding gets -1."""
        k = self.block_size
        prefix_len = tokens[:, k:].ne(self.decoder.padding_idx).sum(1)  # p + 1 (BOS)
        cols = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0)
        steps = torch.where(cols < k, prefix_len.unsqueeze(1) + cols, cols - k)
        return steps.masked_fill(tokens.eq(self.decoder.padding_idx), -1)

    @staticmethod
    def block_causal_mask(k: int, length: int, like: torch.Tensor):
        """Additive (L, L) mask of [k slots, L - k prefix positions]: slots see everything,
        prefix positions see the prefix causally and no slot."""
        mask = like.new_zeros(length, length)
        prefix = length - k
        mask[k:, :k] = float("-inf")
        mask[k:, k:] = torch.triu(like.new_full((prefix, prefix), float("-inf")), diagonal=1)
        return mask

    def block_causal_features(self, tokens, encoder_out):
        """Features (B, T, d) of the block-causal decoder over the slot-first layout, through
        fairseq's own decoder layers (dropout and all, for training)."""
        dec = self.decoder
        pad = dec.padding_idx
        steps = self.block_causal_steps(tokens)
        positions = torch.where(steps >= 0, steps + pad + 1, torch.full_like(steps, pad))
        x = embed_at(dec, tokens, positions).transpose(0, 1)
        self_pad = tokens.eq(pad)
        mask = self.block_causal_mask(self.block_size, tokens.size(1), x)
        enc, enc_pad = encoder_states(encoder_out)
        for layer in dec.layers:
            x, _, _ = layer(x, enc, enc_pad, self_attn_mask=mask,
                            self_attn_padding_mask=self_pad if bool(self_pad.any()) else None)
        return final_features(dec, x, time_major=True)

    def draft_inputs(self, prefixes, n_prefix, k, longest: Optional[int] = None):
        """The decoder input per row and the positions of its k mask slots: ``[BOS, prefix,
        MASK x k]`` (right-padded; block-causal: ``[MASK x k, BOS, prefix]``).

        Args:
            prefixes: (B, T) tokens starting with BOS (right part may hold anything).
            n_prefix: (B,) accepted tokens after BOS.
            longest: ``max(n_prefix)`` where the caller knows it on the host (else it is
                read from ``n_prefix``: on CUDA a wait for the device).
        Returns:
            tokens (B, W) and slots (B, k) positions of the mask slots.
        """
        if longest is None:
            longest = int(n_prefix.max()) if n_prefix.numel() else 0
        if self.block_causal:
            return self._slot_first_inputs(prefixes, n_prefix, k, longest)
        bsz = prefixes.size(0)
        device = prefixes.device
        width = longest + 1 + k
        cols = torch.arange(width, device=device).unsqueeze(0)
        ends = (n_prefix + 1).unsqueeze(1)
        src = prefixes[:, : min(width, prefixes.size(1))]
        if src.size(1) < width:
            src = torch.cat([src, src.new_full((bsz, width - src.size(1)), self.decoder.padding_idx)], 1)
        tokens = torch.where(cols < ends, src, torch.full_like(src, self.decoder.padding_idx))
        tokens = torch.where((cols >= ends) & (cols < ends + k),
                             torch.full_like(src, self.mask_index()), tokens)
        slots = ends + torch.arange(k, device=device).unsqueeze(0)
        return tokens, slots

    def _slot_first_inputs(self, prefixes, n_prefix, k, longest: int):
        bsz, device = prefixes.size(0), prefixes.device
        width = longest + 1
        src = prefixes[:, :width]
        cols = torch.arange(width, device=device).unsqueeze(0)
        prefix = src.masked_fill(cols > n_prefix.unsqueeze(1), self.decoder.padding_idx)
        masks = prefixes.new_full((bsz, k), self.mask_index())
        slots = torch.arange(k, device=device).unsqueeze(0).expand(bsz, k)
        return torch.cat([masks, prefix], 1), slots


def _defaults(args, k=25):
    args.drafter_block_size = getattr(args, "drafter_block_size", k)
    args.init_from_verifier = getattr(args, "init_from_verifier", None)
    args.drafter_attention = getattr(args, "drafter_attention", None) or "bidirectional"
    args.drafter_encoder = getattr(args, "drafter_encoder", None) or "own"
    args.init_drafter_decoder = getattr(args, "init_drafter_decoder", False)


@register_model_architecture("glat_drafter", "glat_drafter")
def glat_drafter(args):
    _defaults(args)
    base_architecture(args)


@register_model_architecture("glat_drafter", "glat_drafter_base")
def glat_drafter_base(args):
    glat_drafter(args)


@register_model_architecture("glat_drafter", "glat_drafter_big")
def glat_drafter_big(args):
    _defaults(args, k=30)
    transformer_vaswani_wmt_en_de_big(args)


@register_model_architecture("glat_drafter", "glat_drafter_tiny")
def glat_drafter_tiny(args):
    tiny_sizes(args)
    _defaults(args, k=5)
    base_architecture(args)
