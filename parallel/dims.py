"""ParallelDims: the data-parallel × expert-parallel layout of the world, as one DeviceMesh.

World = W ranks, all data-parallel (each reads its own shard). The experts of a layer are split
over an expert-parallel (EP) group of ``ep`` consecutive ranks: ranks ``[g·ep, (g+1)·ep)`` form
EP group g, and EP rank i holds experts ``[i·L, (i+1)·L)`` with ``L = E / ep``. The ``edp = W / ep``
ranks that hold the same expert shard (same ``rank % ep``) form its expert-data-parallel (EDP)
group, over which that shard's gradients are reduced.

Example, W = 4, ep = 2: EP groups [0, 1] and [2, 3]; EDP groups [0, 2] and [1, 3].
"""

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.dispatcher import AllToAllDispatcher


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"ParallelDims: {name} must be an int >= {minimum}, got {value!r}")


class ParallelDims:
    """Validated ``world_size = edp · ep`` layout; builds the device mesh once.

    Args:
        world_size: W, all ranks (every one data-parallel).
        ep: expert-parallel size (P); must divide W (and, per layer, the expert count: see
            :meth:`check_experts`).

    The constructor only validates (no communication), so a bad layout fails before any
    process group exists. :meth:`build_mesh` is a collective: every rank calls it once, after
    ``torch.distributed.init_process_group``; the groups of the dispatchers, the gradient
    reductions and FSDP all come from that one mesh.
    """

    def __init__(self, world_size: int, ep: int = 1):
        _check_int("world_size", world_size, 1)
        _check_int("ep", ep, 1)
        if world_size % ep:
            raise ValueError(f"ParallelDims: ep={ep} must divide world_size={world_size}")
        self.world_size = world_size
        self.ep = ep
        self.edp = world_size // ep
        self._mesh = None

    def __repr__(self) -> str:
        return f"ParallelDims(world_size={self.world_size}, ep={self.ep}, edp={self.edp})"

    def check_experts(self, num_experts: int) -> int:
        """Raise unless ``ep`` divides ``num_experts``; return L, the experts held per rank."""
        _check_int("num_experts", num_experts, 1)
        if num_experts % self.ep:
            raise ValueError(
                f"ParallelDims: num_experts={num_experts} is not a multiple of ep={self.ep}; "
                f"every EP rank must hold the same number of experts"
            )
        return num_experts // self.ep

    def ep_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s expert-parallel group (consecutive, in EP-rank order)."""
        start = rank // self.ep * self.ep
        return list(range(start, start + self.ep))

    def edp_ranks(self, rank: int) -> list[int]:
        """Global ranks holding the same expert shard as ``rank``."""
        return list(range(rank % self.ep, self.world_size, self.ep))

    def build_mesh(self, device_type: str = "cpu") -> "ParallelDims":
        """Build the one :class:`DeviceMesh` of the run (collective; call once on every rank).

        The mesh is ``arange(W).view(edp, ep)`` named ``("edp", "ep")``: a row is an EP group
        (consecutive ranks), a column an EDP group; ``"dp"``, both dims flattened, is the whole
        world, over which the dense parameters are data-parallel. ``device_type``: ``"cuda"``
        (NCCL) or ``"cpu"`` (gloo), the backend of the process group already initialised.
        Returns self.
        """
        if self._mesh is not None:
            raise RuntimeError("ParallelDims.build_mesh() was already called")
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh() needs torch.distributed.init_process_group() first")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims: world_size={self.world_size} but the process group has {dist.get_world_size()} ranks"
            )
        mesh = init_device_mesh(device_type, (self.edp, self.ep), mesh_dim_names=("edp", "ep"))
        # the flattened "dp" dim reuses the world's communicator when it spans the world (torch
        # keeps one group per flattened mesh), so dense collectives need no extra group
        self._mesh = (mesh, mesh["edp", "ep"]._flatten("dp"))
        return self

    def _built(self):
        if self._mesh is None:
            raise RuntimeError("ParallelDims: call build_mesh() first")
        return self._mesh

    @property
    def mesh(self) -> DeviceMesh:
        """The 2-D ``("edp", "ep")`` mesh."""
        return self._built()[0]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The whole world as one dim: the dense parameters' data-parallel mesh."""
        return self._built()[1]

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self.mesh["ep"]

    @property
    def edp_mesh(self) -> DeviceMesh:
        """The ranks holding this rank's expert shard: its FSDP mesh."""
        return self.mesh["edp"]

    @property
    def world_group(self):
        return self.dp_mesh.get_group()

    @property
    def ep_group(self):
        """This rank's expert-parallel group."""
        return self.mesh.get_group("ep")

    @property
    def edp_group(self):
        """This rank's expert-data-parallel group."""
        return self.mesh.get_group("edp")

    @property
    def rank(self) -> int:
        self._built()
        return dist.get_rank()

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    def dispatcher(self, overlap_chunks: int = 1, max_tokens: int | None = None, capacity_factor: float | None = None,
                   capacity_groups: int = 1):
        """An :class:`AllToAllDispatcher` over this rank's EP group (aux inputs over the world),
        pipelining each layer's tokens in ``overlap_chunks`` chunks; with ``max_tokens``, the
        padded exchange (no host sync), sized by the layers' capacity when they cap."""
        return AllToAllDispatcher(self.ep_group, self.world_group, overlap_chunks=overlap_chunks, max_tokens=max_tokens,
                                  capacity_factor=capacity_factor, capacity_groups=capacity_groups)
