"""The README's "Training on your own text or tokens": a text file trains byte-level, a flat
uint16 token file with its vocabulary size; a token id past the vocabulary is one error naming
the file and the size to set."""

import numpy as np
import pytest

from tests.test_train import SMALL, _run_inprocess
from train.config import ConfigError

BASE = [a for a in SMALL if not a.startswith("--data.max_bytes")] + ["--train.steps=3"]


def test_a_text_file_trains_byte_level(tmp_path):
    path = tmp_path / "my_corpus.txt"
    path.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * i}\n" for i in range(400)))
    hist = _run_inprocess(BASE + ["--data.source=text", f"--data.path={path}", f"--log.dir={tmp_path}"])
    assert sorted(hist["train_loss"]) == [1, 2, 3] and all(np.isfinite(list(hist["train_loss"].values())))


def test_a_token_file_trains_with_its_vocabulary_and_refuses_a_smaller_one(tmp_path):
    ids = np.random.default_rng(0).integers(0, 1000, 30_000)
    path = tmp_path / "my_corpus.u16"
    np.asarray(ids, dtype=np.uint16).tofile(path)  # what the README's snippet writes
    args = BASE + ["--data.source=tokens", f"--data.path={path}", "--data.token_dtype=uint16", f"--log.dir={tmp_path}"]
    with pytest.raises(ConfigError, match=rf"model\.vocab_size=256 but data\.path={path} holds token id 999: "
                                          r"set --model\.vocab_size=1000 or more"):
        _run_inprocess(args + ["--log.run_name=small_vocab"])
    hist = _run_inprocess(args + ["--model.vocab_size=1000", "--log.run_name=mine_tok"])
    assert sorted(hist["train_loss"]) == [1, 2, 3]
