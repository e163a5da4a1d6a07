"""Training script: data, schedule, FLOPs, logging pieces, checkpoints, and real runs
(one process in-process; 2 and 4 processes and 2 "nodes" × 2 through torchrun with gloo)."""

import json
import math
import os
import socket
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from moe import moe_layers
from train import checkpoint as ckpt
from train.config import Config, ConfigError, apply_overrides, load_config
from train.data import TokenStream, shard, stdlib_corpus, stdlib_files, unigram_counts, val_batches
from train.flops import forward_flops_per_token
from train.model import MoETransformer, num_moe_blocks
from train.optim import WarmupCosine, build_optimizer
from train.runtime import Runtime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# small and fast: 2 layers, D 64, seq 32
SMALL = [
    "--config", os.path.join(REPO, "configs", "tiny.yaml"), "--model.dim=64", "--model.n_layers=2",
    "--moe.hidden_dim=64", "--data.seq_len=32", "--data.batch_size=4", "--data.val_batches=1",
    "--data.max_bytes=400000", "--log.every=1", "--train.eval_every=0", "--log.wandb_mode=disabled",
    "--log.progress=false", "--parallel.ep=1",
]
# the 2-rank EP-2 runs that resume (tests/conftest.py's ep2_uninterrupted): 6 steps, a checkpoint
# every 2 (steps 4 and 6 kept)
EP2_RUN = ["--train.steps=6", "--checkpoint.every=2", "--parallel.ep=2"]


def _metrics(run_dir: str) -> dict[int, dict]:
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            out.setdefault(rec["step"], {}).update(rec)
    return out


def _losses(run_dir: str) -> dict[int, float]:
    return {s: m["train/loss"] for s, m in _metrics(run_dir).items() if "train/loss" in m}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the training script runs the PyTorch paths on CPU
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _torchrun(nproc: int, args: list[str], timeout: int = 240, script: str = os.path.join(REPO, "train", "train.py"),
              launcher: list[str] | None = None, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun`` of ``script`` on ``nproc`` local processes; ``launcher``: its options (default:
    c10d rendezvous on a free port); ``env``: added to the environment; ``check``: exit 0."""
    launcher = launcher or ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{_free_port()}", "--nnodes=1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *launcher, script, *args]
    proc = subprocess.run(cmd, cwd=REPO, env={**_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout)
    assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _concurrently(*calls):
    """The results of the zero-argument ``calls`` (independent launches), run at once. On 2 cores
    two launches overlap what each spends on one core (the launcher's and the processes' imports,
    the rendezvous, the shutdown); the one that fails raises its own error here."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def _run_inprocess(args: list[str]) -> dict:
    from train.train import main

    return main(args)


# ---------------------------------------------------------------- data


def test_stdlib_split_is_a_rule_of_the_file_name():
    files = stdlib_files()
    assert files == sorted(files) and all(f.endswith(".py") for f in files)
    train, val = stdlib_corpus(300_000, 0.05)
    assert train.dtype == np.uint8 and len(train) + len(val) == 300_000
    # the files under the cap, assigned by crc32 of their relative path
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    total, expect_val = 0, 0
    for rel in files:
        if total >= 300_000:
            break
        n = min(os.path.getsize(os.path.join(root, rel)), 300_000 - total)
        total += n
        expect_val += n if zlib.crc32(rel.encode()) % 1000 < 50 else 0
    assert len(val) == expect_val > 0
    train2, val2 = stdlib_corpus(300_000, 0.05)
    assert np.array_equal(train, train2) and np.array_equal(val, val2)


def test_shards_partition_the_tokens():
    tokens = np.arange(103)
    parts = [shard(tokens, r, 4) for r in range(4)]
    assert np.array_equal(np.concatenate(parts), tokens)


def test_token_stream_targets_and_resume():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16)
    a = TokenStream(tokens, seq_len=16, batch_size=8, seed=3)
    x, y = a.next_batch()
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for _ in range(50):  # crosses an epoch boundary (312 windows / 8)
        a.next_batch()
    state = a.state_dict()
    b = TokenStream(tokens, seq_len=16, batch_size=8, seed=3)
    b.load_state_dict(state)
    for _ in range(5):
        xa, _ = a.next_batch()
        xb, _ = b.next_batch()
        assert torch.equal(xa, xb)
    assert state["epoch"] == 1


