"""kernel_floor.cached_launch: the JIT's binary reused without the JIT's per-call binding.

The reuse is only sound for a kernel whose binary depends on its constexprs alone. These tests
launch one such kernel first at "nice" arguments (a length that is a multiple of 16, aligned
pointers, a small int64: what Triton would specialize on or type as i32) and then at awkward
ones (odd lengths, pointers one element off alignment, a length of 1, an int64 past 2^31), each
against PyTorch, and count that only the first launch per constexpr set compiles; a kernel that
specializes is refused before it runs (on CPU too, in the interpreter). A GPU test checks the
later launches' kept TMA maps (by address, shape and strides) and their fallback to Triton's
runner while a launch hook is set. The host-side grid arithmetic (``cdiv``, ``next_power_of_2``)
is checked against Triton's functions, which it replaces on every launch path. So is
``partition_args``' share of the cache key: a bundle's fields.
"""

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from kernel_floor import cached_launch, cdiv, next_power_of_2, runtime

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit(do_not_specialize=["N", "shift"], do_not_specialize_on_alignment=["X", "Y"])
def _axpy(X, Y, N, alpha, shift: tl.int64, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < N
    x = tl.load(X + offs, mask=keep)
    y = tl.load(Y + offs, mask=keep) + alpha * x + (shift % 7).to(tl.float32)
    tl.store(Y + offs, y, mask=keep)


@triton.jit(do_not_specialize=["scale"])
def _scale_rows(x_desc, y_desc, scale, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """y = scale · x, one BLOCK_M × D block a program, through host tensor descriptors."""
    off = tl.program_id(0) * BLOCK_M
    y_desc.store([off, 0], (x_desc.load([off, 0]).to(tl.float32) * scale).to(y_desc.dtype))


@triton.jit
def _copy_specialized(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N), mask=offs < N)


@triton.jit(do_not_specialize_on_alignment=["X", "Y"])
def _copy_int_specialized(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N), mask=offs < N)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_cached_launch_matches_torch_at_awkward_arguments(dtype, monkeypatch):
    compiles = []
    run = _axpy.run
    monkeypatch.setattr(_axpy, "run", lambda *a, **kw: compiles.append(1) or run(*a, **kw))
    base_x = torch.randn(4099, device="cuda", dtype=dtype)
    base_y = torch.randn(4099, device="cuda", dtype=dtype)
    # (offset, length, shift): aligned, a multiple of 16 and a small shift first, so a binary
    # specialized on these would be the one reused for the rest.
    cases = ((0, 4096, 3), (1, 4095, 2**33 + 5), (3, 17, 11), (0, 1, 0), (1, 1000, 2**40 + 1))
    for offset, n, shift in cases:
        for block in (128, 1024):
            x, y = base_x[offset:offset + n], base_y[offset:offset + n].clone()
            want = y.float() + 0.5 * x.float() + shift % 7
            cached_launch(_axpy, (triton.cdiv(n, block),), dtype, x, y, n, 0.5, shift,
                          BLOCK=block)
            torch.testing.assert_close(y.float(), want, rtol=1e-3, atol=1e-2)
    assert len(compiles) == 2, f"{len(compiles)} JIT launches: one per BLOCK expected"


@pytest.mark.parametrize("kernel, name, lists", [
    (_copy_specialized, "X", "do_not_specialize_on_alignment"),
    (_copy_int_specialized, "N", "do_not_specialize"),
])
def test_cached_launch_refuses_a_specializing_kernel(kernel, name, lists):
    x = torch.randn(64, device=DEVICE)
    y = torch.zeros_like(x)
    with pytest.raises(ValueError, match=f"'{name}'; list it in {lists}$"):
        cached_launch(kernel, (1,), x.dtype, x, y, 64, BLOCK=64)
    assert not y.any(), "the refused kernel ran"


