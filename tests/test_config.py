"""Config: YAML + CLI overrides (CLI > YAML > defaults), type checks, errors naming section.key."""

import glob
import os
import re
import typing

import pytest

from train.config import Config, ConfigError, coerce, apply_overrides, from_yaml, load_config, to_yaml, validate

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
