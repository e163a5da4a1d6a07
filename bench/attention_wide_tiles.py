"""Benchmark: Hd 33-63 and 65-127 on the Gluon kernels' wider tiles, vs the Triton path and cuDNN.

Hd 96 (Phi-3's) and the other multiples of 8 between 64 and 128 run the Gluon Hd 128 kernels from
``flash_attn_hopper.WIDE_TILE_FROM`` keys, and 33-63 the Hd 64 kernels: the TMA descriptors keep the
tensors' Hd columns and move the tile's full-width blocks, so loads zero-fill the rest and stores
drop it. Elsewhere, and on other GPUs, the Triton kernels run them on power-of-two tiles (masked).
Each row times, alternating: ours with the route forced on (``wide``), ours with it forced off
(``triton``), cuDNN through SDPA, and ``wide`` again (the A-vs-A column); ``default`` names what
``flash_attention`` runs for the row.

The rule that set ``WIDE_TILE_FROM`` (1024 from the 1k-32k rows, then 256 from rows at 128-512),
applied to this table's fwd+bwd rows: the shortest length at which wide is >= 1.05x triton there
and at every longer length measured, both masks.

bf16, MHA, B·S 16k (B 1 from 16k), H 32; FLOPs as bench/attention.py's, at the tensors' Hd.

    python bench/attention_wide_tiles.py [--head-dims 96 72 120] [--lengths 1024 4096] [--rounds 5]
"""

import argparse
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
# after the repo root: bench/attention.py must not shadow the package
sys.path.append(os.path.dirname(__file__))
import attention.flash_attn_hopper as fah  # noqa: E402
from attention import flash_attention  # noqa: E402
from common import (alternate, attention_flops, attention_runner, header,  # noqa: E402
                    median_ratio, sdpa, write_results)

TOKENS, H = 16384, 32
ON, OFF = 0, 1 << 40


def _ours(route):
    def fn(q, k, v, causal):
        fah.WIDE_TILE_FROM = route  # read at each call's dispatch, the backward's too
        return flash_attention(q, k, v, causal=causal)
    return fn


def _out_and_grads(fn, q, k, v, do, causal):
    o = fn(q, k, v, causal)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def _max_rel_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() / y.float().abs().max().item()
               for x, y in zip(a, b))


def row(Hd, S, causal, mode, rounds, shipped):
    B = max(1, TOKENS // S)
    q, k, v, do = (torch.randn(B, H, S, Hd, device="cuda", dtype=torch.bfloat16,
                               requires_grad=i < 3) for i in range(4))
    impls = {"wide": _ours(ON), "triton": _ours(OFF), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    fns = {n: attention_runner(f, q, k, v, do, causal, mode) for n, f in impls.items()}
    err = _max_rel_diff(*(_out_and_grads(impls[n], q, k, v, do, causal)
                          for n in ("wide", "triton")))
    fns["wide_again"] = fns["wide"]
    t = alternate(fns, rounds)
    fah.WIDE_TILE_FROM = shipped
    flop = attention_flops(B, H, S, Hd, causal, mode)
    tf = {n: flop / statistics.median(t[n]) / 1e9 for n in t}
    default = "wide" if fah.kernel_head_dim(Hd, S, fah.HEAD_DIMS) else "triton"
    return (f"| {Hd} | {S} | {B}×{H} | {'yes' if causal else 'no'} | {mode} | {tf['wide']:.0f} | "
            f"{tf['triton']:.0f} | {tf['cudnn']:.0f} | "
            f"**{median_ratio(t['triton'], t['wide']):.3f}** | "
            f"{median_ratio(t['cudnn'], t['wide']):.3f} | "
            f"{median_ratio(t['cudnn'], t['triton']):.3f} | "
            f"{median_ratio(t['wide'], t['wide_again']):.3f} | {default} | {err:.1e} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", type=int, nargs="+", default=[96])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="bench/results/attention_wide_tiles.md")
    args = p.parse_args()
    for Hd in args.head_dims:
        # the dispatch's own rule, at a length past every threshold (OFF keys)
        if Hd % 8 or fah.kernel_head_dim(Hd, OFF, fah.HEAD_DIMS) in (None, Hd):
            p.error(f"--head-dims: {Hd} is not a multiple of 8 in 33-63 or 65-127, where a "
                    "wider tile serves it")
    torch.manual_seed(0)
    shipped = fah.WIDE_TILE_FROM
    md = header(
        "Head dims below a Gluon tile width on those kernels vs the Triton path and cuDNN",
        "bench/attention_wide_tiles.py",
        f"bf16, MHA, B·S = {TOKENS} tokens, H {H}; {args.rounds} rounds of do_bench(warmup=100, "
        "rep=200) median, alternating wide, triton, cuDNN (SDPA), wide again",
        "wide: ours with the Gluon kernels of the next tile width (64 or 128) forced on; triton: "
        "forced off (the Triton kernels on power-of-two masked tiles); default: what "
        f"flash_attention runs for the row (WIDE_TILE_FROM = {shipped})",
        "ratios: median over rounds of the second named's time over the first's, > 1: the first "
        "named faster; "
        "A-vs-A: wide against wide again; max rel diff: wide against triton over o, dq, dk, dv, "
        "relative to the largest value",
    ) + ["| Hd | S | B×H | causal | mode | wide TFLOP/s | triton | cuDNN | wide / triton | "
         "wide vs cuDNN | triton vs cuDNN | A-vs-A | default | max rel diff |",
         "|---:|---:|---:|:---:|:---|---:|---:|---:|---:|---:|---:|---:|:---|---:|"]
    for Hd in args.head_dims:
        for causal in (False, True):
            for S in args.lengths:
                for mode in args.modes:
                    md.append(row(Hd, S, causal, mode, args.rounds, shipped))
                    print(md[-1], flush=True)
    write_results(args.out, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
