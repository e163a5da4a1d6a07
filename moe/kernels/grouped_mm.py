"""Differentiable grouped matmul over packed rows, Triton on CUDA, PyTorch reference on CPU.

Legend: M packed rows, I input width, N weight output width, L weight
groups, J row segments (a multiple of L), F = N/2 for SwiGLU.

``y = act(x[rows of s] @ w[s % L])`` with segment s holding rows ``offsets[s-1]:offsets[s]``.
J = L is the usual grouped matmul (rows sorted by group), and what the dispatchers hand over
(expert-parallel ones too: ``parallel.token_rows`` says why); J = G·L takes rows in a (source
rank, local expert) order unchanged, for a caller that has them so.
Forward: one persistent Triton GEMM (on Hopper with aligned rows after a tiny launch that lists
the tiles on the device, see ``grouped_mm_tma``, or on sm_90 without an activation its
warp-specialized Gluon counterpart, ``grouped_mm_gluon``; GELU fused into its epilogue; SwiGLU as one more
elementwise Triton pass over its output, see ``grouped_mm_fwd``), pre-activation saved when a
gradient is needed. Backward: the activation's elementwise backward (one Triton
pass, ``dz``), then dgrad ``dx = dz @ w[g]ᵀ`` (the forward kernel on ``w`` with swapped strides)
and wgrad ``dw[g] = x_gᵀ @ dz_g`` (its own kernels, reduction over the group's rows, see
``grouped_mm_wgrad``, ``grouped_mm_wgrad_tma`` and ``grouped_mm_wgrad_gluon``).

Host syncs: none once tuned (checked on an H100 with ``torch.cuda.set_sync_debug_mode("error")``
in tests/test_grouped_mm.py). Group sizes are only read by the kernels on the device; the
kernels' grids depend on shapes and the SM count alone. The one exception is the first call
for a new (N, I, dtype) of an autotuned kernel (the pointer-load forward and the general wgrad;
the Hopper TMA kernels run one fixed config): Triton's autotuner then times its configs, which
synchronizes. Rows at or past ``offsets[-1]`` are zero in
``y`` and ``dx`` and contribute nothing to ``dw``.
"""

import torch

from kernel_floor import use_reference
from moe.kernels.activation import activation_backward, check_row_weights, swiglu_forward
from moe.kernels.grouped_mm_fwd import grouped_mm_forward
from moe.kernels.grouped_mm_wgrad import grouped_mm_wgrad
from moe.kernels.master_grad import accumulate_wgrad_, master_of
from moe.kernels.reference import grouped_mm_reference



class GroupedMMFn(torch.autograd.Function):
    """Autograd wrapper: Triton forward, Triton activation-backward + dgrad + wgrad."""

    @staticmethod
    def forward(ctx, x_MI, w_LIN, offsets_J, activation):
        needs_grad = x_MI.requires_grad or w_LIN.requires_grad
        y, z = grouped_mm_forward(x_MI, w_LIN, offsets_J, activation, save_preact=needs_grad)
        ctx.activation = activation
        ctx.save_for_backward(x_MI, w_LIN, offsets_J, z)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_MI, w_LIN, offsets_J, z = ctx.saved_tensors
        dy = dy.contiguous()
        dz = activation_backward(z, dy, ctx.activation) if ctx.activation is not None else dy
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx, _ = grouped_mm_forward(dz, w_LIN.transpose(1, 2), offsets_J, record_tile=False)
        if ctx.needs_input_grad[1]:
            dw = grouped_mm_wgrad(x_MI, dz, offsets_J, w_LIN.shape[0])
        return dx, dw, None, None


def _runs_reference(x_MI: torch.Tensor, backend: str) -> bool:
    """Whether ``backend`` picks the PyTorch reference for these rows. fp32 stays on it under
    "auto": the kernels' tuned tiles are sized for 16-bit operands, and an fp32 run of the NCCL
    test on 2×H200 hit "out of resource: shared memory" with the first forward config (262160 B
    needed, 232448 B available)."""
    return use_reference(backend, not x_MI.is_cuda or x_MI.dtype == torch.float32)


