"""Hugging Face checkpoints in and out (train/hf), against ``transformers`` itself, fp32, on CPU.

Every model is a tiny random one built by ``transformers`` and saved to a temporary directory (no
network). Every parameter and buffer is perturbed before saving (norm gains away from 1, biases
away from 0, DeepSeek-V3's selection bias away from 0), so a tensor mapped to the wrong place, or
not at all, changes the logits.

Tolerances (fp32): logits within 1e-5 absolute of logits of size ~1 (measured: <= 2.4e-7, the
order of fp32 rounding of a few summation orders); gradients within 1e-4 relative to their
tensor's largest entry.
"""

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from tests.distributed import run_distributed  # noqa: E402
from train.config import ConfigError, load_config  # noqa: E402
from train.hf import (HFError, SafetensorsDir, architecture, load_weights, moe_block_state, moe_config,  # noqa: E402
                      read_hf_config)
from train.hf.export import export  # noqa: E402
from train.hf.tensors import model_rules  # noqa: E402
from train.model import MoETransformer  # noqa: E402

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, eos_token_id=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_group=4, topk_group=2,
                         first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24,
                         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5)),
}


def build_hf(kind: str, directory: str, seed: int = 0, tie: bool = False, **save_kwargs):
    """A tiny random ``kind`` model, every tensor perturbed, saved to ``directory``; returns it."""
    cfg_name, model_name, extra = MODELS[kind]
    torch.manual_seed(seed)
    hf_cfg = getattr(transformers, cfg_name)(**COMMON, **extra, tie_word_embeddings=tie)
    model = getattr(transformers, model_name)(hf_cfg).float().eval()
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "e_score_correction_bias" in name:
                # positive: HF masks dropped groups with 0, ours with -inf; they agree while the
                # kept experts' biased scores are > 0 (see moe/router.py)
                t.copy_(torch.rand_like(t) * 0.1)
            elif t.is_floating_point() and "inv_freq" not in name:
                t.add_(torch.randn_like(t) * (0.1 if t.dim() == 1 else 0.02))
    model.save_pretrained(directory, **save_kwargs)
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in MODELS:
        # one saved in shards, to read through model.safetensors.index.json
        extra = {"max_shard_size": "40KB"} if kind == "qwen3_moe" else {}
        out[kind] = (str(base / kind), build_hf(kind, str(base / kind), **extra))
    return out


def ours_from(directory: str, *extra: str) -> MoETransformer:
    cfg = load_config([f"--train.init_from={directory}", "--parallel.device=cpu", *extra], world_size=1)
    model = MoETransformer(cfg)
    model.init_weights(1)  # anything load_weights misses keeps these, and the logits differ
    load_weights(model, directory, cfg)
    return model


def _tokens(vocab: int = 300, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 19), generator=g), torch.randint(0, vocab, (2, 19), generator=g)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_logits_and_gradients_match_transformers(kind, hf_dirs, tmp_path):
    directory, ref = hf_dirs[kind]
    ref = copy.deepcopy(ref)  # its parameters become its gradients below
    if kind == "qwen3_moe":
        assert os.path.exists(os.path.join(directory, "model.safetensors.index.json"))
    ours = ours_from(directory)
    tokens, targets = _tokens()
    ref.zero_grad()
    ref_logits = ref(tokens).logits
    F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()).backward()
    logits = ours(tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert (logits - ref_logits).abs().max().item() < 1e-5

    # HF's gradients in the layout of its files: its own save_pretrained of the gradients
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.grad)
    ref.save_pretrained(str(tmp_path / "grads"))
    ref_grads = SafetensorsDir(str(tmp_path / "grads"))
    rules = model_rules(architecture(read_hf_config(directory), "config.json"), ours.cfg)
    compared = 0
    for name, p in ours.named_parameters():
        for hf_name, g in zip(rules[name].sources, rules[name].split(p.grad)):
            want = ref_grads.read(hf_name)
            scale = want.abs().max().item()
            assert (g - want).abs().max().item() <= 1e-4 * scale + 1e-9, hf_name
            compared += 1
    assert compared == len(ref_grads.file_of)


