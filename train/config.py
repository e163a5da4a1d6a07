"""Training configuration: nested dataclasses <-> YAML <-> ``--section.key=value`` overrides.

Precedence: command line > YAML file > dataclass defaults. Every value is type-checked against
its field's annotation (``int``, ``float``, ``bool``, ``str``, ``Literal[...]`` for a choice,
``X | None``, ``list[X]``), and an unknown section or key raises :class:`ConfigError` naming
``section.key``. All of this happens before any process group starts, so a typo fails fast on
every rank with the same message. The ``moe`` section is :class:`moe.MoEConfig` itself: its
fields, choices and checks are the layer's, not restated here.

Each key's meaning is its field's ``metadata["help"]`` (:func:`option`); :func:`help_text` writes
every key with its default, its type or ``Literal`` choices and that meaning (``--help``).
:meth:`Config.is_set` tells the keys a YAML file or the command line set from the defaults, so
that :func:`check_ignored` refuses an option the rest of the config ignores only when the user
asked for it. ``--config`` takes a path or the name of a built-in config
(:func:`resolve_config_path`: ``train/configs/<name>.yaml``, shipped inside the package).
What the config asks of the machine and its data is checked by :mod:`train.preflight`.
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
    """A config problem found before the run starts: a missing config or data file, an unknown key,
    a wrongly typed value, values that contradict each other or the data, an option the rest of
    the config ignores, a device the machine lacks. Its message is one line naming the key(s);
    the training script prints it and exits with status 2."""


# the built-in configs, shipped inside the package (train/configs/*.yaml; the repository's
# configs/ is a link to it): ``--config tiny`` finds them from any directory after an install
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def option(default, help: str):
    """A config key: its default and its one-line meaning (``--help`` prints it, with its type and
    the choices of its ``Literal`` annotation)."""
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    """the transformer (train/model.py)"""

    vocab_size: int = option(256, "V, rows of the embedding and the LM head; byte-level data (stdlib, text) needs >= 256")
    dim: int = option(128, "D, model width")
    n_layers: int = option(2, "transformer blocks (which of them are MoE blocks: moe.every_n_layers)")
    n_heads: int = option(4, "H, query heads")
    n_kv_heads: int | None = option(None, "Hkv, key/value heads (GQA), must divide n_heads; none: = n_heads (no GQA)")
    head_dim: int | None = option(None, "Hd, width of a head; none: dim // n_heads")
    rope_theta: float = option(10000.0, "RoPE base")
    sliding_window: int | None = option(
        None, "W: every query attends to the last W positions, itself included (Mistral/Mixtral's sliding_window, "
              "in every block); none: the whole causal prefix")
    norm_eps: float = option(1e-5, "RMSNorm epsilon")
    qk_norm: Literal["none", "head", "full"] = option(
        "none", "RMSNorm of the queries and keys before RoPE: head: over each head's Hd (Qwen3-MoE), full: over all "
        "the heads' width at once (OLMoE)")
    qkv_bias: bool = option(False, "biases on the query, key and value projections (Qwen2-MoE)")
    tie_embeddings: bool = option(True, "the LM head is the embedding's weight (false: a separate V × D head)")
    dense_hidden_dim: int = option(512, "hidden width of the dense MLP in non-MoE blocks")
    init_std: float = option(0.02, "std of the normal init (output projections: init_std / sqrt(2 · n_layers))")
    embed_init_std: float | None = option(
        None, "std of the embedding's normal init; none: init_std. configs/olmoe_*.yaml set 1.0 (torchtitan's): at "
              "0.02 a token's own signal is drowned within ten steps by what the attention writes, and every router "
              "sees one input (bench/results/routing_health.md)")
    lm_head_bias: bool = option(
        False, "a (V,) bias on the LM head's logits, initialised to the training data's centred log unigram "
               "frequencies, so the residual stream need not carry them as a component common to every token "
               "(which then reaches every router); no Hugging Face architecture has one")


@dataclass
class ParallelConfig:
    """how the ranks of torchrun's world share the work (train/runtime.py, parallel/)"""

    ep: int = option(1, "expert-parallel size: must divide the world (torchrun --nproc_per_node · nodes) and "
                        "moe.num_experts; data parallel over the whole world, edp = world // ep")
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "auto: cuda if a GPU is visible, else cpu; cuda: refuse to start on a machine without one")
    dispatcher: Literal["nccl", "p2p"] = option(
        "nccl", "how MoE rows cross the EP group (ep > 1 only): nccl (all-to-all; any devices, any nodes) | "
                "p2p (NVLink stores into symmetric memory; CUDA, every EP group on one node; no host sync per layer: "
                "1.33-1.58x nccl's tokens/s on 2xH200, OLMoE-shaped, 8 micro-batches a step, at the same peak memory)")
    nccl_sizes: Literal["exact", "padded"] = option(
        "exact", "dispatcher nccl: exact (each exchange sized by the counts, which the host waits for once per MoE "
                 "layer) | padded (every rank sends every other one a block of batch_size * seq_len token rows, no "
                 "host wait; the experts' buffers then hold the most rows a rank can receive: ep * top_k rows a "
                 "token dropless, the capacity's bound when moe.capacity_factor caps; on 2xH200, OLMoE-shaped, "
                 "0.95-1.09x exact's step for 8.5 GB more: the ranks' wait moved into the all-to-all)")
    p2p_copy: Literal["kernels", "copy_engine"] = option(
        "kernels", "dispatcher p2p: how the token rows cross: kernels (the P2P kernels store each (token, rank)'s "
                   "row over NVLink, on the SMs) | copy_engine (each rank's whole block of token rows by cudaMemcpyAsync "
                   "on the copy engines, which take no SMs: with overlap_chunks > 1 the exchange runs beside the "
                   "experts' GEMMs; every token's row goes to every rank: about the same bytes at top-8 of 64 on 2 "
                   "ranks, 4x at top-2 of 8 on 8)")
    overlap_chunks: int = option(
        1, "the dispatcher cuts each MoE layer's tokens into this many chunks and pipelines them on a second "
           "CUDA stream: one chunk's exchange runs while another chunk's experts compute, forward and backward "
           "(1: no pipelining; ep > 1; both dispatchers, P2P's buffers then hold a chunk each; on 2xH200 NVLink "
           "2 chunks ran the nccl dispatcher at 0.80x of 1)")
    data_parallel: Literal["replicate", "fsdp"] = option(
        "fsdp", "how the data-parallel copies hold their state: fsdp (FSDP2: dense state sharded over the world, "
                "each expert shard's state over its expert-data-parallel group, gradients reduce-scattered during "
                "the backward) | replicate (every rank a full copy, gradients all-reduced after the backward); "
                "on 2xH200 (OLMoE-shaped, EP 2) fsdp trained at 1.08x replicate's tokens/s in 71 instead of 75 GiB "
                "at one micro-batch a step, replicate at 1.14-1.15x fsdp's at 8 (FSDP gathers every micro-batch)")
    reshard_after_forward: bool = option(
        True, "fsdp: free each block's gathered parameters after its forward (ZeRO-3-like, less memory) or keep "
              "them until the backward (false: ZeRO-2-like, one all-gather per step fewer)")
    param_dtype: Literal["auto", "bf16", "fp32"] = option(
        "auto", "fsdp: the dtype parameters are gathered and computed in (auto: bf16 iff training in bf16); the "
                "router always runs in fp32")
    reduce_dtype: Literal["fp32", "bf16"] = option("fp32", "fsdp: the dtype gradients are reduced in")
    timeout_s: float = option(
        600.0, "how long a rank waits for the others in one collective (or, with dispatcher p2p, for a peer's "
               "signal) before the run stops with an error naming what it waited in; must exceed the longest "
               "checkpoint write")