def test_token_file_and_text_sources(tmp_path):
    toks = (np.arange(4000) % 1000).astype(np.uint16)
    path = tmp_path / "toks.bin"
    toks.tofile(path)
    from train.data import load_splits

    train, val = load_splits("tokens", str(path), "uint16", 0, 0.1)
    assert isinstance(train, np.memmap) and len(train) == 3600 and np.array_equal(val, toks[3600:])
    (tmp_path / "t.txt").write_bytes(b"hello world " * 100)
    train, val = load_splits("text", str(tmp_path / "t.txt"), "uint16", 0, 0.5)
    assert bytes(train[:5]) == b"hello" and len(val) == 600


def test_val_batches_are_fixed():
    tokens = np.arange(2000) % 256
    a = val_batches(tokens, 16, 4, 3)
    b = val_batches(tokens, 16, 4, 3)
    assert len(a) == 3 and all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, b))


# ---------------------------------------------------------------- schedule, flops, logging


def test_warmup_cosine():
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.ones(1))], "base_lr": 1.0, "lr": 1.0}])
    s = WarmupCosine(opt, warmup=4, total=14, min_ratio=0.1)
    lrs = []
    for _ in range(16):
        lrs.append(s.apply())
        s.step()
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0) and lrs[9] == pytest.approx(0.55)
    assert lrs[14] == pytest.approx(0.1) and lrs[15] == pytest.approx(0.1)


def test_flops_formula_by_hand():
    cfg = apply_overrides(Config(), [
        "--model.dim=8", "--model.n_layers=2", "--model.n_heads=2", "--model.vocab_size=10",
        "--moe.num_experts=4", "--moe.top_k=2", "--moe.hidden_dim=3", "--moe.every_n_layers=2",
        "--model.dense_hidden_dim=5", "--data.seq_len=7",
    ])
    D, V, S, H, Hd = 8, 10, 7, 2, 4
    attn = 2 * D * 3 * H * Hd + 2 * H * Hd * D + 2 * 2 * H * Hd * (S + 1) / 2
    dense = 2 * D * 5 * 3
    moe = 2 * D * 4 + 2 * (2 * D * 3 * 3)
    assert forward_flops_per_token(cfg) == pytest.approx(2 * D * V + 2 * attn + dense + moe)


# ---------------------------------------------------------------- model options


def _model(*overrides, seed=0):
    model = MoETransformer(load_config(SMALL[2:] + list(overrides)))
    model.init_weights(seed)
    return model


def test_embedding_init_std():
    """model.embed_init_std sets the embedding's std (none: init_std, tied or not). Only the
    embedding changes: every other weight draws the same numbers."""
    tied, untied = _model(), _model("--model.tie_embeddings=false")
    chosen, large = (_model("--model.tie_embeddings=false", f"--model.embed_init_std={v}") for v in (0.3, 1.0))
    for model, want in ((tied, 0.02), (untied, 0.02), (chosen, 0.3), (large, 1.0)):
        assert float(model.embed.weight.detach().std()) == pytest.approx(want, rel=0.03)
    others = {n: p for n, p in untied.named_parameters() if n != "embed.weight"}
    for name, p in large.named_parameters():
        if name != "embed.weight":
            assert torch.equal(p, others[name]), name
    with pytest.raises(ConfigError, match="model.embed_init_std: must be > 0"):
        load_config(SMALL[2:] + ["--model.embed_init_std=0"])


