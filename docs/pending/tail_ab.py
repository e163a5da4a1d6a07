"""Probe: the causal forward's last heads dealt tile by tile (Plan.tail) against the plan.

The pairs of the causal walk cost the same, so a CTA's share is whole units: at Hd 64 S 1k causal
(B·H 512, 2,048 units) 68 CTAs run 16 units while 64 run 15, 3 % of the launch idle. With the
tail, ``tail_heads`` heads' tiles are dealt one by one, longest first, in a snake over the CTAs
(``_tile``); the model in ``tail_heads`` picks how many (0: none) and expects 1.3-3.1 % at the
bench's Hd 64 causal rows, nothing at Hd 128.

Each Hd 64 causal row of bench/attention.py: the bits of the tail against the plan's (it only
moves tiles between CTAs, so O and LSE must be equal; forced tail heads at every tiling are the
patch's ``test_gpu_hopper_forward_tail_same_bits``, run first), then the plan (base), the tail,
cuDNN and the plan again (A-vs-A), 7 alternating rounds of do_bench(warmup=100, rep=200).

    git apply docs/pending/fwd-tail.patch
    timeout 300 pytest -q -m gpu tests/test_attention.py -k tail && PYTHONPATH=. python docs/pending/tail_ab.py
"""

import dataclasses
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention.flash_attn_hopper as fah
from attention.flash_attn import attention_forward
from kernel_floor import sm_count

sys.path.append("bench")
from common import alternate, median_ratio  # noqa: E402

real_plan = fah.plan


def forward(q, k, v, tail):
    """O and LSE through the Hopper forward, the plan with ``tail``."""
    fah.plan = lambda *a: dataclasses.replace(real_plan(*a), tail=tail)
    try:
        return attention_forward(q, k, v, True, q.shape[-1] ** -0.5, None)
    finally:
        fah.plan = real_plan


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    torch.manual_seed(0)
    table = []
    for S in (1024, 2048, 4096, 8192, 16384):
        B, H, hd = 16384 // S, 32, 64
        q, k, v = (torch.randn(B, H, S, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        p = real_plan(hd, S, True)
        th = fah.tail_heads(S, B * H, p.block_m, p.block_n, sm_count(q.device))
        o0, l0 = forward(q, k, v, False)
        o1, l1 = forward(q, k, v, True)
        same = torch.equal(o0, o1) and torch.equal(l0, l1)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fns = {"base": lambda: forward(q, k, v, False), "tail": lambda: forward(q, k, v, True),
               "cudnn": cudnn}
        fns["base_again"] = fns["base"]
        t = alternate(fns, rounds)
        table.append((S, p.warpgroups, th, statistics.median(t["base"]), statistics.median(t["tail"]),
                      median_ratio(t["base"], t["tail"]), median_ratio(t["cudnn"], t["base"]),
                      median_ratio(t["cudnn"], t["tail"]), median_ratio(t["base"], t["base_again"]), same))
        print(table[-1], flush=True)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| Hd | S | WG | tail heads | base ms | tail ms | tail speed | base vs cuDNN | tail vs cuDNN | A-vs-A | same bits |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for S, wg, th, b, tl, sp, bc, tc, aa, same in table:
        print(f"| 64 | {S} | {wg} | {th} | {b:.4f} | {tl:.4f} | {sp:.3f} | {bc:.3f} | {tc:.3f} | {aa:.3f} | {same} |")


if __name__ == "__main__":
    main()