@pytest.mark.parametrize("kind", ["qwen2_moe", "deepseek_v3"])
def test_moe_block_matches_transformers(kind, hf_dirs):
    """The MoE block alone: Qwen2-MoE's gated shared expert; DeepSeek-V3's sigmoid router with
    its selection bias, group-limited top-k (4 groups, best 2) and routed scaling factor 2.5, and
    a shared expert. Output and input gradient."""
    from moe import MoELayer

    directory, ref = hf_dirs[kind]
    layer_idx = 1  # DeepSeek-V3's layer 0 is dense (first_k_dense_replace=1)
    block = ref.model.layers[layer_idx].mlp
    layer = MoELayer(64, config=moe_config(directory))
    layer.load_state_dict(moe_block_state(directory, layer_idx))
    x = torch.randn(3, 11, 64, requires_grad=True)
    want = block(x)
    want = want[0] if isinstance(want, tuple) else want
    (gx_want,) = torch.autograd.grad(want.square().sum(), x)
    got = layer(x)
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    assert (got - want).abs().max().item() < 1e-5
    assert (gx - gx_want).abs().max().item() < 1e-4 * gx_want.abs().max().item()
    if kind == "deepseek_v3":
        assert layer.router.expert_bias.abs().min() > 0 and layer.router.routed_scaling_factor == 2.5


def test_a_whole_deepseek_v3_is_refused_by_name(hf_dirs):
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        load_config([f"--train.init_from={hf_dirs['deepseek_v3'][0]}"], world_size=1)


def _train_and_export(tmp_path, argv: list[str], **export_kwargs):
    from train.trainer import Trainer

    cfg = load_config(["--parallel.device=cpu", "--train.steps=2", "--train.eval_every=0", "--log.every=1",
                       "--data.max_bytes=100000", "--data.seq_len=16", "--data.batch_size=2", "--checkpoint.save_final=true",
                       f"--log.dir={tmp_path}", "--log.wandb_mode=disabled", "--log.progress=false", *argv], world_size=1)
    trainer = Trainer(cfg, [])
    trainer.fit()
    trainer.close()
    ckpt = os.path.join(trainer.ckpt_dir, "step_00000002")
    config = export(ckpt, str(tmp_path / "exported"), **export_kwargs)
    return trainer.model, config


def test_export_after_training_loads_in_transformers(hf_dirs, tmp_path):
    """init_from → 2 training steps → checkpoint → export → from_pretrained: the trained weights,
    and the source config's other keys kept."""
    directory, _ = hf_dirs["olmoe"]
    trained, config = _train_and_export(tmp_path, [f"--train.init_from={directory}"])
    assert config["model_type"] == "olmoe" and config["eos_token_id"] == 2  # kept from the source
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
    tokens, _ = _tokens()
    with torch.no_grad():
        assert (trained(tokens) - back(tokens).logits).abs().max().item() < 1e-5
        # the two steps changed the weights: the export is not the source
        source = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        assert (source(tokens).logits - back(tokens).logits).abs().max().item() > 1e-4


