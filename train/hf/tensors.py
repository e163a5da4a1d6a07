"""Which Hugging Face tensors make each of our tensors, both ways.

Legend: D model dim, F expert hidden dim, L experts held (here: a contiguous range of global
experts), V vocabulary, H / Hkv / Hd heads, key/value heads, head dim.

A :class:`Rule` builds one tensor of ours from HF tensors (:meth:`Rule.assemble`) and splits it
back (:meth:`Rule.split`); it lists the HF names with the shape each must have, so a loader checks
every tensor it reads and names the one that is wrong. The layouts:

- attention: our fused ``qkv`` (rows ``[q | k | v]``) ← ``q_proj``, ``k_proj``, ``v_proj`` (weights,
  and biases with ``qkv_bias``); ``out`` ← ``o_proj``; ``q_norm`` / ``k_norm`` as they are.
- dense MLPs (a dense block's, the shared experts'): ``w1`` (2F, D) rows ``[gate | up]`` ←
  ``gate_proj`` (Mixtral: ``w1``) and ``up_proj`` (``w3``); ``w2`` ← ``down_proj`` (``w2``).
- routed experts: ``w1_LDU[l] = [gate_e | up_e]ᵀ`` (D, 2F) and ``w2_LFD[l] = down_eᵀ`` (F, D) for
  global expert ``e = first + l``: a rank's map names only its own experts, so it reads only them.
- router: ``router.weight`` ← ``gate.weight`` (E, D); DeepSeek-V3's ``gate.e_score_correction_bias``
  → ``router.expert_bias``.
"""

from dataclasses import dataclass
from typing import Literal

import torch

from moe import MoEConfig
from train.config import Config
from train.hf.architectures import Architecture

Kind = Literal["copy", "rows", "experts_w1", "experts_w2"]


