"""Benchmark: Triton FlashAttention vs scaled_dot_product_attention (FLASH and cuDNN backends).

bf16, MHA, B·S = 16k tokens per row, H·Hd = 2048 (H 32 at Hd 64, 16 at 128, 8 at 256). FLOPs
counted as 4·B·H·S²·Hd for the forward (half when causal) and 3.5× that for forward+backward.
Protocol: per row, ``rounds`` rounds; each round times ours, then each anchor, with
triton.testing.do_bench (median); the claim is the median over rounds of anchor_time / our_time
(> 1: ours faster). The A-vs-A rows time ours against itself to show the noise.

    python bench/attention.py [--quick] [--sass] [--out bench/results/attention.md]
    python bench/attention.py --head-dims 256 --out bench/results/attention_hd256.md  # Triton
    python bench/attention.py --tune --head-dims 256   # time the WIDE config spaces and exit
    python bench/attention.py --host   # host vs GPU-kernel time of a fwd+bwd call at S 1k, and
                                       # where the host time of our backward goes
"""

import argparse
import glob
import os
import statistics
import subprocess
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.append(os.path.dirname(__file__))  # after the repo root: bench/attention.py must not shadow the package
import attention.flash_attn_hopper as fah  # noqa: E402
from attention import flash_attention  # noqa: E402
from common import (alternate, attention_flops, attention_runner, header, median_ratio,  # noqa: E402
                    sdpa, write_results)

TOKENS = 16384


IMPLS = {
    "ours": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal),
    # The backward's opt-in mode: dQ parts added in arrival order, not bit-reproducible.
    "ours_nondet": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal,
                                                           deterministic=False),
    "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
}


def _inputs(Hd, S):
    """A row's (B, H, q, k, v, do): B·S = TOKENS, H·Hd = 2048 (the FLOPs of a token the same at
    every head dim), bf16 MHA."""
    H, B = 2048 // Hd, max(TOKENS // S, 1)
    q, k, v, do = (torch.randn(B, H, S, Hd, device="cuda", dtype=torch.bfloat16,
                               requires_grad=i < 3) for i in range(4))
    return B, H, q, k, v, do


def _serves(name, q, k, v, do, causal, mode):
    """Whether SDPA backend ``name`` runs this row (cuDNN's head-dim limits differ by mode)."""
    try:
        attention_runner(IMPLS[name], q, k, v, do, causal, mode)()
        return True
    except RuntimeError:
        return False


def bench_row(Hd, S, causal, mode, rounds, warmup, rep, a_vs_a):
    B, H, q, k, v, do = _inputs(Hd, S)
    anchors = [n for n in ("sdpa_flash", "sdpa_cudnn") if _serves(n, q, k, v, do, causal, mode)]
    assert anchors, f"no SDPA backend runs Hd={Hd} S={S} causal={causal} {mode}"
    ref = IMPLS[anchors[-1]](q, k, v, causal)
    err = (IMPLS["ours"](q, k, v, causal).float() - ref.float()).abs().max().item()
    assert err < 0.05, f"ours differs from {anchors[-1]} by {err} at Hd={Hd} S={S} causal={causal}"
    names = [n for n in IMPLS if (mode == "fwd+bwd" or n != "ours_nondet")
             and (not n.startswith("sdpa") or n in anchors)]
    names += ["ours_again"] if a_vs_a else []
    fns = {n: attention_runner(IMPLS["ours" if n == "ours_again" else n], q, k, v, do, causal, mode)
           for n in names}
    times = alternate(fns, rounds, warmup, rep)
    flops = attention_flops(B, H, S, Hd, causal, mode)
    tflops = {n: flops / statistics.median(t) / 1e9 for n, t in times.items()}
    ratios = {n: median_ratio(times[n], times["ours"]) for n in names if n != "ours"}
    if "ours_nondet" in times and "sdpa_cudnn" in times:
        ratios["nondet_vs_cudnn"] = median_ratio(times["sdpa_cudnn"], times["ours_nondet"])
    return dict(Hd=Hd, S=S, B=B, H=H, causal=causal, mode=mode, tflops=tflops, ratios=ratios)