def test_export_of_a_model_trained_from_scratch(tmp_path):
    """No init_from: the architecture follows from the options (tiny's: Mixtral, tied
    embeddings); an option Mixtral cannot write is refused by name. Dropless, as transformers
    runs it (tiny's capacity factor would drop pairs that transformers keeps)."""
    trained, config = _train_and_export(tmp_path, ["--config", "tiny", "--parallel.ep=1", "--model.n_layers=2",
                                                   "--moe.capacity_factor=none"])
    assert config["model_type"] == "mixtral" and config["tie_word_embeddings"] is True
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
    tokens, _ = _tokens(256)
    with torch.no_grad():
        assert (trained(tokens) - back(tokens).logits).abs().max().item() < 1e-5
    ckpt = os.path.join(os.path.dirname(str(tmp_path / "exported")), "tiny", "checkpoints", "step_00000002")
    with pytest.raises(HFError, match="exists and is not empty"):
        export(ckpt, str(tmp_path / "exported"))
    with pytest.raises(HFError, match=r"model.qk_norm='none' cannot be written as qwen3_moe"):
        export(ckpt, str(tmp_path / "other"), arch="qwen3_moe")
    # the command line: a checkpoints directory means its newest; errors are one line and exit 2
    from train.export import main

    assert main([os.path.dirname(ckpt), "--to", str(tmp_path / "cli"), "--dtype", "bfloat16"]) == 0
    assert read_hf_config(str(tmp_path / "cli"))["dtype"] == "bfloat16"
    assert main([os.path.dirname(ckpt), "--to", str(tmp_path / "cli")]) == 2
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(HFError, match="is a file, not a directory"):
        export(ckpt, str(tmp_path / "a_file"))
    # a failure while writing leaves nothing behind, neither the directory nor its .tmp
    import torch.distributed.checkpoint as dcp

    def broken(*args, **kwargs):
        raise OSError("disk full")

    original, dcp.load = dcp.load, broken
    try:
        with pytest.raises(OSError, match="disk full"):
            export(ckpt, str(tmp_path / "failed"))
    finally:
        dcp.load = original
    assert not (tmp_path / "failed").exists() and not (tmp_path / "failed.tmp").exists()


def test_export_refuses_what_the_architecture_cannot_write_and_keeps_what_it_can():
    from train.hf import ARCHITECTURES

    flat = load_config(["--model.qk_norm=full", "--model.head_dim=16", "--model.dim=128", "--model.n_heads=4"],
                       world_size=1).to_flat()
    with pytest.raises(HFError, match="model.head_dim=16 with model.n_heads=4 is not model.dim=128"):
        ARCHITECTURES["olmoe"].hf_config(flat)  # transformers sizes OLMoE's q_norm by hidden_size
    flat = load_config(["--moe.num_shared_experts=1", "--moe.shared_expert_gate=true"], world_size=1).to_flat()
    written = ARCHITECTURES["qwen2_moe"].hf_config(flat)
    assert written["qkv_bias"] is False and written["rope_theta"] == written["rope_parameters"]["rope_theta"]


def _ep_logits(rank: int, world: int, directory: str, tokens: torch.Tensor) -> dict:
    from parallel import ParallelDims
    from train.hf import load as hf_load

    dims = ParallelDims(world, ep=world).build_mesh("cpu")
    cfg = load_config([f"--train.init_from={directory}", "--parallel.device=cpu", f"--parallel.ep={world}"], world_size=world)
    read = []
    original = hf_load.SafetensorsDir.read
    hf_load.SafetensorsDir.read = lambda self, name: (read.append(name), original(self, name))[1]
    model = MoETransformer(cfg, dispatcher=dims.dispatcher())
    model.init_weights(1)
    load_weights(model, directory, cfg)
    with torch.no_grad():
        return {"logits": model(tokens).tolist(), "experts_read": sorted({int(n.split(".experts.")[1].split(".")[0])
                                                                for n in read if ".experts." in n})}


def test_loading_under_ep2_gives_the_ep1_logits(hf_dirs):
    """2 processes (gloo), EP 2: each reads only its own experts, and both give the logits of
    the one-process model."""
    directory, _ = hf_dirs["qwen3_moe"]
    tokens, _ = _tokens()
    with torch.no_grad():
        want = ours_from(directory)(tokens)
    results = run_distributed(_ep_logits, 2, directory, tokens)
    for rank, res in enumerate(results):
        assert res["experts_read"] == [2 * rank, 2 * rank + 1]
        assert (torch.tensor(res["logits"]) - want).abs().max().item() < 1e-5


