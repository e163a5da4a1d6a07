"""Benchmark: the experts' input as an expert-parallel dispatcher hands it over, one row segment
per local expert (expert-major, what the NCCL and P2P dispatchers give since this change) against
one segment per (source rank, local expert) (the layout before).

The same rows, permuted: the experts' SwiGLU MLP fwd+bwd (``GroupedExperts`` under bf16 autocast
inside ``master_weight_step``, as the training step runs it: fp32 weights cast once, weight
gradients added into the fp32 ``.grad``), dx and the rows' weights' gradient included. Rows per
rank = tokens · K (balanced routing), split over the G sources and L experts by a multinomial
draw. Protocol: ``bench/common.py`` (alternating rounds; the claim is the median per-round ratio
anchor / ours; an A-vs-A row).

    python bench/expert_layout.py [--rounds 5] [--out bench/results/expert_layout.md]
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.append(os.path.dirname(__file__))  # after the repo root
from common import alternate, header, median_ratio, write_results  # noqa: E402
from moe.experts import GroupedExperts, master_weight_step  # noqa: E402

# name: (G ranks, E experts, D, F, K, tokens a rank)
SHAPES = {
    "OLMoE-like, EP 2": (2, 64, 2048, 1024, 8, 8192),
    "Qwen3-A3B-like, EP 2": (2, 128, 2048, 768, 8, 8192),
    "Mixtral-like, EP 2": (2, 8, 4096, 14336, 2, 8192),
    "DeepSeek-V3-like, EP 8": (8, 256, 7168, 2048, 8, 8192),
}


def _layouts(G, L, R, gen):
    """(offsets of the expert-major layout (L,), offsets of the source-major one (G·L,), the
    permutation that takes expert-major rows to source-major order)."""
    c_GL = torch.multinomial(torch.ones(G * L), R, replacement=True, generator=gen).bincount(minlength=G * L).view(G, L)
    expert_major = c_GL.sum(0).cumsum(0)
    first_GL = expert_major[None, :] - c_GL.sum(0)[None, :] + c_GL.cumsum(0) - c_GL  # row of segment (g, l)
    perm = torch.cat([torch.arange(int(first_GL[g, el]), int(first_GL[g, el] + c_GL[g, el]))
                      for g in range(G) for el in range(L)])
    return expert_major.to(torch.int32), c_GL.flatten().cumsum(0).to(torch.int32), perm


def bench_shape(name, rounds):
    G, E, D, F, K, tokens = SHAPES[name]
    L, R = E // G, tokens * K
    gen = torch.Generator().manual_seed(0)
    offsets_L, offsets_GL, perm = _layouts(G, L, R, gen)
    experts = GroupedExperts(L, D, F, device="cuda", init_seed=0)
    x = torch.randn(R, D, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))
    w_R = torch.rand(R, device="cuda")
    dy = torch.randn(R, D, device="cuda", dtype=torch.bfloat16)
    perm = perm.cuda()
    layouts = {"expert-major": (x, w_R, dy, offsets_L.cuda()),
               "by source": (x[perm], w_R[perm], dy[perm], offsets_GL.cuda())}
    for p in experts.parameters():
        p.grad = torch.zeros_like(p)  # a step's later micro-batch: the gradients add

    def runner(rows, w, dy_RD, offsets):
        rows, w = rows.detach().requires_grad_(), w.detach().requires_grad_()

        def step():
            rows.grad = w.grad = None
            with torch.autocast("cuda", torch.bfloat16):
                y = experts(rows, offsets, w)
            y.backward(dy_RD)
        return step, rows, w

    with master_weight_step(experts):
        runs = {n: runner(*args) for n, args in layouts.items()}
        outs = {}
        for n, (step, rows, w) in runs.items():  # the two layouts compute the same gradients
            for p in experts.parameters():
                p.grad.zero_()
            step()
            outs[n] = [rows.grad.float(), w.grad, *(p.grad.clone() for p in experts.parameters())]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(R, device="cuda")
        for a, b in zip(outs["expert-major"][:2], outs["by source"][:2]):
            torch.testing.assert_close(a, b[inv], rtol=2e-2, atol=2e-2)
        for a, b in zip(outs["expert-major"][2:], outs["by source"][2:]):  # fp32 sums vs bf16-rounded partials
            assert (a - b).abs().max() <= 2e-2 * b.abs().max(), name
        fns = {"expert-major": runs["expert-major"][0], "by source": runs["by source"][0],
               "expert-major again": runs["expert-major"][0]}
        times = alternate(fns, rounds)
    flops = 3 * 2 * R * D * 3 * F  # fwd + bwd of the three D×F matrices (w1 is D×2F)
    med = {n: statistics.median(t) for n, t in times.items()}
    return dict(name=name, G=G, L=L, R=R, D=D, F=F, ms=med, tflops={n: flops / m / 1e9 for n, m in med.items()},
                ratio=median_ratio(times["by source"], times["expert-major"]),
                a_vs_a=median_ratio(times["expert-major again"], times["expert-major"]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "expert_layout.md"))
    args = p.parse_args()
    rows = []
    for name in args.shapes:
        rows.append(bench_shape(name, args.rounds))
        r = rows[-1]
        print(f"{name}: expert-major {r['ms']['expert-major']:.3f} ms, by source {r['ms']['by source']:.3f} ms, "
              f"ratio {r['ratio']:.3f}, A-vs-A {r['a_vs_a']:.3f}", flush=True)
        torch.cuda.empty_cache()
    md = header("The experts' input from an expert-parallel dispatch: one segment per expert vs one per (source, expert)",
                "bench/expert_layout.py",
                "the experts' SwiGLU MLP fwd+bwd on one rank's rows (R = tokens · K), bf16 autocast, fp32 master weights "
                "in `master_weight_step` (gradients added into `.grad`), dx and the row weights' gradient included",
                "expert-major: L segments, the sources' rows of an expert together (the dispatchers since this change); "
                "by source: the same rows in G·L segments, source-major (before)",
                f"{args.rounds} alternating rounds of do_bench(warmup=100, rep=200) median; ratio = median over rounds of "
                "by-source time / expert-major time (> 1: expert-major faster)")
    md = "\n".join(md) + "\n| shape | G | L | R | D | F | expert-major ms | by source ms | TFLOP/s (expert-major / by source) " \
        "| ratio | A-vs-A |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    for r in rows:
        md += (f"| {r['name']} | {r['G']} | {r['L']} | {r['R']} | {r['D']} | {r['F']} | {r['ms']['expert-major']:.3f} | "
               f"{r['ms']['by source']:.3f} | {r['tflops']['expert-major']:.0f} / {r['tflops']['by source']:.0f} | "
               f"**{r['ratio']:.3f}** | {r['a_vs_a']:.3f} |\n")
    write_results(args.out, md)


if __name__ == "__main__":
    main()
