"""Triton grouped matmul (forward, activation backward, dgrad, wgrad) against the reference.

On CPU the Triton kernels run through the interpreter (conftest sets TRITON_INTERPRET=1) at
small sizes in fp32/fp16; on a GPU the same checks run compiled in bf16 at larger sizes.
Every check compares with the float64 reference on fresh random inputs, by relative
Frobenius error, and requires padding rows (at or past offsets[-1]) to be exactly zero in the
output and the input gradient.
"""

import pytest
import torch

from moe.kernels import DEFAULT_BLOCK_M, grouped_mlp, grouped_mm, grouped_mm_reference, grouped_mm_triton, row_tile_size
from moe.kernels.activation import activation_backward, swiglu_forward
from moe.kernels.grouped_mm_fwd import grouped_mm_kernel
from kernel_floor import tma_ok, use_tensor_descriptors
from moe.kernels.grouped_mm_wgrad import grouped_mm_wgrad, grouped_mm_wgrad_kernel, wgrad_configs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Relative Frobenius error allowed against the float64 reference, per operand dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}

ACTIVATIONS = [None, "swiglu", "gelu"]


def _offsets(sizes, device, dtype=torch.int64):
    return torch.tensor(sizes, device=device).cumsum(0).to(dtype)


def _rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(sizes, padding, I, N, activation, dtype, device=DEVICE, offsets_dtype=torch.int64, num_groups=None):
    """Forward and both gradients of the Triton path against the float64 reference. ``sizes``
    are the row segments; with ``num_groups`` L, segment s uses weight s % L."""
    L = len(sizes) if num_groups is None else num_groups
    M = sum(sizes) + padding
    offsets = _offsets(sizes, device, offsets_dtype)
    x = torch.randn(M, I, device=device).to(dtype)
    w = (torch.randn(L, I, N, device=device) / I**0.5).to(dtype)
    n_out = N // 2 if activation == "swiglu" else N
    dy = torch.randn(M, n_out, device=device).to(dtype)  # padding rows of dy are not zero

    x_ref = x.detach().double().requires_grad_()
    w_ref = w.detach().double().requires_grad_()
    y_ref = grouped_mm_reference(x_ref, w_ref, offsets, activation)
    y_ref.backward(dy.double())  # the reference keeps the graph even when every group is empty

    x.requires_grad_()
    w.requires_grad_()
    y = grouped_mm_triton(x, w, offsets, activation)
    y.backward(dy)

    tol = TOLERANCE[dtype]
    end = sum(sizes)
    assert y.shape == (M, n_out) and y.dtype == dtype
    assert (y[end:] == 0).all(), "padding rows of y must be zero"
    assert (x.grad[end:] == 0).all(), "padding rows of dx must be zero"
    assert _rel_err(y[:end], y_ref[:end]) < tol
    assert _rel_err(x.grad[:end], x_ref.grad[:end]) < tol
    for g in range(L):
        if sum(sizes[g::L]) == 0:
            assert (w.grad[g] == 0).all(), f"empty group {g} must get dw = 0"
        else:
            assert _rel_err(w.grad[g], w_ref.grad[g]) < tol, f"dw of group {g}"


# Group layouts: random sizes with 0 and 1, one group holding every row, all groups empty.
CPU_CASES = {
    "mixed": ([5, 0, 1, 37, 0, 20], 7),
    "one_group": ([0, 70, 0], 0),
    "all_empty": ([0, 0], 5),
}


