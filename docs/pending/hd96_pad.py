"""Probe: Hd 96 (Phi-3's head dim) through the Gluon Hd 128 kernels, zero-padded, against the
Triton kernels that run it today.

Why. The Gluon kernels take Hd 64 and 128; Hd 96 runs the Triton kernels on 128-wide tiles (the
lists tuned at Hd 128), which at Hd 256 ran 0.65-0.76x cuDNN fwd+bwd (bench/results/
attention_hd256.md). Zero-padding q, k, v to 128 columns is exact: QK^T gains only zero terms,
the padded columns of O, dQ, dK, dV are zero and sliced off, and the scale stays 96^-0.5. It costs
a third more matmul work and the pad copies.

Decision rule, set before the run: if padded fwd+bwd is >= 1.10x the Triton path at every row
(S 1k / 4k / 16k, causal and not), a later change routes Hd 65-127 (the cases the Gluon kernels
take otherwise) through the padded kernels; otherwise the table is recorded and nothing changes.

What: bf16, B·S 16k, H 32, MHA; fwd and fwd+bwd; 5 alternating rounds of do_bench(100, 200):
ours (Triton), padded (Gluon), SDPA cuDNN, ours again (A-vs-A); padded outputs and gradients
against ours by max error.

    PYTHONPATH=. python docs/pending/hd96_pad.py
"""

import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import flash_attention

sys.path.append("bench")
from common import alternate, median_ratio  # noqa: E402

HD, H, TOKENS = 96, 32, 16384


def ours(q, k, v, causal):
    return flash_attention(q, k, v, causal=causal)


def padded(q, k, v, causal):
    pad = [F.pad(t, (0, 128 - HD)) for t in (q, k, v)]
    return flash_attention(*pad, causal=causal, scale=HD ** -0.5)[..., :HD]


def cudnn(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def runner(fn, q, k, v, do, causal, mode):
    if mode == "fwd":
        return lambda: fn(q, k, v, causal)
    return lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)


def main():
    torch.manual_seed(0)
    rows = []
    for causal in (False, True):
        for S in (1024, 4096, 16384):
            B = TOKENS // S
            q, k, v, do = (torch.randn(B, H, S, HD, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=i < 3) for i in range(4))
            a = runner(ours, q, k, v, do, causal, "fwd+bwd")()
            b = runner(padded, q, k, v, do, causal, "fwd+bwd")()
            err = max((x.float() - y.float()).abs().max().item() / y.float().abs().max().item()
                      for x, y in zip(a, b))
            for mode in ("fwd", "fwd+bwd"):
                fns = {n: runner(f, q, k, v, do, causal, mode)
                       for n, f in (("ours", ours), ("padded", padded), ("cudnn", cudnn))}
                fns["ours_again"] = fns["ours"]
                t = alternate(fns, 5)
                flop = 4 * B * H * S * S * HD / (2 if causal else 1) * (3.5 if mode == "fwd+bwd" else 1)
                row = (f"| {S} | {'yes' if causal else 'no'} | {mode} | "
                       f"{flop / statistics.median(t['ours']) / 1e9:.0f} | "
                       f"{flop / statistics.median(t['padded']) / 1e9:.0f} | "
                       f"{flop / statistics.median(t['cudnn']) / 1e9:.0f} | "
                       f"{median_ratio(t['ours'], t['padded']):.3f} | "
                       f"{median_ratio(t['cudnn'], t['ours']):.3f} | "
                       f"{median_ratio(t['cudnn'], t['padded']):.3f} | "
                       f"{median_ratio(t['ours'], t['ours_again']):.3f} | {err:.1e} |")
                print(row, flush=True)
                rows.append(row)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| S | causal | mode | ours TFLOP/s | padded | cuDNN | padded / ours | ours vs cuDNN | "
          "padded vs cuDNN | A-vs-A | max rel diff |  (speed ratios; TFLOP/s at Hd 96's FLOPs)")
    print("|---:|:---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