def test_lm_head_bias_is_the_centred_log_unigram_and_enters_logits_and_loss():
    model = _model("--model.lm_head_bias=true", "--model.tie_embeddings=false")
    twin = _model("--model.tie_embeddings=false")  # the same weights (the bias draws no numbers), no bias
    assert torch.equal(model.lm_bias, torch.zeros(256))  # until the data sets it
    counts_V = torch.randint(0, 1000, (256,))
    counts_V[:3] = 0
    model.init_lm_bias(counts_V)
    logp_V = (counts_V.double() + 0.5).log()
    torch.testing.assert_close(model.lm_bias, (logp_V - logp_V.mean()).float())
    tokens_BS, targets_BS = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    logits_BSV, plain_BSV = model(tokens_BS), twin(tokens_BS)
    torch.testing.assert_close(logits_BSV - plain_BSV, model.lm_bias.detach().expand_as(plain_BSV))
    loss = model(tokens_BS, targets_BS)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten()))
    loss.backward()
    # d loss / d bias_v = mean over tokens of (softmax − onehot)_v
    probs_TV = logits_BSV.detach().flatten(0, 1).softmax(-1)
    want_V = (probs_TV - torch.nn.functional.one_hot(targets_BS.flatten(), 256)).mean(0)
    torch.testing.assert_close(model.lm_bias.grad, want_V)
    with pytest.raises(ValueError, match=r"init_lm_bias needs model.lm_head_bias and \(256,\) counts, got "
                                         r"lm_head_bias=False"):
        twin.init_lm_bias(counts_V)


def test_unigram_counts_whole_or_sampled():
    tokens = np.random.default_rng(0).integers(0, 300, 5000).astype(np.uint16)
    assert np.array_equal(unigram_counts(tokens, 300), np.bincount(tokens, minlength=300))
    assert np.array_equal(unigram_counts(tokens, 200)[:200], np.bincount(tokens, minlength=300)[:200])
    # above the sample: 64 evenly spaced blocks of sample / 64 tokens, the first and the last included
    sampled = unigram_counts(tokens, 300, sample=640)
    blocks = [tokens[s:s + 10] for s in np.linspace(0, len(tokens) - 10, 64).astype(np.int64)]
    assert sampled.sum() == 640 and np.array_equal(sampled, np.bincount(np.concatenate(blocks), minlength=300))


def test_lm_head_bias_starts_a_run_at_the_unigram_loss(tmp_path):
    """Set from the training split: the first step's loss is near the bytes' unigram entropy
    (about 4.3 nats for Python source), not log 256 = 5.55."""
    args = SMALL + ["--train.steps=1", f"--log.dir={tmp_path}", "--model.tie_embeddings=false"]
    plain = _run_inprocess(args + ["--log.run_name=plain"])["train_loss"][1]
    biased = _run_inprocess(args + ["--log.run_name=biased", "--model.lm_head_bias=true"])["train_loss"][1]
    assert plain > 5.3 and biased < 4.8, (plain, biased)


# ---------------------------------------------------------------- checkpoints


def _one_process():
    return Runtime(0, 0, 1, 1, torch.device("cpu"), None)


def _tiny_model(seed=0):
    cfg = load_config(SMALL[2:] + ["--moe.num_experts=4"])
    model = MoETransformer(cfg)
    model.init_weights(seed)
    opt = build_optimizer(model, cfg.optim)
    return cfg, model, opt, WarmupCosine(opt, 2, 10, 0.1)


def _one_step(model, opt):
    x = torch.randint(0, 256, (2, 16))
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_checkpoint_of_the_pre_dcp_format_is_one_clear_error(tmp_path):
    old = tmp_path / "ck" / "step_00000004"
    os.makedirs(old)
    (old / "dense.pt").write_bytes(b"")
    (old / "meta.json").write_text(json.dumps({"step": 4, "world_size": 2, "ep": 2}))
    _, model, opt, sched = _tiny_model()
    with pytest.raises(ValueError, match="pre-DCP format.*c43e526.*checkpoint.resume=none"):
        ckpt.Checkpointer(str(tmp_path / "ck"), _one_process()).restore("auto", model, opt, sched)


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_round_trip_and_crash_safety(tmp_path, async_save):
    cfg, model, opt, sched = _tiny_model()
    _one_step(model, opt)
    sched.step()
    d = str(tmp_path / "ck")
    saver = ckpt.Checkpointer(d, _one_process(), async_save=async_save)
    path = saver.save(1, model, opt, sched, {"epoch": 0, "cursor": 4})
    assert os.path.isdir(path + ".tmp") == async_save  # async: published by the next save or finish()
    saver.finish()
    assert os.path.basename(path) == "step_00000001" and open(os.path.join(d, "latest")).read().strip() == "step_00000001"
    # a crash mid-save: a .tmp directory and a directory without meta.json are never picked up
    os.makedirs(os.path.join(d, "step_00000009.tmp"))
    os.makedirs(os.path.join(d, "step_00000008"))
    os.remove(os.path.join(d, "latest"))

    _, model2, opt2, sched2 = _tiny_model(seed=1)
    info = ckpt.Checkpointer(d, _one_process()).restore("auto", model2, opt2, sched2)
    assert info == {"step": 1, "data": {"epoch": 0, "cursor": 4}, "exact": True, "path": path}
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    assert sched2.step_count == 1
    p1, p2 = dict(model.named_parameters()), dict(model2.named_parameters())
    for n in p1:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p1[n]][k], opt2.state[p2[n]][k]), (n, k)
    # both continue identically
    torch.manual_seed(5)
    _one_step(model, opt)
    torch.manual_seed(5)
    _one_step(model2, opt2)
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n


