"""Ranks agree before work starts: :func:`check_ranks_agree` compares what every rank believes
about the run and stops all of them with one error naming the first difference.

Why. Each rank parses its own command line and reads its own data files (on several nodes: its
node's copy), and nothing compared them. Issue #18 measured what a difference did: a rank with
another ``model.n_layers`` under EP hung with nothing logged, another ``moe.num_experts`` made one
rank try to allocate 17.9 PB, another ``train.seed`` ran to the end while the expert copies that
must be identical drifted apart (by 0.137 after 30 steps, and were checkpointed so), another
``moe.top_k`` or ``data.seq_len`` was never noticed.

What is compared (each a flat ``{key: value}`` of JSON-able values, "facts"):

- :func:`config_facts`: the resolved config, ``"section.key": value``, except the keys only rank
  0 reads (:data:`RANK_ZERO_ONLY`), and the code version: ``code.sha`` (:func:`source_sha` of the
  library's own sources), ``code.torch``, ``code.triton``. Called once the process group exists,
  before the model is built.
- :func:`data_facts`: the tokenizer (``data.tokenizer``'s SHA-256 prefix, :mod:`train.tokenizer`),
  each split's token count and a CRC-32 of evenly spaced samples of it. Called once every rank
  has loaded the splits, before it takes its shard.

How. One ``all_gather_object`` of the facts over the world; every rank compares all of them with
rank 0's, so every rank raises the same :class:`~train.config.ConfigError` (or none) and no rank
is left waiting in a later collective. Ranks that all arrive pass at once; a rank that never
arrives is the collective timeout's case (``parallel.timeout_s``).

Cost, measured with 2 gloo ranks on one 2-core CPU host (torch 2.13): one config check (76 keys,
1.9 kB pickled; facts built and gathered) takes 4 ms (median of 20, at most 16 ms), plus 2.7 ms
once per process for the source hash (about 60 files, 0.4 MB); the data check of the stdlib
corpus 10 ms for the facts and 1.4-2.5 ms for the gather.
"""

import functools
import hashlib
import os
import zlib

import numpy as np
import torch
import torch.distributed as dist
import triton

from parallel import flight
from train.config import Config, ConfigError

# the directory that holds the library's packages (a checkout's root, or site-packages)
LIBRARY_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY_PACKAGES = ("attention", "kernel_floor", "moe", "parallel", "train")
# read by rank 0's RunLogger only (train/logger.py: every other rank's logger is inactive), so
# another value on another rank changes nothing; every other key is read by all ranks or feeds
# one that is (log.dir and log.run_name make the default checkpoint directory all ranks write)
RANK_ZERO_ONLY = frozenset({"log.progress", "log.project", "log.wandb_mode"})
# data_facts: this many windows of this many tokens per split; a memmap reads only their pages
SAMPLE_WINDOWS, SAMPLE_TOKENS = 16, 4096

_MISSING = object()


def source_sha(root: str = LIBRARY_ROOT, packages: tuple[str, ...] = LIBRARY_PACKAGES) -> str:
    """The first 16 hex digits of a SHA-256 over the ``*.py`` files of ``packages`` under
    ``root``: each file's path relative to ``root``, then its bytes, in sorted path order."""
    paths = []
    for package in packages:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            paths += [os.path.join(dirpath, name) for name in filenames if name.endswith(".py")]
    digest = hashlib.sha256()
    for rel in sorted(os.path.relpath(p, root) for p in paths):
        digest.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


@functools.cache
def code_facts() -> dict:
    """This process's code version: its library sources (hashed once per process) and the
    torch and triton it runs on."""
    return {"code.sha": source_sha(), "code.torch": torch.__version__, "code.triton": triton.__version__}


def config_facts(cfg: Config) -> dict:
    """``cfg`` flattened to ``"section.key": value`` (:data:`RANK_ZERO_ONLY` left out), then
    :func:`code_facts`."""
    return {**{k: v for k, v in cfg.to_flat().items() if k not in RANK_ZERO_ONLY}, **code_facts()}


def data_facts(train_tokens: np.ndarray, val_tokens: np.ndarray, tokenizer: str = "bytes") -> dict:
    """``data.tokenizer`` (``tokenizer``: ``"bytes"``, or the SHA-256 prefix of the json of the
    tokenizer that encoded the splits: ranks with different files of the same name differ here),
    ``data.{train,val}_tokens`` (each split's length) and ``data.{train,val}_crc32`` (a CRC-32 of
    :data:`SAMPLE_WINDOWS` evenly spaced windows of :data:`SAMPLE_TOKENS` tokens, the first and
    the last included). The tokenizer comes first: where it differs, so do the tokens, and the
    message names the cause.

    The splits are the whole loaded data, before :func:`train.data.shard`: for ``stdlib`` they
    depend on the Python installation, for ``tokens`` and ``text`` on the file the node holds
    (whose size the two counts give). A sample, not a hash of the whole: a rank reads only
    its shard, and a whole multi-terabyte file per rank is too much to read for a check.
    """
    facts = {"data.tokenizer": tokenizer}
    for name, tokens in (("train", train_tokens), ("val", val_tokens)):
        starts = np.unique(np.linspace(0, max(len(tokens) - SAMPLE_TOKENS, 0), SAMPLE_WINDOWS, dtype=np.int64))
        crc = 0
        for s in starts:
            crc = zlib.crc32(np.ascontiguousarray(tokens[s:s + SAMPLE_TOKENS]).tobytes(), crc)
        facts[f"data.{name}_tokens"] = len(tokens)
        facts[f"data.{name}_crc32"] = crc
    return facts


def _show(value) -> str:
    return "missing" if value is _MISSING else repr(value)


def disagreement(what: str, gathered: list[dict]) -> str | None:
    """The message for ``gathered`` (every rank's facts, by rank), None when all equal rank 0's:
    the first differing key (rank 0's keys in their order, then keys only some ranks have), its
    value on rank 0 and on the lowest rank that differs, and how many keys differ."""
    keys = list(dict.fromkeys(k for rank_facts in gathered for k in rank_facts))
    differing = [k for k in keys if any(f.get(k, _MISSING) != gathered[0].get(k, _MISSING) for f in gathered[1:])]
    if not differing:
        return None
    key = differing[0]
    ref = gathered[0].get(key, _MISSING)
    rank = next(r for r, f in enumerate(gathered) if f.get(key, _MISSING) != ref)
    more = len(differing) - 1
    tail = f" (and {more} more key{' differs' if more == 1 else 's differ'})" if more else ""
    return (f"ranks disagree on the {what}: {key} is {_show(ref)} on rank 0 "
            f"but {_show(gathered[rank].get(key, _MISSING))} on rank {rank}{tail}")


def check_ranks_agree(what: str, facts: dict) -> None:
    """Collective over the world: raise :class:`~train.config.ConfigError` on every rank, with
    the same :func:`disagreement` message, unless every rank's ``facts`` equal rank 0's. No-op
    without a process group.

    ``what`` (the same on every rank) names the facts, e.g. ``"ranks disagree on the config:
    model.n_layers is 2 on rank 0 but 3 on rank 1 (and 1 more key differs)"``.
    """
    if not dist.is_initialized():
        return
    gathered = [None] * dist.get_world_size()
    flight.record(f"all_gather of the ranks' {what}")
    dist.all_gather_object(gathered, facts)
    message = disagreement(what, gathered)
    if message is not None:
        raise ConfigError(message)
