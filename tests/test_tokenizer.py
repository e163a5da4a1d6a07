"""data.tokenizer (train/tokenizer.py): a byte-level BPE trained on the training split only, or a
user's tokenizer.json; the encoded splits cached under a key of what they depend on, written
atomically, built by local rank 0 while the other ranks wait (and fail with it, never hang);
the options' errors; preflight's bounds; a short training run on BPE tokens."""

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.distributed import run_distributed
from tests.test_train import REPO, SMALL, _env, _run_inprocess
from train import preflight
from train import tokenizer as tk
from train.agreement import data_facts, disagreement
from train.config import ConfigError, load_config
from train.data import TokenStream, stdlib_corpus, tail_cut

V = 300  # a small BPE: 43 merges beyond the bytes and the special
# a text with 2- and 3-byte UTF-8 characters, about 30 KB
CORPUS = "".join(f"def f{i}(x):\n    return x * {i} + len('héllo wörld ✓')\n" for i in range(600))


def _text_file(tmp_path, text: str, name: str = "corpus.txt") -> str:
    path = tmp_path / name
    path.write_bytes(text.encode())
    return str(path)


def _bpe(tmp_path, *args, vocab: int = V):
    """A validated config of ``data.tokenizer=bpe`` with its cache under ``tmp_path``."""
    return load_config(["--data.tokenizer=bpe", f"--model.vocab_size={vocab}", f"--data.cache_dir={tmp_path / 'cache'}",
                        *args])


def _on_text(tmp_path, text: str = CORPUS, *args, vocab: int = V):
    return _bpe(tmp_path, "--data.source=text", f"--data.path={_text_file(tmp_path, text)}", *args, vocab=vocab)


def _count_calls(monkeypatch, name: str) -> list:
    """Patch train.tokenizer's function ``name`` to record each call (then run it)."""
    calls, fn = [], getattr(tk, name)
    monkeypatch.setattr(tk, name, lambda *a, **k: calls.append(a) or fn(*a, **k))
    return calls


# ---------------------------------------------------------------- the options


@pytest.mark.parametrize("args, needles", [
    (["--data.tokenizer=BPE"], ["data.tokenizer", "'BPE'", "tokenizer.json"]),
    (["--data.tokenizer=models/qwen"], ["data.tokenizer", "'models/qwen'"]),
    (["--data.source=tokens", "--data.path=x.bin", "--data.tokenizer=bpe", "--model.vocab_size=1000"],
     ["data.tokenizer=bpe with data.source=tokens"]),
    (["--data.source=tokens", "--data.path=x.bin", "--data.tokenizer=t/tokenizer.json"],
     ["data.tokenizer=t/tokenizer.json with data.source=tokens"]),
    (["--data.tokenizer=bpe"], ["model.vocab_size=256", "data.tokenizer=bpe", ">= 257"]),
    (["--data.tokenizer=bpe", "--model.vocab_size=200"], ["model.vocab_size=200", ">= 257"]),
    (["--data.cache_dir=/tmp/c"], ["data.cache_dir=/tmp/c is ignored with data.tokenizer=bytes"]),
])
def test_option_errors_name_the_key(args, needles):
    with pytest.raises(ConfigError) as err:
        load_config(args)
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_valid_spellings():
    assert load_config([]).data.tokenizer == "bytes"
    assert load_config(["--data.tokenizer=bpe", "--model.vocab_size=257"]).data.cache_dir is None
    # a tokenizer.json's vocabulary is checked once the file is read (preflight), not against 256
    assert load_config(["--data.tokenizer=a/tokenizer.json", "--model.vocab_size=100"]).model.vocab_size == 100