# (I, N): neither is a multiple of the interpreter's 16/32 blocks. (40, 54): rows of 108 bytes
# in fp16, not 16-byte aligned, so the pointer-load path; (56, 80): aligned, tensor descriptors.
CPU_IN = {"pointer_loads": (40, 54), "tensor_descriptors": (56, 80)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", list(CPU_CASES))
@pytest.mark.parametrize("loads", list(CPU_IN))
def test_matches_reference(loads, case, activation, dtype):
    sizes, padding = CPU_CASES[case]
    I, N = CPU_IN[loads]
    _check(sizes, padding, I=I, N=N, activation=activation, dtype=dtype)


def _mlp_chain_and_fused(sizes, padding, I, F, dtype, device=DEVICE, num_groups=None, grads=(True, True, True)):
    """The SwiGLU expert MLP as two GroupedMMFn nodes and as one GroupedSwiGLUMLPFn node:
    (outputs, then the gradients of those of x, w1, w2 flagged in ``grads``) of each, and the
    bytes each graph saves for the backward. ``num_groups`` L: segment s uses weight s % L."""
    L = len(sizes) if num_groups is None else num_groups
    M = sum(sizes) + padding
    offsets = _offsets(sizes, device)
    x = torch.randn(M, I, device=device).to(dtype)
    w1 = (torch.randn(L, I, 2 * F, device=device) / I**0.5).to(dtype)
    w2 = (torch.randn(L, F, I, device=device) / F**0.5).to(dtype)
    dy = torch.randn(M, I, device=device).to(dtype)
    results = []
    for fused in (False, True):
        leaves = [t.detach().clone().requires_grad_(g) for t, g in zip((x, w1, w2), grads)]
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if fused:
                y = grouped_mlp(leaves[0], leaves[1], leaves[2], offsets, "swiglu", backend="triton")
            else:
                h = grouped_mm_triton(leaves[0], leaves[1], offsets, "swiglu")
                y = grouped_mm_triton(h, leaves[2], offsets)
        wanted = [t for t in leaves if t.requires_grad]
        results.append((y, *torch.autograd.grad(y, wanted, dy), sum(saved.values())))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_fused_swiglu_mlp_equals_the_chain_and_keeps_no_h(case, dtype):
    """One node, same bits as the two-node chain, and M·F·itemsize fewer saved bytes (no h)."""
    sizes, padding = CPU_CASES[case]
    I, F = 56, 40
    chain, fused = _mlp_chain_and_fused(sizes, padding, I, F, dtype)
    for name, a, b in zip(("y", "dx", "dw1", "dw2"), chain[:4], fused[:4]):
        assert torch.equal(a, b), name
    M = sum(sizes) + padding
    assert chain[4] - fused[4] == M * F * torch.finfo(dtype).bits // 8


@pytest.mark.parametrize("grads", [(False, True, True), (True, False, False), (False, False, True)])
def test_fused_swiglu_mlp_segments_and_partial_gradients(grads):
    """J = G·L segments (rows by source rank) and only some inputs needing a gradient: still the
    chain's bits."""
    chain, fused = _mlp_chain_and_fused([3, 0, 17, 9, 1, 12], 5, 56, 40, torch.float16, num_groups=2, grads=grads)
    assert len(chain) == len(fused) == 2 + sum(grads)
    for a, b in zip(chain[:-1], fused[:-1]):
        assert torch.equal(a, b)


def test_activation_backward_returns_the_forward_activation():
    z = torch.randn(37, 2 * 24, device=DEVICE, dtype=torch.float16)
    dh = torch.randn(37, 24, device=DEVICE, dtype=torch.float16)
    dz, h = activation_backward(z, dh, "swiglu", return_h=True)
    assert torch.equal(h, swiglu_forward(z))
    assert torch.equal(dz, activation_backward(z, dh, "swiglu"))
    w = torch.rand(37, device=DEVICE)
    dzw, hw, dw = activation_backward(z, dh, "swiglu", return_h=True, w_M=w)
    assert torch.equal(hw, swiglu_forward(z, w))
    dzw2, dw2 = activation_backward(z, dh, "swiglu", w_M=w)
    assert torch.equal(dzw, dzw2) and torch.equal(dw, dw2)
    with pytest.raises(ValueError, match="return_h and w_M are for swiglu only"):
        activation_backward(z, z, "gelu", return_h=True)
    with pytest.raises(ValueError, match="w_M must be a contiguous fp32"):
        activation_backward(z, dh, "swiglu", w_M=w.half())
    with pytest.raises(ValueError, match="w_M must be a contiguous fp32"):
        swiglu_forward(z, w[:36])


@pytest.mark.parametrize("F", [24, 300])
def test_row_weighted_activation_backward_matches_float64(F):
    """The weights' gradient is a sum over the whole row: F = 300 spans three column blocks."""
    z = torch.randn(45, 2 * F, device=DEVICE, dtype=torch.float16)
    dh = torch.randn(45, F, device=DEVICE, dtype=torch.float16)
    w = torch.rand(45, device=DEVICE)
    dz, h, dw = activation_backward(z, dh, "swiglu", return_h=True, w_M=w)
    z64, dh64 = z.double().requires_grad_(), dh.double()
    w64 = w.double().requires_grad_()
    h64 = torch.nn.functional.silu(z64[:, :F]) * z64[:, F:]
    (h64 * w64[:, None]).backward(dh64)
    assert _rel_err(h, h64 * w64[:, None]) < TOLERANCE[torch.float16]
    assert _rel_err(dz, z64.grad) < TOLERANCE[torch.float16]
    assert _rel_err(dw, w64.grad) < 1e-5  # fp32 sums of products of the 16-bit inputs


def _weighted_mlp_reference(x, w1, w2, offsets, w_R):
    """float64 ``(swiglu(x @ w1[g]) · w_R) @ w2[g]`` through plain autograd."""
    h = grouped_mm_reference(x, w1, offsets, "swiglu") * w_R[:, None]
    return grouped_mm_reference(h, w2, offsets)


@pytest.mark.parametrize("backend", ["triton", "reference"] + (["triton_bf16"] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_row_weighted_mlp_matches_reference(case, backend):
    """``grouped_mlp(..., w_R=)``: the output rows times their weight, and every gradient (x, w1,
    w2 and w_R) against float64, on the fused Triton node and the reference chain. Weights with
    exact zeros and a wide range; padding rows get zero output, dx and dw_R."""
    sizes, padding = CPU_CASES[case]
    I, F, L = 56, 40, len(sizes)
    M, end = sum(sizes) + padding, sum(sizes)
    dtype = {"triton": torch.float16, "triton_bf16": torch.bfloat16, "reference": torch.float32}[backend]
    backend = backend.removesuffix("_bf16")
    offsets = _offsets(sizes, DEVICE)
    x = torch.randn(M, I, device=DEVICE).to(dtype)
    w1 = (torch.randn(L, I, 2 * F, device=DEVICE) / I**0.5).to(dtype)
    w2 = (torch.randn(L, F, I, device=DEVICE) / F**0.5).to(dtype)
    w_R = torch.rand(M, device=DEVICE) * torch.logspace(-3, 0, M, device=DEVICE)
    w_R[::5] = 0.0
    dy = torch.randn(M, I, device=DEVICE).to(dtype)
    refs = [t.detach().double().requires_grad_() for t in (x, w1, w2, w_R)]
    y_ref = _weighted_mlp_reference(*refs[:3], offsets, refs[3])
    y_ref.backward(dy.double())
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, w_R)]
    y = grouped_mlp(*leaves[:3], offsets, "swiglu", backend=backend, w_R=leaves[3])
    y.backward(dy)
    tol = TOLERANCE[dtype]
    assert y.dtype == dtype and (y[end:] == 0).all() and (leaves[0].grad[end:] == 0).all()
    assert (leaves[3].grad[end:] == 0).all(), "padding rows must get dw_R = 0"
    if end:
        assert _rel_err(y[:end], y_ref[:end]) < tol
        for name, a, r in zip(("dx", "dw1", "dw2", "dw_R"), leaves, refs):
            assert _rel_err(a.grad, r.grad) < tol, name


def test_row_weights_checked():
    x = torch.randn(6, 8, device=DEVICE)
    w = torch.randn(1, 8, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"w_R must be a contiguous fp32 \(6,\) tensor"):
        grouped_mlp(x, w, w[:, :4], _offsets([6], DEVICE), "swiglu", w_R=torch.ones(5, device=DEVICE))


def test_block_multiples_int32_offsets():
    # I and N multiples of the blocks (the unmasked I/N paths), int32 offsets.
    _check([33, 0, 64, 1], 3, I=64, N=128, activation="swiglu", dtype=torch.float16,
           offsets_dtype=torch.int32)


def test_wgrad_one_team_walks_several_tiles_per_group():
    # I = N = 128: in the interpreter, 16 dw tiles per group on 3 programs, so the group-major
    # wgrad runs one team whose programs each take several tiles of a group (the flattened tile
    # loop); compiled on a GPU the same check runs with one program per SM.
    _check([33, 0, 64, 1], 5, I=128, N=128, activation=None, dtype=torch.float16)


@pytest.mark.parametrize("loads", list(CPU_IN))
def test_segments_share_weights(loads):
    # 3 source ranks x 2 weight groups: segment s uses w[s % 2]; group 1 gets rows only from
    # its last segment, one segment holds a single row.
    I, N = CPU_IN[loads]
    _check([9, 0, 1, 0, 30, 17], 4, I=I, N=N, activation="swiglu", dtype=torch.float16, num_groups=2)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_all_segments_empty_keeps_the_graph(activation):
    """Rows but no segment (a rank that received nothing, padding only): zeros that still
    depend on x and w, on both paths, so the backward reaches the dispatch on every rank (its
    exchange is collective)."""
    offsets = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    for fn in (grouped_mm_reference, grouped_mm_triton):
        x = torch.randn(5, 16, device=DEVICE).to(torch.float16).requires_grad_()
        w = torch.randn(2, 16, 32, device=DEVICE).to(torch.float16).requires_grad_()
        y = fn(x, w, offsets, activation)
        assert y.requires_grad and not y.detach().any()
        y.sum().backward()
        assert not x.grad.any() and not w.grad.any()


def test_segments_must_be_a_multiple_of_the_groups():
    x = torch.randn(10, 8, device=DEVICE).to(torch.float16)
    w = torch.randn(2, 8, 6, device=DEVICE).to(torch.float16)
    with pytest.raises(ValueError, match="offsets_J"):
        grouped_mm_triton(x, w, _offsets([4, 3, 3], DEVICE))
    with pytest.raises(ValueError, match="offsets_J"):
        grouped_mm_reference(x, w, _offsets([4, 3, 3], DEVICE))
    with pytest.raises(ValueError, match="offsets_J"):
        grouped_mm_wgrad(x, torch.randn(10, 6, device=DEVICE).to(torch.float16), _offsets([4, 3, 3], DEVICE), 2)


def test_row_tile_size_reports_the_launched_config():
    assert row_tile_size(12345, 678, torch.float16) == DEFAULT_BLOCK_M
    x = torch.randn(50, 24, device=DEVICE).to(torch.float16)
    w = torch.randn(3, 24, 34, device=DEVICE).to(torch.float16)
    grouped_mm_triton(x, w, _offsets([10, 0, 40], DEVICE), "swiglu")
    assert row_tile_size(24, 34, torch.float16) == grouped_mm_kernel.best_config.kwargs["BLOCK_M"]


def test_auto_backend_on_cpu_is_the_reference():
    x = torch.randn(20, 8)
    w = torch.randn(2, 8, 6)
    offsets = _offsets([7, 10], "cpu")
    torch.testing.assert_close(grouped_mm(x, w, offsets, "gelu"), grouped_mm_reference(x, w, offsets, "gelu"),
                               rtol=0, atol=0)


def test_launcher_rejects_bad_arguments():
    x = torch.randn(10, 8, device=DEVICE).to(torch.float16)
    w = torch.randn(2, 8, 6, device=DEVICE).to(torch.float16)
    offsets = _offsets([4, 6], DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        grouped_mm_triton(x.float(), w, offsets)
    with pytest.raises(ValueError, match="offsets_J"):
        grouped_mm_triton(x, w, offsets[:1])
    with pytest.raises(ValueError, match="swiglu"):
        grouped_mm_triton(x, w[:, :, :5], offsets, "swiglu")
    with pytest.raises(ValueError, match="backend"):
        grouped_mm(x, w, offsets, backend="cuda")


def grouped_mm_wgrad_reference(x_MI, dy_MN, offsets_J):
    """dw[g] = x_gᵀ @ dy_g, group by group."""
    bounds = [0] + offsets_J.tolist()
    return torch.stack([x_MI[a:b].t() @ dy_MN[a:b] for a, b in zip(bounds[:-1], bounds[1:])])


def _check_bf16_dw(dw, x, dy, offsets, sizes, label=""):
    """bf16 dw against the float64 reference, group by group; empty groups exactly zero."""
    ref = grouped_mm_wgrad_reference(x.double(), dy.double(), offsets)
    for g, size in enumerate(sizes):
        if size == 0:
            assert (dw[g] == 0).all(), f"empty group {g} must get dw = 0{label}"
        else:
            assert _rel_err(dw[g], ref[g]) < TOLERANCE[torch.bfloat16], f"dw of group {g}{label}"


GPU_CASES = {
    "mixed": ([300, 0, 1, 1200, 0, 77, 513, 2], 129),
    "one_group": ([0, 2500, 0], 0),
    "many_small": ([0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 0, 1] * 4, 31),
}


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_bf16_matches_reference(case, activation):
    sizes, padding = GPU_CASES[case]
    # I=520, N=2*300: not multiples of 64/128.
    _check(sizes, padding, I=520, N=600, activation=activation, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_bf16_segments_share_weights(activation):
    # 4 source ranks x 3 weight groups: rows by source rank, each block by weight group.
    sizes = [300, 0, 77, 1, 513, 0, 0, 129, 2, 640, 0, 5]
    _check(sizes, 17, I=520, N=600, activation=activation, dtype=torch.bfloat16, num_groups=3)


@pytest.mark.gpu
def test_gpu_fused_swiglu_mlp_equals_the_chain():
    chain, fused = _mlp_chain_and_fused([300, 0, 1, 517, 129], 40, 512, 384, torch.bfloat16)
    for name, a, b in zip(("y", "dx", "dw1", "dw2"), chain[:4], fused[:4]):
        assert torch.equal(a, b), name
    assert chain[4] - fused[4] == (300 + 1 + 517 + 129 + 40) * 384 * 2


@pytest.mark.gpu
def test_gpu_bf16_block_multiples_int32_offsets():
    _check([700, 0, 1, 1347], 64, I=1024, N=1536, activation="swiglu", dtype=torch.bfloat16,
           offsets_dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(wgrad_configs())))
def test_gpu_every_wgrad_config_matches_reference(index):
    """Each wgrad config, launched directly (autotuning would only check the one that wins)."""
    import triton
    config = wgrad_configs()[index]
    sizes, padding = GPU_CASES["many_small"]
    offsets = _offsets(sizes, "cuda", torch.int32)
    M, I, N = sum(sizes) + padding, 520, 600
    x = torch.randn(M, I, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    dw = torch.full((len(sizes), I, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    tiles = len(sizes) * triton.cdiv(I, config.kwargs["BLOCK_K"]) * triton.cdiv(N, config.kwargs["BLOCK_N"])
    grid = (min(tiles, 7) if config.kwargs["PERSISTENT"] else tiles,)
    use_tensor_descriptors()
    grouped_mm_wgrad_kernel.fn[grid](
        x, dy, offsets, dw, N, I, len(sizes), len(sizes), x.stride(0), dy.stride(0), dw.stride(0), dw.stride(1),
        DOT_PRECISION="tf32", TMA_OK=tma_ok(x, dy, dw), num_warps=config.num_warps,
        num_stages=config.num_stages, **config.kwargs)
    _check_bf16_dw(dw, x, dy, offsets, sizes, f" ({config})")


@pytest.mark.gpu
@pytest.mark.parametrize("I, N, sizes, deep", [
    (520, 600, GPU_CASES["many_small"][0], True),  # 15 tiles per group: 8 teams
    (4096, 2048, [700, 0, 1, 1347], False),  # 256 tiles per group: 3 teams
])
def test_gpu_wgrad_tma_both_pipelines(I, N, sizes, deep):
    """The Hopper wgrad's 4-stage pipeline (many teams) and its 3-stage one."""
    from moe.kernels.grouped_mm_wgrad_tma import wgrad_tma_plan
    assert wgrad_tma_plan(len(sizes), I, N, torch.device("cuda"))[2] is deep
    from moe.kernels.grouped_mm_wgrad_tma import grouped_mm_wgrad_tma
    offsets = _offsets(sizes, "cuda", torch.int32)
    x = torch.randn(sum(sizes) + 9, I, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(x.shape[0], N, device="cuda", dtype=torch.bfloat16)
    dw = torch.full((len(sizes), I, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped_mm_wgrad_tma(x, dy, offsets, dw)  # directly: its own kernel, whatever the routing
    _check_bf16_dw(dw, x, dy, offsets, sizes)


@pytest.mark.gpu
def test_gpu_no_host_sync():
    sizes, padding = GPU_CASES["mixed"]
    offsets = _offsets(sizes, "cuda", torch.int32)
    x = torch.randn(sum(sizes) + padding, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(len(sizes), 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(x.shape[0], 256, device="cuda", dtype=torch.bfloat16)
    grouped_mm(x, w, offsets, "swiglu").backward(dy)  # compile and autotune first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_mm(x, w, offsets, "swiglu").backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _tile_walk(sizes, N, L, tile_m, tile_n, band):
    """The Triton TMA kernel's tile order written out in Python: (first row, column tile, weight
    group, rows left) per tile, segments in turn, bands of ``band`` m-tiles within each."""
    tiles, start, n_tiles = [], 0, -(-N // tile_n)
    for s, rows in enumerate(sizes):
        m_tiles = -(-rows // tile_m)
        for band_start in range(0, m_tiles, band):
            in_band = min(m_tiles - band_start, band)
            for tile_n_ in range(n_tiles):
                for tile_m_ in range(band_start, band_start + in_band):
                    tiles.append((start + tile_m_ * tile_m, tile_n_, s % L, rows - tile_m_ * tile_m))
        start += rows
    return tiles


@pytest.mark.parametrize("sizes, padding, N, L", [
    ([0, 5, 33, 0, 64, 1, 70, 0], 3, 70, 4),  # ragged tails, empty segments, J = 2L
    ([0, 0, 200, 0], 0, 32, 4),  # every row to one group: 7 m-tiles, bands of 2
    ([0, 0, 0], 9, 40, 3),  # no rows at all: no tiles
    ([3] * 37, 1, 96, 37),  # 37 segments: a 6-step search
])
def test_tile_table_matches_the_walk(sizes, padding, N, L):
    """The Gluon kernel's per-call tile table (``tile_table``) lists the Triton kernel's tiles in
    its order; CPU runs it in the interpreter at its small tiles (the GPU equality test checks
    the rest: the Gluon kernel's output, bit for bit, on the GPU's tiles)."""
    from moe.kernels.grouped_mm_gluon import tile_table
    from moe.kernels.grouped_mm_tma import TILE_M, TILE_N, _GROUP_M, segment_tiles
    M = sum(sizes) + padding
    offsets = _offsets(sizes, DEVICE, torch.int32)
    y = torch.full((M, N), float("nan"), device=DEVICE)
    tile_end = segment_tiles(offsets, y, M, N)
    table = tile_table(offsets, tile_end, M, N, L)
    expected = _tile_walk(sizes, N, L, TILE_M, TILE_N, _GROUP_M)
    assert int(tile_end[-1]) == len(expected) <= table.shape[0]
    assert table[:len(expected)].tolist() == [list(t) for t in expected]
    assert (y[sum(sizes):] == 0).all()  # the padding rows, zeroed by the same launch


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon grouped GEMM is sm_90's")
@pytest.mark.parametrize("sizes, padding, I, N, b_trans, dtype, programs", [
    ([0, 1, 127, 128, 129, 300, 0, 64], 5, 200, 264, False, torch.bfloat16, 3),  # k chunks 4, ragged
    ([0, 1, 127, 128, 129, 300, 0, 64], 5, 200, 264, True, torch.bfloat16, 2),  # dgrad's b
    ([700, 0, 1, 1347], 0, 64, 512, False, torch.float16, 2),  # one k chunk
    ([0, 0, 2500, 0], 16, 192, 256, True, torch.bfloat16, 3),  # every row to one group, 3 chunks
    ("random", 7, 192, 256, False, torch.bfloat16, None),  # J = 260 segments over 130 groups
    ([0, 0, 0, 0], 16, 64, 256, False, torch.bfloat16, 2),  # no rows: no tiles
    ([1, 64, 2, 63, 0, 5, 64, 30] * 8 + [200], 3, 64, 512, False, torch.bfloat16, 1),  # one CTA,
    # one k chunk: consumer 1 idle on tile after tile (nothing of its rows in the segment), a
    # whole ring ahead of consumer 0
    ([1, 64, 2, 63, 0, 5, 64, 30] * 8 + [200], 3, 64, 512, True, torch.bfloat16, 1),
])
def test_gpu_gluon_equals_tma_kernel(sizes, padding, I, N, b_trans, dtype, programs):
    """The Gluon kernel writes the Triton TMA kernel's output bit for bit, every element (both
    outputs start as NaN). Few CTAs walk every tile, so each consumer reuses its store buffer
    after TMA stores and masked ones alike, and the ring wraps many times."""
    from moe.kernels.grouped_mm_gluon import grouped_mm_gluon
    from moe.kernels.grouped_mm_tma import grouped_mm_tma
    if sizes == "random":
        sizes = torch.randint(0, 300, (260,)).tolist()
    L = len(sizes) // 2 if len(sizes) == 260 else len(sizes)
    M = sum(sizes) + padding
    offsets = _offsets(sizes, "cuda", torch.int32)
    a = torch.randn(M, I, device="cuda").to(dtype)
    if b_trans:
        b = (torch.randn(L, N, I, device="cuda") / I**0.5).to(dtype).transpose(1, 2)
    else:
        b = (torch.randn(L, I, N, device="cuda") / I**0.5).to(dtype)
    y_tma, y_gluon = (torch.full((M, N), float("nan"), device="cuda", dtype=dtype) for _ in range(2))
    use_tensor_descriptors()
    grouped_mm_tma(a, b, offsets, y_tma, None, 0)
    grouped_mm_gluon(a, b, offsets, y_gluon, programs=programs)
    assert torch.equal(y_gluon.view(torch.int16), y_tma.view(torch.int16))
    ref = grouped_mm_reference(a.double(), b.double(), offsets)
    assert _rel_err(y_gluon, ref) < TOLERANCE[dtype]


_GLUON_SM90 = """
import json, re, sys
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
import moe.kernels.grouped_mm_gluon as g
import moe.kernels.grouped_mm_wgrad_gluon as w
from tests.sm90 import compile_sm90, cuobjdump, map_cases


def resources(case):
    kind, b_trans, name = case
    short = "bf16" if name == "bfloat16" else "fp16"

    def desc(block):
        layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, name))
        return f"tensordesc<{short}[{','.join(map(str, block))}],{layout!r}>"
    if kind == "fwd":
        signature = {"a_desc": desc([g.TILE_M, g.BLOCK_K]), "y_desc": desc([g.WG_M, g.TILE_N]),
                     "b_desc": desc([1, g.TILE_N, g.BLOCK_K] if b_trans else [1, g.BLOCK_K, g.TILE_N]),
                     "y_ptr": f"*{short}", "table_ptr": "*i32", "tile_end_ptr": "*i32", "S": "i32",
                     "capacity": "i32", "N": "i32", "K": "i32", "stride_ym": "i32"}
        constexprs = {"B_TRANS": b_trans, "STAGES": g.STAGES}
        fn, pointers = g._grouped_mm_gluon_kernel, (3, 4, 5)
    else:  # b_trans: the weight gradient's EPILOGUE (0: 16-bit TMA store, 1: fp32 store, 2: fp32 add)
        signature = {"x_desc": desc([1, 1, w.BLOCK_M, w.WG_M]), "dy_desc": desc([1, 1, w.BLOCK_M, w.BLOCK_N]),
                     "dw_desc": "constexpr" if b_trans else desc([1, w.WG_M, w.BLOCK_N]),
                     "dw_ptr": "*fp32" if b_trans else f"*{short}", "offsets_ptr": "*i32", "G": "i32", "K": "i32",
                     "N": "i32"}
        constexprs = {"BLOCK_K": w.BLOCK_K, "BLOCK_N": w.BLOCK_N, "STAGES": w.FP32_STAGES if b_trans else w.STAGES,
                      "EPILOGUE": b_trans, **({"dw_desc": None} if b_trans else {})}
        # dw_ptr, offsets_ptr, and K, N: the JIT marks ints divisible by 16 so, as the shapes are
        fn, pointers = w._grouped_mm_wgrad_gluon_kernel, (3, 4, 6, 7)
    constexprs.update({"CONSUMER_REGS": g.CONSUMER_REGS, "PRODUCER_REGS": g.PRODUCER_REGS})
    signature.update({k: "constexpr" for k in constexprs})
    # the pointers as the JIT sees torch's allocations: 16-byte aligned (and the wgrad's sizes)
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}
    kernel, _ = compile_sm90(GluonASTSource(fn, signature, constexprs, attrs=attrs),
                             {"num_warps": 4, "maxnreg": g.MAX_NREG})
    ptx = kernel.asm["ptx"]
    usage = cuobjdump(kernel, "--dump-resource-usage")
    return [int(re.search(r"STACK:(\\d+)", usage).group(1)), "setmaxnreg" in ptx,
            ptx.count("st.global.v4"), ptx.count("st.global.b16"), kernel.metadata.shared,
            ptx.count("tensormap.cp_fenceproxy"), kernel.metadata.global_scratch_size,
            ptx.count("st.global.v2.b32"), ptx.count("ld.global.v2.b32")]


print(json.dumps(map_cases(resources, json.loads(sys.argv[1]))))
"""


def _wgrad_operands(sizes, padding, I, N, dtype):
    """The Gluon weight-gradient tests' operands on the GPU: group sizes ("random": 130 of 0-299
    rows), their int32 offsets, and x (M, I), dy (M, N) with ``padding`` rows of NaN past the
    groups (were they read, they would poison dw)."""
    if sizes == "random":
        sizes = torch.randint(0, 300, (130,)).tolist()
    offsets = _offsets(sizes, "cuda", torch.int32)
    x = torch.randn(sum(sizes) + padding, I, device="cuda").to(dtype)
    dy = torch.randn(x.shape[0], N, device="cuda").to(dtype)
    x[sum(sizes):], dy[sum(sizes):] = float("nan"), float("nan")
    return sizes, offsets, x, dy


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon grouped GEMM is sm_90's")
@pytest.mark.parametrize("sizes, padding, I, N, dtype, programs", [
    ([0, 1, 63, 64, 65, 300, 0, 129], 9, 200, 264, torch.bfloat16, 3),  # ragged chunks and tiles
    ([700, 0, 1, 1347], 0, 64, 512, torch.float16, 2),  # half a row tile
    ([0, 0, 2500, 0], 16, 384, 256, torch.bfloat16, None),  # every row to one group
    ("random", 7, 192, 256, torch.bfloat16, None),  # 130 groups of 2 tiles: a new group each tile
    ([1, 0, 2, 70, 5, 64, 3] * 20, 0, 256, 512, torch.bfloat16, 7),  # tiny groups: a new group
    # every few chunks, the ring holding chunks of two or three groups at once
    ([3000, 5, 0, 1200], 3, 1024, 520, torch.bfloat16, 3),  # 24 tiles a group: each CTA stays
    # in a group for about 8 tiles, then moves on
    ([1, 0, 2, 70, 5, 64, 3] * 4, 0, 256, 512, torch.bfloat16, 1),  # one CTA walks every tile
    ([3000, 5, 70, 0, 1200], 3, 1024, 520, torch.bfloat16, 5),  # 5 CTAs stay in a group 4 or 5
    # tiles and enter groups at different offsets
    ([0, 300, 1, 64], 0, 1024, 520, torch.bfloat16, 4),  # every CTA's first group empty
    ([16, 17, 32, 33, 48, 49, 64 + 17, 128 + 33, 0, 1], 5, 200, 264, torch.bfloat16, 3),  # a last
    # chunk at each edge of the 16-row steps it is trimmed to: a step dropped loses real rows
])
def test_gpu_gluon_wgrad_matches_reference(sizes, padding, I, N, dtype, programs):
    """The Gluon weight gradient against the float64 reference on NaN-poisoned dw (every element
    written), empty groups exactly zero; padding rows (NaN in x and dy) and the next group's rows
    in a ragged chunk (the ragged view's row bound) contribute nothing."""
    from moe.kernels.grouped_mm_wgrad_gluon import grouped_mm_wgrad_gluon
    from moe.kernels.grouped_mm_wgrad_tma import grouped_mm_wgrad_tma
    sizes, offsets, x, dy = _wgrad_operands(sizes, padding, I, N, dtype)
    dw = torch.full((len(sizes), I, N), float("nan"), device="cuda", dtype=dtype)
    grouped_mm_wgrad_gluon(x, dy, offsets, dw, programs=programs)
    dw_tma = torch.full_like(dw, float("nan"))
    grouped_mm_wgrad_tma(x, dy, offsets, dw_tma)
    assert torch.equal(dw.view(torch.int16), dw_tma.view(torch.int16))  # the same chunks and wgmma
    # order (the trimmed last chunk's products are zeros): bit for bit, zeros' signs too (H200)
    start = 0
    for g, rows in enumerate(sizes):
        ref = x[start:start + rows].double().T @ dy[start:start + rows].double()
        if rows:
            assert _rel_err(dw[g], ref) < TOLERANCE[dtype], g
        else:
            assert (dw[g] == 0).all(), g
        start += rows


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon grouped GEMM is sm_90's")
@pytest.mark.parametrize("sizes, padding, I, N, dtype, programs", [
    ([0, 1, 63, 64, 65, 300, 0, 129], 9, 200, 264, torch.bfloat16, 3),  # ragged chunks, clipped tiles
    ([16, 17, 32, 33, 48, 49, 64 + 17, 128 + 33, 0, 1], 5, 256, 512, torch.float16, 3),  # 16-row edges
    ("random", 7, 192, 256, torch.bfloat16, None),  # 130 groups: a new group each tile
    ([3000, 5, 70, 0, 1200], 3, 1024, 520, torch.bfloat16, 5),  # long groups, odd N
])
def test_gpu_gluon_wgrad_fp32_equals_tma_kernel(sizes, padding, I, N, dtype, programs, monkeypatch):
    """The Gluon weight gradient's fp32 epilogue (the master gradient's: stored from registers,
    or added to what is there) against the Triton TMA kernel's fp32 one, bit for bit: a store
    over NaN (every element written, empty groups +0), then an add into random values (empty
    groups leave them as they were); and ``accumulate_wgrad_`` routed to it (first micro-batch
    writes ``.grad``, the next adds) equal to it routed to the TMA kernel."""
    from moe.kernels import grouped_mm_wgrad, grouped_mm_wgrad_gluon as w
    from moe.kernels.grouped_mm_wgrad_tma import grouped_mm_wgrad_tma
    from moe.kernels.master_grad import accumulate_wgrad_
    sizes, offsets, x, dy = _wgrad_operands(sizes, padding, I, N, dtype)
    for accumulate in (False, True):
        start = torch.full((len(sizes), I, N), float("nan"), device="cuda")
        if accumulate:
            start.normal_()
        dw, dw_tma = start.clone(), start.clone()
        w.grouped_mm_wgrad_gluon(x, dy, offsets, dw, programs=programs, accumulate=accumulate)
        grouped_mm_wgrad_tma(x, dy, offsets, dw_tma, accumulate=accumulate)
        assert torch.equal(dw.view(torch.int32), dw_tma.view(torch.int32)), accumulate
    ref = torch.stack([x[a:b].double().T @ dy[a:b].double() for a, b in zip([0, *offsets[:-1].tolist()], offsets.tolist())])
    assert _rel_err(dw_tma - start, ref) < TOLERANCE[dtype]
    grads, calls = [], []
    gluon = grouped_mm_wgrad.grouped_mm_wgrad_gluon  # hopper_wgrad_'s, which accumulate_wgrad_ calls
    monkeypatch.setattr(grouped_mm_wgrad, "grouped_mm_wgrad_gluon", lambda *a, **k: calls.append(k) or gluon(*a, **k))
    monkeypatch.setattr(w, "FP32_MIN_GROUPS", 1)
    monkeypatch.setattr(w, "FP32_MIN_ROWS_PER_GROUP", 0)
    for routed in (True, False):
        monkeypatch.setattr(w, "FP32_ROUTED", routed)
        master = torch.zeros(len(sizes), I, N, device="cuda", requires_grad=True)
        accumulate_wgrad_(master, x, dy, offsets)
        accumulate_wgrad_(master, x, dy.flip(1), offsets)
        grads.append(master.grad)
    # the Gluon kernel wrote .grad, then added (I and N multiples of 16), or the TMA one did
    assert calls == ([{"accumulate": False}, {"accumulate": True}] if I % 16 == N % 16 == 0 else [])
    assert torch.equal(grads[0].view(torch.int32), grads[1].view(torch.int32))


def test_gluon_kernel_compiles_for_sm90_without_spills():
    """The Gluon grouped GEMMs compile for sm_90 on CPU (Gluon has no interpreter) with their
    register plan (``setmaxnreg``, no stack), the forward's 16-byte tail stores (the 2-byte ones
    a table version once compiled to were 256 stores a slice instead of 32) and shared memory
    within Hopper's 227 KB: the forward for its b and the dgrad's, and the weight gradient with
    each epilogue (16-bit TMA store, fp32 store, fp32 add: the master gradient's)."""
    import json

    from tests.sm90 import run_child

    if torch.cuda.is_available():
        pytest.skip("compiles for sm_90 on CPU; on a GPU the GPU tests run the kernel")
    cases = [["fwd", False, "bfloat16"], ["fwd", True, "float16"], ["wgrad", 0, "bfloat16"], ["wgrad", 0, "float16"],
             ["wgrad", 1, "bfloat16"], ["wgrad", 2, "bfloat16"]]
    run = run_child(_GLUON_SM90, json.dumps(cases), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for case, (stack, setmaxnreg, wide, narrow, smem, builds, scratch, st_f32, ld_f32) in zip(
            cases, json.loads(run.stdout.splitlines()[-1]), strict=True):
        # the forward's tail stores; the weight gradient's 16-bit stores are all TMA, its fp32
        # ones each consumer's 64 pairs of columns a thread, 8 bytes each (and as many loads to
        # add to): the JIT's K, N divisible by 16 make them pairs, not 256 4-byte stores
        stores = (32, 0, 0, 0) if case[0] == "fwd" else (0, 0, 128 if case[1] else 0, 128 if case[1] == 2 else 0)
        # Both read through host descriptors only: none is built on the device (in global
        # scratch, which loads in flight read: the race an earlier weight gradient had)
        assert (stack == 0 and setmaxnreg and (wide, narrow, st_f32, ld_f32) == stores and smem <= 232448
                and (builds, scratch) == (0, 0)), (case, stack, setmaxnreg, wide, narrow, st_f32, ld_f32, smem,
                                                   builds, scratch)


def test_gluon_wgrad_ragged_view_refuses_rows_it_cannot_address():
    """The weight gradient's ragged view counts a group's rows below 2^30: more rows is one clear
    error before any launch (a view of one row, expanded: nothing is allocated)."""
    from moe.kernels.grouped_mm_wgrad_gluon import RAGGED_ROWS, ragged_descriptor
    row = torch.zeros(1, 64, dtype=torch.bfloat16)
    desc = ragged_descriptor(row, [64, 64])
    assert desc.shape[2:] == [RAGGED_ROWS, 64] and desc.strides == [2**34 - 64, 64, 64, 1]
    with pytest.raises(ValueError, match="rows, over the ragged view"):
        ragged_descriptor(row.expand(RAGGED_ROWS + 1, 64), [64, 64])
