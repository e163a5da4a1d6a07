"""Tokenizers of the text sources (``data.tokenizer``) and the cache of what they produce.

``bytes`` (the default) is train/data.py's reading: one token per byte, vocabulary 256, nothing
cached. The two others encode the same text with a Hugging Face ``tokenizers`` tokenizer (the
package is imported by them only):

- ``bpe``: a byte-level BPE as GPT-2's (the ByteLevel pre-tokenizer and decoder, the 256 byte
  symbols, one special ``<|endoftext|>``) of ``model.vocab_size`` entries, so that every row of
  the embedding and the LM head is a token (fewer only when the corpus holds fewer distinct
  pairs), trained on the run's training split only: no validation text informs a merge.
- a path to a ``tokenizer.json`` (any ``tokenizers`` file, e.g. a Hugging Face model
  directory's): its ids; ``model.vocab_size`` must hold them all.

Splits: train/data.py's, cut on the bytes, then each side encoded on its own, so no token
straddles the boundary. ``stdlib``: a file goes to a split by its name, and each file is encoded
as one document. ``text``: the tail split's cut moved back to the first byte of the UTF-8
character it falls in (:func:`text_cut`); each side is encoded in chunks of about
:data:`CHUNK_BYTES` that begin at a line start, a word boundary of the byte-level
pre-tokenization (the chunked encoding differs from the whole text's only where a line ends in
spaces; a tokenizer that marks the start of a text, as sentencepiece's ``▁``, sees one mark per
chunk). No separator token goes between files: the text is exactly the bytes the ``bytes``
tokenizer reads, so the two compare on the same text, and a Python file ends with its newline.

Text that is not UTF-8: each byte of it reads as ASCII SUB (0x1A, "substitute"), one byte for one
byte, so a token of the byte-level BPE still covers at least one byte of the file (the bound
train/preflight.py checks with). The stdlib's first 16 MB hold 51 such bytes, in 2 files
(``test/encoded_modules``). UTF-8 text round-trips exactly: :func:`decode` of its ids is the text.

Cache (``data.cache_dir``; none: ``$XDG_CACHE_HOME/moe-ep``, else ``~/.cache/moe-ep``), each entry
named by a hash of everything it depends on, so changing any of it makes a new entry:

- ``bpe-<key>.json``: a trained BPE; key: the corpus (:func:`corpus_identity`), the vocabulary
  size, :data:`FORMAT`.
- ``tokens-<key>.{train,val}.bin``: the encoded splits, uint16 when the tokenizer's ids fit, else
  uint32 (read with ``np.memmap``); and ``tokens-<key>.json``, their manifest (dtype, token
  counts, the tokenizer), written last: an entry exists iff its manifest does. Key: the corpus,
  the SHA-256 of the tokenizer's json, :data:`FORMAT`.

The corpus is named by what is known without reading it: ``stdlib`` by its
:func:`~train.data.stdlib_plan` (each file's path, the bytes taken and its split, which follow
``data.max_bytes`` and ``data.val_fraction``), the stdlib's directory and the Python version;
``text`` by the file's absolute path, size and modification time and ``data.val_fraction``.
Every file is written under a temporary name in its directory, fsynced, then renamed over its
final name (``os.replace``): a crash leaves at most a ``*.tmp-*`` file, which nothing reads, never
a part of a file under a name that is read.

Ranks (:func:`load_tokens`): local rank 0 of each node builds what the cache lacks while every
other rank waits in one all_gather of the builders' outcomes; a failed build then raises on
every rank (the builder its own error, the others one that names it), so no rank waits on a
build that has ended. That wait counts against ``parallel.timeout_s``: a first build longer than
it ends the run with the watchdog's error naming this all_gather (raise the timeout for that
first start). Nodes sharing one cache directory build the same entries side by side,
harmlessly: training is deterministic (two processes wrote the same json) and every file is
replaced whole.

Measured on a 2-core CPU (tokenizers 0.23.3, nothing else running), the 16 MB stdlib corpus of
configs/olmoe_bench.yaml (14.9 MB of it training text): vocabulary 50,304: 10.9 s for the first
start (4.3 s to train, 5.1 s to encode both splits; 3.97 M tokens, 4.03 bytes a token); 32,768:
10.4 s (4.6 s, 5.4 s; 4.01 M tokens, 3.99 bytes a token). A later start reads the cache in
0.05 s, after 0.08 s of train/preflight.py. With another job on the 2 cores: 22-31 s to build.
"""

