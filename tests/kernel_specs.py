"""Every Triton kernel of the project compiled for sm_90 on a machine without a GPU, with the
argument types and constexprs it is launched with (tests/test_kernels_compile.py).

Why: on CPU the kernels run in Triton's interpreter, which does not type-check. A kernel that
reassigned a loop-carried variable with another type (an int64 block, then an int1 block) passed
every interpreter test and failed to compile on the GPU ("Loop-carried variable ... has initial
type ... but is re-assigned to ..."). Triton compiles for Hopper without a GPU, so the test
compiles what the interpreter runs.

How, in two processes:

1. The test process (``TRITON_INTERPRET=1``, conftest) runs :func:`exercise`, small calls of
   every launcher (one per dtype / constexpr path worth having), through Triton's interpreter,
   with ``InterpretedFunction.run`` wrapped (:func:`record_interpreter_launches`): each launch's
   kernel, positional arguments and keyword arguments are written down as JSON (:func:`encode`;
   tensors by dtype and 16-byte alignment, ints and floats by value, jit functions and
   ``tl.dtype`` constexprs by name, host tensor descriptors whole).
2. A child process without ``TRITON_INTERPRET`` (``python -m tests.kernel_specs``), where
   ``@triton.jit`` gives real ``JITFunction`` objects and the modules' constants are the GPU's
   (``INTERPRET`` False: row tiles of 1024 columns, the TMA kernels' 128x256 tiles and warp
   specialization, the P2P kernels' spin-waits and traps):

   - turns each recorded launch back into arguments (a small tensor of the dtype and alignment
     stands in for each tensor) and, with ``--replay``, runs :func:`exercise` once more as a GPU
     would launch it (:func:`replay_gpu_launches`: the launchers' own GPU constants, the first
     autotune config that survives each kernel's own pruning with ``MOE_AUTOTUNE=0``, 132 SMs,
     tensor descriptors where 16-byte aligned), with ``JITFunction.run`` recording instead of
     launching;
   - binds every launch through Triton's own binder for an sm_90 target (the JIT's
     specialization: ``i32``/``i64`` by value, 16-divisibility, ``do_not_specialize``, ``None``
     as constexpr), keeps one launch per distinct (signature, constexprs, attributes, options),
     i.e. per binary the JIT would build, and compiles each through Triton's stages up to
     ``--stage`` (default ``ttgir``: the frontend, where type errors are, and the GPU passes,
     pipelining and warp specialization included; ``cubin`` also runs LLVM and ptxas);
   - prints one JSON line (and writes it to ``--out``): per kernel its binaries, what each was
     compiled for, and every failure with its signature, constexprs and error.

Kernels that are not launched on CPU at all are :data:`GPU_ONLY`, each with its reason; every
other ``@triton.jit`` / ``@gluon.jit`` function of the packages that some module launches
(``name[grid](...)`` or ``cached_launch(name, ...)``, found by :func:`launched_kernels`) must be
recorded, or the test lists it.
"""

import ast
import contextlib
import json
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("attention", "kernel_floor", "moe", "parallel", "train")  # pyproject's packages

GPU_ONLY = {
    "moe.kernels.grouped_mm_gluon._grouped_mm_gluon_kernel":
        "Gluon, launched only on an sm_90 GPU (grouped_mm_gluon.gluon_ok needs a.is_cuda); "
        "tests/test_grouped_mm.py::test_gluon_kernel_compiles_for_sm90_without_spills compiles it "
        "for sm_90 on CPU for both b layouts",
    "moe.kernels.grouped_mm_wgrad_gluon._grouped_mm_wgrad_gluon_kernel":
        "Gluon, launched only on an sm_90 GPU (wgrad_gluon_ok needs x.is_cuda); the same test in "
        "tests/test_grouped_mm.py compiles it for sm_90 on CPU",
    "attention.flash_attn_hopper._attn_fwd_hopper_kernel":
        "Gluon, launched only on an sm_90 GPU (flash_attn_hopper.gluon_case needs q.is_cuda); "
        "tests/test_attention.py::test_hopper_kernels_compile_for_sm90_without_spills_or_serialized_wgmma "
        "compiles it for sm_90 on CPU at every tiling it launches",
    "attention.flash_attn_hopper_bwd._attn_bwd_hopper_kernel":
        "Gluon, launched only on an sm_90 GPU (gluon_case needs q.is_cuda); the same test in "
        "tests/test_attention.py compiles it for sm_90 on CPU for every walk, head dim and flag",
}
"""Kernels that no CPU run launches, with the reason; the test checks every entry still names a
launched kernel of the packages."""

