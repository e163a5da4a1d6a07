"""Data × expert parallelism: the device mesh, FSDP2 and gradient sync, and the expert-parallel dispatchers.

The dispatchers: :class:`ExpertParallelDispatcher` (groups, one-rank fallback, global reductions)
and its two transports, :class:`AllToAllDispatcher` (NCCL all-to-all, any topology) and
:class:`P2PDispatcher` (NVLink peer stores, the GPUs of one node).
"""

from parallel.all_to_all import all_reduce_sum, all_to_all
from parallel.comm import CommTimer
from parallel.dims import ParallelDims
from parallel.dispatcher import AllToAllDispatcher, AllToAllMeta
from parallel.env import init_distributed
from parallel.fsdp import fully_shard_moe
from parallel.ep_dispatcher import ExpertParallelDispatcher, ExpertParallelMeta
from parallel.grad_sync import clip_grad_norm_, expert_parameters, sync_gradients
from parallel.p2p_dispatcher import P2PDispatcher, P2PMeta
from parallel.replicas import check_replicas_agree
from parallel.stats import global_moe_stats, update_expert_biases_global

__all__ = [
    "AllToAllDispatcher", "AllToAllMeta", "CommTimer", "ExpertParallelDispatcher", "ExpertParallelMeta",
    "P2PDispatcher", "P2PMeta", "ParallelDims", "all_reduce_sum", "all_to_all", "check_replicas_agree", "clip_grad_norm_",
    "expert_parameters", "fully_shard_moe", "global_moe_stats", "init_distributed", "sync_gradients", "update_expert_biases_global",
]
