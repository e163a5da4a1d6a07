"""The routed experts: one MLP per expert, weights stacked, run as grouped matmuls.

Legend: R packed rows (sorted by expert), D model dim, F expert hidden dim, U width of the first
matmul (2F for SwiGLU, F for GELU), L experts held here, J row segments.
"""

from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from moe.kernels import grouped_mlp, row_tile_size
from moe.kernels.master_grad import accumulate_master_grad_, tag_master_copy
from moe.mlp import ACTIVATIONS, Activation


class _MasterCopy(torch.autograd.Function):
    """``copy``, the fp32 weight ``master`` cast to the compute dtype, as an autograd node whose
    backward adds the gradient into ``master.grad`` itself, in one pass
    (:func:`~moe.kernels.master_grad.accumulate_master_grad_`), and hands autograd no gradient
    for ``master``: the fusion Megatron-LM calls gradient_accumulation_fusion. Autograd's
    ``AccumulateGrad`` (and any hook on ``master``) does not run for it."""

    @staticmethod
    def forward(ctx, master, copy):
        ctx.master = master
        ctx.set_materialize_grads(False)
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:  # None: the matmul added it into master.grad itself (tag_master_copy)
            accumulate_master_grad_(ctx.master, grad)
        return None, None


class GroupedExperts(nn.Module):
    """L expert MLPs over packed rows.

    Weights: ``w1_LDU`` (L, D, U): U = 2F for SwiGLU (``[gate | up]`` along the last dim, one
    GEMM of width 2F), U = F for GELU; ``w2_LFD`` (L, F, D). Under autocast the rows and weights
    run in the autocast dtype (the grouped GEMM takes bf16/fp16 operands, fp32 accumulation).

    ``recompute`` (attribute, default False): keep only the rows and offsets for the backward and
    run the two GEMMs again there (activation checkpointing of the expert MLP: the (R, U)
    pre-activation and (R, F) hidden rows, the largest tensors of a fine-grained MoE layer, are
    not kept).

    ``fuse_master_weights`` (attribute, default False; :func:`master_weight_step` sets it): fp32
    weights under a 16-bit autocast are cast once and the copy reused while their version is
    unchanged (every micro-batch of an optimizer step), and each micro-batch's weight gradient
    is added into the fp32 ``.grad`` in one pass (:class:`_MasterCopy`); the SwiGLU MLP's
    weight gradients on Hopper are added there by the wgrad kernel's epilogue, unrounded
    (:func:`~moe.kernels.master_grad.accumulate_wgrad_`).

    ``init_seed``, ``first_expert``: these L experts are the global experts
    ``[first_expert, first_expert + L)``, each initialised from its own generator seeded
    ``init_seed + e`` (see :meth:`reset_parameters`); ``init_seed=None``: from the global RNG.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, activation: Activation = "swiglu", *, device=None, dtype=None,
                 init_seed: int | None = None, first_expert: int = 0):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.num_experts = num_experts
        self.init_seed = init_seed
        self.first_expert = first_expert
        width = 2 * hidden_dim if activation == "swiglu" else hidden_dim
        self.w1_LDU = nn.Parameter(torch.empty(num_experts, dim, width, device=device, dtype=dtype))
        self.w2_LFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, device=device, dtype=dtype))
        self.recompute = False
        self.fuse_master_weights = False
        self._copies = None  # (dtype, versions) and the weights cast to that dtype
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        """Normal(0, std) ``w1``, Normal(0, out_std) ``w2`` (``out_std`` default: std).

        With ``init_seed`` set (what :class:`moe.MoELayer` does), local expert l is *global*
        expert ``e = first_expert + l`` and both its matrices come from one generator of its own,
        seeded ``init_seed + e`` on the weights' device (``w1[l]`` drawn first, then ``w2[l]``):
        expert e gets the same weights whichever rank holds it and however many experts the rank
        holds, and the global RNG is not touched. Without it, both tensors are drawn from the
        global RNG (the amount drawn then depends on the number of experts held). On the meta
        device nothing is drawn.
        """
        out_std = std if out_std is None else out_std
        if self.init_seed is None:
            nn.init.normal_(self.w1_LDU, std=std)
            nn.init.normal_(self.w2_LFD, std=out_std)
            return
        device = self.w1_LDU.device
        if device.type == "meta":
            return
        for local in range(self.num_experts):
            gen = torch.Generator(device=device).manual_seed(self.init_seed + self.first_expert + local)
            self.w1_LDU[local].normal_(0.0, std, generator=gen)
            self.w2_LFD[local].normal_(0.0, out_std, generator=gen)

    def compute_dtype(self, x_RD: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x_RD.device.type):
            return torch.get_autocast_dtype(x_RD.device.type)
        return x_RD.dtype

    def row_tile_size(self, dtype: torch.dtype) -> int:
        """BLOCK_M of the first (largest) grouped GEMM: the tile the tile-utilization stat counts."""
        return row_tile_size(self.w1_LDU.shape[1], self.w1_LDU.shape[2], dtype)

    def forward(self, x_RD: torch.Tensor, offsets_J: torch.Tensor, w_R: torch.Tensor | None = None) -> torch.Tensor:
        """x_RD (R, D) rows in J segments; offsets_J (J,) int32 cumulative segment ends, J a
        multiple of L, segment s run by expert ``s % L`` (J = L: rows sorted by expert); w_R
        optional (R,) fp32 weights each output row is multiplied by (the combine weights).
        Returns (R, D) in the compute dtype; rows past ``offsets_J[-1]`` come back zero."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._mlp, x_RD, offsets_J, w_R, use_reentrant=False)
        return self._mlp(x_RD, offsets_J, w_R)

    def compute_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1, w2) in ``dtype``, differentiable in the parameters."""
        w1, w2 = self.w1_LDU, self.w2_LFD
        if not self.fuse_master_weights or (w1.dtype == dtype and w2.dtype == dtype):
            return w1.to(dtype), w2.to(dtype)
        key = (dtype, w1._version, w2._version)
        if self._copies is None or self._copies[0] != key:
            with torch.no_grad():
                self._copies = (key, w1.to(dtype), w2.to(dtype))
        _, c1, c2 = self._copies
        return tag_master_copy(_MasterCopy.apply(w1, c1), w1), tag_master_copy(_MasterCopy.apply(w2, c2), w2)

    @torch.no_grad()
    def refresh_copies(self) -> None:
        """Re-cast the weights into the copies made by :meth:`compute_weights`, in place (under
        the weights' current versions, so that it reuses them): the copies stay where a captured
        CUDA graph reads them (train/step_graph.py)."""
        if self._copies is None:
            return
        (dtype, *_), c1, c2 = self._copies
        w1, w2 = self.w1_LDU, self.w2_LFD
        c1.copy_(w1)
        c2.copy_(w2)
        self._copies = ((dtype, w1._version, w2._version), c1, c2)

    def _mlp(self, x_RD: torch.Tensor, offsets_J: torch.Tensor, w_R: torch.Tensor | None) -> torch.Tensor:
        dtype = self.compute_dtype(x_RD)
        w1, w2 = self.compute_weights(dtype)
        return grouped_mlp(x_RD.to(dtype), w1, w2, offsets_J, self.activation, w_R=w_R)


@contextmanager
def master_weight_step(model: nn.Module, keep_copies: bool = False):
    """The micro-batches of one optimizer step over ``model``: inside, every
    :class:`GroupedExperts` not managed by FSDP (whose own mixed precision casts its weights)
    sets ``fuse_master_weights``; leaving frees the cast copies, before the optimizer step
    needs the memory. ``keep_copies``: they stay allocated, and entering re-casts them in place
    (a captured CUDA graph reads them at fixed addresses: train/step_graph.py), whatever the
    weights' version counters say: the fused AdamW step does not bump them (torch 2.13:
    ``_version`` 0 before and after ``AdamW(fused=True).step()``, 0 → 2 with ``foreach=True``).

    Inside, take gradients with ``backward()``: the experts' weight gradients are written into
    ``.grad`` directly, so ``torch.autograd.grad`` does not return them (nor writes them) and
    hooks on those weights do not fire. Measured on an H100 (OLMoE-shaped model at 6 layers, 2.4B
    expert parameters, bench/results/master_weights.md): the per-micro-batch cast (4.8 ms) and
    autograd's two gradient passes (about 8 ms each) went; a step of 16 micro-batches ran 1.164x
    faster than with the per-micro-batch cast (MFU 35.4 %), one of a single micro-batch 1.051x.
    """
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts) and not isinstance(m, FSDPModule)]
    for m in experts:
        m.fuse_master_weights = True
        m.refresh_copies()
    try:
        yield
    finally:
        for m in experts:
            m.fuse_master_weights = False
            if not keep_copies:
                m._copies = None