STAGES = ("ttir", "ttgir", "llir", "ptx", "cubin")


# ---- which kernels exist and are launched --------------------------------------------------------

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_jit_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return isinstance(target, ast.Attribute) and target.attr == "jit" or (
        isinstance(target, ast.Name) and target.id == "jit")


def launched_kernels(packages=PACKAGES) -> dict[str, str]:
    """``{"module.name": path}`` of every ``@*.jit`` function of ``packages`` that the packages'
    sources launch: subscripted with a grid (``name[...]``) or handed to ``cached_launch``.
    Device functions (called from kernels, or passed to them as constexpr locators) are not
    launched: they compile as part of the kernels that call them."""
    sources, jitted = {}, {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            sources[path] = text
            if ".jit" not in text:
                continue
            for node in ast.parse(text).body:
                if isinstance(node, ast.FunctionDef) and any(_is_jit_decorator(d) for d in node.decorator_list):
                    jitted[f"{_module_name(path)}.{node.name}"] = (node.name, path)
    used = set()  # names subscripted anywhere (kernel[grid]), or launched by cached_launch
    for text in sources.values():
        used.update(re.findall(r"\b([A-Za-z_]\w*)\s*\[", text))
        used.update(re.findall(r"\bcached_launch\(\s*(?:[\w.]+\.)?([A-Za-z_]\w*)", text))
    return {qualified: str(path.relative_to(ROOT)) for qualified, (name, path) in jitted.items() if name in used}


# ---- launches as JSON ----------------------------------------------------------------------------

def _kernel_id(fn) -> str:
    """"module.name" of a JITFunction or the interpreter's stand-in (both keep the Python
    function as ``.fn``)."""
    return f"{fn.fn.__module__}.{fn.fn.__name__}"


def encode(value):
    """A launch argument as JSON."""
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, torch.Tensor):
        return {"t": "tensor", "dtype": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, TensorDescriptor):
        return {"t": "desc", "dtype": str(value.base.dtype).removeprefix("torch."), "shape": list(value.shape),
                "strides": list(value.strides), "block_shape": list(value.block_shape), "padding": value.padding}
    if value is None or isinstance(value, (bool, str)):
        return {"t": "value", "v": value}
    if isinstance(value, int):
        return {"t": "int", "v": int(value)}
    if isinstance(value, float):
        return {"t": "float", "v": value if math.isfinite(value) else repr(value)}
    if isinstance(value, tl.dtype):
        return {"t": "tldtype", "v": value.name}
    if isinstance(value, (tuple, list)):
        return {"t": "tuple", "v": [encode(v) for v in value]}
    if hasattr(value, "fn") and hasattr(value.fn, "__module__") and callable(value.fn):  # a jit function
        return {"t": "jit", "v": _kernel_id(value)}
    raise TypeError(f"cannot record a launch argument of type {type(value).__name__}: {value!r}")


def _resolve(qualified: str):
    import importlib

    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def decode(item):
    """A stand-in argument for a recorded one: what Triton's binder sees is the same (a tensor's
    dtype and 16-byte alignment, an int's value, ...)."""
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    kind = item["t"]
    if kind == "tensor":
        dtype = getattr(torch, item["dtype"])
        return torch.empty(8, dtype=dtype) if item["aligned"] else torch.empty(9, dtype=dtype)[1:]
    if kind == "desc":
        base = torch.empty(8, dtype=getattr(torch, item["dtype"]))
        return TensorDescriptor(base, item["shape"], item["strides"], item["block_shape"], item["padding"])
    if kind in ("value", "int"):
        return item["v"]
    if kind == "float":
        return float(item["v"])
    if kind == "tldtype":
        return tl.dtype(item["v"])
    if kind == "tuple":
        return tuple(decode(v) for v in item["v"])
    if kind == "jit":
        return _resolve(item["v"])
    raise ValueError(f"unknown recorded argument {item!r}")


def _record(log: list, source: str, fn, args, kwargs) -> None:
    log.append({"kernel": _kernel_id(fn), "source": source, "args": [encode(a) for a in args],
                "kwargs": {k: encode(v) for k, v in kwargs.items()}})


