"""Probe: the Gluon backward with a causal sliding window at Hd 128 and 64 (window-bwd.patch).

With ``window=(left, 0)`` the backward runs the Triton kernels: seven matmuls where the Gluon
backward does five (it measured 1.3-1.4x the Triton backward's speed without a window,
bench/results/attention.md). The patch gives the Gluon backward a WINDOW constexpr: a key block's
query blocks end at the one its last key + left reaches (``i_hi``), a dQ block's adders start at
the key block of its first row's first key (``_last_turn``; the ascending walk, nearest key block
first, keeps its order of adds as it is), and a step across either edge of the window is masked
by one unsigned compare, 0 <= query - key <= left (as two masks it spilled at Hd 64: 98 spill
instructions in the loop; none now, sm_90 compile on CPU). The patch dispatches Hd 128
(``WINDOW_HEAD_DIMS``); Hd 64 is timed here with the dispatch widened. The unwindowed backward
binaries' SASS is identical to main's (36, Hd 64/128/256). It applies on top of
window-fwd.patch (the LSE it reads is the same from either forward; at Hd 64 the forward is
Triton's).

Decision rule, set before the run: the patch lands if the Hd 128 and Hd 96 cases of its GPU test
pass (``pytest tests/test_attention.py -k hopper_backward_window``) and fwd+bwd with the Gluon
backward is >= 1.05x fwd+bwd with the Triton backward at every Hd 128 row, deterministic (the
default); otherwise it is dropped. Hd 64 joins ``WINDOW_HEAD_DIMS`` if its own cases of the GPU
test pass and its rows clear the same bar (>= 1.05x at every Hd 64 row). The non-deterministic
rows are for the record.

What: bf16, MHA, Hd 128 then 64, B·S 32k (at 16k the left-511 rows have 1.2-1.3e8 visible
scores, under the Gluon gate's 2^27 = 1.34e8), H 16, causal windows: S 2k (left 511, 1023),
4k (511, 2047), 16k (511, 4095); 5 alternating rounds of do_bench(100, 200): Gluon backward
(deterministic), Triton backward, Gluon backward again, Gluon non-deterministic (Hd 128 only); the
forward is the same in all.

    git apply docs/pending/window-fwd.patch && git apply docs/pending/window-bwd.patch
    PYTHONPATH=. timeout 270 pytest -q tests/test_attention.py -k hopper_backward_window
    PYTHONPATH=. python docs/pending/window_bwd.py
"""

import statistics
import sys

import torch
import triton

import attention.flash_attn as fa
import attention.flash_attn_hopper_bwd as fab
from attention import flash_attention

sys.path.append("bench")
from common import alternate, median_ratio  # noqa: E402

TOKENS, H = 32768, 16
GLUON_OK = fa.hopper_backward_ok


def call(q, k, v, do, left, backward):
    """fwd+bwd with the Gluon backward ("det", "nondet") or the Triton one ("triton")."""
    fa.hopper_backward_ok = (lambda *args: False) if backward == "triton" else GLUON_OK
    o = flash_attention(q, k, v, causal=True, window=(left, 0), deterministic=backward != "nondet")
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def main():
    torch.manual_seed(0)
    fab.WINDOW_HEAD_DIMS = (64, 128)  # Hd 64's rows (the patch dispatches Hd 128)
    rows = []
    for HD in (128, 64):
        for S, lefts in ((2048, (511, 1023)), (4096, (511, 2047)), (16384, (511, 4095))):
            for left in lefts:
                rows.append(timed_row(HD, S, left, nondet=HD == 128))
                print(rows[-1], flush=True)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| Hd | S | left | Gluon bwd det fwd+bwd TFLOP/s | Triton bwd | Gluon nondet | "
          "det / Triton | nondet / Triton | A-vs-A | max rel diff dq dk dv | "
          "det repeats bit-equal |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    print("\n".join(rows))


def timed_row(HD, S, left, nondet):
    """One table row: fwd+bwd TFLOP/s and ratios, the Gluon backward against the Triton one."""
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
    if nondet:
        fns["nondet"] = lambda: call(q, k, v, do, left, "nondet")
    t = alternate(fns, 5)
    visible = S * (left + 1) - left * (left + 1) / 2  # keys seen, summed over the queries
    flop = 4 * B * H * visible * HD * 3.5
    tflops = {n: flop / statistics.median(t[n]) / 1e9 for n in t}
    nd = (f"{tflops['nondet']:.0f}", f"{median_ratio(t['triton'], t['nondet']):.3f}") if nondet \
        else ("-", "-")
    return (f"| {HD} | {S} | {left} | {tflops['det']:.0f} | {tflops['triton']:.0f} | {nd[0]} | "
            f"**{median_ratio(t['triton'], t['det']):.3f}** | {nd[1]} | "
            f"{median_ratio(t['det'], t['det_again']):.3f} | {err:.1e} | {repeat} |")


if __name__ == "__main__":
    main()
