"""Probe: forward tilings for the Hd 64 S 1k causal row (0.99x cuDNN in three runs), one process.

Each row times the plan that ``hopper_forward`` takes (``base``), the same plan again (A-vs-A),
each candidate Plan (``fah.plan`` switched for the call) and SDPA's cuDNN backend, alternating
over ``--rounds`` rounds of do_bench(warmup=100, rep=200). Candidates:

- ``peel``: a tile's first step without the P·V of a zero P (Plan.peel_first).
- ``st3``: a three-deep K/V ring.
- ``1wg_2cta``: one 64-row consumer a CTA, two CTAs an SM (each CTA its own K/V stream);
  ``_half``: a tile that starts a key block takes half of its diagonal block (Plan.half_diagonal).
- ``2wg_n64_2cta``: two consumers, 64-key blocks, two CTAs an SM (112 registers a consumer).

Outputs: ``same bits`` against base (peel and st3 must be bit-equal), else the max |diff|.

    PYTHONPATH=. python docs/pending/fwd_variants.py --rounds 5
"""

import argparse
import dataclasses
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention.flash_attn_hopper as fah
from attention import flash_attention

sys.path.append("bench")
from common import alternate, median_ratio  # noqa: E402


def candidates(hd, S, causal):
    base = fah.plan(hd, S, causal)
    out = {"base": base, "base_again": base, "peel": dataclasses.replace(base, peel_first=True)}
    if hd == 64:  # (a third stage at Hd 128 needs 263 KB of shared memory)
        out["st3"] = dataclasses.replace(base, stages=3)
        out["1wg_2cta"] = fah.Plan(1, ctas_per_sm=2)
        out["1wg_2cta_peel"] = fah.Plan(1, ctas_per_sm=2, peel_first=True)
        if causal:
            out["1wg_2cta_half"] = fah.Plan(1, ctas_per_sm=2, half_diagonal=True)
            out["1wg_2cta_half_peel"] = fah.Plan(1, ctas_per_sm=2, half_diagonal=True,
                                                 peel_first=True)
        out["2wg_n64_2cta"] = fah.Plan(2, block_n=64, ctas_per_sm=2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rows = [(64, 1024, True), (64, 2048, True), (64, 1024, False), (128, 4096, True)]
    real_plan = fah.plan
    table = []
    for hd, S, causal in rows:
        H, B = (16 if hd == 128 else 32), 16384 // S
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fns, outs = {}, {}
        for name, p in candidates(hd, S, causal).items():
            def fn(p=p):
                fah.plan = lambda *a: p
                try:
                    return flash_attention(q, k, v, causal=causal)
                finally:
                    fah.plan = real_plan
            outs[name] = fn()
            fns[name] = fn

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        fns["cudnn"] = cudnn
        ref = cudnn().float()
        times = alternate(fns, args.rounds)
        for name in fns:
            if name == "cudnn":
                continue
            d = (outs[name].float() - outs["base"].float()).abs().max().item()
            table.append((hd, S, causal, name, statistics.median(times[name]),
                          median_ratio(times["base"], times[name]),
                          median_ratio(times["cudnn"], times[name]),
                          "yes" if torch.equal(outs[name], outs["base"]) else f"{d:.2e}",
                          (outs[name].float() - ref).abs().max().item()))
        for row in table[-(len(fns) - 1):]:
            print(row, flush=True)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| Hd | S | causal | plan | ms | vs base | vs cuDNN | same bits | max diff vs cuDNN |")
    print("|---:|---:|:---:|:---|---:|---:|---:|:---:|---:|")
    for hd, S, causal, name, ms, rb, rc, same, dc in table:
        print(f"| {hd} | {S} | {causal} | {name} | {ms:.4f} | {rb:.3f} | {rc:.3f} | {same} | {dc:.3f} |")


if __name__ == "__main__":
    main()
