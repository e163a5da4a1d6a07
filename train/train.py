"""Train an MoE transformer with data × expert parallelism.

    torchrun --nproc_per_node=W train/train.py --config configs/<name>.yaml [--section.key=value ...]
    torchrun --nproc_per_node=W -m train --config configs/<name>.yaml        # the same, as a module
    python train/train.py --config configs/tiny.yaml          # one process, no torchrun

Sections, in train/trainer.py's Trainer: config → distributed init → data → model → parallelize →
optimizer → (resume) → loop (forward, loss + aux losses, backward, grad sync, clip, step,
schedule) → log → checkpoint.
"""

import os
import sys

if __package__ in (None, ""):  # run as a script: import the repo's packages, not train/'s files
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    sys.path.insert(0, _root)

from train.config import Config, ConfigError, load_config, to_yaml  # noqa: E402
from train.trainer import Trainer  # noqa: E402


def main(argv: list[str]) -> dict:
    """One run from its command line; returns the trainer's history (train and val loss by step)."""
    cfg = load_config(argv)  # validated before any process group exists
    trainer = Trainer(cfg, argv)
    history = trainer.fit()
    trainer.close()
    return history


def cli(argv: list[str]) -> None:
    """The command line of ``train/train.py`` and ``python -m train``: ``--help`` prints every
    config key with its default; a config error is one line and exit status 2."""
    if {"-h", "--help"} & set(argv):
        print(__doc__.strip() + "\n\nEvery key of the config tree, with its default:\n\n" + to_yaml(Config()))
        sys.exit(0)
    try:
        main(argv)
    except ConfigError as err:  # a bad key or value: one line naming it, no traceback
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli(sys.argv[1:])
