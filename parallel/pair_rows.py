"""Token rows to send order and back, with this rank's own rows kept out of the exchange.

Legend: T tokens, D row width, K slots per token, P = T·K pairs, G ranks of the expert-parallel
group, S pairs sent (kept), N rows a buffer holds.

The all-to-all dispatcher orders the kept (token, slot) pairs by destination rank then expert:
pair (t, k) sits at send position ``pos[t, k]`` (``>= S``: dropped, goes nowhere), and
destination rank g owns positions ``[ends[g-1], ends[g])``. The pairs bound for this rank (``me``)
never enter the all-to-all; they are split off into a *local* buffer, the others packed into a
*remote* one, so a pair's row in its buffer is

    lo, hi = ends[me-1] (0 when me = 0), ends[me]
    lo <= p < hi:         local  row p - lo
    p < lo or hi <= p < S: remote row p (p < lo) or p - (hi - lo)

Why: the remote rows must be packed before the exchange starts, the local ones only before the
experts run, so the local half is written while the exchange is in flight; and the NCCL self
copy disappears. Both operations read or write each token row once per pair, the token row
itself once (the old gather read a token row once per pair: K reads).

- :func:`scatter_pairs`: ``dst[row of (t, k)] = w[t, k] · x[t]`` for the pairs of one buffer
  (dispatch forward; combine backward, which also needs ``dw[t, k] = <x[t], y[row]>``).
- :func:`gather_pairs_sum`: ``out[t] = Σ_k w[t, k] · src[row of (t, k)]`` over both buffers, fp32
  accumulation (combine forward; dispatch backward with w = 1).

Both have a plain PyTorch reference beside them (used on CPU, tested against the kernels).
"""

import torch
import triton
import triton.language as tl

from moe.kernels.launch import INTERPRET, use_reference

# 1024 bf16 columns over 4 warps: 8 per thread, 16-byte accesses (as moe/kernels/combine.py).
_BLOCK_D = 64 if INTERPRET else 1024


@triton.jit
def _locate(pos_ptr, ends_ptr, pair, me, G):
    """(is_local, is_remote, row in its buffer) of one pair; see the module docstring."""
    p = tl.load(pos_ptr + pair)
    lo = tl.load(ends_ptr + me - 1, mask=me > 0, other=0)
    hi = tl.load(ends_ptr + me)
    num_sent = tl.load(ends_ptr + G - 1)
    is_local = (p >= lo) & (p < hi)
    is_remote = (p < lo) | ((p >= hi) & (p < num_sent))
    row = tl.where(is_local, p - lo, tl.where(p < lo, p, p - (hi - lo)))
    return is_local, is_remote, row.to(tl.int64)


