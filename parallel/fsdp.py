"""FSDP2 over the data × expert-parallel mesh: dense state sharded over the world, each expert
shard's state over its expert-data-parallel group.

What ``fully_shard`` is applied to, innermost first (FSDP2 manages a parameter in the innermost
``fully_shard`` module that holds it):

1. every :class:`moe.GroupedExperts` over ``dims.edp_mesh``: the W/P ranks that hold the same
   experts. Sharded along dim 1 (D of ``w1_LDU``, F of ``w2_LFD``), not FSDP's default dim 0,
   because L = E/P can be smaller than the EDP size (8 experts over EP 8 leave L = 1), and a
   dim-0 shard of one expert would leave all but one rank holding padding. FSDP2 shards a dim
   other than 0 only evenly, so D and F must be multiples of W/P (checked before any sharding).
2. every transformer block over the world (``dims.dp_mesh``): the rest of the block.
3. the root (embeddings, final norm, LM head) over the world, never resharded after the forward:
   the backward starts with it.

Left out of FSDP (``ignored_params``), replicated as in ``replicate`` mode and reduced by
:func:`parallel.sync_gradients` after the backward:
- the routers: fp32 by design (their logits decide discrete routes; a bf16 gather would round the
  weights they read), and tiny (E·D each);
- the experts when their EDP group is one rank (EP = W): there is nothing to shard them over, and
  an FSDP unit per layer would still copy every expert weight in and out of its buffers twice a
  step and add hooks per layer on a step whose dispatch already waits on the host. On 2×H200
  (OLMoE-shaped, EP 2) wrapping routers and such experts in FSDP units of their own measured 0.77×
  the replicated tokens/s.

Gradients. FSDP reduce-scatters each gradient during the backward and divides by its mesh size by
default. That is right for the dense parameters (mean over the W ranks' losses). An expert shard's
gradient already holds, through the all-to-all's backward, the contributions of every rank of its
EP group, so its sum over the EDP group covers all W ranks' losses once: it must be divided by W,
not by the EDP size W/P (the bug of pytorch#160285 / Megatron PR #5916, P times too large). The
experts' divide factor is therefore set to W. ``tests/test_fsdp.py`` proves both against one
process.
"""

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from moe import GroupedExperts, Router


def _expert_placement(param: nn.Parameter) -> Shard:
    return Shard(1)


def fully_shard_moe(model: nn.Module, blocks: list[nn.Module], dims, *, param_dtype: torch.dtype,
                    reduce_dtype: torch.dtype, reshard_after_forward: bool) -> nn.Module:
    """Apply FSDP2 to ``model`` (in place; returns it) as the module docstring says.

    Args:
        model: the root module; ``blocks`` its transformer blocks, in forward order.
        dims: a :class:`~parallel.dims.ParallelDims` with its mesh built.
        param_dtype: the dtype parameters are gathered and computed in (not the router's).
        reduce_dtype: the dtype gradients are reduce-scattered in.
        reshard_after_forward: free each block's gathered parameters after its forward
            (ZeRO-3-like) or keep them until its backward (ZeRO-2-like).

    Build the optimizer after this call: it replaces every parameter by a sharded DTensor.
    """
    for block in blocks:
        for module in block.modules():
            if isinstance(module, GroupedExperts):
                uneven = {n: p.shape[1] for n, p in module.named_parameters() if p.shape[1] % dims.edp}
                if uneven:
                    raise ValueError(f"fully_shard_moe: the experts' weights are sharded along dim 1 over the "
                                     f"{dims.edp} ranks of an expert-data-parallel group, which must divide it: {uneven}")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # the experts' unit leaves its inputs as they come: the rows are in the compute dtype already
    # (the dispatch casts them), and the row weights the local dispatcher passes must stay fp32
    # (a bf16 cast would round the combine weights to 8 bits)
    experts_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    ignored: set[nn.Parameter] = set()
    for block in blocks:
        mine = set()
        for module in block.modules():
            if isinstance(module, Router):
                mine.update(module.parameters())
            elif isinstance(module, GroupedExperts) and dims.edp == 1:
                mine.update(module.parameters())
            elif isinstance(module, GroupedExperts):
                fully_shard(module, mesh=dims.edp_mesh, reshard_after_forward=reshard_after_forward,
                            shard_placement_fn=_expert_placement, mp_policy=experts_policy)
                module.set_gradient_divide_factor(float(dims.world_size))
                if dims.mesh.device_type == "cpu":  # gloo has no PREMUL_SUM: sum, then divide
                    module.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dims.dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    ignored_params=mine)
        ignored |= mine
    fully_shard(model, mesh=dims.dp_mesh, reshard_after_forward=False, mp_policy=policy, ignored_params=ignored)
    return model
