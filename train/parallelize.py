"""The model's data-parallel form, chosen by ``parallel.data_parallel``.

``replicate``: every rank keeps whole parameters; :func:`parallel.sync_gradients` all-reduces the
gradients after the last backward of a step. ``fsdp``: :func:`parallel.fully_shard_moe` shards
every parameter and FSDP reduce-scatters the gradients during the backward. One process (no
torchrun) has nothing to shard or reduce: both modes are then the plain model.
"""

import torch
import torch.nn as nn

from parallel import fully_shard_moe, sync_gradients
from train.config import Config


def trains_in_bf16(cfg: Config, device: torch.device) -> bool:
    """``train.precision``: bf16, or auto on a GPU."""
    return cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")


def is_sharded(cfg: Config, dims) -> bool:
    return cfg.parallel.data_parallel == "fsdp" and dims is not None


def parallelize(model: nn.Module, cfg: Config, dims, device: torch.device) -> nn.Module:
    """Shard ``model`` (built with its expert-parallel dispatcher) when the config asks for FSDP.

    ``dims``: the run's :class:`~parallel.ParallelDims`, None for one process. Build the
    optimizer after this call.
    """
    if not is_sharded(cfg, dims):
        return model
    p = cfg.parallel
    bf16 = p.param_dtype == "bf16" or (p.param_dtype == "auto" and trains_in_bf16(cfg, device))
    return fully_shard_moe(
        model, list(model.blocks), dims,
        param_dtype=torch.bfloat16 if bf16 else torch.float32,
        reduce_dtype=torch.bfloat16 if p.reduce_dtype == "bf16" else torch.float32,
        reshard_after_forward=p.reshard_after_forward,
    )


def set_gradient_sync(model: nn.Module, cfg: Config, dims, enabled: bool) -> None:
    """FSDP: reduce-scatter in this backward (the step's last micro-batch) or keep accumulating
    the unsharded gradients locally (the others). Replicated parameters reduce once, in
    :func:`reduce_gradients`, so there is nothing to switch for them."""
    if is_sharded(cfg, dims):
        model.set_requires_gradient_sync(enabled)


def reduce_gradients(model: nn.Module, dims) -> None:
    """After the step's last backward: the all-reduce of every parameter FSDP does not manage
    (all of them when replicated; the routers, and the experts at EP = W, under FSDP, which has
    reduce-scattered the rest during the backward)."""
    if dims is not None:
        sync_gradients(model, dims)
