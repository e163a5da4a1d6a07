"""The LM head and its cross-entropy in chunks of tokens: no (T, V) tensor outlives one chunk.

Legend: T tokens, D model dim, V vocabulary, n the rows of one chunk.

Why: ``F.cross_entropy(F.linear(h_TD, weight_VD).float(), targets_T)`` materialises the logits in
the compute dtype and in fp32, keeps the log-softmax output (T, V) fp32 for the backward, and the
backward makes two more (T, V) tensors (the gradient of the log-softmax output, its own output):
at T = 16,384 and V = 50,304 each fp32 one is 3.3 GB. Here the tokens are taken ``chunk`` rows at
a time: logits ``h_nD @ weightᵀ`` in the compute dtype (the autocast dtype under autocast, as
``F.linear`` there, else the inputs'), then in fp32 the shifted logits, their log-sum-exp and the
loss sum. When a gradient is asked for, the forward finishes the chunk's backward at once: the
gradient of its logits ``(softmax − onehot) / T``, cast back to the compute dtype as the
reference's ``.float()`` backward does, then ``dh_nD = g_nV @ weight`` and ``dW_VD += g_nVᵀ @
h_nD`` (the sum over chunks in fp32).

What is saved for the backward: the two gradients, ``dh_TD`` in h's dtype and ``dW_VD`` in the
weight's: the size of h and of the weight, never T·V. With a bias (``bias_V``, an LM head's: the
logits' GEMM adds it in the compute dtype), a third: its gradient, the sum over tokens of ``g_nV``,
summed over the chunks in fp32, in the bias's dtype. The backward only scales them by the incoming
gradient (in place). With no gradient asked for (validation, ``torch.no_grad``) only the loss is
computed.

What it costs: the same three GEMMs as the reference (logits, dgrad, wgrad; none recomputed) and,
on CUDA, one Triton pass per chunk (:func:`_softmax_xent_`: each row's max and sum of exponentials
online, then the gradient written over the logits: two reads and one write of the chunk in the
compute dtype, no fp32 copy); elsewhere the same math in PyTorch ops (shift, exp, sum, scale,
cast: about ten kernels and an fp32 copy of the chunk). The weight's
gradient is summed over the chunks in fp32: on CUDA each chunk's GEMM adds into the fp32 sum
itself (:func:`_add_wgrad`); elsewhere each chunk's product, (V, D) rounded to the compute dtype,
is a transient added to it (the reference rounds the whole product once). The fp32 sum lives
from the forward to the backward, where it becomes (or joins, tied to the embedding) the weight's
gradient anyway.

The weight is an input of the autograd Function (never ``.data``): under FSDP2 it is the unsharded
parameter the root module's forward gathered, and its gradient reaches the parameter through
autograd like any other, summed with the embedding lookup's when the embeddings are tied.
"""

import torch
import triton
import triton.language as tl

from kernel_floor import INTERPRET

# A chunk's fp32 logits (n · V · 4 bytes) are kept near 1.5 GiB: n = 7,936 rows at V = 50,304,
# 2,560 at V = 151,936, whatever T is (the reference's fp32 logits grow with T: 3.3 GB at 16k × 50k,
# and it keeps two more (T, V) fp32 tensors). On CUDA the Triton softmax pass keeps no fp32 copy,
# so a chunk holds half that, in the compute dtype; with it the whole head + loss ran 1.49-1.60x
# the reference at 3.4-11x less peak memory (H100, bench/results/lm_loss.md). Measured before it,
# on an H100 (T 8192, D 2048, bf16 autocast, fwd+bwd, bench/results/lm_loss.md): at V 50,304
# chunks of 1,280 / 2,560 / 4,096 rows ran 0.92 / 0.98 / 1.03× the reference's speed, at
# V 151,936 0.67 / 1.02 / 1.06× (peak 2.7 / 3.0 / 3.5 GiB and 6.1 / 8.0 / 9.3 GiB against the
# reference's 4.8 and 14.5): the fixed cost of a chunk (the softmax passes over its logits, a
# weight-gradient GEMM that writes all of (V, D)) needs a few thousand rows to amortise. Rows
# come in multiples of 128 (the GEMM tiles), at least 128.
LOGITS_BUDGET_BYTES = 3 * 2**29


