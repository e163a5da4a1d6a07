"""Benchmark: the chunked LM head + cross-entropy (``train.lm_loss.linear_cross_entropy``) vs the
materialised logits, ``F.cross_entropy(F.linear(h, W).float(), y)`` (what the model ran before).

What is timed: forward + backward (``torch.autograd.grad`` of the loss for h and W) under bf16
autocast, h (T, D) fp32 as the final norm's output, W (V, D) fp32 as the master weight, random
inputs and targets; FLOPs ``6·T·V·D`` (the three GEMMs both run). Peak memory: one forward +
backward after ``torch.cuda.reset_peak_memory_stats``, ``max_memory_allocated`` above what was
allocated before (the inputs).
Protocol: per shape, rounds alternating ours, the anchor and ours again, each
``triton.testing.do_bench(warmup=100, rep=200)`` median; the ratio is the median over rounds of
``t_anchor / t_ours`` (> 1: ours faster); A-vs-A is the median of ``t_ours_again / t_ours`` (the
noise).

    python bench/lm_loss.py [--rounds 5] [--out bench/results/lm_loss.md]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))
from common import alternate, header, median_ratio, write_results  # noqa: E402

from train.lm_loss import chunk_rows, linear_cross_entropy  # noqa: E402

SHAPES = [(T, 2048, V) for V in (50304, 151936) for T in (8192, 16384)]  # (T, D, V)


def anchor(h_TD, weight_VD, targets_T):
    return F.cross_entropy(F.linear(h_TD, weight_VD).float(), targets_T)


def fwd_bwd(loss_fn, h_TD, weight_VD, targets_T):
    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(h_TD, weight_VD, targets_T)
        return loss, torch.autograd.grad(loss, (h_TD, weight_VD))
    return run


def peak_bytes(run) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_row(T, D, V, rounds):
    h_TD = torch.randn(T, D, device="cuda", requires_grad=True)
    weight_VD = (torch.randn(V, D, device="cuda") / D**0.5).requires_grad_()
    targets_T = torch.randint(0, V, (T,), device="cuda")
    ours, ref = fwd_bwd(linear_cross_entropy, h_TD, weight_VD, targets_T), fwd_bwd(anchor, h_TD, weight_VD, targets_T)
    (loss, grads), (ref_loss, ref_grads) = ours(), ref()
    errors = [abs(loss.item() / ref_loss.item() - 1)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    del loss, grads, ref_loss, ref_grads
    mem_ours, mem_ref = peak_bytes(ours), peak_bytes(ref)
    times = alternate({"ours": ours, "anchor": ref, "ours_again": ours}, rounds)
    med = statistics.median
    return dict(T=T, D=D, V=V, chunk=min(T, chunk_rows(V)), ms_ours=med(times["ours"]), ms_anchor=med(times["anchor"]),
                ratio=median_ratio(times["anchor"], times["ours"]),
                a_vs_a=median_ratio(times["ours_again"], times["ours"]),
                tflops=6 * T * V * D / med(times["ours"]) / 1e9, mem_ours=mem_ours, mem_anchor=mem_ref, errors=errors)


def to_markdown(rows, rounds) -> str:
    out = header(
        "Chunked LM head + cross-entropy vs materialised logits", "bench/lm_loss.py",
        f"GPU memory: {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB",
        "forward + backward (autograd.grad for h and W), bf16 autocast, h and W fp32, random inputs and targets; "
        "anchor: `F.cross_entropy(F.linear(h, W).float(), y)`",
        f"{rounds} rounds alternating ours / anchor / ours, each do_bench(warmup=100, rep=200) median; ratio = "
        "median over rounds of anchor time / our time (> 1: ours faster); A-vs-A = median of ours again / ours",
        "peak: max_memory_allocated of one forward + backward above the inputs; TFLOP/s = 6·T·V·D / our time",
        "errors: |loss / anchor loss − 1|, and ‖ours − anchor‖ / ‖anchor‖ of the gradients of h and W",
    ) + [
        "| T | D | V | chunk | ours ms | anchor ms | anchor / ours | A-vs-A | ours TFLOP/s | ours peak GiB "
        "| anchor peak GiB | loss err | dh err | dW err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        e = r["errors"]
        out.append(f"| {r['T']} | {r['D']} | {r['V']} | {r['chunk']} | {r['ms_ours']:.2f} | {r['ms_anchor']:.2f} | "
                   f"{r['ratio']:.3f} | {r['a_vs_a']:.3f} | {r['tflops']:.0f} | {r['mem_ours'] / 2**30:.2f} | "
                   f"{r['mem_anchor'] / 2**30:.2f} | {e[0]:.1e} | {e[1]:.1e} | {e[2]:.1e} |")
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "lm_loss.md"))
    args = parser.parse_args()
    rows = []
    for T, D, V in SHAPES:
        rows.append(bench_row(T, D, V, args.rounds))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    write_results(args.out, to_markdown(rows, args.rounds))


if __name__ == "__main__":
    main()