import contextlib
import hashlib
import itertools
import json
import mmap
import os
import re
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterable, Iterator

import numpy as np

from train.config import ConfigError, DataConfig
from train.data import load_splits, stdlib_documents, stdlib_plan, tail_cut
from train.digest import file_digest

FORMAT = 1  # the layout and meaning of the cache's files: a new value makes every older entry a miss
SPECIALS = ("<|endoftext|>",)
MIN_BPE_VOCAB = 256 + len(SPECIALS)  # the byte symbols and the specials: a BPE with no merge yet
CHUNK_BYTES = 1 << 18  # text source: the documents encode_batch spreads over the cores
BATCH_BYTES = 1 << 24  # text per encode_batch call: bounds the encodings held at once
_LINE_START = re.compile(rb"\n(?=\S)")
# surrogateescape reads a byte b that is not UTF-8 as U+DC00 + b (b >= 0x80): each becomes SUB
_SUB = {0xDC00 + b: 0x1A for b in range(0x80, 0x100)}


def cache_dir(d: DataConfig) -> str:
    """``data.cache_dir``, or the user's cache directory's ``moe-ep``."""
    return d.cache_dir or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moe-ep")


def to_text(data: bytes) -> str:
    """``data`` read as UTF-8, each byte that is not UTF-8 as SUB (see the module docstring)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("utf-8", "surrogateescape").translate(_SUB)


def text_cut(path: str, val_fraction: float) -> int:
    """Where a text file's validation split starts with a tokenizer: train/data.py's tail cut,
    moved back to the first byte of the UTF-8 character it falls in (at most 3 bytes back; reads
    those bytes only)."""
    cut = tail_cut(os.path.getsize(path), val_fraction)
    with open(path, "rb") as f:
        f.seek(max(cut - 3, 0))
        head = f.read(min(cut, 3) + 1)  # the bytes before the cut, then the byte at it
    back = 0
    while back < len(head) - 1 and head[len(head) - 1 - back] & 0xC0 == 0x80:  # a continuation byte
        back += 1
    return cut - back


def _text_documents(path: str, start: int, end: int) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of a text file in chunks of about :data:`CHUNK_BYTES`, each but the
    first beginning at a line start (see the module docstring); memory-mapped, read as taken."""
    if start >= end:
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        while start < end:
            stop = end
            if start + CHUNK_BYTES < end:
                line = _LINE_START.search(buf, start + CHUNK_BYTES, end)
                stop = line.end() if line else end
            yield buf[start:stop]
            start = stop


def documents(d: DataConfig, split: str) -> Iterator[bytes]:
    """The text of ``split`` (``"train"`` or ``"val"``) of ``data.source`` stdlib or text, as
    the documents it is encoded in."""
    if d.source == "stdlib":
        return stdlib_documents([row for row in stdlib_plan(d.max_bytes, d.val_fraction) if row[2] == (split == "val")])
    cut = text_cut(d.path, d.val_fraction)
    return _text_documents(d.path, *((0, cut) if split == "train" else (cut, os.path.getsize(d.path))))


