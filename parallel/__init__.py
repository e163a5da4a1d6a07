"""Data × expert parallelism: process groups, all-to-all dispatch, gradient sync."""

from parallel.all_to_all import all_reduce_sum, all_to_all
from parallel.dims import ParallelDims
from parallel.dispatcher import AllToAllDispatcher, AllToAllMeta
from parallel.env import init_distributed
from parallel.grad_sync import expert_parameters, sync_gradients
from parallel.launch import run_distributed
from parallel.stats import global_moe_stats, update_expert_biases_global

__all__ = [
    "AllToAllDispatcher", "AllToAllMeta", "ParallelDims", "all_reduce_sum", "all_to_all",
    "expert_parameters", "global_moe_stats", "init_distributed", "run_distributed", "sync_gradients",
    "update_expert_biases_global",
]
