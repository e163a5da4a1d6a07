"""ParallelDims: the data-parallel × expert-parallel layout of the world, and its process groups.

World = W ranks, all data-parallel (each reads its own shard). The experts of a layer are split
over an expert-parallel (EP) group of ``ep`` consecutive ranks: ranks ``[g·ep, (g+1)·ep)`` form
EP group g, and EP rank i holds experts ``[i·L, (i+1)·L)`` with ``L = E / ep``. The ``edp = W / ep``
ranks that hold the same expert shard (same ``rank % ep``) form its expert-data-parallel (EDP)
group, over which that shard's gradients are reduced.

Example, W = 4, ep = 2: EP groups [0, 1] and [2, 3]; EDP groups [0, 2] and [1, 3].
"""

import torch.distributed as dist

from parallel.dispatcher import AllToAllDispatcher


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"ParallelDims: {name} must be an int >= {minimum}, got {value!r}")


class ParallelDims:
    """Validated ``world_size = edp · ep`` layout; builds the process groups once.

    Args:
        world_size: W, all ranks (every one data-parallel).
        ep: expert-parallel size (G); must divide W (and, per layer, the expert count: see
            :meth:`check_experts`).

    The constructor only validates (no communication), so a bad layout fails before any
    process group exists. :meth:`build_groups` is a collective: every rank calls it once, after
    ``torch.distributed.init_process_group``, and it creates every group in the same order on all
    ranks (``dist.new_group`` requires that).
    """

    def __init__(self, world_size: int, ep: int = 1):
        _check_int("world_size", world_size, 1)
        _check_int("ep", ep, 1)
        if world_size % ep:
            raise ValueError(f"ParallelDims: ep={ep} must divide world_size={world_size}")
        self.world_size = world_size
        self.ep = ep
        self.edp = world_size // ep
        self._groups = None

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

    def build_groups(self) -> "ParallelDims":
        """Create the EP and EDP groups (collective; call once on every rank). Returns self."""
        if self._groups is not None:
            raise RuntimeError("ParallelDims.build_groups() was already called")
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_groups() needs torch.distributed.init_process_group() first")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims: world_size={self.world_size} but the process group has {dist.get_world_size()} ranks"
            )
        rank = dist.get_rank()
        world = dist.group.WORLD
        ep_group = self._new_groups([self.ep_ranks(g * self.ep) for g in range(self.edp)], rank)
        edp_group = self._new_groups([self.edp_ranks(i) for i in range(self.ep)], rank)
        self._groups = (world, ep_group, edp_group)
        return self

    def _new_groups(self, all_ranks: list[list[int]], rank: int):
        if len(all_ranks) == 1:  # the group is the whole world: reuse it, no new communicator
            return dist.group.WORLD
        mine = None
        for ranks in all_ranks:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        return mine

    def _built(self):
        if self._groups is None:
            raise RuntimeError("ParallelDims: call build_groups() first")
        return self._groups

    @property
    def world_group(self):
        return self._built()[0]

    @property
    def ep_group(self):
        """This rank's expert-parallel group."""
        return self._built()[1]

    @property
    def edp_group(self):
        """This rank's expert-data-parallel group."""
        return self._built()[2]

    @property
    def rank(self) -> int:
        self._built()
        return dist.get_rank()

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    def dispatcher(self):
        """An :class:`AllToAllDispatcher` over this rank's EP group (aux inputs over the world)."""
        return AllToAllDispatcher(self.ep_group, self.world_group)
