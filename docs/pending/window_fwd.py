"""Probe: the Gluon forward with a causal sliding window at Hd 128 (window-fwd.patch), once more.

With ``window=(left, 0)`` (the model's ``model.sliding_window``, Mistral's) every call runs the
Triton kernels, whose forward measured 0.80-0.92x cuDNN at Hd 128 where the Gluon forward ran
1.00-1.12x without a window (bench/results/attention.md). The patch gives the Gluon forward a
WINDOW constexpr: a tile's key blocks start at the first its first row sees, blocks across the
window's left edge are masked, and the softmax keeps a row that has seen no key yet finite. The
backward stays on the Triton kernels, which read the forward's LSE unchanged.

Its first run (2026-12-04, bench/results/attention.md, "The Gluon forward with a causal sliding
window") dropped it by its rule, every forward row >= 1.05x: Hd 128 ran 1.21-1.53x, Hd 64
0.71-1.08x. The patch now sends windows to the Gluon forward at Hd 128 only
(``WINDOW_HEAD_DIMS``; the kernel takes any head dim, and its GPU test runs Hd 64, 96 and 128).
The unwindowed binaries' SASS is identical to main's (sm_90 compile on CPU, nine tilings, Hd 64,
128 and 256). This run confirms the Hd 128 rows and adds S 2k (the stream of tiles,
``CROSS_TILE_HD128_TO``), which the first run did not time; its S 4k row with left 4095 had run
the causal kernel (a window reaching every key), so the windows here are shorter than S.

Decision rule, set before the run: the patch lands if its GPU test passes
(``pytest tests/test_attention.py -k "hopper_forward_window or causal_window"``), the windowed
Gluon forward is >= 1.05x the Triton forward at every Hd 128 forward row, and both fwd+bwd rows
are >= 1.0x (only the forward differs); otherwise it is dropped.

A lead at Hd 64, timed in the same run but not part of that decision: the first run's Hd 64 rows
ran three consumers (192-row tiles, the plan from 4k keys). The "Hd 64, 2 WG" rows force two
(128-row tiles, ``WIDE_HD64_FROM`` past every length) and the dispatch to take Hd 64 windows.
Rule for the lead: if those rows are all >= 1.05x the Triton forward, a later change sends Hd 64
windows to the Gluon forward in two consumers; otherwise Hd 64 windows stay on Triton.

What: bf16, MHA, Hd 128, B·S 16k, H 16; forward at S 2k (left 511, 1023), 4k (511, 2047), 16k
(511, 4095); fwd+bwd at S 4k left 511 and S 16k left 4095; Hd 64 (H 32) forward in two consumers
at S 4k (511, 2047) and 16k (511, 4095); 5 alternating rounds of do_bench(100, 200): Gluon,
Triton, Gluon again.

    git apply docs/pending/window-fwd.patch
    PYTHONPATH=. timeout 400 pytest -q tests/test_attention.py -k "hopper_forward_window or causal_window"
    PYTHONPATH=. python docs/pending/window_fwd.py
"""

import statistics
import sys

import torch
import triton

import attention.flash_attn as fa
import attention.flash_attn_hopper as fah
from attention import flash_attention

sys.path.append("bench")
from common import alternate, median_ratio  # noqa: E402

TOKENS = 16384
GLUON_OK = fa.hopper_forward_ok


def call(q, k, v, do, left, gluon, mode):
    fa.hopper_forward_ok = GLUON_OK if gluon else (lambda *args: False)
    o = flash_attention(q, k, v, causal=True, window=(left, 0))
    return o if mode == "fwd" else torch.autograd.grad(o, (q, k, v), do)


def main():
    torch.manual_seed(0)
    cases = [(128, S, left, "fwd") for S, lefts in ((2048, (511, 1023)), (4096, (511, 2047)),
                                                   (16384, (511, 4095))) for left in lefts]
    cases += [(128, 4096, 511, "fwd+bwd"), (128, 16384, 4095, "fwd+bwd")]
    cases += [(64, S, left, "fwd") for S, lefts in ((4096, (511, 2047)), (16384, (511, 4095)))
              for left in lefts]
    rows = []
    for Hd, S, left, mode in cases:
        if Hd == 64:  # the lead: two consumers, and the dispatch taking Hd 64 windows
            fah.WIDE_HD64_FROM, fah.WINDOW_HEAD_DIMS = 1 << 30, (128, 64)
        B, H = TOKENS // S, 2048 // Hd
        q, k, v, do = (torch.randn(B, H, S, Hd, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=i < 3) for i in range(4))
        assert GLUON_OK(q, k, v, True, (left, 0))
        a, b = call(q, k, v, do, left, True, "fwd"), call(q, k, v, do, left, False, "fwd")
        err = (a.float() - b.float()).abs().max().item()
        fns = {"gluon": lambda: call(q, k, v, do, left, True, mode),
               "triton": lambda: call(q, k, v, do, left, False, mode)}
        fns["gluon_again"] = fns["gluon"]
        t = alternate(fns, 5)
        visible = S * (left + 1) - left * (left + 1) / 2  # keys seen, summed over the queries
        flop = 4 * B * H * visible * Hd * (3.5 if mode == "fwd+bwd" else 1.0)
        row = (f"| {Hd}{', 2 WG' if Hd == 64 else ''} | {S} | {left} | {mode} | {flop / statistics.median(t['gluon']) / 1e9:.0f} | "
               f"{flop / statistics.median(t['triton']) / 1e9:.0f} | "
               f"**{median_ratio(t['triton'], t['gluon']):.3f}** | "
               f"{median_ratio(t['gluon'], t['gluon_again']):.3f} | {err:.1e} |")
        print(row, flush=True)
        rows.append(row)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| Hd | S | left | mode | Gluon TFLOP/s | Triton | Gluon / Triton | A-vs-A | max abs diff o |")
    print("|---:|---:|---:|:---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
