"""Checks of a validated config against this machine and its data, before any process group starts.

:func:`train.config.validate` checks the config alone; :func:`check_environment` checks what the
config asks of the machine, each cheaply enough to run on every rank at every start:

- the device: ``parallel.device=cuda`` (the GPU configs say so) on a machine without a CUDA GPU,
  ``parallel.dispatcher=p2p`` without one, more processes on this node than it has GPUs;
- the data: ``data.path`` exists (sources ``tokens`` and ``text``) and holds whole tokens; every
  rank's shard of the training and of the validation split holds at least one micro-batch of
  ``data.batch_size`` windows of ``data.seq_len + 1`` tokens. Computed from file sizes, nothing is
  read: for ``tokens``/``text`` the file's size, for ``stdlib`` :func:`train.data.stdlib_plan`,
  the sizes of the files the corpus reads (a walk and one stat per file, 0.09 s for 1,790 files
  on a 2-core machine; reading the 8 MB corpus itself took 0.21 s). With a ``data.tokenizer``
  (train/tokenizer.py) the token counts are known once the splits are encoded: the cached
  counts when the cache holds them; else, for ``bpe``, the bytes bound them (a byte-level BPE
  token covers one byte or more), so a split that holds too few bytes is refused before any
  training or encoding, and one that holds enough bytes but too few tokens is TokenStream's
  error after the encoding; a tokenizer.json's count has no such bound. A tokenizer.json is read
  (its vocabulary must fit ``model.vocab_size``);
- GPU memory: with bf16 training on a GPU, the peak that :mod:`train.memory` predicts for the
  run's layout (a few ms of arithmetic) against the GPU's memory (``train.memory_check``).

Each problem is one :class:`~train.config.ConfigError`; :func:`start_line` is the line rank 0
prints once everything passed, before the (possibly long) build and first validation.
"""

import os
import numpy as np
import torch

from train.config import Config, ConfigError
from train.data import stdlib_plan, tail_cut
from train.tokenizer import TokenCache, fitting_tokenizer, text_cut

GiB = 1 << 30


def check_environment(cfg: Config, world_size: int | None = None) -> None:
    """Raise ConfigError for the first thing this machine or its data cannot do of ``cfg``."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_device(cfg)
    check_data(cfg, world_size)
    check_memory(cfg, world_size)


def uses_cuda(device_choice: str) -> bool:
    """``parallel.device``: cuda, or auto on a machine with a visible GPU (train/runtime.py's too)."""
    return device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())


def check_device(cfg: Config) -> None:
    p = cfg.parallel
    if p.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("parallel.device=cuda but this machine has no CUDA GPU (torch.cuda.is_available() is False); "
                          "--parallel.device=auto runs on the CPU")
    if cfg.train.cuda_graph and not uses_cuda(p.device):
        raise ConfigError("train.cuda_graph=true needs a CUDA GPU, and this machine has none "
                          "(torch.cuda.is_available() is False)")
    if p.dispatcher == "p2p" and p.ep > 1 and not torch.cuda.is_available():
        raise ConfigError("parallel.dispatcher=p2p needs CUDA GPUs (symmetric memory) but this machine has none "
                          "(torch.cuda.is_available() is False); use parallel.dispatcher=nccl")
    if uses_cuda(cfg.parallel.device):
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gpus = torch.cuda.device_count()
        if per_node > gpus:
            raise ConfigError(f"parallel.device={p.device}: torchrun starts {per_node} processes on this node but it has "
                              f"{gpus} visible GPU{'s' if gpus != 1 else ''} (one each): lower --nproc_per_node")


def split_sizes(cfg: Config) -> tuple[int, int, str]:
    """(train tokens, validation tokens, a few words on where they come from) of ``cfg.data``,
    from file sizes (of the text sources: bytes, the tokens of ``data.tokenizer=bytes``); raises
    ConfigError for a missing or malformed data file."""
    d = cfg.data
    if d.source == "stdlib":
        plan = stdlib_plan(d.max_bytes, d.val_fraction)
        total, val = sum(n for _, n, _ in plan), sum(n for _, n, is_val in plan if is_val)
        return total - val, val, f"the {total:,} bytes of the stdlib corpus with data.max_bytes={d.max_bytes:,}"
    if not os.path.isfile(d.path):
        what = "is a directory" if os.path.isdir(d.path) else "no such file"
        raise ConfigError(f"data.path={d.path}: {what} ({os.path.abspath(d.path)}; data.source={d.source})")
    size = os.path.getsize(d.path)
    itemsize = np.dtype(d.token_dtype).itemsize if d.source == "tokens" else 1
    if size % itemsize:
        raise ConfigError(f"data.path={d.path}: {size:,} bytes is not a whole number of data.token_dtype={d.token_dtype} "
                          f"tokens ({itemsize} bytes each): is the dtype right?")
    n = size // itemsize
    cut = text_cut(d.path, d.val_fraction) if d.tokenizer != "bytes" else tail_cut(n, d.val_fraction)
    unit = "tokens" if d.source == "tokens" else "bytes"
    return cut, n - cut, f"the {n:,} {unit} of {d.path}"


