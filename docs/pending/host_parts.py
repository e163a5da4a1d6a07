"""Host µs of each part of our fwd+bwd's Python at Hd 128 S 1k causal (B 16, H 16), the backward
body run by autograd's device thread (as in the bench) and by the calling thread
(set_multithreading_enabled(False)): the body below is attention_backward's Hopper path, step
by step, with a clock read between steps; medians over 200 calls, GPU kept ahead by a sleep."""
import statistics, threading, time
import torch
import attention.flash_attn as fa
import attention.flash_attn_hopper_bwd as fab
from attention.flash_attn_hopper import hopper_forward_ok

parts = {}
def mark(marks, name):
    marks.append((name, time.perf_counter_ns()))

def body(do, q, k, v, o, lse, causal, scale):
    m = [("start", time.perf_counter_ns())]
    do = fa._last_dim_contiguous(do)
    B, H, Sq, Hd = q.shape
    scale = 1.0 / fa.math.sqrt(Hd) if scale is None else float(scale)
    mark(m, "shapes")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    mark(m, "empty_like x3")
    q.numel() == 0
    delta = torch.empty_like(lse)
    mark(m, "delta alloc")
    ok = fab.hopper_backward_ok(q, k, v, do, causal, None)
    mark(m, "backward_ok")
    sem = fab.hopper_turn_counters(q)
    mark(m, "turn counters")
    launch = fab.hopper_backward(do, q, k, v, lse, delta, sem, dq, dk, dv, causal, scale, scale * fa._LOG2E)
    mark(m, "hopper_backward prep")
    fa._delta(o, do, delta, sem)
    mark(m, "delta launch")
    out = launch()
    mark(m, "bwd launch + dq copy")
    assert ok
    for (_, t0), (name, t1) in zip(m, m[1:]):
        parts.setdefault((threading.get_ident() == MAIN, name), []).append((t1 - t0) / 1e3)
    parts.setdefault((threading.get_ident() == MAIN, "body total"), []).append((m[-1][1] - m[0][1]) / 1e3)
    return out

class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        m = [("start", time.perf_counter_ns())]
        fa._check_inputs(q, k, v, True, None)
        mark(m, "fwd checks")
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[1], q.shape[2], device=q.device, dtype=torch.float32)
        mark(m, "fwd allocs")
        ok = hopper_forward_ok(q, k, v, True, None)
        mark(m, "fwd ok")
        fa.hopper_forward(q, k, v, o, lse, True, q.shape[3] ** -0.5 * fa._LOG2E)
        mark(m, "fwd plan+launch")
        ctx.save_for_backward(q, k, v, o, lse)
        mark(m, "save_for_backward")
        assert ok
        for (_, t0), (name, t1) in zip(m, m[1:]):
            parts.setdefault((True, name), []).append((t1 - t0) / 1e3)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return body(do, q, k, v, o, lse, True, None)

MAIN = threading.get_ident()
B, H, S, Hd = 16, 16, 1024, 128
q, k, v, do = (torch.randn(B, H, S, Hd, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3) for i in range(4))
ref = torch.autograd.grad(fa.flash_attention(q, k, v, causal=True), (q, k, v), do)
got = torch.autograd.grad(Fn.apply(q, k, v), (q, k, v), do)
assert all(torch.equal(a, b) for a, b in zip(ref, got)), "the probe's body is not attention_backward's"
calls = []
for threads in (True, False):
    with torch.autograd.set_multithreading_enabled(threads):
        for rnd in range(4):
            parts.clear() if rnd == 0 else None
            torch.cuda._sleep(200_000_000)  # ~0.1 s: the host issues ahead of the GPU
            for _ in range(50):
                t0 = time.perf_counter_ns()
                torch.autograd.grad(Fn.apply(q, k, v), (q, k, v), do)
                calls.append((("call", "whole call"), (time.perf_counter_ns() - t0) / 1e3))
            torch.cuda.synchronize()
    for key, t in calls:
        parts.setdefault(key, []).append(t)
    calls.clear()
    print(f"== backward on {'device thread' if threads else 'calling thread'}")
    for (main, name), t in parts.items():
        where = {True: "main", False: "dev"}.get(main, "")
        print(f"  {name:24s} {where:5s} median {statistics.median(t):7.1f} us  p10 {sorted(t)[len(t) // 10]:7.1f}")
    parts.clear()