def host_split(Hd, S, causal, calls=30):
    """fwd+bwd of ours and cuDNN, ms per call: the event time (do_bench), the sum of the GPU
    kernels (torch.profiler), and the host's time to issue a call (``calls`` unsynchronized
    calls, few enough that their launches fit in the GPU's queue: a full queue blocks the host
    and would time the GPU instead). Event > kernels: the GPU waited for launches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    _, _, q, k, v, do = _inputs(Hd, S)
    out = {}
    for name in ("ours", "sdpa_cudnn"):
        fn = attention_runner(IMPLS[name], q, k, v, do, causal, "fwd+bwd")
        event = triton.testing.do_bench(fn, warmup=100, rep=200, return_mode="median")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - start) / calls * 1e3
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        kernels = sum(e.self_device_time_total for e in prof.key_averages()
                      if e.device_type == DeviceType.CUDA) / 20 / 1e3
        out[name] = (event, kernels, host)
    return out


def backward_thread_split(Hd, S, causal, calls=30):
    """Host ms of our backward's Python body (``FlashAttentionFn.backward``) within a fwd+bwd
    call: run by the autograd engine's device thread (the default), by the calling thread
    (``set_multithreading_enabled(False)``), and called directly. The body's work is the same in
    all three; a slower first column is the device thread's wake-up on another core."""
    import threading

    from attention.flash_attn import FlashAttentionFn, attention_backward, attention_forward
    _, _, q, k, v, do = _inputs(Hd, S)
    body, inner = [], FlashAttentionFn.backward

    def timed(ctx, g):
        start = time.perf_counter()
        out = inner(ctx, g)
        body.append((time.perf_counter() - start, threading.get_ident()))
        return out

    def median_body(fn):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        body.clear()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return statistics.median(t for t, _ in body) * 1e3, body[-1][1] == threading.get_ident()

    call = lambda: torch.autograd.grad(flash_attention(q, k, v, causal=causal), (q, k, v), do)  # noqa: E731
    FlashAttentionFn.backward = staticmethod(timed)
    try:
        device_thread = median_body(call)
        with torch.autograd.set_multithreading_enabled(False):
            calling_thread = median_body(call)
    finally:
        FlashAttentionFn.backward = staticmethod(inner)
    assert not device_thread[1] and calling_thread[1], "the threads were not the ones meant"
    o, lse = attention_forward(q, k, v, causal)

    def direct():
        start = time.perf_counter()
        attention_backward(do, q, k, v, o, lse, causal)
        body.append((time.perf_counter() - start, threading.get_ident()))
    return device_thread[0], calling_thread[0], median_body(direct)[0]


def report_sass():
    """HGMMA (Hopper wgmma) count and resource usage of each compiled attention kernel."""
    cache = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    lines = []
    for cubin in sorted(glob.glob(os.path.join(cache, "*", "_attn_*.cubin"))):
        sass = subprocess.run(["cuobjdump", "--dump-sass", cubin], capture_output=True,
                              text=True).stdout
        res = subprocess.run(["cuobjdump", "--dump-resource-usage", cubin], capture_output=True,
                             text=True).stdout
        usage = " ".join(line.strip() for line in res.splitlines() if "REG:" in line)
        lines.append(f"{os.path.basename(cubin)}: HGMMA={sass.count('HGMMA')} "
                     f"HMMA={sass.count('HMMA')} {usage}")
    print("\n".join(lines) if lines else f"no attention cubins under {cache}")
    return lines


# Wider spaces than the library's, tried once to choose the library's (BLOCK_M, BLOCK_N, warps,
# stages) lists; ``--tune`` prints every config's time per kernel.
WIDE = {
    "_attn_fwd_kernel": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 4),
                         (128, 128, 8, 2), (128, 64, 8, 4), (64, 128, 4, 3)],
    "_attn_bwd_dkdv_kernel": [(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 4),
                              (64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 8, 3)],
    "_attn_bwd_dq_kernel": [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
                            (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 8, 3)],
}


