"""Probe: the Gluon backward at Hd 256 (bwd-hd256.patch), against the Triton backward and cuDNN.

At Hd 256 the backward runs the Triton kernels (seven matmuls, 0.65-0.76x cuDNN's fwd+bwd with
the Triton forward, bench/results/attention_hd256.md); the forward is the Gluon kernel since
b29cd88 (0.986-1.054x cuDNN). The patch runs the Gluon backward there in FlashAttention-3's Hd
256 tiling: 64 keys a CTA, the two consumer warpgroups splitting the head dim of dK and dV (64
registers each a thread) and the query rows of Sᵀ and dPᵀ, with Pᵀ and dSᵀ through shared memory
(double-buffered), one Q/dO stage, no in-kernel dQ finish: 230,332 bytes of shared memory, 168
registers, no spill, no serialized wgmma (sm_90 compile on CPU, 2026-12-04). The Hd 64 / 128
binaries' SASS is identical to main's (24 of them).

Decision rule, set before the run: the patch lands if its GPU tests pass (``pytest
tests/test_attention.py -k "hopper_backward and 256"``) and fwd+bwd with the Gluon backward
(deterministic, the default) is >= 1.05x fwd+bwd with the Triton backward at every row below;
otherwise it is dropped. cuDNN and the non-deterministic mode are timed for the record.

What: bf16, MHA, Hd 256, B·S 16k, H 8, fwd+bwd, S 1k / 4k / 16k, causal and not (at S 1k non-causal
B·H·S² = 2^27, the gate's edge; causal needs B·S 32k there, so that row runs B 32); 5 alternating
rounds of do_bench(100, 200): Gluon det, Triton, cuDNN, Gluon nondet, Gluon det again.

    git apply docs/pending/bwd-hd256.patch
    PYTHONPATH=. timeout 500 pytest -q tests/test_attention.py -k "hopper_backward and 256"
    PYTHONPATH=. python docs/pending/hd256_bwd.py
"""

import statistics
import sys

import torch
import triton
from torch.nn.attention import SDPBackend

import attention.flash_attn as fa
from attention import flash_attention

sys.path.append("bench")
from common import alternate, attention_flops, attention_runner, median_ratio, sdpa  # noqa: E402

HD, H, TOKENS = 256, 8, 16384
GLUON_OK = fa.hopper_backward_ok


def ours(q, k, v, do, causal, backward):
    """fwd+bwd, the Gluon backward ("det", "nondet") or the Triton one ("triton")."""
    fa.hopper_backward_ok = (lambda *args: False) if backward == "triton" else GLUON_OK
    o = flash_attention(q, k, v, causal, deterministic=backward != "nondet")
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def main():
    torch.manual_seed(0)
    rows = []
    for causal in (False, True):
        for S in (1024, 4096, 16384):
            B = max(1, TOKENS // S) * (2 if causal and S == 1024 else 1)
            q, k, v, do = (torch.randn(B, H, S, HD, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=i < 3) for i in range(4))
            assert GLUON_OK(q, k, v, do, causal, None), (S, causal)
            a, b = ours(q, k, v, do, causal, "det"), ours(q, k, v, do, causal, "triton")
            err = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                      for x, y in zip(a[1:], b[1:]))
            repeat = all(torch.equal(x, y) for x, y in zip(a, ours(q, k, v, do, causal, "det")))
            fns = {n: (lambda n=n: ours(q, k, v, do, causal, n)) for n in ("det", "triton")}
            fns["cudnn"] = attention_runner(sdpa(SDPBackend.CUDNN_ATTENTION), q, k, v, do, causal,
                                            "fwd+bwd")
            fns["nondet"] = lambda: ours(q, k, v, do, causal, "nondet")
            fns["det_again"] = fns["det"]
            t = alternate(fns, 5)
            flop = attention_flops(B, H, S, HD, causal, "fwd+bwd")
            tf = {n: flop / statistics.median(t[n]) / 1e9 for n in t}
            row = (f"| {S} | {'yes' if causal else 'no'} | {B} | {tf['det']:.0f} | "
                   f"{tf['triton']:.0f} | {tf['cudnn']:.0f} | {tf['nondet']:.0f} | "
                   f"**{median_ratio(t['triton'], t['det']):.3f}** | "
                   f"{median_ratio(t['cudnn'], t['det']):.3f} | "
                   f"{median_ratio(t['triton'], t['nondet']):.3f} | "
                   f"{median_ratio(t['det'], t['det_again']):.3f} | {err:.1e} | {repeat} |")
            print(row, flush=True)
            rows.append(row)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| S | causal | B | Gluon bwd det fwd+bwd TFLOP/s | Triton bwd | cuDNN | Gluon nondet | "
          "det / Triton | det vs cuDNN | nondet / Triton | A-vs-A | max rel diff dq dk dv | "
          "det repeats bit-equal |")
    print("|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
