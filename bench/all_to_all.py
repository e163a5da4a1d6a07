"""Benchmark: AllToAllDispatcher dispatch + combine vs raw ``all_to_all_single`` of one row per pair.

With ``--transport p2p`` ours is :class:`parallel.P2PDispatcher` (rows by NVLink stores into
symmetric memory, no host sync; ``max_tokens`` = the row's tokens) and the NCCL dispatcher is
timed in the same rounds in place of the link-bytes-only exchange (results/all_to_all.md; the NCCL
dispatcher's own tables: results/all_to_all_nccl.md).

What is timed (forward only, no autograd): ours = ``dispatch`` (the route, counts all-to-all, one
device->host copy of the counts, one row per token and remote rank packed while it travels,
variable-split all-to-all of those rows while the own pairs' rows are written into the experts'
input, then each received row copied into its pair rows) then ``combine`` of the dispatched rows
(identity experts, which leave ``w_R`` unapplied: each received token's rows summed into one,
reverse all-to-all, then one pass summing each token's rows into (T, D)). Anchor = two raw
``all_to_all_single`` calls with the split sizes of one row per (token, expert) pair, own chunk
included, on preallocated buffers (there and back): the rows a layout without the per-rank sums
must move, none of the bookkeeping. Since the dispatcher sends each token to a rank once, its
ratio can exceed 1 (about K / G fewer rows cross at top-K of E on G ranks). Also shown (not the
anchor): the raw exchange without the own chunk, i.e. only the pair bytes that cross the link.
Routing: uniform random top-K (distinct experts per token), dropless, bf16 rows, ep = world
(each GPU holds E / world experts).

Effective bandwidth = bytes sent + received per rank (both exchanges, the rank's own chunk
included, mean over ranks) / time (max over ranks).
Protocol: per row, ``rounds`` rounds alternating ours, anchor, ours again; each timing is a fixed
number of back-to-back calls between CUDA events (not triton's do_bench: its repeat count is
estimated per process, and collectives need the same count on every rank). The claim is the
median over rounds of anchor_time / our_time (= our bandwidth / raw bandwidth; bar 0.85); the
A-vs-A column is ours / ours-again, the noise.

    torchrun --nproc_per_node=2 bench/all_to_all.py [--out bench/results/all_to_all_nccl.md]
    torchrun --nproc_per_node=2 bench/all_to_all.py --transport p2p [--backward]   # GPUs of one node
    torchrun --nproc_per_node=2 bench/all_to_all.py --smoke      # CPU/gloo, seconds, prints only
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moe.capacity import plan_routing  # noqa: E402
from parallel import ParallelDims, init_distributed  # noqa: E402

LAYERS = {  # name: (D, E, K)
    "Mixtral-like (D 4096, E 8, top-2)": (4096, 8, 2),
    "fine-grained (D 2048, E 64, top-8)": (2048, 64, 8),
}
TOKENS = (4096, 8192, 16384, 32768)
SMOKE_LAYERS = {"smoke (D 64, E 8, top-2)": (64, 8, 2), "smoke (D 32, E 16, top-4)": (32, 16, 4)}
SMOKE_TOKENS = (64, 256)


def _timer(device):
    """Seconds per call of ``fn`` over ``iters`` calls, every rank starting together."""
    def measure(fn, iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    return measure


def _max_over_ranks(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _mean_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _layer_call(dispatcher, D, E, K, T, device, dtype, seed, backward=False):
    """Random top-K routing of T random tokens; returns (x_TD, w_TK, plan, ours) where ``ours()``
    is dispatch + combine with identity experts (``backward``: then the backward of both, with a
    random output gradient, into leaves x_TD and w_TK)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x_TD = torch.randn(T, D, device=device, dtype=dtype, generator=gen)
    experts_TK = torch.rand(T, E, device=device, generator=gen).topk(K, dim=-1).indices
    priority_TK = torch.rand(T, K, device=device, generator=gen)
    plan = plan_routing(experts_TK, priority_TK, E, None)
    w_TK = priority_TK / priority_TK.sum(-1, keepdim=True)

    grad_TD = torch.randn(T, D, device=device, dtype=dtype, generator=gen)
    if backward:
        x_TD.requires_grad_(), w_TK.requires_grad_()

    def ours():
        rows_RD, _, _, meta = dispatcher.dispatch(x_TD, plan, w_TK)  # w_R: the experts would apply it
        out_TD = dispatcher.combine(rows_RD, meta)
        if backward:
            x_TD.grad = w_TK.grad = None
            out_TD.backward(grad_TD)
        return out_TD

    ours.grad_TD = grad_TD
    return x_TD, w_TK, plan, ours