@contextlib.contextmanager
def record_interpreter_launches(log: list):
    """Within the block, every interpreter launch (``InterpretedFunction.run``: what
    ``kernel[grid](...)`` reaches, through autotuners and heuristics, with their config and
    values among the keyword arguments) is appended to ``log`` and then runs as usual."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        _record(log, "interpreter", self, args, kwargs)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield log
    finally:
        InterpretedFunction.run = original


# ---- the launches to record ----------------------------------------------------------------------

def _grouped_mm_calls():
    from moe.kernels import grouped_mlp, grouped_mm_triton
    from moe.kernels.master_grad import accumulate_master_grad_, accumulate_wgrad_

    def mm(dtype, activation, I=32, ends=(17, 40), offsets_dtype=torch.int64):
        L, N, M = 2, 64, ends[-1]
        x = torch.randn(M, I, dtype=dtype, requires_grad=True)
        w = (torch.randn(L, I, N) / I ** 0.5).to(dtype).requires_grad_()
        y = grouped_mm_triton(x, w, torch.tensor(ends, dtype=offsets_dtype), activation)
        y.float().sum().backward()

    # 16-byte rows: tensor-descriptor forward and dgrad, the Hopper wgrad (16-bit) or the general
    # one with descriptor loads (fp32); GELU fused with its saved pre-activation; SwiGLU's passes
    for dtype in (torch.bfloat16, torch.float32):
        for activation in (None, "gelu", "swiglu"):
            mm(dtype, activation)
    mm(torch.float16, None, offsets_dtype=torch.int32)
    # the Gluon kernel's tile table (the kernel itself is GPU_ONLY)
    from moe.kernels.grouped_mm_gluon import tile_table
    from moe.kernels.grouped_mm_tma import segment_tiles
    offsets, y = torch.tensor([17, 17, 40], dtype=torch.int32), torch.empty(44, 64, dtype=torch.bfloat16)
    tile_table(offsets, segment_tiles(offsets, y, 44, 64), 44, 64, 3)
    mm(torch.bfloat16, None, ends=(5, 17, 30, 40))  # J = 2L segments: the general wgrad
    mm(torch.bfloat16, "gelu", I=10)  # unaligned rows: the pointer-load kernels
    mm(torch.float32, None, I=10)
    # the expert MLP as one node: weighted SwiGLU, its backward writing h and the weights' gradient
    x = torch.randn(40, 32, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(2, 32, 64) / 6).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(2, 32, 32) / 6).to(torch.bfloat16).requires_grad_()
    w_R = torch.rand(40, requires_grad=True)
    offsets = torch.tensor([17, 40])
    for weights in (w_R, None):
        grouped_mlp(x, w1, w2, offsets, "swiglu", backend="triton", w_R=weights).float().sum().backward()
    # fp32 master gradients: the fused wgrad epilogue (write, then add) and the plain accumulate
    master = torch.zeros(2, 32, 64, requires_grad=True)
    dy = torch.randn(40, 64, dtype=torch.bfloat16)
    for _ in range(2):
        accumulate_wgrad_(master, x.detach(), dy, offsets)
    plain = torch.zeros(3, 5, requires_grad=True)
    for grad in (torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(3, 5)):
        accumulate_master_grad_(plain, grad)
    if not os.environ.get("TRITON_INTERPRET"):
        # the Hopper wgrad's 4-stage pipeline, which needs >= 4 teams of
        # programs: 132 SMs over 4x2 tiles a group (the interpreter's 3 "SMs" never reach it,
        # and at this size its 32x32 tiles would take it seconds)
        from moe.kernels.grouped_mm_wgrad import grouped_mm_wgrad

        grouped_mm_wgrad(torch.randn(64, 512, dtype=torch.bfloat16), torch.randn(64, 512, dtype=torch.bfloat16),
                         torch.tensor([30, 64]), 2)


def _router_calls():
    from moe.kernels.causal_centre import causal_centre_triton
    from moe.kernels.router_mm import router_logits

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(40, 32, dtype=dtype, requires_grad=True)
        w = torch.randn(8, 32, requires_grad=True)
        router_logits(x, w, backend="triton").sum().backward()
    logits = torch.randn(24, 6, requires_grad=True)
    causal_centre_triton(logits, 8).square().sum().backward()
    # the MoE layer's two router paths: softmax with the expert bias (the gradients it gets in
    # training: the scores' broadcast one, the weights', the lse's), sigmoid without
    from moe.kernels.router_topk import router_topk

    logits = torch.randn(40, 64, requires_grad=True)
    scores, _, _, weights, lse, _ = router_topk(logits, torch.randn(64), 8, False, True, 1.0)
    ((scores.sum(0) * torch.randn(64)).sum() + weights.square().sum() + lse.square().sum()).backward()
    scores, _, _, weights, _, _ = router_topk(logits, None, 6, True, False, 2.5)
    weights.square().sum().backward()
    # the losses from the reduced inputs: the training backward (the weighted sum) and every loss's
    from moe.kernels.router_loss import router_losses

    prob, lse = torch.rand(64, requires_grad=True), torch.randn(40, requires_grad=True)
    for use in ((2,), (0, 1, 2)):
        out = router_losses(torch.randint(0, 9, (64,)), prob, torch.tensor(40.0), lse, torch.rand(40), 8, 0.01, 1e-3,
                            backend="triton")
        sum(out[i] for i in use).backward()
    # the dropless plan (E bins) and the capacity plan's packing (E + 1 bins)
    from moe.kernels.expert_sort import sort_by_key

    for bins in (64, 65):
        sort_by_key(torch.randint(0, bins, (300,)), bins, backend="triton")


def _attention_calls():
    from attention.flash_attn import attention_backward, attention_forward, flash_attention
    from attention.rope import apply_rope

    def qkv(dtype, Sq, Sk, Hd, H=2, Hkv=1):
        return (torch.randn(1, H, Sq, Hd, dtype=dtype, requires_grad=True),
                torch.randn(1, Hkv, Sk, Hd, dtype=dtype, requires_grad=True),
                torch.randn(1, Hkv, Sk, Hd, dtype=dtype, requires_grad=True))

    q, k, v = qkv(torch.bfloat16, 40, 40, 16)
    flash_attention(q, k, v, True).float().sum().backward()  # causal, GQA
    q, k, v = qkv(torch.float32, 24, 40, 24)  # the band path: Sq != Sk, a window, BLOCK_D > Hd
    flash_attention(q, k, v, False, window=(8, 4)).sum().backward()
    # a backward whose dO is not 16-byte aligned (the delta kernel's ALIGNED=False)
    q, k, v = (t.detach() for t in qkv(torch.float16, 33, 33, 16))
    o, lse = attention_forward(q, k, v, True)
    do = torch.randn(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    attention_backward(do, q, k, v, o, lse, True)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 5, 3, 16, dtype=dtype, requires_grad=True)
        angle = torch.rand(5, 8)
        apply_rope(x, angle.cos(), angle.sin(), backend="triton").float().sum().backward()


def _loss_calls():
    from train.lm_loss import _softmax_xent_

    for dtype, with_grad in ((torch.bfloat16, True), (torch.float32, False)):
        _softmax_xent_(torch.randn(3, 300, dtype=dtype), torch.tensor([0, 299, 7]), 1 / 3, with_grad)


def _row_calls():
    from moe.kernels.combine import gather_rows, sum_combine, weighted_combine
    from parallel.token_rows import expert_rows, gather_slots, locate_pairs, scatter_slots, write_headers

    T, K, D = 5, 2, 24
    pair_R = torch.tensor([3, 0, 7, 4, 9, 1, 6])  # pairs 2, 5 and 8 have no row
    y = torch.randn(7, D, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(T, K, requires_grad=True)
    weighted_combine(y, pair_R, w, out_dtype=torch.float32, backend="triton").sum().backward()
    sum_combine(y, pair_R, T, K, backend="triton").float().sum().backward()
    gather_rows(torch.randn(T, D), torch.randperm(T * K), K, torch.bfloat16, backend="triton")

    M = 8
    x = torch.randn(T, D, dtype=torch.bfloat16)
    table = torch.tensor([[0, -1], [3, 1], [-1, -1], [7, 2], [5, 6]])
    table_TG = torch.tensor([[1, -1, 0], [-1, 2, -1], [3, -1, -1], [-1, -1, 4], [0, 1, 2]])
    dst = torch.zeros(M, D + 8, dtype=torch.float32)[:, 8:]  # rows apart by more than D
    scatter_slots(x, table, dst, backend="triton")
    a, b = torch.randn(M, D, dtype=torch.bfloat16), torch.randn(M, D, dtype=torch.bfloat16)
    gather_slots(a, table, b, table_TG, out_dtype=torch.float32, backend="triton")
    gather_slots(a, table, out_TD=torch.zeros(T, D + 4, dtype=torch.bfloat16)[:, 4:], backend="triton")
    dest = torch.tensor([[0, 1], [2, 2], [1, 0], [0, 2], [1, 1]])
    sent = torch.tensor([[0, 1, -1], [-1, -1, 2], [3, 4, -1], [5, -1, 6], [-1, 7, -1]])
    header = torch.zeros(M, 2 * K, dtype=torch.int32)  # [places | weights] as the send buffer's view
    write_headers(table, dest, torch.rand(T, K), sent, header[:, :K], header[:, K:].view(torch.float32),
                  backend="triton")
    locate_pairs(torch.tensor([[0, 4], [1, 6], [9, 2], [3, 5], [7, 8]]), torch.tensor([3, 6, 8]), 1,
                 backend="triton")
    counts = torch.tensor([[2, 1, 3], [0, 2, 2], [1, 1, 2]])  # (G, L + 1): pairs per expert, unique rows
    places = torch.tensor([[0, -1], [1, 2], [-1, 0], [1, -1]])
    expert_rows(places, counts, source=1, backend="triton")
    expert_rows(torch.tensor([[0, 1], [2, -1], [0, -1], [1, 3], [0, 1], [1, -1], [0, 1]]), counts,
                backend="triton")
    expert_rows(places.to(torch.int32), counts, blocks=(2, 0), backend="triton")


def _p2p_calls():
    from moe.capacity import plan_routing
    from parallel.p2p_rows import dispatch_rows, expand_rows, push_back, push_rows, signal_peers, sum_returned

    def ptrs(bufs):
        return torch.tensor([t.data_ptr() for t in bufs], dtype=torch.int64)

    def flags():
        return [torch.zeros(1, dtype=torch.int64) for _ in range(G)]

    G, E, K, D, tokens = 2, 4, 2, 24, (3, 2)
    P_cap = max(tokens) * K
    R_cap = G * P_cap
    gen = torch.Generator().manual_seed(0)
    counts = [torch.zeros((G, E), dtype=torch.int64) for _ in range(G)]
    counts_flags, back_flags = flags(), flags()
    T_cap = P_cap // K
    recv = [torch.zeros((G * T_cap, D), dtype=torch.bfloat16) for _ in range(G)]  # token rows
    tok_of = [torch.zeros((R_cap,), dtype=torch.int64) for _ in range(G)]
    src = [torch.full((R_cap,), -1, dtype=torch.int64) for _ in range(G)]
    w_recv = [torch.zeros(R_cap) for _ in range(G)]
    for r, T in enumerate(tokens):  # one pass: each rank routes by the count rows in so far
        plan = plan_routing(torch.rand(T, E, generator=gen).topk(K, dim=-1).indices, torch.rand(T, K, generator=gen),
                            E, None)
        dispatch_rows(torch.randn(T, D, dtype=torch.bfloat16), torch.rand(T, K), plan.order_P, plan.kept_per_expert_E,
                      ptrs(counts), ptrs(counts_flags), torch.tensor([-G]), counts[r], counts_flags[r], ptrs(recv),
                      ptrs(src), ptrs(w_recv), torch.bfloat16, r, K, P_cap, R_cap, ptrs(tok_of),
                      torch.zeros(T_cap * G, dtype=torch.int32), store_rows=r == 0)  # rank 1: the copy engines' mode
    expand_rows(recv[0], tok_of[0], torch.tensor([3], dtype=torch.int32))
    # the copy engines' mode: rank 1's own block read from its tokens
    expand_rows(recv[1], tok_of[1], torch.tensor([3], dtype=torch.int32), torch.randn(2, D, dtype=torch.bfloat16),
                T_cap)
    ret = [torch.zeros((G * P_cap, D)) for _ in range(G)]
    ret_g = [torch.zeros(P_cap) for _ in range(G)]
    src_M = torch.tensor([0, -1, P_cap + 1, 2])  # rank 0 place 0, stays, rank 1 place 1, rank 0 place 2
    back_expected = torch.zeros(1, dtype=torch.int64)
    push_back(torch.randn(4, D), src_M, torch.tensor([4]), ptrs(ret), torch.float32, 1, P_cap, ptrs(back_flags),
              torch.zeros(1, dtype=torch.int64), own_too=True)
    push_back(None, src_M, torch.tensor([3], dtype=torch.int32), ptrs(ret), torch.float32, 0, P_cap,
              ptrs(back_flags), back_expected, torch.rand(4), ptrs(ret_g), num_rows=4)
    rows_TG = torch.tensor([[0, -1], [-1, 1], [2, 3]])
    signal_peers(ptrs(back_flags), back_expected, 1)
    sum_returned(ret[0], rows_TG, torch.bfloat16, back_flags[0], back_expected)
    sum_returned(ret[1], rows_TG, torch.bfloat16, back_flags[1], back_expected, own_MD=torch.randn(G * P_cap, D), me=1)
    grad_rows = [torch.zeros((R_cap, D)) for _ in range(G)]
    push_rows(torch.randn(3, D), torch.tensor([[0, -1], [1, 2], [-1, 3]]), torch.tensor([[0, 0], [1, 0], [0, 1]]),
              ptrs(grad_rows), torch.float32, me=0)


CALLS = (_grouped_mm_calls, _router_calls, _attention_calls, _loss_calls, _row_calls, _p2p_calls)


def exercise() -> None:
    """Small calls of every launcher of the packages, one per dtype / constexpr path worth
    compiling (and, without TRITON_INTERPRET, one that only 132 SMs reach). They must also run
    when the kernels do not (the GPU replay records launches without running them, so outputs
    hold garbage): no call reads a kernel's output on the host to decide what to launch next.
    Leaves ``row_tile_size``'s record of the forward's tiles as it found it."""
    from moe.kernels import grouped_mm_fwd

    ran_block_m = dict(grouped_mm_fwd._ran_block_m)  # what row_tile_size reports: left as it was
    torch.manual_seed(0)
    try:
        for call in CALLS:
            call()
    finally:
        grouped_mm_fwd._ran_block_m.clear()
        grouped_mm_fwd._ran_block_m.update(ran_block_m)


# ---- the child: the GPU's launches, binding, compiling -------------------------------------------

@contextlib.contextmanager
def replay_gpu_launches(log: list):
    """Within the block (a process without TRITON_INTERPRET, MOE_AUTOTUNE=0), CPU tensors are
    launched as on an sm_90 GPU with 132 SMs, and each launch is recorded instead of run:

    - ``JITFunction.run`` records its arguments and returns None (nothing compiles or runs);
    - an autotuner takes the first of its configs that its own pruning keeps (with
      MOE_AUTOTUNE=0 the grouped GEMMs' pruning keeps the first that fits shared memory; the
      attention configs are listed best first);
    - ``kernel_floor.runtime.INTERPRET`` is True: its ``tma_ok`` then accepts 16-byte aligned CPU
      tensors as on Hopper, and ``cached_launch`` launches through ``kernel[grid]``. The other
      modules keep the GPU's values they imported; ``moe.kernels.master_grad.INTERPRET`` (its
      stand-in for "the gradient is on a GPU") is True too;
    - ``sm_count`` is 132 wherever a module imported it.
    """
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    import kernel_floor.runtime as runtime

    if os.environ.get("TRITON_INTERPRET") or os.environ.get("MOE_AUTOTUNE") != "0":
        raise RuntimeError("replay_gpu_launches needs TRITON_INTERPRET unset and MOE_AUTOTUNE=0")
    import moe.kernels.master_grad as master_grad

    def run(self, *args, grid, warmup, **kwargs):
        _record(log, "gpu-replay", self, args, kwargs)

    def autotuned(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        config = (self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs)[0]
        self.best_config = config
        try:
            return self.fn.run(*args, **kwargs, **config.all_kwargs())
        finally:
            self.nargs = None

    original_sm_count = runtime.sm_count
    patched = [(JITFunction, "run", run), (Autotuner, "run", autotuned), (runtime, "INTERPRET", True),
               (master_grad, "INTERPRET", True)]
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in PACKAGES and getattr(module, "sm_count", None) is original_sm_count:
            patched.append((module, "sm_count", lambda device: 132))
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patched]
    for owner, attr, value in patched:
        setattr(owner, attr, value)
    try:
        yield log
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)


def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def bind(launch: dict, backend):
    """(JITFunction, options, signature, constexprs, attrs) as ``JITFunction.run`` computes them
    for this launch on ``backend``'s target."""
    from triton import knobs
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = _resolve(launch["kernel"])
    while not isinstance(fn, JITFunction):  # autotuner / heuristics wrappers: their config is recorded
        fn = fn.fn
    args = [decode(a) for a in launch["args"]]
    kwargs = {k: decode(v) for k, v in launch["kwargs"].items()}
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    return (fn, *fn._pack_args(backend, kwargs, bound, specialization, options))