def _edit(directory: str, tmp_path, config_edit=None, drop=None, add=None, reshape=None) -> str:
    """A copy of ``directory`` with its config or one tensor changed."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "edited"
    out.mkdir()
    hf = read_hf_config(directory)
    (config_edit or (lambda c: None))(hf)
    (out / "config.json").write_text(json.dumps(hf))
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(3)
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


@pytest.mark.parametrize("kind, window_keys", [("mixtral", dict(sliding_window=5)),
                                               ("qwen3_moe", dict(use_sliding_window=True, sliding_window=5))])
def test_sliding_window_models_match_transformers(kind, window_keys, tmp_path):
    """One window in every layer (5 keys, 19 tokens): transformers' logits, and the window
    written back by the export's config."""
    cfg_name, model_name, extra = MODELS[kind]
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, cfg_name)(**COMMON, **extra, **window_keys)
    ref = getattr(transformers, model_name)(hf_cfg).float().eval()
    with torch.no_grad():
        for t in ref.parameters():
            t.add_(torch.randn_like(t) * (0.1 if t.dim() == 1 else 0.02))
    ref.save_pretrained(str(tmp_path / kind))
    ours = ours_from(str(tmp_path / kind))
    assert ours.cfg.model.sliding_window == 5
    tokens, _ = _tokens()
    with torch.no_grad():
        assert (ours(tokens) - ref(tokens).logits).abs().max().item() < 1e-5
    written = architecture(read_hf_config(str(tmp_path / kind)), "config.json").hf_config(ours.cfg.to_flat())
    assert {k: written[k] for k in window_keys} == window_keys


def test_windows_in_some_layers_or_where_the_architecture_has_none_are_refused(hf_dirs, tmp_path):
    from train.hf import ARCHITECTURES

    def explicit(c):  # the layer types written out (transformers 5)
        c.update(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"])

    def by_rule(c):  # no layer_types: transformers' default, every other layer below max_window_layers
        c.update(use_sliding_window=True, sliding_window=8)
        c.pop("layer_types", None)

    for i, edit in enumerate((explicit, by_rule)):
        (tmp_path / str(i)).mkdir()
        directory = _edit(hf_dirs["qwen2_moe"][0], tmp_path / str(i), config_edit=edit)
        with pytest.raises(ConfigError, match=r"sliding-window attention in 1 of 2 layers\) is not supported"):
            ours_from(directory)
    for kind in ("olmoe", "qwen2_moe"):
        flat = {**load_config([], world_size=1).to_flat(), **ARCHITECTURES[kind].fixed(), "model.sliding_window": 8}
        with pytest.raises(HFError, match=f"model.sliding_window=8 cannot be written as {kind}"):
            ARCHITECTURES[kind].hf_config(flat)
    # the routing-health options change the model from its first step: no architecture writes them
    for kind in ("mixtral", "olmoe"):
        for key, value in (("moe.router_centre", "causal"), ("model.lm_head_bias", True)):
            flat = {**load_config([], world_size=1).to_flat(), **ARCHITECTURES[kind].fixed(), key: value}
            with pytest.raises(HFError, match=rf"^{key}={value!r}: no Hugging Face architecture has it, so a model "
                                              "trained with it cannot be exported"):
                ARCHITECTURES[kind].hf_config(flat)


QPROJ = "model.layers.1.self_attn.q_proj.weight"
EXPERT = "model.layers.0.block_sparse_moe.experts.3.w2.weight"


@pytest.mark.parametrize("edit, error, match", [
    (dict(drop=EXPERT), HFError, f"tensor {EXPERT} is missing"),
    (dict(add="model.layers.2.mlp.gate.weight"), HFError, r"tensor model.layers.2.mlp.gate.weight \(model.safetensors\) has no place"),
    (dict(reshape=QPROJ), HFError, rf"tensor {QPROJ} \(model.safetensors\) has shape \(63, 64\), the config.json implies \(64, 64\)"),
    (dict(config_edit=lambda c: c.update(model_type="llama")), ConfigError, "model_type='llama' is not supported"),
    (dict(config_edit=lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4})), ConfigError,
     "rope_type='yarn'"),
    (dict(config_edit=lambda c: c.update(hidden_act="gelu")), ConfigError, "hidden_act='gelu'"),
])
def test_bad_directories_are_one_error_naming_the_tensor_or_key(hf_dirs, tmp_path, edit, error, match):
    directory = _edit(hf_dirs["mixtral"][0], tmp_path, **edit)
    with pytest.raises(error, match=match):
        ours_from(directory)


