"""``train.init_from``: build the model of a Hugging Face directory and load its weights.

A directory is ``config.json`` plus safetensors: one ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (any other set of ``*.safetensors`` files is read too, by their
headers). Tensors are read one at a time through ``safe_open`` (a memory map of the file, so a
rank reads the bytes of the tensors it asks for and nothing else): under expert parallelism each
rank asks only for its own experts, and a rank's host memory holds one assembled tensor at a time.

Before anything is read, the directory's names are checked against the whole model's map (every
expert of every rank): a tensor the model needs and the directory lacks, or one the directory has
and the model would not use, is one :class:`~train.hf.architectures.HFError` naming it. Each tensor
read is checked against the shape the config implies, and named if it differs.
"""

import json
import os
import time

import torch
import torch.nn as nn

from moe import GroupedExperts
from train.config import Config

from train.hf.architectures import Architecture, HFError, architecture
from train.hf.tensors import Rule, model_rules, moe_block_rules

INDEX = "model.safetensors.index.json"
# buffers some checkpoints carry that the model recomputes (RoPE frequencies of older exports)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(directory: str) -> dict:
    """The parsed ``config.json`` of ``directory``; HFError naming the file otherwise."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise HFError(f"train.init_from={directory}: no such directory")
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise HFError(f"train.init_from={directory}: no config.json there (a Hugging Face model directory has one)") from None
    except ValueError as e:
        raise HFError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise HFError(f"{path}: not a JSON object")
    return hf


def _architecture_of(directory: str) -> tuple[Architecture, dict, str]:
    """The architecture of ``directory``, its parsed config.json and that file's path."""
    hf = read_hf_config(directory)
    where = os.path.join(directory, "config.json")
    return architecture(hf, where), hf, where


def init_options(directory: str) -> tuple[Architecture, dict]:
    """The architecture of ``directory`` and the ``{"section.key": value}`` it sets."""
    arch, hf, where = _architecture_of(directory)
    return arch, arch.options(hf, where)