# The same for the 256-wide tiles (Hd 129-256): smaller blocks, whose q/k/v tiles and fp32
# accumulators fit registers and shared memory (a config that does not fit is skipped). The
# second space, around the first's winners (bench/results/attention_hd256.md has both); dK/dV
# keeps BLOCK_N a multiple of BLOCK_M (else the band code runs).
WIDE_256 = {
    "_attn_fwd_kernel": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2),
                         (64, 128, 8, 2), (128, 64, 4, 2), (64, 64, 4, 3)],
    "_attn_bwd_dkdv_kernel": [(64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3),
                              (64, 64, 4, 2), (32, 128, 8, 2), (128, 128, 8, 2)],
    "_attn_bwd_dq_kernel": [(64, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4), (128, 32, 4, 3),
                            (64, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2)],
}


def tune_report(cases, spaces):
    """Time every config of ``spaces`` (WIDE or WIDE_256: one tile width) on ``cases``."""
    from attention import flash_attn as fa
    for name, space in spaces.items():
        # the list is of one tile width already; the library's width filter would match the
        # wide configs by value against its own lists
        getattr(fa, name).early_config_prune = None
        getattr(fa, name).configs = [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, bn, w, st in space]
    for Hd, S, causal in cases:
        _, _, q, k, v, do = _inputs(Hd, S)
        torch.autograd.grad(flash_attention(q, k, v, causal=causal), (q, k, v), do)
        for name in WIDE:
            timings = getattr(fa, name).configs_timings
            ranked = sorted(timings.items(), key=lambda kv: kv[1][0] if isinstance(kv[1], list)
                            else kv[1])
            print(f"TUNE Hd={Hd} S={S} causal={causal} {name}: " + "; ".join(
                f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
                f" {t[0] if isinstance(t, list) else t:.3f}ms" for c, t in ranked), flush=True)


def _tiling(Hd, S, causal):
    """The Gluon forward's plan for a row, as the table names it ("Triton" at the head dims the
    Gluon kernels do not take)."""
    head_d = fah.kernel_head_dim(Hd, S, fah.HEAD_DIMS)
    if head_d is None:
        return "Triton"
    plan = fah.plan(head_d, S, causal)
    return ", ".join([f"{plan.warpgroups} WG"] + ["one Q buffer"] * (plan.q_buffers == 1)
                     + ["stream"] * plan.cross_tile
                     + ["half diagonal"] * plan.half_diagonal + ["peeled"] * plan.peel_first)


