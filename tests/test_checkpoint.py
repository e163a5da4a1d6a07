"""DCP checkpoints reshard: saved under one layout, loaded under another, the run goes on the same.

A layout is (world size, EP size, data-parallel mode). The saving run trains the model of
``train.model`` for two steps, saves (model, AdamW state, schedule), and then records the next
step: the loss on a fixed batch, one more optimizer step, and the loss after it. A fresh model
(another seed) under another layout loads the checkpoint and records the same next step. Equal
losses before and after that step mean the parameters and the optimizer's moments were resliced
right (a moment put on the wrong expert, or a stale step count, moves the second loss).

Every layout sees the same global batch (each rank its slice) and routes dropless, so the math is
that of one process whatever the layout; only the reduction order differs.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe import moe_aux_loss
from parallel import ParallelDims, clip_grad_norm_
from tests.distributed import run_distributed
from tests.test_fsdp import Case, _config
from train.checkpoint import Checkpointer
from train.model import MoETransformer
from train.optim import WarmupCosine, build_optimizer
from train.parallelize import parallelize, reduce_gradients
from train.runtime import Runtime

GLOBAL_BATCH, SEQ = 4, 8
RELATIVE = 2e-5  # another layout: the same math in another reduction order (fp32)


def _batch(i: int) -> torch.Tensor:
    return torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + i))


class _Run:
    """The model, optimizer and schedule of one layout, on this rank."""

    def __init__(self, world: int, ep: int, data_parallel: str, seed: int):
        self.rank = dist.get_rank() if world > 1 else 0
        dims = ParallelDims(world, ep).build_mesh("cpu") if world > 1 else None
        self.rt = Runtime(self.rank, self.rank, world, ep, torch.device("cpu"), dims)
        self.cfg = _config(Case("checkpoint", ep=ep, data_parallel=data_parallel), world, ep,
                           GLOBAL_BATCH // world, 1, torch.device("cpu"))
        model = MoETransformer(self.cfg, dispatcher=self.rt.dispatcher()) if dims else MoETransformer(self.cfg)
        model.init_weights(seed)
        self.model = parallelize(model, self.cfg, dims, torch.device("cpu"))
        self.opt = build_optimizer(self.model, self.cfg.optim)
        self.schedule = WarmupCosine(self.opt, 1, 10, 0.1)

    def _loss(self, tokens: torch.Tensor) -> torch.Tensor:
        b = GLOBAL_BATCH // self.rt.world_size
        mine = tokens[self.rank * b:(self.rank + 1) * b]
        logits = self.model(mine[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten()) + moe_aux_loss(self.model)

    def _mean(self, loss: torch.Tensor) -> float:
        loss = loss.detach().clone()
        if self.rt.distributed:
            dist.all_reduce(loss)
        return float(loss) / self.rt.world_size

    def step(self, i: int) -> float:
        self.schedule.apply()
        loss = self._loss(_batch(i))
        loss.backward()
        reduce_gradients(self.model, self.rt.dims)
        clip_grad_norm_(self.model, self.cfg.optim.grad_clip, self.rt.dims)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.schedule.step()
        return self._mean(loss)

    def next_step(self) -> list[float]:
        """The loss of the next step's batch, that step, and the loss after it."""
        before = self.step(2)
        with torch.no_grad():
            after = self._mean(self._loss(_batch(3)))
        return [before, after]


def _save_then_continue(world: int, ep: int, data_parallel: str, path: str, async_save: bool) -> list[float]:
    run = _Run(world, ep, data_parallel, seed=3)
    run.step(0)
    run.step(1)
    saver = Checkpointer(path, run.rt, async_save=async_save, data_parallel=data_parallel)
    saved = saver.save(2, run.model, run.opt, run.schedule, {"epoch": 0, "cursor": 0})
    saver.finish()
    return [saved] + run.next_step()


def _load_then_continue(world: int, ep: int, data_parallel: str, saved: str) -> list[float]:
    run = _Run(world, ep, data_parallel, seed=11)
    info = Checkpointer(saved, run.rt).load(saved, run.model, run.opt, run.schedule)
    assert info["step"] == 2 and run.schedule.step_count == 2
    return run.next_step()


def _world2(rank, world, tmp):
    saved, *reference = _save_then_continue(2, 2, "replicate", f"{tmp}/a", async_save=True)
    return {"saved": saved, "reference": reference,
            "same_layout": _load_then_continue(2, 2, "replicate", saved),
            "ep1_fsdp": _load_then_continue(2, 1, "fsdp", saved)}


def _world4(rank, world, saved_a, tmp):
    saved, *reference = _save_then_continue(4, 4, "fsdp", f"{tmp}/b", async_save=False)
    return {"saved": saved, "reference": reference, "ep2_dp2_fsdp_from_a": _load_then_continue(4, 2, "fsdp", saved_a),
            "ep2_dp2_replicate_from_b": _load_then_continue(4, 2, "replicate", saved)}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dcp"))
    w2 = run_distributed(_world2, 2, tmp, timeout_s=120.0)
    w4 = run_distributed(_world4, 4, w2[0]["saved"], tmp, timeout_s=120.0)
    return w2, w4


def test_same_layout_resumes_bit_exact(layouts):
    w2, _ = layouts
    for rank in w2:
        assert rank["same_layout"] == rank["reference"]


def test_another_ep_size_world_size_and_data_parallel_mode(layouts):
    w2, w4 = layouts
    a, b = w2[0]["reference"], w4[0]["reference"]
    assert w2[0]["ep1_fsdp"] == pytest.approx(a, rel=RELATIVE)  # EP 2 → 1, replicate → fsdp
    assert w4[0]["ep2_dp2_fsdp_from_a"] == pytest.approx(a, rel=RELATIVE)  # world 2 → 4
    assert w4[0]["ep2_dp2_replicate_from_b"] == pytest.approx(b, rel=RELATIVE)  # EP 4 → 2, fsdp → replicate


def test_one_process_loads_a_sharded_checkpoint(layouts):
    _, w4 = layouts
    assert _load_then_continue(1, 1, "replicate", w4[0]["saved"]) == pytest.approx(w4[0]["reference"], rel=RELATIVE)
