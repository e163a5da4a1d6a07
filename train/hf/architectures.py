"""The Hugging Face MoE architectures this project reads and writes, and how each maps onto ours.

An :class:`Architecture` says, for one ``model_type`` of a ``config.json``, which of its keys set
which of our ``model.*`` / ``moe.*`` keys (:meth:`Architecture.options`), which values we cannot
reproduce (one :class:`HFError` naming the key), how the config is written back
(:meth:`Architecture.hf_config`), and how the tensors of one block are named (the tensor map in
:mod:`train.hf.tensors`).

========== ============================ ====================================================
model_type routing                      around the MoE block
========== ============================ ====================================================
mixtral    softmax top-k, renormalised   GQA, RoPE
qwen2_moe  softmax top-k (norm_topk_prob) QKV biases; a shared expert, sigmoid-gated
qwen3_moe  softmax top-k (norm_topk_prob) q/k RMSNorm per head; head_dim
olmoe      softmax top-k (norm_topk_prob) q/k RMSNorm over the whole projection
deepseek_v3 sigmoid, bias, group-limited, MLA attention (not supported): the MoE block alone
           scaling factor; shared experts (:func:`moe_config`, :func:`train.hf.load.moe_block_state`)
========== ============================ ====================================================

What no architecture here has and we refuse rather than ignore: RoPE scaling (``rope_type`` other
than ``default``), sliding-window attention in some layers and not others (Qwen2-MoE's
``layer_types``), ``clip_qkv``, router jitter, activations other than SiLU (SwiGLU), Qwen's
``mlp_only_layers``. One window in every layer (Mixtral's ``sliding_window``, Qwen3-MoE's with
``use_sliding_window``) is ``model.sliding_window``.
"""

from dataclasses import dataclass

from moe import MoEConfig


class HFError(ValueError):
    """A Hugging Face directory, config or tensor that cannot be read or reproduced; the message
    names the file, the key or the tensor."""


# our options that no architecture here has, with the value that means "off": a centred router
# and an LM-head bias change the model from its first step, so neither is imported or exported
NO_ARCHITECTURE = {"moe.router_centre": "none", "model.lm_head_bias": False}


