"""Probe: Hd 96 zero-padded through the Gluon Hd 128 kernels, by length: from which key length does
it pay?

The first probe (hd96_pad.py of 6fab84f; bench/results/attention.md, "Hd 96 zero-padded") found
padded fwd+bwd 0.954 / 1.185 / 1.317x the Triton path at S 1k / 4k / 16k non-causal and 0.809 /
1.047 / 1.193x causal: the pad copies cost most where the attention is short. A route from some
length on would keep the wins without the losses.

Decision rule, set before the run: for each mask, L = the shortest length such that padded
fwd+bwd is >= 1.05x the Triton path at L and at every longer length measured; a later change routes
Hd 65-127 (no window, Sq == Sk, fp16/bf16) through the padded Gluon kernels from L keys for that
mask. No such L: nothing changes. Same-run A-vs-A rows give the noise.

What: bf16, B·S 16k (B 1 at 32k), H 32, MHA; fwd+bwd; S 2k / 4k / 8k / 16k / 32k, causal and not;
5 alternating rounds of do_bench(100, 200): ours (Triton), padded (Gluon), ours again.

    PYTHONPATH=. python docs/pending/hd96_pad_long.py
"""

import statistics
import sys

import torch
import torch.nn.functional as F
import triton

from attention import flash_attention

sys.path.append("bench")
from common import alternate, median_ratio  # noqa: E402

HD, H, TOKENS = 96, 32, 16384


def ours(q, k, v, causal):
    return flash_attention(q, k, v, causal=causal)


def padded(q, k, v, causal):
    pad = [F.pad(t, (0, 128 - HD)) for t in (q, k, v)]
    return flash_attention(*pad, causal=causal, scale=HD ** -0.5)[..., :HD]


def runner(fn, q, k, v, do, causal):
    return lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)


def main():
    torch.manual_seed(0)
    rows = []
    for causal in (False, True):
        for S in (2048, 4096, 8192, 16384, 32768):
            B = max(1, TOKENS // S)
            q, k, v, do = (torch.randn(B, H, S, HD, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=i < 3) for i in range(4))
            a, b = runner(ours, q, k, v, do, causal)(), runner(padded, q, k, v, do, causal)()
            err = max((x.float() - y.float()).abs().max().item() / y.float().abs().max().item()
                      for x, y in zip(a, b))
            fns = {"ours": runner(ours, q, k, v, do, causal),
                   "padded": runner(padded, q, k, v, do, causal)}
            fns["ours_again"] = fns["ours"]
            t = alternate(fns, 5)
            flop = 4 * B * H * S * S * HD / (2 if causal else 1) * 3.5
            row = (f"| {S} | {'yes' if causal else 'no'} | "
                   f"{flop / statistics.median(t['ours']) / 1e9:.0f} | "
                   f"{flop / statistics.median(t['padded']) / 1e9:.0f} | "
                   f"{median_ratio(t['ours'], t['padded']):.3f} | "
                   f"{median_ratio(t['ours'], t['ours_again']):.3f} | {err:.1e} |")
            print(row, flush=True)
            rows.append(row)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| S | causal | ours fwd+bwd TFLOP/s | padded | padded / ours | A-vs-A | max rel diff |")
    print("|---:|:---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
