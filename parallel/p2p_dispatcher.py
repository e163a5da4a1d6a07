"""Expert-parallel dispatcher for the GPUs of one node: rows move by NVLink peer stores into
symmetric memory, not by NCCL, and the host never waits for the GPU.

Legend: T tokens, D model dim, K experts per token (top-k), E experts, G ranks of the expert-parallel
group, L = E / G experts per rank, T_cap the most tokens a rank passes to one dispatch (``max_tokens``,
or a chunk's ``ceil(max_tokens / overlap_chunks)``), R_cap rows a rank can receive at most (G ·
T_cap · K, or the capacity's bound when one is given, where smaller:
:func:`moe.capacity.max_received_rows`), P_cap = T_cap · K pairs a rank can send at most.

A token's row crosses to a rank once, however many of its K pairs go there (at top-8 of 64 on 2
ranks about 4: a row per pair moved ~4× the bytes), each way and in each backward; the receiver
copies it into its pair rows. ``dispatch`` returns a fixed R_cap rows (the rows past
``offsets[-1]`` are padding, which the grouped GEMM skips and zero-fills), so the host never needs
R. Each dispatch holds one *slot* of buffers until its backward, taken round-robin from
``num_buffers`` · ``overlap_chunks`` slots; the same call order on every rank means every rank
takes the same slot.

``dispatch``: :func:`~parallel.p2p_rows.dispatch_rows` writes this rank's per-expert counts into
every rank's count matrix, signals that rank's counts flag and waits until all G ranks have
signalled (a one-program kernel), then a second kernel computes from the (G, E) count matrix
where each of this rank's kept pairs lands (a receiver's rows are expert-major: one segment per
local expert) and this rank's experts' row ends, stores each token's row once into the token
buffer of every rank that keeps a pair of it (own rows into its own; the first of the token's
pairs there to take its (token, rank) ticket stores it), and each kept pair's token row, where it
came from and its combine weight at the pair's row of its destination; then a barrier, and each
rank copies its token rows into its pair rows (:func:`~parallel.p2p_rows.expand_rows`), the
experts' input, with their weights (``w_R``: the experts weight their output rows, as on the other
paths).

``combine``: every rank sums, in fp32, the valid rows of its expert output that came from one
(source, token) (:func:`~parallel.p2p_rows.return_table`) and stores that one row into the
source's return buffer (its own sources' into its own), each program signalling every peer's
flag: a token's rows cross the link once however many of its K pairs a rank holds (at top-8 of
64 on 2 ranks about 4 of them: 4× fewer bytes than a row per pair, which took ~0.4 ms a call on
2×H200 at 8k tokens, bench/results/step_profile.md); then one local pass waits for the flag and
sums each token's G rows in fp32. It keeps no rows for its backward.

Backward: the combine backward stores ``dout`` once per (token, rank) into the receivers' token
gradient buffer (one per chunk of a layer, shared by the slots: each rank copies it into its pair
rows right after the barrier that follows), then a barrier and that copy; the dispatch backward sends
the rows' gradients home like the combine, each pair's weight gradient (the experts' ``dw_R``) on
its own into the source's ``ret_w``, and one pass sums each token's rows; each pair's weight
gradient is then read where it arrived.

Copy-engine mode (``copy_engine``): the same buffers and tables, but the token rows move as
whole blocks by cudaMemcpyAsync (the copy engines, no SMs): after the dispatch kernel (counts,
routes, weights; no row stores), x's T rows to rows ``me·T_cap ...`` of every other rank's token
buffer; the way back copies each of its G blocks of T_cap sums to its source (zeros for tokens with
no pair here) and then one small kernel signals the peers (:func:`~parallel.p2p_rows.signal_peers`);
the combine backward copies ``dout``'s block to every other rank's gradient buffer. Each copy sits
where the kernel's stores sat on the stream, and a copy is complete before the next launch on its
stream starts (what PyTorch's own copy-engine collectives and NCCL's rely on, under graph capture
too), so the ordering below holds unchanged. A rank's own block is not copied: the expand and the
final sum read it where it is (x, dout, the own sums).

Ordering: 9 launches per forward (the tickets' memset, 7 Triton kernels, two of them one-program
waits: the counts' exchange and the wait before the final sum, and one barrier) and a table of 3
small torch ops, 8 and the table per backward (the kernels' mode; the copy-engine mode trades the
memset and the row stores for G - 1 copies each way). Flags only grow; each rank keeps on its
device, per slot, the value each flag reaches after the signals sent so far (every rank makes the same
calls with the same grids, so each knows it), advanced by the kernels: the host passes no
per-call value, and a captured CUDA graph's replays advance them as the eager launches do.
Writers never overrun readers: every rank's counts reach a peer only after that rank finished
everything before its dispatch, and the rows of a dispatch reach a peer only after that peer's
counts (the counts kernel waits for them before the rows kernel starts), so the counts exchange
orders each dispatch after the previous call's reads on every rank (the rows' weights travel with
the rows); the return buffer (and its weight gradients) is stored into only after the barrier at the end of the dispatch
(forward) or of the combine backward (backward), which every reader of the previous contents passed
after reading; and a gradient buffer only after the sum of the previous layer's dispatch backward
of the same chunk waited for the peers' signals, sent after their experts' backward read it (one
gradient buffer per chunk: a layer's chunks' combine backwards run back to back).

Memory per slot: 2 · G·T_cap token rows of D (received and returned), 2 · R_cap int64 (each
pair row's token row and source) and R_cap + P_cap fp32 (weights, returned weight gradients), and
G·T_cap token rows of D for each chunk's gradient buffer (train.memory.p2p_buffer_bytes). The
experts' activations are R_cap rows too: dropless, the worst case, G× the T·K rows a balanced layer
receives; with a capacity, its bound, about capacity_factor × those.

Requirements: CUDA, every rank of the expert-parallel group on one node with peer access
(``torch.distributed._symmetric_memory``), and a token bound ``max_tokens`` per rank known to all
ranks (the buffers are allocated collectively, the same size everywhere).
"""

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from moe.capacity import RoutingPlan
from moe.config import check_positive_int
from parallel import flight
from parallel.ep_dispatcher import ExpertParallelDispatcher, ExpertParallelMeta
from parallel.p2p_rows import (
    dispatch_rows, expand_rows, pair_values, push_back, push_rows, return_table, signal_peers, sum_returned,
)
from parallel.token_rows import gather_slots