def test_checkpoint_keeps_the_newest(tmp_path):
    _, model, opt, sched = _tiny_model()
    d = str(tmp_path / "ck")
    saver = ckpt.Checkpointer(d, _one_process(), keep=2)
    for step in (1, 2, 3):
        saver.save(step, model, opt, sched, {"epoch": 0, "cursor": 0})
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(d)] == ["step_00000002", "step_00000003"]


@pytest.mark.parametrize("n_layers, every", [(4, 1), (4, 2), (5, 2), (4, 3), (2, 3)])
def test_num_moe_blocks_counts_the_models_moe_layers(n_layers, every):
    cfg = load_config(SMALL[2:] + [f"--model.n_layers={n_layers}", f"--moe.every_n_layers={every}", "--model.dim=32",
                                   "--moe.hidden_dim=16", "--model.dense_hidden_dim=16"])
    assert num_moe_blocks(cfg) == len(moe_layers(MoETransformer(cfg)))


def test_runtime_dispatcher_choice(monkeypatch):
    one = Runtime(0, 0, 1, 1, torch.device("cpu"), None)
    assert one.dispatcher("p2p", max_tokens=8, num_buffers=2) is None  # one process: the local path
    fake_dims = object()  # never reached: the checks come before any group is touched
    with pytest.raises(ValueError, match="parallel.nccl_sizes: unknown 'bogus'"):
        Runtime(0, 0, 2, 2, torch.device("cpu"), fake_dims).dispatcher("nccl", max_tokens=8, nccl_sizes="bogus")
    with pytest.raises(ValueError, match="parallel.p2p_copy: unknown 'dma'"):
        Runtime(0, 0, 2, 2, torch.device("cpu"), fake_dims).dispatcher("p2p", max_tokens=8, p2p_copy="dma")
    with pytest.raises(RuntimeError, match="parallel.dispatcher=p2p needs CUDA"):
        Runtime(0, 0, 2, 2, torch.device("cpu"), fake_dims).dispatcher("p2p", max_tokens=8, num_buffers=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # 2 nodes of 3 processes: rank 2's EP group spans both
    with pytest.raises(RuntimeError, match="every EP group on one node"):
        Runtime(0, 0, 6, 2, torch.device("cuda", 0), fake_dims).dispatcher("p2p", max_tokens=8, num_buffers=2)


# ---------------------------------------------------------------- runs


def test_single_process_resume_is_exact(tmp_path):
    base = SMALL + ["--train.steps=6", f"--log.dir={tmp_path}"]
    _run_inprocess(base + ["--log.run_name=full"])
    _run_inprocess(base + ["--log.run_name=part", "--checkpoint.stop_after=3"])
    assert sorted(_losses(str(tmp_path / "part"))) == [1, 2, 3]
    _run_inprocess(base + ["--log.run_name=part"])  # finds the newest checkpoint and resumes at 3
    full, part = _losses(str(tmp_path / "full")), _losses(str(tmp_path / "part"))
    assert sorted(full) == list(range(1, 7))
    assert part == full  # exact, every step


def test_training_collects_garbage_at_planned_steps_only(tmp_path, monkeypatch):
    # train.gc_every 2 over 5 steps: automatic collection off while training, a full collection
    # after steps 2 and 4 (after one at the start), back on at the end
    import gc

    import train.trainer

    collections, enabled = [], []
    real_collect, real_step = gc.collect, train.trainer.Trainer.train_step
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or real_collect(*a))

    def step(self):
        enabled.append(gc.isenabled())
        return real_step(self)

    monkeypatch.setattr(train.trainer.Trainer, "train_step", step)
    _run_inprocess(SMALL + ["--train.steps=5", "--train.gc_every=2", f"--log.dir={tmp_path}"])
    assert collections[-3:] == [(), (2,), (2,)] and enabled == [False] * 5 and gc.isenabled()
    collections.clear(), enabled.clear()
    _run_inprocess(SMALL + ["--train.steps=2", "--train.gc_every=0", f"--log.dir={tmp_path}", "--log.run_name=auto"])
    assert (2,) not in collections and enabled == [True] * 2