@dataclass
class DataConfig:
    """what the model reads (train/data.py); every rank reads its own shard of each split"""

    source: Literal["stdlib", "tokens", "text"] = option(
        "stdlib", "stdlib: the bytes of Python's own standard library sources (nothing to download) | tokens: a "
                  "memory-mapped file of token ids (data.path, data.token_dtype) | text: a file's bytes (data.path)")
    path: str | None = option(None, "the token or text file (source tokens or text only)")
    token_dtype: Literal["uint16", "uint32"] = option("uint16", "dtype of the token file's ids (source tokens only)")
    max_bytes: int = option(8_000_000, "how many bytes of the stdlib corpus to use (source stdlib only)")
    val_fraction: float = option(
        0.05, "share of the data held out for validation, in (0, 1): stdlib by a hash of each file's name, tokens "
              "and text the file's tail")
    seq_len: int = option(128, "S, tokens per sequence; a rank's shard of each split needs batch_size windows of "
                               "seq_len + 1 tokens")
    batch_size: int = option(8, "B, sequences per rank and micro-batch")
    val_batches: int = option(4, "micro-batches per rank in one validation pass")
    tokenizer: str = option(
        "bytes", "sources stdlib and text: bytes (one token per byte, vocabulary 256) | bpe (a byte-level BPE of "
                 "model.vocab_size tokens, trained on the training split once and cached with the encoded splits in "
                 "data.cache_dir) | the path of a tokenizer.json (Hugging Face tokenizers, e.g. a model directory's; "
                 "its vocabulary must fit model.vocab_size; the encoded splits are cached)")
    cache_dir: str | None = option(
        None, "where a data.tokenizer other than bytes keeps the trained BPE and the encoded splits; none: "
              "$XDG_CACHE_HOME/moe-ep, else ~/.cache/moe-ep")


