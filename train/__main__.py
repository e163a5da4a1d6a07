"""``python -m train`` (and ``torchrun -m train``): the training script as a module."""

import sys

from train.train import cli

cli(sys.argv[1:])