def compile_to(fn, options, signature, constexprs, attrs, backend, stage: str) -> None:
    """``triton.compile``'s pipeline for sm_90 up to ``stage`` (no cache: always compiled)."""
    from triton._C.libtriton import ir
    from triton.compiler import ASTSource

    target = _target()
    src = ASTSource(fn, signature, constexprs, attrs)
    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    stages = {}
    backend.add_stages(stages, options, src.language)
    metadata = {"hash": "kernel-compile-check", "target": target, **options.__dict__}
    names = list(stages)
    for ext in names[names.index(src.ext):names.index(stage) + 1]:
        module = stages[ext](module, metadata)


def describe(signature: dict, constexprs: dict, options) -> str:
    types = ", ".join(f"{k}: {v}" for k, v in signature.items() if v != "constexpr")
    names = list(signature)
    consts = ", ".join(f"{names[path[0]]}={getattr(v, '__name__', v)}" for path, v in constexprs.items())
    return f"({types}) [{consts}] num_warps={options.num_warps} num_stages={options.num_stages}"


_JOBS: list = []


def _compile_job(index: int):
    fn, options, signature, constexprs, attrs, backend, stage = _JOBS[index]
    start = time.perf_counter()
    try:
        compile_to(fn, options, signature, constexprs, attrs, backend, stage)
        error = None
    except Exception as e:  # noqa: BLE001 - every failure is reported
        error = "".join(traceback.format_exception_only(type(e), e)).strip()
    return index, error, time.perf_counter() - start


