"""Benchmark: the whole ``MoELayer`` (router → routing plan → dispatch → grouped-GEMM SwiGLU
experts → combine, plus the aux losses and stats) against a torchtitan-style layer.

The anchor, as torchtitan's MoE runs it on one GPU: an fp32 router (softmax, top-k, renormalised
weights), an argsort permute of the (token, slot) pairs by expert, ``x[token of pair]``
materialised, ``torch._grouped_mm`` for the two expert GEMMs with PyTorch's ``silu(gate) · up``
between them, the rows scaled by their weights and summed back with ``index_add_`` (fp32), and the
load-balancing loss from the routed counts. Both layers share one set of weights (bf16 experts,
fp32 router), dropless, bf16 input (T, D) of fresh random values; the routing is the router's
own, so group sizes are ragged.

- ``fwd``: one forward; ``fwd+bwd``: ``torch.autograd.grad`` of the output (random dy) for x and
  every weight (fresh gradients: no accumulation into ``.grad`` is timed).
- TFLOP/s count the expert GEMMs only: ``6·T·K·D·F`` forward (SwiGLU: ``4·D·F`` + ``2·F·D`` a
  row), three times that forward+backward; the router's ``2·T·D·E`` is left out of both.
- Saved activations: the bytes autograd keeps for the backward (``saved_tensors_hooks``, each
  storage counted once, parameters excluded), per token.
- Protocol: ``bench/common.py`` (alternating rounds of do_bench, median ratio, A-vs-A row).

    python bench/moe_layer.py [--rounds 5] [--shapes OLMoE ...] [--profile OLMoE]
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))
from common import alternate, header, median_ratio, write_results  # noqa: E402

from moe import MoELayer  # noqa: E402

# name, experts E, model dim D, expert hidden F, tokens T, top-k K
SHAPES = [
    ("Mixtral", 8, 4096, 14336, 16384, 2),
    ("OLMoE", 64, 2048, 1024, 16384, 8),
    ("Qwen3-A3B", 128, 2048, 768, 16384, 8),
    ("DeepSeek-V3", 256, 7168, 2048, 8192, 8),
    ("SonicMoE", 128, 4096, 1024, 32768, 8),
]


class TorchtitanStyleMoE(torch.nn.Module):
    """The anchor; reads the weights of ``layer`` (a :class:`MoELayer`), holds none of its own."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        self.layer = layer
        self.top_k = layer.config.top_k

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_w = self.layer.router.weight
        w1_EDU, w2_EFD = self.layer.experts.w1_LDU, self.layer.experts.w2_LFD
        E, K = router_w.shape[0], self.top_k
        scores_TE = F.linear(x_TD.float(), router_w).softmax(-1)
        weights_TK, experts_TK = scores_TE.topk(K, dim=-1)
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        counts_E = torch.bincount(experts_TK.flatten(), minlength=E)
        lb_loss = E * (counts_E.float() / experts_TK.numel() * scores_TE.mean(0)).sum()
        order_P = experts_TK.flatten().argsort(stable=True)
        token_P = order_P // K
        offsets_E = counts_E.cumsum(0).to(torch.int32)
        z_PU = torch._grouped_mm(x_TD[token_P], w1_EDU, offs=offsets_E)
        gate, up = z_PU.chunk(2, dim=-1)
        y_PD = torch._grouped_mm(F.silu(gate) * up, w2_EFD, offs=offsets_E)
        y_PD = y_PD.float() * weights_TK.flatten()[order_P, None]
        out_TD = torch.zeros(x_TD.shape, device=x_TD.device, dtype=torch.float32).index_add_(0, token_P, y_PD)
        return out_TD.to(x_TD.dtype), lb_loss


def ours_forward(layer):
    def fwd(x_TD):
        out, aux = layer.forward_with_aux(x_TD)
        return out, aux.load_balancing_loss
    return fwd