def corpus_identity(d: DataConfig) -> dict:
    """What names the corpus and its split in a cache key, known without reading it (see the
    module docstring)."""
    if d.source == "stdlib":
        return {"source": "stdlib", "python": sys.version, "stdlib": sysconfig.get_paths()["stdlib"],
                "max_bytes": d.max_bytes, "val_fraction": d.val_fraction,
                "plan": stdlib_plan(d.max_bytes, d.val_fraction)}
    st = os.stat(d.path)
    return {"source": d.source, "path": os.path.abspath(d.path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "val_fraction": d.val_fraction}


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def file_sha256(path: str) -> str:
    """The first 16 hex digits of the SHA-256 of a file's bytes (:func:`train.digest.file_digest`)."""
    return file_digest(path)["sha256"][:16]


@contextlib.contextmanager
def atomic_file(path: str):
    """A binary file to write that appears under ``path`` whole, or not at all (module docstring)."""
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_tokenizer(path: str):
    """The ``tokenizers.Tokenizer`` of a json file; ConfigError naming ``data.tokenizer`` when
    there is none there."""
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "no such file"
        raise ConfigError(f"data.tokenizer={path}: {what} ({os.path.abspath(path)}); give the path of a tokenizer.json")
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ConfigError(f"data.tokenizer={path}: not a tokenizers file ({err})") from None


def vocab_size_of(tokenizer) -> int:
    """How many embedding rows the tokenizer's ids need: its largest id + 1 (its
    ``get_vocab_size()`` unless ids are left unused)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def fitting_tokenizer(path: str, vocab_size: int):
    """:func:`load_tokenizer`, and a ConfigError naming ``model.vocab_size`` when its ids do not
    fit the model's ``vocab_size`` rows."""
    tokenizer = load_tokenizer(path)
    need = vocab_size_of(tokenizer)
    if need > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the vocabulary of data.tokenizer={path} "
                          f"({need:,} ids): set --model.vocab_size={need} or more")
    return tokenizer


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) of ``vocab_size`` entries, trained on
    ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _batches(docs: Iterable[bytes], limit: int) -> Iterator[list[bytes]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_to_file(tokenizer, docs: Iterable[bytes], path: str, dtype) -> int:
    """Write the ids of ``docs`` to ``path`` (:func:`atomic_file`), one parallel ``encode_batch``
    per :data:`BATCH_BYTES` of text; returns how many."""
    count = 0
    with atomic_file(path) as f:
        for batch in _batches(docs, BATCH_BYTES):
            encodings = tokenizer.encode_batch_fast([to_text(doc) for doc in batch], add_special_tokens=False)
            ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=dtype)
            ids.tofile(f)
            count += len(ids)
    return count


def decode(ids, tokenizer: str) -> str:
    """The text of token ids. ``tokenizer``: ``"bytes"``, or the path of a tokenizer json (a
    run's: :attr:`TokenCache.tokenizer_path`)."""
    ids = np.asarray(ids)
    if tokenizer == "bytes":
        return bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")
    return load_tokenizer(tokenizer).decode(ids.tolist(), skip_special_tokens=False)


class TokenCache:
    """The cache entries of one run's data (see the module docstring): :meth:`build` writes what
    is missing, :meth:`manifest` and :meth:`load` read."""

    def __init__(self, d: DataConfig, vocab_size: int):
        self.d, self.vocab_size = d, vocab_size
        self.dir = cache_dir(d)
        self.corpus = corpus_identity(d)
        self.tokenizer_path = d.tokenizer if d.tokenizer != "bpe" else os.path.join(
            self.dir, f"bpe-{_key(FORMAT, 'bpe', vocab_size, self.corpus)}.json")

    def _prefix(self) -> str | None:
        """``<dir>/tokens-<key>``; None while there is no tokenizer (a BPE not trained yet)."""
        if not os.path.isfile(self.tokenizer_path):
            return None
        return os.path.join(self.dir, f"tokens-{_key(FORMAT, file_sha256(self.tokenizer_path), self.corpus)}")

    def manifest(self) -> dict | None:
        """The entry's manifest (``dtype``, ``tokens``: {split: count}, ``tokenizer``,
        ``tokenizer_sha256``), None when it is not cached."""
        prefix = self._prefix()
        if prefix is None or not os.path.isfile(prefix + ".json"):
            return None
        with open(prefix + ".json") as f:
            return json.load(f)

    def build(self) -> str:
        """Train (``bpe``) and encode what the cache lacks; returns a few words on what it did."""
        if self.manifest() is not None:
            return "read from the cache"
        start = time.perf_counter()
        try:
            os.makedirs(self.dir, exist_ok=True)
            if not os.access(self.dir, os.W_OK):
                raise PermissionError("not writable")
        except OSError as err:
            raise ConfigError(f"data.cache_dir={self.dir}: cannot write there ({err.strerror or err}); set "
                              f"data.cache_dir to a writable directory") from None
        if not os.path.isfile(self.tokenizer_path):  # bpe: a tokenizer.json given is there (train/preflight.py)
            tokenizer = train_bpe((to_text(doc) for doc in documents(self.d, "train")), self.vocab_size)
            with atomic_file(self.tokenizer_path) as f:
                f.write(tokenizer.to_str().encode())
        tokenizer = fitting_tokenizer(self.tokenizer_path, self.vocab_size)
        dtype = np.uint16 if vocab_size_of(tokenizer) <= 1 << 16 else np.uint32
        prefix = self._prefix()
        counts = {split: encode_to_file(tokenizer, documents(self.d, split), f"{prefix}.{split}.bin", dtype)
                  for split in ("train", "val")}
        manifest = {"format": FORMAT, "dtype": np.dtype(dtype).name, "tokens": counts,
                    "tokenizer": os.path.abspath(self.tokenizer_path),
                    "tokenizer_sha256": file_sha256(self.tokenizer_path)}
        with atomic_file(prefix + ".json") as f:
            f.write(json.dumps(manifest, indent=1).encode())
        return f"built in {time.perf_counter() - start:.1f} s"

    def load(self) -> tuple[np.ndarray, np.ndarray, str]:
        """(train, val) token arrays (memory-mapped) and the tokenizer's SHA-256 prefix."""
        manifest = self.manifest()
        if manifest is None:
            raise RuntimeError(f"the token cache of data.tokenizer={self.d.tokenizer} is missing from {self.dir} "
                               f"after its build (another cache directory on this rank?)")
        prefix, dtype = self._prefix(), np.dtype(manifest["dtype"])
        arrays = []
        for split in ("train", "val"):
            path, count = f"{prefix}.{split}.bin", manifest["tokens"][split]
            if os.path.getsize(path) != count * dtype.itemsize:
                raise RuntimeError(f"{path}: {os.path.getsize(path):,} bytes, but its manifest says {count:,} "
                                   f"{dtype.name} tokens: delete {prefix}.* to rebuild it")
            arrays.append(np.memmap(path, dtype=dtype, mode="r") if count else np.zeros(0, dtype=dtype))
        return arrays[0], arrays[1], manifest["tokenizer_sha256"]