class SafetensorsDir:
    """The tensors of a directory's safetensors files, by name, read lazily."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        self._open = safe_open
        self.directory = directory
        self._handles: dict[str, object] = {}
        index = os.path.join(directory, INDEX)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    self.file_of = dict(json.load(f)["weight_map"])
            except (ValueError, KeyError, TypeError) as e:
                raise HFError(f"{index}: not a safetensors index (no weight_map): {e}") from None
            for name in sorted(set(self.file_of.values())):
                if not os.path.isfile(os.path.join(directory, name)):
                    raise HFError(f"{index} lists {name}, which is not in {directory}")
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                raise HFError(f"{directory}: no *.safetensors files (weights saved as pytorch_model.bin are not read: "
                              "re-save them with safe_serialization=True)")
            self.file_of = {name: f for f in files for name in self._file(f).keys()}

    def _file(self, name: str):
        if name not in self._handles:
            path = os.path.join(self.directory, name)
            try:
                self._handles[name] = self._open(path, framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for a bad header
                raise HFError(f"{path}: not a readable safetensors file ({e})") from None
        return self._handles[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(self.file_of[name]).get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        return self._file(self.file_of[name]).get_tensor(name)


def check_names_present(reader: SafetensorsDir, rules: dict[str, Rule], directory: str) -> list[str]:
    """The HF names ``rules`` read; HFError naming the first that the directory lacks."""
    needed = [n for rule in rules.values() for n in rule.sources]
    missing = [n for n in needed if n not in reader.file_of]
    if missing:
        raise HFError(f"{directory}: tensor {missing[0]} is missing ({len(missing)} missing in all); the config.json "
                      "and the safetensors files must be of one model")
    return needed


def check_names(reader: SafetensorsDir, everything: dict[str, Rule], directory: str, ignored: tuple[str, ...] = ()) -> None:
    """HFError naming the first tensor the model needs that the directory lacks, or the first
    the directory holds that the model would not use (``ignored`` names aside)."""
    needed = check_names_present(reader, everything, directory)
    unused = sorted(set(reader.file_of) - set(needed) - set(ignored))
    unused = [n for n in unused if not n.endswith(_IGNORED_SUFFIXES)]
    if unused:
        raise HFError(f"{directory}: tensor {unused[0]} ({reader.file_of[unused[0]]}) has no place in the model "
                      f"({len(unused)} unexpected in all); the config.json and the safetensors files must be of one model")


def read_rule(reader: SafetensorsDir, rule: Rule) -> torch.Tensor:
    """The tensor ``rule`` builds, each source checked against its expected shape."""
    tensors = []
    for name, want in zip(rule.sources, rule.shapes):
        got = reader.shape(name)
        if got != tuple(want):
            raise HFError(f"tensor {name} ({reader.file_of[name]}) has shape {got}, the config.json implies {tuple(want)}")
        tensors.append(reader.read(name))
    return rule.assemble(tensors)


@torch.no_grad()
def load_weights(model: nn.Module, directory: str, cfg: Config) -> float:
    """Fill every parameter and buffer of ``model`` (a :class:`train.model.MoETransformer` of
    config ``cfg``, before any FSDP wrapping; under EP its layers hold their rank's experts,
    which are the ones read) from ``directory``; returns the seconds it took. Tensors of ours
    with no HF counterpart must be the ones the architecture lacks by design (an ``expert_bias``
    the run adds): left as initialised."""
    start = time.perf_counter()
    arch, _, _ = _architecture_of(directory)
    reader = SafetensorsDir(directory)
    # a tied model's file may hold lm_head.weight as well (transformers ignores it): so do we
    check_names(reader, model_rules(arch, cfg), directory, ("lm_head.weight",) if cfg.model.tie_embeddings else ())
    held = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    ep_size = cfg.moe.num_experts // held[0].num_experts if held else 1
    rules = model_rules(arch, cfg, held[0].first_expert // held[0].num_experts if held else 0, ep_size)
    state = dict(model.named_parameters())
    state.update((n, b) for n, b in model.named_buffers() if b is not None)
    for name, target in state.items():
        rule = rules.get(name)
        if rule is None:
            if name.endswith("router.expert_bias"):
                continue
            raise HFError(f"{directory}: nothing in a {arch.model_type} checkpoint fills our tensor {name}")
        value = read_rule(reader, rule)
        if value.shape != target.shape:  # a map that disagrees with the model: a bug here, not the user's
            raise AssertionError(f"{name}: built {tuple(value.shape)} from {rule.sources[0]}, the model has {tuple(target.shape)}")
        target.copy_(value)
    return time.perf_counter() - start


@torch.no_grad()
def moe_block_state(directory: str, layer: int, ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """The state dict of a :class:`moe.MoELayer` holding HF layer ``layer``'s MoE block (the
    experts of EP rank ``ep_rank`` of ``ep_size``), for any architecture here, DeepSeek-V3's
    included: ``layer.load_state_dict(moe_block_state(d, i))`` on a layer built with
    ``config=moe_config(d)``."""
    arch, hf, where = _architecture_of(directory)
    moe_cfg = arch.moe_config(hf, where)
    if not moe_cfg.is_moe_layer(layer):
        raise HFError(f"{where}: layer {layer} is a dense layer, not an MoE block")
    L = moe_cfg.num_experts // ep_size
    theirs = f"model.layers.{layer}.{arch.moe_module}"
    reader = SafetensorsDir(directory)
    rules = moe_block_rules(arch, "", theirs, hf["hidden_size"], moe_cfg, ep_rank * L, L)
    check_names_present(reader, rules, directory)
    return {name[1:]: read_rule(reader, rule) for name, rule in rules.items()}


def moe_config(directory: str):
    """The :class:`moe.MoEConfig` of the MoE blocks of the HF model in ``directory``."""
    arch, hf, where = _architecture_of(directory)
    return arch.moe_config(hf, where)