def chunk_rows(V: int) -> int:
    """Tokens per chunk for a vocabulary of ``V``: fp32 logits near :data:`LOGITS_BUDGET_BYTES`."""
    return max(LOGITS_BUDGET_BYTES // (4 * V) // 128 * 128, 128)


@triton.jit
def _softmax_xent_kernel(logits_ptr, y_ptr, loss_ptr, V, stride_n, inv_T, WITH_GRAD: tl.constexpr,
                         BLOCK_V: tl.constexpr):
    """One row: its loss ``logsumexp(x) − x[y]`` (fp32) and, WITH_GRAD, ``(softmax(x) − onehot(y))
    · inv_T`` written over x in x's dtype. Two reads of the row and one write."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_n
    cols = tl.arange(0, BLOCK_V)
    # per lane: running max (finite start, so no inf − inf) and sum of exp(x − max)
    m = tl.full((BLOCK_V,), -1.0e30, tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    m_row = tl.max(m, 0)
    s_row = tl.sum(s * tl.exp(m - m_row), 0)
    y = tl.load(y_ptr + row)
    x_y = tl.load(base + y).to(tl.float32)
    tl.store(loss_ptr + row, tl.log(s_row) + m_row - x_y)
    if WITH_GRAD:
        scale = inv_T / s_row
        for v0 in range(0, V, BLOCK_V):
            mask = v0 + cols < V
            x = tl.load(base + v0 + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - m_row) * scale - tl.where(v0 + cols == y, inv_T, 0.0)
            tl.store(base + v0 + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def _softmax_xent_(logits_nV: torch.Tensor, y_n: torch.Tensor, inv_T: float, with_grad: bool) -> torch.Tensor:
    """The chunk's summed loss (fp32, 0-dim); with_grad: its logits' gradient written over them."""
    n, V = logits_nV.shape
    loss_n = torch.empty(n, dtype=torch.float32, device=logits_nV.device)
    if n:
        _softmax_xent_kernel[(n,)](logits_nV, y_n, loss_n, V, logits_nV.stride(0), inv_T, WITH_GRAD=with_grad,
                                   BLOCK_V=256 if INTERPRET else 2048, num_warps=8)
    return loss_n.sum()


def _chunk(h_nD, w_VD, b_V, y_n, inv_T: float, grad_h_nD, grad_w_VD, grad_b_V) -> torch.Tensor:
    """One chunk's summed loss (fp32, 0-dim). ``h_nD``, ``w_VD`` and ``b_V`` (the bias or None) in
    the compute dtype. With ``grad_h_nD`` (a slice of h's gradient), ``grad_w_VD`` or ``grad_b_V``
    (the fp32 accumulators) given, writes the chunk's gradient of h there and adds its gradients of
    the weight and of the bias there. On CUDA the softmax passes are one Triton kernel
    (:func:`_softmax_xent_`)."""
    with_grad = grad_h_nD is not None or grad_w_VD is not None or grad_b_V is not None
    if h_nD.is_cuda:
        g_nV = _logits(h_nD, w_VD, b_V)  # the logits, then their gradient written over them
        loss = _softmax_xent_(g_nV, y_n, inv_T, with_grad)
    else:  # the logits handed over, so that the reference can free them before its fp32 work
        loss, g_nV = _softmax_xent_reference(_logits(h_nD, w_VD, b_V), y_n, inv_T, with_grad)
    if grad_h_nD is not None:
        grad_h_nD.copy_(g_nV @ w_VD)
    if grad_w_VD is not None:
        _add_wgrad(grad_w_VD, g_nV, h_nD)
    if grad_b_V is not None:  # one read of the chunk, summed in fp32 (the reference: in the compute dtype)
        grad_b_V.add_(g_nV.sum(0, dtype=torch.float32))
    return loss


def _logits(h_nD, w_VD, b_V) -> torch.Tensor:
    """``h_nD @ w_VDᵀ (+ b_V)`` in the compute dtype. The bias is added by the GEMM itself, as
    F.linear does (on CUDA cuBLASLt's bias epilogue: no add pass over the chunk, and the logits
    round to the compute dtype once, as the reference's)."""
    return h_nD @ w_VD.T if b_V is None else torch.addmm(b_V, h_nD, w_VD.T)


def _softmax_xent_reference(logits_nV, y_n, inv_T: float, with_grad: bool):
    """:func:`_softmax_xent_` in PyTorch ops: (summed loss, gradient of the logits or None)."""
    dtype = logits_nV.dtype
    # the max of compute-dtype values is exact; subtracting it from them promotes to fp32: the
    # reference's .float() and log-softmax shift in one pass
    z_nV = logits_nV - logits_nV.amax(dim=1, keepdim=True).float()
    del logits_nV
    z_target_n1 = z_nV.gather(1, y_n[:, None])
    z_nV.exp_()
    sum_n1 = z_nV.sum(dim=1, keepdim=True)
    loss = (sum_n1.log() - z_target_n1).sum()
    if not with_grad:
        return loss, None
    z_nV.mul_(sum_n1.reciprocal_().mul_(inv_T))  # softmax / T
    z_nV[torch.arange(len(y_n), device=y_n.device), y_n] -= inv_T
    return loss, z_nV.to(dtype)


def _add_wgrad(grad_w_VD: torch.Tensor, g_nV: torch.Tensor, h_nD: torch.Tensor) -> None:
    """``grad_w_VD += g_nVᵀ @ h_nD`` into the fp32 sum. On CUDA one cuBLAS GEMM with an fp32 output
    accumulates in place (no (V, D) product in the compute dtype, no add pass: measured on an H100
    at T 8192, V 50,304, D 2048, chunks of 1,280 rows, the product-then-add cost 0.82× the
    reference's time); elsewhere (no fp32-output GEMM for bf16 inputs) the product, then the add."""
    if g_nV.is_cuda:
        torch.addmm(grad_w_VD, g_nV.T, h_nD, out_dtype=torch.float32, out=grad_w_VD)
    else:
        grad_w_VD.add_(g_nV.T @ h_nD)


def _loss_and_grads(h_TD, weight_VD, bias_V, targets_T, chunk: int, dtype: torch.dtype, need_h: bool, need_w: bool,
                    need_b: bool):
    """(mean loss, dh_TD in h's dtype or None, dW_VD in the weight's dtype or None, db_V in the
    bias's dtype or None)."""
    T = h_TD.shape[0]
    # autocast off: every operand is cast here, once, to the dtype F.linear would compute in
    with torch.autocast(h_TD.device.type, enabled=False):
        w_VD = weight_VD.to(dtype)
        b_V = None if bias_V is None else bias_V.to(dtype)
        grad_h_TD = torch.empty_like(h_TD) if need_h else None
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if need_w else None
        grad_b_V = torch.zeros(bias_V.shape, dtype=torch.float32, device=bias_V.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        for start in range(0, T, chunk):
            end = min(start + chunk, T)
            total += _chunk(h_TD[start:end].to(dtype), w_VD, b_V, targets_T[start:end], 1.0 / T,
                            None if grad_h_TD is None else grad_h_TD[start:end], grad_w_VD, grad_b_V)
        del w_VD, b_V
        if grad_w_VD is not None:
            grad_w_VD = grad_w_VD.to(weight_VD.dtype)
        if grad_b_V is not None:
            grad_b_V = grad_b_V.to(bias_V.dtype)
    return total / T, grad_h_TD, grad_w_VD, grad_b_V


class LinearCrossEntropy(torch.autograd.Function):
    """``(h_TD, weight_VD, bias_V, targets_T, chunk, dtype) -> ()`` mean cross-entropy of ``h_TD @
    weight_VDᵀ + bias_V`` (bias_V may be None), in F.linear's order; the gradients are computed in
    the forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, h_TD, weight_VD, bias_V, targets_T, chunk, dtype):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        loss, *grads = _loss_and_grads(h_TD, weight_VD, bias_V, targets_T, chunk, dtype, need_h, need_w, need_b)
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h_TD, grad_w_VD, grad_b_V = ctx.saved_tensors
        # in place: nothing else reads them, and a second backward through a retained graph then
        # fails autograd's check of the saved tensors' versions instead of scaling them twice
        for grad in (grad_h_TD, grad_w_VD, grad_b_V):
            if grad is not None:
                grad.mul_(grad_loss)
        return grad_h_TD, grad_w_VD, grad_b_V, None, None, None


def linear_cross_entropy(h_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor,
                         chunk: int | None = None, bias_V: torch.Tensor | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(h_TD, weight_VD, bias_V).float(), targets_T)`` (the mean over T,
    fp32, 0-dim) without the (T, V) logits: ``chunk`` tokens at a time (default :func:`chunk_rows`).

    The logits are computed in autocast's dtype when autocast is on for h's device, as F.linear
    there, else in the inputs' dtype (which must then match); the optional bias ``bias_V`` (V,) is
    cast to that dtype and added by the logits' GEMM, as F.linear does. Differentiable in ``h_TD``,
    ``weight_VD`` and ``bias_V``.
    """
    if (h_TD.dim() != 2 or weight_VD.dim() != 2 or targets_T.shape != h_TD.shape[:1]
            or (bias_V is not None and bias_V.shape != weight_VD.shape[:1]) or (chunk is not None and chunk < 1)):
        bias = None if bias_V is None else tuple(bias_V.shape)
        raise ValueError(f"linear_cross_entropy takes h (T, D), weight (V, D), targets (T,), bias_V (V,) or None "
                         f"and chunk >= 1; got {tuple(h_TD.shape)}, {tuple(weight_VD.shape)}, "
                         f"{tuple(targets_T.shape)}, {bias} and {chunk}")
    device_type = h_TD.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h_TD.dtype
    chunk = chunk or chunk_rows(weight_VD.shape[0])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (h_TD, weight_VD, bias_V)):
        return LinearCrossEntropy.apply(h_TD, weight_VD, bias_V, targets_T, chunk, dtype)
    return _loss_and_grads(h_TD, weight_VD, bias_V, targets_T, chunk, dtype, False, False, False)[0]
