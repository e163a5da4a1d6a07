"""Rows moved straight between the GPUs of one node: Triton kernels that store into the other
ranks' symmetric-memory buffers (NVLink peer stores), each with a plain PyTorch reference beside
it.

Legend: T tokens, K experts per token (top-k), D model dim, G ranks of the expert-parallel group,
E experts, R_cap rows of each rank's receive buffer, P_cap = max_tokens · K pair places of each
rank's return buffer.

A pair (t, k) of a source rank that is kept has a place ``row_TK[t, k]`` in the receive buffer of
rank ``dest_TK[t, k]`` (-1: dropped, it goes nowhere). A received row r remembers where it came
from as ``src_R[r] = source · P_cap + t · K + k``. ``*_ptrs_G`` hold the G buffers' addresses as
int64, this rank's own included, so that one program can reach any rank's buffer (how
``torch.distributed._symmetric_memory`` exposes the peers' memory).

Ordering between ranks without a barrier launch: a phase that stores into the peers' buffers
ends each program with a CTA barrier and a release atomic add (system scope) on a *flag* of the
receiver; the kernel that reads spins (acquire, system scope) until its own flag reaches a
target: flags only grow, and each phase adds a fixed number of signals (the counts: one per rank;
push_back: one per program per peer, its grid fixed by R_cap, which every rank shares). The
targets live on the device, advanced by the kernels themselves (the counts' one-program exchange;
push_back's first program; signal_peers), never passed from the host: a captured CUDA graph replays
the same launches and the targets still advance (train/step_graph.py). A wait that passes its
timeout prints and traps (the process dies with a CUDA error instead of hanging). In Triton's
interpreter (one process, the ranks run one after another) a wait does not spin: the tests run
every rank's phase before the next and check the flags, and a wait whose target is not met adds
``UNMET`` to its flag, so that a test sees which target a kernel waited for (one that waited for
too little would otherwise pass unseen).
Why: on 2×H200 a Mixtral-like dispatch + combine at 4k tokens took ~255 µs of GPU and ~275 µs of
host per call (Triton launches cost 15-40 µs of host each); flags, and the counts and routes folded
into one dispatch kernel, took it from 8 launches to 4 (the counts' exchange is now its own
one-program kernel again, for the reason below). Every wait is a one-program kernel of its
own (the counts' exchange, the way back's wait before the sum): a wait spun in every program of a
grid held all the SMs while a peer was late, against a kernel overlapping it on another stream
(overlap_chunks' GEMMs); one more launch each, which a captured graph makes cheap.

- ``dispatch_rows``: row ``me`` of every rank's (G, E) count matrix = this rank's (E,) counts
  (one program, a signal to each rank, the wait for all); then a kernel for each kept pair's row
  at its destination and this rank's experts' row ends, and every kept pair's row of x stored into
  its destination's receive buffer with where it came from and its weight. Two launches where ~30
  small torch ops and three kernels were (the routes alone made the 4k dispatch 4× faster than
  those ops).
- ``push_rows``: ``buf[dest][row] = x[t]`` for every kept pair: the combine's backward. One
  program per token.
- ``return_table``: on the receiver, each (source, token)'s rows of its receive buffer, for the
  sum that goes home as one row (PyTorch, one scatter).
- ``push_back``: the receiver's side of the way home: every valid row r (r < ``n_rows``, a device
  scalar) that came from another rank (or any rank, ``own_too``) is stored at its place of that
  rank's return buffer (the dispatcher's: a (source, token)'s summed rows; in the dispatch
  backward also each pair's weight gradient, alone); then each program signals every peer's flag.
- ``signal_peers``: one signal to every peer's flag, after the copy engines' block copies of the
  way back (the dispatcher's ``copy_engine`` mode, where no kernel stores the rows).
- ``sum_returned``: (after waiting for the flag) ``out[t] = Σ_g`` of token t's G returned rows,
  in fp32. No peer memory touched.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from kernel_floor import (
    INTERPRET, ROW_BLOCK_D, cdiv, check_pair_weights, check_rows, gather_sum, gather_sum_reference,
    grid_programs, next_power_of_2, scatter_rows, scatter_rows_reference, tl_dtype,
)
from moe.config import check_positive_int

# Tiles of the kernels: [_BLOCK_ROWS rows, ROW_BLOCK_D] per step, at most _MAX_PROGRAMS programs
# striding over the rows. Per-kernel µs on 2×H200 at 16k tokens/rank (dispatch_rows, push_back,
# and sum_pairs, which summed each token's pair rows before the way home summed them first),
# Mixtral-like / fine-grained: [1, 1024] × 4096 programs 414/407/110 and
# 811/804/170; [4, 512] × 2048 432/415/133 and 849/833/212; [8, 256] × 2048 452/421/133 and
# 804/825/214; [4, 1024] × 1056 458/427/154 and 875/878/257.
_BLOCK_ROWS = 2 if INTERPRET else 1
_MAX_PROGRAMS = 4 if INTERPRET else 4096
TIMEOUT_MS = 120_000
_INTERPRET = tl.constexpr(INTERPRET)
UNMET = 1 << 40  # what an unmet wait adds to its flag in the interpreter
_UNMET = tl.constexpr(UNMET)


@triton.jit
def _signal(flag_ptrs, rank):
    """Every prior store of this program is visible to ``rank`` before its flag grows by 1."""
    tl.debug_barrier()
    flag = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int64))
    tl.atomic_add(flag, 1, sem="release", scope="sys")


@triton.jit
def _wait(flag_ptr, target, timeout_ns):
    """Spin until this rank's flag reaches ``target``; then the peers' stores before their
    signals are visible to the whole program. Past ``timeout_ns``: print and trap."""
    if not _INTERPRET:
        start = globaltimer()
        while tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys") < target:
            if globaltimer() - start > timeout_ns:
                if tl.program_id(0) == 0:
                    tl.device_print("P2P wait timed out (a peer never signalled: ranks disagree on the calls?); flag target",
                                    target)
                tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
    else:
        if tl.load(flag_ptr) < target:
            tl.atomic_add(flag_ptr, _UNMET)


@triton.jit
def _wait_expected(flag_ptr, expect_ptr, timeout_ns):
    """:func:`_wait` for the target stored at ``expect_ptr`` (by an earlier launch)."""
    _wait(flag_ptr, tl.load(expect_ptr), timeout_ns)


@triton.jit
def _wait_flag_kernel(flag_ptr, expect_ptr, timeout_ns):
    """One program's :func:`_wait_expected`, so that a wait holds one SM, not a grid's: the
    launch after it on the stream starts once the peers' stores are visible (as after the
    symmetric-memory barrier), and a kernel beside it on another stream keeps the other SMs."""
    _wait_expected(flag_ptr, expect_ptr, timeout_ns)


@triton.jit
def _count_matrix(counts_ptr, me, G, L, E, GP: tl.constexpr, LP: tl.constexpr):
    """This rank's (G, E) count matrix as [source, destination, local expert], with the
    destinations' row tables: (C, per_expert [destination, local expert], the first row of this
    rank's pairs there, the most rows any destination receives)."""
    s = tl.arange(0, GP)
    l = tl.arange(0, LP)
    ok3 = (s[:, None, None] < G) & (s[None, :, None] < G) & (l[None, None, :] < L)
    C = tl.load(counts_ptr + s[:, None, None] * E + s[None, :, None] * L + l[None, None, :], mask=ok3, other=0)
    # [destination, local expert] tables; a destination's rows are expert-major, each expert's
    # rows by source rank (moe.kernels.grouped_mm then takes one segment per expert)
    per_expert = tl.sum(C, axis=0)
    first = tl.cumsum(per_expert, axis=1) - per_expert + tl.sum(tl.where(s[:, None, None] < me, C, 0), axis=0)
    return C, per_expert, first, tl.max(tl.sum(per_expert, axis=1), axis=0)


