"""Config: YAML + CLI overrides (CLI > YAML > defaults), type checks, errors naming section.key; every
config problem before the process group as one line and exit status 2, with the machine and data
checks of train/preflight.py; --help from the dataclasses; the built-in configs by name (issue #19)."""

import dataclasses
import glob
import os
import re
import subprocess
import sys
import typing

import numpy as np
import pytest
import torch

from train import preflight
from train.config import (CONFIG_DIR, Config, ConfigError, apply_overrides, builtin_configs, coerce, from_yaml,
                          load_config, resolve_config_path, to_yaml, type_text, validate)
from train.data import TokenStream, load_splits, shard, stdlib_corpus, val_batches
from train.train import cli, usage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_validate():
    cfg = validate(Config())
    assert cfg.model.dim == 128 and cfg.moe.capacity_factor is None and cfg.log.wandb_mode is None


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    path = _write(tmp_path, "model:\n  dim: 64\n  n_heads: 2\noptim:\n  lr: 1.0e-3\n", name="mine.yaml")
    cfg = load_config(["--config", path, "--optim.lr=5e-4", "--train.steps", "7"])
    assert cfg.model.dim == 64  # YAML over default
    assert cfg.model.n_heads == 2
    assert cfg.optim.lr == 5e-4  # CLI over YAML
    assert cfg.train.steps == 7  # "--key value" form
    assert cfg.model.n_layers == Config().model.n_layers  # default kept
    assert cfg.log.run_name == "mine"  # from the file's stem


@pytest.mark.parametrize(
    "override, key, value",
    [
        ("--moe.capacity_factor=null", ("moe", "capacity_factor"), None),
        ("--moe.capacity_factor=1.25", ("moe", "capacity_factor"), 1.25),
        ("--moe.capacity_factor=2", ("moe", "capacity_factor"), 2.0),  # int widens to float
        ("--model.tie_embeddings=false", ("model", "tie_embeddings"), False),
        ("--model.n_kv_heads=2", ("model", "n_kv_heads"), 2),
        ("--log.run_name=123", ("log", "run_name"), "123"),  # str stays str
        ("--log.wandb_mode=disabled", ("log", "wandb_mode"), "disabled"),
        ("--data.path=/x/y.bin", ("data", "path"), "/x/y.bin"),
    ],
)
def test_override_types(override, key, value):
    cfg = apply_overrides(Config(), [override])
    got = getattr(getattr(cfg, key[0]), key[1])
    assert got == value and type(got) is type(value)


def test_yaml_float_without_dot_is_accepted(tmp_path):
    # YAML 1.1 reads 3e-4 as a string; a float field takes it as the number it means
    cfg = from_yaml(_write(tmp_path, "optim:\n  lr: 3e-4\n"))
    assert cfg.optim.lr == 3e-4


