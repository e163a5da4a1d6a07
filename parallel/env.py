"""Process-group start-up from torchrun's environment."""

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes; return ``(rank, world_size, device)``.

    Reads RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR/PORT through ``env://``). Without them
    (a plain ``python`` run) nothing is initialised and it returns ``(0, 1, device)``.
    backend: default ``"nccl"`` when CUDA is available, else ``"gloo"``. With CUDA each process
    takes GPU LOCAL_RANK.
    """
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, device
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    backend = backend or ("nccl" if cuda else "gloo")
    dist.init_process_group(backend=backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device
