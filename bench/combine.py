"""Benchmark: fused un-permute + weighted sum (``weighted_combine``) vs its PyTorch reference.

The reference is what the layer ran before: un-permute the expert outputs into pair order
(``index_copy`` into a zero (P, D) buffer) and sum each token's K rows with their weights in fp32
(``(y.view(T, K, D).float() * w).sum(1)``). Timed forward and forward+backward (gradients of the
expert outputs and the weights), bf16 rows, rows in a random order, every pair kept.
Protocol: 5 rounds alternating ours / reference / ours, ``triton.testing.do_bench(warmup=100,
rep=200)`` medians; ratio = median over rounds of t_reference / mean(ours before, ours after).

    python bench/combine.py [--out bench/results/combine.md]
"""

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe.kernels.combine import weighted_combine  # noqa: E402


def unpermute_then_sum(y_PD, pair_P, w_TK):
    """The anchor, what the layer ran before the fused combine: un-permute the rows into pair
    order (index_copy into a zero (P, D) buffer), then the weighted sum over K in fp32."""
    T, K = w_TK.shape
    y_TKD = y_PD.new_zeros(y_PD.shape).index_copy(0, pair_P, y_PD).view(T, K, -1)
    return (y_TKD.float() * w_TK.unsqueeze(-1)).sum(dim=1).to(y_PD.dtype)

SHAPES = [  # name, tokens T, top-k K, model dim D
    ("Mixtral-like", 16384, 2, 4096),
    ("OLMoE-like", 16384, 8, 2048),
    ("DeepSeek-V3-like", 8192, 8, 7168),
]


def bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=100, rep=200, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/combine.md")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for name, T, K, D in SHAPES:
        P = T * K
        y = torch.randn(P, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        pair = torch.randperm(P, device="cuda")
        w = torch.rand(T, K, device="cuda", requires_grad=True)
        dout = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        ours = lambda: weighted_combine(y, pair, w, backend="triton")  # noqa: E731
        ref = lambda: unpermute_then_sum(y, pair, w)  # noqa: E731
        err = ((ours().float() - ref().float()).norm() / ref().float().norm()).item()
        for mode in ("fwd", "fwd+bwd"):
            if mode == "fwd":
                def run(f):
                    with torch.no_grad():
                        f()
            else:
                def run(f):
                    torch.autograd.grad(f(), (y, w), dout)
            ratios, noise, t_o, t_r = [], [], [], []
            for _ in range(args.rounds):
                a = bench_ms(lambda: run(ours))
                b = bench_ms(lambda: run(ref))
                c = bench_ms(lambda: run(ours))
                ratios.append(b / ((a + c) / 2))
                noise.append(c / a)
                t_o.append((a + c) / 2)
                t_r.append(b)
            # bytes ours must move: forward reads P rows, writes T; backward reads T + P, writes P
            nbytes = (P + T) * D * 2 if mode == "fwd" else (3 * P + 2 * T) * D * 2
            med = statistics.median
            rows.append((name, T, K, D, mode, med(t_o), med(t_r), nbytes / med(t_o) / 1e6, med(ratios), med(noise), err))
            print(rows[-1], flush=True)
    props = torch.cuda.get_device_properties(0)
    lines = [
        "# Fused combine (un-permute + weighted sum) vs PyTorch",
        "",
        f"Device: {props.name}; torch {torch.__version__}, triton {triton.__version__}; date {datetime.date.today()}.",
        f"Command: `python bench/combine.py` ({args.rounds} rounds alternating ours / reference / ours; ratio = "
        "median of t_reference / mean(ours before, ours after); A-vs-A = ours after / ours before).",
        "",
        "| shape | T | K | D | what | ours ms | PyTorch ms | ours GB/s (min bytes) | PyTorch / ours | A-vs-A | rel err |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, T, K, D, mode, to, tr, gbs, ratio, noise, err in rows:
        lines.append(f"| {name} | {T} | {K} | {D} | {mode} | {to:.3f} | {tr:.3f} | {gbs:.0f} | {ratio:.2f}x | {noise:.3f} | {err:.1e} |")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
