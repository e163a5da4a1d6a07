"""A stable counting sort of small integer keys (the routing plan's expert of each pair): the order
and the count of each key, in three launches.

Legend: P pairs (the keys), B bins (the key values ``0 .. B-1``), N blocks of pairs.

Why a kernel: the dropless plan was ``torch.argsort(expert_P, stable=True)`` plus a
``scatter_add_`` count. For int64 keys the argsort is CUB's radix sort over all 64 bits: 22
launches (memsets, copies, one pass per 8 bits) and 91 µs for 65k pairs on an H100, 25
launches a layer's forward with the count (probe of 2026-11-28, one OLMoE-shaped layer, 8k
tokens, top-8). The 2×H200 step profile of olmoe_bench (16 layers, 8 micro-batches a step) put
the router and the plan at 15.6k of the step's 32k launches, on hosts that could not keep
the GPUs fed (bench/results/step_profile.md). The keys here take fewer than B ≤ 1025 values,
so a counting sort is exact and needs three launches whatever P:

1. ``_histogram_kernel``: block n of BLOCK_P pairs counts each key (a one-hot column sum) into
   row n of an (N, B) table.
2. ``_scan_kernel``: one program walks the table in row chunks: each entry becomes the number of
   equal keys in the earlier blocks, the running column sums give each key's total, and their
   exclusive prefix each key's first position.
3. ``_scatter_kernel``: block n places each pair at its key's first position + the equal keys of
   the earlier blocks + the equal keys before it in its own block (a one-hot column cumsum).

Stable: a pair lands after every pair of its key with a smaller index, as ``argsort(stable=True)``
orders them, so the result is that argsort's exactly (tests/test_expert_sort.py). Integer sums
only: deterministic. Off CUDA the wrapper runs the PyTorch reference.
"""

import torch
import triton
import triton.language as tl

from kernel_floor import INTERPRET, cdiv, next_power_of_2, use_reference

MAX_BINS = 1025  # the plan's keys: E experts (≤ 1024 here) and one more for the dropped pairs


@triton.jit
def _histogram_kernel(KEY, COUNT, P, B, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
    n = tl.program_id(0)
    idx = n * BLOCK_P + tl.arange(0, BLOCK_P)
    key = tl.load(KEY + idx, mask=idx < P, other=B)  # B: no bin
    bins = tl.arange(0, BLOCK_B)
    count = tl.sum((key[:, None] == bins[None, :]).to(tl.int32), 0)
    tl.store(COUNT + n.to(tl.int64) * BLOCK_B + bins, count)


@triton.jit
def _scan_kernel(COUNT, TOTAL, START, N, B, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """COUNT (N, BLOCK_B) in place: each entry → the equal keys of the earlier blocks.
    TOTAL (B,) int64: each key's count; START (BLOCK_B,) int32: each key's first position."""
    bins = tl.arange(0, BLOCK_B)
    running = tl.zeros([BLOCK_B], tl.int32)
    for r0 in range(0, N, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        offs = rows[:, None].to(tl.int64) * BLOCK_B + bins[None, :]
        ok = (rows < N)[:, None]
        c = tl.load(COUNT + offs, mask=ok, other=0)
        tl.store(COUNT + offs, tl.cumsum(c, 0) - c + running[None, :], mask=ok)
        running += tl.sum(c, 0)
    tl.store(TOTAL + bins, running.to(tl.int64), mask=bins < B)
    tl.store(START + bins, tl.cumsum(running, 0) - running)


@triton.jit
def _scatter_kernel(KEY, COUNT, START, ORDER, P, B, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
    n = tl.program_id(0)
    idx = n * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = idx < P
    key = tl.load(KEY + idx, mask=ok, other=B)
    bins = tl.arange(0, BLOCK_B)
    hot = (key[:, None] == bins[None, :]).to(tl.int32)
    before_in_block = tl.sum((tl.cumsum(hot, 0) - hot) * hot, 1)  # equal keys earlier in the block
    safe = tl.where(ok, key, 0)
    pos = tl.load(START + safe, mask=ok, other=0) + tl.load(COUNT + n.to(tl.int64) * BLOCK_B + safe, mask=ok, other=0)
    tl.store(ORDER + pos + before_in_block, idx.to(tl.int64), mask=ok)


def _blocks(num_bins: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_B): the one-hot tile BLOCK_P × BLOCK_B at 16k int32 (64 a thread at 8
    warps); the interpreter's at 512, so small tests walk several blocks."""
    block_b = next_power_of_2(num_bins)
    tile = 512 if INTERPRET else 16384
    return max(16, min(1024, tile // block_b)), block_b


def count_keys(key_P: torch.Tensor, num_bins: int) -> torch.Tensor:
    """(num_bins,) int64: how often each value of the int64 ``key_P`` occurs."""
    # scatter_add_ rather than torch.bincount: bincount reads the maximum on the host (a sync)
    return torch.zeros(num_bins, dtype=torch.int64, device=key_P.device).scatter_add_(0, key_P, torch.ones_like(key_P))


def sort_by_key_reference(key_P: torch.Tensor, num_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_P int64: ``argsort(key_P, stable=True)``, count_B int64: each key's count)."""
    return torch.argsort(key_P, stable=True), count_keys(key_P, num_bins)


def sort_by_key(key_P: torch.Tensor, num_bins: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """key_P (P,) int64 in ``[0, num_bins)`` -> (order_P (P,) int64, the stable ascending order of
    the keys; count_B (num_bins,) int64, each key's count). No host synchronisation; keys out of
    range are not checked (the router makes them). ``backend``: "auto" runs the kernels on CUDA
    for up to :data:`MAX_BINS` keys, the reference otherwise."""
    if key_P.dim() != 1 or key_P.dtype != torch.int64:
        raise ValueError(f"sort_by_key: key_P must be 1-D int64, got {tuple(key_P.shape)} {key_P.dtype}")
    if num_bins < 1 or (backend == "triton" and num_bins > MAX_BINS):
        raise ValueError(f"sort_by_key: num_bins must be in [1, {MAX_BINS}] for the kernels, got {num_bins}")
    if use_reference(backend, not key_P.is_cuda or num_bins > MAX_BINS):  # more keys: the one-hot tiles outgrow
        return sort_by_key_reference(key_P, num_bins)
    P = key_P.numel()
    block_p, block_b = _blocks(num_bins)
    N = cdiv(P, block_p)
    dev = key_P.device
    order = torch.empty(P, dtype=torch.int64, device=dev)
    total = torch.empty(num_bins, dtype=torch.int64, device=dev)
    if N == 0:
        return order, total.zero_()
    count = torch.empty(N, block_b, dtype=torch.int32, device=dev)
    start = torch.empty(block_b, dtype=torch.int32, device=dev)
    key_P = key_P.contiguous()
    _histogram_kernel[(N,)](key_P, count, P, num_bins, BLOCK_P=block_p, BLOCK_B=block_b, num_warps=8)
    _scan_kernel[(1,)](count, total, start, N, num_bins, BLOCK_N=max(1, 4096 // block_b), BLOCK_B=block_b,
                       num_warps=8)
    _scatter_kernel[(N,)](key_P, count, start, order, P, num_bins, BLOCK_P=block_p, BLOCK_B=block_b,
                          num_warps=8)
    return order, total
