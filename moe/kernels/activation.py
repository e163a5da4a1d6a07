"""Triton elementwise passes of the grouped matmul's activations.

Legend: M rows, N pre-activation width (the output width of the experts' first matmul, U: 2F
for SwiGLU, F for GELU), F = N/2 for SwiGLU.

Forward (SwiGLU only; GELU is fused into the GEMM epilogue): ``h = silu(gate) · up`` from the
GEMM output ``z = [gate | up]``, one read of z and one write of h, math in fp32.
Backward: the saved pre-activation ``z_MN`` and the output gradient ``dh`` give ``dz_MN``,
which both dgrad and wgrad then read; for SwiGLU the same pass can also write ``h`` again
(``return_h``), bit-identical to the forward's, so the expert MLP need not keep h (M, F) for the
second matmul's weight gradient (it reads z here anyway: one more write of M·F).

Row weights (``w_M``, SwiGLU): the forward writes ``h·w[m]``, w[m] the combine weight of the
row's (token, slot) pair, so the expert output rows ``y = (h·w) @ W2`` come out weighted and the
combine is a plain sum (SonicMoE's arrangement). The gradient of w[m] is then ``<dh[m], h[m]>``
(dh the gradient of ``h·w``, i.e. ``dout @ W2ᵀ``; h unweighted), which equals the weighted
combine's ``<dout[t], h[m] @ W2>``; this pass sums it over the row while it recomputes h anyway,
so nothing keeps the (M, D) expert output rows for the backward, as a weighted combine must.

Math in fp32:
SwiGLU ``h = silu(g)·u``: ``dg = dh·u·σ(g)(1 + g(1 − σ(g)))``, ``du = dh·silu(g)``;
tanh-GELU: ``d/dz [0.5 z (1 + tanh s)] = 0.5(1 + tanh s) + 0.5 z (1 − tanh² s) s'``,
``s = c(z + 0.044715 z³)``, ``s' = c(1 + 3·0.044715 z²)``.
"""

import torch
import triton
import triton.language as tl

from kernel_floor import cdiv

ACTIVATIONS = {None: 0, "swiglu": 1, "gelu": 2}


@triton.jit
def gelu_tanh(v):
    """tanh-approximate GELU of an fp32 tile (fused into the grouped matmul's epilogue)."""
    inner = 0.7978845608028654 * (v + 0.044715 * v * v * v)
    # tanh(u) = 2 * sigmoid(2u) - 1, exact and stable for fp32.
    return 0.5 * v * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))