_ALIGN = 256


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory under a tensor of its own version counter, for the copy engines' stores. A
    copy through a view of a rank's ``bytes`` would bump the version that the views handed to
    autograd share (``w_R``), and the backward of anything viewing them would then raise "... its
    base or another view of its base has been modified inplace": so it did on 2×H200 when the own
    block was still copied, and so it would wherever a peer view is a rank's own tensor (the CPU
    tests' one-process ranks). The kernels' stores through raw addresses bump nothing; neither may
    these."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


class _SymmetricBuffer:
    """One collectively allocated byte buffer carved into typed regions: ``views[name]``
    is this rank's region, ``ptrs[name]`` the (G,) int64 addresses of that region on every rank."""

    def __init__(self, group, sizes: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device,
                 timeout_ms: int):
        self.timeout_ms = timeout_ms
        offsets, nbytes, total = {}, {}, 0
        for name, (shape, dtype) in sizes.items():
            offsets[name], nbytes[name] = total, dtype.itemsize * math.prod(shape)
            total += -(-nbytes[name] // _ALIGN) * _ALIGN
        self.bytes = self._empty(max(total, _ALIGN), device)
        # padding rows hold finite values from the start, and the flags start at 0. A peer may
        # store its counts and signal as soon as it has passed its allocation, so the zeros must
        # be on the device before any peer gets past it: a zero_() still queued here wiped a
        # peer's signal on 2×H200 (a slot allocated lazily at the second dispatch waited forever
        # for its counts flag). The exchange alone does not order that: the symmetric-memory pool
        # hands out parts of segments that were exchanged before, and then rendezvous answers
        # from its cache without a collective. So a device barrier after the zeros on this stream
        # (every peer's later stores are queued after its own barrier, which waits for this one),
        # and the host waits for it, so work on any stream comes after.
        self.bytes.zero_()
        ptrs = self._exchange(group, self.bytes)
        self.barrier()
        torch.cuda.current_stream(device).synchronize()
        base_G = torch.tensor(ptrs, dtype=torch.int64, device=device)
        self._base_ptrs = ptrs
        self.views, self.ptrs = {}, {}
        self._regions = {name: (offsets[name], nbytes[name], shape, dtype) for name, (shape, dtype) in sizes.items()}
        self._peer_regions: dict[str, list[torch.Tensor]] = {}
        for name in sizes:
            self.views[name] = self._region(self.bytes, name)
            self.ptrs[name] = base_G + offsets[name]

    def _region(self, bytes_: torch.Tensor, name: str) -> torch.Tensor:
        offset, nbytes, shape, dtype = self._regions[name]
        return bytes_[offset:offset + nbytes].view(dtype).view(shape)

    def peer_views(self, name: str) -> list[torch.Tensor]:
        """Region ``name`` of every rank's buffer (this rank's own at its index) as tensors on this
        device, for the copy engines to store into (made at the first call, then kept)."""
        if name not in self._peer_regions:
            views = [self._region(_alias(self._peer_bytes(g)), name) for g in range(len(self._base_ptrs))]
            # the kernels reach the same regions through the exchanged addresses: a view elsewhere
            # (a mapping offset one side counts and the other not) would put the copied rows where
            # no kernel reads them
            offset = self._regions[name][0]
            for g, view in enumerate(views):
                if view.data_ptr() != self._base_ptrs[g] + offset:
                    raise RuntimeError(f"P2PDispatcher: rank {g}'s mapped region {name!r} is at {view.data_ptr():#x}, "
                                       f"the kernels' address is {self._base_ptrs[g] + offset:#x}")
            self._peer_regions[name] = views
        return self._peer_regions[name]

    def _peer_bytes(self, g: int) -> torch.Tensor:
        """Rank g's byte buffer, mapped on this device (this rank's own for g = its rank)."""
        if g == self.handle.rank:
            return self.bytes
        return self.handle.get_remote_tensor(g, self.bytes.shape, torch.uint8)

    def _empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """(nbytes,) uint8 of this rank's symmetric memory."""
        import torch.distributed._symmetric_memory as symm_mem

        return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)

    def _exchange(self, group, buf: torch.Tensor) -> list[int]:
        """The G ranks' addresses of ``buf``, and the handle :meth:`barrier` uses."""
        import torch.distributed._symmetric_memory as symm_mem

        self.handle = symm_mem.rendezvous(buf, group)
        return list(self.handle.buffer_ptrs)

    def barrier(self) -> None:
        """Every rank's stores into these buffers so far are complete and visible (device side)."""
        flight.record("symmetric-memory barrier of the P2P dispatcher")
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)