@triton.jit
def _exchange_counts_kernel(mine_ptr, cnt_ptrs, flag_ptrs, state_ptr, counts_ptr, flag_ptr, timeout_ns, me, G, L, E,
                            R_cap, GP: tl.constexpr, LP: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: this rank's counts into every rank's count matrix, a signal to each, then the
    wait for the G ranks' counts (the flag reaching ``state + G``), and ``state`` advanced to that
    target. One program, so the wait holds one SM, not a grid's (a kernel beside it on
    another stream keeps the others); the rows kernel after it on the stream reads the matrix. A
    matrix that gives some rank more than R_cap rows: on a GPU this program, which has signalled
    every rank by then, prints and traps, so every rank stops (all read the same matrix) and none
    waits for counts that never come."""
    target = tl.load(state_ptr) + G
    e = tl.arange(0, BLOCK_E)
    mine_E = tl.load(mine_ptr + e, mask=e < E)
    for g in range(G):
        dst = tl.load(cnt_ptrs + g).to(tl.pointer_type(tl.int64))
        tl.store(dst + me * E + e, mine_E, mask=e < E)
        _signal(flag_ptrs, g)
    _wait(flag_ptr, target, timeout_ns)
    if not _INTERPRET:
        most = _count_matrix(counts_ptr, me, G, L, E, GP, LP)[3]
        if most > R_cap:
            tl.device_print("P2P dispatch: a rank would receive more rows than its buffer holds (the "
                            "dispatcher's capacity_factor/capacity_groups below the layers'?); rows, buffer rows",
                            most, R_cap)
            tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(state_ptr, target)


@triton.jit
def _dispatch_rows_kernel(x_ptr, order_ptr, counts_ptr, row_ptr, dest_ptr, offsets_ptr, recv_ptrs, src_ptrs, w_ptr,
                          wrecv_ptrs, lead_ptr, tokrow_ptr, tokof_ptrs, T_cap,
                          me, G, L, E, P, K, P_cap, R_cap, D, OUT: tl.constexpr, GP: tl.constexpr, LP: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """After :func:`_exchange_counts_kernel`: the programs stride over tiles of BLOCK_P sorted
    positions of ``order``; every program derives the few per-rank sums it needs from the (G, E)
    count matrix, program 0 also writes this rank's experts' row ends. A matrix that gives some
    rank more than R_cap rows moves nothing (every rank reads the same matrix)."""
    s = tl.arange(0, GP)
    l = tl.arange(0, LP)
    C, per_expert, first, most = _count_matrix(counts_ptr, me, G, L, E, GP, LP)
    overflow = most > R_cap  # a destination whose buffer cannot hold its rows
    mine = tl.sum(tl.where(s[:, None, None] == me, C, 0), axis=0)  # what I send to each (destination, expert)
    mine_D = tl.sum(mine, axis=1)  # ... and to each destination
    seg_end = (tl.cumsum(mine_D, axis=0) - mine_D)[:, None] + tl.cumsum(mine, axis=1)  # in my sorted order
    shift = first - (seg_end - mine)  # sorted position -> row at the destination
    seg_end = tl.where((s[:, None] < G) & (l[None, :] < L), seg_end, tl.cast(2**62, tl.int64))
    n_kept = tl.where(overflow, 0, tl.sum(mine_D, axis=0))  # overflow: no store at all

    if tl.program_id(0) == 0:
        mine_rows = tl.sum(tl.where(s[:, None] == me, per_expert, 0), axis=0)  # [local expert] rows I receive
        tl.store(offsets_ptr + l, tl.cumsum(mine_rows, axis=0).to(tl.int32), mask=(l < L) & ~overflow)

    offs = tl.arange(0, BLOCK_D)
    for tile in range(tl.program_id(0), tl.cdiv(P, BLOCK_P), tl.num_programs(0)):
        i = tile * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
        inside = i < P
        pair = tl.load(order_ptr + i, mask=inside, other=0)
        seg = tl.sum(tl.sum((seg_end[None, :, :] <= i[:, None, None]).to(tl.int64), axis=2), axis=1)  # d·L + l
        d = seg // L
        kept = inside & (i < n_kept)
        at = (s[None, :, None] == d[:, None, None]) & (l[None, None, :] == (seg % L)[:, None, None])
        row = i + tl.sum(tl.sum(tl.where(at, shift[None, :, :], 0), axis=2), axis=1)
        tl.store(row_ptr + pair, tl.where(kept, row, -1), mask=inside)
        tl.store(dest_ptr + pair, tl.where(kept, d, 0), mask=inside)
        t = pair // K
        tok_row = me * T_cap + t
        if ROWS:
            # the token's row crosses to rank d once: the first of its kept pairs there to take the
            # (token, rank) ticket stores it, at row me·T_cap + t of d's token buffer
            leads = kept & (tl.atomic_add(lead_ptr + t * G + d, 1, mask=kept) == 0)
            tl.store(tokrow_ptr + pair, tl.where(leads, tok_row, -1), mask=inside)
            to_rows = tl.load(recv_ptrs + d, mask=leads, other=0).to(tl.pointer_type(OUT)) + tok_row * D
            for c in range(0, D, BLOCK_D):
                ok = leads[:, None] & (c + offs[None, :] < D)
                v = tl.load(x_ptr + t[:, None] * D + c + offs[None, :], mask=ok, other=0.0)
                tl.store(to_rows[:, None] + c + offs[None, :], v.to(OUT), mask=ok)
        else:  # the caller copies the whole token block (copy engines): no pair stores a row
            tl.store(tokrow_ptr + pair, -1, mask=inside)
        to_tok = tl.load(tokof_ptrs + d, mask=kept, other=0).to(tl.pointer_type(tl.int64))
        tl.store(to_tok + row, tok_row, mask=kept)
        to_src = tl.load(src_ptrs + d, mask=kept, other=0).to(tl.pointer_type(tl.int64))
        tl.store(to_src + row, me * P_cap + pair, mask=kept)
        to_w = tl.load(wrecv_ptrs + d, mask=kept, other=0).to(tl.pointer_type(tl.float32))
        tl.store(to_w + row, tl.load(w_ptr + pair, mask=kept, other=0.0), mask=kept)


@triton.jit
def _push_back_kernel(y_ptr, src_ptr, n_ptr, ret_ptrs, g_ptr, retw_ptrs, flag_ptrs, expect_ptr, me, G, P_cap, D,
                      OUT: tl.constexpr, HAS_G: tl.constexpr, OWN_TOO: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    if tl.program_id(0) == 0:  # the peers' matching calls signal this rank as often as this one signals each
        tl.store(expect_ptr, tl.load(expect_ptr) + (G - 1) * tl.num_programs(0))
    offs = tl.arange(0, BLOCK_D)
    n = tl.load(n_ptr).to(tl.int64)
    for tile in range(tl.program_id(0), tl.cdiv(n, BLOCK_R), tl.num_programs(0)):
        r = tile * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        src = tl.load(src_ptr + r, mask=r < n, other=0)
        rank = src // P_cap
        away = (r < n) & (src >= 0) & ((rank != me) | OWN_TOO)
        to_rows = tl.load(ret_ptrs + rank, mask=away, other=0).to(tl.pointer_type(OUT)) + (src % P_cap) * D
        for c in range(0, D, BLOCK_D):
            ok = away[:, None] & (c + offs[None, :] < D)
            v = tl.load(y_ptr + r[:, None] * D + c + offs[None, :], mask=ok, other=0.0)
            tl.store(to_rows[:, None] + c + offs[None, :], v.to(OUT), mask=ok)
        if HAS_G:
            to_g = tl.load(retw_ptrs + rank, mask=away, other=0).to(tl.pointer_type(tl.float32))
            tl.store(to_g + src % P_cap, tl.load(g_ptr + r, mask=away, other=0.0), mask=away)
    for g in range(G):
        if g != me:
            _signal(flag_ptrs, g)


@triton.jit
def _locate_pair(pair, live, row_ptr, dest_ptr, me, _n):
    """Where a kept pair's expert output is on this rank: ``own[row]`` when this rank holds its
    expert, else ``ret[pair]`` (where ``push_back`` put it)."""
    row = tl.load(row_ptr + pair, mask=live, other=-1)
    here = tl.load(dest_ptr + pair, mask=live, other=0) == me
    kept = row >= 0
    return kept & here, kept & ~here, row, pair


@triton.jit
def _to_peer(pair, live, row_ptr, dest_ptr, me, _n):
    """A kept pair's row goes to row ``row`` of rank ``dest``'s buffer (an index into the table)."""
    row = tl.load(row_ptr + pair, mask=live, other=-1)
    dest = tl.load(dest_ptr + pair, mask=live, other=0)
    return tl.where(row >= 0, dest, -1), row


def _check_pairs(row_TK: torch.Tensor, dest_TK: torch.Tensor) -> None:
    if row_TK.dtype != torch.int64 or dest_TK.dtype != torch.int64:
        raise ValueError(f"row_TK and dest_TK must be int64, got {row_TK.dtype} and {dest_TK.dtype}")
    if row_TK.shape != dest_TK.shape or row_TK.dim() != 2:
        raise ValueError(f"row_TK {tuple(row_TK.shape)} and dest_TK {tuple(dest_TK.shape)} must be the same (T, K)")


def _check_ptrs(name: str, ptrs_G: torch.Tensor) -> None:
    if ptrs_G.dtype != torch.int64 or ptrs_G.dim() != 1:
        raise ValueError(f"{name} must be an int64 vector of buffer addresses, got {ptrs_G.dtype} {tuple(ptrs_G.shape)}")


def _check_flag(name: str, flag: torch.Tensor) -> None:
    if not isinstance(flag, torch.Tensor):
        raise ValueError(f"{name} must be a contiguous 1-element int64 tensor on the device, got {flag!r}")
    if flag.dtype != torch.int64 or flag.numel() != 1 or not flag.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-element int64 tensor, got {flag.dtype} {tuple(flag.shape)}")


def dispatch_rows(x_TD: torch.Tensor, w_TK: torch.Tensor, order_P: torch.Tensor, counts_E: torch.Tensor,
                  cnt_ptrs_G: torch.Tensor, flag_ptrs_G: torch.Tensor, state: torch.Tensor,
                  counts_GE: torch.Tensor, flag: torch.Tensor, recv_ptrs_G: torch.Tensor,
                  src_ptrs_G: torch.Tensor, w_ptrs_G: torch.Tensor, recv_dtype: torch.dtype, me: int, K: int, P_cap: int,
                  R_cap: int, tok_ptrs_G: torch.Tensor, lead_TG: torch.Tensor,
                  out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  timeout_ms: int = TIMEOUT_MS, store_rows: bool = True):
    """Exchange the counts, then route and move this rank's kept pairs.

    Counts: ``counts_E`` (E,) int64, what this rank keeps for each expert, becomes row ``me`` of
    every rank's (G, E) int64 count matrix (``cnt_ptrs_G``), and every rank's int64 counts flag
    (``flag_ptrs_G``) grows by 1: G signals per call reach each rank. ``state`` (1-element
    int64, this rank's, on the device; zero before the first call): the value ``flag`` has
    reached once every earlier call's counts arrived; a one-program kernel waits until ``flag``
    reaches ``state + G`` (every rank's counts are in ``counts_GE``, this rank's matrix: row s =
    what rank s keeps for each expert, experts ``[d·L, (d+1)·L)`` on rank d) and leaves ``state``
    at that target; then the rows kernel routes.

    Rows: ``order_P`` (P = T·K,) int64 holds the kept pairs sorted by expert, then the dropped
    ones. A destination d stores its rows expert-major: local expert 0's, then 1's, ..., each
    expert's by source rank (one segment per expert for the grouped GEMM: module docstring of
    :mod:`parallel.token_rows` says why). Token t's row of x_TD (T, D) goes once to each rank d
    that keeps a pair of it, at row ``me·T_cap + t`` of d's token buffer (``recv_ptrs_G``, (G·T_cap,
    D) of ``recv_dtype``, T_cap = P_cap / K), stored by the first of those pairs to take the
    (token, rank) ticket in ``lead_TG`` ((T_cap·G,) int32, zeroed here when rows are stored);
    every kept pair's row ``row`` at its destination gets that token row in rank ``dest``'s (R_cap,) int64 token-row
    buffer (``tok_ptrs_G``), ``me · P_cap + t·K + k`` in its (R_cap,) int64 source buffer and the
    pair's weight ``w_TK[t, k]`` (fp32) in its (R_cap,) fp32 weight buffer (``w_ptrs_G``); the
    receiver copies its token rows into its pair rows (:func:`expand_rows`). ``store_rows``
    False: no token row is stored (``tokrow_TK`` all -1); the caller copies x's whole block to
    rows ``me·T_cap ...`` of every other rank's token buffer after these kernels (copy engines:
    the rows reach a peer only after its counts, as the kernel's own stores do).
    A count matrix that gives some rank more than ``R_cap`` rows moves no row and writes no
    offsets (every rank reads the same matrix); on a GPU the counts kernel then prints and traps on
    every rank (in the interpreter the rows kernel returns with every pair's row -1).

    Returns ``row_TK``, ``dest_TK`` (T, K) int64 (row -1: dropped), this rank's local experts'
    row ends ``offsets_J`` (L,) int32, ``tokrow_TK`` (T, K) int64 the token row a pair stored
    (-1 for the pairs that stored none: a token's other pairs on the same rank, dropped pairs;
    where the combine backward sends ``dout``) (into ``out`` when given)."""
    if counts_GE.dtype != torch.int64 or counts_GE.dim() != 2 or counts_GE.shape[1] % counts_GE.shape[0]:
        raise ValueError(f"counts_GE must be int64 (G, E) with G dividing E, got {counts_GE.dtype} {tuple(counts_GE.shape)}")
    G, E = counts_GE.shape
    if counts_E.dtype != torch.int64 or counts_E.shape != (E,) or not counts_E.is_contiguous():
        raise ValueError(f"counts_E must be a contiguous int64 ({E},) vector, got {counts_E.dtype} {tuple(counts_E.shape)}")
    if x_TD.dim() != 2:
        raise ValueError(f"x_TD must be (T, D), got {tuple(x_TD.shape)}")
    T, D = x_TD.shape
    P = order_P.numel()
    if order_P.dtype != torch.int64 or order_P.dim() != 1 or P != T * K:
        raise ValueError(f"order_P must be an int64 vector of T·K = {T * K} pairs, got {order_P.dtype} {tuple(order_P.shape)}")
    if P_cap < P:
        raise ValueError(f"P_cap = {P_cap} is below the T·K = {P} pairs")
    check_positive_int("dispatch_rows: R_cap", R_cap)
    if w_TK is None:
        raise ValueError("dispatch_rows: w_TK is required (the pairs' weights travel with their rows)")
    check_pair_weights("dispatch_rows", w_TK, T, K)
    _check_flag("flag", flag)
    _check_flag("state", state)
    for name, ptrs in (("cnt_ptrs_G", cnt_ptrs_G), ("flag_ptrs_G", flag_ptrs_G), ("recv_ptrs_G", recv_ptrs_G),
                       ("src_ptrs_G", src_ptrs_G), ("w_ptrs_G", w_ptrs_G), ("tok_ptrs_G", tok_ptrs_G)):
        _check_ptrs(name, ptrs)
    T_cap = P_cap // K
    if lead_TG.dtype != torch.int32 or lead_TG.numel() < T_cap * G or not lead_TG.is_contiguous():
        raise ValueError(f"lead_TG must be a contiguous int32 tensor of ≥ T_cap·G = {T_cap * G} entries, got "
                         f"{lead_TG.dtype} {tuple(lead_TG.shape)}")
    L = E // G
    device = x_TD.device
    if out is None:
        out = (torch.empty((T, K), dtype=torch.int64, device=device), torch.empty((T, K), dtype=torch.int64, device=device),
               torch.empty(L, dtype=torch.int32, device=device), torch.empty((T, K), dtype=torch.int64, device=device))
    row_TK, dest_TK, offsets_J, tokrow_TK = out
    if row_TK.shape != (T, K) or dest_TK.shape != (T, K) or offsets_J.shape != (L,) or tokrow_TK.shape != (T, K):
        raise ValueError(f"out must be (T, K) = ({T}, {K}), ({T}, {K}), ({L},) and ({T}, {K}) tensors")
    if store_rows:  # the tickets of the row stores
        lead_TG.zero_()
    GP, LP = next_power_of_2(G), next_power_of_2(L)
    _exchange_counts_kernel[(1,)](counts_E, cnt_ptrs_G, flag_ptrs_G, state, counts_GE, flag, timeout_ms * 1_000_000, me,
                                  G, L, E, R_cap, GP=GP, LP=LP, BLOCK_E=next_power_of_2(E), num_warps=1)
    grid = grid_programs(cdiv(P, _BLOCK_ROWS), _MAX_PROGRAMS)
    _dispatch_rows_kernel[(grid,)](
        x_TD.contiguous(), order_P, counts_GE, row_TK, dest_TK, offsets_J, recv_ptrs_G, src_ptrs_G, w_TK.contiguous(),
        w_ptrs_G, lead_TG, tokrow_TK, tok_ptrs_G, T_cap, me, G, L, E, P, K, P_cap, R_cap, D,
        OUT=tl_dtype(recv_dtype), GP=GP, LP=LP, ROWS=store_rows, BLOCK_P=_BLOCK_ROWS, BLOCK_D=ROW_BLOCK_D, num_warps=4)
    return row_TK, dest_TK, offsets_J, tokrow_TK


# the own block's place and size are per-call values: specialized, a size crossing a multiple of 16
# would compile a new variant mid-run (~0.5 s)
@triton.jit(do_not_specialize=["own_start", "own_rows"])
def _expand_rows_kernel(tok_ptr, of_ptr, n_ptr, out_ptr, own_ptr, own_start, own_rows, D, OWN: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    offs = tl.arange(0, BLOCK_D)
    n = tl.load(n_ptr).to(tl.int64)
    for tile in range(tl.program_id(0), tl.cdiv(n, BLOCK_R), tl.num_programs(0)):
        r = tile * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        live = r < n
        src = tl.load(of_ptr + r, mask=live, other=0)
        if OWN:  # this rank's block from its own tokens (masked loads fetch nothing)
            own = (src >= own_start) & (src < own_start + own_rows)
        for c in range(0, D, BLOCK_D):
            ok = live[:, None] & (c + offs[None, :] < D)
            if OWN:
                v = tl.where(own[:, None],
                             tl.load(own_ptr + (src - own_start)[:, None] * D + c + offs[None, :],
                                     mask=ok & own[:, None], other=0.0),
                             tl.load(tok_ptr + src[:, None] * D + c + offs[None, :], mask=ok & ~own[:, None],
                                     other=0.0))
            else:
                v = tl.load(tok_ptr + src[:, None] * D + c + offs[None, :], mask=ok, other=0.0)
            tl.store(out_ptr + r[:, None] * D + c + offs[None, :], v, mask=ok)


def expand_rows(tok_MD: torch.Tensor, of_R: torch.Tensor, n_rows: torch.Tensor, own_TD: torch.Tensor | None = None,
                own_start: int = 0) -> torch.Tensor:
    """``out[r] = tok_MD[of_R[r]]`` for the rows r < ``n_rows`` (1-element device int tensor): a
    receiver's token rows copied into its pair rows (R, D), R = of_R's length; the rows past
    ``n_rows`` are left as allocated (the experts skip them). Local memory only. With ``own_TD``
    (T, D) of tok_MD's dtype, the token rows ``own_start ... own_start + T`` come from it instead
    (this rank's own block, read where it is rather than copied into tok_MD first)."""
    check_rows("tok_MD", tok_MD, None, tok_MD.shape[1] if tok_MD.dim() == 2 else -1)
    if of_R.dtype != torch.int64 or of_R.dim() != 1 or n_rows.numel() != 1:
        raise ValueError(f"of_R must be an int64 vector and n_rows 1-element, got {of_R.dtype} {tuple(of_R.shape)} "
                         f"and {tuple(n_rows.shape)}")
    D = tok_MD.shape[1]
    if own_TD is not None:
        check_rows("own_TD", own_TD, None, D)
        if own_TD.dtype != tok_MD.dtype or not 0 <= own_start <= tok_MD.shape[0] - own_TD.shape[0]:
            raise ValueError(f"own_TD ({own_TD.dtype}, {own_TD.shape[0]} rows at {own_start}) must be tok_MD's dtype "
                             f"({tok_MD.dtype}) and a block within its {tok_MD.shape[0]} rows")
    out = tok_MD.new_empty((of_R.shape[0], D))
    if of_R.shape[0]:
        grid = grid_programs(cdiv(of_R.shape[0], _BLOCK_ROWS), _MAX_PROGRAMS)
        own = own_TD is not None and own_TD.numel() > 0
        _expand_rows_kernel[(grid,)](tok_MD, of_R, n_rows, out, own_TD if own else tok_MD, own_start if own else 0,
                                     own_TD.shape[0] if own else 0, D, OWN=own, BLOCK_R=_BLOCK_ROWS,
                                     BLOCK_D=ROW_BLOCK_D, num_warps=4)
    return out


def expand_rows_reference(tok_MD: torch.Tensor, of_R: torch.Tensor, n_rows: torch.Tensor,
                          own_TD: torch.Tensor | None = None, own_start: int = 0) -> torch.Tensor:
    """PyTorch version of :func:`expand_rows` (the rows past ``n_rows`` zero here)."""
    if own_TD is not None:
        tok_MD = tok_MD.clone()
        tok_MD[own_start:own_start + own_TD.shape[0]] = own_TD
    n = int(n_rows.reshape(()))
    out = tok_MD.new_zeros((of_R.shape[0], tok_MD.shape[1]))
    out[:n] = tok_MD[of_R[:n]]
    return out


def p2p_routes_reference(order_P: torch.Tensor, counts_GE: torch.Tensor, me: int, K: int):
    """PyTorch version of the routes of :func:`dispatch_rows` (plain loops)."""
    G, E = counts_GE.shape
    L = E // G
    C = counts_GE.view(G, G, L).tolist()  # [source, destination, local expert]
    P = order_P.numel()
    row, dest = [-1] * P, [0] * P
    segments = [(d, el) for d in range(G) for el in range(L)]  # my sorted order
    ends = [sum(C[me][d][el] for d, el in segments[:j + 1]) for j in range(len(segments))]
    for i, pair in enumerate(order_P.tolist()[:ends[-1] if ends else 0]):
        d, el = segments[next(j for j, end in enumerate(ends) if i < end)]
        start_here = sum(C[me][x][y] for x, y in segments[:segments.index((d, el))])
        first = sum(C[x][d][y] for x in range(G) for y in range(el)) + sum(C[x][d][el] for x in range(me))
        row[pair], dest[pair] = first + i - start_here, d
    offsets = torch.tensor([sum(C[x][me][el] for x in range(G)) for el in range(L)]).cumsum(0).to(torch.int32)
    return (torch.tensor(row).view(-1, K), torch.tensor(dest).view(-1, K), offsets)


def push_rows(x_TD: torch.Tensor, row_TK: torch.Tensor, dest_TK: torch.Tensor, buf_ptrs_G: torch.Tensor,
              buf_dtype: torch.dtype, me: int = 0) -> None:
    """Store each kept pair's row of x_TD (T, D) ``x[t]`` into row ``row`` of rank ``dest``'s
    buffer of ``buf_dtype`` (the combine's backward: dout to every row of the token)."""
    _check_pairs(row_TK, dest_TK)
    _check_ptrs("buf_ptrs_G", buf_ptrs_G)
    T, D = x_TD.shape
    K = row_TK.shape[1]
    if row_TK.shape[0] != T:
        raise ValueError(f"row_TK has {row_TK.shape[0]} tokens, x_TD {T}")
    scatter_rows(x_TD.contiguous(), _to_peer, _locate_pair, row_TK.contiguous(), dest_TK.contiguous(), me, 0,
                 buf_ptrs_G, buf_dtype, D, K=K, peer_table=True)


def push_back(y_RD: torch.Tensor | None, src_R: torch.Tensor, n_rows: torch.Tensor, ret_ptrs_G: torch.Tensor,
              ret_dtype: torch.dtype, me: int, P_cap: int, flag_ptrs_G: torch.Tensor, expect: torch.Tensor,
              g_R: torch.Tensor | None = None, ret_g_ptrs_G: torch.Tensor | None = None, own_too: bool = False,
              num_rows: int | None = None) -> int:
    """Send the valid rows of y_RD (R, D) home: row r < ``n_rows`` (a 1-element int32/int64 device
    tensor) with ``src_R[r] = s · P_cap + p`` (-1: stays) and s ≠ ``me`` is stored at row p of rank s's return
    buffer (of ``ret_dtype``), and with ``g_R`` (≥ R,) fp32 its value at place p of rank s's
    (P_cap,) fp32 buffer (``ret_g_ptrs_G``; the dispatch backward's weight gradients). Rows from
    ``me`` stay (their reader reads them, and their values, in place), unless ``own_too``: then
    they are stored into this rank's own return buffer like the others. ``y_RD`` None: only the
    values of ``g_R`` travel, for ``num_rows`` = R rows. Then every program adds 1 to every other
    rank's int64 flag (``flag_ptrs_G``). ``expect`` (1-element int64, this rank's): the target of
    this rank's own flag for :func:`sum_returned`, advanced by the signals the peers' matching
    calls send it ((G - 1) · the grid).

    Returns the signals each other rank receives from this call: the grid, a function of R only,
    so every rank of a dispatcher (same R_cap) sends the same number."""
    if y_RD is None and (g_R is None or num_rows is None):
        raise ValueError("push_back: without rows (y_RD None) it sends g_R's values, for num_rows rows")
    R = y_RD.shape[0] if y_RD is not None else num_rows
    if src_R.dtype != torch.int64 or src_R.dim() != 1 or src_R.shape[0] < R:
        raise ValueError(f"src_R must be int64 with ≥ {R} entries, got {src_R.dtype} {tuple(src_R.shape)}")
    if n_rows.numel() != 1 or n_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"n_rows must be a 1-element int32/int64 tensor, got {n_rows.dtype} {tuple(n_rows.shape)}")
    _check_ptrs("ret_ptrs_G", ret_ptrs_G)
    _check_ptrs("flag_ptrs_G", flag_ptrs_G)
    _check_flag("expect", expect)
    D = 0
    if y_RD is not None:
        check_rows("y_RD", y_RD, None, y_RD.shape[1] if y_RD.dim() == 2 else -1)
        D = y_RD.shape[1]
    if (g_R is None) != (ret_g_ptrs_G is None):
        raise ValueError("g_R and ret_g_ptrs_G go together (the rows' weight gradients and where they go)")
    if g_R is not None:
        _check_ptrs("ret_g_ptrs_G", ret_g_ptrs_G)
        if g_R.dtype != torch.float32 or g_R.dim() != 1 or g_R.shape[0] < R or not g_R.is_contiguous():
            raise ValueError(f"g_R must be a contiguous fp32 vector of ≥ {R} entries, got {g_R.dtype} {tuple(g_R.shape)}")
    grid = grid_programs(cdiv(R, _BLOCK_ROWS), _MAX_PROGRAMS)
    _push_back_kernel[(grid,)](y_RD if y_RD is not None else g_R, src_R, n_rows, ret_ptrs_G,
                               g_R if g_R is not None else src_R,
                               ret_g_ptrs_G if ret_g_ptrs_G is not None else ret_ptrs_G, flag_ptrs_G, expect, me,
                               flag_ptrs_G.numel(), P_cap, D, OUT=tl_dtype(ret_dtype), HAS_G=g_R is not None,
                               OWN_TOO=own_too, BLOCK_R=_BLOCK_ROWS, BLOCK_D=ROW_BLOCK_D, num_warps=4)
    return grid


@triton.jit
def _signal_peers_kernel(flag_ptrs, expect_ptr, me, G):
    for g in range(G):
        if g != me:
            _signal(flag_ptrs, g)
    tl.store(expect_ptr, tl.load(expect_ptr) + G - 1)


def signal_peers(flag_ptrs_G: torch.Tensor, expect: torch.Tensor, me: int) -> int:
    """One signal to every other rank's int64 flag (``flag_ptrs_G``), after everything before it
    on this stream (the copy engines' block copies of the way back: a copy's writes are complete
    when the next launch starts), and ``expect`` (this rank's 1-element int64) advanced by the
    G - 1 signals the peers' matching calls send it, for :func:`sum_returned`. Returns the
    signals each other rank receives (1), as :func:`push_back` does."""
    _check_ptrs("flag_ptrs_G", flag_ptrs_G)
    _check_flag("expect", expect)
    if not 0 <= me < flag_ptrs_G.numel():
        raise ValueError(f"signal_peers: me={me} is not a rank of the {flag_ptrs_G.numel()} flags")
    _signal_peers_kernel[(1,)](flag_ptrs_G, expect, me, flag_ptrs_G.numel(), num_warps=1)
    return 1


@triton.jit
def _locate_returned(pair, live, rows_ptr, _unused, me, own):
    """Slot g of token t (pair = t·G + g) is row ``rows[t·G + g]`` of the return buffer (-1: none);
    with ``own`` = G (not 0), slot ``me``'s row is that row of the own sums instead."""
    row = tl.load(rows_ptr + pair, mask=live, other=-1)
    there = live & (row >= 0)
    mine = (pair % tl.maximum(own, 1) == me) & (own > 0)
    return there & ~mine, there & mine, row, row


def sum_returned(ret_MD: torch.Tensor, rows_TG: torch.Tensor, out_dtype: torch.dtype, flag: torch.Tensor,
                 expect: torch.Tensor, timeout_ms: int = TIMEOUT_MS, own_MD: torch.Tensor | None = None,
                 me: int = 0) -> torch.Tensor:
    """After waiting until ``flag`` (1-element int64) reaches ``expect[0]`` (a 1-element int64
    device tensor, read when the kernel starts: :func:`push_back` advances it for the ranks'
    pushes of their sums): ``out_TD[t] = Σ_g ret_MD[rows_TG[t, g]]`` in fp32, cast to ``out_dtype``; rows -1
    add nothing. ret_MD (M, D) row-major; rows_TG (T, G) int64 contiguous. Runs (the wait) for
    T = 0 too: it orders this rank's later stores into the peers' buffers after their reads.
    With ``own_MD`` (M, D) of ret_MD's dtype, rank ``me``'s rows come from it, not ret_MD (this
    rank's sums for its own tokens, read where they are rather than copied into ret_MD first)."""
    _check_flag("flag", flag)
    _check_flag("expect", expect)
    if rows_TG.dim() != 2 or rows_TG.dtype != torch.int64 or not rows_TG.is_contiguous():
        raise ValueError(f"rows_TG must be a contiguous (T, G) int64 tensor, got {rows_TG.dtype} {tuple(rows_TG.shape)}")
    check_rows("ret_MD", ret_MD, None, ret_MD.shape[1] if ret_MD.dim() == 2 else -1)
    (T, G), D = rows_TG.shape, ret_MD.shape[1]
    if own_MD is not None:
        check_rows("own_MD", own_MD, ret_MD.shape[0], D)
        if own_MD.dtype != ret_MD.dtype or not 0 <= me < G:
            raise ValueError(f"own_MD must be ret_MD's dtype ({ret_MD.dtype}, got {own_MD.dtype}) and me a rank of "
                             f"{G}, got {me}")
    # the wait in one program, then the sum: a wait in every program of the sum's grid spun on all
    # the SMs while the peers were late, which a kernel overlapping it on another stream (a side
    # stream's GEMM under overlap_chunks) could not use
    _wait_flag_kernel[(1,)](flag, expect, timeout_ms * 1_000_000, num_warps=1)
    own = own_MD is not None  # without it neither me nor G is read: one compiled variant for every rank
    return gather_sum(T, D, _locate_returned, rows_TG, None, me if own else 0, G if own else 0, ret_MD, own_MD, None,
                      out_dtype, K=G, block_t=_BLOCK_ROWS, max_programs=_MAX_PROGRAMS)


def sum_returned_reference(ret_MD: torch.Tensor, rows_TG: torch.Tensor, out_dtype: torch.dtype,
                           own_MD: torch.Tensor | None = None, me: int = 0) -> torch.Tensor:
    """PyTorch version of :func:`sum_returned` (no wait)."""
    there = rows_TG >= 0
    if own_MD is None:
        return gather_sum_reference((there, there & False, rows_TG, rows_TG), ret_MD, None, None, out_dtype)
    mine = torch.zeros_like(there)
    mine[:, me] = True
    return gather_sum_reference((there & ~mine, there & mine, rows_TG, rows_TG), ret_MD, own_MD, None, out_dtype)


def locate_pair_reference(row_TK, dest_TK, me):
    """PyTorch version of ``_locate_pair`` for every pair: (own?, returned?, own row, return row)."""
    T, K = row_TK.shape
    kept, here = row_TK >= 0, dest_TK == me
    pair_TK = torch.arange(T * K, device=row_TK.device).view(T, K)
    return kept & here, kept & ~here, row_TK, pair_TK


def push_rows_reference(x_TD, row_TK, dest_TK, bufs, me=0):
    """PyTorch version of :func:`push_rows` over lists of buffers (one per rank)."""
    sent = (torch.where(row_TK >= 0, dest_TK, -1), row_TK)
    scatter_rows_reference(x_TD, sent, locate_pair_reference(row_TK, dest_TK, me), bufs)


def push_back_reference(y_RD, src_R, n_rows, rets, me, P_cap, g_R=None, ret_gs=None, own_too=False):
    """PyTorch version of :func:`push_back` (the rows unless ``y_RD`` is None, and the values of
    ``g_R`` into ``ret_gs``; no flags) over lists of return buffers."""
    for r in range(int(n_rows)):
        if int(src_R[r]) < 0:
            continue
        s, p = divmod(int(src_R[r]), P_cap)
        if s != me or own_too:
            if y_RD is not None:
                rets[s][p] = y_RD[r].to(rets[s].dtype)
            if g_R is not None:
                ret_gs[s][p] = g_R[r]


def return_table(src_R: torch.Tensor, n_rows: torch.Tensor, G: int, T_cap: int, K: int) -> torch.Tensor:
    """(G·T_cap, K) int64: for each (source s, token t), row ``s·T_cap + t``, the rows r < ``n_rows``
    of a receive buffer that came from its pairs (``src_R[r] = s·T_cap·K + t·K + k``, at column
    k), -1 where there is none: the table that sums a token's pairs on the receiver before they
    go home as one row (:func:`~parallel.token_rows.gather_slots`)."""
    P = G * T_cap * K
    r = torch.arange(src_R.shape[0], device=src_R.device)
    table = torch.full((P + 1,), -1, dtype=torch.int64, device=src_R.device)  # the last: a sink for padding rows
    table.scatter_(0, torch.where(r < n_rows.reshape(()), src_R, P), r)
    return table[:P].view(G * T_cap, K)


def pair_values(row_TK: torch.Tensor, dest_TK: torch.Tensor, own_R: torch.Tensor, ret_P: torch.Tensor,
                me: int) -> torch.Tensor:
    """(T, K) fp32 value of each pair (the dispatch backward's weight gradients, read after
    :func:`sum_returned`'s wait):
    ``own_R[row]`` where this rank holds its expert (``dest == me``), else ``ret_P[t·K + k]``
    (where :func:`push_back` put it), 0 for a dropped pair."""
    T, K = row_TK.shape
    own_TK = own_R[row_TK.clamp_min(0).view(-1)].view(T, K)
    value_TK = torch.where(dest_TK == me, own_TK, ret_P[:T * K].view(T, K))
    return torch.where(row_TK >= 0, value_TK, 0.0)
