"""Probe: the causal backward's ASCENDING walk, but for the launch's last head, which descends.

ASCENDING launches a head's longest CTA (key block 0, every query block) last; at Hd 128 its
schedule cost 2-3 % past 12k keys (nondet ASCENDING / DESCENDING 0.971 / 0.980, ff02ae9), put in
the tail by a host model of the launch order. WALK_ASCENDING_BUT_LAST has the grid's last (batch,
K/V head) walk and order its adds as DESCENDING, launching its longest CTA first; the host model
put its makespan within 0.5 % of DESCENDING's.

Decision rule, set before the run: for a head dim, ``_walk`` takes ASCENDING_BUT_LAST for causal
calls if its deterministic median per-round ratio over the shipped walk is >= 1.0 at every length
and >= 1.01 at three or more; otherwise the walk is removed and the table recorded.

What: fwd+bwd, causal, bf16, B·S 16k (B 1 at 32k), H 16, Hd 128 and 64, S 1k-32k; 5 alternating
rounds of do_bench(100, 200): shipped det, BUT_LAST det, shipped nondet, BUT_LAST nondet, shipped
det again (A-vs-A); BUT_LAST's deterministic repeats bit-equal.

    PYTHONPATH=. python docs/pending/walk_last_desc.py
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
    """fwd+bwd under ``walk`` (None: the one ``_walk`` picks)."""
    if walk is not None:
        fab._walk = lambda *a: int(walk)
    try:
        o = flash_attention(q, k, v, causal=True, deterministic=deterministic)
        return torch.autograd.grad(o, (q, k, v), do)
    finally:
        fab._walk = SHIPPED


def main():
    torch.manual_seed(0)
    last = fab.WALK_ASCENDING_BUT_LAST
    rows = []
    for Hd in (128, 64):
        for S in (1024, 2048, 4096, 8192, 16384, 32768):
            B = max(1, 16384 // S)
            q, k, v, do = (torch.randn(B, 16, S, Hd, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=i < 3) for i in range(4))
            a, b = grads(q, k, v, do, last, True), grads(q, k, v, do, last, True)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (Hd, S)
            shipped = SHIPPED(True, triton.cdiv(S, fab.BLOCK_N), q.device, Hd)
            fns = {"det": lambda: grads(q, k, v, do, None, True),
                   "det_last": lambda: grads(q, k, v, do, last, True),
                   "nondet": lambda: grads(q, k, v, do, None, False),
                   "nondet_last": lambda: grads(q, k, v, do, last, False)}
            fns["det_again"] = fns["det"]
            t = alternate(fns, 5)
            flop = 3.5 * 2 * 2 * S * S * Hd * 16 * B / 2
            row = (f"| {Hd} | {S} | {B} | {shipped} | "
                   f"{flop / statistics.median(t['det']) / 1e9:.0f} | "
                   f"{median_ratio(t['det'], t['det_last']):.3f} | "
                   f"{median_ratio(t['nondet'], t['nondet_last']):.3f} | "
                   f"{median_ratio(t['det'], t['det_again']):.3f} |")
            print(row, flush=True)
            rows.append(row)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| Hd | S | B | shipped walk | shipped det TFLOP/s | det BUT_LAST / shipped | "
          "nondet BUT_LAST / shipped | A-vs-A |  (speed ratios)")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