def test_init_from_conflicts_and_missing_directories(hf_dirs, tmp_path):
    directory = hf_dirs["mixtral"][0]
    with pytest.raises(ConfigError, match=rf"model.dim=128 contradicts train.init_from={directory}, whose config.json gives 64"):
        load_config([f"--train.init_from={directory}", "--model.dim=128"], world_size=1)
    # the routing the architecture fixes is pinned too (Mixtral's router is softmax)
    with pytest.raises(ConfigError, match="moe.score_func=sigmoid contradicts"):
        load_config([f"--train.init_from={directory}", "--moe.score_func=sigmoid"], world_size=1)
    # the routing-health options would change the loaded model from its first step; the init
    # options would be ignored (every weight is read from the directory)
    for arg, match in (("--model.lm_head_bias=true", "model.lm_head_bias=true contradicts"),
                       ("--moe.router_centre=causal", "moe.router_centre=causal contradicts"),
                       ("--model.embed_init_std=1.0", "model.embed_init_std=1.0 is ignored with train.init_from=")):
        with pytest.raises(ConfigError, match=match):
            load_config([f"--train.init_from={directory}", arg], world_size=1)
    # the same value is no conflict (a saved run's config.yaml repeats every key)
    assert load_config([f"--train.init_from={directory}", "--model.dim=64"], world_size=1).model.dim == 64
    with pytest.raises(ConfigError, match="no such directory"):
        load_config([f"--train.init_from={tmp_path / 'nothing'}"], world_size=1)
    with pytest.raises(ConfigError, match="no config.json"):
        load_config([f"--train.init_from={tmp_path}"], world_size=1)


@pytest.mark.gpu
def test_a_loaded_model_runs_on_a_gpu(hf_dirs):
    """The compiled kernels (FlashAttention with q/k norm, head_dim 32; the grouped GEMM under
    bf16 autocast) on a loaded Qwen3-MoE, against transformers in fp32 on the CPU."""
    directory, ref = hf_dirs["qwen3_moe"]
    model = ours_from(directory).cuda()
    tokens, _ = _tokens()
    with torch.no_grad():
        want = ref(tokens).logits
        got = model(tokens.cuda()).cpu()
        with torch.autocast("cuda", torch.bfloat16):
            got_bf16 = model(tokens.cuda()).cpu()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 1e-2 * scale  # fp32 operands, TF32-rate dots in the kernels
    assert (got_bf16 - want).abs().max().item() < 5e-2 * scale


def test_a_tied_model_may_carry_its_lm_head(tmp_path):
    """transformers ignores a tied model's stored lm_head.weight; so does the loader."""
    from safetensors.torch import load_file, save_file

    ref = build_hf("qwen3_moe", str(tmp_path / "tied"), tie=True)
    tensors = load_file(str(tmp_path / "tied" / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "tied" / "model.safetensors"))
    ours = ours_from(str(tmp_path / "tied"))
    tokens, _ = _tokens()
    with torch.no_grad():
        assert ours.lm_head is None and (ours(tokens) - ref(tokens).logits).abs().max().item() < 1e-5
