"""Train an MoE transformer with data × expert parallelism.

    torchrun --nproc_per_node=W train/train.py --config <name or path> [--section.key=value ...]
    torchrun --nproc_per_node=W -m train --config tiny                  # the same, as a module
    torchrun --standalone --nproc_per_node=2 train/train.py --config tiny   # the main job: CPU, EP 2
    python train/train.py --config tiny --parallel.ep=1       # one process, no torchrun

``--config`` takes a YAML file, or the name of a built-in config (train/configs/<name>.yaml,
shipped with the package; a clone's configs/ links to it, and configs/<name>.yaml not found in
the working directory is the built-in one too).

Before any process group starts, every rank checks the config (train/config.py: keys, types,
values, options the rest of the config ignores) and what it asks of this machine and its data
(train/preflight.py: config and data files, GPUs, the data's length, predicted GPU memory); a
problem is one line on stderr (printed by rank 0, and by the first process of every other node)
and exit status 2 on every rank.

Sections, in train/trainer.py's Trainer: config → distributed init → data → model → parallelize →
optimizer → (resume) → loop (forward, loss + aux losses, backward, grad sync, clip, step,
schedule) → log → checkpoint.
"""

import os
import signal
import sys
import time

if __package__ in (None, ""):  # run as a script: import the repo's packages, not train/'s files
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    sys.path.insert(0, _root)

from train.config import ConfigError, builtin_configs, help_text, load_config  # noqa: E402
from train.preflight import check_environment, start_line  # noqa: E402


def _prints() -> bool:
    """Whether this process prints a config error: rank 0 (or one process without torchrun), and
    under a multi-node torchrun the first process of every other node, whose console would show
    nothing else (a missing data file may be missing on that node only)."""
    return os.environ.get("RANK", "0") == "0" or os.environ.get("LOCAL_RANK", "0") == "0"


def main(argv: list[str]) -> dict:
    """One run from its command line; returns the trainer's history (train and val loss by step).
    Raises ConfigError, before any process group exists, for anything wrong with the config."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(argv, world_size)
    check_environment(cfg, world_size)
    if os.environ.get("RANK", "0") == "0":
        print(start_line(cfg, world_size), flush=True)
    from train.trainer import Trainer  # after the checks: a config error costs no trainer import

    trainer = Trainer(cfg, argv)
    history = trainer.fit()
    trainer.close()
    return history


def usage() -> str:
    """``--help``: this module's docstring and every config key with its default, type or choices,
    and meaning."""
    return (__doc__.strip() + "\n\nBuilt-in configs: " + ", ".join(builtin_configs()) + "\n\nConfig keys "
            "(--section.key=value on the command line, section: {key: value} in YAML; command line > YAML > "
            "default), with their defaults:\n\n" + help_text())


def cli(argv: list[str]) -> None:
    """The command line of ``train/train.py`` and ``python -m train``: ``--help`` prints every
    config key with its meaning; a config error is one line and exit status 2 (other exceptions
    keep their traceback)."""
    if {"-h", "--help"} & set(argv):
        if hasattr(signal, "SIGPIPE"):  # `--help | head`: end quietly, as other command-line tools do
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        print(usage())
        sys.exit(0)
    try:
        main(argv)
    except ConfigError as err:  # a bad key, value, file or device: one line naming it, no traceback
        printer = _prints()
        if printer:
            print(f"config error: {err}", file=sys.stderr, flush=True)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _exit_together(err, printer)
        sys.exit(2)


def _exit_together(err: ConfigError, printer: bool, linger_s: float = 3.0, grace_s: float = 10.0) -> None:
    """Under torchrun, every rank exits with status 2 and the error is printed once. torchrun stops
    every other rank (SIGTERM) as soon as one exits, so a rank that exited at once could stop rank 0
    before it printed, or a rank still checking its config (which then reads -15, not 2). So each
    rank exits with status 2 on that SIGTERM; the printing rank exits itself after ``linger_s``
    (the others have reached their error by then: they do the same work); any other rank waits
    for the SIGTERM, and if none comes within ``grace_s`` (rank 0 did not fail: the problem is
    this rank's own), prints the error naming its rank."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    time.sleep(linger_s if printer else grace_s)
    if not printer:
        print(f"config error (rank {os.environ.get('RANK')}): {err}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    cli(sys.argv[1:])
