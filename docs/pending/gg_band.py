"""Probe: wider L2 bands for the Gluon grouped GEMM at Mixtral's few large groups.

Why: at Mixtral's shape both our kernels and torch._grouped_mm run at the 700 W cap, so TFLOP/s
follow energy per FLOP (bench/results/grouped_gemm.md, 2026-12-03). The forward/dgrad walks each
segment in bands of GROUP_M = 8 m-tiles and the weight gradient in bands of GROUP_K = 8 k-tiles:
at Mixtral (2048-4096 rows a group, 16-32 m-tiles) every band re-reads the whole expert weight
(117-235 MB, past the 50 MB L2) from HBM, so the forward reads each weight 2-4 times and the weight
gradient reads dy 4 times. A band over all of a group's tiles reads each once. What this asks: does
the saved HBM traffic buy TFLOP/s under the cap, and does it cost anything elsewhere?

Decision rule, set before the run: a wider band ships for an op where, in both Mixtral token
counts, its median per-round ratio over the shipped band is >= 1.01 in both projections and no
op-shape anywhere reads below 0.995; otherwise the bands stay at 8.

What: per shape and projection, each op (fwd, dgrad, wgrad) timed in 5 alternating rounds of
do_bench(100, 200): torch._grouped_mm, the shipped band (8), 16, 32, the shipped band again (A-vs-A);
outputs of every band bit-equal to the shipped one's (the band only reorders tiles).

Run: PYTHONPATH=. python docs/pending/gg_band.py
"""

import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

import moe.kernels.grouped_mm_gluon as gg

ROOT = Path(__file__).resolve().parents[2]
BANDS = (8, 16, 32)
# name, experts, in dim, out dim, tokens, top-k
SHAPES = [("Mixtral up T8k", 8, 4096, 14336, 8192, 2), ("Mixtral down T8k", 8, 14336, 4096, 8192, 2),
          ("Mixtral up T16k", 8, 4096, 14336, 16384, 2), ("Mixtral down T16k", 8, 14336, 4096, 16384, 2),
          ("OLMoE up", 64, 2048, 1024, 16384, 8), ("Qwen3 up", 128, 2048, 768, 16384, 8)]


def wgrad_with_band(band):
    """The weight-gradient launcher of a copy of its module with GROUP_K = band."""
    src = (ROOT / "moe/kernels/grouped_mm_wgrad_gluon.py").read_text()
    assert "GROUP_K = gl.constexpr(8)" in src
    tmp = Path(tempfile.mkdtemp())
    (tmp / f"wgrad_band{band}.py").write_text(src.replace("GROUP_K = gl.constexpr(8)", f"GROUP_K = gl.constexpr({band})"))
    sys.path.insert(0, str(tmp))
    return importlib.import_module(f"wgrad_band{band}").grouped_mm_wgrad_gluon


def fwd_with_band(band, a, b, offsets, y):
    def run():
        gg._GROUP_M = band
        gg.grouped_mm_gluon(a, b, offsets, y)
    return run


def bench(fn):
    return triton.testing.do_bench(fn, warmup=100, rep=200, return_mode="median")


def main():
    torch.manual_seed(0)
    wgrads = {band: wgrad_with_band(band) for band in BANDS}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < 20:  # heat: the cap's clock from the first row on
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    del a
    rows = []
    for name, E, D, F, T, k in SHAPES:
        experts = torch.rand(T, E, device="cuda").topk(k, dim=1).indices.flatten()
        offsets = torch.bincount(experts, minlength=E).cumsum(0).to(torch.int32)
        M = T * k
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(E, D, F, device="cuda") / D ** 0.5).to(torch.bfloat16)
        dy = torch.randn(M, F, device="cuda", dtype=torch.bfloat16)
        y, dx = torch.empty(M, F, device="cuda", dtype=x.dtype), torch.empty(M, D, device="cuda", dtype=x.dtype)
        dw = torch.empty(E, D, F, device="cuda", dtype=x.dtype)
        ops = {
            "fwd": (lambda: torch._grouped_mm(x, w, offs=offsets),
                    {b: fwd_with_band(b, x, w, offsets, y) for b in BANDS}, y, 2 * M * D * F),
            "dgrad": (lambda: torch._grouped_mm(dy, w.transpose(1, 2), offs=offsets),
                      {b: fwd_with_band(b, dy, w.transpose(1, 2), offsets, dx) for b in BANDS}, dx, 2 * M * D * F),
            "wgrad": (lambda: torch._grouped_mm(x.t(), dy, offs=offsets),
                      {b: (lambda b=b: wgrads[b](x, dy, offsets, dw)) for b in BANDS}, dw, 2 * M * D * F),
        }
        for op, (anchor, variants, out, flop) in ops.items():
            outs = {}
            for b, fn in variants.items():
                fn()
                torch.cuda.synchronize()
                outs[b] = out.clone()
            ref = anchor().float()
            err = ((outs[8].float() - ref).norm() / ref.norm()).item()
            same = all(torch.equal(outs[b], outs[8]) for b in BANDS)
            t = {key: [] for key in ("anchor", *BANDS, "again")}
            for _ in range(5):
                t["anchor"].append(bench(anchor))
                for b in BANDS:
                    t[b].append(bench(variants[b]))
                t["again"].append(bench(variants[8]))
            med = statistics.median
            ratio = {key: med(a / o for a, o in zip(t["anchor"], t[key])) for key in (*BANDS, "again")}
            over8 = {b: med(o8 / o for o8, o in zip(t[8], t[b])) for b in BANDS[1:]}
            aa = med(g / o for g, o in zip(t[8], t["again"]))
            row = (f"| {name} | {op} | {flop / med(t['anchor']) / 1e9:.0f} | "
                   + " | ".join(f"{flop / med(t[b]) / 1e9:.0f} ({ratio[b]:.3f})" for b in BANDS)
                   + " | " + " | ".join(f"{over8[b]:.3f}" for b in BANDS[1:])
                   + f" | {aa:.3f} | {same} | {err:.1e} |")
            print(row, flush=True)
            rows.append(row)
    gg._GROUP_M = 8
    props = torch.cuda.get_device_properties(0)
    print(f"\n{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}")
    print("| shape | op | anchor TFLOP/s | band 8 (anchor/ours) | band 16 | band 32 | 16 / 8 | 32 / 8 | A-vs-A (8) "
          "| bits equal | rel err vs anchor |")
    print("|:---|:---|---:|---:|---:|---:|---:|---:|---:|:---|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