@dataclass(frozen=True)
class Architecture:
    """One ``model_type``: its key names and its fixed choices.

    hf_class: ``architectures[0]`` of the config (what ``from_pretrained`` builds).
    moe_module: the MoE block's name inside a layer (``block_sparse_moe`` or ``mlp``).
    expert_names: the gate, up and down projections of an expert, in that order.
    experts_key: the config key of the number of routed experts.
    expert_width_key: the config key of an expert's hidden width.
    qk_norm: our ``model.qk_norm`` for it.
    shared_expert: the shared experts' module name, or None.
    shared_gate: a sigmoid gate on the shared expert (Qwen2-MoE).
    always_renormalize: the top-k scores are renormalised whatever the config says (Mixtral has
        no ``norm_topk_prob``).
    attention: False: the attention is not ours (DeepSeek-V3's MLA), so only MoE blocks load.
    """

    model_type: str
    hf_class: str
    moe_module: str
    expert_names: tuple[str, str, str]
    experts_key: str
    expert_width_key: str
    qk_norm: str = "none"
    shared_expert: str | None = None
    shared_gate: bool = False
    always_renormalize: bool = False
    attention: bool = True

    def fixed(self) -> dict:
        """The ``{"section.key": value}`` every model of this architecture has, whatever its
        config.json says: what :meth:`options` pins (a user key contradicting one is named) and
        what :meth:`hf_config` requires of a model it writes. DeepSeek-V3's routing is its own
        (:meth:`moe_config` reads it from the config)."""
        fixed = {
            "model.qk_norm": self.qk_norm,
            "moe.activation": "swiglu",
            "moe.score_func": "softmax",
            "moe.n_group": 1,
            "moe.topk_group": 1,
            "moe.routed_scaling_factor": 1.0,
            "moe.first_dense_layers": 0,
            "moe.num_shared_experts": 1 if self.shared_expert else 0,
            "moe.shared_expert_gate": self.shared_gate,
            **NO_ARCHITECTURE,
        }
        if self.always_renormalize:
            fixed["moe.renormalize"] = True
        if self.model_type not in ("mixtral", "qwen3_moe"):  # no key for one window in every layer
            fixed["model.sliding_window"] = None
        if self.model_type not in ("qwen2_moe", "qwen3_moe"):  # the others have no decoder_sparse_step
            fixed["moe.every_n_layers"] = 1
        if self.model_type != "qwen2_moe":  # Qwen2-MoE's qkv_bias is a key of its config
            fixed["model.qkv_bias"] = False
        return fixed

    def options(self, hf: dict, where: str) -> dict:
        """The ``{"section.key": value}`` of our config that ``hf`` (a parsed config.json, read
        from ``where``) sets. Raises :class:`HFError` naming the first key we cannot reproduce."""
        get = _getter(hf, where)
        _refuse(hf, where)
        if not self.attention:
            raise HFError(f"{where}: model_type {self.model_type!r} uses multi-head latent attention (MLA), which this "
                          "project does not implement: its MoE blocks load into MoELayer (train.hf.moe_config, "
                          "train.hf.moe_block_state), the whole model does not")
        heads = get("num_attention_heads")
        out = self.fixed()
        out.update({
            "model.vocab_size": get("vocab_size"),
            "model.dim": get("hidden_size"),
            "model.n_layers": get("num_hidden_layers"),
            "model.n_heads": heads,
            "model.n_kv_heads": hf.get("num_key_value_heads") or heads,
            "model.head_dim": hf.get("head_dim") or get("hidden_size") // heads,
            "model.rope_theta": float(_rope_theta(hf, where)),
            "model.norm_eps": float(get("rms_norm_eps")),
            "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "model.dense_hidden_dim": get("intermediate_size"),
        })
        if self.model_type == "qwen2_moe":  # always biased in v4 configs, which have no key; v5 writes qkv_bias
            out["model.qkv_bias"] = bool(hf.get("qkv_bias", True))
        out["model.sliding_window"] = self._sliding_window(hf, where)
        out.update({f"moe.{k}": v for k, v in self._moe_options(hf, where).items()})
        return out

    def _sliding_window(self, hf: dict, where: str) -> int | None:
        """The window every layer attends through (transformers' rule for the architecture), None
        for none; HFError for windows in some layers only."""
        window = hf.get("sliding_window") or None  # Qwen2-MoE writes 0 for none
        if self.model_type == "mixtral":
            return window
        if self.model_type == "qwen3_moe":
            return window if hf.get("use_sliding_window") else None
        if self.model_type == "qwen2_moe":
            n = hf.get("num_hidden_layers", 0)
            types = hf.get("layer_types") or [  # transformers' default: every other layer below max_window_layers
                "sliding_attention" if (i + 1) % 2 and i < hf.get("max_window_layers", 28) and hf.get("use_sliding_window")
                else "full_attention" for i in range(n)]
            if "sliding_attention" in types:
                raise HFError(f"{where}: layer_types={types} (sliding-window attention in "
                              f"{types.count('sliding_attention')} of {len(types)} layers) is not supported: "
                              "model.sliding_window is one window for every layer")
            return None
        if window:
            raise HFError(f"{where}: sliding_window={window} (sliding-window attention) is not supported for {self.model_type}")
        return None

    def _moe_options(self, hf: dict, where: str) -> dict:
        get = _getter(hf, where)
        experts = hf.get(self.experts_key) or hf.get("num_local_experts")  # v5 writes the alias
        if experts is None:
            raise HFError(f"{where}: no {self.experts_key!r} (the number of routed experts)")
        opts = {
            # no shared experts: no width either (a user key setting one is named)
            "shared_hidden_dim": None,
            "num_experts": experts,
            "top_k": get("num_experts_per_tok"),
            "hidden_dim": get(self.expert_width_key),
            "renormalize": True if self.always_renormalize else bool(hf.get("norm_topk_prob", False)),
            "every_n_layers": hf.get("decoder_sparse_step", 1) or 1,
        }
        if self.model_type == "deepseek_v3":
            if hf.get("moe_layer_freq", 1) != 1:
                raise HFError(f"{where}: moe_layer_freq={hf['moe_layer_freq']} is not supported (only 1)")
            opts.update(score_func="sigmoid", expert_bias=True, n_group=get("n_group"), topk_group=get("topk_group"),
                        routed_scaling_factor=float(get("routed_scaling_factor")),
                        first_dense_layers=hf.get("first_k_dense_replace", 0))
            if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
                raise HFError(f"{where}: only DeepSeek-V3's routing (topk_method noaux_tc, scoring_func sigmoid) is "
                              f"supported, got topk_method={hf.get('topk_method')!r} scoring_func={hf.get('scoring_func')!r}")
        if self.shared_expert == "shared_experts":
            opts.update(num_shared_experts=get("n_shared_experts"), shared_hidden_dim=get(self.expert_width_key))
        elif self.shared_expert == "shared_expert":
            opts.update(num_shared_experts=1, shared_hidden_dim=get("shared_expert_intermediate_size"),
                        shared_expert_gate=self.shared_gate)
        return opts

    def moe_config(self, hf: dict, where: str = "config.json") -> MoEConfig:
        """The :class:`moe.MoEConfig` of one of its MoE blocks (every architecture, DeepSeek-V3's
        included)."""
        _refuse(hf, where)
        fixed = {k[len("moe."):]: v for k, v in self.fixed().items() if k.startswith("moe.")}
        return MoEConfig(**{**fixed, **self._moe_options(hf, where)}).validate(f"{where}: ")

    def hf_config(self, flat: dict, base: dict | None = None) -> dict:
        """A config.json for our ``{"section.key": value}`` config: ``base`` (the one a run was
        initialised from: its ids, lengths and other keys kept) with every key we set replaced.
        Raises :class:`HFError` naming our key whose value this architecture cannot express."""
        if not self.attention:
            raise HFError(f"{self.model_type}: the whole model cannot be exported (its attention is MLA)")
        self._check_expressible(flat)
        hf = dict(base or {})
        for alias in ("num_local_experts", "num_experts", "n_routed_experts", "rope_scaling", "torch_dtype"):
            hf.pop(alias, None)  # written afresh below, under this architecture's own name
        hf.update({
            "architectures": [self.hf_class], "model_type": self.model_type,
            "vocab_size": flat["model.vocab_size"], "hidden_size": flat["model.dim"],
            "num_hidden_layers": flat["model.n_layers"], "num_attention_heads": flat["model.n_heads"],
            "num_key_value_heads": flat["model.n_kv_heads"] or flat["model.n_heads"],
            "head_dim": flat["model.head_dim"] or flat["model.dim"] // flat["model.n_heads"],
            "rms_norm_eps": flat["model.norm_eps"], "tie_word_embeddings": flat["model.tie_embeddings"],
            "intermediate_size": flat["model.dense_hidden_dim"], "hidden_act": "silu",
            self.experts_key: flat["moe.num_experts"], "num_experts_per_tok": flat["moe.top_k"],
            self.expert_width_key: flat["moe.hidden_dim"],
        })
        # both spellings: transformers 5 reads rope_parameters, 4 reads rope_theta
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": flat["model.rope_theta"]}
        hf["rope_theta"] = flat["model.rope_theta"]
        if not self.always_renormalize:
            hf["norm_topk_prob"] = flat["moe.renormalize"]
        window = flat["model.sliding_window"]
        if self.model_type == "mixtral":
            hf["sliding_window"] = window
        if self.model_type == "qwen3_moe":
            hf["use_sliding_window"] = window is not None
            if window is not None:
                hf["sliding_window"] = window
        if self.model_type in ("qwen2_moe", "qwen3_moe"):
            hf.update(decoder_sparse_step=flat["moe.every_n_layers"], mlp_only_layers=[])
        if self.model_type == "qwen2_moe":
            hf.update(qkv_bias=flat["model.qkv_bias"], shared_expert_intermediate_size=flat["moe.shared_hidden_dim"] or flat["moe.hidden_dim"])
        hf.setdefault("dtype", "float32")
        return hf

    def _check_expressible(self, flat: dict) -> None:
        """Raise HFError naming the first of our keys whose value the architecture has no way to
        write (a model trained with it would load into ``transformers`` as a different model)."""
        if self.qk_norm == "full" and flat["model.n_heads"] * (flat["model.head_dim"] or 0) not in (0, flat["model.dim"]):
            # transformers sizes OLMoE's q_norm to hidden_size, whatever head_dim says
            raise HFError(f"model.head_dim={flat['model.head_dim']} with model.n_heads={flat['model.n_heads']} is not "
                          f"model.dim={flat['model.dim']}: {self.model_type} cannot write it")
        # a trained selection bias changes the routing and no architecture here but DeepSeek-V3
        # (never exported) has one; a run may add it on import (it starts at zero, the same model)
        for key, want in {**self.fixed(), "moe.expert_bias": False}.items():
            if flat[key] != want and key in NO_ARCHITECTURE:
                raise HFError(f"{key}={flat[key]!r}: no Hugging Face architecture has it, so a model trained with it "
                              f"cannot be exported")
            elif flat[key] != want:
                raise HFError(f"{key}={flat[key]!r} cannot be written as {self.model_type} (which has {key}={want!r}); "
                              f"pick the architecture whose options the model uses (--arch)")