@pytest.mark.parametrize(
    "text, needle",
    [
        ("model:\n  dimm: 3\n", "model.dimm"),
        ("modle:\n  dim: 3\n", "modle.dim"),
        ("model:\n  dim: 12.5\n", "model.dim"),
        ("model:\n  dim: true\n", "model.dim"),  # bool is not an int
        ("model:\n  tie_embeddings: 1\n", "model.tie_embeddings"),
        ("optim:\n  lr: fast\n", "optim.lr"),
        ("log:\n  run_name: 5\n", "log.run_name"),
        ("model: 3\n", "model"),
    ],
)
def test_yaml_errors_name_the_key(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        from_yaml(_write(tmp_path, text))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--train.stepz=3"], "train.stepz"),
        (["--nosection.x=3"], "nosection.x"),
        (["--train.steps=three"], "train.steps"),
        (["--model.tie_embeddings=maybe"], "model.tie_embeddings"),
        (["--train.steps"], "train.steps"),  # missing value
        (["train.steps=3"], "train.steps=3"),  # not an override
        (["--moe.drop_policy=random"], "moe.drop_policy"),
        (["--moe.top_k=9"], "moe.top_k"),
        (["--parallel.ep=3"], "parallel.ep"),  # 8 experts, world 1
        (["--model.n_heads=3"], "model.dim"),
        (["--data.source=tokens"], "data.path"),
        (["--log.wandb_mode=sometimes"], "log.wandb_mode"),
        (["--moe.capacity_factor=0"], "moe.capacity_factor"),  # MoEConfig's own check, named as a config key
        (["--moe.capacity_groups=3"], "moe.capacity_groups"),  # 8 · 128 tokens do not split in 3
        (["--parallel.dispatcher=gloo"], "parallel.dispatcher"),
        (["--parallel.dispatcher=p2p", "--parallel.device=cpu"], "parallel.dispatcher"),
        (["--parallel.dispatcher=p2p", "--log.time_comm=true"], "log.time_comm"),  # the timer sees NCCL calls only
        (["--train.gc_every=-1"], "train.gc_every"),
        (["--parallel.nccl_sizes=auto"], "parallel.nccl_sizes"),
    ],
)
def test_cli_errors_name_the_key(args, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(args, world_size=1)


def test_ep_must_divide_world():
    load_config(["--parallel.ep=2"], world_size=4)
    with pytest.raises(ConfigError, match=r"parallel\.ep=2 must divide the world size 3"):
        load_config(["--parallel.ep=2"], world_size=3)


def test_list_and_optional_coercion():
    assert coerce([1, 2], list[int], "k") == [1, 2]
    assert coerce([1, 2.5], list[float], "k") == [1.0, 2.5]
    assert coerce(None, list[int] | None, "k") is None
    with pytest.raises(ConfigError, match=r"k\[1\]"):
        coerce([1, "x"], list[int], "k")
    with pytest.raises(ConfigError, match="expected a list"):
        coerce(3, list[int], "k")


def test_round_trip_yaml(tmp_path):
    cfg = apply_overrides(Config(), ["--model.dim=96", "--moe.capacity_factor=1.5"])
    back = from_yaml(_write(tmp_path, to_yaml(cfg)))
    assert back == cfg


def test_dispatcher_key_from_yaml_and_cli(tmp_path):
    assert Config().parallel.dispatcher == "nccl"
    path = _write(tmp_path, "parallel:\n  ep: 2\n  dispatcher: p2p\n")
    assert load_config(["--config", path], world_size=2).parallel.dispatcher == "p2p"
    assert load_config(["--config", path, "--parallel.dispatcher=nccl"], world_size=2).parallel.dispatcher == "nccl"
    cfg = load_config(["--parallel.dispatcher=p2p", "--parallel.device=cuda"], world_size=1)
    assert from_yaml(_write(tmp_path, to_yaml(cfg), name="back.yaml")) == cfg


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))))
def test_shipped_configs_parse(path):
    cfg = from_yaml(path)
    validate(cfg, world_size=max(2, cfg.parallel.ep))


def test_none_is_a_value_of_a_plain_string_key():
    """``checkpoint.resume=none`` (a documented choice of a str key) stays the string; on an
    optional key ``none`` is the null."""
    cfg = load_config(["--checkpoint.resume=none", "--checkpoint.dir=none"])
    assert cfg.checkpoint.resume == "none" and cfg.checkpoint.dir is None


# every float option of the config tree (optional ones included) as section.key
FLOAT_KEYS = [f"{section}.{name}" for section, cls in typing.get_type_hints(Config).items()
              for name, tp in typing.get_type_hints(cls).items() if float in (tp, *typing.get_args(tp))]


