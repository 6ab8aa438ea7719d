"""GAD's non-autoregressive block drafter (Xia et al., "Lossless Speedup of Autoregressive
Translation with Generalized Aggressive Decoding", § 3.1).

A Transformer encoder-decoder whose decoder is *not* causal: its input is
``[BOS, y_1 .. y_p, MASK x k]`` (the accepted prefix, then k mask slots) and it predicts the next k
tokens at the mask slots in parallel. The mask slot is the dictionary's ``<unk>`` token, so the
drafter shares its dictionary with the verifier unchanged (the copy of ``<unk>`` in a real prefix
is rare with BPE, and the slots are told apart by their positions).

Training (``--criterion glat_loss``) samples a random prefix per target and uses glancing
(Qian et al. 2021); see ``fairseq_pardec/criterions/glat_loss.py``.
"""

import logging
import os

import torch

from fairseq import checkpoint_utils
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerModel,
    base_architecture,
    transformer_vaswani_wmt_en_de_big,
)

from ..errors import UsageError
from .loading import LOADING_CHECKPOINT
from .sizes import tiny_sizes

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

    @classmethod
    def build_model(cls, args, task):
        if getattr(args, "drafter_block_size", 0) < 1:
            raise UsageError("--drafter-block-size must be >= 1 for --arch glat_drafter*")
        model = super().build_model(args, task)
        path = getattr(args, "init_from_verifier", None)
        if path:
            if not LOADING_CHECKPOINT.active:
                cls._init_from_verifier(model, path)
        return model

    @staticmethod
    def _init_from_verifier(model, path):
        if not os.path.isfile(path):
            raise UsageError("--init-from-verifier: no checkpoint file %r" % path)
        state = checkpoint_utils.load_checkpoint_to_cpu(path)["model"]
        wanted = {k: v for k, v in state.items()
                  if k.startswith("encoder.") or k.startswith("decoder.embed_tokens")
                  or k.startswith("decoder.output_projection")}
        own = model.state_dict()
        bad = [k for k, v in wanted.items() if k not in own or own[k].shape != v.shape]
        if bad:
            raise UsageError("--init-from-verifier %s does not match the drafter's sizes (%s)"
                             % (path, bad[:3]))
        model.load_state_dict(wanted, strict=False)
        logger.info("initialised the drafter's encoder and embeddings from %s", path)

    @property
    def block_size(self):
        return self.args.drafter_block_size

    def mask_index(self):
        return self.decoder.dictionary.unk()

    def forward(self, src_tokens, src_lengths, prev_output_tokens, **kwargs):
        """Bidirectional decoding of ``prev_output_tokens`` (prefix and mask slots)."""
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        return self.decode(prev_output_tokens, encoder_out)

    def decode(self, tokens, encoder_out):
        """(B, T) [BOS, prefix, masks, pad...] -> (B, T, V) logits, no causal mask."""
        return self.decoder(tokens, encoder_out=encoder_out, full_context_alignment=True)

    def slot_logits(self, tokens, slots, encoder_out):
        """Logits (B, k, V) at the mask slots only: the vocabulary projection of the prefix
        positions, which nobody reads, is skipped (about half of it with a long prefix)."""
        features = self.decoder(tokens, encoder_out=encoder_out, full_context_alignment=True,
                                features_only=True)[0]
        features = features.gather(1, slots.unsqueeze(-1).expand(-1, -1, features.size(-1)))
        return self.decoder.output_layer(features)

    def draft_inputs(self, prefixes, n_prefix, k):
        """Build [BOS, prefix, MASK x k] per row (right-padded) and the mask slot positions.

        Args:
            prefixes: (B, T) tokens starting with BOS (right part may hold anything).
            n_prefix: (B,) accepted tokens after BOS.
        Returns:
            tokens (B, W) and slots (B, k) positions of the mask slots.
        """
        bsz = prefixes.size(0)
        device = prefixes.device
        width = int(n_prefix.max()) + 1 + k
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


def _defaults(args, k=25):
    args.drafter_block_size = getattr(args, "drafter_block_size", k)
    args.init_from_verifier = getattr(args, "init_from_verifier", None)


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
