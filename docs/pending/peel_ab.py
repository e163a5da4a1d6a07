"""Probe: the forward's first step without the zero P·V (Plan.peel_first) against the plan.

Each row times the plan ``hopper_forward`` takes (``base``), each peel mode (``fah.plan``
switched for the call), SDPA's cuDNN backend and the plan again (A-vs-A), alternating over
``--rounds`` rounds of do_bench(warmup=100, rep=200). Peel modes: 1 every consumer; 2 all but
consumer 0's half-diagonal copy (causal two-consumer plans: its code already holds a second
step). Outputs must be bit-equal to base (the peeled step skips a product of a zero P).

    PYTHONPATH=. python docs/pending/peel_ab.py --rounds 7
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

ROWS = [(64, 1024, False, (1, )), (64, 2048, False, (1, )), (64, 4096, False, (1, )),
        (64, 16384, False, (1, )), (128, 4096, False, (1, )), (128, 16384, False, (1, )),
        (64, 1024, True, (2, 1)), (64, 2048, True, (2, ))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    real_plan = fah.plan
    table = []
    for hd, S, causal, modes in ROWS:
        H, B = (16 if hd == 128 else 32), 16384 // S
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        base = real_plan(hd, S, causal)
        plans = {"base": base, **{f"peel{m}": dataclasses.replace(base, peel_first=m) for m in modes}}
        fns, outs = {}, {}
        for name, p in plans.items():
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
        fns["base_again"] = fns["base"]
        times = alternate(fns, args.rounds)
        aa = median_ratio(times["base"], times["base_again"])
        for name in plans:
            table.append((hd, S, causal, name, statistics.median(times[name]),
                          median_ratio(times["base"], times[name]),
                          median_ratio(times["cudnn"], times[name]), aa,
                          torch.equal(outs[name], outs["base"])))
            print(table[-1], flush=True)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| Hd | S | causal | plan | ms | speed vs base | vs cuDNN | A-vs-A | same bits |")
    print("|---:|---:|:---:|:---|---:|---:|---:|---:|:---:|")
    for hd, S, causal, name, ms, rb, rc, aa, same in table:
        print(f"| {hd} | {S} | {causal} | {name} | {ms:.4f} | {rb:.3f} | {rc:.3f} | {aa:.3f} | {same} |")


if __name__ == "__main__":
    main()