@dataclass
class OptimConfig:
    """AdamW with warmup and cosine decay (train/optim.py)"""

    lr: float = option(3e-3, "peak learning rate, after warmup")
    min_lr_ratio: float = option(0.1, "the cosine decays to lr · min_lr_ratio, in [0, 1]")
    warmup_steps: int = option(20, "linear warmup steps")
    weight_decay: float = option(0.1, "AdamW weight decay of the matrices (norm gains and biases: none)")
    expert_lr_mult: float = option(1.0, "the experts' learning rate is lr · expert_lr_mult")
    expert_weight_decay: float | None = option(None, "the experts' weight decay; none: = weight_decay")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    eps: float = option(1e-8, "AdamW epsilon")
    grad_clip: float = option(1.0, "clip the global gradient norm to this; 0: no clipping")


@dataclass
class TrainConfig:
    """the loop (train/trainer.py)"""

    steps: int = option(300, "optimizer steps of the whole run (the schedule's length)")
    grad_accum: int = option(1, "micro-batches per optimizer step")
    seed: int = option(0, "seed of the weights (the same on every rank) and of each rank's data order")
    precision: Literal["auto", "bf16", "fp32"] = option(
        "auto", "auto: bf16 autocast on cuda, fp32 on cpu")
    eval_every: int = option(50, "validate every this many steps; 0: only at the start and the end")
    activation_checkpointing: Literal["none", "selective", "full"] = option(
        "none", "recompute activations in the backward instead of keeping them: none | selective (each block's "
                "attention and its experts' MLP; the dispatch, and its all-to-all, runs once) | full (every block: "
                "its forward, all-to-alls included, runs again in the backward)")
    on_nonfinite: Literal["stop", "skip"] = option(
        "stop", "a step whose loss or gradient norm is not finite (on any rank) never changes the model: stop (the "
                "run ends with an error naming the first non-finite layer, no checkpoint after it) | skip (the "
                "step's update is dropped, its batch and schedule position are consumed; the run stops once more "
                "than max_skipped_steps steps were skipped)")
    max_skipped_steps: int = option(10, "on_nonfinite=skip: the most skipped steps before the run stops")
    gc_every: int = option(
        50, "Python's cyclic garbage collector is off while training and collects fully every this "
            "many steps, on every rank at the same point of the step (an automatic collection pauses one rank at a "
            "moment of its own, and the others wait for it at the next collective: torchtitan's gc_freq, Megatron-LM's "
            "--manual-gc); 0: Python's automatic collection")
    memory_check: bool = option(
        True, "on a GPU, refuse to start when train/memory.py predicts a peak above the GPU's memory (bf16 "
              "training); false: start anyway")
    cuda_graph: bool = option(
        False, "after this launch's first step, capture one micro-batch's forward and backward as a CUDA graph "
               "and replay it for every micro-batch: the host launches one graph a micro-batch instead of its ~2,600 "
               "kernels (OLMoE-shaped, 16 layers; the host's time a step at EP 1 fell from 803 to 166 ms, a host-bound "
               "step ran 1.59x, bench/results/step_graph.md); needs a GPU, bf16, parallel.dispatcher=p2p when "
               "parallel.ep > 1, and replicate when several processes train; keeps the gradients and the experts' bf16 "
               "weight copies allocated between steps (train/step_graph.py)")
    init_from: str | None = option(
        None, "a Hugging Face model directory (config.json + *.safetensors; Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): "
              "its config.json sets the model.* and moe.* architecture keys, its weights the initial model (each "
              "rank reads its own experts)")


