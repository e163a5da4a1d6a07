"""Benchmark: the Gluon grouped GEMM kernels against the Triton TMA kernels they replace on sm_90,
and both against ``torch._grouped_mm`` (cuBLAS), kernel by kernel; then the whole ``MoELayer``
fwd+bwd with the Gluon kernels as shipped, with the weight gradient on the Triton TMA kernel
(``grouped_mm_wgrad_gluon.ROUTED`` off) and with both off (``moe.kernels.grouped_mm_gluon.ENABLED``).

Kernels (bf16, tokens routed by uniform random top-k, so group sizes are ragged): each expert
projection of the SwiGLU MLP, up ``x(M, D) @ w1[e](D, 2F)`` and down ``h(M, F) @ w2[e](F, D)``, as
- ``fwd``: the forward GEMM (Gluon ``grouped_mm_gluon`` / TMA ``grouped_mm_tma``);
- ``dgrad``: ``dy(M, N) @ w[e]ᵀ``, the same kernels on the transposed weight, read as stored;
- ``wgrad``: ``x_eᵀ @ dy_e`` (``grouped_mm_wgrad_gluon`` / ``grouped_mm_wgrad_tma``);
- ``wgrad += fp32``: the same added into an fp32 dw (the master gradient's epilogue; the anchor
  adds cuBLAS's bf16 dw in a second pass).
FLOPs ``2·M·I·N`` each. Each row also says whether the Gluon output equals the TMA kernel's bit
for bit. The layer rows time ``torch.autograd.grad`` of the layer for x and every weight, and
say whether those gradients are bit-equal with the Gluon kernels on and off.

Protocol (bench/common.py): rounds alternating Gluon, TMA, the anchor and Gluon again, each
``do_bench(warmup=100, rep=200)`` median; ratios are medians over rounds (> 1: Gluon faster);
A-vs-A is Gluon over Gluon again.

    python bench/grouped_gemm_gluon.py [--rounds 5] [--what kernels layer] [--shapes DeepSeek-V3 ...] [--fp32-only]
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))
from common import alternate, header, median_ratio, write_results  # noqa: E402
from moe_layer import SHAPES as LAYER_SHAPES, _setup, ours_forward  # noqa: E402

from kernel_floor import use_tensor_descriptors  # noqa: E402
from moe.kernels import grouped_mm_gluon  # noqa: E402
from moe.kernels.grouped_mm_tma import grouped_mm_tma  # noqa: E402
from moe.kernels import grouped_mm_wgrad_gluon  # noqa: E402
from moe.kernels.grouped_mm_wgrad_tma import grouped_mm_wgrad_tma  # noqa: E402

# name, experts E, model dim D, expert hidden F, tokens T, top-k K (bench/grouped_gemm.py's)
SHAPES = [("Mixtral", 8, 4096, 14336, 8192, 2), ("OLMoE", 64, 2048, 1024, 16384, 8),
          ("Qwen3-A3B", 128, 2048, 768, 16384, 8), ("DeepSeek-V3", 256, 7168, 2048, 8192, 8)]


KERNEL_CASES = ("fwd", "dgrad", "wgrad", "wgrad += fp32")


def _cases(E, D, F, T, K, whats=KERNEL_CASES):
    """(projection, what, ``{impl: fn}``, flops, bit-equal) per kernel case of one shape, for the
    cases in ``whats``."""
    M = T * K
    offsets = torch.bincount(torch.randint(0, E, (M,), device="cuda"), minlength=E).cumsum(0).to(torch.int32)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for proj, I, N in (("up", D, 2 * F), ("down", F, D)):
        w = torch.randn(E, I, N, **bf16) / I**0.5 if {"fwd", "dgrad"} & set(whats) else None
        for what in ("fwd", "dgrad"):
            if what not in whats:
                continue
            a, b, n = (torch.randn(M, I, **bf16), w, N) if what == "fwd" else (torch.randn(M, N, **bf16), w.transpose(1, 2), I)
            y_gluon, y_tma = torch.empty(M, n, **bf16), torch.empty(M, n, **bf16)
            fns = {"gluon": lambda a=a, b=b, y=y_gluon: grouped_mm_gluon.grouped_mm_gluon(a, b, offsets, y),
                   "tma": lambda a=a, b=b, y=y_tma: grouped_mm_tma(a, b, offsets, y, None, 0),
                   "anchor": lambda a=a, b=b: torch._grouped_mm(a, b, offs=offsets)}
            use_tensor_descriptors()
            fns["gluon"](), fns["tma"]()
            yield proj, what, fns, 2 * M * I * N, torch.equal(y_gluon, y_tma)
        w = None
        x, dy = torch.randn(M, I, **bf16), torch.randn(M, N, **bf16)
        if "wgrad" in whats:
            dw_gluon, dw_tma = torch.empty(E, I, N, **bf16), torch.empty(E, I, N, **bf16)
            fns = {"gluon": lambda: grouped_mm_wgrad_gluon.grouped_mm_wgrad_gluon(x, dy, offsets, dw_gluon),
                   "tma": lambda: grouped_mm_wgrad_tma(x, dy, offsets, dw_tma),
                   "anchor": lambda: torch._grouped_mm(x.t(), dy, offs=offsets)}
            fns["gluon"](), fns["tma"]()
            yield proj, "wgrad", fns, 2 * M * I * N, torch.equal(dw_gluon, dw_tma)
            dw_gluon = dw_tma = None  # freed (the caller timed them) before the fp32 dw is allocated
        if "wgrad += fp32" in whats:
            yield proj, "wgrad += fp32", *_fp32_add_case(x, dy, offsets, E, I, N)


def _fp32_add_case(x, dy, offsets, E, I, N):
    """The master gradient's weight gradient, added into an fp32 dw: the Gluon and TMA kernels'
    fp32 add epilogue, the anchor ``torch._grouped_mm``'s bf16 dw then added (two passes). All
    three add into one buffer (DeepSeek-V3's fp32 dw is 30 GB); bit-equality is checked on the
    first 16 groups (Mixtral's 8), each kernel into its own buffer."""
    sub = offsets[:16]
    parts = [torch.zeros(len(sub), I, N, device="cuda") for _ in range(2)]
    grouped_mm_wgrad_gluon.grouped_mm_wgrad_gluon(x, dy, sub, parts[0], accumulate=True)
    grouped_mm_wgrad_tma(x, dy, sub, parts[1], accumulate=True)
    same = torch.equal(parts[0].view(torch.int32), parts[1].view(torch.int32))  # bits, zeros' signs too
    del parts
    dw = torch.zeros(E, I, N, device="cuda")
    fns = {"gluon": lambda: grouped_mm_wgrad_gluon.grouped_mm_wgrad_gluon(x, dy, offsets, dw, accumulate=True),
           "tma": lambda: grouped_mm_wgrad_tma(x, dy, offsets, dw, accumulate=True),
           "anchor": lambda: dw.add_(torch._grouped_mm(x.t(), dy, offs=offsets))}
    return fns, 2 * x.shape[0] * I * N, same


def bench_kernels(rounds, names, fp32_only):
    rows = []
    for name, *shape in SHAPES:
        if name not in names:
            continue
        torch.manual_seed(0)
        for proj, what, fns, flops, same in _cases(*shape, ("wgrad += fp32", ) if fp32_only else KERNEL_CASES):
            t = alternate({**fns, "gluon_again": fns["gluon"]}, rounds)
            rows.append(f"| {name} {proj} | {what} | {flops / statistics.median(t['gluon']) / 1e9:.0f} | "
                        f"{flops / statistics.median(t['tma']) / 1e9:.0f} | "
                        f"{flops / statistics.median(t['anchor']) / 1e9:.0f} | "
                        f"{median_ratio(t['tma'], t['gluon']):.3f}x | {median_ratio(t['anchor'], t['gluon']):.3f}x | "
                        f"{median_ratio(t['anchor'], t['tma']):.3f}x | {median_ratio(t['gluon_again'], t['gluon']):.3f} | "
                        f"{'yes' if same else 'NO'} |")
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return ["| shape | what | Gluon TFLOP/s | TMA TFLOP/s | torch._grouped_mm TFLOP/s | TMA / Gluon time "
            "| anchor / Gluon | anchor / TMA | A-vs-A | bit-equal to TMA |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |", *rows]


def _layer_row(name, E, D, F, T, K, rounds):
    """One layer's row: fwd+bwd with the Gluon kernels as shipped (``wgrad_gluon_ok`` routes the
    weight gradient by its size rule), with the weight gradient on the Triton TMA kernel
    (``grouped_mm_wgrad_gluon.ROUTED`` off), and with no Gluon kernel."""
    layer, params, x_TD, dy_TD = _setup(E, D, F, T, K)
    forward = ours_forward(layer)
    shipped = grouped_mm_wgrad_gluon.ROUTED

    def grads(on, wgrad):
        def run():
            grouped_mm_gluon.ENABLED, grouped_mm_wgrad_gluon.ROUTED = on, wgrad
            return torch.autograd.grad(forward(x_TD)[0], [x_TD, *params], dy_TD)
        return run
    fns = {"gluon": grads(True, shipped), "no_wgrad": grads(True, False), "tma": grads(False, False),
           "gluon_again": grads(True, shipped)}
    try:
        same = all(all(torch.equal(p, q) for p, q in zip(fns["gluon"](), fns[other]())) for other in ("no_wgrad", "tma"))
        t = alternate(fns, rounds)
    finally:
        grouped_mm_gluon.ENABLED, grouped_mm_wgrad_gluon.ROUTED = True, shipped
    flops = 3 * 6 * T * K * D * F
    tflops = {n: flops / statistics.median(t[n]) / 1e9 for n in ("gluon", "no_wgrad", "tma")}
    return (f"| {name} | {tflops['gluon']:.0f} | {tflops['no_wgrad']:.0f} | {tflops['tma']:.0f} | "
            f"{median_ratio(t['tma'], t['gluon']):.3f}x | {median_ratio(t['no_wgrad'], t['gluon']):.3f}x | "
            f"{median_ratio(t['gluon_again'], t['gluon']):.3f} | {'yes' if same else 'NO'} |")


def bench_layer(rounds, names):
    rows = []
    for shape in LAYER_SHAPES:
        if shape[0] not in names:
            continue
        rows.append(_layer_row(*shape, rounds))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return ["| layer fwd+bwd | Gluon as shipped TFLOP/s | wgrad on the TMA kernel TFLOP/s | off (TMA kernels) TFLOP/s "
            "| off / shipped time | wgrad TMA / shipped time | A-vs-A | gradients bit-equal (all three) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |", *rows]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--what", nargs="+", choices=("kernels", "layer"), default=["kernels", "layer"])
    p.add_argument("--fp32-only", action="store_true", help="of the kernel rows, only the fp32 master-gradient add")
    names = sorted({s[0] for s in SHAPES} | {s[0] for s in LAYER_SHAPES})
    p.add_argument("--shapes", nargs="+", choices=names, default=names)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "grouped_gemm_gluon.md"))
    args = p.parse_args()
    md = header("Gluon grouped GEMM kernels vs the Triton TMA kernels and torch._grouped_mm",
                "bench/grouped_gemm_gluon.py",
                f"{args.rounds} rounds of do_bench(warmup=100, rep=200) median, alternating Gluon / TMA / "
                "anchor / Gluon again; ratios = median over rounds of the other's time over Gluon's (> 1: Gluon faster)",
                "bf16; kernels: M = T·K rows routed by uniform random top-k; layer: bench/moe_layer.py's shapes, "
                "fwd+bwd TFLOP/s of the expert GEMMs")
    if "kernels" in args.what:
        md += bench_kernels(args.rounds, args.shapes, args.fp32_only) + [""]
    if "layer" in args.what:
        md += bench_layer(args.rounds, args.shapes) + [""]
    write_results(args.out, "\n".join(md))


if __name__ == "__main__":
    main()
