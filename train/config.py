"""Training configuration: nested dataclasses <-> YAML <-> ``--section.key=value`` overrides.

Precedence: command line > YAML file > dataclass defaults. Every value is type-checked against
its field's annotation (``int``, ``float``, ``bool``, ``str``, ``Literal[...]`` for a choice,
``X | None``, ``list[X]``), and an unknown section or key raises :class:`ConfigError` naming
``section.key``. All of this happens before any process group starts, so a typo fails fast on
every rank with the same message. The ``moe`` section is :class:`moe.MoEConfig` itself: its
fields, choices and checks are the layer's, not restated here.
"""

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

import yaml

from moe import MoEConfig


class ConfigError(ValueError):
    """A config file or override that names an unknown key or holds a wrongly typed value."""


@dataclass
class ModelConfig:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: = n_heads (no GQA)
    head_dim: int | None = None  # None: dim // n_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dense_hidden_dim: int = 512  # hidden width of the dense MLP in non-MoE blocks
    init_std: float = 0.02


@dataclass
class ParallelConfig:
    ep: int = 1  # expert-parallel size; data parallel over the whole world, edp = world // ep
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda if available
    # how MoE rows cross the EP group (ep > 1 only): nccl (all-to-all; any devices, any nodes) |
    # p2p (NVLink stores into symmetric memory; CUDA, every EP group on one node)
    dispatcher: Literal["nccl", "p2p"] = "nccl"
    # how the data-parallel copies hold their state: fsdp (FSDP2: dense state sharded over the
    # world, each expert shard's state over its expert-data-parallel group, gradients
    # reduce-scattered during the backward) | replicate (every rank a full copy, gradients
    # all-reduced after the backward). fsdp is the default: on 2xH200 (OLMoE-shaped, EP 2) it
    # trained at 1.08x replicate's tokens/s in 71 instead of 75 GiB (bench/results/memory.md)
    data_parallel: Literal["replicate", "fsdp"] = "fsdp"
    # fsdp: free each block's gathered parameters after its forward (ZeRO-3-like, less memory) or
    # keep them until the backward (ZeRO-2-like, one all-gather per step fewer)
    reshard_after_forward: bool = True
    # fsdp: the dtype parameters are gathered and computed in (auto: bf16 iff training in bf16)
    # and the dtype gradients are reduced in; the router always runs in fp32
    param_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # how long a rank waits for the others in one collective before the run stops with an error
    # naming the collective (and the layer) it waited in; must exceed the longest checkpoint write
    timeout_s: float = 600.0


@dataclass
class DataConfig:
    source: Literal["stdlib", "tokens", "text"] = "stdlib"  # stdlib: bytes of Python's own sources; tokens: memmap
    path: str | None = None  # the token or text file
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # for source=tokens
    max_bytes: int = 8_000_000  # stdlib corpus size cap
    val_fraction: float = 0.05
    seq_len: int = 128
    batch_size: int = 8  # sequences per rank and micro-batch
    val_batches: int = 4  # micro-batches per rank in one validation pass


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    expert_lr_mult: float = 1.0
    expert_weight_decay: float | None = None  # None: = weight_decay
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0: no clipping


@dataclass
class TrainConfig:
    steps: int = 300
    grad_accum: int = 1
    seed: int = 0
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on cuda, fp32 on cpu
    eval_every: int = 50  # 0: validate only at the start and the end
    # recompute activations in the backward instead of keeping them: none | selective (each
    # block's attention and its experts' MLP; the dispatch, and its all-to-all, runs once) |
    # full (every block: its forward, all-to-alls included, runs again in the backward)
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    # a step whose loss or gradient norm is not finite (on any rank) never changes the model: stop
    # (the run ends with an error naming the first non-finite layer, no checkpoint after it) |
    # skip (the step's update is dropped, its batch and schedule position are consumed; the run
    # stops once more than max_skipped_steps steps were skipped)
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_skipped_steps: int = 10


