"""RoPE fwd+bwd: the Triton pass (attention/rope.py) against the same math in PyTorch ops.

    python bench/rope.py [--rounds 5]

q and k of one attention block, bf16, as the model applies them: strided views of the fused qkv
projection output in, a contiguous tensor out, then a backward with a random gradient. Protocol:
bench/common.py (alternating rounds of do_bench, median per-round ratio, A-vs-A row).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from attention.rope import apply_rope, rope_cos_sin  # noqa: E402
from common import alternate, header, median_ratio, write_results  # noqa: E402

# name: (B, S, H, Hkv, Hd)
SHAPES = {"OLMoE (8k tokens)": (4, 2048, 16, 16, 128), "Qwen3-A3B (8k tokens)": (2, 4096, 32, 4, 128),
          "head dim 64 (16k tokens)": (8, 2048, 16, 16, 64)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rope.md"))
    args = ap.parse_args()
    md = header("RoPE fwd+bwd: Triton pass vs PyTorch ops", "bench/rope.py",
                "q and k of one block, bf16, strided views of the fused qkv output; backward with a random gradient",
                f"{args.rounds} rounds of do_bench(warmup=100, rep=200), alternating; ratio = median over rounds of "
                "PyTorch / ours (> 1: ours faster)")
    md += ["| shape | B, S, H, Hkv, Hd | PyTorch ms | ours ms | PyTorch / ours | A-vs-A | max abs diff |",
           "|---|---|---|---|---|---|---|"]
    for name, (B, S, H, Hkv, Hd) in SHAPES.items():
        qkv = torch.randn(B, S, H + 2 * Hkv, Hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        cos, sin = rope_cos_sin(S, Hd, device="cuda")
        grads = [torch.randn(B, S, n, Hd, device="cuda", dtype=torch.bfloat16) for n in (H, Hkv)]

        def step(backend):
            q = apply_rope(qkv[:, :, :H], cos, sin, backend)
            k = apply_rope(qkv[:, :, H:H + Hkv], cos, sin, backend)
            torch.autograd.backward([q, k], grads)
            qkv.grad = None
            return q

        diff = (step("triton").float() - step("reference").float()).abs().max().item()
        t = alternate({"ref": lambda: step("reference"), "ours": lambda: step("triton"),
                       "ref2": lambda: step("reference")}, args.rounds)
        md.append(f"| {name} | {B}, {S}, {H}, {Hkv}, {Hd} | {sorted(t['ref'])[args.rounds // 2]:.3f} | "
                  f"{sorted(t['ours'])[args.rounds // 2]:.3f} | **{median_ratio(t['ref'], t['ours']):.2f}** | "
                  f"{median_ratio(t['ref'], t['ref2']):.3f} | {diff:.1e} |")
        print(md[-1], flush=True)
    write_results(args.out, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