ARCHITECTURES = {a.model_type: a for a in (
    Architecture("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), "num_local_experts",
                 "intermediate_size", always_renormalize=True),
    Architecture("qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts",
                 "moe_intermediate_size", shared_expert="shared_expert", shared_gate=True),
    Architecture("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts",
                 "moe_intermediate_size", qk_norm="head"),
    Architecture("olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts",
                 "intermediate_size", qk_norm="full"),
    Architecture("deepseek_v3", "DeepseekV3ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "n_routed_experts",
                 "moe_intermediate_size", shared_expert="shared_experts", attention=False),
)}


def architecture(hf: dict, where: str) -> Architecture:
    """The :class:`Architecture` of a parsed config.json; HFError naming ``model_type`` otherwise."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HFError(f"{where}: model_type={model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[model_type]


def _getter(hf: dict, where: str):
    def get(key: str):
        if hf.get(key) is None:
            raise HFError(f"{where}: missing {key!r}")
        return hf[key]
    return get


def _rope_theta(hf: dict, where: str) -> float:
    """RoPE base: v5's ``rope_parameters`` or v4's ``rope_theta`` / ``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise HFError(f"{where}: rope_type={rope_type!r} (RoPE scaling) is not supported, only plain RoPE")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise HFError(f"{where}: missing 'rope_theta' (or rope_parameters.rope_theta)")
    return theta


def _refuse(hf: dict, where: str) -> None:
    """HFError naming the first key whose value changes the model in a way we do not implement."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFError(f"{where}: hidden_act={act!r} is not supported (SwiGLU experts: silu)")
    for key in ("clip_qkv", "router_jitter_noise"):
        if hf.get(key):
            raise HFError(f"{where}: {key}={hf[key]} is not supported")
    if hf.get("mlp_only_layers"):
        raise HFError(f"{where}: mlp_only_layers={hf['mlp_only_layers']} is not supported (dense blocks: "
                      "decoder_sparse_step)")
    if hf.get("attention_bias") and hf.get("model_type") != "deepseek_v3":
        raise HFError(f"{where}: attention_bias=true is not supported")
