"""Ranks agree before work starts: one error, the same on every rank, naming the first differing
key and both values, within seconds (issue #18's desynchronised ranks)."""

import functools
import os
import shutil
import tempfile
import time

import numpy as np
import pytest
import torch.distributed as dist

from tests.distributed import run_distributed
from train import agreement
from train.agreement import check_ranks_agree, config_facts, data_facts, disagreement, source_sha
from train.config import Config, ConfigError, load_config

# rank 1's command line per case (rank 0 runs the defaults); each differing key with rank 0's
# value and rank 1's
CONFIG_CASES = {
    "model.n_layers": (["--model.n_layers=3"], 2, 3),
    "train.seed": (["--train.seed=1"], 0, 1),
    "moe.top_k": (["--moe.top_k=1"], 2, 1),
    "data.seq_len": (["--data.seq_len=64"], 128, 64),
}


def _edited_library(root: str) -> str:
    """A copy of the library's sources under ``root`` with one comment added: a node whose
    checkout differs."""
    for package in agreement.LIBRARY_PACKAGES:
        shutil.copytree(os.path.join(agreement.LIBRARY_ROOT, package), os.path.join(root, package),
                        ignore=shutil.ignore_patterns("__pycache__"))
    with open(os.path.join(root, "moe", "config.py"), "a") as f:
        f.write("# edited on this node only\n")
    return root


def _timed_check(what: str, facts: dict) -> tuple[str | None, float]:
    start = time.perf_counter()
    try:
        check_ranks_agree(what, facts)
        message = None
    except ConfigError as err:
        message = str(err)
    return message, time.perf_counter() - start


def _check_cases(rank: int, world_size: int) -> dict:
    """Every case, one after the other in one process group: each check is one collective that
    every rank passes or fails alike, so the ranks stay in step across the failures."""
    out = {"same": _timed_check("config", config_facts(load_config([], world_size)))}
    for name, (overrides, _, _) in CONFIG_CASES.items():
        out[name] = _timed_check("config", config_facts(load_config(overrides if rank == 1 else [], world_size)))
    out["two keys"] = _timed_check(
        "config", config_facts(load_config(["--model.n_layers=3", "--moe.top_k=1"] if rank == 1 else [], world_size)))
    with tempfile.TemporaryDirectory() as tmp:
        if rank == 1:
            agreement.code_facts.cache_clear()
            agreement.source_sha = functools.partial(source_sha, _edited_library(tmp))
        out["code.sha"] = _timed_check("config", config_facts(load_config([], world_size)))
    tokens = np.arange(100_000, dtype=np.uint16) % 256
    if rank == 1:
        tokens[0] = 7  # the first sampled window
    out["data"] = _timed_check("data", data_facts(tokens[:90_000], tokens[90_000:]))
    return out


@pytest.fixture(scope="module")
def two_ranks() -> tuple[list[dict], float]:
    start = time.perf_counter()
    results = run_distributed(_check_cases, 2, timeout_s=30.0)
    return results, time.perf_counter() - start


def test_the_same_config_passes(two_ranks):
    results, _ = two_ranks
    assert [r["same"][0] for r in results] == [None, None]


@pytest.mark.parametrize("key", list(CONFIG_CASES))
def test_a_differing_key_stops_every_rank_with_one_message(two_ranks, key):
    results, wall_s = two_ranks
    _, on_rank0, on_rank1 = CONFIG_CASES[key]
    expected = f"ranks disagree on the config: {key} is {on_rank0!r} on rank 0 but {on_rank1!r} on rank 1"
    assert [r[key][0] for r in results] == [expected, expected]
    # the bar is one error within 30 s: the check itself is one collective, and the
    # whole two-process run (start-up, imports, every case) stays inside the bar too
    assert max(r[key][1] for r in results) < 5.0
    assert wall_s < 30.0


def test_the_message_counts_the_other_differing_keys(two_ranks):
    results, _ = two_ranks
    expected = "ranks disagree on the config: model.n_layers is 2 on rank 0 but 3 on rank 1 (and 1 more key differs)"
    assert [r["two keys"][0] for r in results] == [expected, expected]


def test_a_differing_checkout_is_named(two_ranks):
    results, _ = two_ranks
    message = results[0]["code.sha"][0]
    assert message is not None and message.startswith("ranks disagree on the config: code.sha is '")
    assert results[1]["code.sha"][0] == message


def test_differing_data_is_named(two_ranks):
    results, _ = two_ranks
    message = results[0]["data"][0]
    assert message is not None and message.startswith("ranks disagree on the data: data.train_crc32 is ")
    assert results[1]["data"][0] == message


def test_no_process_group_is_a_no_op():
    assert not dist.is_initialized()
    check_ranks_agree("config", config_facts(Config()))


def test_disagreement_names_the_lowest_differing_rank_and_missing_keys():
    ranks = [{"a": 1, "b": 2}, {"a": 1, "b": 2}, {"a": 1, "b": 5, "c": 0}, {"a": 1}]
    assert disagreement("x", ranks) == "ranks disagree on the x: b is 2 on rank 0 but 5 on rank 2 (and 1 more key differs)"
    assert disagreement("x", [{"a": 1}, {"a": 1, "c": "s"}]) == "ranks disagree on the x: c is missing on rank 0 but 's' on rank 1"
    assert disagreement("x", [{"a": 1}] * 3) is None


def test_config_facts_flatten_the_config_and_add_the_code_version():
    facts = config_facts(load_config(["--model.n_layers=3"]))
    assert facts["model.n_layers"] == 3 and facts["moe.top_k"] == 2 and facts["parallel.ep"] == 1
    assert not agreement.RANK_ZERO_ONLY & facts.keys()
    assert {"code.sha", "code.torch", "code.triton"} <= facts.keys()
    assert len(facts) == sum(len(values) for values in Config().to_dict().values()) - len(agreement.RANK_ZERO_ONLY) + 3


def test_source_sha_follows_the_library_sources(tmp_path):
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "a.py").write_text("x = 1\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "b.py").write_text("y = 1\n")
    sha = source_sha(str(tmp_path))
    assert len(sha) == 16 and sha == source_sha(str(tmp_path))
    (tmp_path / "other" / "b.py").write_text("y = 2\n")  # not a library package
    (tmp_path / "moe" / "notes.txt").write_text("z")  # not a source file
    assert source_sha(str(tmp_path)) == sha
    (tmp_path / "moe" / "a.py").rename(tmp_path / "moe" / "c.py")  # same bytes, another module
    assert source_sha(str(tmp_path)) != sha


def test_data_facts():
    tokens = np.arange(50_000, dtype=np.uint16)
    facts = data_facts(tokens[:45_000], tokens[45_000:])
    assert facts["data.train_tokens"] == 45_000 and facts["data.val_tokens"] == 5_000
    assert data_facts(tokens[:45_000].copy(), tokens[45_000:].copy()) == facts
    edited = tokens.copy()
    edited[-1] += 1  # the last token is in the last sampled window
    assert data_facts(edited[:45_000], edited[45_000:])["data.val_crc32"] != facts["data.val_crc32"]
    short = data_facts(np.arange(10, dtype=np.uint16), tokens[:0])  # shorter than one window; empty
    assert short["data.train_tokens"] == 10 and short["data.val_tokens"] == 0