def _user_tokenizer(tmp_path, vocab: int = 280) -> str:
    """A tokenizer.json built with tokenizers directly, as a user's would be."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox " * 50, "jumps over the lazy dog " * 50],
                            trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_a_tokenizer_json_is_read_and_must_fit_the_vocabulary(tmp_path, monkeypatch):
    path = _user_tokenizer(tmp_path)
    text = "the lazy dog jumps over the quick brown fox, ünïcode ✓\n" * 200
    base = ["--data.source=text", f"--data.path={_text_file(tmp_path, text)}", f"--data.tokenizer={path}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--data.seq_len=16", "--data.batch_size=2"]
    with pytest.raises(ConfigError, match=rf"model\.vocab_size=256 is smaller than the vocabulary of "
                                          rf"data\.tokenizer={path} \(280 ids\): set --model\.vocab_size=280"):
        preflight.check_data(load_config(base), 1)
    for bad, needle in ((str(tmp_path / "none.json"), "no such file"), (_text_file(tmp_path, "{}", "bad.json"),
                                                                        "not a tokenizers file")):
        with pytest.raises(ConfigError, match=f"data.tokenizer={bad}: {needle}"):
            preflight.check_data(load_config(base + [f"--data.tokenizer={bad}", "--model.vocab_size=300"]), 1)
    cfg = load_config(base + ["--model.vocab_size=300"])
    preflight.check_data(cfg, 1)
    trained = _count_calls(monkeypatch, "train_bpe")
    train, val, sha = tk.load_tokens(cfg.data, 300)
    assert not trained and sha == tk.file_sha256(path) and train.dtype == np.uint16
    assert max(train.max(), val.max()) < 280 and len(train) + len(val) < len(text.encode()) / 1.5  # its merges are used
    assert tk.decode(train, path) + tk.decode(val, path) == text


# ---------------------------------------------------------------- the BPE and its splits


def test_bpe_has_the_vocabulary_size_and_round_trips(tmp_path):
    cfg = _on_text(tmp_path, CORPUS, "--data.val_fraction=0.3")
    train, val, _ = tk.load_tokens(cfg.data, V)
    path = tk.TokenCache(cfg.data, V).tokenizer_path
    assert tk.vocab_size_of(tk.load_tokenizer(path)) == V  # every row of the embedding is a token
    assert max(train.max(), val.max()) == V - 1 and len(train) < len(CORPUS.encode()) * 0.7 * 0.5
    cut = tk.text_cut(cfg.data.path, 0.3)
    assert tk.decode(train, path) == CORPUS.encode()[:cut].decode() and tk.decode(val, path) == CORPUS.encode()[cut:].decode()
    # the stdlib: a sample of its files (UTF-8) round-trips exactly
    cfg = _bpe(tmp_path, "--data.max_bytes=100000", vocab=400)
    train, val, _ = tk.load_tokens(cfg.data, 400)
    text_train, text_val = stdlib_corpus(100_000, cfg.data.val_fraction)
    path = tk.TokenCache(cfg.data, 400).tokenizer_path
    assert tk.decode(train, path) == bytes(text_train).decode() and tk.decode(val, path) == bytes(text_val).decode()


def test_bytes_that_are_not_utf8_read_as_one_sub_each():
    assert tk.to_text(b"a\xffb\xc3") == "a\x1ab\x1a" and tk.to_text("é✓".encode()) == "é✓"
    assert tk.decode(np.frombuffer("é".encode(), np.uint8), "bytes") == "é"


def test_the_text_split_is_cut_between_characters(tmp_path):
    data = ("aé✓" * 50).encode()  # 1-, 2- and 3-byte characters
    path = _text_file(tmp_path, data.decode())
    moved = 0
    for k in range(1, 100):
        vf = k / 100
        cut = tk.text_cut(path, vf)
        assert tail_cut(len(data), vf) - 3 <= cut <= tail_cut(len(data), vf)
        data[:cut].decode()  # raises inside a character
        data[cut:].decode()
        moved += cut != tail_cut(len(data), vf)
        cfg = _on_text(tmp_path, data.decode(), f"--data.val_fraction={vf}")
        assert preflight.split_sizes(cfg)[:2] == (cut, len(data) - cut)
    assert moved > 10  # the cut fell inside a character, and moved


def test_the_bpe_never_sees_the_validation_text(tmp_path):
    """Training text of the letters a-m only, validation text of q, x, y, z only: a merge that
    holds any of those could only come from the validation split."""
    train_text = "".join(f"{'abc' * (i % 5 + 1)} {'defg' * (i % 3 + 1)} hijklm\n" for i in range(400))
    val_text = "qxqx zyzy xyz\n" * 200
    text = train_text + val_text
    cfg = _on_text(tmp_path, text, f"--data.val_fraction={(len(val_text) - 0.5) / len(text)}", vocab=320)
    train, val, _ = tk.load_tokens(cfg.data, 320)
    path = tk.TokenCache(cfg.data, 320).tokenizer_path
    assert tk.decode(val, path) == val_text and tk.decode(train, path) == train_text
    merged = [t for t in json.load(open(path))["model"]["vocab"] if len(t) > 1 and t != "<|endoftext|>"]
    assert any("abc" in t for t in merged)  # the training text was merged ...
    assert not [t for t in merged if set(t) & set("qxyz")]  # ... and nothing of the validation text
    assert len(val) == len(val_text)  # not one merge: a token a byte


# ---------------------------------------------------------------- the cache


def test_the_cache_is_reused(tmp_path, monkeypatch):
    cfg = _on_text(tmp_path)
    trained, encoded = _count_calls(monkeypatch, "train_bpe"), _count_calls(monkeypatch, "encode_to_file")
    first = tk.load_tokens(cfg.data, V)
    assert (len(trained), len(encoded)) == (1, 2)
    second = tk.load_tokens(cfg.data, V)
    assert (len(trained), len(encoded)) == (1, 2)  # nothing trained or encoded again
    assert isinstance(second[0], np.memmap) and second[2] == first[2]
    assert all(np.array_equal(a, b) for a, b in zip(first[:2], second[:2]))
    manifest = tk.TokenCache(cfg.data, V).manifest()
    assert manifest["tokens"] == {"train": len(first[0]), "val": len(first[1])} and manifest["dtype"] == "uint16"


def test_the_cache_key_follows_what_the_entry_depends_on(tmp_path):
    def keys(cfg, vocab=V):
        tk.load_tokens(cfg.data, vocab)
        cache = tk.TokenCache(cfg.data, vocab)
        return cache.tokenizer_path, cache._prefix()

    base = keys(_bpe(tmp_path, "--data.max_bytes=60000"))
    assert keys(_bpe(tmp_path, "--data.max_bytes=60000")) == base
    for other in (keys(_bpe(tmp_path, "--data.max_bytes=70000")), keys(_bpe(tmp_path, "--data.max_bytes=60000", vocab=V + 1), V + 1),
                  keys(_bpe(tmp_path, "--data.max_bytes=60000", "--data.val_fraction=0.2"))):
        assert other[0] != base[0] and other[1] != base[1]
    # the tokens' key follows the tokenizer's content, and a text file's size and time
    text_cfg = _on_text(tmp_path)
    path, prefix = keys(text_cfg)
    with open(path, "r+b") as f:  # the same vocabulary, another json: another entry of tokens
        f.seek(0, 2)
        f.write(b" ")
    assert tk.TokenCache(text_cfg.data, V)._prefix() != prefix
    st = os.stat(text_cfg.data.path)
    os.utime(text_cfg.data.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert keys(text_cfg)[0] != path


def test_writes_are_atomic(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    with tk.atomic_file(str(target)) as f:
        f.write(b"part")
        assert not target.exists()  # nothing under the final name while it is written
    assert target.read_bytes() == b"part"
    with pytest.raises(RuntimeError, match="crash"):
        with tk.atomic_file(str(target)) as f:
            f.write(b"other")
            raise RuntimeError("crash")
    assert target.read_bytes() == b"part" and os.listdir(tmp_path) == ["f.bin"]  # the old file, no temporary

    # an encoding that fails part of the way: several batches of the training split written, then
    # an error; the next build starts again and nothing half-written was ever read
    monkeypatch.setattr(tk, "CHUNK_BYTES", 500)
    monkeypatch.setattr(tk, "BATCH_BYTES", 1000)
    cfg = _on_text(tmp_path)
    cache, batches, written = tk.TokenCache(cfg.data, V), tk._batches, []

    def failing(docs, limit):
        for i, batch in enumerate(batches(docs, limit)):
            if i == 3:
                written.extend(os.path.getsize(os.path.join(cache.dir, n)) for n in os.listdir(cache.dir) if ".tmp-" in n)
                raise OSError("disk gone")
            yield batch

    monkeypatch.setattr(tk, "_batches", failing)
    with pytest.raises(OSError, match="disk gone"):
        tk.load_tokens(cfg.data, V)
    assert len(written) == 1 and written[0] > 0  # three batches of the training split were in the file
    left = sorted(os.listdir(cache.dir))
    assert left == [os.path.basename(cache.tokenizer_path)], left  # the trained BPE (written whole) only
    assert cache.manifest() is None
    (tmp_path / "cache" / (os.path.basename(cache._prefix()) + ".train.bin.tmp-1-dead")).write_bytes(b"\1" * 7)  # a kill -9
    monkeypatch.setattr(tk, "_batches", batches)
    train, val, _ = tk.load_tokens(cfg.data, V)
    assert tk.decode(train, cache.tokenizer_path) + tk.decode(val, cache.tokenizer_path) == CORPUS


# ---------------------------------------------------------------- preflight and the ranks' facts


def test_preflight_bounds_bpe_tokens_by_bytes_then_counts_the_cached_tokens(tmp_path):
    short = ["--data.seq_len=16", "--data.batch_size=4", "--data.val_fraction=0.5"]  # 65 tokens a shard
    cfg = _on_text(tmp_path, "the cat " * 12, *short)  # 48 bytes a split: too few for any tokenizer
    with pytest.raises(ConfigError, match=r"a rank's training shard holds at most 48 tokens \(the training split is "
                                          r"48 of the 96 bytes of .*, at most one data.tokenizer=bpe token a byte"):
        preflight.check_data(cfg, 1)
    assert not (tmp_path / "cache").exists()  # refused before any training or encoding
    cfg = _on_text(tmp_path, "the cat " * 40, *short)  # 160 bytes a split, fewer tokens once merged
    preflight.check_data(cfg, 1)  # not provably short before the encoding
    train, val, _ = tk.load_tokens(cfg.data, V)
    assert len(train) < 65 and len(val) < 65
    with pytest.raises(ConfigError, match=rf"training shard holds {len(train)} tokens \(the training split is "
                                          rf"{len(train)} of the {len(train) + len(val)} data.tokenizer=bpe tokens \(cached\) of the 320 "
                                          rf"bytes"):
        preflight.check_data(cfg, 1)
    with pytest.raises(ValueError, match="fewer than batch_size"):  # where the run itself would stop
        TokenStream(train, 16, 4, seed=0)


def test_ranks_compare_the_tokenizer():
    tokens = np.arange(1000, dtype=np.uint16)
    facts = [data_facts(tokens[:900], tokens[900:], sha) for sha in ("0123abcd", "4567ef01")]
    assert disagreement("data", facts) == "ranks disagree on the data: data.tokenizer is '0123abcd' on rank 0 but " \
                                          "'4567ef01' on rank 1"
    assert data_facts(tokens[:900], tokens[900:])["data.tokenizer"] == "bytes"


# ---------------------------------------------------------------- ranks: one builds, the others wait


def _build_on_two_ranks(rank: int, world_size: int, text_path: str, cache: str, not_a_dir: str) -> dict:
    """Rank r is local rank r of one node: rank 0 builds, rank 1 waits and reads; then a cache
    directory that cannot be made: every rank fails, in seconds."""
    trained = []
    train_bpe = tk.train_bpe
    tk.train_bpe = lambda *a: trained.append(a) or train_bpe(*a)
    out = {}
    args = ["--data.tokenizer=bpe", f"--model.vocab_size={V}", "--data.source=text", f"--data.path={text_path}"]
    train, val, sha = tk.load_tokens(load_config(args + [f"--data.cache_dir={cache}"], world_size).data, V, rank)
    out["ok"] = (np.asarray(train).tobytes(), np.asarray(val).tobytes(), sha, len(trained))
    start = time.perf_counter()
    try:
        tk.load_tokens(load_config(args + [f"--data.cache_dir={not_a_dir}"], world_size).data, V, rank)
    except ConfigError as err:
        out["failed"] = (str(err), time.perf_counter() - start)
    return out


def test_local_rank_0_builds_the_others_wait_and_fail_with_it(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    results = run_distributed(_build_on_two_ranks, 2, _text_file(tmp_path, CORPUS), str(tmp_path / "cache"),
                              str(not_a_dir), timeout_s=60.0)
    (train0, val0, sha0, trained0), (train1, val1, sha1, trained1) = results[0]["ok"], results[1]["ok"]
    assert (trained0, trained1) == (1, 0) and (train0, val0, sha0) == (train1, val1, sha1) and len(train0) > 0
    message0, seconds0 = results[0]["failed"]
    message1, seconds1 = results[1]["failed"]
    assert message0.startswith(f"data.cache_dir={not_a_dir}: cannot write there")
    assert message1 == "rank 0 (local rank 0 of its node) could not build the token cache: " + message0
    assert max(seconds0, seconds1) < 10


# ---------------------------------------------------------------- runs


def test_a_tiny_model_trains_on_bpe_tokens(tmp_path, capsys):
    vocab = 384
    hist = _run_inprocess(SMALL + ["--data.tokenizer=bpe", f"--model.vocab_size={vocab}", f"--data.cache_dir={tmp_path}/c",
                                   "--train.steps=3", f"--log.dir={tmp_path}"])
    assert sorted(hist["train_loss"]) == [1, 2, 3] and all(map(math.isfinite, hist["train_loss"].values()))
    assert hist["val_loss"][0] == pytest.approx(math.log(vocab), abs=0.1)  # near-uniform over the 384 tokens
    out = capsys.readouterr().out
    assert f"data.tokenizer=bpe ({tmp_path}/c/bpe-" in out and "built in" in out


def test_a_bytes_run_never_imports_tokenizers(tmp_path):
    code = ("import sys; from train.config import load_config; from train.preflight import check_data; "
            "import train.trainer; from train.tokenizer import load_tokens; "
            "cfg = load_config(['--data.max_bytes=100000']); check_data(cfg, 1); load_tokens(cfg.data, 256); "
            "print('tokenizers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
