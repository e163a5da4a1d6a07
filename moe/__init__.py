"""Mixture-of-Experts layer with expert parallelism."""

from moe.capacity import RoutingPlan, expert_capacity, plan_routing
from moe.config import MoEConfig
from moe.dispatch import Dispatcher, DispatchMeta, LocalDispatcher
from moe.experts import GroupedExperts, master_weight_step
from moe.kernels import grouped_mm
from moe.layer import MoEAux, MoELayer, moe_aux_loss, moe_layers, moe_stats, update_expert_biases
from moe.losses import load_balancing_loss, router_z_loss
from moe.mlp import DenseMLP
from moe.router import Router, RouterOutput
from moe.stats import MoEStats

__all__ = [
    "DenseMLP", "DispatchMeta", "Dispatcher", "GroupedExperts", "LocalDispatcher", "MoEAux", "MoEConfig", "MoELayer",
    "MoEStats", "Router", "RouterOutput", "RoutingPlan", "expert_capacity", "grouped_mm", "load_balancing_loss",
    "master_weight_step", "moe_aux_loss", "moe_layers", "moe_stats", "plan_routing", "router_z_loss", "update_expert_biases",
]
