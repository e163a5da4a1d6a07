"""The gather-sum family: every "sum each token's K weighted rows" and its scatter-back in the
project, one forward kernel and one backward kernel, with where a pair's row lives passed in.

Legend: T tokens, K experts per token (top-k), P = T·K (token, slot) pairs, pair p = t·K + k, D row
width, M rows of a buffer.

An MoE layer hands each kept (token, slot) pair's row to an expert and sums the K expert
outputs of each token with the combine weights. Where the output row of a pair lives depends on
the transport: one buffer in dispatch order (all experts here, ``moe.kernels.combine``), the
own-rows buffer or the rows of each token summed on and received back from the other ranks
(NCCL all-to-all, ``parallel.token_rows``), the own expert output or the return buffer the peers stored into (P2P,
``parallel.p2p_rows``). Each names it with a **locator**, a ``@triton.jit`` function passed to the
kernels as a ``tl.constexpr``::

    locate(pair, live, idx0_ptr, idx1_ptr, me, n) -> (in_a, in_b, row_a, row_b)

for a block of pairs (``live`` masks the block's tail): the pair's row is ``a[row_a]`` where
``in_a``, ``b[row_b]`` where ``in_b``, nowhere (dropped, or not sent) where neither. ``idx0_ptr``,
``idx1_ptr``, ``me`` and ``n`` are the locator's own: index tensors and two integers.

- :func:`gather_sum`: ``out[t] = Σ_k (w[t, k] ·) row of (t, k)``, fp32 accumulation, one read
  of each row (the combine forward; a dispatch backward with w = 1).
- :func:`scatter_rows`: for each pair that a second jit function, the **destination**
  ``dest(pair, live, idx0_ptr, idx1_ptr, me, n) -> (buffer, row)`` (buffer < 0: none), sends
  somewhere: ``dst[buffer][row] = (w[t, k] ·) x[t]``, and with ``dw`` also
  ``dw[t, k] = <x[t], row of (t, k)>`` in fp32 (the combine backward: ``x = dout``; a dispatch
  forward without w). ``dst`` is one buffer (buffer 0) or a table of G buffer addresses
  (``peer_table``: the P2P path stores straight into the other ranks' memory). With
  ``zero_dropped`` a pair located nowhere gets ``dw = 0``. No atomics: every output element is
  written by one program, so repeated runs are bit-identical.

Programs stride over blocks of ``BLOCK_T`` tokens; per block the D columns go in chunks of
``ROW_BLOCK_D``. The grid is the caller's: one program per token (as many as T) or a capped
grid-stride walk (the P2P path: its tiles were measured fastest at 4096 programs).

:func:`gather_sum_reference` and :func:`scatter_rows_reference` are the plain PyTorch versions,
fed by a PyTorch version of the locator (the located tensors ``(in_a, in_b, row_a, row_b)``, each
(T, K)).
"""

import torch
import triton
import triton.language as tl

from kernel_floor.runtime import ROW_BLOCK_D, ROW_BLOCK_T, cdiv, grid_programs, tl_dtype