class GroupedSwiGLUMLPFn(torch.autograd.Function):
    """The expert MLP ``y = (swiglu(x @ w1[s]) · w_R) @ w2[s]`` as one autograd node that keeps x,
    the pre-activation z and the row weights for the backward, not the activation h.

    Two :class:`GroupedMMFn` nodes keep h (M, F) as the second matmul's input; here the
    activation backward, which reads z anyway, writes h again for the second matmul's weight
    gradient (bit-identical: the same kernel expression on the same z). Saved activation bytes
    fall by M·F·2 (K·F·2 per token: 16 KiB at OLMoE's F 1024, top-8), for one more (M, F)
    write in the backward. Gradients equal the two-node chain's bit for bit, except the weight
    gradients of tagged fp32-master casts (``moe.master_weight_step``), added into the master's
    ``.grad`` unrounded (:func:`_weight_grad`).

    ``w_R`` (M,) fp32 or None: per-row weights applied to h in the SwiGLU pass (the combine
    weights, so the combine only sums); their gradient comes from the same backward pass
    (``moe.kernels.activation``), so the combine need not keep the output rows.
    """

    @staticmethod
    def forward(ctx, x_MI, w1_LIU, w2_LFN, offsets_J, w_R):
        z, _ = grouped_mm_forward(x_MI, w1_LIU, offsets_J)
        h = swiglu_forward(z, w_R)
        y, _ = grouped_mm_forward(h, w2_LFN, offsets_J)
        ctx.save_for_backward(x_MI, w1_LIU, w2_LFN, offsets_J, z, w_R)
        # a tagged cast's own autograd node (the one that would add a returned gradient into
        # the master): the backward adds into master.grad only when the engine runs that node
        ctx.masters = [(master_of(w), w.grad_fn) for w in (w1_LIU, w2_LFN)]
        return y

    @staticmethod
    def backward(ctx, dy):
        x_MI, w1_LIU, w2_LFN, offsets_J, z, w_R = ctx.saved_tensors
        dy = dy.contiguous()
        dh, _ = grouped_mm_forward(dy, w2_LFN.transpose(1, 2), offsets_J, record_tile=False)
        if w_R is None:
            (dz, h), dw_R = activation_backward(z, dh, "swiglu", return_h=True), None
        else:
            dz, h, dw_R = activation_backward(z, dh, "swiglu", return_h=True, w_M=w_R)
        del dh
        dx = None
        dw2 = _weight_grad(ctx.needs_input_grad[2], ctx.masters[1], h, dy, offsets_J, w2_LFN.shape[0])
        del h
        if ctx.needs_input_grad[0]:
            dx, _ = grouped_mm_forward(dz, w1_LIU.transpose(1, 2), offsets_J, record_tile=False)
        dw1 = _weight_grad(ctx.needs_input_grad[1], ctx.masters[0], x_MI, dz, offsets_J, w1_LIU.shape[0])
        return dx, dw1, dw2, None, dw_R if ctx.needs_input_grad[4] else None


class _ScaleRowsFn(torch.autograd.Function):
    """``y[m] · w[m]`` in fp32, cast to y's dtype; keeps y and w (what a weighted combine kept)."""

    @staticmethod
    def forward(ctx, y_MN, w_M):
        ctx.save_for_backward(y_MN, w_M)
        return (y_MN.float() * w_M[:, None]).to(y_MN.dtype)

    @staticmethod
    def backward(ctx, dout):
        y_MN, w_M = ctx.saved_tensors
        d32 = dout.float()
        return (d32 * w_M[:, None]).to(y_MN.dtype), (d32 * y_MN.float()).sum(1)


def _weight_grad(needed, master_and_node, x_MI, dy_MN, offsets_J, num_groups):
    """The weight gradient ``grouped_mm_wgrad`` returns, or, for a weight that is a tagged cast of
    an fp32 master (``moe.master_weight_step``), None after adding it into ``master.grad``
    (:func:`~moe.kernels.master_grad.accumulate_wgrad_`: on Hopper in the wgrad kernel's
    epilogue). ``torch.autograd.grad`` or ``backward(inputs=...)`` that do not reach the cast's
    node get None and leave ``master.grad`` alone, as autograd would."""
    master, node = master_and_node
    if not needed:
        return None
    if master is None:
        return grouped_mm_wgrad(x_MI, dy_MN, offsets_J, num_groups)
    if torch._C._will_engine_execute_node(node):
        accumulate_wgrad_(master, x_MI, dy_MN, offsets_J)
    return None


