"""Probe: the walk under deterministic=False for causal Hd 64 past half the SMs' key blocks. Since
fa2fb2d ``_walk`` takes ASCENDING there in both modes; its probe timed the non-deterministic mode
only under DESCENDING (a review asked for the A/B). Without turns the walk sets only which CTAs
add into the same dQ block at once and in which order the blocks are read.

What: fwd+bwd, causal, Hd 64, B 1, H 32, bf16, S 16k and 32k; deterministic=False under ASCENDING
(shipped) / DESCENDING (forced) / ASCENDING again, 7 alternating rounds of do_bench(100, 200). If
DESCENDING wins beyond the A-vs-A spread at both lengths, ``_walk`` learns ``deterministic``.

    PYTHONPATH=. python docs/pending/walk_nondet.py [rounds]
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


def grads(q, k, v, do, walk=None):
    fab._walk = SHIPPED if walk is None else (lambda *a: int(walk))
    try:
        o = flash_attention(q, k, v, causal=True, deterministic=False)
        return torch.autograd.grad(o, (q, k, v), do)
    finally:
        fab._walk = SHIPPED


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    torch.manual_seed(0)
    rows = []
    for S in (16384, 32768):
        q, k, v, do = (torch.randn(1, 32, S, 64, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=i < 3) for i in range(4))
        fns = {"asc": lambda: grads(q, k, v, do), "desc": lambda: grads(q, k, v, do, fab.WALK_DESCENDING)}
        fns["asc_again"] = fns["asc"]
        t = alternate(fns, rounds)
        rows.append((S, statistics.median(t["asc"]), statistics.median(t["desc"]),
                     median_ratio(t["desc"], t["asc"]), median_ratio(t["asc"], t["asc_again"])))
        print(rows[-1], flush=True)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| Hd | S | asc ms | desc ms | asc speed | A-vs-A |")
    print("|---:|---:|---:|---:|---:|---:|")
    for S, a, d, sp, aa in rows:
        print(f"| 64 | {S} | {a:.3f} | {d:.3f} | {sp:.3f} | {aa:.3f} |")


if __name__ == "__main__":
    main()
