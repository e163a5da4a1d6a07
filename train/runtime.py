"""Process layout of a run: torchrun's environment → device, process group, ParallelDims.

Launched without torchrun (no ``WORLD_SIZE``) the run is one process with no process group.
Under torchrun (``parallel.init_distributed``): NCCL when the device is a GPU
(``cuda:LOCAL_RANK``), gloo on a CPU.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel import P2PDispatcher, ParallelDims, flight, init_distributed
from train.preflight import uses_cuda


@dataclass
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    ep: int
    device: torch.device
    dims: ParallelDims | None  # None: a single process without a process group

    @property
    def distributed(self) -> bool:
        return self.dims is not None

    def barrier(self) -> None:
        if self.distributed:
            flight.record("barrier")
            dist.barrier()

    def all_reduce_mean(self, values: list[float]) -> list[float]:
        """Mean over the world of a few floats (one collective)."""
        return self.all_reduce_mean_(torch.tensor(values, dtype=torch.float64, device=self.device)).tolist()

    def all_reduce_mean_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` becomes its mean over the world, in place and on the device (no host sync)."""
        if self.distributed:
            flight.record(f"all_reduce of {t.numel()} scalars (loss, logged metrics)")
            dist.all_reduce(t)
            t.div_(self.world_size)
        return t

    def dispatcher(self, kind: str = "nccl", max_tokens: int = 0, num_buffers: int = 1, overlap_chunks: int = 1,
                   timeout_s: float = 600.0, capacity_factor: float | None = None, capacity_groups: int = 1,
                   nccl_sizes: str = "exact", p2p_copy: str = "kernels"):
        """The MoE layers' expert-parallel dispatcher, None for one process.

        With ep 1 over several ranks the dispatcher's group has one rank: rows stay local, but the
        load-balancing loss's inputs are still summed over the world, so its value and gradient
        are those of one process on the whole batch.

        kind ``"nccl"``: the all-to-all :class:`~parallel.AllToAllDispatcher`. ``"p2p"``: the
        :class:`~parallel.P2PDispatcher`, whose buffers hold ``max_tokens`` tokens per layer in
        ``num_buffers`` slots (one per MoE layer; with ``overlap_chunks`` N, N slots of a chunk's
        tokens each), whose kernels wait ``timeout_s`` for a peer before they fail
        (``parallel.timeout_s``, as the collectives), and sized by the MoE
        layers' ``capacity_factor`` and ``capacity_groups`` when they cap. ``overlap_chunks``: both
        dispatchers' pipelining of each layer's tokens (:meth:`parallel.ExpertParallelDispatcher.run_experts`).
        ``p2p_copy``: the P2P dispatcher's ``"kernels"`` or ``"copy_engine"`` row moves.
        ``nccl_sizes``: the nccl dispatcher's ``"exact"`` sizes (one host sync a layer) or
        ``"padded"`` blocks of ``max_tokens`` tokens (none; sized by the capacity as P2P's buffers).
        """
        if not self.distributed:
            return None
        if nccl_sizes not in ("exact", "padded"):
            raise ValueError(f"parallel.nccl_sizes: unknown {nccl_sizes!r} (exact | padded)")
        if p2p_copy not in ("kernels", "copy_engine"):
            raise ValueError(f"parallel.p2p_copy: unknown {p2p_copy!r} (kernels | copy_engine)")
        if self.ep == 1 or (kind == "nccl" and nccl_sizes == "exact"):
            return self.dims.dispatcher(overlap_chunks)
        if kind == "nccl":
            return self.dims.dispatcher(overlap_chunks, max_tokens, capacity_factor, capacity_groups)
        if kind != "p2p":
            raise ValueError(f"parallel.dispatcher: unknown kind {kind!r} (nccl | p2p)")
        if self.device.type != "cuda":
            raise RuntimeError(f"parallel.dispatcher=p2p needs CUDA GPUs, but this run is on {self.device}")
        # EP groups are consecutive ranks and torchrun starts as many on every node: each group
        # lies within one node iff ep divides the processes per node
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if per_node % self.ep:
            raise RuntimeError(f"parallel.dispatcher=p2p needs every EP group on one node: "
                               f"parallel.ep={self.ep} does not divide the {per_node} processes per node")
        return P2PDispatcher(self.dims.ep_group, self.dims.world_group, max_tokens=max_tokens, num_buffers=num_buffers,
                             timeout_s=timeout_s, capacity_factor=capacity_factor, capacity_groups=capacity_groups,
                             overlap_chunks=overlap_chunks, copy_engine=p2p_copy == "copy_engine")

    def shutdown(self) -> None:
        if self.distributed:
            dist.destroy_process_group()


def init_runtime(ep: int, device_choice: str = "auto", timeout_s: float = 600.0) -> Runtime:
    """The run's layout from torchrun's environment. ``timeout_s``: the collective watchdog's
    (:mod:`parallel.flight`); the process group's own timeout is that plus ``flight.GRACE_S``."""
    use_cuda = uses_cuda(device_choice)
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("parallel.device=cuda but no CUDA device is visible")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dims = None
    if "WORLD_SIZE" in os.environ:
        dims = ParallelDims(world_size, ep)  # validates before the group exists
    elif ep != 1:
        raise ValueError(f"parallel.ep={ep} needs {ep} or more processes: launch with torchrun")
    rank, world_size, device = init_distributed(backend="nccl" if use_cuda else "gloo", timeout_s=timeout_s + flight.GRACE_S)
    if not use_cuda:
        device = torch.device("cpu")
    if dims is not None:
        dims.build_mesh(device.type)
    return Runtime(rank, local_rank, world_size, ep, device, dims)
