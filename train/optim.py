"""AdamW with dense and expert parameter groups, and the warmup + cosine learning-rate schedule."""

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from train.config import OptimConfig
from train.model import expert_parameter_names


def _by_placement(group: dict) -> list[dict]:
    """``group`` split by where its parameters live: plain tensors, and FSDP's DTensors per mesh.

    A fused or foreach AdamW step takes one group's tensors in one call, and DTensor refuses a
    call that mixes plain tensors and DTensors (measured on 2×H200: "aten._fused_adamw_.default:
    got mixed torch.Tensor and DTensor"), as it does DTensors of two meshes. Under FSDP the
    routers stay plain beside the sharded dense weights, so they get a group of their own.
    """
    parts: dict = {}
    for p in group["params"]:
        parts.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{**group, "params": params} for params in parts.values()]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """Three kinds of group, each with its ``base_lr``: ``dense`` (matrices, decayed),
    ``dense_no_decay`` (norm gains and biases), ``experts`` (this rank's expert weights,
    ``lr · expert_lr_mult``, ``expert_weight_decay``); each kind split by placement
    (:func:`_by_placement`)."""
    expert_names = expert_parameter_names(model)
    dense, no_decay, experts = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name in expert_names:
            experts.append(p)
        elif p.dim() < 2:
            no_decay.append(p)
        else:
            dense.append(p)
    expert_wd = cfg.weight_decay if cfg.expert_weight_decay is None else cfg.expert_weight_decay
    groups = [
        {"name": "dense", "params": dense, "weight_decay": cfg.weight_decay, "base_lr": cfg.lr},
        {"name": "dense_no_decay", "params": no_decay, "weight_decay": 0.0, "base_lr": cfg.lr},
        {"name": "experts", "params": experts, "weight_decay": expert_wd, "base_lr": cfg.lr * cfg.expert_lr_mult},
    ]
    groups = [part for g in groups for part in _by_placement(g)]
    for g in groups:
        g["lr"] = g["base_lr"]
    # fused: the foreach path allocates parameter-sized temporaries (a 6.9B-parameter model's
    # expert shard is 12.9 GB of fp32 per GPU at EP=2), and only the fused kernels skip a step
    # on the device (found_inf: train.nonfinite); CPU tensors have a fused kernel too
    return torch.optim.AdamW(groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


class WarmupCosine:
    """``lr(step) = base_lr · f(step)``: linear warmup ``(step + 1) / warmup`` over ``warmup``
    steps, then cosine from 1 down to ``min_ratio`` at ``total`` steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int, total: int, min_ratio: float):
        self.optimizer = optimizer
        self.warmup = warmup
        self.total = total
        self.min_ratio = min_ratio
        self.step_count = 0

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self) -> float:
        """Set every group's lr for the current step; return the dense lr."""
        f = self.factor(self.step_count)
        for g in self.optimizer.param_groups:
            g["lr"] = g["base_lr"] * f
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict:
        """The position only: warmup, total and min_ratio come from the config of the run that
        resumes (a resumed run may set a new ``train.steps``)."""
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
