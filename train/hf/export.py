"""A checkpoint of ours as a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained``
loads: ``config.json`` and safetensors shards (with ``model.safetensors.index.json`` when there
is more than one).

The checkpoint is read through DCP by global names and shapes, so one written by any number of
ranks at any EP size exports the same; it is verified against its manifest first. Memory stays
near one shard: the tensors are loaded a shard's worth at a time (``max_shard_bytes``), split
into their HF tensors (:meth:`train.hf.tensors.Rule.split`), written, and dropped.

The architecture is the one the run was initialised from (``hf_config`` in the checkpoint's
meta.json), else ``arch`` if given, else the one the model's options imply (q/k norm per head:
Qwen3-MoE; over the whole projection: OLMoE; a gated shared expert: Qwen2-MoE; none of these:
Mixtral). An option the architecture cannot write (a sigmoid router as Mixtral, say) is one
:class:`~train.hf.architectures.HFError` naming it, before anything is written. The directory is
written as ``<out>.tmp`` and renamed when complete.
"""

import json
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp

from train.config import Config, ConfigError, apply_dict, from_yaml
from train.hf.architectures import ARCHITECTURES, Architecture, HFError
from train.hf.load import INDEX
from train.hf.tensors import Rule, model_rules

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _run_config(checkpoint: str, meta: dict) -> Config:
    """The config of the run that wrote ``checkpoint``: meta.json's, else the run directory's
    config.yaml (checkpoints written before meta.json held it)."""
    saved = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))), "config.yaml")
    if meta.get("config") is None and not os.path.isfile(saved):
        raise HFError(f"{checkpoint}: its meta.json holds no config and there is no {saved}: cannot tell the model's shape")
    try:
        if meta.get("config") is None:
            return from_yaml(saved)
        return apply_dict(Config(), meta["config"], "the checkpoint's config")
    except ConfigError as e:
        raise HFError(f"{checkpoint}: its config does not parse: {e}") from None


def infer_architecture(flat: dict) -> Architecture:
    if flat["model.qk_norm"] == "head":
        return ARCHITECTURES["qwen3_moe"]
    if flat["model.qk_norm"] == "full":
        return ARCHITECTURES["olmoe"]
    if flat["moe.shared_expert_gate"]:
        return ARCHITECTURES["qwen2_moe"]
    return ARCHITECTURES["mixtral"]


def _shards(rules: dict[str, Rule], saved: dict, max_bytes: int) -> list[list[str]]:
    """Our tensor names in groups of at most ``max_bytes`` (a tensor larger than that alone)."""
    groups, size = [[]], 0
    for name in rules:
        md = saved[name]
        nbytes = md.size.numel() * md.properties.dtype.itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def export(checkpoint: str, out_dir: str, arch: str | None = None, dtype: str | None = None,
           max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> dict:
    """Write ``checkpoint`` (a ``step_XXXXXXXX`` directory) as a Hugging Face directory
    ``out_dir``; returns its config.json as a dict. ``dtype``: of the written tensors
    (``float32``, ``bfloat16``, ``float16``; default: the ``dtype`` of the config the run was
    initialised from, else float32, the checkpoint's own)."""
    from train.checkpoint import Checkpointer, read_meta
    from train.runtime import Runtime

    tmp = out_dir.rstrip("/") + ".tmp"
    for path in (out_dir, tmp):
        if os.path.exists(path) and not os.path.isdir(path):
            raise HFError(f"--to {out_dir}: {path} is a file, not a directory")
        if os.path.isdir(path) and os.listdir(path) and not overwrite:
            raise HFError(f"--to {out_dir}: {path} exists and is not empty (pass --overwrite to replace it)")
    one_process = Runtime(0, 0, 1, 1, torch.device("cpu"), None)
    Checkpointer(os.path.dirname(os.path.abspath(checkpoint)), one_process).verify(checkpoint)
    meta = read_meta(checkpoint)
    cfg = _run_config(checkpoint, meta)
    flat = cfg.to_flat()
    base = meta.get("hf_config")
    if arch is not None:
        if arch not in ARCHITECTURES:
            raise HFError(f"--arch {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
        chosen = ARCHITECTURES[arch]
    elif base is not None and base.get("model_type") in ARCHITECTURES:
        chosen = ARCHITECTURES[base["model_type"]]
    else:
        chosen = infer_architecture(flat)
    if base is not None and base.get("model_type") != chosen.model_type:
        base = None  # another architecture's keys would not fit
    hf_config = chosen.hf_config(flat, base)
    dtype = dtype or (base or {}).get("dtype") or (base or {}).get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise HFError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    hf_config["dtype"] = dtype

    rules = model_rules(chosen, cfg)
    saved = {k[len("model."):]: m for k, m in dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata.items()
             if k.startswith("model.")}
    for name, rule in rules.items():
        want = tuple(rule.assemble([torch.empty(s, device="meta") for s in rule.shapes]).shape)
        if name not in saved or tuple(saved[name].size) != want:
            raise HFError(f"{checkpoint}: tensor {name} is {tuple(saved[name].size) if name in saved else 'missing'}, its "
                          f"config implies {want}")

    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write(checkpoint, tmp, rules, saved, max_shard_bytes, DTYPES[dtype], hf_config)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left to be mistaken for an export
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return hf_config


def _write(checkpoint: str, tmp: str, rules: dict[str, Rule], saved: dict, max_shard_bytes: int, dtype: torch.dtype,
           hf_config: dict) -> None:
    """The safetensors shards, their index and config.json, into ``tmp``."""
    from safetensors.torch import save_file

    groups = _shards(rules, saved, max_shard_bytes)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        state = {"model": {n: torch.empty(tuple(saved[n].size), dtype=saved[n].properties.dtype) for n in group}}
        with warnings.catch_warnings():  # DCP's notice that one process reads it: what export means
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
        file = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in group:
            for hf_name, t in zip(rules[name].sources, rules[name].split(state["model"][name])):
                tensors[hf_name] = t.to(dtype)
                weight_map[hf_name] = file
                total += tensors[hf_name].numel() * tensors[hf_name].element_size()
        save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
    if len(groups) > 1:
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