@dataclass
class LogConfig:
    """what the run reports (train/logger.py; rank 0 only)"""

    every: int = option(10, "log the training metrics every this many steps")
    dir: str = option("runs", "the run directory is <dir>/<run_name>")
    run_name: str | None = option(None, "none: the config file's stem (run without --config: run)")
    overwrite: bool = option(
        False, "start afresh in a run directory that holds an earlier run (its files and checkpoints are removed); "
               "without it such a rerun resumes, or refuses (train/rundir.py)")
    project: str = option("moe-ep", "the wandb project")
    wandb_mode: Literal["online", "offline", "disabled"] | None = option(
        None, "none: the WANDB_MODE environment variable, else online iff WANDB_API_KEY is set, else offline")
    heatmap_every: int = option(50, "log the layers × experts load heatmap every this many steps; 0: never")
    progress: bool = option(True, "a progress bar on stderr (when it is a terminal)")
    time_comm: bool = option(
        False, "time the expert-parallel all-to-alls (CUDA events, read at log time): logs time/all_to_all_ms "
               "(per step, mean over ranks) and time/all_to_all_fraction of step time; parallel.ep > 1 and "
               "parallel.dispatcher=nccl only")


@dataclass
class CheckpointConfig:
    """checkpoints (train/checkpoint.py)"""

    dir: str | None = option(None, "none: <log.dir>/<run_name>/checkpoints")
    every: int = option(0, "save every this many steps; 0: never during the run")
    keep: int = option(2, "newest checkpoints kept; 0: all")
    save_final: bool = option(False, "save after the last step")
    resume: str = option(
        "auto", "auto (the newest checkpoint in dir that verifies; none found: a fresh start) | none | a "
                "checkpoint directory")
    async_save: bool = option(
        False, "write in a background thread (the state is first copied to host memory); the checkpoint becomes "
               "visible when the next save begins or the run ends")
    stop_after: int = option(0, ">0: exit after this many steps (simulates an interruption); 0: run to train.steps")


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

    def __post_init__(self):
        # "section.key" of every key a YAML file or the command line set (not a dataclass field:
        # neither compared, nor dumped, nor part of the config a run saves)
        self.user_set: set[str] = set()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_flat(self) -> dict:
        """``{"section.key": value}`` of every key (:func:`flatten` of :meth:`to_dict`)."""
        return flatten(self.to_dict())

    def is_set(self, dotted: str) -> bool:
        """Whether a YAML file or the command line set ``section.key`` to something other than its
        default (a key written with its default value, as in a saved run's config.yaml, changes
        nothing and counts as unset)."""
        if dotted not in self.user_set:
            return False
        sec_name, key = dotted.split(".")
        return getattr(getattr(self, sec_name), key) != _default(type(getattr(self, sec_name)), key)


def flatten(tree: dict) -> dict:
    """A config tree ``{section: {key: value}}`` (a :meth:`Config.to_dict`, or a saved run's
    config.yaml) as ``{"section.key": value}``; anything else at the top level is left out."""
    return {f"{section}.{key}": value for section, values in tree.items() if isinstance(values, dict)
            for key, value in values.items()}


def _default(cls, key: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == key)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


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
    cfg.user_set.add(dotted)


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


def builtin_configs() -> list[str]:
    """Names of the built-in configs (``--config <name>``)."""
    if not os.path.isdir(CONFIG_DIR):
        return []
    return sorted(os.path.splitext(n)[0] for n in os.listdir(CONFIG_DIR) if n.endswith(".yaml"))


