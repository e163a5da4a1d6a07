"""The router's logits ``x_TD @ w_EDᵀ`` in fp32 precision on tensor cores (3xTF32), with its backward.

Legend: T tokens, D model dim, E experts; the kernel's own parameters keep the matmul names
(M, N, K; C = A @ B).

Why: the router is fp32 by design (routing decisions flip on logit differences far below bf16's
resolution), and PyTorch runs an fp32 GEMM with TF32 off as FFMA SIMT code: on an H100 the
router's three GEMMs (logits, dx, dw) of a 16k-token OLMoE-shaped layer took 0.34 ms of its
10.2 ms fwd+bwd, 0.59 of 8.8 ms at Qwen3-A3B's 128 experts (bench/moe_layer.py --profile),
more than the whole SwiGLU pass. ``tl.dot(..., input_precision="tf32x3")`` splits each fp32
operand into a TF32 high part and a TF32 remainder and sums three tensor-core products (the
remainder × remainder term dropped), which keeps about 21 of fp32's 24 mantissa bits: the
error stays at fp32 accumulation level, three orders below TF32's.

Also saved: the (T, D) fp32 copy ``x.float()`` that ``F.linear`` needed when the layer's input
is bf16 (and its saved bytes), and the cast of dx back; the kernel reads x in its own dtype and
converts in registers. Measured per call on an H100 (T 16k, D 2048, bf16 x; ours / PyTorch fp32,
ms): logits 0.080 / 0.209 (E 64), 0.126 / 0.288 (E 128); dx (3xTF32) 0.108 / 0.204, 0.185 /
0.299; dw 0.128 / 0.104, 0.241 / 0.180 (PyTorch's from the saved fp32 copy). In the layer: 0.29
ms of kernels where the fp32 path took 0.52 (OLMoE shape). With fp32 x (the training model's
fp32 norm output) there is no cast to save and PyTorch's logits were faster at E 64 (0.108 vs
0.187 ms): Triton 3.6 lowers 3xTF32 to three mma.sync products, not wgmma. So ``"auto"`` runs
the kernel for 16-bit x only.

One kernel serves the three products through strides:
- forward ``logits_TE = x_TD @ w_EDᵀ`` (A = x, B = wᵀ);
- ``dx_TD = dlogits_TE @ w_ED`` (A = dlogits, B = w), stored in x's dtype (plain TF32 products for
  bf16 x: finer than its 7-bit rounding);
- ``dw_ED = dlogits_TEᵀ @ x_TD`` (A = dlogitsᵀ, B = x): a reduction over T into only
  ``cdiv(E, BLOCK_M) · cdiv(D, BLOCK_N)`` tiles (16 at E 64, D 2048), so it is split over T
  into partial sums (SPLIT, E, D) that one ``sum(0)`` adds in a fixed order: deterministic.
Off CUDA (and for fp64 inputs) the logits are PyTorch's ``F.linear`` on fp32 copies, as before.
"""

import torch
import triton
import triton.language as tl

from kernel_floor import AUTOTUNE, INTERPRET, band_swizzle, cdiv, fixed_config, next_power_of_2, sm_count, use_reference


def _configs():
    # One BLOCK_K for all: 3xTF32 sums each BLOCK_K slice's three products before adding them to
    # the accumulator, so the slice width sets the rounding. With one width a token's logits do
    # not depend on which config the autotuner timed fastest for this token count (T / N on N
    # ranks vs T on one; top-k turns an ulp into another route).
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in [
            (128, 128, 32, 8, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3), (64, 64, 32, 4, 4),
        ]
    ]


