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

from fairseq_pardec.errors import UsageError
from fairseq_pardec.models.loading import built_from_checkpoint, init_from_checkpoint
from fairseq_pardec.models.sizes import tiny_sizes

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


class RecurrentProposalLayer(nn.Module):
    """Heads p_2..p_k as one learned step applied again and again (``--proposal-layer
    recurrent``; our addition, after the feature-level drafting of EAGLE, Li et al. 2024, and
    the sequentially dependent heads of Hydra, Ankner et al. 2024).

    p_1 is the base itself. Head j + 1 reads the state of head j and the token head j chose:
    ``h_0`` = the base's features at the kept position, ``h_j = h_{j-1} + W2 act(W1 [h_{j-1};
    e(y_j)])`` with ``e`` the decoder's (shared) token embedding, and p_{j+1} projects ``h_j``
    with the base's output layer. The light and paper heads all guess from ``h_0`` alone, so
    head 3 cannot know which token head 2 proposed; here every proposal is conditioned on the
    ones before it, at the price of running the step once per proposal (a few small products
    per draft token, against the verifier's whole decoder per verification).

    Exact verification only ever accepts proposal j + 1 after proposals 1..j were accepted,
    that is, equal to the verifier's own tokens: training feeds the target tokens (the
    verifier's outputs, self-distilled) and the step's own states, which is what decoding
    feeds whenever a proposal can count. W2 starts at zero: every head starts as p_1.
    """

    identity_first_head = True
    reads_tokens = True

    def __init__(self, embed_dim, token_dim, hidden_dim, heads, activation_fn="relu"):
        super().__init__()
        self.heads = heads
        self.embed_dim, self.hidden_dim = embed_dim, hidden_dim
        self.fc1 = nn.Linear(embed_dim + token_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, embed_dim)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)
        self.activation_fn = utils.get_activation_fn(activation_fn)

    def step(self, state, token_embedding):
        """(..., d) state of head j, (..., d_e) embedding of its token -> state of head j + 1."""
        hidden = self.activation_fn(self.fc1(torch.cat([state, token_embedding], dim=-1)))
        return state + self.fc2(hidden)

    def forward(self, x, heads=None):
        """p_1 only: the later heads need tokens (:meth:`unroll`)."""
        if (self.heads if heads is None else heads) > 1:
            raise UsageError("recurrent proposal heads read the tokens before them; "
                             "use unroll(features, token_embeddings)")
        return x.unsqueeze(-2)

    def unroll(self, x, token_embeddings):
        """(..., d) features, (..., n, d_e) embeddings of the tokens p_1..p_n chose ->
        (..., n, d) states of heads 2..n+1."""
        states, state = [], x
        for j in range(token_embeddings.size(-2)):
            state = self.step(state, token_embeddings[..., j, :])
            states.append(state)
        return torch.stack(states, dim=-2)


class BlockwiseTransformerDecoder(TransformerDecoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, heads, identity_first_head,
                 proposal_layer="paper", proposal_hidden_dim=None, **kwargs):
        super().__init__(cfg, dictionary, embed_tokens, **kwargs)
        if proposal_layer == "recurrent":
            if not identity_first_head:
                raise UsageError("--proposal-layer recurrent needs --identity-first-head (its "
                                 "first proposal reads the token p_1 chose)")
            self.proposal = RecurrentProposalLayer(
                self.output_embed_dim,
                embed_tokens.embedding_dim,
                proposal_hidden_dim or 2 * self.output_embed_dim,
                heads,
                activation_fn=cfg.activation_fn,
            )
        elif proposal_layer == "light":
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

    @property
    def proposals_read_tokens(self):
        """True when each proposal reads the token chosen before it (recurrent heads)."""
        return getattr(self.proposal, "reads_tokens", False)

    def proposal_features(self, features, count, tokens=None):
        """(..., d) features -> (..., count, d) outputs of heads 2..count+1, before the
        vocabulary projection. ``tokens`` (..., count): the tokens p_1..p_count chose, which
        recurrent heads read (the others ignore them)."""
        if self.proposals_read_tokens:
            if tokens is None:
                raise UsageError("recurrent proposal heads need the tokens before them")
            return self.proposal.unroll(features, self.embed_tokens(tokens))
        return self.proposal.later(features, count)

    def proposal_step(self, state, tokens):
        """Recurrent heads: (B, d) state of head j and (B,) its token -> state of head j + 1."""
        return self.proposal.step(state, self.embed_tokens(tokens))


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
        parser.add_argument("--proposal-layer", choices=["paper", "light", "recurrent"],
                            help="paper: one multi-output feed-forward layer (k d_ffn hidden "
                                 "units shared by all heads); light: one small residual block "
                                 "per head (--proposal-hidden-dim), cost linear in k; recurrent: "
                                 "one step shared by all heads, each reading the state and token "
                                 "of the head before it (needs --identity-first-head)")
        parser.add_argument("--proposal-hidden-dim", type=int, metavar="H",
                            help="hidden size of each light head (default: decoder embed dim / 4) "
                                 "or of the recurrent step (default: 2 x decoder embed dim)")

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
           "ProposalLayer", "RecurrentProposalLayer"]
