"""Probe: the Gluon forward with a causal sliding window (window-fwd.patch).

With ``window=(left, 0)`` (the model's ``model.sliding_window``, Mistral's) every call ran the
Triton kernels, whose forward measured 0.80-0.92x cuDNN at Hd 128 where the Gluon forward ran
1.00-1.12x without a window (bench/results/attention.md). The patch gives the Gluon forward a
WINDOW constexpr: a tile's key blocks start at the first its first row sees, blocks across the
window's left edge are masked, and the softmax keeps a row that has seen no key yet finite. The
binaries without a window are unchanged (SASS identical, sm_90 compile on CPU, 2026-12-04); the
windowed ones compile without spills (+300-450 instructions). The backward stays on the Triton
kernels, which read the forward's LSE unchanged.

Decision rule, set before the run: the patch lands if its GPU test passes
(``pytest tests/test_attention.py -k hopper_forward_window``), the windowed Gluon forward is
>= 1.05x the Triton forward at every forward row, and the fwd+bwd row is >= 1.0x (only its
forward differs; the Triton backward is most of its time); otherwise it is dropped.

What: bf16, MHA, B·S 16k, H 16 at Hd 128 and 32 at Hd 64; forward, S 4k and 16k, left 511 and
4095; 5 alternating rounds of do_bench(100, 200): Gluon, Triton, Gluon again; and fwd+bwd
(Gluon forward + Triton backward against all Triton) at Hd 128, S 16k, left 4095.

    git apply docs/pending/window-fwd.patch
    PYTHONPATH=. timeout 400 pytest -q tests/test_attention.py -k hopper_forward_window
    PYTHONPATH=. python docs/pending/window_fwd.py
"""

import statistics
import sys

import torch
import triton

import attention.flash_attn as fa
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
    cases = [(Hd, S, left, "fwd") for Hd in (128, 64) for S in (4096, 16384) for left in (511, 4095)]
    cases.append((128, 16384, 4095, "fwd+bwd"))
    rows = []
    for Hd, S, left, mode in cases:
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
        row = (f"| {Hd} | {S} | {left} | {mode} | {flop / statistics.median(t['gluon']) / 1e9:.0f} | "
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