@triton.jit
def _gather_sum_kernel(out_ptr, a_ptr, b_ptr, w_ptr, idx0_ptr, idx1_ptr, me, n, T, D, stride_a, stride_b, stride_out,
                       K: tl.constexpr, LOCATE: tl.constexpr, WEIGHTED: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    offs = tl.arange(0, BLOCK_D)
    for tile in range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        live = t < T
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + offs
            ok_d = (cols < D)[None, :]
            acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            for k in range(K):
                pair = t * K + k
                in_a, in_b, row_a, row_b = LOCATE(pair, live, idx0_ptr, idx1_ptr, me, n)
                # a block whose pairs are all dropped skips its loads (a uniform branch)
                if tl.max((in_a | in_b).to(tl.int32), axis=0) > 0:
                    v = tl.load(a_ptr + row_a[:, None] * stride_a + cols[None, :], mask=in_a[:, None] & ok_d,
                                other=0.0).to(tl.float32)
                    if b_ptr is not None:
                        v += tl.load(b_ptr + row_b[:, None] * stride_b + cols[None, :], mask=in_b[:, None] & ok_d,
                                     other=0.0).to(tl.float32)
                    if WEIGHTED:
                        v = v * tl.load(w_ptr + pair, mask=live, other=0.0)[:, None]
                    acc += v
            tl.store(out_ptr + t[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=live[:, None] & ok_d)


@triton.jit
def _scatter_rows_kernel(x_ptr, dst_ptr, w_ptr, ya_ptr, yb_ptr, dw_ptr, idx0_ptr, idx1_ptr, me, n, T, D,
                         stride_x, stride_dst, stride_ya, stride_yb,
                         K: tl.constexpr, DEST: tl.constexpr, LOCATE: tl.constexpr, OUT: tl.constexpr,
                         PEER_TABLE: tl.constexpr, SCALE: tl.constexpr, DW: tl.constexpr, ZERO_DROPPED: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    offs = tl.arange(0, BLOCK_D)
    for tile in range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        live = t < T
        for k in range(K):
            pair = t * K + k
            buf, row = DEST(pair, live, idx0_ptr, idx1_ptr, me, n)
            go = live & (buf >= 0)
            if DW:
                in_a, in_b, row_a, row_b = LOCATE(pair, live, idx0_ptr, idx1_ptr, me, n)
                if ZERO_DROPPED:
                    # pairs located nowhere (dropped) get dw = 0 here, the others their dot below
                    tl.store(dw_ptr + pair, tl.zeros((BLOCK_T,), dtype=tl.float32), mask=live & ~in_a & ~in_b)
            # a block that sends none of its pairs skips the row work (a uniform branch)
            if tl.max(go.to(tl.int32), axis=0) > 0:
                if PEER_TABLE:
                    base = tl.load(dst_ptr + buf, mask=go, other=0).to(tl.pointer_type(OUT))
                    to_rows = base + row * stride_dst
                else:
                    to_rows = dst_ptr + row * stride_dst
                if SCALE:
                    wk = tl.load(w_ptr + pair, mask=go, other=0.0)
                # products summed over the columns once, after the loop: a reduction per chunk
                # would cross the warps (shared memory and a barrier) D / BLOCK_D times
                dot = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
                for d0 in range(0, D, BLOCK_D):
                    cols = d0 + offs
                    ok = go[:, None] & (cols < D)[None, :]
                    v = tl.load(x_ptr + t[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                    if DW:
                        y = tl.load(ya_ptr + row_a[:, None] * stride_ya + cols[None, :], mask=ok & in_a[:, None],
                                    other=0.0).to(tl.float32)
                        if yb_ptr is not None:
                            y += tl.load(yb_ptr + row_b[:, None] * stride_yb + cols[None, :],
                                         mask=ok & in_b[:, None], other=0.0).to(tl.float32)
                        dot += v * y
                    if SCALE:
                        v = v * wk[:, None]
                    tl.store(to_rows[:, None] + cols[None, :], v.to(OUT), mask=ok)
                if DW:
                    tl.store(dw_ptr + pair, tl.sum(dot, axis=1), mask=go)


def _grid(T: int, max_programs: int | None, block_t: int) -> tuple[int]:
    return (grid_programs(cdiv(T, block_t), max_programs),)


def gather_sum(T: int, D: int, locate, idx0: torch.Tensor, idx1: torch.Tensor | None, me: int, n: int,
               a_MD: torch.Tensor, b_MD: torch.Tensor | None = None, w_TK: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, *, K: int, block_t: int = ROW_BLOCK_T,
               max_programs: int | None = None, out_TD: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the forward: ``out_TD[t] = Σ_k (w[t, k] ·) row of (t, k)`` in fp32, cast to
    ``out_dtype`` (default a's dtype).

    Args:
        T, D, K: tokens, row width, slots per token.
        locate: the locator (see the module docstring), with its ``idx0``, ``idx1`` (a tensor or
            None), ``me`` and ``n``.
        a_MD, b_MD: the buffers the locator points into (``b_MD`` None: one buffer), row-major.
        w_TK: optional (T, K) fp32 weights (1 when None).
        block_t, max_programs: tokens per step and a cap on the grid (None: one program per block).
        out_TD: where to write (a (T, D) view with unit column stride, any row stride; its dtype
            wins over ``out_dtype``), or None: a new tensor.
    The callers check their own arguments' shapes; this launcher only launches.
    """
    if out_TD is None:
        out_TD = a_MD.new_empty((T, D), dtype=out_dtype or a_MD.dtype)
    if T == 0 or D == 0:
        return out_TD
    w_TK = None if w_TK is None else w_TK.contiguous()  # indexed by pair t·K + k
    # an empty buffer is never read (no pair locates there), but Triton rejects its null pointer
    a_MD = a_MD if a_MD.numel() else out_TD
    if b_MD is not None and not b_MD.numel():
        b_MD = out_TD
    _gather_sum_kernel[_grid(T, max_programs, block_t)](
        out_TD, a_MD, b_MD, out_TD if w_TK is None else w_TK, idx0, idx0 if idx1 is None else idx1, me, n, T, D,
        a_MD.stride(0), 0 if b_MD is None else b_MD.stride(0), out_TD.stride(0),
        K=K, LOCATE=locate, WEIGHTED=w_TK is not None,
        BLOCK_T=block_t, BLOCK_D=ROW_BLOCK_D, num_warps=4)
    return out_TD


def scatter_rows(x_TD: torch.Tensor, dest, locate, idx0: torch.Tensor, idx1: torch.Tensor | None, me: int, n: int,
                 dst: torch.Tensor, dst_dtype: torch.dtype, stride_dst: int, *, K: int, peer_table: bool = False,
                 w_TK: torch.Tensor | None = None, ya_MD: torch.Tensor | None = None, yb_MD: torch.Tensor | None = None,
                 dw_TK: torch.Tensor | None = None, zero_dropped: bool = False, block_t: int = ROW_BLOCK_T,
                 max_programs: int | None = None) -> None:
    """Launch the backward: ``dst[buffer][row] = (w[t, k] ·) x[t]`` for every pair ``dest`` sends
    somewhere, and with ``dw_TK`` (T, K) fp32 also ``dw[t, k] = <x[t], row of (t, k)>`` (rows
    found by ``locate`` in ``ya_MD`` / ``yb_MD``).

    Args:
        x_TD: (T, D) rows with unit column stride (any row stride).
        dest, locate: the destination and the locator (module docstring), sharing ``idx0``,
            ``idx1``, ``me``, ``n``.
        dst: the one destination buffer (its rows ``stride_dst`` elements apart), or with
            ``peer_table`` a (G,) int64 table of buffer addresses; ``dst_dtype`` its element type.
        zero_dropped: pairs that ``locate`` finds nowhere get ``dw = 0`` (else left untouched).
    """
    T, D = x_TD.shape
    if T == 0 or (not peer_table and dst.numel() == 0 and dw_TK is None):
        return
    w_TK = None if w_TK is None else w_TK.contiguous()  # indexed by pair t·K + k
    # empty buffers are never touched (no pair goes there), but Triton rejects their null pointers
    dst = dst if dst.numel() else x_TD
    ya_MD = x_TD if ya_MD is None or not ya_MD.numel() else ya_MD
    if yb_MD is not None and not yb_MD.numel():
        yb_MD = x_TD
    _scatter_rows_kernel[_grid(T, max_programs, block_t)](
        x_TD, dst, x_TD if w_TK is None else w_TK, ya_MD, yb_MD, x_TD if dw_TK is None else dw_TK,
        idx0, idx0 if idx1 is None else idx1, me, n, T, D,
        x_TD.stride(0), stride_dst, ya_MD.stride(0), 0 if yb_MD is None else yb_MD.stride(0),
        K=K, DEST=dest, LOCATE=locate, OUT=tl_dtype(dst_dtype), PEER_TABLE=peer_table, SCALE=w_TK is not None,
        DW=dw_TK is not None, ZERO_DROPPED=zero_dropped, BLOCK_T=block_t, BLOCK_D=ROW_BLOCK_D, num_warps=4)


def _rows_of_pairs(in_TK: torch.Tensor, row_TK: torch.Tensor, y_MD: torch.Tensor) -> torch.Tensor:
    """(T, K, D) fp32: ``y[row]`` where ``in_TK``, else 0. A gather of clamped rows and a select,
    not boolean indexing: no host sync, and it is the reference's hot path on CPU."""
    if y_MD.shape[0] == 0:
        return y_MD.new_zeros((*in_TK.shape, y_MD.shape[1]), dtype=torch.float32)
    rows_TKD = y_MD[row_TK.clamp(0, y_MD.shape[0] - 1)].float()
    return torch.where(in_TK.unsqueeze(-1), rows_TKD, 0.0)


def gather_sum_reference(located, a_MD: torch.Tensor, b_MD: torch.Tensor | None = None,
                         w_TK: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """PyTorch version of :func:`gather_sum`; ``located`` = ``(in_a, in_b, row_a, row_b)``, each
    (T, K), from a PyTorch version of the locator."""
    in_a, in_b, row_a, row_b = located
    y_TKD = _rows_of_pairs(in_a, row_a, a_MD)
    if b_MD is not None:
        y_TKD = y_TKD + _rows_of_pairs(in_b, row_b, b_MD)
    if w_TK is not None:
        y_TKD = y_TKD * w_TK.unsqueeze(-1)
    return y_TKD.sum(1).to(out_dtype or a_MD.dtype)


def scatter_rows_reference(x_TD: torch.Tensor, sent, located, dsts: list[torch.Tensor],
                           w_TK: torch.Tensor | None = None, ya_MD: torch.Tensor | None = None,
                           yb_MD: torch.Tensor | None = None, dw_TK: torch.Tensor | None = None,
                           zero_dropped: bool = False) -> None:
    """PyTorch version of :func:`scatter_rows`; ``sent`` = ``(buffer, row)`` (T, K) from a
    PyTorch version of the destination, ``located`` as for :func:`gather_sum_reference`,
    ``dsts`` the buffers by index."""
    buf_TK, row_TK = sent
    go = buf_TK >= 0
    tokens = go.nonzero()[:, 0]
    vals = x_TD[tokens].float()
    if w_TK is not None:
        vals = vals * w_TK[go].unsqueeze(-1)
    for b, dst in enumerate(dsts):
        sel = buf_TK[go] == b
        dst.index_copy_(0, row_TK[go][sel], vals[sel].to(dst.dtype))
    if dw_TK is None:
        return
    in_a, in_b, row_a, row_b = located
    y_TKD = torch.zeros(*in_a.shape, x_TD.shape[1], dtype=torch.float32, device=x_TD.device)
    for in_y, row_y, y_MD in ((in_a & go, row_a, ya_MD), (in_b & go, row_b, yb_MD)):
        if y_MD is not None:
            y_TKD = y_TKD + _rows_of_pairs(in_y, row_y, y_MD)
    dw_TK[go] = (x_TD.float().unsqueeze(1) * y_TKD).sum(-1)[go]
    if zero_dropped:
        dw_TK[~in_a & ~in_b] = 0.0