@dataclass
class LogConfig:
    every: int = 10
    dir: str = "runs"
    run_name: str | None = None  # None: the config file's stem
    project: str = "moe-ep"
    wandb_mode: Literal["online", "offline", "disabled"] | None = None  # None: online iff WANDB_API_KEY is set
    heatmap_every: int = 50
    progress: bool = True
    # time the expert-parallel all-to-alls (CUDA events, read at log time): logs
    # time/all_to_all_ms (per step, mean over ranks) and time/all_to_all_fraction of step time;
    # ep > 1 and parallel.dispatcher=nccl only
    time_comm: bool = False


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: <log.dir>/<run_name>/checkpoints
    every: int = 0  # 0: never during the run
    keep: int = 2  # newest checkpoints kept, 0: all
    save_final: bool = False
    resume: str = "auto"  # auto (the newest checkpoint in dir that verifies) | none | a checkpoint directory
    # write in a background thread (the state is first copied to host memory); the checkpoint
    # becomes visible when the next save begins or the run ends
    async_save: bool = False
    stop_after: int = 0  # >0: exit after this many steps (simulates an interruption)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value, tp, key: str):
    """``value`` checked (and losslessly converted) against annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return coerce(value, inner[0], key)
    if origin is list:
        (elem,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is Literal:
        allowed = list(typing.get_args(tp))
        if value in allowed:
            return value
        raise ConfigError(f"{key}: must be one of {allowed}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        # YAML's .nan/.inf and the strings "nan"/"inf" are floats, but no float option means one
        # (none has an "unlimited" value: grad_clip and capacity_factor say it with 0 and None):
        # NaN passed every `>= 0` check, and capacity_factor=inf overflowed only later (issue #18)
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{key}: must be a finite number, got {number}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise ConfigError(f"{key}: unsupported annotation {tp}")
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _field_types(section) -> dict:
    hints = typing.get_type_hints(type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def _set(cfg: Config, dotted: str, value) -> None:
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"{dotted}: keys are section.key, e.g. model.dim")
    sec_name, key = parts
    sections = {f.name for f in dataclasses.fields(cfg)}
    if sec_name not in sections:
        raise ConfigError(f"{dotted}: unknown section {sec_name!r} (known: {', '.join(sorted(sections))})")
    section = getattr(cfg, sec_name)
    types_ = _field_types(section)
    if key not in types_:
        raise ConfigError(f"{dotted}: unknown key {key!r} in section {sec_name!r} (known: {', '.join(types_)})")
    setattr(section, key, coerce(value, types_[key], dotted))


def apply_dict(cfg: Config, data: dict, source: str = "config") -> Config:
    """Set every ``{section: {key: value}}`` of ``data`` on ``cfg`` (type-checked)."""
    if data is None:
        return cfg
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping of sections, got {type(data).__name__}")
    for sec_name, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{sec_name}: a section must be a mapping of keys, got {values!r}")
        for key, value in values.items():
            _set(cfg, f"{sec_name}.{key}", value)
    return cfg


def from_yaml(path: str, cfg: Config | None = None) -> Config:
    with open(path) as f:
        data = yaml.safe_load(f)
    return apply_dict(cfg or Config(), data, source=path)


def _is_text(tp) -> bool:
    """``str``, or a choice among strings."""
    return tp is str or (typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp)))


def _parse_value(text: str, tp):
    """A command-line value: strings (and choices among strings) stay as typed, everything else
    is read as YAML."""
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
    base = [a for a in typing.get_args(tp) if a is not type(None)] if optional else [tp]
    # "none" is a value of a plain string (checkpoint.resume=none), the null only of an optional one
    if len(base) == 1 and _is_text(base[0]) and not (optional and text.lower() in ("none", "null", "~")):
        return text
    if text.lower() in ("none", "null"):
        return None
    return yaml.safe_load(text)


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """``["--model.dim=256", "--train.steps", "10", ...]`` onto ``cfg``."""
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key=value")
        body = arg[2:]
        if "=" in body:
            dotted, text = body.split("=", 1)
        else:
            if i + 1 >= len(overrides):
                raise ConfigError(f"{body}: missing value")
            dotted, text = body, overrides[i + 1]
            i += 1
        i += 1
        sec_name, _, key = dotted.partition(".")
        section = getattr(cfg, sec_name, None)
        tp = _field_types(section).get(key, str) if dataclasses.is_dataclass(section) else str
        _set(cfg, dotted, _parse_value(text, tp))
    return cfg


def validate(cfg: Config, world_size: int = 1) -> Config:
    """Cross-field checks, before any process group starts. Raises ConfigError."""
    positive = {
        "model.vocab_size": cfg.model.vocab_size, "model.dim": cfg.model.dim, "model.n_layers": cfg.model.n_layers,
        "model.n_heads": cfg.model.n_heads, "model.dense_hidden_dim": cfg.model.dense_hidden_dim,
        "parallel.ep": cfg.parallel.ep,
        "data.seq_len": cfg.data.seq_len, "data.batch_size": cfg.data.batch_size, "data.val_batches": cfg.data.val_batches,
        "train.steps": cfg.train.steps, "train.grad_accum": cfg.train.grad_accum, "log.every": cfg.log.every,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    m = cfg.model
    head_dim = m.head_dim or m.dim // m.n_heads
    if m.head_dim is None and m.dim % m.n_heads:
        raise ConfigError(f"model.dim={m.dim} must be divisible by model.n_heads={m.n_heads} (or set model.head_dim)")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    if head_dim <= 0:
        raise ConfigError(f"model.head_dim: must be > 0, got {head_dim}")
    try:
        cfg.moe.validate("moe.")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    tokens = cfg.data.batch_size * cfg.data.seq_len
    if tokens % cfg.moe.capacity_groups:
        raise ConfigError(f"moe.capacity_groups={cfg.moe.capacity_groups} must divide the {tokens} tokens of a micro-batch "
                          "(data.batch_size · data.seq_len)")
    if world_size % cfg.parallel.ep:
        raise ConfigError(f"parallel.ep={cfg.parallel.ep} must divide the world size {world_size}")
    if cfg.moe.num_experts % cfg.parallel.ep:
        raise ConfigError(f"moe.num_experts={cfg.moe.num_experts} must be divisible by parallel.ep={cfg.parallel.ep}")
    if cfg.parallel.dispatcher == "p2p" and cfg.parallel.device == "cpu":
        raise ConfigError("parallel.dispatcher=p2p needs CUDA GPUs (symmetric memory), not parallel.device=cpu")
    edp = world_size // cfg.parallel.ep
    if cfg.parallel.data_parallel == "fsdp" and (cfg.model.dim % edp or cfg.moe.hidden_dim % edp):
        raise ConfigError(f"parallel.data_parallel=fsdp shards every expert's weights over the {edp} ranks of its "
                          f"expert-data-parallel group (world {world_size} / parallel.ep {cfg.parallel.ep}) along "
                          f"model.dim={cfg.model.dim} and moe.hidden_dim={cfg.moe.hidden_dim}: both must be multiples of {edp}")
    if cfg.train.activation_checkpointing == "full" and cfg.parallel.dispatcher == "p2p":
        # the recomputed forward would dispatch again into the symmetric buffers while the
        # slots of the blocks not yet recomputed still hold their rows
        raise ConfigError("train.activation_checkpointing=full recomputes the dispatch: not with parallel.dispatcher=p2p "
                          "(use selective, or the nccl dispatcher)")
    if cfg.parallel.dispatcher == "p2p" and cfg.log.time_comm:
        # the timer brackets the NCCL all-to-alls; the P2P path makes none, so it would log 0 ms
        raise ConfigError("log.time_comm=true times the NCCL all-to-alls only: not with parallel.dispatcher=p2p")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in (0, 1), got {cfg.data.val_fraction}")
    if cfg.data.source != "stdlib" and not cfg.data.path:
        raise ConfigError(f"data.path: required for data.source={cfg.data.source!r}")
    if cfg.data.source in ("stdlib", "text") and cfg.model.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size}: byte-level data needs >= 256")
    if cfg.optim.lr <= 0 or not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError("optim.lr must be > 0 and optim.min_lr_ratio in [0, 1]")
    if cfg.optim.warmup_steps < 0 or cfg.optim.grad_clip < 0:
        raise ConfigError("optim.warmup_steps and optim.grad_clip must be >= 0")
    if cfg.parallel.timeout_s <= 0:
        raise ConfigError(f"parallel.timeout_s: must be > 0, got {cfg.parallel.timeout_s}")
    for key in ("train.eval_every", "train.max_skipped_steps", "log.heatmap_every", "checkpoint.every", "checkpoint.keep", "checkpoint.stop_after"):
        sec, k = key.split(".")
        if getattr(getattr(cfg, sec), k) < 0:
            raise ConfigError(f"{key}: must be >= 0")
    return cfg


def load_config(argv: list[str], world_size: int | None = None) -> Config:
    """``[--config PATH] [--section.key=value ...]`` -> validated Config (CLI > YAML > defaults)."""
    argv = list(argv)
    cfg = Config()
    path = None
    rest = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config: missing path")
            path = argv[i + 1]
            i += 2
        elif argv[i].startswith("--config="):
            path = argv[i].split("=", 1)[1]
            i += 1
        else:
            rest.append(argv[i])
            i += 1
    if path is not None:
        from_yaml(path, cfg)
        if cfg.log.run_name is None:
            cfg.log.run_name = os.path.splitext(os.path.basename(path))[0]
    apply_overrides(cfg, rest)
    if cfg.log.run_name is None:
        cfg.log.run_name = "run"
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return validate(cfg, world_size)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
