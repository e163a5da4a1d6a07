"""Probe: the Gluon backward with a causal sliding window at Hd 128 (window-bwd.patch).

With ``window=(left, 0)`` the backward runs the Triton kernels: seven matmuls where the Gluon
backward does five (it measured 1.3-1.4x the Triton backward's speed without a window,
bench/results/attention.md). The patch gives the Gluon backward a WINDOW constexpr: a key block's
query blocks end at the one its last key + left reaches (``i_hi``), a dQ block's adders start at
the key block of its first row's first key (``_last_turn``; the ascending walk, nearest key block
first, keeps its order of adds as it is), and a step across the window's left edge is masked.
At Hd 64 that mask spilled (98 spill instructions in the loop, sm_90 compile on CPU): Hd 128
only (``WINDOW_HEAD_DIMS``). The 24 unwindowed backward binaries' SASS is identical to main's.
It applies on top of window-fwd.patch (whose Gluon forward makes the LSE either way).

Decision rule, set before the run: the patch lands if its GPU test passes (``pytest
tests/test_attention.py -k "hopper_backward_window or compile_for_sm90"``) and fwd+bwd with the
Gluon backward is >= 1.05x fwd+bwd with the Triton backward at every row, deterministic (the
default); otherwise it is dropped. The non-deterministic rows are for the record.

What: bf16, MHA, Hd 128, B·S 32k (at 16k the left-511 rows have 1.2-1.3e8 visible scores, under the
Gluon gate's 2^27 = 1.34e8), H 16, causal windows: S 2k (left 511, 1023), 4k (511, 2047),
16k (511, 4095); 5 alternating rounds of do_bench(100, 200): Gluon backward (deterministic),
Triton backward, Gluon backward again, Gluon non-deterministic; the forward is the same in all.

    git apply docs/pending/window-fwd.patch && git apply docs/pending/window-bwd.patch
    PYTHONPATH=. timeout 500 pytest -q tests/test_attention.py -k "hopper_backward_window or compile_for_sm90"
    PYTHONPATH=. python docs/pending/window_bwd.py
"""

import statistics
import sys

import torch
import triton

import attention.flash_attn as fa
from attention import flash_attention

sys.path.append("bench")
from common import alternate, median_ratio  # noqa: E402

TOKENS, HD, H = 32768, 128, 16
GLUON_OK = fa.hopper_backward_ok


def call(q, k, v, do, left, backward):
    """fwd+bwd with the Gluon backward ("det", "nondet") or the Triton one ("triton")."""
    fa.hopper_backward_ok = (lambda *args: False) if backward == "triton" else GLUON_OK
    o = flash_attention(q, k, v, causal=True, window=(left, 0), deterministic=backward != "nondet")
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def main():
    torch.manual_seed(0)
    rows = []
    for S, lefts in ((2048, (511, 1023)), (4096, (511, 2047)), (16384, (511, 4095))):
        for left in lefts:
            B = TOKENS // S
            q, k, v, do = (torch.randn(B, H, S, HD, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=i < 3) for i in range(4))
            assert GLUON_OK(q, k, v, do, True, (left, 0))
            ours, ref = call(q, k, v, do, left, "det"), call(q, k, v, do, left, "triton")
            err = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                      for x, y in zip(ours[1:], ref[1:]))
            repeat = all(torch.equal(x, y) for x, y in zip(ours, call(q, k, v, do, left, "det")))
            fns = {n: (lambda n=n: call(q, k, v, do, left, n)) for n in ("det", "triton")}
            fns["det_again"] = fns["det"]
            fns["nondet"] = lambda: call(q, k, v, do, left, "nondet")
            t = alternate(fns, 5)
            visible = S * (left + 1) - left * (left + 1) / 2  # keys seen, summed over the queries
            flop = 4 * B * H * visible * HD * 3.5
            tflops = {n: flop / statistics.median(t[n]) / 1e9 for n in t}
            row = (f"| {S} | {left} | {tflops['det']:.0f} | {tflops['triton']:.0f} | "
                   f"{tflops['nondet']:.0f} | **{median_ratio(t['triton'], t['det']):.3f}** | "
                   f"{median_ratio(t['triton'], t['nondet']):.3f} | "
                   f"{median_ratio(t['det'], t['det_again']):.3f} | {err:.1e} | {repeat} |")
            print(row, flush=True)
            rows.append(row)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| S | left | Gluon bwd det fwd+bwd TFLOP/s | Triton bwd | Gluon nondet | det / Triton | "
          "nondet / Triton | A-vs-A | max rel diff dq dk dv | det repeats bit-equal |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