def check_data(cfg: Config, world_size: int) -> None:
    """Every rank's shard of each split holds one micro-batch: ``batch_size`` windows of
    ``seq_len + 1`` tokens (train.data.TokenStream; the validation set takes its batches from as
    many windows, so fewer would repeat windows)."""
    d = cfg.data
    n_train, n_val, origin = split_sizes(cfg)
    bound = ""  # bpe, not cached yet: the counts are bytes, bounds of the tokens that refuse what is short by them
    if d.tokenizer != "bytes":
        if d.tokenizer != "bpe":
            fitting_tokenizer(d.tokenizer, cfg.model.vocab_size)
        manifest = TokenCache(d, cfg.model.vocab_size).manifest()
        if manifest is not None:
            n_train, n_val = manifest["tokens"]["train"], manifest["tokens"]["val"]
            origin = f"the {n_train + n_val:,} data.tokenizer={d.tokenizer} tokens (cached) of {origin}"
        elif d.tokenizer == "bpe":
            bound = ", at most one data.tokenizer=bpe token a byte"
        else:
            return
    need = d.batch_size * d.seq_len + 1  # (n - 1) // seq_len >= batch_size windows
    for split, n in (("training", n_train), ("validation", n_val)):
        per_rank = n // world_size  # the smallest shard (train.data.shard)
        if per_rank < need:
            windows = max(per_rank - 1, 0) // d.seq_len
            ranks = f" over {world_size} ranks" if world_size > 1 else ""
            at_most = "at most " if bound else ""
            raise ConfigError(
                f"data.seq_len={d.seq_len}, data.batch_size={d.batch_size}: a rank's {split} shard holds {at_most}"
                f"{per_rank:,} tokens (the {split} split is {n:,} of {origin}{bound}, data.val_fraction="
                f"{d.val_fraction}{ranks}): {at_most}{windows} window{'s' if windows != 1 else ''} of seq_len + 1, "
                f"fewer than one batch of {d.batch_size} ({need:,} tokens); lower data.seq_len or data.batch_size, or "
                f"use more data")


def check_memory(cfg: Config, world_size: int) -> None:
    """On a GPU, with bf16 training (what train/memory.py models): refuse a run whose predicted
    peak exceeds the GPU's memory (``train.memory_check=false`` starts it anyway)."""
    if not cfg.train.memory_check or not uses_cuda(cfg.parallel.device) or cfg.train.precision == "fp32":
        return
    import importlib.metadata

    from train import memory

    # one process without torchrun builds no process group: nothing is sharded (train/parallelize.py)
    dp = cfg.parallel.data_parallel if "WORLD_SIZE" in os.environ else "replicate"
    ac = cfg.train.activation_checkpointing
    lay = memory.layout_of(cfg, world_size, dp, ac)
    peak = memory.predict(cfg, lay, num=memory.gpu_numerics(importlib.metadata.version("torch"))).peak
    props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
    if peak.total > props.total_memory:
        raise ConfigError(
            f"train.memory_check: train/memory.py predicts a peak of {peak.total / GiB:.1f} GiB per GPU ({dp}, "
            f"activation checkpointing {ac}, at the {peak.name}) but the {props.name} holds "
            f"{props.total_memory / GiB:.1f} GiB: try train.activation_checkpointing=selective or full, "
            f"parallel.data_parallel=fsdp, a smaller data.batch_size or data.seq_len, or more GPUs "
            f"(python -m train.memory --config <this config> --world {world_size} lists every layout); "
            f"--train.memory_check=false starts anyway")


def start_line(cfg: Config, world_size: int) -> str:
    """What rank 0 prints once the checks passed: the run's size per rank and what comes first
    (a large step on a CPU can take minutes before the first line of the trainer)."""
    from train.flops import forward_flops_per_token

    d, t = cfg.data, cfg.train
    tokens = d.batch_size * d.seq_len
    fwd = forward_flops_per_token(cfg) * tokens  # per rank and micro-batch
    step, val = 3 * fwd * t.grad_accum, fwd * d.val_batches

    def flop(x: float) -> str:
        for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
            if x >= scale:
                return f"{x / scale:.1f} {unit}"
        return f"{x / 1e6:.1f} MFLOP"

    device = "cuda" if uses_cuda(cfg.parallel.device) else "cpu"
    return (f"config {cfg.log.run_name}: checked | world {world_size} (ep {cfg.parallel.ep}) on {device} | per rank: "
            f"{t.grad_accum}·{d.batch_size}·{d.seq_len} = {t.grad_accum * tokens:,} tokens and ~{flop(step)} a step, "
            f"~{flop(val)} a validation pass | next: build the run, validate, train {t.steps} steps "
            f"(a line every {cfg.log.every})"
            + (" | moe.force_balance: BENCHMARK ONLY, the experts are chosen at random" if cfg.moe.force_balance else ""))