def resolve_config_path(path: str) -> str:
    """The YAML file ``--config path`` means: ``path`` itself when it exists; else, for a bare name
    (``tiny``, ``tiny.yaml``) or a ``configs/<name>.yaml`` that is not in the working directory,
    the built-in config of that name (found from any directory, also after a non-editable
    install). Raises ConfigError naming the path and the built-in configs."""
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        raise ConfigError(f"--config {path}: is a directory, not a YAML file")
    stem, ext = os.path.splitext(os.path.basename(path))
    parent = os.path.dirname(os.path.normpath(path))
    if stem and ext in ("", ".yaml", ".yml") and (parent == "" or os.path.basename(parent) == "configs"):
        candidate = os.path.join(CONFIG_DIR, stem + ".yaml")
        if os.path.isfile(candidate):
            return candidate
    names = builtin_configs()
    raise ConfigError(f"--config {path}: no such file ({os.path.abspath(path)}); the built-in configs are "
                      + (", ".join(names) + f" (by name: --config {'tiny' if 'tiny' in names else names[0]})" if names
                         else f"missing ({CONFIG_DIR} holds none)"))


def from_yaml(path: str, cfg: Config | None = None) -> Config:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    except yaml.YAMLError as err:  # one line: the problem and where
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
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
        "parallel.ep": cfg.parallel.ep, "parallel.overlap_chunks": cfg.parallel.overlap_chunks,
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
    if m.embed_init_std is not None and not m.embed_init_std > 0:  # NaN included
        raise ConfigError(f"model.embed_init_std: must be > 0 (or none), got {m.embed_init_std}")
    if m.sliding_window is not None and m.sliding_window < 1:
        raise ConfigError(f"model.sliding_window: must be >= 1 (or none), got {m.sliding_window}")
    try:
        cfg.moe.validate("moe.")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    tokens = cfg.data.batch_size * cfg.data.seq_len
    if tokens % cfg.moe.capacity_groups:
        raise ConfigError(f"moe.capacity_groups={cfg.moe.capacity_groups} must divide the {tokens} tokens of a micro-batch "
                          "(data.batch_size · data.seq_len)")
    if world_size % cfg.parallel.ep:
        hint = (f" (one process: launch with torchrun --nproc_per_node={cfg.parallel.ep}, or set --parallel.ep=1)"
                if world_size == 1 else "")
        raise ConfigError(f"parallel.ep={cfg.parallel.ep} must divide the world size {world_size}{hint}")
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
    fixed = "parallel.dispatcher=p2p" if cfg.parallel.dispatcher == "p2p" else (
        "parallel.nccl_sizes=padded" if cfg.parallel.nccl_sizes == "padded" else None)
    if fixed and cfg.parallel.overlap_chunks > 1 and cfg.moe.capacity_factor is not None:
        # fixed buffers: every chunk's would hold the whole layer's capacity bound, all chunks at
        # once (at ep 2 the capacity's saving is gone: train.memory models it)
        raise ConfigError(f"{fixed} with parallel.overlap_chunks={cfg.parallel.overlap_chunks} and "
                          f"moe.capacity_factor={cfg.moe.capacity_factor}: each chunk would hold the layer's whole "
                          "capacity bound of rows (use one chunk, exact nccl sizes, or no capacity)")
    if cfg.parallel.dispatcher == "p2p" and cfg.log.time_comm:
        # the timer brackets the NCCL all-to-alls; the P2P path makes none, so it would log 0 ms
        raise ConfigError("log.time_comm=true times the NCCL all-to-alls only: not with parallel.dispatcher=p2p")
    if cfg.train.cuda_graph:
        check_cuda_graph(cfg, world_size)
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in (0, 1), got {cfg.data.val_fraction}")
    if cfg.data.source != "stdlib" and not cfg.data.path:
        raise ConfigError(f"data.path: required for data.source={cfg.data.source!r}")
    check_tokenizer(cfg)
    if cfg.optim.lr <= 0 or not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError("optim.lr must be > 0 and optim.min_lr_ratio in [0, 1]")
    if cfg.optim.warmup_steps < 0 or cfg.optim.grad_clip < 0:
        raise ConfigError("optim.warmup_steps and optim.grad_clip must be >= 0")
    if cfg.parallel.timeout_s <= 0:
        raise ConfigError(f"parallel.timeout_s: must be > 0, got {cfg.parallel.timeout_s}")
    for key in ("train.eval_every", "train.max_skipped_steps", "train.gc_every", "log.heatmap_every", "checkpoint.every", "checkpoint.keep", "checkpoint.stop_after"):
        sec, k = key.split(".")
        if getattr(getattr(cfg, sec), k) < 0:
            raise ConfigError(f"{key}: must be >= 0")
    check_ignored(cfg)
    return cfg