def to_markdown(rows, args):
    out = header(
        "FlashAttention (Triton, Gluon on Hopper) vs scaled_dot_product_attention", "bench/attention.py",
        f"bf16, MHA, B·S = {TOKENS} tokens, H·Hd = 2048; {args.rounds} rounds "
        f"of do_bench(warmup={args.warmup}, rep={args.rep}) median, alternating implementations",
        "TFLOP/s = FLOPs / median time; FLOPs 4·B·H·S²·Hd fwd, /2 causal, ×3.5 fwd+bwd",
        "ratio = median over rounds of (anchor time / our time): > 1 means ours is faster",
        "ours: on an sm_90 GPU the warp-specialized Gluon kernels run the forward "
        "(attention/flash_attn_hopper.py; its plan in the tiling column: consumer warpgroups, "
        "'stream' where the CTA's tiles run as one stream of block steps, 'half diagonal' where "
        "consumer 0 takes half of a causal diagonal block, 'peeled' where a tile's first key block "
        "skips the P·V of the zero P) and the 5-matmul backward "
        "(attention/flash_attn_hopper_bwd.py; every row here: 64-row query steps at Hd 128, "
        "128-row at Hd 64), deterministic by default; tiling 'Triton': a head dim the Gluon "
        "kernels do not take, where the Triton forward and its dK/dV + dQ backward run",
        "nondet: the backward's opt-in deterministic=False mode (dQ parts added in arrival "
        "order); its ratio to cuDNN in the last column",
    ) + [
        "| Hd | S | B×H | causal | mode | ours | SDPA-FLASH | SDPA-cuDNN | vs FLASH | vs cuDNN |"
        " A-vs-A | nondet vs cuDNN | tiling |",
        "|---:|---:|---:|:---:|:---|---:|---:|---:|---:|---:|---:|---:|:---|",
    ]
    for r in rows:
        t, q = r["tflops"], r["ratios"]
        aa = f"{q['ours_again']:.3f}" if "ours_again" in q else ""
        nd = f"{q['nondet_vs_cudnn']:.2f}" if "nondet_vs_cudnn" in q else ""
        # an anchor that does not run the row (cuDNN past its head dims) reads "n/a"
        fl, cu = (f"{t[n]:.0f}" if n in t else "n/a" for n in ("sdpa_flash", "sdpa_cudnn"))
        vs_fl = f"{q['sdpa_flash']:.2f}" if "sdpa_flash" in q else "n/a"
        vs_cu = f"{q['sdpa_cudnn']:.3f}" if "sdpa_cudnn" in q else "n/a"
        out.append(f"| {r['Hd']} | {r['S']} | {r['B']}×{r['H']} | {'yes' if r['causal'] else 'no'}"
                   f" | {r['mode']} | {t['ours']:.0f} | {fl} | {cu} | {vs_fl} | {vs_cu} | {aa} |"
                   f" {nd} | {_tiling(r['Hd'], r['S'], r['causal'])} |")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="S in {1k, 4k, 16k} only")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--a-vs-a-everywhere", action="store_true",
                   help="time ours against itself on every row (default: the S 4k rows)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--rep", type=int, default=200)
    p.add_argument("--sass", action="store_true")
    p.add_argument("--host", action="store_true",
                   help="print host and GPU-kernel time per fwd+bwd call at S 1k and exit")
    p.add_argument("--tune", action="store_true", help="time the WIDE config spaces and exit")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "attention.md"))
    args = p.parse_args()
    if args.tune:
        if args.head_dims[0] > 128:
            tune_report([(args.head_dims[0], S, causal) for S in (4096, 16384)
                         for causal in (False, True)], WIDE_256)
        else:
            tune_report([(128, 16384, False), (128, 16384, True), (128, 4096, True),
                         (64, 16384, True)], WIDE)
        return
    if args.host:
        print("| Hd | causal | ours event | ours kernels | ours host | cuDNN event | "
              "cuDNN kernels | cuDNN host |\n|---:|:---:|---:|---:|---:|---:|---:|---:|")
        for Hd in args.head_dims:
            for causal in (False, True):
                t = host_split(Hd, 1024, causal)
                print(f"| {Hd} | {'yes' if causal else 'no'} | "
                      + " | ".join(f"{x:.3f}" for n in ("ours", "sdpa_cudnn") for x in t[n]) + " |")
        print("\n| Hd | causal | our backward's body: device thread | calling thread | direct |"
              "\n|---:|:---:|---:|---:|---:|")
        for Hd in args.head_dims:
            for causal in (False, True):
                print(f"| {Hd} | {'yes' if causal else 'no'} | "
                      + " | ".join(f"{x:.3f}" for x in backward_thread_split(Hd, 1024, causal))
                      + " |")
        return
    lengths = [1024, 4096, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384]
    rows = []
    for Hd in args.head_dims:
        for causal in (False, True):
            for S in lengths:
                for mode in args.modes:
                    row = bench_row(Hd, S, causal, mode, args.rounds, args.warmup, args.rep,
                                    a_vs_a=S == 4096 or args.a_vs_a_everywhere)
                    rows.append(row)
                    print(f"Hd={Hd} S={S} causal={causal} {mode}: " + " ".join(
                        f"{n}={v:.0f}" for n, v in row["tflops"].items()) + " | " + " ".join(
                        f"{n}={v:.3f}" for n, v in row["ratios"].items()), flush=True)
    md = to_markdown(rows, args)
    if args.sass:
        md += "\n## SASS check\n\n```\n" + "\n".join(report_sass()) + "\n```\n"
    write_results(args.out, md)


if __name__ == "__main__":
    main()