def _pair_splits(plan, dims) -> tuple[list[int], list[int]]:
    """The pairs this rank sends to and receives from each rank: what a layout with one row per
    pair moves (the anchor's split sizes)."""
    send_G = plan.kept_per_expert_E.view(dims.ep, -1).sum(-1)
    recv_G = torch.empty_like(send_G)
    dist.all_to_all_single(recv_G, send_G, group=dims.ep_group)
    return send_G.tolist(), recv_G.tolist()


def bench_row(dispatcher, dims, D, E, K, T, rounds, device, dtype, measure, backward=False, nccl=None):
    """One table row. ``nccl``: the AllToAllDispatcher, when ``dispatcher`` is another one: it is
    timed in place of the link-bytes-only exchange."""
    x_TD, w_TK, plan, ours = _layer_call(dispatcher, D, E, K, T, device, dtype, 1000 + dist.get_rank(), backward)
    gen = torch.Generator(device=device).manual_seed(2000 + dist.get_rank())

    # correctness guard, before the timed calls (whose experts are the identity): experts that
    # weight their rows bring every token home as Σ_k w[t, k] · x[t] (dropless: every pair kept);
    # backward dx = Σ_k w · g, dw[t, k] = <g[t], x[t]>
    with torch.set_grad_enabled(backward):
        rows_RD, _, w_R, meta = dispatcher.dispatch(x_TD, plan, w_TK)
        out_TD = dispatcher.combine(rows_RD * w_R[:, None].to(rows_RD.dtype), meta)
        if backward:
            out_TD.backward(ours.grad_TD)
    x, w, g = x_TD.detach().float(), w_TK.detach(), ours.grad_TD.float()
    scale = w.sum(-1, keepdim=True)
    torch.testing.assert_close(out_TD.detach(), (x * scale).to(dtype), rtol=1e-2, atol=1e-2)
    if backward:
        torch.testing.assert_close(x_TD.grad.float(), g * scale, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(w_TK.grad, (g * x).sum(-1, keepdim=True).expand_as(w), rtol=2e-2, atol=0.5)
    send_splits, recv_splits = _pair_splits(plan, dims)
    send_MD = torch.randn(sum(send_splits), D, device=device, dtype=dtype, generator=gen)
    recv_RD = torch.empty(sum(recv_splits), D, device=device, dtype=dtype)
    back_MD = torch.empty_like(send_MD)

    def raw():
        for _ in range(2 if backward else 1):  # backward: the same two exchanges once more
            dist.all_to_all_single(recv_RD, send_MD, recv_splits, send_splits, group=dims.ep_group)
            dist.all_to_all_single(back_MD, recv_RD, send_splits, recv_splits, group=dims.ep_group)

    me = dims.ep_rank
    link_send = [0 if g == me else n for g, n in enumerate(send_splits)]
    link_recv = [0 if g == me else n for g, n in enumerate(recv_splits)]
    link_send_MD, link_recv_RD = send_MD[:sum(link_send)], recv_RD[:sum(link_recv)]
    link_back_MD = back_MD[:sum(link_send)]

    if nccl is not None:
        raw_link = _layer_call(nccl, D, E, K, T, device, dtype, 1000 + dist.get_rank(), backward)[3]
    else:
        def raw_link():
            for _ in range(2 if backward else 1):
                dist.all_to_all_single(link_recv_RD, link_send_MD, link_recv, link_send, group=dims.ep_group)
                dist.all_to_all_single(link_back_MD, link_recv_RD, link_send, link_recv, group=dims.ep_group)

    elem = torch.finfo(dtype).bits // 8
    passes = 4 if backward else 2
    nbytes = _mean_over_ranks(passes * (sum(send_splits) + sum(recv_splits)) * D * elem, device)
    # same count on every rank (from the config only): ~0.2 s of raw traffic at ~300 GB/s
    iters = max(5, min(100, int(0.2 * 300e9 / (2 * passes * T * K * D * elem))))
    with torch.set_grad_enabled(backward):
        for fn in (ours, raw, raw_link):
            measure(fn, 3)
        t_ours, t_raw, t_again, t_link = [], [], [], []
        for _ in range(rounds):
            t = _max_over_ranks([measure(ours, iters), measure(raw, iters), measure(ours, iters),
                                 measure(raw_link, iters)], device)
            t_ours.append(t[0]), t_raw.append(t[1]), t_again.append(t[2]), t_link.append(t[3])
    ratios = [r / o for r, o in zip(t_raw, t_ours)]
    noise = [o / a for o, a in zip(t_ours, t_again)]
    med_ours, med_raw = statistics.median(t_ours), statistics.median(t_raw)
    return {
        "tokens": T, "mbytes": nbytes / 1e6, "ours_ms": med_ours * 1e3, "raw_ms": med_raw * 1e3,
        "ours_gbs": nbytes / med_ours / 1e9, "raw_gbs": nbytes / med_raw / 1e9,
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "a_vs_a": statistics.median(noise), "iters": iters, "link_ms": statistics.median(t_link) * 1e3,
        "link_ratio": statistics.median([r / n for r, n in zip(t_raw, t_link)]),
    }


def _warm(dispatcher, D, E, K, T, device, dtype, iters, rank):
    """Run ours ``iters`` times before timing anything (a count, not a duration: every rank must
    make the same collective calls). In one 2×H200 session the first row timed (4k tokens, the
    most host-bound) came out 2× slower than the same call timed seconds later in another
    process, while the anchor was unaffected."""
    _, _, _, ours = _layer_call(dispatcher, D, E, K, T, device, dtype, 5 + rank)
    with torch.no_grad():
        for _ in range(iters):
            ours()
    if device.type == "cuda":
        torch.cuda.synchronize()


def _profile(dispatcher, D, E, K, T, device, dtype, rank):
    """Where ours spends its time: CUDA kernels and host waits over 10 calls (rank 0 prints)."""
    _, _, _, ours = _layer_call(dispatcher, D, E, K, T, device, dtype, 7 + rank)
    with torch.no_grad():
        for _ in range(3):
            ours()
        torch.cuda.synchronize()
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                ours()
            torch.cuda.synchronize()
    if rank == 0:
        for key in ("cuda_time_total", "cpu_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=16), flush=True)


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def _header(device, world, rounds, backward, transport="nccl") -> str:
    if device.type == "cuda":
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        name = f"{world}× {torch.cuda.get_device_name(device)}, NCCL {nccl}"
    else:
        name = f"{world} CPU processes ({platform.processor() or platform.machine()}), gloo"
    if transport == "p2p":
        what = ["# P2PDispatcher: dispatch + combine vs raw all_to_all_single", "",
                "- ours: P2PDispatcher (rows stored into the other GPU's symmetric memory by Triton kernels, no NCCL, no",
                "  host sync; `max_tokens` = the row's tokens, one buffer slot)."]
        last = ("- last column: the NCCL AllToAllDispatcher in the same rounds, its ratio to raw (the version P2P "
                "replaces), not the anchor.")
    else:
        what = ["# AllToAllDispatcher: dispatch + combine vs raw all_to_all_single", "",
                "- ours: AllToAllDispatcher (counts exchange, one host copy of the counts, one row per token and remote",
                "  rank packed, all-to-all while the own rows are written, copied into pair rows; per-token sums, reverse",
                "  all-to-all, one pass of sums into (T, D))."]
        last = "- last column: the same raw exchanges without the own chunk (only the bytes that cross the link), not the anchor."
    flags = (" --backward" if backward else "") + (" --transport p2p" if transport == "p2p" else "")
    return "\n".join(what + [
        f"- device: {name}",
        f"- torch {torch.__version__}, triton {_triton_version()}, Python {platform.python_version()}, date {datetime.date.today()}",
        f"- command: `torchrun --nproc_per_node={world} bench/all_to_all.py{flags}`",
        f"- {rounds} rounds alternating ours / raw / ours-again; ratio = median over rounds of raw time / our time",
        "  (= our effective bandwidth / raw bandwidth, bar 0.85); A-vs-A = ours / ours-again.",
        f"- timed: {'forward + backward of ' if backward else 'forward '}dispatch + combine with identity experts "
        "vs raw all_to_all_single of one row per",
        f"  (token, expert) pair, own chunk included ({'4: there and back, twice' if backward else '2: there and back'}). "
        "bf16 rows, uniform random top-K, dropless, ep = world.",
        last,
        "- bandwidth = the pair layout's bytes sent + received per rank (both directions, own chunk included) / time",
        "  (max over ranks), for both columns.",
        "",
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU/gloo, print only")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, metavar="T",
                        help="print torch.profiler tables of ours for the first layer at T tokens per rank")
    parser.add_argument("--warm-iters", type=int, default=2000,
                        help="calls of ours (first layer, fewest tokens) before the first timing")
    parser.add_argument("--backward", action="store_true",
                        help="time forward + backward (anchor: the two raw exchanges twice)")
    parser.add_argument("--transport", choices=("nccl", "p2p"), default="nccl",
                        help="AllToAllDispatcher (NCCL) or P2PDispatcher (symmetric memory, GPUs of one node)")
    parser.add_argument("--out", default=None,
                        help="markdown table (default bench/results/all_to_all.md for p2p, all_to_all_nccl.md for "
                             "nccl; none with --smoke)")
    args = parser.parse_args()
    rank, world, device = init_distributed("gloo" if args.smoke else None)
    if world < 2:
        raise SystemExit("run under torchrun with --nproc_per_node >= 2")
    if args.smoke:
        device = torch.device("cpu")
    name = "all_to_all.md" if args.transport == "p2p" else "all_to_all_nccl.md"
    out = args.out or (None if args.smoke else os.path.join(os.path.dirname(__file__), "results", name))
    dims = ParallelDims(world, ep=world).build_mesh(device.type)
    nccl = dims.dispatcher()

    def make(T):
        if args.transport == "nccl":
            return nccl
        from parallel.p2p_dispatcher import P2PDispatcher
        return P2PDispatcher(dims.ep_group, dims.world_group, max_tokens=T)
    dtype = torch.bfloat16
    measure = _timer(device)
    layers, tokens = (SMOKE_LAYERS, SMOKE_TOKENS) if args.smoke else (LAYERS, TOKENS)
    p2p = args.transport == "p2p"
    lines = [_header(device, world, args.rounds, args.backward, args.transport),
             "| layer | tokens/rank | MB/rank | ours ms | raw ms | ours GB/s | raw GB/s | ours/raw bw (min–max) | A-vs-A "
             f"| {'NCCL dispatcher / raw bw' if p2p else 'raw, link bytes only, ms'} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    if not args.smoke:
        _warm(make(tokens[0]), *next(iter(layers.values())), tokens[0], device, dtype, args.warm_iters, rank)
    if args.profile and not args.smoke:
        _profile(make(args.profile), *next(iter(layers.values())), args.profile, device, dtype, rank)
    for name, (D, E, K) in layers.items():
        dims.check_experts(E)
        for T in tokens:
            r = bench_row(make(T), dims, D, E, K, T, args.rounds, device, dtype, measure, args.backward,
                          nccl if p2p else None)
            last = f"{r['link_ratio']:.2f}" if p2p else f"{r['link_ms']:.3f}"
            lines.append(
                f"| {name} | {T} | {r['mbytes']:.0f} | {r['ours_ms']:.3f} | {r['raw_ms']:.3f} | {r['ours_gbs']:.0f} | "
                f"{r['raw_gbs']:.0f} | **{r['ratio']:.2f}** ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | {r['a_vs_a']:.2f} | "
                f"{last} |"
            )
            if rank == 0:
                print(lines[-1], flush=True)
    if rank == 0:
        text = "\n".join(lines) + "\n"
        print(text)
        if out:
            with open(out, "w") as f:
                f.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