class _Slot:
    """The buffers one dispatch holds until its backward: ``recv`` (G·T_cap, D) token rows received
    (source s's token t at row s·T_cap + t), per received pair row (R_cap):
    ``tok`` int64 its token row, ``src`` int64 where it came from, ``w`` fp32 its combine weight;
    ``ret`` (G·T_cap, D) this rank's tokens' rows sent back, one per rank (rank g's sum of token t's
    pairs at row g·T_cap + t), and ``ret_w`` (P_cap,) fp32 its pairs' weight
    gradients, ``counts`` (G, E) int64, two int64 flags (``counts_flag``, ``back_flag``) that the
    peers' kernels signal. ``generation`` counts the dispatches that took the slot.

    The values the flags must reach live on this rank's device, never the host (a captured CUDA
    graph replays the launches that advance them): ``dispatch_state`` (1,) int64, what the
    counts flag has reached (:func:`~parallel.p2p_rows.dispatch_rows`), and ``back_expected`` (1,) int64, what the back
    flag reaches once the peers' pushes so far arrived (:func:`~parallel.p2p_rows.push_back`
    advances it, :func:`~parallel.p2p_rows.sum_returned` waits for it)."""

    def __init__(self, group, R_cap: int, P_cap: int, D: int, dtype: torch.dtype, G: int, E: int, device,
                 timeout_ms: int, T_cap: int):
        self.buf = _SymmetricBuffer(group, {
            "recv": ((G * T_cap, D), dtype), "ret": ((G * T_cap, D), dtype), "tok": ((R_cap,), torch.int64),
            "src": ((R_cap,), torch.int64), "w": ((R_cap,), torch.float32), "ret_w": ((P_cap,), torch.float32),
            "counts": ((G, E), torch.int64),
            "counts_flag": ((1,), torch.int64), "back_flag": ((1,), torch.int64),
        }, device, timeout_ms)
        self.generation = 0
        self.dispatch_state = torch.zeros(1, dtype=torch.int64, device=device)
        self.back_expected = torch.zeros(1, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class _Home:
    """What the way back of every dispatch of one buffer shape reads, made once: ``src_M``
    (G·T_cap,) int64 where the sum of (source s, token t), row m = s·T_cap + t of the receiver's
    sums, goes (row ``me·T_cap + t`` of rank s's return buffer, as ``s · G·T_cap + row``);
    ``n_M`` (1,) their number on the device; ``rows_TG`` (T_cap, G) int64 the rows of token t's
    G sums in this rank's return buffer (g·T_cap + t); ``lead_TG`` (T_cap·G,) int32 the dispatch
    kernel's (token, rank) tickets, zeroed by each dispatch that stores rows."""

    src_M: torch.Tensor
    n_M: torch.Tensor
    rows_TG: torch.Tensor
    lead_TG: torch.Tensor

    @staticmethod
    def make(G: int, T_cap: int, me: int, device) -> "_Home":
        m = torch.arange(G * T_cap, device=device)
        src_M = (m // T_cap) * (G * T_cap) + me * T_cap + m % T_cap
        rows_TG = torch.arange(G, device=device)[None, :] * T_cap + torch.arange(T_cap, device=device)[:, None]
        lead_TG = torch.zeros(T_cap * G, dtype=torch.int32, device=device)
        return _Home(src_M, torch.tensor([G * T_cap], device=device), rows_TG.contiguous(), lead_TG)


@dataclass(frozen=True)
class _P2PRoute:
    """One dispatch: ``row_TK`` (T, K) int64 row of each pair among rank ``dest_TK[t, k]``'s pair
    rows (-1: dropped); ``offsets_J`` (L,) int32 this rank's experts' row ends; ``tokrow_TK`` (T,
    K) int64 the token row the pair stored at its destination (-1 where another pair of the token
    did, or dropped: where the combine backward sends ``dout``; all -1 under ``engine``) (all four
    filled on the device by the dispatch); the slot and the generation that wrote it; the
    dispatcher's gradient buffer; the way back's tables; ``engine``: the rows move as whole token
    blocks on the copy engines (:func:`_send_rows`, :func:`_send_blocks`), not inside the kernels."""

    row_TK: torch.Tensor
    dest_TK: torch.Tensor
    offsets_J: torch.Tensor
    slot: _Slot
    generation: int
    grad: _SymmetricBuffer
    me: int
    P_cap: int
    index: int
    home: _Home
    tokrow_TK: torch.Tensor
    engine: bool

    @cached_property
    def returned_TG(self) -> torch.Tensor:
        """(T, G) int64 the rows of token t's returned sums in this rank's return buffer, from the
        ranks that hold a kept pair of it (-1 for the others: they send none); read after the
        dispatch filled the route, once for the combine and its dispatch backward."""
        T, G = self.row_TK.shape[0], self.home.rows_TG.shape[1]
        has_TG = torch.zeros((T, G + 1), dtype=torch.bool, device=self.row_TK.device)
        has_TG.scatter_(1, torch.where(self.row_TK >= 0, self.dest_TK, G), True)
        return torch.where(has_TG[:, :G], self.home.rows_TG[:T], -1)

    @property
    def T_cap(self) -> int:
        """The tokens of one dispatch the buffers hold (P_cap = T_cap · K)."""
        return self.P_cap // self.row_TK.shape[1]

    @property
    def n_rows(self) -> torch.Tensor:
        """(1,) int32 device count of the valid rows received."""
        return self.offsets_J[-1:]

    def check(self) -> None:
        if self.slot.generation != self.generation:
            raise RuntimeError(
                f"P2PDispatcher: buffer slot {self.index} was taken by a later dispatch before this one's "
                "combine/backward finished with it; build the dispatcher with num_buffers >= the number of MoE "
                "layers run between a dispatch and its backward")


@dataclass(frozen=True)
class P2PMeta(ExpertParallelMeta):
    """What ``combine`` needs from ``dispatch``: the route."""

    route: _P2PRoute


# The copy-engine mode's moves. This rank's own block is not copied: its readers
# (p2p_rows.expand_rows, p2p_rows.sum_returned) take it where it is (on 2×H200 the transfer of the
# OLMoE-shaped step took 56.5 ms of 1.40 s, 45.2 of it the peer copies: the rest, the within-device
# copies of the own block and the signals, was exposed). Contiguous copies of equal dtype between
# tensors of this device are cudaMemcpyAsync calls, which the copy engines run without taking SMs
# from the kernels beside them.

def _send_rows(rows_TD: torch.Tensor, buf: _SymmetricBuffer, name: str, me: int, T_cap: int) -> torch.Tensor:
    """``rows_TD`` (T, D), cast to region ``name``'s dtype, into rows ``me·T_cap ... me·T_cap + T``
    of that region (G·T_cap, D) of every other rank's ``buf``; returns the rows as sent (this
    rank's own block, which its reader takes in place)."""
    views = buf.peer_views(name)
    rows_TD = rows_TD.to(views[me].dtype).contiguous()
    for g, view in enumerate(views):
        if g != me:
            view[me * T_cap:me * T_cap + rows_TD.shape[0]].copy_(rows_TD)
    return rows_TD


def _send_blocks(blocks_GTD: torch.Tensor, buf: _SymmetricBuffer, name: str, me: int, T_cap: int) -> None:
    """Block g of ``blocks_GTD`` (G·T_cap, D) into rows ``me·T_cap ... (me + 1)·T_cap`` of region
    ``name`` of rank g's ``buf``, for every other rank g (the way back: rank g's tokens' sums)."""
    for g, view in enumerate(buf.peer_views(name)):
        if g != me:
            view[me * T_cap:(me + 1) * T_cap].copy_(blocks_GTD[g * T_cap:(g + 1) * T_cap])


def _expand_arrived(route: _P2PRoute, buf: _SymmetricBuffer, name: str, own_TD: torch.Tensor | None) -> torch.Tensor:
    """After ``buf``'s barrier (every rank's token rows are in region ``name``): the token rows
    copied into this rank's pair rows (:func:`~parallel.p2p_rows.expand_rows`), the own block
    (``own_TD``, copy engines: what :func:`_send_rows` returned) read where it is, at the rows
    ``_send_rows`` fills on the peers."""
    buf.barrier()
    return expand_rows(buf.views[name], route.slot.buf.views["tok"], route.n_rows, own_TD, route.me * route.T_cap)


def _home_and_sum(route: _P2PRoute, y_RD: torch.Tensor, out_dtype: torch.dtype,
                  g_R: torch.Tensor | None = None):
    """The way back, shared by the combine and the dispatch backward. The receiver first sums each
    (source, token)'s valid rows of y_RD (R_cap, D) contiguous in fp32 (:func:`return_table`: one
    rounding to the rows' dtype per token and rank, as the NCCL dispatcher's), then stores one
    row per (source, token) that has rows here into the source's return buffer, its own sources'
    into its own (so a token's rows cross the link once however many of its pairs a rank holds:
    about 4× fewer bytes at top-8 of 64 on 2 ranks than a row per pair); with ``g_R`` (R_cap,)
    fp32, the rows' weight gradients, each goes to its pair's place of the source's ``ret_w``. Then ``out_TD[t] = Σ_g``
    of token t's G rows (T, D) once the peers' rows have arrived; with ``g_R``, ``(out_TD,
    dw_TK)``, dw_TK (T, K) fp32 each pair's weight gradient."""
    slot, home = route.slot, route.home
    bufs = slot.buf
    K, G = route.row_TK.shape[1], bufs.ptrs["ret"].numel()
    T_cap, ret_dtype = route.T_cap, bufs.views["ret"].dtype
    table_MK = return_table(bufs.views["src"], route.n_rows, G, T_cap, K)
    sums_MD = gather_slots(y_RD, table_MK, out_dtype=ret_dtype)
    if route.engine:  # every (source, token)'s row, zeros where it has none here; then one signal
        _send_blocks(sums_MD, bufs, "ret", route.me, T_cap)
        signal_peers(bufs.ptrs["back_flag"], slot.back_expected, route.me)
    else:  # only the (source, token)s with rows here travel: at top-2 of 8 ranks most have none
        src_M = torch.where((table_MK >= 0).any(1), home.src_M, -1)
        push_back(sums_MD, src_M, home.n_M, bufs.ptrs["ret"], ret_dtype, route.me, G * T_cap, bufs.ptrs["back_flag"],
                  slot.back_expected, own_too=True)
    if g_R is not None:
        push_back(None, bufs.views["src"], route.n_rows, bufs.ptrs["ret"], ret_dtype, route.me, route.P_cap,
                  bufs.ptrs["back_flag"], slot.back_expected, g_R, bufs.ptrs["ret_w"], num_rows=y_RD.shape[0])
    out_TD = sum_returned(bufs.views["ret"], route.returned_TG, out_dtype, bufs.views["back_flag"],
                          slot.back_expected, bufs.timeout_ms, own_MD=sums_MD if route.engine else None, me=route.me)
    if g_R is None:
        return out_TD
    return out_TD, pair_values(route.row_TK, route.dest_TK, g_R, bufs.views["ret_w"], route.me)


class _P2PDispatchFn(torch.autograd.Function):
    """x_TD (T, D), w_TK (T, K) fp32, order_P (T·K,), counts_E (E,) -> rows_RD (R_cap, D) and w_R
    (R_cap,) fp32, views of the slot's receive and weight buffers; fills the route's row_TK,
    dest_TK and offsets_J. Backward: the rows' gradients and the weights' gradients (w_R's, from
    the experts) go home; dx sums each token's rows, dw_TK is each pair's weight gradient."""

    @staticmethod
    def forward(ctx, x_TD, w_TK, order_P, counts_E, route: _P2PRoute):
        slot = route.slot
        bufs = slot.buf
        dispatch_rows(
            x_TD, w_TK, order_P, counts_E, bufs.ptrs["counts"], bufs.ptrs["counts_flag"], slot.dispatch_state,
            bufs.views["counts"], bufs.views["counts_flag"], bufs.ptrs["recv"], bufs.ptrs["src"], bufs.ptrs["w"],
            bufs.views["recv"].dtype, route.me, route.row_TK.shape[1], route.P_cap, bufs.views["tok"].shape[0],
            bufs.ptrs["tok"], route.home.lead_TG,
            out=(route.row_TK, route.dest_TK, route.offsets_J, route.tokrow_TK), timeout_ms=bufs.timeout_ms,
            store_rows=not route.engine)
        own_TD = None
        if route.engine:  # after the kernel, so after the peers' counts: they finished with the slot
            own_TD = _send_rows(x_TD, bufs, "recv", route.me, route.T_cap)
        ctx.route, ctx.x_dtype = route, x_TD.dtype
        w_R = bufs.views["w"].view_as(bufs.views["w"])
        if not ctx.needs_input_grad[1]:  # the experts then skip the weights' gradient
            ctx.mark_non_differentiable(w_R)
        return _expand_arrived(route, bufs, "recv", own_TD), w_R

    @staticmethod
    def backward(ctx, grad_RD, grad_R):
        route = ctx.route
        route.check()
        # whether the weights' gradients travel is this rank's choice, but a peer reads them: every
        # rank's w_TK must need a gradient or none (as every rank runs the same model)
        if not ctx.needs_input_grad[1]:
            return _home_and_sum(route, grad_RD.contiguous(), ctx.x_dtype), None, None, None, None
        dx_TD, dw_TK = _home_and_sum(route, grad_RD.contiguous(), ctx.x_dtype, grad_R.float().contiguous())
        return dx_TD, dw_TK, None, None, None


class _P2PCombineFn(torch.autograd.Function):
    """y_RD (R_cap, D) in dispatch order, weighted by the experts -> out_TD = Σ_k y[row of (t, k)].
    Keeps nothing for its backward but the route: dout goes to every row of its token."""

    @staticmethod
    def forward(ctx, y_RD, route: _P2PRoute, out_dtype):
        route.check()
        ctx.route, ctx.y_dtype = route, y_RD.dtype
        return _home_and_sum(route, y_RD.contiguous(), out_dtype)

    @staticmethod
    def backward(ctx, dout_TD):
        route = ctx.route
        route.check()
        grad = route.grad
        # dout once per (token, rank), where the dispatch stored the token's row (the copy
        # engines: the whole block to every rank); then each rank copies it into its pair rows
        own_TD = None
        if route.engine:
            own_TD = _send_rows(dout_TD, grad, "rows", route.me, route.T_cap)
        else:
            push_rows(dout_TD, route.tokrow_TK, route.dest_TK, grad.ptrs["rows"], grad.views["rows"].dtype,
                      me=route.me)
        dy_RD = _expand_arrived(route, grad, "rows", own_TD)
        return dy_RD if dy_RD.dtype == ctx.y_dtype else dy_RD.to(ctx.y_dtype), None, None


class P2PDispatcher(ExpertParallelDispatcher):
    """Dispatcher for :class:`moe.MoELayer` over an expert-parallel group on one node, the rows
    moved by NVLink peer stores instead of NCCL and no host sync (see the module docstring); the
    load-balancing loss and stats reductions are the base's.

    Args:
        ep_group, world_group: as for :class:`~parallel.ep_dispatcher.ExpertParallelDispatcher`;
            every rank of ``ep_group`` on one node.
        max_tokens: the most tokens any rank passes to one MoE layer (one ``dispatch``, or
            ``overlap_chunks`` of them through :meth:`run_experts`).
        num_buffers: slots of buffers, taken round-robin, in layers: at least the number of MoE
            layers whose dispatch runs before their backward (a model of n MoE layers: n). A
            dispatch whose slot was taken again before its backward raises (never silently reads
            newer rows).
        overlap_chunks: N; :meth:`run_experts` pipelines each layer's tokens in N chunks on a side
            stream (:meth:`~parallel.ep_dispatcher.ExpertParallelDispatcher.run_experts`). The
            buffers then hold a chunk, ``ceil(max_tokens / N)`` tokens, in N · num_buffers slots
            (dropless, the bytes of one unchunked slot per layer; under a capacity each chunk's
            holds the layer's whole bound where smaller), with a gradient buffer per chunk: the
            combine backwards of a layer's chunks run back to back on the side stream, and one
            chunk's stores must not land in rows a peer still copies out for the other.
        copy_engine: the token rows move as whole blocks (a rank's T rows to every other rank,
            each way back's G - 1 blocks of T_cap sums; the own block is read in place) by
            cudaMemcpyAsync on the copy engines, which leave the SMs to the kernels beside them (a
            side stream's exchange beside the experts' GEMMs under ``overlap_chunks``); the
            kernels then move only the counts, routes and weights. A
            block holds every token, also those with no pair on that rank: hardly more bytes where
            nearly every token has one (top-8 of 64 on 2 ranks: all but 0.2 %), 4× the rows where
            one token in 4 does (top-2 of 8 on 8 ranks).
        timeout_s: how long a rank's kernels wait for a peer's signal (and its barriers for the
            peers) before the process fails with a CUDA error, having printed what it waited for
            (a peer that died or made other calls never signals); the trainer passes
            ``parallel.timeout_s``.
        capacity_factor, capacity_groups: the MoE layers' (:class:`moe.MoEConfig`), when they cap
            what an expert keeps: the buffers, and the rows the experts compute, then hold the
            capacity's bound on what a rank receives instead of dropless's worst case (ep 8,
            capacity_factor 1.25: 6.4× fewer rows). A dispatch that would receive more (a layer
            capped less than declared) fails the process with a CUDA error, having printed why.

    ``dispatch`` returns R_cap rows and row weights, whatever the routing; rows past
    ``offsets[-1]`` are padding. Buffers are allocated at the first call for each (D, dtype, K, E).
    """

    def __init__(self, ep_group=None, world_group=None, max_tokens: int = 0, num_buffers: int = 1,
                 timeout_s: float = 120.0, capacity_factor: float | None = None, capacity_groups: int = 1,
                 overlap_chunks: int = 1, copy_engine: bool = False):
        super().__init__(ep_group, world_group, overlap_chunks)
        self._set_token_bound(max_tokens, capacity_factor, capacity_groups)
        check_positive_int("P2PDispatcher: num_buffers", num_buffers)
        if not timeout_s > 0:  # NaN included
            raise ValueError(f"P2PDispatcher: timeout_s must be > 0, got {timeout_s}")
        if not torch.cuda.is_available():
            raise RuntimeError("P2PDispatcher needs CUDA GPUs (symmetric memory); use AllToAllDispatcher")
        self.num_buffers = num_buffers
        self.copy_engine = bool(copy_engine)
        self.timeout_ms = math.ceil(timeout_s * 1000)
        # resources reused by every call (not per-call state): the slots and gradient buffers of
        # each buffer shape, and how many dispatches each shape has served (picks both)
        self._pools: dict[tuple, tuple[list[_Slot], list[_SymmetricBuffer], _Home]] = {}
        self._calls: dict[tuple, int] = {}

    def __repr__(self) -> str:
        chunks = "" if self.overlap_chunks == 1 else f", overlap_chunks={self.overlap_chunks}"
        engine = ", copy_engine" if self.copy_engine else ""
        return (f"P2PDispatcher(ep_size={self.ep_size}, ep_rank={self.ep_rank}, num_buffers={self.num_buffers}, "
                f"{self._token_bound_repr()}{chunks}{engine})")

    def _take_slot(self, D: int, dtype: torch.dtype, K: int, E: int, device: torch.device):
        G, T_cap = self.ep_size, self.dispatch_tokens
        R_cap = self._received_rows_bound(E, K, T_cap)
        P_cap = T_cap * K
        key = (D, dtype, K, E, device)
        group = self.ep_group if self.ep_group is not None else dist.group.WORLD
        if key not in self._pools:
            grads = [_SymmetricBuffer(group, {"rows": ((G * T_cap, D), dtype)}, device, self.timeout_ms)
                     for _ in range(self.overlap_chunks)]
            self._pools[key] = ([], grads, _Home.make(G, T_cap, self.ep_rank, device))
        slots, grads, home = self._pools[key]
        calls = self._calls.get(key, 0)
        self._calls[key] = calls + 1
        # run_experts makes a layer's N chunk dispatches in order, so call c of a layer is chunk c
        grad = grads[calls % self.overlap_chunks]
        index = calls % (self.num_buffers * self.overlap_chunks)
        if index == len(slots):
            slots.append(_Slot(group, R_cap, P_cap, D, dtype, G, E, device, self.timeout_ms, T_cap))
        slot = slots[index]
        slot.generation += 1
        # a view of the earlier generation's rows or weights kept by autograd now fails its version
        # check (every region is a view of the slot's one byte buffer and shares its counter)
        increment_version(slot.buf.bytes)
        return slot, grad, index, P_cap, home

    def _dispatch_ep(self, x_TD: torch.Tensor, plan: RoutingPlan, w_TK: torch.Tensor, num_experts: int, prepared,
                     row_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, P2PMeta]:
        """As :meth:`~moe.dispatch.Dispatcher.dispatch`, but rows_RD and w_R have R_cap rows
        (padding past ``offsets[-1]``: stale values of earlier dispatches, zeros at first; the
        grouped GEMM zero-fills those rows, so the experts' output and weight gradient there are 0
        for finite stale weights, and the combine never reads them).
        Raises ValueError when T > T_cap. Nothing to prepare: the counts travel inside the
        dispatch kernel."""
        me, E = self.ep_rank, num_experts
        T, K = plan.kept_TK.shape
        self._check_dispatch_tokens(T)
        device = x_TD.device
        slot, grad, index, P_cap, home = self._take_slot(x_TD.shape[1], row_dtype, K, E, device)
        route_3TK = torch.empty((3, T, K), dtype=torch.int64, device=device)
        offsets_J = torch.empty(E // self.ep_size, dtype=torch.int32, device=device)
        route = _P2PRoute(route_3TK[0], route_3TK[1], offsets_J, slot, slot.generation, grad, me, P_cap, index, home,
                          route_3TK[2], self.copy_engine)
        rows_RD, w_R = _P2PDispatchFn.apply(x_TD, w_TK, plan.order_P, plan.kept_per_expert_E.contiguous(), route)
        return rows_RD, route.offsets_J, w_R, P2PMeta(route=route)

    def _combine_ep(self, y_RD: torch.Tensor, meta: P2PMeta, out_dtype: torch.dtype) -> torch.Tensor:
        """As :meth:`~moe.dispatch.Dispatcher.combine`; y_RD has the R_cap rows ``dispatch`` returned."""
        R_cap = meta.route.slot.buf.views["tok"].shape[0]
        if y_RD.dim() != 2 or y_RD.shape[0] != R_cap:
            raise ValueError(f"P2PDispatcher.combine: y_RD must have the {R_cap} rows dispatch returned, "
                             f"got {tuple(y_RD.shape)}")
        return _P2PCombineFn.apply(y_RD, meta.route, out_dtype)
