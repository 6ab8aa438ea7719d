"""Blockwise parallel decoding model (Stern, Shazeer, Uszkoreit 2018, § 4 and § 6, Fig. 3).

A fairseq transformer whose decoder output goes through one multi-output feed-forward layer
(hidden size k x d_ffn, output k x d_model) with a residual connection from its input to each of
the k outputs; the model's own output projection is applied to each output, giving p_1 ... p_k,
where p_i predicts the token i positions ahead (``--proposal-layer light``: one small residual
block per head instead, see :class:`LightProposalLayer`). ``--identity-first-head`` makes p_1 the base
model's own distribution (footnote 1): a frozen base then decodes exactly like the baseline.

fairseq sees p_1 as the model's output (``output_layer``), so stock scoring, ``--generator
greedy`` and beam search use it; ``--generator blockwise`` also reads heads 2..k.
"""

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq import utils
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerModel,
    base_architecture,
    transformer_vaswani_wmt_en_de_big,
)

from ..errors import UsageError
from .loading import built_from_checkpoint, init_from_checkpoint
from .sizes import tiny_sizes

logger = logging.getLogger(__name__)


class _Heads(nn.Module):
    """Heads p_1..p_k as a residual map per head; p_1 may be the identity (the base itself)."""

    def forward(self, x, heads=None):
        """(..., d) -> (..., n, d): outputs of the first ``heads`` heads (default: all k)."""
        heads = self.heads if heads is None else heads
        parts = []
        if self.identity_first_head:
            parts.append(x.unsqueeze(-2))
        need = heads - len(parts)
        if need > 0:
            parts.append(x.unsqueeze(-2) + self.residuals(x, need))
        return torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]

    def later(self, x, count):
        """(..., d) -> (..., count, d): outputs of heads 2..count+1 only (the proposals a
        drafter reads; p_1's output is not computed when it is the identity)."""
        if self.identity_first_head:
            return x.unsqueeze(-2) + self.residuals(x, count)
        return self.forward(x, heads=count + 1)[..., 1:, :]


class ProposalLayer(_Heads):
    """x -> (x + FFN(x)_1, ..., x + FFN(x)_k): the combined scoring-and-proposal layer."""

    def __init__(self, embed_dim, ffn_dim, heads, identity_first_head, activation_fn="relu"):
        super().__init__()
        self.heads = heads
        self.identity_first_head = identity_first_head
        learned = heads - 1 if identity_first_head else heads
        self.embed_dim = embed_dim
        self.learned = learned
        if learned > 0:
            self.fc1 = nn.Linear(embed_dim, learned * ffn_dim)
            self.fc2 = nn.Linear(learned * ffn_dim, learned * embed_dim)
            # Start as the identity map (residual only): heads begin as copies of p_1.
            nn.init.zeros_(self.fc2.weight)
            nn.init.zeros_(self.fc2.bias)
        self.activation_fn = utils.get_activation_fn(activation_fn)

    def residuals(self, x, need):
        hidden = self.activation_fn(self.fc1(x))
        # fc2 is dense over all heads' hidden units; compute only the outputs we need.
        rows = need * self.embed_dim
        out = F.linear(hidden, self.fc2.weight[:rows], self.fc2.bias[:rows])
        return out.view(x.shape[:-1] + (need, self.embed_dim))


class LightProposalLayer(_Heads):
    """x -> (x + f_1(x), ..., x + f_k(x)), each f_i a small residual block of its own
    (``--proposal-layer light``): f_i(x) = W2_i relu(W1_i x), hidden size ``hidden_dim``.

    The paper's layer mixes every head's hidden units into every output (its second matrix is
    k d_ffn x k d_model, so its cost grows with k^2); here head i reads only its own units: cost
    k (2 d h) per position, about a sixth of one decoder layer's feed-forward at h = d / 4 and
    k = 8 (d_ffn = 4 d). Outputs start as the identity (W2 = 0), like the paper's.
    """

    def __init__(self, embed_dim, hidden_dim, heads, identity_first_head, activation_fn="relu"):
        super().__init__()
        self.heads = heads
        self.identity_first_head = identity_first_head
        self.embed_dim, self.hidden_dim = embed_dim, hidden_dim
        self.learned = heads - 1 if identity_first_head else heads
        if self.learned > 0:
            self.fc1 = nn.Linear(embed_dim, self.learned * hidden_dim)
            self.fc2_weight = nn.Parameter(torch.zeros(self.learned, hidden_dim, embed_dim))
            self.fc2_bias = nn.Parameter(torch.zeros(self.learned, embed_dim))
        self.activation_fn = utils.get_activation_fn(activation_fn)

    def residuals(self, x, need):
        rows = need * self.hidden_dim
        hidden = self.activation_fn(F.linear(x, self.fc1.weight[:rows], self.fc1.bias[:rows]))
        hidden = hidden.view(x.shape[:-1] + (need, self.hidden_dim))
        return torch.einsum("...nh,nhd->...nd", hidden, self.fc2_weight[:need]) + self.fc2_bias[:need]