def test_a_training_step_leaves_no_tensors_in_reference_cycles(tmp_path, monkeypatch):
    # with the automatic collector off (train.gc_every), a tensor in a reference cycle would stay
    # allocated until the next planned collection: each step's cyclic garbage holds none
    import gc

    import train.trainer

    found, real_step = [], train.trainer.Trainer.train_step

    def step(self):
        out = real_step(self)
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            found.append([type(o).__name__ for o in gc.garbage if isinstance(o, torch.Tensor)])
        finally:
            gc.garbage.clear()
            gc.set_debug(0)
        return out

    monkeypatch.setattr(train.trainer.Trainer, "train_step", step)
    _run_inprocess(SMALL + ["--train.steps=3", "--train.grad_accum=2", f"--log.dir={tmp_path}"])
    assert found == [[], [], []]


def test_validation_loss_falls(tmp_path):
    hist = _run_inprocess(SMALL + ["--train.steps=40", "--train.eval_every=40", f"--log.dir={tmp_path}", "--optim.warmup_steps=5"])
    v = hist["val_loss"]
    assert v[40] < v[0] - 1.0, v
    from train.report import summarize, to_markdown

    summary = summarize(str(tmp_path / "tiny"), skip_steps=10)
    assert (summary["val_first"], summary["val_last"], summary["steps"]) == (v[0], v[40], 40)
    assert summary["windows"] == 30 and summary["info"]["world_size"] == 1
    assert f"{v[0]:.3f} → {v[40]:.3f}" in to_markdown([summary], "cmd", 10)


def test_token_file_run_and_vocab_check(tmp_path):
    toks = np.random.default_rng(0).integers(0, 300, 20000).astype(np.uint16)
    path = tmp_path / "toks.bin"
    toks.tofile(path)
    small = [a for a in SMALL if not a.startswith("--data.max_bytes")]  # a stdlib option: refused with tokens
    args = small + ["--train.steps=2", f"--log.dir={tmp_path}", "--data.source=tokens", f"--data.path={path}"]
    with pytest.raises(ValueError, match="model.vocab_size=256"):
        _run_inprocess(args)
    hist = _run_inprocess(args + ["--model.vocab_size=300"])
    assert sorted(hist["train_loss"]) == [1, 2]


def test_python_dash_m_train_is_the_script():
    """``python -m train`` runs the same command line: --help lists the config keys, a bad key
    is one line and exit status 2."""
    ok, bad = _concurrently(*(lambda args=args: subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, env=_env(),
                                                               capture_output=True, text=True, timeout=120)
                              for args in (["--help"], ["--moe.top_kk=2"])))
    assert ok.returncode == 0 and "moe:" in ok.stdout and "every_n_layers" in ok.stdout, ok.stderr[-2000:]
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [bad.stderr.strip()], bad.stderr[-2000:]
    assert "moe.top_kk" in bad.stderr