def scale_rows(y_MN: torch.Tensor, w_M: torch.Tensor) -> torch.Tensor:
    """``y[m] · w[m]`` (w (M,) fp32) computed in fp32, in y's dtype; differentiable in both,
    keeping y and w for the backward."""
    return _ScaleRowsFn.apply(y_MN, w_M)


def grouped_mlp(x_MI: torch.Tensor, w1_LIU: torch.Tensor, w2_LFN: torch.Tensor, offsets_J: torch.Tensor,
                activation: str, backend: str = "auto", w_R: torch.Tensor | None = None) -> torch.Tensor:
    """``w_R[r] · act(x[rows of s] @ w1[s % L]) @ w2[s % L]``: the expert MLP, differentiable in
    x, w1, w2 and w_R.

    Shapes and backends as :func:`grouped_mm` (w1 (L, I, U), U = 2F for ``"swiglu"``; w2 (L, F, N)).
    ``w_R``: optional (M,) fp32 row weights (the combine weights of the rows' pairs).
    The Triton SwiGLU path is one :class:`GroupedSwiGLUMLPFn` node (h is not kept for the
    backward; w_R scales h in its SwiGLU pass); GELU and the reference chain two :func:`grouped_mm`
    calls and scale the output rows.
    """
    w_R = None if w_R is None else w_R.contiguous()
    check_row_weights(w_R, x_MI.shape[0], x_MI, "w_R")
    if activation == "swiglu" and not _runs_reference(x_MI, backend):
        return GroupedSwiGLUMLPFn.apply(x_MI, w1_LIU, w2_LFN, offsets_J, w_R)
    h = grouped_mm(x_MI, w1_LIU, offsets_J, activation=activation, backend=backend)
    y = grouped_mm(h, w2_LFN, offsets_J, backend=backend)
    return y if w_R is None else scale_rows(y, w_R)


def grouped_mm_triton(
    x_MI: torch.Tensor,
    w_LIN: torch.Tensor,
    offsets_J: torch.Tensor,
    activation: str | None = None,
) -> torch.Tensor:
    """The Triton path, differentiable in x and w (on CPU only under ``TRITON_INTERPRET=1``)."""
    return GroupedMMFn.apply(x_MI, w_LIN, offsets_J, activation)


def grouped_mm(
    x_MI: torch.Tensor,
    w_LIN: torch.Tensor,
    offsets_J: torch.Tensor,
    activation: str | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``y[rows of s] = act(x[rows of s] @ w[s % L])``, differentiable in x and w.

    Args:
        x_MI: (M, I) bf16/fp16 packed rows sorted by group, row-major (fp32 runs the reference
            under ``"auto"``: the kernels' tiles are tuned for 16-bit operands).
        w_LIN: (L, I, N) same dtype; for ``"swiglu"`` N = 2F holds ``[gate | up]``.
        offsets_J: (J,) int32/int64 cumulative end offsets of the row segments on x's device,
            non-decreasing, ``offsets[-1] <= M``; J a multiple of L, segment s uses ``w[s % L]``;
            empty segments allowed.
        activation: None, ``"swiglu"`` (output width F, ``silu(gate) * up`` in fp32) or
            ``"gelu"`` (tanh approximation).
        backend: ``"auto"`` (Triton for bf16/fp16 on CUDA, the reference for fp32 and off
            CUDA), ``"triton"`` or ``"reference"``.

    Returns:
        y: (M, N or F) in x's dtype; rows at or past ``offsets[-1]`` are zero, and so are
        those rows of the input gradient.
    """
    if _runs_reference(x_MI, backend):
        return grouped_mm_reference(x_MI, w_LIN, offsets_J, activation)
    return grouped_mm_triton(x_MI, w_LIN, offsets_J, activation)