def compile_launches(launches: list[dict], stage: str, workers: int) -> dict:
    """Bind every launch, keep one per distinct binary, compile those; the report."""
    import multiprocessing

    from triton.compiler import make_backend

    global _JOBS
    backend = make_backend(_target())
    report = {"stage": stage, "kernels": {}, "failures": [], "launches": len(launches)}
    seen, jobs, about = set(), [], []
    for launch in launches:
        kernel, source = launch["kernel"], launch["source"]
        entry = report["kernels"].setdefault(kernel, {"sources": [], "binaries": 0, "compile_s": 0.0})
        if source not in entry["sources"]:
            entry["sources"].append(source)
        try:
            fn, options, signature, constexprs, attrs = bind(launch, backend)
        except Exception as e:  # noqa: BLE001
            report["failures"].append({"kernel": kernel, "source": source, "what": "bind",
                                       "error": "".join(traceback.format_exception_only(type(e), e)).strip()})
            continue
        key = (kernel, repr(signature), repr(sorted(constexprs.items(), key=repr)), repr(sorted(attrs.items())),
               repr(sorted(options.__dict__.items())))
        if key in seen:
            continue
        seen.add(key)
        jobs.append((fn, options, signature, constexprs, attrs, backend, stage))
        about.append((kernel, source, describe(signature, constexprs, options)))
    _JOBS = jobs
    results = []
    if workers > 1 and len(jobs) > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = list(pool.imap_unordered(_compile_job, range(len(jobs))))
    else:
        results = [_compile_job(i) for i in range(len(jobs))]
    for index, error, seconds in sorted(results):
        kernel, source, what = about[index]
        entry = report["kernels"][kernel]
        entry["binaries"] += 1
        entry["compile_s"] = round(entry["compile_s"] + seconds, 3)
        entry.setdefault("compiled", []).append(f"{source}: {what}")
        if error is not None:
            report["failures"].append({"kernel": kernel, "source": source, "what": what, "error": error[-4000:]})
    return report


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("launches", help="JSON file of recorded launches (a list)")
    parser.add_argument("--replay", action="store_true", help="also record exercise() as a GPU launches it")
    parser.add_argument("--stage", choices=STAGES, default="ttgir")
    parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 4))
    parser.add_argument("--out", help="write the report here (default: the last line of stdout)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    launches = json.loads(Path(args.launches).read_text())
    replayed = []
    if args.replay:
        with replay_gpu_launches(replayed):
            exercise()
    report = compile_launches(launches + replayed, args.stage, args.workers)
    report["seconds"] = round(time.perf_counter() - start, 2)
    text = json.dumps(report)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
