"""Token rows to send order and back, with this rank's own rows kept out of the exchange.

Legend: T tokens, D row width, K experts per token (top-k), P = T·K pairs, G ranks of the
expert-parallel group, M rows a buffer holds.

The all-to-all dispatcher orders the kept (token, slot) pairs by destination rank then expert:
pair (t, k) sits at send position ``pos[t, k]`` (``>= ends[G-1]``, the number of kept pairs:
dropped, it goes nowhere), and destination rank g owns positions ``[ends[g-1], ends[g])``. The pairs bound for this rank (``me``)
never enter the all-to-all; they are split off into a *local* buffer, the others packed into a
*remote* one, so a pair's row in its buffer is

    lo, hi = ends[me-1] (0 when me = 0), ends[me]
    lo <= p < hi:         local  row p - lo
    p < lo or hi <= p < ends[G-1]: remote row p (p < lo) or p - (hi - lo)

Why: the remote rows must be packed before the exchange starts, the local ones only before the
experts run, so the local half is written while the exchange is in flight; and the NCCL self
copy disappears. Both operations read or write each token row once per pair, the token row
itself once (the old gather read a token row once per pair: K reads).

- :func:`scatter_pairs`: ``dst[row of (t, k)] = w[t, k] · x[t]`` for the pairs of one buffer
  (dispatch forward; combine backward, which also needs ``dw[t, k] = <x[t], y[row]>``).
- :func:`gather_pairs_sum`: ``out[t] = Σ_k w[t, k] · src[row of (t, k)]`` over both buffers, fp32
  accumulation (combine forward; dispatch backward with w = 1).

Both are the gather-sum family of :mod:`kernel_floor` with ``_locate`` as the locator (and
``_to_local`` / ``_to_remote`` as the destination of one pass); their PyTorch references feed
the family's one reference (used on CPU, tested against the kernels).
"""

import torch
import triton
import triton.language as tl

from kernel_floor import check_pair_weights, gather_sum, gather_sum_reference, scatter_rows, scatter_rows_reference, use_reference


@triton.jit
def _locate(pair, live, pos_ptr, ends_ptr, me, G):
    """(is_local, is_remote, row in the local buffer, row in the remote buffer) of a block of
    pairs; see the module docstring."""
    p = tl.load(pos_ptr + pair, mask=live, other=0)
    lo = tl.load(ends_ptr + me - 1, mask=me > 0, other=0)
    hi = tl.load(ends_ptr + me)
    num_sent = tl.load(ends_ptr + G - 1)
    is_local = live & (p >= lo) & (p < hi)
    is_remote = live & ((p < lo) | ((p >= hi) & (p < num_sent)))
    return is_local, is_remote, p - lo, tl.where(p < lo, p, p - (hi - lo))


@triton.jit
def _to_local(pair, live, pos_ptr, ends_ptr, me, G):
    """The local pass sends the pairs of the local buffer (buffer 0 of this pass)."""
    is_local, _, row, _ = _locate(pair, live, pos_ptr, ends_ptr, me, G)
    return tl.where(is_local, 0, -1), row


@triton.jit
def _to_remote(pair, live, pos_ptr, ends_ptr, me, G):
    """The remote pass sends the pairs of the remote buffer (buffer 0 of this pass)."""
    _, is_remote, _, row = _locate(pair, live, pos_ptr, ends_ptr, me, G)
    return tl.where(is_remote, 0, -1), row


def locate_reference(pos_TK: torch.Tensor, ends_G: torch.Tensor, me: int):
    """PyTorch version of ``_locate`` for every pair: (is_local, is_remote, local row, remote
    row), each (T, K)."""
    lo = ends_G[me - 1] if me > 0 else ends_G.new_zeros(())
    hi, num_sent = ends_G[me], ends_G[-1]
    is_local = (pos_TK >= lo) & (pos_TK < hi)
    is_remote = (pos_TK < lo) | ((pos_TK >= hi) & (pos_TK < num_sent))
    return is_local, is_remote, pos_TK - lo, torch.where(pos_TK < lo, pos_TK, pos_TK - (hi - lo))


def scatter_pairs_reference(x_TD, pos_TK, ends_G, me, dst_MD, local, w_TK=None, y_MD=None, dw_TK=None):
    """PyTorch version of :func:`scatter_pairs` (same arguments, same writes)."""
    located = locate_reference(pos_TK, ends_G, me)
    is_local, is_remote, row_local, row_remote = located
    mine = is_local if local else is_remote
    sent = (torch.where(mine, 0, -1), row_local if local else row_remote)
    ya_MD, yb_MD = (y_MD, None) if local else (None, y_MD)
    scatter_rows_reference(x_TD, sent, located, [dst_MD], w_TK, ya_MD, yb_MD, dw_TK, zero_dropped=not local)


def gather_pairs_sum_reference(remote_MD, local_MD, pos_TK, ends_G, me, w_TK=None, out_dtype=None):
    """PyTorch version of :func:`gather_pairs_sum`."""
    return gather_sum_reference(locate_reference(pos_TK, ends_G, me), local_MD, remote_MD, w_TK,
                                out_dtype or remote_MD.dtype)