@triton.jit
def _scatter_pairs_kernel(x_ptr, pos_ptr, ends_ptr, me, G, dst_ptr, w_ptr, y_ptr, dw_ptr, D,
                          stride_x, stride_dst, stride_y,
                          K: tl.constexpr, LOCAL: tl.constexpr, HAS_W: tl.constexpr, HAS_DW: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    for k in range(K):
        is_local, is_remote, row = _locate(pos_ptr, ends_ptr, t * K + k, me, G)
        mine = is_local if LOCAL else is_remote
        if HAS_DW:
            if not LOCAL:
                if (~is_local) & (~is_remote):
                    tl.store(dw_ptr + t * K + k, 0.0)  # dropped pair: its weight gets no gradient
        if mine:
            dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
            wk = tl.load(w_ptr + t * K + k) if HAS_W else 1.0
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + offs
                x = tl.load(x_ptr + t * stride_x + cols, mask=cols < D, other=0.0)
                if HAS_W:
                    val = (wk * x.to(tl.float32)).to(dst_ptr.dtype.element_ty)
                else:
                    val = x.to(dst_ptr.dtype.element_ty)
                tl.store(dst_ptr + row * stride_dst + cols, val, mask=cols < D)
                if HAS_DW:
                    y = tl.load(y_ptr + row * stride_y + cols, mask=cols < D, other=0.0)
                    dot += x.to(tl.float32) * y.to(tl.float32)
            if HAS_DW:
                tl.store(dw_ptr + t * K + k, tl.sum(dot, axis=0))


@triton.jit
def _gather_pairs_sum_kernel(remote_ptr, local_ptr, pos_ptr, ends_ptr, me, G, w_ptr, out_ptr, D,
                             stride_remote, stride_local, stride_out,
                             K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + offs
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for k in range(K):
            is_local, is_remote, row = _locate(pos_ptr, ends_ptr, t * K + k, me, G)
            wk = tl.load(w_ptr + t * K + k) if HAS_W else 1.0
            if is_local:
                acc += wk * tl.load(local_ptr + row * stride_local + cols, mask=cols < D, other=0.0).to(tl.float32)
            elif is_remote:
                acc += wk * tl.load(remote_ptr + row * stride_remote + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < D)


def locate_reference(pos_TK: torch.Tensor, ends_G: torch.Tensor, me: int):
    """PyTorch version of ``_locate`` for every pair: (is_local, is_remote, row), each (T, K)."""
    lo = ends_G[me - 1] if me > 0 else ends_G.new_zeros(())
    hi, num_sent = ends_G[me], ends_G[-1]
    is_local = (pos_TK >= lo) & (pos_TK < hi)
    is_remote = (pos_TK < lo) | ((pos_TK >= hi) & (pos_TK < num_sent))
    row = torch.where(is_local, pos_TK - lo, torch.where(pos_TK < lo, pos_TK, pos_TK - (hi - lo)))
    return is_local, is_remote, row


def scatter_pairs_reference(x_TD, pos_TK, ends_G, me, dst_ND, local, w_TK=None, y_ND=None, dw_TK=None):
    """PyTorch version of :func:`scatter_pairs` (same arguments, same writes)."""
    is_local, is_remote, row = locate_reference(pos_TK, ends_G, me)
    mine = is_local if local else is_remote
    tokens = mine.nonzero()[:, 0]
    rows = row[mine]
    vals = x_TD[tokens].float()
    if w_TK is not None:
        vals = vals * w_TK[mine].unsqueeze(-1)
    dst_ND.index_copy_(0, rows, vals.to(dst_ND.dtype))
    if dw_TK is not None:
        dw_TK[mine] = (x_TD[tokens].float() * y_ND[rows].float()).sum(-1)
        if not local:
            dw_TK[~(is_local | is_remote)] = 0.0


def gather_pairs_sum_reference(remote_ND, local_ND, pos_TK, ends_G, me, w_TK=None, out_dtype=None):
    """PyTorch version of :func:`gather_pairs_sum`."""
    T, K = pos_TK.shape
    is_local, is_remote, row = locate_reference(pos_TK, ends_G, me)
    y_TKD = remote_ND.new_zeros((T, K, remote_ND.shape[1]), dtype=torch.float32)
    y_TKD[is_local] = local_ND[row[is_local]].float()
    y_TKD[is_remote] = remote_ND[row[is_remote]].float()
    if w_TK is not None:
        y_TKD = y_TKD * w_TK.unsqueeze(-1)
    return y_TKD.sum(1).to(out_dtype or remote_ND.dtype)


def _check_common(name, pos_TK, ends_G, me, w_TK):
    if pos_TK.dim() != 2 or pos_TK.dtype != torch.int64:
        raise ValueError(f"{name}: pos_TK must be (T, K) int64, got {pos_TK.dtype} {tuple(pos_TK.shape)}")
    if ends_G.dim() != 1 or ends_G.dtype != torch.int64 or not 0 <= me < ends_G.numel():
        raise ValueError(f"{name}: ends_G must be (G,) int64 with 0 <= me < G, got {ends_G.dtype} "
                         f"{tuple(ends_G.shape)}, me={me}")
    if w_TK is not None and (w_TK.shape != pos_TK.shape or w_TK.dtype != torch.float32):
        raise ValueError(f"{name}: w_TK must be fp32 of shape {tuple(pos_TK.shape)}, got {w_TK.dtype} {tuple(w_TK.shape)}")


def scatter_pairs(x_TD: torch.Tensor, pos_TK: torch.Tensor, ends_G: torch.Tensor, me: int, dst_ND: torch.Tensor,
                  local: bool, w_TK: torch.Tensor | None = None, y_ND: torch.Tensor | None = None,
                  dw_TK: torch.Tensor | None = None, backend: str = "auto") -> None:
    """Write each pair of one buffer: ``dst[row of (t, k)] = w[t, k] · x[t]`` (w = 1 when None).

    Args:
        x_TD: (T, D) rows, bf16/fp16/fp32.
        pos_TK: (T, K) int64 send position of each pair (``>= ends[-1]``: dropped).
        ends_G: (G,) int64 cumulative end of each destination rank's send positions (on x's device).
        me: this rank in the group; its pairs form the local buffer.
        dst_ND: the local buffer (``local=True``, ``hi - lo`` rows) or the remote one (``S - (hi - lo)``
            rows, or more); contiguous rows, written in place (other rows untouched).
        w_TK: optional (T, K) fp32 weights.
        y_ND, dw_TK: optional, together: rows of the same buffer's layout and a (T, K) fp32 output;
            each written pair also gets ``dw[t, k] = <x[t], y[row]>`` in fp32 (the combine's weight
            gradient), and the remote pass writes ``dw = 0`` for dropped pairs, so the two passes
            write every entry once (dw may start uninitialised). Pairs of the other buffer keep
            their dw.
    """
    _check_common("scatter_pairs", pos_TK, ends_G, me, w_TK)
    T, K = pos_TK.shape
    if x_TD.dim() != 2 or x_TD.shape[0] != T or dst_ND.dim() != 2 or dst_ND.shape[1] != x_TD.shape[1]:
        raise ValueError(f"scatter_pairs: x_TD {tuple(x_TD.shape)} and dst_ND {tuple(dst_ND.shape)} must be "
                         f"(T={T}, D) and (N, D)")
    if (y_ND is None) != (dw_TK is None):
        raise ValueError("scatter_pairs: y_ND and dw_TK go together")
    if not dst_ND.is_contiguous():
        raise ValueError("scatter_pairs: dst_ND must be contiguous (written in place)")
    if use_reference(backend, not x_TD.is_cuda):
        scatter_pairs_reference(x_TD, pos_TK, ends_G, me, dst_ND, local, w_TK, y_ND, dw_TK)
        return
    has_dw = dw_TK is not None
    if T == 0 or (dst_ND.numel() == 0 and not has_dw):
        return
    x_TD, pos_TK = x_TD.contiguous(), pos_TK.contiguous()
    # an empty buffer is never written (no pair locates there), but Triton rejects its null pointer
    _scatter_pairs_kernel[(T,)](
        x_TD, pos_TK, ends_G, me, ends_G.numel(), dst_ND if dst_ND.numel() else x_TD,
        w_TK if w_TK is not None else x_TD,
        y_ND.contiguous() if has_dw and y_ND.numel() else x_TD, dw_TK if has_dw else x_TD, x_TD.shape[1],
        x_TD.stride(0), dst_ND.stride(0), y_ND.stride(0) if has_dw else 0,
        K=K, LOCAL=local, HAS_W=w_TK is not None, HAS_DW=has_dw, BLOCK_D=_BLOCK_D, num_warps=4)


def gather_pairs_sum(remote_ND: torch.Tensor, local_ND: torch.Tensor, pos_TK: torch.Tensor, ends_G: torch.Tensor,
                     me: int, w_TK: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """``out[t] = Σ_k w[t, k] · src[row of (t, k)]``, src the remote or the local buffer, in fp32.

    remote_ND, local_ND: (N, D) and (N', D) rows of the two buffers (same dtype); pos_TK, ends_G, me
    as in :func:`scatter_pairs`; w_TK optional (T, K) fp32 (1 when None). Dropped pairs add zero.
    Returns (T, D) in ``out_dtype`` (default the rows' dtype).
    """
    _check_common("gather_pairs_sum", pos_TK, ends_G, me, w_TK)
    if remote_ND.dim() != 2 or local_ND.dim() != 2 or remote_ND.shape[1] != local_ND.shape[1] \
            or remote_ND.dtype != local_ND.dtype:
        raise ValueError(f"gather_pairs_sum: remote_ND {remote_ND.dtype} {tuple(remote_ND.shape)} and local_ND "
                         f"{local_ND.dtype} {tuple(local_ND.shape)} must be (N, D) rows of one dtype")
    if use_reference(backend, not remote_ND.is_cuda):
        return gather_pairs_sum_reference(remote_ND, local_ND, pos_TK, ends_G, me, w_TK, out_dtype)
    T, K = pos_TK.shape
    D = remote_ND.shape[1]
    out_TD = remote_ND.new_empty((T, D), dtype=out_dtype or remote_ND.dtype)
    if T == 0 or D == 0:
        return out_TD
    remote_ND, local_ND = remote_ND.contiguous(), local_ND.contiguous()
    # an empty buffer is never read (no pair locates there), but Triton rejects its null pointer
    _gather_pairs_sum_kernel[(T,)](
        remote_ND if remote_ND.numel() else out_TD, local_ND if local_ND.numel() else out_TD, pos_TK.contiguous(), ends_G, me, ends_G.numel(),
        w_TK if w_TK is not None else remote_ND, out_TD, D, remote_ND.stride(0), local_ND.stride(0),
        out_TD.stride(0), K=K, HAS_W=w_TK is not None, BLOCK_D=_BLOCK_D, num_warps=4)
    return out_TD
