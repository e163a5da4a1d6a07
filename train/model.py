"""The MoE transformer language model: embeddings → blocks → final norm → LM head (→ loss).

Legend: B batch, S sequence length, D model dim, V vocabulary, E experts (global), L experts on this rank.

A block is pre-norm: ``x + Attention(RMSNorm(x))`` then ``x + FFN(RMSNorm(x))``, where the FFN
is an :class:`moe.MoELayer` built from the ``moe`` section in every ``moe.every_n_layers``-th
block after the first ``moe.first_dense_layers`` (:meth:`moe.MoEConfig.is_moe_layer`) and a dense
:class:`moe.DenseMLP` otherwise. The options around the MoE block (GQA, head_dim, RoPE base, q/k
RMSNorm, QKV biases, a sliding window, norm eps, tied or separate embeddings, dense first blocks) are those of the
Hugging Face architectures :mod:`hf` loads: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Initialisation is seeded and independent of the expert-parallel size: dense weights come from
one generator seeded by ``seed`` (identical on every rank), and global expert e of layer l is
drawn from its own generator seeded by ``(seed, l, e)``, so rank r's slice of experts equals the
same slice of a one-process model. Output projections (attention out, FFN down) use
``std / sqrt(2 · n_layers)`` (GPT-2's residual scaling). ``model.embed_init_std`` sets the
embedding's (configs/olmoe_*.yaml: 1.0, torchtitan's): at ``init_std`` its rows' RMS is 0.02, and
in the OLMoE-shaped benchmark the attention had written a vector common to every token of RMS 1.5
into the stream by step 11, which then chose the experts of every token
(bench/results/routing_health.md). ``model.lm_head_bias`` adds a bias to the LM head's
logits, set from the data's unigram counts (:meth:`MoETransformer.init_lm_bias`).

Given the targets, the forward ends in the loss instead of the logits: the LM head and the
cross-entropy run together in chunks of tokens (:func:`train.lm_loss.linear_cross_entropy`), so
training never holds the (B·S, V) fp32 logits nor their gradient.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from attention import Attention
from moe import DenseMLP, GroupedExperts, MoELayer
from train.config import Config
from train.lm_loss import linear_cross_entropy


def num_moe_blocks(cfg: Config) -> int:
    """MoE blocks in a model of ``cfg``: the dispatches one forward makes (P2P buffer slots)."""
    return sum(cfg.moe.is_moe_layer(i) for i in range(cfg.model.n_layers))


class Block(nn.Module):
    """One pre-norm block; ``train.activation_checkpointing`` decides what its backward recomputes.

    ``full``: the whole block (its input is all it keeps; the MoE dispatch and its collectives run
    again in the backward, in the same order on every rank). ``selective``: the attention
    sub-layer (norm + attention) and the experts' MLP (:class:`moe.GroupedExperts` with
    ``recompute``); the router, the dispatch and the combine keep their saved tensors, so no
    collective runs twice.
    """

    def __init__(self, cfg: Config, layer_idx: int, dispatcher=None):
        super().__init__()
        m, e = cfg.model, cfg.moe
        self.layer_idx = layer_idx
        self.checkpointing = cfg.train.activation_checkpointing
        self.attn_norm = nn.RMSNorm(m.dim, eps=m.norm_eps)
        self.attn = Attention(m.dim, m.n_heads, m.n_kv_heads, m.head_dim, m.rope_theta, qkv_bias=m.qkv_bias,
                              qk_norm=m.qk_norm, norm_eps=m.norm_eps, sliding_window=m.sliding_window)
        self.ffn_norm = nn.RMSNorm(m.dim, eps=m.norm_eps)
        self.is_moe = e.is_moe_layer(layer_idx)
        if self.is_moe:
            self.ffn = MoELayer(m.dim, config=e, dispatcher=dispatcher)
            self.ffn.experts.recompute = self.checkpointing == "selective"
        else:
            self.ffn = DenseMLP(m.dim, m.dense_hidden_dim, e.activation)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x_BSD, use_reentrant=False)
        return self._forward(x_BSD)

    def _forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "selective" and torch.is_grad_enabled():
            x_BSD = x_BSD + checkpoint(self._attention, x_BSD, use_reentrant=False)
        else:
            x_BSD = x_BSD + self._attention(x_BSD)
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))

    def _attention(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.attn(self.attn_norm(x_BSD))


class MoETransformer(nn.Module):
    """``forward(tokens_BS int64) -> logits_BSV`` (fp32 under autocast too), or with
    ``targets_BS`` (int64) the mean cross-entropy over the B·S tokens (fp32, 0-dim)."""

    def __init__(self, cfg: Config, dispatcher=None):
        super().__init__()
        m = cfg.model
        self.cfg = cfg
        self.embed = nn.Embedding(m.vocab_size, m.dim)
        self.blocks = nn.ModuleList(Block(cfg, i, dispatcher) for i in range(m.n_layers))
        self.norm = nn.RMSNorm(m.dim, eps=m.norm_eps)
        self.lm_head = None if m.tie_embeddings else nn.Linear(m.dim, m.vocab_size, bias=False)
        # the LM head's bias (model.lm_head_bias), a parameter of the model whether or not the
        # head is the embedding; set from the data by init_lm_bias
        self.lm_bias = nn.Parameter(torch.zeros(m.vocab_size)) if m.lm_head_bias else None

    def forward(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (B, S, V), or given ``targets_BS`` the loss, equal to ``F.cross_entropy`` of
        those logits, through :func:`train.lm_loss.linear_cross_entropy` (no (B·S, V) tensor).

        The loss is computed here rather than by the caller from the weight: under FSDP2 the root
        module's forward hooks gather the LM head (the embedding, when tied) for its forward and
        keep it gathered for the backward, so the weight read here is the whole unsharded
        parameter, and its gradient flows back to it through autograd.
        """
        x_BSD = self.embed(tokens_BS)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        x_BSD = self.norm(x_BSD)
        weight_VD = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if targets_BS is None:
            return F.linear(x_BSD, weight_VD, self.lm_bias).float()
        return linear_cross_entropy(x_BSD.flatten(0, 1), weight_VD, targets_BS.flatten(), bias_V=self.lm_bias)

    @torch.no_grad()
    def init_lm_bias(self, token_counts_V: torch.Tensor) -> None:
        """Set the LM head's bias to the centred log unigram frequencies of ``token_counts_V``
        (each count + 0.5, so an unseen token is not -inf): the loss at initialisation is then
        the data's unigram entropy, and the residual stream need not learn the frequencies.
        Karpathy's "initialise the final layer's bias to the log prior"."""
        V = self.cfg.model.vocab_size
        if self.lm_bias is None or tuple(token_counts_V.shape) != (V,):
            raise ValueError(f"init_lm_bias needs model.lm_head_bias and ({V},) counts, got "
                             f"lm_head_bias={self.lm_bias is not None} and {tuple(token_counts_V.shape)}")
        logp_V = (token_counts_V.double() + 0.5).log()
        self.lm_bias.copy_((logp_V - logp_V.mean()).to(self.lm_bias.dtype))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        m = self.cfg.model
        std = m.init_std
        out_std = std / math.sqrt(2 * m.n_layers)
        embed_std = std if m.embed_init_std is None else m.embed_init_std
        device = self.embed.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        expert_params = set()
        for layer_idx, block in enumerate(self.blocks):
            if block.is_moe:
                _init_experts(block.ffn, seed, layer_idx, std, out_std)
                expert_params.update(block.ffn.experts.parameters())
        for name, p in self.named_parameters():
            if p in expert_params:
                continue
            if p is self.lm_bias:  # set from the data (init_lm_bias); zero until then
                p.zero_()
            elif p.dim() == 1:  # norm gains
                p.fill_(1.0)
            elif p is self.embed.weight:
                p.normal_(0.0, embed_std, generator=gen)
            else:
                is_out = name.endswith(("attn.out.weight", "ffn.w2.weight", "shared_experts.w2.weight"))
                p.normal_(0.0, out_std if is_out else std, generator=gen)
            if name.endswith(".bias"):
                p.zero_()
        for block in self.blocks:
            if block.is_moe and block.ffn.router.expert_bias is not None:
                block.ffn.router.expert_bias.zero_()


def _init_experts(layer: MoELayer, seed: int, layer_idx: int, std: float, out_std: float) -> None:
    """Each global expert from its own generator (GroupedExperts.reset_parameters), seeded from
    the run's seed and the block: the same weights whichever EP rank holds it."""
    layer.experts.init_seed = seed * 1_000_003 + layer_idx * 65_537
    layer.experts.reset_parameters(std, out_std)


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters that live in a :class:`moe.GroupedExperts` (sharded over EP)."""
    names = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, GroupedExperts):
            names.update(f"{mod_name}.{p}" for p, _ in mod.named_parameters())
    return names