@triton.jit
def _swiglu_fwd_kernel(z_ptr, w_ptr, h_ptr, M, F, stride_zm, stride_hm, WEIGHTED: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    rows64 = tl.cast(rows, tl.int64)
    z_ptrs = z_ptr + rows64[:, None] * stride_zm + cols[None, :]
    gate = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(z_ptrs + F, mask=mask, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    if WEIGHTED:
        h = h * tl.load(w_ptr + rows, mask=rows < M, other=0.0)[:, None]
    tl.store(h_ptr + rows64[:, None] * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


def check_row_weights(w_M: torch.Tensor | None, M: int, like: torch.Tensor, name: str = "w_M") -> None:
    """Row weights are None or a contiguous fp32 (M,) tensor on ``like``'s device; the error
    names them ``name``."""
    if w_M is not None and (w_M.shape != (M,) or w_M.dtype != torch.float32 or w_M.device != like.device
                            or w_M.stride(0) != 1):
        raise ValueError(f"{name} must be a contiguous fp32 ({M},) tensor on {like.device}, got {w_M.dtype} "
                         f"{tuple(w_M.shape)} on {w_M.device}")


def swiglu_forward(z_MN: torch.Tensor, w_M: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(z[:, :F]) * z[:, F:]`` (times the row weight ``w_M[m]`` when given) in fp32, cast
    to z's dtype; z (M, 2F) row-major, w_M (M,) fp32."""
    if z_MN.dim() != 2 or z_MN.shape[1] % 2 or z_MN.stride(1) != 1:
        raise ValueError(f"z_MN must be row-major (M, 2F), got shape {tuple(z_MN.shape)} strides {z_MN.stride()}")
    M, f = z_MN.shape[0], z_MN.shape[1] // 2
    check_row_weights(w_M, M, z_MN)
    h = z_MN.new_empty(M, f)
    if h.numel() == 0:
        return h
    block_m, block_f = 32, 128
    grid = (cdiv(M, block_m), cdiv(f, block_f))
    _swiglu_fwd_kernel[grid](z_MN, h if w_M is None else w_M, h, M, f, z_MN.stride(0), h.stride(0),
                             WEIGHTED=w_M is not None, BLOCK_M=block_m, BLOCK_F=block_f, num_warps=4)
    return h


@triton.jit
def _activation_bwd_tile(z_ptr, dh_ptr, dz_ptr, h_ptr, rows64, row_ok, cols, F, stride_zm, stride_dhm, stride_dzm,
                         stride_hm, w, ACT: tl.constexpr, WRITE_H: tl.constexpr, WEIGHTED: tl.constexpr):
    """One (rows, cols) tile of the backward; returns ``dh · h`` (the row weights' gradient
    terms) when WEIGHTED."""
    mask = row_ok[:, None] & (cols[None, :] < F)
    z_ptrs = z_ptr + rows64[:, None] * stride_zm + cols[None, :]
    dz_ptrs = dz_ptr + rows64[:, None] * stride_dzm + cols[None, :]
    dh = tl.load(dh_ptr + rows64[:, None] * stride_dhm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
    prod = dh
    if ACT == 1:
        up = tl.load(z_ptrs + F, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(z)
        # the forward's expression (_swiglu_fwd_kernel), so the bits of h (h·w) match
        h = z * tl.sigmoid(z) * up
        if WEIGHTED:
            # dh is the gradient of h·w: w's gradient is <dh, h>, h's is dh·w
            prod = dh * h
            h = h * w
            dh = dh * w
        d_gate = dh * up * sig * (1.0 + z * (1.0 - sig))
        d_up = dh * z * sig
        tl.store(dz_ptrs, d_gate.to(dz_ptr.dtype.element_ty), mask=mask)
        tl.store(dz_ptrs + F, d_up.to(dz_ptr.dtype.element_ty), mask=mask)
        if WRITE_H:
            tl.store(h_ptr + rows64[:, None] * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
    else:
        s = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2.0 * tl.sigmoid(2.0 * s) - 1.0
        ds = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        dz = dh * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * ds)
        tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
    return prod


@triton.jit
def _activation_bwd_kernel(
    z_ptr, dh_ptr, w_ptr, dz_ptr, h_ptr, dw_ptr, M, F,
    stride_zm, stride_dhm, stride_dzm, stride_hm,
    ACT: tl.constexpr, WRITE_H: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = tl.cast(rows, tl.int64)
    if WEIGHTED:
        # one program per BLOCK_M whole rows: the row weight's gradient is a sum over the row,
        # made in registers and reduced across the warps once, after the loop. Measured on an
        # H100 (bf16): 0.560 ms in the OLMoE layer's profile (131072 x 1024) and 2.16 ms at
        # 32768 x 14336, against 0.595 and 2.34 for a tile grid reducing each tile's part
        # (deterministic, partial sums added by the launcher)
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)[:, None]
        dot = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            dot += _activation_bwd_tile(z_ptr, dh_ptr, dz_ptr, h_ptr, rows64, row_ok, f0 + tl.arange(0, BLOCK_F), F,
                                        stride_zm, stride_dhm, stride_dzm, stride_hm, w, ACT, WRITE_H, WEIGHTED)
        tl.store(dw_ptr + rows, tl.sum(dot, axis=1), mask=row_ok)
    else:
        # one program per tile: the same loop over whole rows ran GELU 1.03 ms against 0.97
        # (H100, 32768 x 14336), fewer programs for the same bytes
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        _activation_bwd_tile(z_ptr, dh_ptr, dz_ptr, h_ptr, rows64, row_ok, cols, F, stride_zm, stride_dhm,
                             stride_dzm, stride_hm, 1.0, ACT, WRITE_H, WEIGHTED)


def activation_backward(z_MN: torch.Tensor, dh: torch.Tensor, activation: str, return_h: bool = False,
                        w_M: torch.Tensor | None = None):
    """Gradient w.r.t. the pre-activation.

    Args:
        z_MN: (M, N) saved pre-activation, row-major.
        dh: (M, N/2) for ``"swiglu"``, (M, N) for ``"gelu"``; row-major, any float dtype: the
            gradient of the activation's output (of ``h·w`` with ``w_M``).
        activation: ``"swiglu"`` or ``"gelu"``.
        return_h: SwiGLU only: also return the activation ``h`` (M, N/2), bit-identical to
            ``swiglu_forward(z_MN, w_M)``.
        w_M: SwiGLU only: (M,) fp32 row weights the forward multiplied ``h`` by
            (:func:`swiglu_forward`); their gradient ``<dh[m], h[m]>`` (fp32, h unweighted) is
            returned too.

    Returns:
        dz_MN (M, N) in z's dtype; then h if ``return_h``, then dw_M (M,) fp32 if ``w_M`` is given.
    """
    if activation not in ("swiglu", "gelu"):
        raise ValueError(f"activation must be 'swiglu' or 'gelu', got {activation!r}")
    if (return_h or w_M is not None) and activation != "swiglu":
        raise ValueError("return_h and w_M are for swiglu only (GELU's output is the GEMM epilogue's)")
    M, N = z_MN.shape
    f = N // 2 if activation == "swiglu" else N
    if dh.shape != (M, f):
        raise ValueError(f"dh must have shape {(M, f)} for {activation}, got {tuple(dh.shape)}")
    if z_MN.stride(1) != 1 or dh.stride(1) != 1:
        raise ValueError(f"z_MN and dh must be row-major, got strides {z_MN.stride()}, {dh.stride()}")
    check_row_weights(w_M, M, z_MN)
    dz = torch.empty_like(z_MN)
    h = z_MN.new_empty(M, f) if return_h else None
    dw = torch.empty_like(w_M) if w_M is not None else None
    if dz.numel():
        block_m, block_f = 32, 128
        grid = (cdiv(M, block_m), 1 if w_M is not None else cdiv(f, block_f))
        _activation_bwd_kernel[grid](
            z_MN, dh, dz if w_M is None else w_M, dz, dz if h is None else h, dz if dw is None else dw, M, f,
            z_MN.stride(0), dh.stride(0), dz.stride(0), 0 if h is None else h.stride(0),
            ACT=ACTIVATIONS[activation], WRITE_H=return_h, WEIGHTED=w_M is not None, BLOCK_M=block_m,
            BLOCK_F=block_f, num_warps=4,
        )
    elif dw is not None:
        dw.zero_()  # no columns: empty sums
    outs = (dz,) + ((h,) if return_h else ()) + ((dw,) if w_M is not None else ())
    return outs if len(outs) > 1 else dz
