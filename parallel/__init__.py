"""Data × expert parallelism: process groups, all-to-all and peer-memory dispatch, gradient sync."""

from parallel.all_to_all import all_reduce_sum, all_to_all
from parallel.dims import ParallelDims
from parallel.dispatcher import AllToAllDispatcher, AllToAllMeta
from parallel.env import init_distributed
from parallel.grad_sync import expert_parameters, sync_gradients
from parallel.launch import run_distributed
from parallel.p2p_dispatcher import P2PDispatcher
from parallel.stats import global_moe_stats, update_expert_biases_global

__all__ = [
    "AllToAllDispatcher", "AllToAllMeta", "P2PDispatcher", "ParallelDims", "all_reduce_sum", "all_to_all",
    "expert_parameters", "global_moe_stats", "init_distributed", "run_distributed", "sync_gradients",
    "update_expert_biases_global",
]