@pytest.mark.gpu
def test_gpu_cached_launch_keeps_tma_maps_by_address_and_shape(monkeypatch):
    """The fast launch keeps each descriptor's TMA map by its address, shape and strides. Views of
    one buffer share its address: a shorter then a longer length, then a strided view, each
    poisons the output first, so a map reused for another shape or stride leaves NaN rows or
    reads the wrong ones. The same address with new contents reuses its map; a launch with a hook
    set takes Triton's runner, which calls the hook."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("host tensor descriptors need sm_90")
    if runtime.launch_hooked():
        pytest.skip("a launch hook is set in this process: every launch takes Triton's runner")
    x_buf = torch.randn(48, 128, device="cuda", dtype=torch.float16)
    y_buf = torch.empty_like(x_buf)

    def launch(x, y, scale):
        y.fill_(float("nan"))
        cached_launch(_scale_rows, (triton.cdiv(x.shape[0], 16),), x.dtype,
                      TensorDescriptor.from_tensor(x, [16, 64]),
                      TensorDescriptor.from_tensor(y, [16, 64]), scale, BLOCK_M=16, D=64)
        torch.testing.assert_close(y, (x.float() * scale).to(x.dtype))

    contiguous = lambda buf, n: buf.view(-1)[:n * 64].view(n, 64)  # noqa: E731 (stride 64)
    launch(contiguous(x_buf, 37), contiguous(y_buf, 37), 2.0)  # through the JIT: no map kept
    (fast,) = [v for k, v in runtime._compiled.items() if k[0] is _scale_rows]
    assert fast.raw is not None, "the fast launch was not set up"
    raw_calls, filled = [], []
    raw, make_map = fast.raw, fast.make_map
    monkeypatch.setattr(fast, "raw", lambda *a: raw_calls.append(1) or raw(*a))
    monkeypatch.setattr(fast, "make_map",
                        lambda desc, meta: filled.append(desc.base.data_ptr()) or make_map(desc, meta))
    for n in (37, 48):  # one address, two lengths
        launch(contiguous(x_buf, n), contiguous(y_buf, n), 2.0)
    launch(x_buf[:, :64], y_buf[:, :64], 0.5)  # the same address, stride 128
    assert len(raw_calls) == 3 and len(filled) == 6, (raw_calls, filled)
    x_buf.normal_()  # same address, new contents: the maps stay valid and are reused
    launch(x_buf[:, :64], y_buf[:, :64], -0.5)
    assert len(raw_calls) == 4 and len(filled) == 6, "a kept map was filled again"
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731 (a LazyDict)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(contiguous(x_buf, 48), contiguous(y_buf, 48), 3.0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_scale_rows"] and len(raw_calls) == 4, (seen, raw_calls)


def test_host_grid_arithmetic_equals_tritons():
    """Same values as triton.cdiv / triton.next_power_of_2 (constexpr functions in Triton 3.6,
    3-5 us a host call): zero, negatives, every n to 4100, powers of two and their neighbours
    past 2^31."""
    ns = list(range(-5, 4100)) + [p + d for p in (2**31, 2**33, 2**40) for d in (-1, 0, 1)]
    for n in ns:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for y in (1, 3, 16, 64, 128, 1000):
            assert cdiv(n, y) == triton.cdiv(n, y), (n, y)
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 5, 129)] == [0, 1, 2, 4, 8, 256]
    assert cdiv(1024, 64) == 16 and cdiv(1025, 64) == 17 and cdiv(0, 64) == 0


def test_partition_args_fields_join_the_cache_key():
    """Bundles whose fields differ in order or type hash apart, and the same fields alike: Triton's
    aggregate hashes only its methods, here one constructor every bundle shares, so without the
    fields a kernel whose bundle was reordered would be served the binary cached for the old order."""
    from triton.experimental.gluon import language as gl

    def key(**fields):
        return runtime.partition_args(type("Args", (), {"__annotations__": fields})).hash_attrs[0].cache_key
    keys = [key(x=gl.tensor, y=gl.tensor), key(y=gl.tensor, x=gl.tensor), key(x=gl.tensor, y=gl.constexpr)]
    assert len(set(keys)) == 3 and key(x=gl.tensor, y=gl.tensor) == keys[0]
