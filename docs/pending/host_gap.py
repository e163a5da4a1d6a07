"""Where the GPU waits in a fwd+bwd call at Hd 128 S 1k causal: the bench row (5 rounds), the
--host split, then a torch.profiler timeline of do_bench's loop body (L2 clear, fn) for ours and
cuDNN: every GPU kernel with its start, duration and the idle gap before it, and the host events
(launches, the backward's body) on their threads, in one clock."""
import os, statistics, sys
import importlib.util
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
spec = importlib.util.spec_from_file_location("bench_attention", "bench/attention.py")  # run from the repo root
ba = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ba)
from common import alternate, median_ratio  # noqa: E402

Hd, S, causal = 128, 1024, True
B, H, q, k, v, do = ba._inputs(Hd, S)
fns = {n: ba._runner(ba.IMPLS[n], q, k, v, do, causal, "fwd+bwd") for n in ("ours", "sdpa_cudnn")}
t = alternate(fns, 5, 100, 200)
print("ratio cuDNN/ours", round(median_ratio(t["sdpa_cudnn"], t["ours"]), 3),
      {n: round(statistics.median(x), 4) for n, x in t.items()}, flush=True)
print(ba.host_split(Hd, S, causal), flush=True)
cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
for name, fn in fns.items():
    for _ in range(20):
        cache.zero_(); fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(6):
            cache.zero_(); fn()
        torch.cuda.synchronize()
    ev = prof.events()
    gpu = sorted([e for e in ev if e.device_type == DeviceType.CUDA], key=lambda e: e.time_range.start)
    keep = ("Launch", "FlashAttention", "Backward", "evaluate_function", "autograd::engine")
    cpu = sorted([e for e in ev if e.device_type == DeviceType.CPU and any(s in e.name for s in keep)],
                 key=lambda e: e.time_range.start)
    fills = [e for e in gpu if "fill" in e.name.lower()]
    t0 = (fills[3] if len(fills) > 3 else gpu[len(gpu) // 2]).time_range.start
    print(f"== {name}: GPU kernels from the 4th L2 clear (us, relative)")
    prev_end = None
    rows = []
    for e in gpu:
        if e.time_range.start < t0 - 1:
            prev_end = e.time_range.end
            continue
        if e.time_range.start > t0 + 2500:
            break
        gap = e.time_range.start - prev_end if prev_end is not None else 0
        rows.append((e.time_range.start - t0, "GPU", e.name[:60], e.time_range.end - e.time_range.start, gap))
        prev_end = e.time_range.end
    for e in cpu:
        if t0 - 1500 <= e.time_range.start <= t0 + 2500:
            rows.append((e.time_range.start - t0, f"CPU{e.thread % 1000}", e.name[:60],
                         e.time_range.end - e.time_range.start, 0))
    for r in sorted(rows):
        print(f"{r[0]:9.1f} {r[1]:7s} {r[3]:8.1f} gap {r[4]:7.1f}  {r[2]}")
    busy = {}
    for e in gpu:
        busy[e.name[:40]] = busy.get(e.name[:40], 0) + (e.time_range.end - e.time_range.start) / 6
    print("per call, GPU us:", {k_: round(v_, 1) for k_, v_ in busy.items()}, flush=True)