def test_float_keys_cover_the_issue_cases():
    assert {"moe.aux_loss_coef", "moe.z_loss_coef", "moe.bias_update_rate", "moe.capacity_factor", "optim.lr"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_non_finite_floats_name_the_key(key, text):
    """No float option means NaN or ±inf (issue #18: NaN passed every ``>= 0`` check, and
    capacity_factor=inf failed only later, with an OverflowError)."""
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: must be a finite number, got {text}$"):
        load_config([f"--{key}={text}"])


@pytest.mark.parametrize("text, shown", [(".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf")])
def test_non_finite_yaml_floats_name_the_key(tmp_path, text, shown):
    with pytest.raises(ConfigError, match=rf"^moe\.capacity_factor: must be a finite number, got {shown}$"):
        from_yaml(_write(tmp_path, f"moe:\n  capacity_factor: {text}\n"))


# ---------------------------------------------------------------- issue #19: every config problem
# before the process group, one line, exit status 2; --help from the dataclasses; built-in configs

GPU_CONFIGS = ["small", "ep2", "ep2_p2p", "mixtral_bench", "olmoe_bench", "olmoe_ep4_dp2", "olmoe_ep8"]


@pytest.fixture
def one_process(monkeypatch):
    """No torchrun environment: one process, rank 0."""
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _token_file(tmp_path, n, name="toks.bin", dtype=np.uint16):
    path = tmp_path / name
    (np.arange(n) % 251).astype(dtype).tofile(path)
    return str(path)


def _cli_error(args, capsys) -> str:
    """``cli(args)`` must exit with status 2 and one line on stderr (nothing on stdout): that line."""
    with pytest.raises(SystemExit) as exit_:
        cli(args)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "", (exit_.value.code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), err
    return lines[0]


def _error_cases(tmp_path):
    short = _token_file(tmp_path, 3000)  # 2850 training tokens: 5 windows of 512 + 1
    bad_yaml = _write(tmp_path, "model:\n  dim: [1\n", name="broken.yaml")
    return {
        "unknown key": (["--config", "tiny", "--parallel.ep=1", "--moe.top_kk=2"], ["moe.top_kk"]),
        "wrong type": (["--train.steps=three"], ["train.steps", "three"]),
        "missing config file": (["--config", "nope.yaml"], ["--config nope.yaml: no such file", "tiny", "olmoe_bench"]),
        "broken YAML": (["--config", bad_yaml], ["broken.yaml: not valid YAML at line 3"]),
        "missing data file": (["--data.source=tokens", f"--data.path={tmp_path}/missing.bin"],
                              ["data.path=", "missing.bin: no such file"]),
        "seq_len too long": (["--data.source=tokens", f"--data.path={short}", "--model.vocab_size=300", "--data.seq_len=512"],
                             ["data.seq_len=512", "data.batch_size=8", "training shard holds 2,850 tokens", "5 windows"]),
        "ignored combination": (["--data.path=/x/y.bin"], ["data.path=/x/y.bin is ignored with data.source=stdlib"]),
        "ep without torchrun": (["--config", "tiny"], ["parallel.ep=2 must divide the world size 1", "--parallel.ep=1"]),
    }


@pytest.mark.parametrize("case", ["unknown key", "wrong type", "missing config file", "broken YAML", "missing data file",
                                  "seq_len too long", "ignored combination", "ep without torchrun"])
def test_each_config_error_is_one_line_and_exit_2(tmp_path, capsys, one_process, case):
    args, needles = _error_cases(tmp_path)[case]
    line = _cli_error(args + [f"--log.dir={tmp_path}/runs"], capsys)
    for needle in needles:
        assert needle in line, line
    assert not (tmp_path / "runs").exists()  # nothing was started


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("args", [["--parallel.device=cuda"], ["--config", "small"], ["--config", "configs/ep2.yaml", "--parallel.ep=1"]])
def test_cuda_config_without_a_gpu_is_one_line(capsys, one_process, args):
    line = _cli_error(args, capsys)
    assert "parallel.device=cuda but this machine has no CUDA GPU (torch.cuda.is_available() is False)" in line


def test_a_config_error_in_a_real_process_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "train", "--config", "nope.yaml"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and "no such file" in proc.stderr


@pytest.mark.slow
def test_torchrun_prints_a_config_error_once_and_every_rank_exits_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "train", "train.py"), "--config", "tiny", "--moe.top_kk=2", f"--log.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("config error: moe.top_kk: unknown key") == 1, out[-3000:]
    # torchrun's summary: every rank exited with status 2 (rank 1 waits for rank 0 to print first)
    codes = dict(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s*exitcode\s*: (-?\d+)", out))
    assert codes == {"0": "2", "1": "2"}, out[-3000:]
    ours = re.compile(r'File ".*/(train|moe|parallel|attention|kernel_floor)/[^"]*\.py"')
    assert not ours.search(out), out[-3000:]  # no traceback line of our code


# ---------------------------------------------------------------- options ignored in combination


@pytest.mark.parametrize("args, keys", [
    (["--data.path=/x/y.bin"], ("data.path", "data.source")),
    (["--data.token_dtype=uint32"], ("data.token_dtype", "data.source")),
    (["--data.source=text", "--data.path=/x.txt", "--data.token_dtype=uint32"], ("data.token_dtype", "data.source=text")),
    (["--data.source=tokens", "--data.path=/x.bin", "--data.max_bytes=1000"], ("data.max_bytes", "data.source=tokens")),
    (["--log.time_comm=true"], ("log.time_comm=true", "parallel.ep=1")),
    (["--parallel.nccl_sizes=padded"], ("parallel.nccl_sizes=padded", "parallel.ep=1")),
    (["--parallel.p2p_copy=copy_engine"], ("parallel.p2p_copy=copy_engine", "parallel.ep=1")),
])
def test_an_ignored_option_names_both_keys(args, keys):
    with pytest.raises(ConfigError) as err:
        load_config(args, world_size=1)
    assert all(k in str(err.value) for k in keys), str(err.value)


def test_cuda_graph_names_what_it_cannot_capture():
    with pytest.raises(ConfigError, match=r"^train\.cuda_graph=true needs a GPU, not parallel\.device=cpu$"):
        load_config(["--train.cuda_graph=true", "--parallel.device=cpu"], world_size=1)
    with pytest.raises(ConfigError, match=r"^train\.cuda_graph=true with parallel\.ep=2 and parallel\.dispatcher=nccl"):
        load_config(["--train.cuda_graph=true", "--parallel.ep=2", "--parallel.data_parallel=replicate"], world_size=2)
    assert load_config(["--train.cuda_graph=true", "--parallel.ep=2", "--parallel.dispatcher=p2p",
                        "--parallel.data_parallel=replicate"], world_size=2).train.cuda_graph
    with pytest.raises(ConfigError, match=r"^train\.cuda_graph=true with train\.precision=fp32: "):
        load_config(["--train.cuda_graph=true", "--train.precision=fp32"], world_size=1)
    with pytest.raises(ConfigError, match=r"^train\.cuda_graph=true with parallel\.data_parallel=fsdp on 2 processes"):
        load_config(["--train.cuda_graph=true", "--parallel.data_parallel=fsdp"], world_size=2)
    # one process without torchrun has nothing to shard (fsdp is then the plain model; under torchrun the
    # trainer refuses it); replicate on several
    assert load_config(["--train.cuda_graph=true", "--parallel.data_parallel=fsdp"], world_size=1).train.cuda_graph
    assert load_config(["--train.cuda_graph=true", "--parallel.data_parallel=replicate"], world_size=2).train.cuda_graph


def test_padded_nccl_sizes_are_the_nccl_dispatchers():
    with pytest.raises(ConfigError, match="parallel.nccl_sizes=padded is ignored with parallel.dispatcher=p2p"):
        load_config(["--parallel.ep=2", "--parallel.dispatcher=p2p", "--parallel.nccl_sizes=padded"], world_size=2)
    assert load_config(["--parallel.ep=2", "--parallel.nccl_sizes=padded"], world_size=2).parallel.nccl_sizes == "padded"
    with pytest.raises(ConfigError, match="parallel.overlap_chunks=2 and moe.capacity_factor=1.25"):
        load_config(["--parallel.ep=2", "--parallel.nccl_sizes=padded", "--parallel.overlap_chunks=2",
                     "--moe.capacity_factor=1.25"], world_size=2)


def test_p2p_copy_is_the_p2p_dispatchers():
    with pytest.raises(ConfigError, match="parallel.p2p_copy=copy_engine is ignored with parallel.dispatcher=nccl"):
        load_config(["--parallel.ep=2", "--parallel.p2p_copy=copy_engine"], world_size=2)
    with pytest.raises(ConfigError, match="parallel.p2p_copy"):
        load_config(["--parallel.ep=2", "--parallel.dispatcher=p2p", "--parallel.p2p_copy=engines"], world_size=2)
    cfg = load_config(["--parallel.ep=2", "--parallel.dispatcher=p2p", "--parallel.p2p_copy=copy_engine",
                       "--parallel.overlap_chunks=2"], world_size=2)
    assert (cfg.parallel.p2p_copy, cfg.parallel.overlap_chunks) == ("copy_engine", 2)
    with pytest.raises(ConfigError, match="parallel.dispatcher=p2p with parallel.overlap_chunks=2 and "
                                          "moe.capacity_factor=1.25: each chunk would hold"):
        load_config(["--parallel.ep=2", "--parallel.dispatcher=p2p", "--parallel.overlap_chunks=2",
                     "--moe.capacity_factor=1.25"], world_size=2)


def test_only_options_the_user_set_count_as_ignored(tmp_path):
    # a key written with its default (a saved run's config.yaml holds every key) is not "set"
    dumped = _write(tmp_path, to_yaml(load_config(["--data.source=tokens", "--data.path=/x.bin"])), name="saved.yaml")
    cfg = load_config(["--config", dumped])
    assert cfg.data.token_dtype == "uint16" and "data.token_dtype" in cfg.user_set and not cfg.is_set("data.token_dtype")
    cfg = load_config(["--config", _write(tmp_path, to_yaml(Config()))])  # max_bytes, path: null, time_comm: false
    assert cfg.user_set and [k for k in cfg.user_set if cfg.is_set(k)] == ["log.run_name"]  # null: the file's stem
    assert load_config(["--parallel.ep=2", "--log.time_comm=true"], world_size=2).log.time_comm
    assert load_config([]).user_set == set()


# ---------------------------------------------------------------- --help


def test_every_key_has_help():
    cfg = Config()
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            assert f.metadata.get("help", "").strip(), f"{section.name}.{f.name} has no help"


def test_help_lists_every_key_with_default_type_choices_and_meaning():
    text = usage()
    cfg = Config()
    for section in dataclasses.fields(cfg):
        assert f"\n{section.name}:  " in text, section.name
        values = getattr(cfg, section.name)
        hints = typing.get_type_hints(type(values))
        for f in dataclasses.fields(values):
            line = next(line for line in text.splitlines() if line.startswith(f"  --{section.name}.{f.name}="))
            assert f"({type_text(hints[f.name])}) {f.metadata['help']}" in line, line
            if typing.get_origin(hints[f.name]) is typing.Literal:
                assert "(" + "|".join(typing.get_args(hints[f.name])) + ")" in line, line
    assert "  --moe.top_k=2  (int) K, experts per token, 1 <= K <= E" in text
    assert "  --parallel.device=auto  (auto|cpu|cuda) " in text
    assert "  --log.wandb_mode=none  (online|offline|disabled or none) " in text
    assert "  --moe.capacity_factor=none  (float or none) " in text
    assert ", ".join(builtin_configs()) in text


def test_help_exits_0_in_a_real_process():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "train", "train.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--moe.drop_policy=probs  (probs|position)" in proc.stdout, proc.stderr[-2000:]


# ---------------------------------------------------------------- built-in configs


def test_configs_dir_is_a_link_to_the_packaged_configs():
    link = os.path.join(REPO, "configs")
    assert os.path.islink(link) and os.path.realpath(link) == os.path.realpath(CONFIG_DIR)
    assert CONFIG_DIR == os.path.join(REPO, "train", "configs")
    assert set(builtin_configs()) >= {"tiny", *GPU_CONFIGS}


@pytest.mark.parametrize("spelling", ["tiny", "tiny.yaml", "configs/tiny.yaml", "./configs/tiny.yaml"])
def test_config_by_name_resolves_from_any_directory(tmp_path, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the packaged file
    assert resolve_config_path(spelling) == os.path.join(CONFIG_DIR, "tiny.yaml")
    cfg = load_config(["--config", spelling], world_size=2)
    assert cfg == load_config(["--config", os.path.join(REPO, "configs", "tiny.yaml")], world_size=2)
    assert cfg.log.run_name == "tiny"


def test_a_file_in_the_working_directory_wins_over_a_builtin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("configs")
    _write(tmp_path / "configs", "model:\n  dim: 64\n  n_heads: 2\n", name="tiny.yaml")
    assert resolve_config_path("configs/tiny.yaml") == "configs/tiny.yaml"
    assert load_config(["--config", "configs/tiny.yaml"]).model.dim == 64


def test_tiny_is_expert_parallel_on_cpu_and_the_gpu_configs_say_cuda():
    tiny = from_yaml(os.path.join(CONFIG_DIR, "tiny.yaml"))
    assert tiny.parallel.ep == 2 and tiny.parallel.device == "auto" and tiny.parallel.dispatcher == "nccl"
    assert "--nproc_per_node=2" in open(os.path.join(CONFIG_DIR, "tiny.yaml")).read()
    for name in GPU_CONFIGS:
        assert from_yaml(os.path.join(CONFIG_DIR, f"{name}.yaml")).parallel.device == "cuda", name


# ---------------------------------------------------------------- preflight: data and memory


def test_stdlib_split_sizes_are_the_corpus_lengths():
    cfg = load_config(["--data.max_bytes=300000"])
    n_train, n_val, _ = preflight.split_sizes(cfg)
    train, val = stdlib_corpus(300_000, cfg.data.val_fraction)
    assert (n_train, n_val) == (len(train), len(val))


@pytest.mark.parametrize("vf, first_short", [(0.5, "training"), (0.25, "validation")])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_data_check_is_exactly_where_the_data_module_fails(tmp_path, world, vf, first_short):
    """Around the boundary, the check passes exactly when every rank's shard of each split (as
    train.data cuts them) holds one batch of windows: TokenStream takes the training shard and the
    validation set gets B distinct windows; otherwise it names the split that falls short."""
    S, B = 16, 4
    need = B * S + 1
    args = [f"--data.seq_len={S}", f"--data.batch_size={B}", f"--data.val_fraction={vf}", "--data.source=tokens",
            "--model.vocab_size=300", "--parallel.data_parallel=replicate"]
    outcomes = set()
    edge = round(need * world / min(vf, 1 - vf))  # the smaller split holds `need` tokens per rank
    for n in range(edge - 8 * world, edge + 4 * world):
        cfg = load_config(args + [f"--data.path={_token_file(tmp_path, n, name=f'{n}.bin')}"], world_size=world)
        train, val = load_splits("tokens", cfg.data.path, "uint16", 0, vf)
        short = [split for split, tokens in (("training", train), ("validation", val))
                 if any(len(shard(tokens, r, world)) < need for r in range(world))]
        if not short:
            preflight.check_data(cfg, world)
            for r in range(world):
                TokenStream(shard(train, r, world), S, B, seed=0, rank=r)
                assert len(val_batches(shard(val, r, world), S, B, 1)[0][0].unique(dim=0)) == B
        else:
            tokens = train if short[0] == "training" else val
            fewest = min(len(shard(tokens, r, world)) for r in range(world))
            with pytest.raises(ConfigError, match=f"a rank's {short[0]} shard holds {fewest} tokens"):
                preflight.check_data(cfg, world)
            if short[0] == "training":
                with pytest.raises(ValueError, match="fewer than batch_size"):
                    TokenStream(shard(train, 0, world), S, B, seed=0)  # rank 0's shard is the smallest
        outcomes.add(tuple(short))
    assert () in outcomes and any(o and o[0] == first_short for o in outcomes), outcomes


def test_a_token_file_of_the_wrong_dtype_is_named(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00" * 1001)
    cfg = load_config(["--data.source=tokens", f"--data.path={path}"])
    with pytest.raises(ConfigError, match=r"1,001 bytes is not a whole number of data\.token_dtype=uint16 tokens"):
        preflight.check_data(cfg, 1)


class _FakeGPU:
    def __init__(self, gib):
        self.total_memory, self.name = int(gib * 2**30), f"fake {gib} GiB GPU"


@pytest.mark.parametrize("gib, refused", [(40, True), (141, False)])
def test_predicted_memory_beyond_the_gpu_is_refused(monkeypatch, gib, refused):
    """olmoe_bench at EP 2, fsdp: train/memory.py predicts about 68 GiB per GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _FakeGPU(gib))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = load_config(["--config", "olmoe_bench"], world_size=2)
    if refused:
        with pytest.raises(ConfigError, match=r"train\.memory_check: train/memory\.py predicts a peak of 6\d\.\d GiB "
                                              r"per GPU \(fsdp, activation checkpointing none"):
            preflight.check_environment(cfg, 2)
        cfg.train.memory_check = False
    preflight.check_environment(cfg, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="torchrun starts 4 processes on this node but it has 2 visible GPUs"):
        preflight.check_environment(cfg, 2)


def test_start_line_says_what_comes_first():
    cfg = load_config(["--config", "tiny", "--data.seq_len=16384"], world_size=2)
    line = preflight.start_line(cfg, 2)
    assert line.startswith("config tiny: checked | world 2 (ep 2) on ")
    assert "1·8·16384 = 131,072 tokens" in line and "TFLOP a step" in line and "train 200 steps" in line
    assert "BENCHMARK ONLY" not in line
    forced = load_config(["--config", "tiny", "--moe.force_balance=true"], world_size=2)
    assert preflight.start_line(forced, 2).endswith("| moe.force_balance: BENCHMARK ONLY, the experts are chosen at random")
