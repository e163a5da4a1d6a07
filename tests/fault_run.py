"""``train/train.py`` with one injected fault, for tests/test_faults.py (run under torchrun).

``MOE_TEST_FAULT`` picks it (only the first launch of a torchrun job, restart count 0, is hit):
- ``kill:<rank>:<step>``: rank ``<rank>`` dies by SIGKILL as step ``<step>`` begins;
- ``stall:<rank>:<step>``: rank ``<rank>`` never joins step ``<step>``'s all-reduce of the loss, a
  collective every other rank issues (it sleeps instead, as a rank stuck in host code would).
"""

import os
import signal
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from train.runtime import Runtime  # noqa: E402
from train.train import cli  # noqa: E402
from train.trainer import Trainer  # noqa: E402


def inject(kind: str, rank: int, step: int) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or int(os.environ["RANK"]) != rank:
        return
    train_step, all_reduce_mean_ = Trainer.train_step, Runtime.all_reduce_mean_
    current = {"step": 0}

    def faulty_step(self):
        current["step"] = self.step + 1
        if kind == "kill" and current["step"] == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(self)

    def faulty_all_reduce(self, t):
        if kind == "stall" and current["step"] == step:
            time.sleep(3600)
        return all_reduce_mean_(self, t)

    Trainer.train_step, Runtime.all_reduce_mean_ = faulty_step, faulty_all_reduce


if __name__ == "__main__":
    fault = os.environ.get("MOE_TEST_FAULT")
    if fault:
        kind, rank, step = fault.split(":")
        inject(kind, int(rank), int(step))
    cli(sys.argv[1:])
