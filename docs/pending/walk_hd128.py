"""Probe: why the causal Hd 128 backward's ASCENDING walk does not beat DESCENDING past 12k keys.

At causal Hd 64 ASCENDING won at every length (1.05-1.08x DESCENDING at S 12k-32k, fa2fb2d); at Hd
128 it ran 1.017x at 12k and 0.989x at 16k, and the deterministic mode there trails the
non-deterministic one by 4 % (the 2026-12-04 lead table: 1.006 against 1.05x cuDNN at S 16k).
Two costs are in play: DESCENDING's turns (its CTAs meet at each query block together and add one
after another) and ASCENDING's schedule (a head's longest CTA, key block 0, is launched last, so the
last head leaves a tail). Timing both walks in both modes separates them: nondet / det under one
walk is that walk's turn cost; ASCENDING / DESCENDING without turns is the schedule alone.

Decision rule, set before the run: if deterministic ASCENDING beats deterministic DESCENDING by
>= 1 % at all three lengths, ``_walk`` ascends at causal Hd 128 too; otherwise nothing changes and
the split is recorded as the lead's evidence.

What: fwd+bwd, causal, Hd 128, B 1, H 16, bf16, S 12k / 16k / 32k; 5 alternating rounds of
do_bench(100, 200): det DESCENDING (shipped), det ASCENDING, nondet DESCENDING, nondet ASCENDING,
det DESCENDING again (A-vs-A); deterministic repeats bit-equal under each walk.

    PYTHONPATH=. python docs/pending/walk_hd128.py
"""

import statistics
import sys

import torch
import triton

import attention.flash_attn_hopper_bwd as fab
from attention import flash_attention

sys.path.append("bench")
from common import alternate, median_ratio  # noqa: E402

SHIPPED = fab._walk


def grads(q, k, v, do, walk, deterministic):
    fab._walk = lambda *a: int(walk)
    try:
        o = flash_attention(q, k, v, causal=True, deterministic=deterministic)
        return torch.autograd.grad(o, (q, k, v), do)
    finally:
        fab._walk = SHIPPED


def main():
    torch.manual_seed(0)
    desc, asc = fab.WALK_DESCENDING, fab.WALK_ASCENDING
    assert SHIPPED(True, 128, torch.device("cuda"), 128) == int(desc)
    rows = []
    for S in (12288, 16384, 32768):
        q, k, v, do = (torch.randn(1, 16, S, 128, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=i < 3) for i in range(4))
        for walk in (desc, asc):
            a, b = grads(q, k, v, do, walk, True), grads(q, k, v, do, walk, True)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (S, walk)
        fns = {"det_desc": lambda: grads(q, k, v, do, desc, True),
               "det_asc": lambda: grads(q, k, v, do, asc, True),
               "nondet_desc": lambda: grads(q, k, v, do, desc, False),
               "nondet_asc": lambda: grads(q, k, v, do, asc, False)}
        fns["det_desc_again"] = fns["det_desc"]
        t = alternate(fns, 5)
        flop = 3.5 * 2 * 2 * S * S * 128 * 16 / 2
        r = {n: median_ratio(t["det_desc"], t[n]) for n in fns}
        row = (f"| {S} | {flop / statistics.median(t['det_desc']) / 1e9:.0f} | {r['det_asc']:.3f} | "
               f"{r['nondet_desc']:.3f} | {r['nondet_asc']:.3f} | {median_ratio(t['det_asc'], t['nondet_asc']):.3f} | "
               f"{median_ratio(t['nondet_desc'], t['nondet_asc']):.3f} | {r['det_desc_again']:.3f} |")
        print(row, flush=True)
        rows.append(row)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| S | det DESC TFLOP/s | det ASC | nondet DESC | nondet ASC | ASC: nondet / det | nondet: ASC / DESC "
          "| A-vs-A |  (speed over det DESC unless named)")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
