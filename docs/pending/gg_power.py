"""Probe: is the grouped GEMM at Mixtral's shape bound by the 700 W cap? Clock and power of ours
and of ``torch._grouped_mm`` while each runs alone.

Why: at Mixtral's few large groups our fwd+bwd is 1.04-1.06x ``torch._grouped_mm`` and each
kernel runs at cuBLAS's pace (bench/results/grouped_gemm.md); both reach 630-680 TFLOP/s, about
two thirds of the H200's dense bf16 peak. If the GPU sits at its power cap with the SM clock
pulled down during both, TFLOP/s follow energy per FLOP, and the 1.10x aim needs less data moved
per FLOP (larger tiles, multicast), not a better-hidden pipeline; if the clock stays at its max,
the main loop has room.

What: per shape (Mixtral; OLMoE beside it), 20 s of heat, then ours and the anchor fwd+bwd each
looped for ``--seconds`` while ``nvidia-smi -lms 100`` samples the SM clock, power, temperature
and throttle reasons; twice, alternating. Prints per run: TFLOP/s (CUDA events over the loop),
median SM clock, median power, GFLOP per joule, and the throttle reasons seen.

    PYTHONPATH=. python docs/pending/gg_power.py --seconds 4
"""

import argparse
import statistics
import subprocess
import sys
import time
from collections import Counter

import torch

sys.path.append("bench")
from grouped_gemm import SHAPES, anchor_weight, heat, make_runner, route  # noqa: E402

from moe.kernels import grouped_mm_triton  # noqa: E402

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def sampled(fn, seconds, flops_per_call):
    """Loop ``fn`` for ``seconds`` under nvidia-smi sampling: TFLOP/s, samples."""
    smi = subprocess.Popen(["nvidia-smi", "-i", str(torch.cuda.current_device()), f"--query-gpu={QUERY}",
                            "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    start.record()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
    end.record()
    end.synchronize()
    smi.terminate()
    out, _ = smi.communicate()
    rows = [r.split(", ") for r in out.strip().splitlines() if r.count(",") == 3]
    ms = start.elapsed_time(end)
    return calls * flops_per_call / ms / 1e9, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    torch.manual_seed(0)
    heat(20.0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    print("| shape | kernel | run | TFLOP/s | SM MHz (median) | W (median) | GFLOP/J | °C | throttle reasons |")
    print("|:---|:---|---:|---:|---:|---:|---:|---:|:---|")
    for name, E, D, F, T, k in (SHAPES[0], SHAPES[1]):
        offsets, _ = route(T, E, k, "cuda")
        M = T * k
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(E, D, F, device="cuda") / D**0.5).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(M, F, device="cuda", dtype=torch.bfloat16)
        w_anchor = anchor_weight(x, w, offsets)
        fns = {"ours": make_runner("fwd+bwd", lambda x, w: grouped_mm_triton(x, w, offsets), x, w, dy),
               "torch._grouped_mm": make_runner("fwd+bwd", lambda x, w: torch._grouped_mm(x, w, offs=offsets),
                                                x, w_anchor, dy)}
        flops = 6 * M * D * F
        for run in range(2):
            for kname, fn in fns.items():
                tf, rows = sampled(fn, args.seconds, flops)
                mhz = statistics.median(float(r[0]) for r in rows)
                watts = statistics.median(float(r[1]) for r in rows)
                temp = statistics.median(float(r[2]) for r in rows)
                reasons = ", ".join(f"{r} ×{c}" for r, c in Counter(r[3] for r in rows).most_common(3))
                print(f"| {name} | {kname} | {run} | {tf:.0f} | {mhz:.0f} | {watts:.0f} | {tf * 1e3 / watts:.0f} |"
                      f" {temp:.0f} | {reasons} |", flush=True)


if __name__ == "__main__":
    main()
