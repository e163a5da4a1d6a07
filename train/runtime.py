"""Process layout of a run: torchrun's environment → device, process group, ParallelDims.

Launched without torchrun (no ``WORLD_SIZE``) the run is one process with no process group.
Under torchrun (``parallel.init_distributed``): NCCL when the device is a GPU
(``cuda:LOCAL_RANK``), gloo on a CPU.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel import ParallelDims, init_distributed


@dataclass
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    ep: int
    device: torch.device
    dims: ParallelDims | None  # None: a single process without a process group

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def distributed(self) -> bool:
        return self.dims is not None

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_mean(self, values: list[float]) -> list[float]:
        """Mean over the world of a few floats (one collective)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return (t / self.world_size).tolist()

    def dispatcher(self):
        return self.dims.dispatcher() if self.distributed and self.ep > 1 else None

    def shutdown(self) -> None:
        if self.distributed:
            dist.destroy_process_group()


def init_runtime(ep: int, device_choice: str = "auto") -> Runtime:
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("parallel.device=cuda but no CUDA device is visible")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dims = None
    if "WORLD_SIZE" in os.environ:
        dims = ParallelDims(world_size, ep)  # validates before the group exists
    elif ep != 1:
        raise ValueError(f"parallel.ep={ep} needs {ep} or more processes: launch with torchrun")
    rank, world_size, device = init_distributed(backend="nccl" if use_cuda else "gloo")
    if not use_cuda:
        device = torch.device("cpu")
    if dims is not None:
        dims.build_groups()
    return Runtime(rank, local_rank, world_size, ep, device, dims)