def _check_common(name, pos_TK, ends_G, me, w_TK):
    if pos_TK.dim() != 2 or pos_TK.dtype != torch.int64:
        raise ValueError(f"{name}: pos_TK must be (T, K) int64, got {pos_TK.dtype} {tuple(pos_TK.shape)}")
    if ends_G.dim() != 1 or ends_G.dtype != torch.int64 or not 0 <= me < ends_G.numel():
        raise ValueError(f"{name}: ends_G must be (G,) int64 with 0 <= me < G, got {ends_G.dtype} "
                         f"{tuple(ends_G.shape)}, me={me}")
    check_pair_weights(name, w_TK, *pos_TK.shape)


def scatter_pairs(x_TD: torch.Tensor, pos_TK: torch.Tensor, ends_G: torch.Tensor, me: int, dst_MD: torch.Tensor,
                  local: bool, w_TK: torch.Tensor | None = None, y_MD: torch.Tensor | None = None,
                  dw_TK: torch.Tensor | None = None, backend: str = "auto") -> None:
    """Write each pair of one buffer: ``dst[row of (t, k)] = w[t, k] · x[t]`` (w = 1 when None).

    Args:
        x_TD: (T, D) rows, bf16/fp16/fp32.
        pos_TK: (T, K) int64 send position of each pair (``>= ends[-1]``: dropped).
        ends_G: (G,) int64 cumulative end of each destination rank's send positions (on x's device).
        me: this rank in the group; its pairs form the local buffer.
        dst_MD: the local buffer (``local=True``, ``hi - lo`` rows) or the remote one (the kept
            pairs less ``hi - lo`` rows, or more); contiguous rows, written in place (other rows
            untouched).
        w_TK: optional (T, K) fp32 weights.
        y_MD, dw_TK: optional, together: rows of the same buffer's layout and a (T, K) fp32 output;
            each written pair also gets ``dw[t, k] = <x[t], y[row]>`` in fp32 (the combine's weight
            gradient), and the remote pass writes ``dw = 0`` for dropped pairs, so the two passes
            write every entry once (dw may start uninitialised). Pairs of the other buffer keep
            their dw.
    """
    _check_common("scatter_pairs", pos_TK, ends_G, me, w_TK)
    T, K = pos_TK.shape
    if x_TD.dim() != 2 or x_TD.shape[0] != T or dst_MD.dim() != 2 or dst_MD.shape[1] != x_TD.shape[1]:
        raise ValueError(f"scatter_pairs: x_TD {tuple(x_TD.shape)} and dst_MD {tuple(dst_MD.shape)} must be "
                         f"(T={T}, D) and (M, D)")
    if (y_MD is None) != (dw_TK is None):
        raise ValueError("scatter_pairs: y_MD and dw_TK go together")
    if dw_TK is not None and (dw_TK.shape != (T, K) or dw_TK.dtype != torch.float32 or not dw_TK.is_contiguous()):
        raise ValueError(f"scatter_pairs: dw_TK must be a contiguous fp32 ({T}, {K}) tensor (written in place), got "
                         f"{dw_TK.dtype} {tuple(dw_TK.shape)}")
    if not dst_MD.is_contiguous():
        raise ValueError("scatter_pairs: dst_MD must be contiguous (written in place)")
    if use_reference(backend, not x_TD.is_cuda):
        scatter_pairs_reference(x_TD, pos_TK, ends_G, me, dst_MD, local, w_TK, y_MD, dw_TK)
        return
    y_MD = None if y_MD is None else y_MD.contiguous()
    scatter_rows(x_TD.contiguous(), _to_local if local else _to_remote, _locate, pos_TK.contiguous(), ends_G, me,
                 ends_G.numel(), dst_MD, dst_MD.dtype, dst_MD.stride(0), K=K, w_TK=w_TK,
                 ya_MD=y_MD if local else None, yb_MD=None if local else y_MD, dw_TK=dw_TK, zero_dropped=not local)


def gather_pairs_sum(remote_MD: torch.Tensor, local_MD: torch.Tensor, pos_TK: torch.Tensor, ends_G: torch.Tensor,
                     me: int, w_TK: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """``out[t] = Σ_k w[t, k] · src[row of (t, k)]``, src the remote or the local buffer, in fp32.

    remote_MD, local_MD: (M, D) and (M', D) rows of the two buffers (same dtype); pos_TK, ends_G, me
    as in :func:`scatter_pairs`; w_TK optional (T, K) fp32 (1 when None). Dropped pairs add zero.
    Returns (T, D) in ``out_dtype`` (default the rows' dtype).
    """
    _check_common("gather_pairs_sum", pos_TK, ends_G, me, w_TK)
    if remote_MD.dim() != 2 or local_MD.dim() != 2 or remote_MD.shape[1] != local_MD.shape[1] \
            or remote_MD.dtype != local_MD.dtype:
        raise ValueError(f"gather_pairs_sum: remote_MD {remote_MD.dtype} {tuple(remote_MD.shape)} and local_MD "
                         f"{local_MD.dtype} {tuple(local_MD.shape)} must be (M, D) rows of one dtype")
    if use_reference(backend, not remote_MD.is_cuda):
        return gather_pairs_sum_reference(remote_MD, local_MD, pos_TK, ends_G, me, w_TK, out_dtype)
    T, K = pos_TK.shape
    return gather_sum(T, remote_MD.shape[1], _locate, pos_TK.contiguous(), ends_G, me, ends_G.numel(),
                      local_MD.contiguous(), remote_MD.contiguous(), w_TK, out_dtype or remote_MD.dtype, K=K)
