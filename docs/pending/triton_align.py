"""Probe: the Triton attention kernels at Hd ≡ 8 mod 16 with the host's ALIGN (triton-align.patch).

Triton's launcher marks an int argument as a multiple of 16 only when it is one, so a contiguous
(B, H, S, 72) tensor's row stride of 72 left the Triton forward and both backward kernels with
2-byte loads and stores and no cp.async pipeline (sm_90 PTX, compiled on CPU, 2026-12-04). That
fits the Triton path's measured rates: Hd 72 and 120 fwd+bwd 0.41-0.46x cuDNN and Hd 40 / 56
0.48-0.51x, against 0.73-0.78x at Hd 96 and 0.83-0.88x at Hd 48, whose strides are multiples of 16
(bench/results/attention_wide_tiles.md). The patch passes strides // ALIGN and multiplies them
back in the kernels, so Triton knows every row starts on 16 bytes: 16-byte cp.async as at Hd 96.

These kernels serve every GPU but Hopper, and on Hopper what the Gluon kernels do not take:
shorter than 1k keys, Sq != Sk, windows, fp32.

Decision rule, set before the run: the patch lands if, at every row below, fwd+bwd with ALIGN is
>= 1.05x the same kernels with ALIGN forced to 1 and o, dq, dk, dv agree within 1e-2 of their
largest value; otherwise it is dropped.

What: the Triton kernels (the Gluon route off: WIDE_TILE_FROM past every length), bf16, B·S 16k,
H 32, MHA, fwd+bwd; Hd 72, 120 and 40 at S 512 and 4k causal and not; and Hd 72 with a sliding
window (512, 0) at S 4k (Triton on every GPU); 5 alternating rounds of do_bench(100, 200): ALIGN,
ALIGN = 1, ALIGN again.

    git apply docs/pending/triton-align.patch
    PYTHONPATH=. python docs/pending/triton_align.py
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

H, TOKENS = 32, 16384
ALIGN = fa._align


def run(q, k, v, do, causal, window, aligned):
    fa._align = ALIGN if aligned else (lambda *tensors: 1)
    o = flash_attention(q, k, v, causal=causal, window=window)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def main():
    torch.manual_seed(0)
    fah.WIDE_TILE_FROM = 1 << 40  # the Triton kernels at every length
    cases = [(Hd, S, causal, None) for Hd in (72, 120, 40) for S in (512, 4096)
             for causal in (False, True)] + [(72, 4096, True, (512, 0))]
    rows = []
    for Hd, S, causal, window in cases:
        B = max(1, TOKENS // S)
        q, k, v, do = (torch.randn(B, H, S, Hd, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=i < 3) for i in range(4))
        a, b = run(q, k, v, do, causal, window, True), run(q, k, v, do, causal, window, False)
        err = max((x.float() - y.float()).abs().max().item() / y.float().abs().max().item()
                  for x, y in zip(a, b))
        fns = {"align": lambda: run(q, k, v, do, causal, window, True),
               "one": lambda: run(q, k, v, do, causal, window, False)}
        fns["align_again"] = fns["align"]
        t = alternate(fns, 5)
        visible = S * S / 2 if causal and window is None else (
            S * min(S, window[0] + 1) if window else S * S)
        flop = 4 * B * H * visible * Hd * 3.5
        row = (f"| {Hd} | {S} | {'yes' if causal else 'no'} | {window} | "
               f"{flop / statistics.median(t['align']) / 1e9:.0f} | "
               f"{flop / statistics.median(t['one']) / 1e9:.0f} | "
               f"**{median_ratio(t['one'], t['align']):.3f}** | "
               f"{median_ratio(t['align'], t['align_again']):.3f} | {err:.1e} |")
        print(row, flush=True)
        rows.append(row)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| Hd | S | causal | window | ALIGN fwd+bwd TFLOP/s | ALIGN 1 | ALIGN / 1 | A-vs-A | "
          "max rel diff |")
    print("|---:|---:|:---:|:---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
