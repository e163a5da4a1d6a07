"""A/B of the host-side ceiling division (kernel_floor.cdiv, next_power_of_2) against Triton 3.6's
constexpr functions (the code before), one process: the attention modules' names patched back and
forth. Host µs a fwd+bwd call at Hd 128 S 1k causal (B 16, H 16) issued while the GPU sleeps
(median of 5 rounds × 50 calls), and the bench row's event time against cuDNN (5 alternating
rounds of do_bench(100, 200))."""
import os, statistics, sys, time
import importlib.util
import torch
import triton
import attention.flash_attn as fa
import attention.flash_attn_hopper as fah
import attention.flash_attn_hopper_bwd as fab
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
spec = importlib.util.spec_from_file_location("bench_attention", "bench/attention.py")
ba = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ba)
from common import median_ratio  # noqa: E402

NEW = {m: {n: getattr(m, n) for n in ("cdiv", "next_power_of_2") if hasattr(m, n)} for m in (fa, fah, fab)}
OLD = {m: {n: getattr(triton, n) for n in names} for m, names in NEW.items()}


def use(table):
    for m, names in table.items():
        for n, f in names.items():
            setattr(m, n, f)


B, H, q, k, v, do = ba._inputs(128, 1024)
call = ba._runner(ba.IMPLS["ours"], q, k, v, do, True, "fwd+bwd")
cudnn = ba._runner(ba.IMPLS["sdpa_cudnn"], q, k, v, do, True, "fwd+bwd")
ref = [g.clone() for g in call()]
host = {"old": [], "new": []}
for _ in range(5):
    for name, table in (("old", OLD), ("new", NEW)):
        use(table)
        assert all(torch.equal(a, b) for a, b in zip(call(), ref))
        torch.cuda.synchronize()
        torch.cuda._sleep(300_000_000)
        t0 = time.perf_counter()
        for _ in range(50):
            call()
        host[name].append((time.perf_counter() - t0) / 50 * 1e6)
        torch.cuda.synchronize()


t = {"old": [], "new": [], "cudnn": []}
for _ in range(5):
    for name, table in (("old", OLD), ("new", NEW), ("cudnn", NEW)):
        use(table)
        fn = cudnn if name == "cudnn" else call
        t[name].append(triton.testing.do_bench(fn, warmup=100, rep=200, return_mode="median"))
print("host us/call old", [round(x) for x in host["old"]], "new", [round(x) for x in host["new"]])
print(f"host median old {statistics.median(host['old']):.0f} new {statistics.median(host['new']):.0f} us")
print(f"event ms: old {statistics.median(t['old']):.4f} new {statistics.median(t['new']):.4f} "
      f"cudnn {statistics.median(t['cudnn']):.4f}; cuDNN/old {median_ratio(t['cudnn'], t['old']):.3f} "
      f"cuDNN/new {median_ratio(t['cudnn'], t['new']):.3f} old/new {median_ratio(t['old'], t['new']):.3f}")
