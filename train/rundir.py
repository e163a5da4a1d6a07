"""What a run does with a run directory that already holds a run (``<log.dir>/<log.run_name>/``).

A second launch of the same command must neither overwrite the first run's files silently nor
die later in a checkpoint load. :func:`check_run_dir` decides before any process group starts,
from the files alone (every rank reads the same files and reaches the same verdict):

- no earlier run there (no ``metrics.jsonl`` or ``config.yaml``): start;
- ``log.overwrite=true``: start afresh; rank 0 removes the old run's files once the process
  group exists (:func:`clear_run_dir`), the checkpoints of a ``checkpoint.dir`` elsewhere too;
- a checkpoint to resume (``checkpoint.resume: auto`` and a complete checkpoint, or a checkpoint
  directory given) and the same model (every ``model.*`` and ``moe.*`` key as in the old run's
  ``config.yaml``): resume, naming the other keys that changed (an lr lowered after a divergence,
  more steps: legitimate);
- otherwise (nothing to resume, or another model): one :class:`~train.config.ConfigError` naming
  the reason and the two ways out, another ``--log.run_name`` or ``--log.overwrite=true``.

The keys that must match are the ones that shape the saved tensors: with another model the
checkpoint cannot load, and with ``checkpoint.resume: none`` the old files would be mixed with
the new run's. A checkpoint loaded from elsewhere (``checkpoint.resume=<dir>``) is checked tensor
by tensor when it loads (:meth:`train.checkpoint.Checkpointer.load`).
"""

import os
import shutil

import yaml

from train.checkpoint import list_checkpoints
from train.config import Config, ConfigError, flatten

RUN_FILES = ("metrics.jsonl", "config.yaml")  # a directory holding one of these holds a run
MODEL_SECTIONS = ("model", "moe")  # the keys a checkpoint's tensors depend on


def changed_keys(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """``(section.key, old value, new value)`` of every key that differs, in ``new``'s order."""
    old_flat, new_flat = flatten(old), flatten(new)
    return [(k, old_flat.get(k), v) for k, v in new_flat.items() if old_flat.get(k, v) != v]


def run_dir_of(cfg: Config) -> str:
    return os.path.join(cfg.log.dir, cfg.log.run_name)


def ckpt_dir_of(cfg: Config) -> str:
    return cfg.checkpoint.dir or os.path.join(run_dir_of(cfg), "checkpoints")


def check_run_dir(cfg: Config) -> str | None:
    """The verdict on ``cfg``'s run directory (module docstring): None to start afresh, or the
    one-line notice of a resume. Raises ConfigError when the run must not start."""
    run_dir = run_dir_of(cfg)
    if cfg.log.overwrite or not any(os.path.exists(os.path.join(run_dir, f)) for f in RUN_FILES):
        return None
    ways_out = "choose another --log.run_name, or pass --log.overwrite=true to replace it"
    explicit = cfg.checkpoint.resume not in ("auto", "none")
    found = list_checkpoints(ckpt_dir_of(cfg))
    if not explicit and (cfg.checkpoint.resume == "none" or not found):
        why = ("checkpoint.resume=none" if cfg.checkpoint.resume == "none"
               else f"no checkpoint to resume in {ckpt_dir_of(cfg)}" + ("" if cfg.checkpoint.every else
                                                                         " (checkpoint.every=0)"))
        raise ConfigError(f"log.run_name: {run_dir} already holds a run and {why}: {ways_out}")
    old_path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(old_path):
        return None
    with open(old_path) as f:
        old = yaml.safe_load(f) or {}
    changed = changed_keys(old, cfg.to_dict())
    model_changes = [c for c in changed if c[0].split(".")[0] in MODEL_SECTIONS]
    if model_changes:
        key, was, now = model_changes[0]
        raise ConfigError(f"{key}={now!r}, but the run in {run_dir} was trained with {key}={was!r}: its checkpoints "
                          f"do not fit this model; {ways_out}")
    others = [f"{k} {was!r} -> {now!r}" for k, was, now in changed if k.split(".")[0] not in ("log", "checkpoint")]
    return "changed since the run began: " + ", ".join(others) if others else None


def clear_run_dir(cfg: Config) -> None:
    """Remove the earlier run's files for ``log.overwrite=true`` (rank 0, before anything is
    written; the caller makes the other ranks wait)."""
    run_dir = run_dir_of(cfg)
    if os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
    if cfg.checkpoint.dir and os.path.isdir(cfg.checkpoint.dir):  # elsewhere: only what a run writes there
        for name in os.listdir(cfg.checkpoint.dir):
            path = os.path.join(cfg.checkpoint.dir, name)
            if name.startswith("step_") and os.path.isdir(path):
                shutil.rmtree(path)
            elif name == "latest":
                os.remove(path)