def check_cuda_graph(cfg: Config, world_size: int) -> None:
    """What ``train.cuda_graph`` cannot capture (train/step_graph.py says why)."""
    if cfg.parallel.device == "cpu":
        raise ConfigError("train.cuda_graph=true needs a GPU, not parallel.device=cpu")
    if cfg.parallel.ep > 1 and cfg.parallel.dispatcher != "p2p":
        raise ConfigError(f"train.cuda_graph=true with parallel.ep={cfg.parallel.ep} and parallel.dispatcher="
                          f"{cfg.parallel.dispatcher}: the nccl dispatcher's exchanges are not captured (exact sizes "
                          "are read on the host); use parallel.dispatcher=p2p (its flags' targets live on the device)")
    if cfg.train.precision == "fp32":
        # fp32 rows take the PyTorch reference grouped matmul, which sizes each expert's matmul on the host
        raise ConfigError("train.cuda_graph=true with train.precision=fp32: the fp32 expert matmuls read each "
                          "expert's row count on the host; use train.precision=bf16 (or auto on a GPU)")
    if cfg.parallel.data_parallel == "fsdp" and world_size > 1:
        raise ConfigError(f"train.cuda_graph=true with parallel.data_parallel=fsdp on {world_size} processes: FSDP "
                          "gathers and reduce-scatters inside the forward and backward from host-side hooks; use "
                          "parallel.data_parallel=replicate")


def check_tokenizer(cfg: Config) -> None:
    """``data.tokenizer``'s spelling, its source, and the vocabulary it needs (of a tokenizer.json
    file, its size is checked once the file is read: train/preflight.py)."""
    d, vocab = cfg.data, cfg.model.vocab_size
    if d.tokenizer not in ("bytes", "bpe") and not d.tokenizer.endswith(".json"):
        raise ConfigError(f"data.tokenizer: bytes, bpe or the path of a tokenizer.json file (a Hugging Face model "
                          f"directory's), got {d.tokenizer!r}")
    if d.source == "tokens" and d.tokenizer != "bytes":
        raise ConfigError(f"data.tokenizer={d.tokenizer} with data.source=tokens: the token file holds ids already; "
                          f"drop data.tokenizer (it encodes the text sources, stdlib and text)")
    if d.tokenizer == "bytes" and d.source in ("stdlib", "text") and vocab < 256:
        raise ConfigError(f"model.vocab_size={vocab}: byte-level data needs >= 256")
    if d.tokenizer == "bpe":
        from train.tokenizer import MIN_BPE_VOCAB  # train/tokenizer.py imports this module

        if vocab < MIN_BPE_VOCAB:
            raise ConfigError(f"model.vocab_size={vocab}: data.tokenizer=bpe trains a tokenizer of that many "
                              f"entries, which needs >= {MIN_BPE_VOCAB} (the 256 bytes and the special "
                              f"<|endoftext|>)")


def _show(value) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return str(value)