def _prune(configs, named_args, **kwargs):
    if AUTOTUNE or INTERPRET:
        return configs
    tile = lambda kw: (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"]  # noqa: E731
    return fixed_config(configs, tile, 4)


def _bucket(n: int) -> int:
    """Autotune key for a length that varies between calls (tokens): its power-of-2 bucket."""
    return min(max(next_power_of_2(n), 256), 1 << 16)


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K_BUCKET"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _mm_3xtf32_kernel(a_ptr, b_ptr, c_ptr, M, N, K, k_per_split, M_BUCKET, K_BUCKET,
                      stride_am, stride_ak, stride_bk, stride_bn, stride_cs, stride_cm, stride_cn,
                      PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[split] = A[:, ks] @ B[ks, :] over the split's slice ks of K, fp32 accumulation,
    operands of any float dtype converted to fp32 in registers."""
    tile_m, tile_n = band_swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), 8)
    split = tl.program_id(1)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + tl.cast(offs_m, tl.int64)[:, None] * stride_am
    b_cols = b_ptr + tl.cast(offs_n, tl.int64)[None, :] * stride_bn
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        k64 = tl.cast(offs_k, tl.int64)
        a = tl.load(a_rows + k64[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + k64[:, None] * stride_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    c = c_ptr + split * stride_cs + tl.cast(offs_m, tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, splits: int = 1,
            precision: str = "tf32x3") -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` (any strides) -> (M, N) in ``out_dtype``, products at
    ``precision`` (tl.dot's input_precision); with ``splits`` > 1 the K range is cut into that
    many slices summed in order after the kernel."""
    M, K = a.shape
    N = b.shape[1]
    k_per_split = cdiv(cdiv(K, splits), 128) * 128  # a multiple of every BLOCK_K
    splits = cdiv(K, k_per_split) if K else 1
    c = torch.empty(splits, M, N, device=a.device, dtype=torch.float32 if splits > 1 else out_dtype)
    if M == 0 or N == 0:
        return c.sum(0).to(out_dtype)
    if K == 0:
        return c.zero_().sum(0).to(out_dtype)
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]), splits)  # noqa: E731
    _mm_3xtf32_kernel[grid](a, b, c, M, N, K, k_per_split, _bucket(M), _bucket(K),
                            a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                            c.stride(0), c.stride(1), c.stride(2), PRECISION=precision)
    return c[0] if splits == 1 else c.sum(0).to(out_dtype)


def _weight_grad_splits(E: int, D: int, T: int, device: torch.device) -> int:
    """Slices of T for ``dw``: enough programs for two waves counted in the largest (128x128) tiles."""
    tiles = max(cdiv(E, 128) * cdiv(D, 128), 1)
    return max(1, min(cdiv(2 * sm_count(device), tiles), cdiv(T, 1024)))


class RouterLogitsFn(torch.autograd.Function):
    """x_TD (T, D) any float dtype, w_ED (E, D) fp32 -> logits_TE (T, E) fp32 (3xTF32 kernel)."""

    @staticmethod
    def forward(ctx, x_TD, w_ED):
        ctx.save_for_backward(x_TD, w_ED)
        return _matmul(x_TD, w_ED.t(), torch.float32)

    @staticmethod
    def backward(ctx, dlogits_TE):
        x_TD, w_ED = ctx.saved_tensors
        dlogits_TE = dlogits_TE.float()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # dx is stored in x's dtype: for bf16 x plain TF32 products (10-bit mantissa) are
            # finer than the result's 7-bit rounding; fp16 (10 bits) and fp32 keep the 3x split
            precision = "tf32" if x_TD.dtype == torch.bfloat16 else "tf32x3"
            dx = _matmul(dlogits_TE, w_ED, x_TD.dtype, precision=precision)
        if ctx.needs_input_grad[1]:
            T, D = x_TD.shape
            splits = _weight_grad_splits(w_ED.shape[0], D, T, x_TD.device)
            dw = _matmul(dlogits_TE.t(), x_TD, w_ED.dtype, splits)
        return dx, dw


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``x_TD @ w_EDᵀ`` in fp32, (T, E), differentiable; autocast does not apply.

    ``backend``: ``"auto"`` runs the Triton kernel for bf16/fp16 x on CUDA (fp32 x has no cast
    to save, and PyTorch's fp32 GEMM was as fast or faster, see the module docstring) and the
    reference elsewhere; ``"triton"`` forces the kernel for any float x but fp64 (tests run it
    under the interpreter); ``"reference"``: ``F.linear`` on fp32 copies (fp64 inputs too: the
    router is fp32).
    """
    sixteen_bit = x_TD.dtype in (torch.bfloat16, torch.float16)
    with torch.autocast(device_type=x_TD.device.type, enabled=False):
        if use_reference(backend, not (x_TD.is_cuda and sixteen_bit)) or torch.float64 in (x_TD.dtype, w_ED.dtype):
            return torch.nn.functional.linear(x_TD.float(), w_ED.float())
        return RouterLogitsFn.apply(x_TD, w_ED.float())