def test_wandb_offline_run_has_the_keys(tmp_path):
    pytest.importorskip("wandb")
    # a subprocess, as a user runs it (python train/train.py, world 1); in-process, pytest's
    # output capture keeps wandb's writer from recording the history
    cmd = [sys.executable, os.path.join(REPO, "train", "train.py"), *SMALL, "--train.steps=2", f"--log.dir={tmp_path}",
           "--log.wandb_mode=offline", "--log.heatmap_every=1"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".wandb")]
    assert len(runs) == 1
    data = open(runs[0], "rb").read()
    for key in ("train/loss", "val/loss", "perf/tokens_per_s", "train/skipped_steps", "train/grad_norm",
                "moe/layer0/dropped_fraction", "moe/layer1/tile_utilization", "moe/layer0/load_max",
                "moe/layer0/load_mean", "moe/layer1/aux_loss", "moe/layer1/z_loss",
                "moe/expert_load_heatmap", "moe/experts_table"):
        assert key.encode() in data, key


def test_config_error_fails_before_the_process_group(tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "train", "train.py"), *SMALL, "--moe.top_kk=2"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "moe.top_kk" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    [],
    # the routing-health options of configs/olmoe_bench.yaml: the LM-head bias is a root parameter
    # FSDP shards and DCP reslices; the centred router and the expert bias act per rank; and the
    # NCCL dispatcher's padded exchange (the bar's layout of issue #20), against the exact one of EP 1
    ["--model.tie_embeddings=false", "--model.embed_init_std=1.0", "--model.lm_head_bias=true",
     "--moe.router_centre=causal", "--moe.expert_bias=true", "--parallel.nccl_sizes=padded"],
], ids=["plain", "routing_options_padded"])
def test_two_process_ep2_and_resume_exact_and_into_ep1_replicated(tmp_path, options, ep2_uninterrupted):
    # the uninterrupted run (tests/conftest.py: 6 steps, a checkpoint every 2); the plain one is
    # shared with tests/test_faults.py's restart test, which proves its resume at EP 2 bit-exact
    full_dir, stdout = ep2_uninterrupted(options)
    padded = "--parallel.nccl_sizes=padded" in options
    # configs/tiny.yaml caps (capacity_factor 1.5): the padded exchange's rows follow it
    assert ("AllToAllDispatcher(ep_size=2, ep_rank=0, padded, max_tokens=128, capacity_factor=1.5, "
            "capacity_groups=1)" in stdout) == padded, stdout[-2000:]
    step4 = full_dir / "checkpoints" / "step_00000004"
    assert (step4 / ".metadata").is_file()  # a DCP checkpoint
    meta = json.loads((step4 / "meta.json").read_text())
    assert meta.pop("config")["parallel"]["ep"] == 2  # the run's config tree (what train.export reads)
    assert meta == {"format": "dcp-2", "step": 4, "world_size": 2, "ep": 2, "data_parallel": "fsdp",
                    "files": {n: ckpt.file_digest(str(step4 / n)) for n in (".metadata", "__0_0.distcp", "__1_0.distcp")}}
    base = SMALL + options + EP2_RUN + [f"--log.dir={tmp_path}", f"--checkpoint.resume={step4}"]
    # resume the EP-2 checkpoint into EP=1, replicated (DCP reslices experts and moments) ...
    ep1_base = [a for a in base if a != "--parallel.nccl_sizes=padded"]  # ignored at EP 1: an error
    runs = [lambda: _torchrun(2, ep1_base + ["--parallel.ep=1", "--parallel.data_parallel=replicate",
                                             "--log.run_name=ep1"])]
    if options:  # ... and continue EP=2 exactly (the plain run's: the restart test's resume at EP 2)
        runs.append(lambda: _torchrun(2, base + ["--log.run_name=resumed"]))
    _concurrently(*runs)
    full, ep1 = _losses(str(full_dir)), _losses(str(tmp_path / "ep1"))
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and sorted(ep1) == [5, 6]
    for s in ep1:  # same math, different reduction order
        assert ep1[s] == pytest.approx(full[s], rel=1e-4)
    if options:
        assert _losses(str(tmp_path / "resumed")) == {s: full[s] for s in (5, 6)}