@dataclass(frozen=True)
class Rule:
    """One of our tensors from ``sources`` (HF names, each of the shape at the same position in
    ``shapes``). ``copy``: one source as it is; ``rows``: the sources stacked along dim 0;
    ``experts_w1``: sources ``gate_0, up_0, gate_1, up_1, ...`` to (L, D, 2F); ``experts_w2``:
    ``down_0, down_1, ...`` to (L, F, D)."""

    kind: Kind
    sources: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def assemble(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.kind == "copy":
            return tensors[0]
        if self.kind == "rows":
            return torch.cat(tensors, dim=0)
        if self.kind == "experts_w1":
            return torch.stack([torch.cat(tensors[i:i + 2], dim=0).T for i in range(0, len(tensors), 2)])
        return torch.stack([t.T for t in tensors])

    def split(self, ours: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of :meth:`assemble`: the source tensors, contiguous."""
        if self.kind == "copy":
            return [ours.contiguous()]
        if self.kind == "rows":
            return [t.contiguous() for t in ours.split([s[0] for s in self.shapes], dim=0)]
        if self.kind == "experts_w1":
            return [h.T.contiguous() for w in ours for h in w.chunk(2, dim=1)]
        return [w.T.contiguous() for w in ours]


def _mlp_rules(ours: str, theirs: str, names: tuple[str, str, str], dim: int, width: int) -> dict[str, Rule]:
    gate, up, down = (f"{theirs}.{n}.weight" for n in names)
    return {f"{ours}.w1.weight": Rule("rows", (gate, up), ((width, dim), (width, dim))),
            f"{ours}.w2.weight": Rule("copy", (down,), ((dim, width),))}


def moe_block_rules(arch: Architecture, ours: str, theirs: str, D: int, moe_cfg: MoEConfig, first: int,
                    count: int) -> dict[str, Rule]:
    """The rules of one MoE block of width ``D``: our ``<ours>.router.weight``, ``.experts.*``
    (global experts ``[first, first + count)``), ``.shared_experts.*``,
    ``.shared_expert_gate.weight`` from HF ``<theirs>.*`` (``model.layers.<i>.<moe_module>``)."""
    F, E = moe_cfg.hidden_dim, moe_cfg.num_experts
    gate, up, down = arch.expert_names
    rules = {f"{ours}.router.weight": Rule("copy", (f"{theirs}.gate.weight",), ((E, D),))}
    if arch.model_type == "deepseek_v3":
        rules[f"{ours}.router.expert_bias"] = Rule("copy", (f"{theirs}.gate.e_score_correction_bias",), ((E,),))
    experts = range(first, first + count)
    rules[f"{ours}.experts.w1_LDU"] = Rule(
        "experts_w1", tuple(f"{theirs}.experts.{e}.{n}.weight" for e in experts for n in (gate, up)),
        ((F, D),) * (2 * count))
    rules[f"{ours}.experts.w2_LFD"] = Rule(
        "experts_w2", tuple(f"{theirs}.experts.{e}.{down}.weight" for e in experts), ((D, F),) * count)
    if arch.shared_expert:
        width = moe_cfg.num_shared_experts * (moe_cfg.shared_hidden_dim or F)
        rules.update(_mlp_rules(f"{ours}.shared_experts", f"{theirs}.{arch.shared_expert}",
                                ("gate_proj", "up_proj", "down_proj"), D, width))
    if arch.shared_gate:
        rules[f"{ours}.shared_expert_gate.weight"] = Rule("copy", (f"{theirs}.shared_expert_gate.weight",), ((1, D),))
    return rules


def model_rules(arch: Architecture, cfg: Config, ep_rank: int = 0, ep_size: int = 1) -> dict[str, Rule]:
    """Every tensor of our :class:`train.model.MoETransformer` of config ``cfg`` on expert-parallel
    rank ``ep_rank`` of ``ep_size``, by our name."""
    m, moe_cfg = cfg.model, cfg.moe
    D, V = m.dim, m.vocab_size
    H, Hd = m.n_heads, m.head_dim or m.dim // m.n_heads
    Hkv = m.n_kv_heads or H
    L = moe_cfg.num_experts // ep_size
    rules = {"embed.weight": Rule("copy", ("model.embed_tokens.weight",), ((V, D),)),
             "norm.weight": Rule("copy", ("model.norm.weight",), ((D,),))}
    if not m.tie_embeddings:
        rules["lm_head.weight"] = Rule("copy", ("lm_head.weight",), ((V, D),))
    for i in range(m.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        attn = f"{theirs}.self_attn"
        rules[f"{ours}.attn_norm.weight"] = Rule("copy", (f"{theirs}.input_layernorm.weight",), ((D,),))
        rules[f"{ours}.ffn_norm.weight"] = Rule("copy", (f"{theirs}.post_attention_layernorm.weight",), ((D,),))
        qkv_rows = ((H * Hd,), (Hkv * Hd,), (Hkv * Hd,))
        rules[f"{ours}.attn.qkv.weight"] = Rule("rows", tuple(f"{attn}.{p}_proj.weight" for p in "qkv"),
                                                tuple((n, D) for (n,) in qkv_rows))
        if m.qkv_bias:
            rules[f"{ours}.attn.qkv.bias"] = Rule("rows", tuple(f"{attn}.{p}_proj.bias" for p in "qkv"), qkv_rows)
        rules[f"{ours}.attn.out.weight"] = Rule("copy", (f"{attn}.o_proj.weight",), ((D, H * Hd),))
        if m.qk_norm != "none":
            q_width, k_width = (Hd, Hd) if m.qk_norm == "head" else (H * Hd, Hkv * Hd)
            rules[f"{ours}.attn.q_norm.weight"] = Rule("copy", (f"{attn}.q_norm.weight",), ((q_width,),))
            rules[f"{ours}.attn.k_norm.weight"] = Rule("copy", (f"{attn}.k_norm.weight",), ((k_width,),))
        if moe_cfg.is_moe_layer(i):
            rules.update(moe_block_rules(arch, f"{ours}.ffn", f"{theirs}.{arch.moe_module}", D, moe_cfg, ep_rank * L, L))
        else:
            rules.update(_mlp_rules(f"{ours}.ffn", f"{theirs}.mlp", ("gate_proj", "up_proj", "down_proj"), D,
                                    m.dense_hidden_dim))
    return rules
