"""Host time of one Triton launch: Triton's ``kernel[grid](...)`` (the anchor) and
``kernel_floor.cached_launch`` (one binary per constexpr set, launched without the JIT's
binding), on a kernel with the row kernels' argument mix (6 tensors, 5 ints, a float, 2
constexprs).

Why: the olmoe_bench step's host time (bench/host_step.py) is ~1.1 s a step for ~21,000
launches, ~4,900 of them Triton's. This bounds what a cheaper Triton launch could save there.

Each round times, for each way in turn, bursts of 256 launches queued behind a GPU sleep (the host
never waits for the GPU: the queue holds them) and keeps the median µs per launch of 15 bursts;
the claim is the median over rounds of anchor / ours, with Triton against itself as the A-vs-A row.

    python bench/launch.py [--rounds 7] [--out bench/results/launch.md]
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.common import header, median_ratio, write_results  # noqa: E402
from kernel_floor import cached_launch  # noqa: E402


def _rows(out_ptr, a_ptr, b_ptr, w_ptr, idx_ptr, cnt_ptr, T, D, stride_a, stride_out, me, scale,
          BLOCK_D: tl.constexpr, HAS_W: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    keep = cols < D
    row = tl.load(idx_ptr + t)
    v = tl.load(a_ptr + row * stride_a + cols, mask=keep, other=0.0)
    v += tl.load(b_ptr + t * D + cols, mask=keep, other=0.0)
    if HAS_W:
        v = v * tl.load(w_ptr + t)
    tl.store(out_ptr + t * stride_out + cols, v * scale + (tl.load(cnt_ptr) + me).to(tl.float32), mask=keep & (t < T))


BURST, BURSTS = 256, 15
NAMES = ["triton_jit", "cached_launch", "triton_jit_again"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="bench/results/launch.md")
    args = ap.parse_args()
    T, D = 64, 256
    a, b, out = (torch.randn(T, D, device="cuda") for _ in range(3))
    w, idx = torch.rand(T, device="cuda"), torch.arange(T, device="cuda")
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    plain = triton.jit(_rows)
    unspecialized = triton.jit(_rows, do_not_specialize=["T", "D", "stride_a", "stride_out", "me"],
                               do_not_specialize_on_alignment=["out_ptr", "a_ptr", "b_ptr", "w_ptr", "idx_ptr",
                                                               "cnt_ptr"])
    launch = (out, a, b, w, idx, cnt, T, D, D, D, 1, 0.5)
    ways = {
        "triton_jit": lambda: plain[(T,)](*launch, BLOCK_D=256, HAS_W=True),
        "cached_launch": lambda: cached_launch(unspecialized, (T,), torch.float32, *launch, BLOCK_D=256, HAS_W=True),
    }
    ways["triton_jit_again"] = ways["triton_jit"]
    want = (a + b) * w[:, None] * 0.5 + 1
    for name, fn in ways.items():  # compile, and check that every way computes the same
        out.zero_()
        fn()
        torch.testing.assert_close(out, want, msg=name)

    def us_per_launch(fn) -> float:
        per = []
        for _ in range(BURSTS):
            torch.cuda.synchronize()
            torch.cuda._sleep(5_000_000)  # ~ms of GPU time: the burst queues behind it
            t0 = time.perf_counter()
            for _ in range(BURST):
                fn()
            per.append((time.perf_counter() - t0) / BURST * 1e6)
        torch.cuda.synchronize()
        return statistics.median(per)

    times = {n: [] for n in NAMES}
    for _ in range(args.rounds):
        for n in NAMES:
            times[n].append(us_per_launch(ways[n]))
    med = {n: statistics.median(v) for n, v in times.items()}
    lines = header("Host time of one Triton launch", "bench/launch.py",
                   f"{args.rounds} rounds, alternating; per way and round the median of {BURSTS} bursts of {BURST} "
                   "launches queued behind a GPU sleep; ratio = median over rounds of Triton's µs / this way's")
    lines += ["| launch | µs per launch (median of rounds) | Triton's ÷ this (median per-round ratio) |",
              "|---|---|---|"]
    for n in NAMES:
        ratio = median_ratio(times["triton_jit"], times[n])
        label = {"triton_jit": "Triton `kernel[grid](...)` (anchor)", "cached_launch": "`cached_launch`",
                 "triton_jit_again": "Triton again (A vs A)"}[n]
        lines.append(f"| {label} | {med[n]:.2f} | {ratio:.2f} |")
    write_results(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