def saved_bytes(fn, x_TD, params) -> int:
    """Bytes of the distinct storages autograd saves for the backward of ``fn(x_TD)``, params out."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs and s.device.type == "cuda":
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x_TD)
    del out
    return sum(seen.values())


def _setup(E, D, F_, T, K):
    """A dropless bf16 layer (seeded), its differentiable weights, a random input and output gradient."""
    torch.manual_seed(0)
    layer = MoELayer(D, F_, E, K, capacity_factor=None, device="cuda", dtype=torch.bfloat16)
    params = [layer.router.weight, layer.experts.w1_LDU, layer.experts.w2_LFD]
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    return layer, params, x_TD, dy_TD


def bench_shape(name, E, D, F_, T, K, rounds):
    layer, params, x_TD, dy_TD = _setup(E, D, F_, T, K)
    anchor = TorchtitanStyleMoE(layer)
    impls = {"ours": ours_forward(layer), "anchor": anchor}

    with torch.no_grad():
        (o, lb_o), (a, lb_a) = impls["ours"](x_TD), anchor(x_TD)
    err = ((o.float() - a.float()).norm() / a.float().norm()).item()
    assert err < 2e-2 and abs(lb_o.item() - lb_a.item()) < 1e-3, f"{name}: ours vs anchor rel err {err}"

    def fwd(f):
        return lambda: f(x_TD)

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(x_TD)[0], [x_TD, *params], dy_TD)

    rows = []
    gemm_flops = 6 * T * K * D * F_
    for mode, make, flops in (("fwd", fwd, gemm_flops), ("fwd+bwd", fwd_bwd, 3 * gemm_flops)):
        fns = {"ours": make(impls["ours"]), "anchor": make(anchor), "ours_again": make(impls["ours"])}
        times = alternate(fns, rounds)
        rows.append(dict(
            shape=name, mode=mode, E=E, D=D, F=F_, T=T, K=K,
            ours=flops / statistics.median(times["ours"]) / 1e9,
            anchor=flops / statistics.median(times["anchor"]) / 1e9,
            ratio=median_ratio(times["anchor"], times["ours"]),
            a_vs_a=median_ratio(times["ours_again"], times["ours"]),
            ms=statistics.median(times["ours"]), err=err,
        ))
    for impl in ("ours", "anchor"):
        rows[0][f"saved_{impl}"] = saved_bytes(impls[impl], x_TD, params) / T
    del layer, anchor
    return rows


def profile_shape(name, E, D, F_, T, K, top=25):
    """Per-kernel GPU time of ours, fwd+bwd, so the layer's non-GEMM share is visible."""
    from torch.profiler import ProfilerActivity, profile
    layer, params, x_TD, dy_TD = _setup(E, D, F_, T, K)
    step = lambda: torch.autograd.grad(layer(x_TD), [x_TD, *params], dy_TD)  # noqa: E731
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    totals = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            totals[ev.name] = totals.get(ev.name, 0.0) + ev.device_time / 5 / 1e3
    whole = sum(totals.values())
    lines = [f"### Kernels of ours, {name}, fwd+bwd ({whole:.2f} ms of kernels a step)", "",
             "| kernel | ms | share |", "| --- | ---: | ---: |"]
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| `{k[:90]}` | {v:.3f} | {100 * v / whole:.1f}% |")
    return lines


def to_markdown(rows, args, profiles):
    out = header(
        "The whole MoE layer vs a torchtitan-style layer", "bench/moe_layer.py",
        "bf16 experts, fp32 router, dropless, softmax top-k renormalised; routing from the router "
        "(ragged groups); anchor: argsort permute + x[idx] + torch._grouped_mm SwiGLU + index_add_",
        f"{args.rounds} rounds of do_bench(warmup=100, rep=200) median, alternating ours / anchor / "
        "ours again; ratio = median over rounds of t_anchor / t_ours (> 1: ours faster)",
        "TFLOP/s of the expert GEMMs only (6·T·K·D·F fwd, ×3 fwd+bwd); saved = activation bytes "
        "autograd keeps for the backward, per token (parameters excluded)",
    )
    out += ["| shape | E | D→F | T | K | mode | ours TFLOP/s | anchor TFLOP/s | ours / anchor | A-vs-A "
            "| ours ms | saved B/token ours | saved B/token anchor | rel err |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        saved = (f"{r['saved_ours']:.0f} | {r['saved_anchor']:.0f}" if "saved_ours" in r else " | ")
        out.append(f"| {r['shape']} | {r['E']} | {r['D']}→{r['F']} | {r['T']} | {r['K']} | {r['mode']} | "
                   f"{r['ours']:.0f} | {r['anchor']:.0f} | {r['ratio']:.3f}x | {r['a_vs_a']:.3f} | "
                   f"{r['ms']:.3f} | {saved} | {r['err']:.1e} |")
    for p in profiles:
        out += [""] + p
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    p.add_argument("--profile", nargs="*", default=[], help="shapes to profile kernel by kernel")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "moe_layer.md"))
    args = p.parse_args()
    by_name = {s[0]: s for s in SHAPES}
    rows = []
    for name in args.shapes:
        rows += bench_shape(*by_name[name], args.rounds)
        for r in rows[-2:]:
            print(f"{r['shape']} {r['mode']}: ours {r['ours']:.0f} anchor {r['anchor']:.0f} TFLOP/s "
                  f"ratio {r['ratio']:.3f} A-vs-A {r['a_vs_a']:.3f}", flush=True)
        torch.cuda.empty_cache()
    profiles = [profile_shape(*by_name[n]) for n in args.profile]
    write_results(args.out, to_markdown(rows, args, profiles))


if __name__ == "__main__":
    main()
