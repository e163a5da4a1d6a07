"""Probe: the deterministic backward's walk at 16k keys, causal. ``_walk`` takes DESCENDING past
n_k = SMs / 2 (S > 8448 keys at BLOCK_N 128 on 132 SMs), a limit CYCLIC's residency needs, but
ASCENDING (causal) waits only for CTAs launched before it, as DESCENDING does. In the lead table
(H200, 2026-12-04, bench/results/attention.md) the deterministic S 16k causal rows read 0.983
(Hd 64) and 1.006x (Hd 128) cuDNN against 1.07 / 1.05x with deterministic=False: DESCENDING's
CTAs meet at each query block together and add in key order, one round trip after another.

What: fwd+bwd at S 16384 causal, Hd 64 and 128 (B 1, H 32 / 16, bf16), walks DESCENDING (shipped)
/ ASCENDING (forced) / deterministic=False / cuDNN / DESCENDING again, 7 alternating rounds of
do_bench(warmup=100, rep=200); ASCENDING's dq, dk, dv bit-equal on repeat and within bf16 rounding of
DESCENDING's. ASCENDING past SMs / 2 ships only if it wins beyond the A-vs-A spread at both.

    PYTHONPATH=. python docs/pending/walk_16k.py [rounds] [HdxS ...]
"""

import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention.flash_attn_hopper_bwd as fab
from attention import flash_attention

sys.path.append("bench")
from common import alternate, median_ratio  # noqa: E402

SHIPPED = fab._walk


def grads(q, k, v, do, walk=None, deterministic=True):
    fab._walk = SHIPPED if walk is None else (lambda *a: int(walk))
    try:
        o = flash_attention(q, k, v, causal=True, deterministic=deterministic)
        return torch.autograd.grad(o, (q, k, v), do)
    finally:
        fab._walk = SHIPPED


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    cases = [tuple(map(int, c.split("x"))) for c in sys.argv[2:]] or [(64, 16384), (128, 16384)]
    torch.manual_seed(0)
    table = []
    for Hd, S in cases:
        H = 32 if Hd == 64 else 16
        q, k, v, do = (torch.randn(1, H, S, Hd, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=i < 3) for i in range(4))
        asc = fab.WALK_ASCENDING
        a1, a2, d1 = grads(q, k, v, do, asc), grads(q, k, v, do, asc), grads(q, k, v, do)
        repeat = all(torch.equal(x, y) for x, y in zip(a1, a2))
        err = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                  for x, y in zip(a1, d1))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.autograd.grad(o, (q, k, v), do)
        fns = {"desc": lambda: grads(q, k, v, do), "asc": lambda: grads(q, k, v, do, asc),
               "nondet": lambda: grads(q, k, v, do, deterministic=False), "cudnn": cudnn}
        fns["desc_again"] = fns["desc"]
        t = alternate(fns, rounds)
        table.append((Hd, S, statistics.median(t["desc"]), statistics.median(t["asc"]),
                      median_ratio(t["desc"], t["asc"]), median_ratio(t["cudnn"], t["desc"]),
                      median_ratio(t["cudnn"], t["asc"]), median_ratio(t["cudnn"], t["nondet"]),
                      median_ratio(t["desc"], t["desc_again"]), repeat, err))
        print(table[-1], flush=True)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| Hd | S | desc ms | asc ms | asc speed | desc vs cuDNN | asc vs cuDNN | nondet vs cuDNN |"
          " A-vs-A | asc repeat bits | asc vs desc rel err |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|")
    for Hd, S, d, a, sp, dc, ac, nc, aa, rep, err in table:
        print(f"| {Hd} | {S} | {d:.3f} | {a:.3f} | {sp:.3f} | {dc:.3f} | {ac:.3f} | {nc:.3f} | {aa:.3f} |"
              f" {rep} | {err:.1e} |")


if __name__ == "__main__":
    main()
