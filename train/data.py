"""Training data with no download: byte-level tokens of Python's own standard library sources
(present on every machine with Python), or a memory-mapped token file, or a plain text file.
The text sources (stdlib, text) are byte-level here; ``data.tokenizer`` encodes the same text
with a BPE instead (train/tokenizer.py, which cuts the splits as here, then encodes each).

Legend: B sequences per micro-batch, S sequence length, W ranks of the world; a split holds n
tokens.

Splits. ``stdlib``: the ``*.py`` files under ``sysconfig.get_paths()['stdlib']`` (site-packages
excluded), sorted by relative path, taken in that order until ``max_bytes``; a file goes to
validation when ``crc32(relative path) % 1000 < 1000 · val_fraction``, so the split is a fixed
rule of the file name. The bytes differ between Python versions, so the corpus (and a run's
losses) is deterministic for a given Python installation, not across installations.
``tokens`` / ``text``: the last ``val_fraction`` of the tokens (bytes) is validation.

Sharding: rank r of W reads tokens ``[r·n/W, (r+1)·n/W)`` of each split. A rank's training
stream cuts its shard into non-overlapping windows of S+1 tokens (inputs and next-token targets)
and visits them in a permutation seeded by (seed, epoch, rank); the position ``(epoch, cursor)``
is the stream's whole state, saved in checkpoints, so a resumed run sees the same batches.
"""

import os
import sysconfig
import zlib
from collections.abc import Iterator

import numpy as np
import torch


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the standard library's ``*.py`` files, sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def stdlib_plan(max_bytes: int, val_fraction: float, root: str | None = None) -> list[tuple[str, int, bool]]:
    """``(relative path, bytes taken, goes to validation)`` of each file the stdlib corpus reads
    (see module docstring), from file sizes alone: train/preflight.py sizes the splits with it."""
    root = root or sysconfig.get_paths()["stdlib"]
    plan, total = [], 0
    threshold = int(round(1000 * val_fraction))
    for rel in stdlib_files(root):
        if total >= max_bytes:
            break
        n = min(os.path.getsize(os.path.join(root, rel)), max_bytes - total)
        total += n
        plan.append((rel, n, zlib.crc32(rel.encode()) % 1000 < threshold))
    return plan


def stdlib_documents(plan: list[tuple[str, int, bool]], root: str | None = None) -> Iterator[bytes]:
    """The bytes of each file of ``plan`` (rows of :func:`stdlib_plan`) as the corpus takes them,
    one file at a time."""
    root = root or sysconfig.get_paths()["stdlib"]
    for rel, n, _ in plan:
        with open(os.path.join(root, rel), "rb") as f:
            yield f.read(n)


def stdlib_corpus(max_bytes: int, val_fraction: float, root: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) uint8 byte arrays of the stdlib sources (see module docstring)."""
    plan = stdlib_plan(max_bytes, val_fraction, root)
    train, val = (b"".join(stdlib_documents([row for row in plan if row[2] == is_val], root)) for is_val in (False, True))
    return np.frombuffer(train, dtype=np.uint8), np.frombuffer(val, dtype=np.uint8)


def tail_cut(n: int, val_fraction: float) -> int:
    """Where the validation split of ``n`` tokens (bytes) of a file starts: its last
    ``val_fraction``."""
    return int(n * (1.0 - val_fraction))


def _tail_split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = tail_cut(len(tokens), val_fraction)
    return tokens[:cut], tokens[cut:]


def load_splits(source: str, path: str | None, token_dtype: str, max_bytes: int, val_fraction: float):
    """(train, val) 1-D token arrays for ``data.source``."""
    if source == "stdlib":
        return stdlib_corpus(max_bytes, val_fraction)
    if source == "text":
        return _tail_split(np.fromfile(path, dtype=np.uint8), val_fraction)
    if source == "tokens":
        return _tail_split(np.memmap(path, dtype=np.dtype(token_dtype), mode="r"), val_fraction)
    raise ValueError(f"data.source must be stdlib, tokens or text, got {source!r}")


def unigram_counts(tokens: np.ndarray, vocab_size: int, sample: int = 2**26) -> np.ndarray:
    """(V,) int64 count of each token id below ``vocab_size`` in ``tokens``; of a longer array, in
    64 evenly spaced blocks of ``sample / 64`` tokens (a token file may hold billions: this reads 64
    runs of it). Counted a block at a time: np.bincount copies its input to int64."""
    if len(tokens) > sample:
        block = sample // 64
        starts = np.linspace(0, len(tokens) - block, 64).astype(np.int64)
    else:
        block = 2**20
        starts = range(0, len(tokens), block)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in starts:
        counts += np.bincount(np.asarray(tokens[s:s + block]), minlength=vocab_size)[:vocab_size]
    return counts


def shard(tokens: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    n = len(tokens)
    return tokens[rank * n // world_size:(rank + 1) * n // world_size]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    block = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    block_BS1 = torch.from_numpy(block)
    return block_BS1[:, :-1].contiguous(), block_BS1[:, 1:].contiguous()


class TokenStream:
    """One rank's training batches: ``next_batch() -> (inputs_BS, targets_BS)`` int64 (CPU)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, rank: int = 0):
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < batch_size:
            raise ValueError(
                f"data shard of {len(tokens)} tokens holds {self.num_windows} windows of seq_len {seq_len}, "
                f"fewer than batch_size {batch_size}: use more data or fewer ranks"
            )
        self.epoch = 0
        self.cursor = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch, self.rank]).permutation(self.num_windows)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cursor + self.batch_size > self.num_windows:
            self.epoch += 1
            self.cursor = 0
            self._perm = self._permutation(self.epoch)
        idx = self._perm[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return _windows(self.tokens, idx * self.seq_len, self.seq_len)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self._perm = self._permutation(self.epoch)


def val_batches(tokens: np.ndarray, seq_len: int, batch_size: int, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set: ``num_batches`` batches of windows spread evenly over ``tokens``
    (the same every time, so validation losses are comparable across steps)."""
    num_windows = (len(tokens) - 1) // seq_len
    want = num_batches * batch_size
    if num_windows < 1:
        raise ValueError(f"validation shard of {len(tokens)} tokens is shorter than seq_len+1 = {seq_len + 1}")
    starts = (np.linspace(0, num_windows - 1, want).round().astype(np.int64)) * seq_len
    return [_windows(tokens, starts[i * batch_size:(i + 1) * batch_size], seq_len) for i in range(num_batches)]
