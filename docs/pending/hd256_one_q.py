"""Probe: the Gluon forward at Hd 256 with one Q buffer per consumer (fwd-one-q-buffer.patch).

The Hd 256 forward runs the Triton kernel at 0.68-0.85x cuDNN (bench/results/attention_hd256.md).
The first probe of the Gluon forward there (hd256_gluon_fwd.py of 509ad9c) found two Q/output
buffers per consumer (128 KB) leave room for 32-key blocks only: 1.02-1.12x the Triton forward,
short of its 1.05x rule at two rows, and 0.78-0.87x cuDNN. The patch lets a plan take one Q buffer:
a tile's output leaves it before the next tile's Q comes; the producer loads the tile's first ring
blocks meanwhile, so Q's latency shows, about 1 % of a 128-row tile at 4k keys by a host estimate,
more for the short tiles of a causal pair at 1k. Then 64-key blocks in a two-stage ring fit: 197 KB,
no spill (sm_90 compile on CPU, 2026-12-04; 128-key blocks in one stage spill 328-416 bytes).

Decision rule, set before the run: "2wg-n64-q1" ships as the Hd 256 forward (the Triton backward
consumes its LSE unchanged; a later change adds it to ``plan``, ``HEAD_DIMS`` and the tests) if it
is correct on every checked shape (o within 2 * 4e-3 of the Triton forward's, LSE within 1e-3)
and its forward is >= 1.05x the Triton forward at every timed row (S 1k, 4k and 16k, causal and
not). Otherwise nothing changes; "2wg-n32" (the first probe's best) is timed beside it for
reference.

What: bf16, B·S 16k, H 8, MHA; forward only; 5 alternating rounds of do_bench(100, 200): Triton,
each tiling, cuDNN (SDPA), Triton again (A-vs-A).

    git apply docs/pending/fwd-one-q-buffer.patch
    PYTHONPATH=. python docs/pending/hd256_one_q.py
"""

import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention.flash_attn_hopper as fah
from attention.flash_attn import attention_forward

sys.path.append("bench")
from common import alternate, median_ratio  # noqa: E402

HD, H, TOKENS = 256, 8, 16384
PLANS = {"2wg-n64-q1": fah.Plan(warpgroups=2, block_n=64, stages=2, q_buffers=1),
         "2wg-n32": fah.Plan(warpgroups=2, block_n=32, stages=2)}
SHIPPED_DIMS, SHIPPED_PLAN = fah.HEAD_DIMS, fah.plan


def use(name):
    """Route Hd 256 to the Gluon forward in tiling ``name`` (None: the Triton forward)."""
    if name is None:
        fah.HEAD_DIMS, fah.plan = SHIPPED_DIMS, SHIPPED_PLAN
    else:
        fah.HEAD_DIMS = (*SHIPPED_DIMS, HD)
        fah.plan = lambda head_d, S, causal: PLANS[name] if head_d == HD else SHIPPED_PLAN(head_d, S, causal)


def forward(name):
    def fn(q, k, v, causal):
        use(name)
        return attention_forward(q, k, v, causal)
    return fn


def cudnn(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def check(name):
    """The worst o and LSE differences against the Triton forward over odd lengths, GQA, both masks."""
    worst_o = worst_lse = 0.0
    # (8, 32, 8, 512): about 8 tiles a CTA, so each hands its one Q buffer on several times
    for B, Hq, Hkv, S in ((2, 4, 4, 1000), (1, 8, 2, 4097), (8, 32, 8, 512), (3, 2, 1, 129),
                          (1, 1, 1, 1)):
        for causal in (False, True):
            q = torch.randn(B, Hq, S, HD, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, Hkv, S, HD, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            use(name)
            assert fah.hopper_forward_ok(q, k, v, causal, None) or B * Hq * S * S < fah.MIN_SCORES
            fah_min, fah.MIN_SCORES = fah.MIN_SCORES, 0
            o, lse = attention_forward(q, k, v, causal)
            fah.MIN_SCORES = fah_min
            use(None)
            o_ref, lse_ref = attention_forward(q, k, v, causal)
            worst_o = max(worst_o, (o.float() - o_ref.float()).abs().max().item())
            worst_lse = max(worst_lse, (lse - lse_ref).abs().max().item())
    return worst_o, worst_lse


def main():
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    ok = {}
    for name in PLANS:  # (a failure ends the run: a CUDA fault leaves no context to time in)
        ok[name] = check(name)
        print(name, ok[name], flush=True)
    rows = []
    for causal in (False, True):
        for S in (1024, 4096, 16384):
            B = TOKENS // S
            q, k, v = (torch.randn(B, H, S, HD, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            fns = {"triton": forward(None)}
            fns.update({n: forward(n) for n in PLANS})
            fns["cudnn"] = cudnn
            fns["triton_again"] = fns["triton"]
            t = alternate({n: (lambda f=f: f(q, k, v, causal)) for n, f in fns.items()}, 5)
            use(None)
            flop = 4 * B * H * S * S * HD / (2 if causal else 1)
            cells = [f"{flop / statistics.median(t[n]) / 1e9:.0f}" for n in fns if n != "triton_again"]
            ratios = [f"{median_ratio(t['triton'], t[n]):.3f}" for n in fns if n not in ("triton", "triton_again")]
            row = (f"| {S} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " | "
                   + " | ".join(ratios) + f" | {median_ratio(t['triton'], t['triton_again']):.3f} |")
            rows.append(row)
            print(row, flush=True)
    names = list(PLANS)
    print("| S | causal | triton TFLOP/s | " + " | ".join(names) + " | cuDNN | "
          + " | ".join(f"{n} / triton" for n in names) + " | cuDNN / triton | A-vs-A |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
