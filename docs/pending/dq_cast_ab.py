"""Probe: the deterministic backward's dQ finished in the kernel (this tree: once a block's last
add has landed, the writer loads it back, the consumers turn it into q's dtype a step later, the
writer stores it) against the kernel before it (``flash_attn_hopper_bwd_base.py``, a copy of
890a4cd's: every block reduce-added into the fp32 accumulator, then a separate cast pass),
fwd+bwd.

Why: the cast pass reads the fp32 accumulator from HBM and writes dq (6 bytes an element, 48 µs of
a 660 µs fwd+bwd at Hd 128 S 1k causal on an H200, bench/results/attention.md) and costs a launch;
the last adder of each dQ block has the block's final sum in reach (L2) and can store it in q's
dtype itself.

What: at each bench row shape (Hd 128 and 64, causal and not, S 1k / 4k / 16k; B·S 16,384, H 16 /
32, bf16), the bits of dq, dk, dv of both (the sum per element is the same additions in the same
order, so they must be equal), then base / finish / cuDNN / base again, 7 alternating rounds of
do_bench(warmup=100, rep=200), fwd+bwd.

    git show 890a4cd:attention/flash_attn_hopper_bwd.py > docs/pending/flash_attn_hopper_bwd_base.py
    PYTHONPATH=. python docs/pending/dq_cast_ab.py
"""

import importlib.util
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention.flash_attn as fa
from attention import flash_attention

sys.path.append("bench")
from common import alternate, median_ratio  # noqa: E402

spec = importlib.util.spec_from_file_location("fab_base", "docs/pending/flash_attn_hopper_bwd_base.py")
fab_base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fab_base)
finish_backward = fa.hopper_backward


def grads(q, k, v, do, causal, backward):
    fa.hopper_backward = backward
    try:
        return torch.autograd.grad(flash_attention(q, k, v, causal=causal), (q, k, v), do)
    finally:
        fa.hopper_backward = finish_backward


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    torch.manual_seed(0)
    table = []
    for Hd in (128, 64):
        for causal in (True, False):
            for S in (1024, 4096, 16384):
                H, B = (16 if Hd == 128 else 32), 16384 // S
                q, k, v, do = (torch.randn(B, H, S, Hd, device="cuda", dtype=torch.bfloat16,
                                           requires_grad=i < 3) for i in range(4))
                base = grads(q, k, v, do, causal, fab_base.hopper_backward)
                finish = grads(q, k, v, do, causal, finish_backward)
                same = all(torch.equal(a, b) for a, b in zip(base, finish))

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    return torch.autograd.grad(o, (q, k, v), do)
                fns = {"base": lambda: grads(q, k, v, do, causal, fab_base.hopper_backward),
                       "finish": lambda: grads(q, k, v, do, causal, finish_backward), "cudnn": cudnn}
                fns["base_again"] = fns["base"]
                t = alternate(fns, rounds)
                table.append((Hd, S, causal, statistics.median(t["base"]), statistics.median(t["finish"]),
                              median_ratio(t["base"], t["finish"]), median_ratio(t["cudnn"], t["base"]),
                              median_ratio(t["cudnn"], t["finish"]), median_ratio(t["base"], t["base_again"]),
                              same))
                print(table[-1], flush=True)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| Hd | S | causal | base ms | finish ms | finish speed | base vs cuDNN | finish vs cuDNN | A-vs-A | same bits |")
    print("|---:|---:|:---:|---:|---:|---:|---:|---:|---:|:---:|")
    for Hd, S, causal, b, f, sp, bc, fc, aa, same in table:
        print(f"| {Hd} | {S} | {'yes' if causal else 'no'} | {b:.4f} | {f:.4f} | {sp:.3f} | {bc:.3f} | {fc:.3f} |"
              f" {aa:.3f} | {same} |")


if __name__ == "__main__":
    main()