def load_tokens(d: DataConfig, vocab_size: int, local_rank: int = 0) -> tuple[np.ndarray, np.ndarray, str]:
    """(train, val) 1-D token arrays of ``data.*`` and the tokenizer's name for the ranks' data
    facts: ``"bytes"``, or the SHA-256 prefix of its json. With a tokenizer, local rank 0 builds
    the cache and the ranks meet in one collective (see the module docstring); rank 0 prints a
    line on the tokenizer and the splits."""
    import torch.distributed as dist  # the trainer's: train/preflight.py imports this module without them

    from parallel import flight

    if d.tokenizer == "bytes":
        return (*load_splits(d.source, d.path, d.token_dtype, d.max_bytes, d.val_fraction), "bytes")
    cache = TokenCache(d, vocab_size)
    flight.phase(f"data: the token cache in {cache.dir} (local rank 0 of each node builds what it lacks)")
    error, did = None, "read from the cache"
    if local_rank == 0:
        try:
            did = cache.build()
        except Exception as err:  # reaches the collective below, so that no rank waits for this one
            error = err
    if dist.is_initialized():
        outcomes = [None] * dist.get_world_size()
        flight.record("all_gather of the token cache builds' outcomes (the ranks wait for local rank 0 to build it)")
        config = isinstance(error, ConfigError)  # one line on rank 0 (train/train.py), a traceback otherwise
        dist.all_gather_object(outcomes, None if error is None else
                               (config, str(error) if config else f"{type(error).__name__}: {error}"))
        failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
        if error is None and failed:
            rank, (config, message) = failed[0]
            raise (ConfigError if config else RuntimeError)(
                f"rank {rank} (local rank 0 of its node) could not build the token cache: {message}")
    if error is not None:
        raise error
    train, val, sha = cache.load()
    if not dist.is_initialized() or dist.get_rank() == 0:
        text_bytes = sum(row[1] for row in cache.corpus["plan"]) if d.source == "stdlib" else cache.corpus["size"]
        trained = f" ({cache.tokenizer_path})" if d.tokenizer == "bpe" else ""
        print(f"data.tokenizer={d.tokenizer}{trained}: {len(train):,} training and {len(val):,} validation tokens, "
              f"{text_bytes / max(len(train) + len(val), 1):.2f} bytes a token | {did}", flush=True)
    return train, val, sha