class BlockwiseTransformerDecoder(TransformerDecoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, heads, identity_first_head,
                 proposal_layer="paper", proposal_hidden_dim=None, **kwargs):
        super().__init__(cfg, dictionary, embed_tokens, **kwargs)
        if proposal_layer == "light":
            self.proposal = LightProposalLayer(
                self.output_embed_dim,
                proposal_hidden_dim or max(1, self.output_embed_dim // 4),
                heads,
                identity_first_head,
                activation_fn=cfg.activation_fn,
            )
        else:
            self.proposal = ProposalLayer(
                self.output_embed_dim,
                cfg.decoder.ffn_embed_dim,
                heads,
                identity_first_head,
                activation_fn=cfg.activation_fn,
            )

    @property
    def proposal_heads(self):
        return self.proposal.heads

    @property
    def output_layer_is_projection(self):
        """True when p_1 is the base itself: ``output_layer`` is then the plain projection
        (the lean verifier step may run it on a transposed copy of the weight)."""
        return self.proposal.identity_first_head

    def output_layer(self, features):
        """p_1 logits: what fairseq's own search and scoring see."""
        return super().output_layer(self.proposal(features, heads=1).squeeze(-2))

    def head_logits(self, features, heads=None):
        """(..., d) features -> (..., n, V) logits of heads 1..n."""
        return self.base_logits(self.proposal(features, heads=heads))

    def base_logits(self, hidden):
        """The base's vocabulary projection, shared by every head."""
        return super().output_layer(hidden)

    def proposal_features(self, features, count):
        """(..., d) features -> (..., count, d) outputs of heads 2..count+1, before the
        vocabulary projection."""
        return self.proposal.later(features, count)


@register_model("blockwise_transformer")
class BlockwiseTransformerModel(TransformerModel):
    """Transformer with k proposal heads (``--proposal-heads``)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--proposal-heads", type=int, metavar="K",
                            help="number of heads p_1..p_k (k >= 1; the next k tokens)")
        parser.add_argument("--identity-first-head", action="store_true",
                            help="p_1 is the base model itself (no learned transform), so a "
                                 "frozen base keeps its exact greedy output")
        parser.add_argument("--init-from-transformer", metavar="PATH",
                            help="initialise every base parameter from a trained fairseq "
                                 "transformer checkpoint (the proposal layer starts as identity)")
        parser.add_argument("--freeze-base", action="store_true",
                            help="train the proposal layer only (the paper's 'frozen' setting)")
        parser.add_argument("--proposal-layer", choices=["paper", "light"],
                            help="paper: one multi-output feed-forward layer (k d_ffn hidden "
                                 "units shared by all heads); light: one small residual block "
                                 "per head (--proposal-hidden-dim), cost linear in k")
        parser.add_argument("--proposal-hidden-dim", type=int, metavar="H",
                            help="hidden size of each light head (default: decoder embed dim / 4)")

    @classmethod
    def build_model(cls, args, task):
        if getattr(args, "proposal_heads", None) is None or args.proposal_heads < 1:
            raise UsageError("--proposal-heads must be >= 1 for --arch blockwise_transformer*")
        model = super().build_model(args, task)
        path = getattr(args, "init_from_transformer", None)
        if path:
            if built_from_checkpoint(args):
                # The checkpoint being loaded holds every weight; the base checkpoint it was
                # initialised from at training time need not exist here.
                logger.info("not re-reading --init-from-transformer while loading a checkpoint")
            else:
                cls._init_from_transformer(model, path)
        if getattr(args, "freeze_base", False):
            for name, param in model.named_parameters():
                param.requires_grad = name.startswith("decoder.proposal.")
        return model

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return BlockwiseTransformerDecoder(
            cfg,
            tgt_dict,
            embed_tokens,
            heads=args.proposal_heads,
            identity_first_head=getattr(args, "identity_first_head", False),
            proposal_layer=getattr(args, "proposal_layer", None) or "paper",
            proposal_hidden_dim=getattr(args, "proposal_hidden_dim", None),
            no_encoder_attn=cfg.no_cross_attention,
        )

    @staticmethod
    def _init_from_transformer(model, path):
        init_from_checkpoint(model, path, "--init-from-transformer", may_differ=("decoder.proposal.",))
        logger.info("initialised base parameters from %s", path)


def _defaults(args, heads=8):
    args.proposal_heads = getattr(args, "proposal_heads", heads)
    args.identity_first_head = getattr(args, "identity_first_head", False)
    args.freeze_base = getattr(args, "freeze_base", False)
    args.init_from_transformer = getattr(args, "init_from_transformer", None)
    args.proposal_layer = getattr(args, "proposal_layer", None) or "paper"
    args.proposal_hidden_dim = getattr(args, "proposal_hidden_dim", None)


@register_model_architecture("blockwise_transformer", "blockwise_transformer")
def blockwise_transformer(args):
    _defaults(args)
    base_architecture(args)


@register_model_architecture("blockwise_transformer", "blockwise_transformer_base")
def blockwise_transformer_base(args):
    blockwise_transformer(args)


@register_model_architecture("blockwise_transformer", "blockwise_transformer_big")
def blockwise_transformer_big(args):
    _defaults(args)
    transformer_vaswani_wmt_en_de_big(args)


@register_model_architecture("blockwise_transformer", "blockwise_transformer_tiny")
def blockwise_transformer_tiny(args):
    tiny_sizes(args)
    blockwise_transformer(args)


__all__ = ["BlockwiseTransformerModel", "BlockwiseTransformerDecoder", "LightProposalLayer",
           "ProposalLayer"]