def check_ignored(cfg: Config) -> None:
    """Raise ConfigError when a key the user set (YAML or command line, to a value other than its
    default) is ignored because of another key's value: the run would silently not do what the
    config says. The message names both keys."""
    d = cfg.data
    rules = [  # (the ignored key, ignored when, the key that makes it so, why)
        ("data.path", d.source == "stdlib", "data.source",
         "the stdlib source reads the standard library's sources, no file (set data.source=tokens or text to read it)"),
        ("data.token_dtype", d.source != "tokens", "data.source", "only a token file (data.source=tokens) has a dtype"),
        ("data.max_bytes", d.source != "stdlib", "data.source",
         "it caps the stdlib corpus only; a token or text file is read whole"),
        ("data.cache_dir", d.tokenizer == "bytes", "data.tokenizer",
         "bytes are read as they are, nothing is cached (set data.tokenizer=bpe or a tokenizer.json)"),
        ("log.time_comm", cfg.parallel.ep == 1, "parallel.ep",
         "with one expert-parallel rank there are no all-to-alls to time (set parallel.ep > 1)"),
        ("parallel.overlap_chunks", cfg.parallel.ep == 1, "parallel.ep",
         "with one expert-parallel rank there is no exchange to overlap (set parallel.ep > 1)"),
        ("parallel.nccl_sizes", cfg.parallel.ep == 1, "parallel.ep",
         "with one expert-parallel rank there is no exchange to size (set parallel.ep > 1)"),
        ("parallel.nccl_sizes", cfg.parallel.dispatcher == "p2p", "parallel.dispatcher",
         "the p2p dispatcher's buffers are always padded (it never waits on the host)"),
        ("parallel.p2p_copy", cfg.parallel.ep == 1, "parallel.ep",
         "with one expert-parallel rank no row crosses (set parallel.ep > 1)"),
        ("parallel.p2p_copy", cfg.parallel.dispatcher != "p2p", "parallel.dispatcher",
         "only the p2p dispatcher moves rows itself (set parallel.dispatcher=p2p)"),
        *((key, cfg.train.init_from is not None, "train.init_from", "every weight is read from the model directory")
          for key in ("model.init_std", "model.embed_init_std")),
    ]
    for key, ignored, because, why in rules:
        if ignored and cfg.is_set(key):
            sec, k = key.split(".")
            bsec, bk = because.split(".")
            raise ConfigError(f"{key}={_show(getattr(getattr(cfg, sec), k))} is ignored with "
                              f"{because}={_show(getattr(getattr(cfg, bsec), bk))}: {why}; drop {key}")


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
        path = resolve_config_path(path)
        from_yaml(path, cfg)
        if cfg.log.run_name is None:
            cfg.log.run_name = os.path.splitext(os.path.basename(path))[0]
    apply_overrides(cfg, rest)
    if cfg.train.init_from:
        apply_init_from(cfg)
    if cfg.log.run_name is None:
        cfg.log.run_name = "run"
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return validate(cfg, world_size)


def apply_init_from(cfg: Config) -> Config:
    """Set the architecture keys that ``train.init_from``'s config.json implies. A key the YAML or
    the command line set to another value is a ConfigError naming it: the checkpoint's weights
    only fit its own architecture."""
    from train.hf.load import init_options  # the Hugging Face reader is needed by this option only

    try:
        _, options = init_options(cfg.train.init_from)
    except (ValueError, TypeError, OSError) as err:  # a config.json with a value of the wrong type, unreadable
        raise ConfigError(str(err)) from None
    for dotted, value in options.items():
        sec_name, key = dotted.split(".")
        section = getattr(cfg, sec_name)
        value = coerce(value, _field_types(section)[key], dotted)
        if dotted in cfg.user_set and getattr(section, key) != value:
            raise ConfigError(f"{dotted}={_show(getattr(section, key))} contradicts train.init_from="
                              f"{cfg.train.init_from}, whose config.json gives {_show(value)}: the architecture comes "
                              f"from there, drop {dotted}")
        setattr(section, key, value)
    return cfg


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def type_text(tp) -> str:
    """An annotation as ``--help`` shows it: ``int``, ``auto|cpu|cuda`` (a Literal's choices),
    ``int or none``, ``list of int``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        text = " or ".join(type_text(a) for a in args if a is not type(None))
        return text + (" or none" if type(None) in args else "")
    if origin is Literal:
        return "|".join(_show(a) for a in typing.get_args(tp))
    if origin is list:
        return "list of " + type_text(typing.get_args(tp)[0])
    return _type_name(tp)


# the moe section's class is the layer's own (moe.MoEConfig): its description is written here
SECTION_HELP = {"moe": "the MoE layers (moe.MoEConfig: the same options as MoELayer's arguments)"}


def help_text(cfg: Config | None = None) -> str:
    """Every key of the config tree, one block per section, one line per key:
    ``  --section.key=<default>  (<type or choices>) <meaning>``."""
    cfg = cfg or Config()
    lines = []
    for sec_field in dataclasses.fields(cfg):
        section = getattr(cfg, sec_field.name)
        doc = SECTION_HELP.get(sec_field.name) or (type(section).__doc__ or "").strip().splitlines()[0]
        lines.append(f"{sec_field.name}:  {doc}")
        types_ = _field_types(section)
        for f in dataclasses.fields(section):
            dotted = f"{sec_field.name}.{f.name}"
            lines.append(f"  --{dotted}={_show(getattr(section, f.name))}  ({type_text(types_[f.name])}) "
                         f"{f.metadata.get('help', '')}".rstrip())
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