@pytest.mark.slow
@pytest.mark.extended
def test_four_process_ep2_dp2_matches_ep1(tmp_path):
    base = SMALL + ["--train.steps=3", f"--log.dir={tmp_path}"]
    _torchrun(4, base + ["--parallel.ep=2", "--log.run_name=ep2"])
    _torchrun(4, base + ["--parallel.ep=1", "--log.run_name=ep1"])
    ep2, ep1 = _metrics(str(tmp_path / "ep2")), _metrics(str(tmp_path / "ep1"))
    assert sorted(k for k in ep2 if "train/loss" in ep2[k]) == [1, 2, 3]
    for s in (1, 2, 3):
        assert ep2[s]["train/loss"] == pytest.approx(ep1[s]["train/loss"], rel=1e-4)
        assert ep2[s]["train/grad_norm"] == pytest.approx(ep1[s]["train/grad_norm"], rel=1e-3)
        assert "perf/mfu" not in ep2[s]  # CPU: no peak to compare against
    # stats are over the world: 4 ranks · 4 · 32 tokens · K=2 / E=8 = 128 pairs routed per expert
    m = ep2[3]
    assert m["moe/layer0/load_mean"] == pytest.approx(128 * (1 - m["moe/layer0/dropped_fraction"]))


@pytest.mark.slow
def test_two_nodes_of_two_processes(tmp_path):
    port = _free_port()
    args = SMALL + ["--train.steps=2", "--parallel.ep=2", f"--log.dir={tmp_path}"]
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
               "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=twonodes",
               os.path.join(REPO, "train", "train.py"), *args]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    assert "world 4 (ep 2, edp 2)" in "".join(outs)
    assert sorted(_losses(str(tmp_path / "tiny"))) == [1, 2]


@pytest.mark.gpu
@pytest.mark.multigpu
def test_p2p_dispatcher_and_padded_nccl_train_like_nccl_on_two_gpus(tmp_path):
    # fp32 so that the transports differ only in summation order; grad_accum 2 and the
    # validation passes take the buffer slots round-robin across forwards with and without grad
    # (2 heads: the GPU attention kernel takes head dims 32/64/128, SMALL's 4 heads of 16 run only on CPU)
    base = SMALL + ["--model.n_heads=2", "--train.steps=4", "--train.grad_accum=2", "--train.precision=fp32",
                    "--parallel.ep=2", "--parallel.device=cuda", f"--log.dir={tmp_path}"]
    _torchrun(2, base + ["--parallel.dispatcher=nccl", "--log.run_name=nccl"])
    _torchrun(2, base + ["--parallel.nccl_sizes=padded", "--log.run_name=padded"])
    proc = _torchrun(2, base + ["--parallel.dispatcher=p2p", "--log.run_name=p2p"])
    # configs/tiny.yaml caps (capacity_factor 1.5): the buffers follow it
    assert "P2PDispatcher(ep_size=2, ep_rank=0, num_buffers=2, max_tokens=128, capacity_factor=1.5, capacity_groups=1)" \
        in proc.stdout
    nccl = _metrics(str(tmp_path / "nccl"))
    for other in (_metrics(str(tmp_path / "p2p")), _metrics(str(tmp_path / "padded"))):
        assert sorted(s for s in other if "train/loss" in other[s]) == [1, 2, 3, 4]
        for s in (1, 2, 3, 4):
            assert math.isfinite(other[s]["train/loss"])
            assert other[s]["train/loss"] == pytest.approx(nccl[s]["train/loss"], rel=1e-3)
        for s in (0, 4):
            assert other[s]["val/loss"] == pytest.approx(nccl[s]["val/loss"], rel=1e-3)


def test_nan_loss_stops_the_run_with_a_clear_error(tmp_path, monkeypatch):
    import train.model

    loss = train.model.linear_cross_entropy
    monkeypatch.setattr(train.model, "linear_cross_entropy", lambda *a, **k: loss(*a, **k) * float("nan"))
    with pytest.raises(FloatingPointError, match="step 1: the loss or the gradient norm is not finite; first non-finite "
                       "value: the loss, with every layer's output finite"):
        _run_inprocess(SMALL + ["--train.steps=2", f"--log.dir={tmp_path}"])
    assert not (tmp_path / "tiny" / "checkpoints" / "latest").exists()
