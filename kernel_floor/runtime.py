"""What every Triton kernel of the project needs at launch time, written once: the interpreter
flag, the backend switch, the SM count and compute capability, tensor-descriptor eligibility
and scratch, 16-byte alignment, the fixed-config switch, the tile swizzle, element types, the
input checks that several launchers share, a launch that skips the JIT's per-call work
(``cached_launch``), and the named bundle a warp-specialized Gluon kernel hands its partitions
(``partition_args``).

``moe/kernels``, ``parallel`` and ``attention`` import these by their public names from
:mod:`kernel_floor`; none of them keeps a private copy.
"""

import functools
import hashlib
import os

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate
from triton.runtime.jit import constexpr_function

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernels (CPU tests): small tiles, one config per kernel."""

# MOE_AUTOTUNE=0: each grouped-GEMM kernel runs the first config of its list (the one that won
# most bench shapes) whose pipelined tiles fit in shared memory for the operands' dtype.
# Autotuning compiles and times every config for every new (N, I, dtype): on a fresh 2×H200
# machine the NCCL equivalence test ran past 100 s with it and took 14.5 s without.
AUTOTUNE = os.environ.get("MOE_AUTOTUNE", "1") != "0"
# Hopper's shared memory per block, less 16 KB for the epilogue and barriers.
_SMEM_BUDGET = 232448 - 16384

# Columns a row-moving program handles per step: 1024 bf16 columns over 4 warps are 8 per
# thread, 16-byte accesses; the interpreter takes 64 so that tests at D <= 128 loop.
ROW_BLOCK_D = 64 if INTERPRET else 1024
# Tokens a row-moving program handles per step by default: one on a GPU (one program per token,
# as the combine was measured); four in the interpreter, where every program costs Python time
# (the CPU tests then also walk blocks with a ragged tail).
ROW_BLOCK_T = 4 if INTERPRET else 1

BACKENDS = ("auto", "triton", "reference")

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
GLUON_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
"""The 16-bit operand types of the Gluon (Hopper wgmma) kernels."""


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for a launch grid or a tile count on the host. ``triton.cdiv`` gives the same
    value but is a Triton constexpr function in 3.6: an import, a list and a dict comprehension
    a call, 3–5 µs against 0.2 (CPU, timeit), and an attention fwd+bwd on Hopper called the two
    six times."""
    return (x + y - 1) // y


SCALAR = (gl.tensor, gl.constexpr)
"""A ``partition_args`` field's type for an int kernel argument, or a value computed from one: the
JIT hands an int argument equal to 1 over as a constexpr unless it is in ``do_not_specialize``."""


def _set_fields(self, **fields):
    for name, value in fields.items():
        # constexpr_function hands constexprs over unwrapped; an unannotated name, or a value of
        # another type than its field's, raises here
        setattr(self, name, value if isinstance(value, tl.core.base_value) else tl.constexpr(value))


def partition_args(cls):
    """A class of annotated fields made a Gluon aggregate built by keyword, ``Args(name=value,
    ...)``: what a warp-specialized kernel hands each of its partitions as one value, which they
    read by name (``a.q_smem``) instead of each unpacking one long tuple in the same order.
    ``gl.warp_specialize`` flattens the fields into the partitions' arguments as it did the
    tuple's: when the tuples went, the sm_90 SASS of every attention and grouped-GEMM binary
    compared equal (CPU), except where an int argument was specialized to 1 (a grouped GEMM of one
    segment): there the field stays a constexpr, where the tuple had captured it as an i32, so
    that binary takes one argument fewer. Triton's aggregate checks that the constructor set
    every field, with a value of its type.

    The fields join the cache key of every kernel that uses the class: Triton's aggregate hashes
    only its methods, here the one shared ``_set_fields``, so a field reordered or retyped would
    otherwise be served the binary cached before."""
    init = constexpr_function(_set_fields)
    fields = repr(list(cls.__annotations__.items()))
    init.hash = hashlib.sha256((init.cache_key + fields).encode()).hexdigest()
    cls.__init__ = init
    return _aggregate(cls)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as ``triton.next_power_of_2``), without
    that constexpr function's per-call cost (``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.lru_cache(maxsize=None)
def gluon_layout(block: tuple[int, ...], dtype) -> gl.NVMMASharedLayout:
    """The default swizzled shared-memory layout of a TMA block of ``block`` elements of the Gluon
    dtype ``dtype``; cached: building it took 4.5 µs of an attention launch's host time (H100)
    and ~6 µs a grouped-GEMM descriptor."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def grid_programs(tiles: int, max_programs: int | None = None) -> int:
    """Programs of a grid-stride launch over ``tiles`` tiles: one per tile, at most
    ``max_programs`` (None: no cap), and at least one (a launch may have work besides its tiles,
    e.g. a wait or a signal)."""
    return max(1, tiles if max_programs is None else min(tiles, max_programs))


def fixed_config(configs, tile_elems, elem_bytes: int):
    """MOE_AUTOTUNE=0: the first config whose ``num_stages · tile_elems(kwargs)`` elements of
    ``elem_bytes`` fit in shared memory (fp32 operands need smaller tiles than bf16)."""
    for c in configs:
        if c.num_stages * tile_elems(c.kwargs) * elem_bytes <= _SMEM_BUDGET:
            return [c]
    return configs[-1:]


def use_reference(backend: str, auto_reference: bool) -> bool:
    """Whether a kernel's wrapper runs its PyTorch reference: ``backend`` is one of
    :data:`BACKENDS` ("auto" picks the reference when ``auto_reference``, e.g. off CUDA)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend == "reference" or (backend == "auto" and auto_reference)


def tl_dtype(dtype: torch.dtype):
    """The Triton element type of a float ``dtype`` (for stores through raw addresses)."""
    if dtype not in TL_DTYPES:
        raise ValueError(f"buffer dtype must be one of {list(TL_DTYPES)}, got {dtype}")
    return TL_DTYPES[dtype]


_properties: dict[int, tuple[int, tuple[int, int]]] = {}


def _device_facts(device: torch.device) -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability) of a CUDA device, cached: the capability query alone took
    4–10 µs of host time per call (H100 host), which every small launch waited for."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _properties:
        props = torch.cuda.get_device_properties(index)
        _properties[index] = (props.multi_processor_count, (props.major, props.minor))
    return _properties[index]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached); 3 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 3  # interpreter: a few programs, so that each one walks several tiles
    return _device_facts(device)[0]


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA ``device`` (cached), e.g. (9, 0) for an H100."""
    return _device_facts(device)[1]


_compiled: dict = {}


def _unspecialized(kernel) -> tuple[set, set]:
    """The names of ``kernel``'s parameters left out of Triton's value and alignment
    specialization (a JIT function, or the interpreter's stand-in for one)."""
    if hasattr(kernel, "params"):
        return ({p.name for p in kernel.params if p.do_not_specialize},
                {p.name for p in kernel.params if p.do_not_specialize_on_alignment})
    names = kernel.arg_names
    return tuple({names[x] if isinstance(x, int) else x for x in kernel.kwargs.get(k) or ()}
                 for k in ("do_not_specialize", "do_not_specialize_on_alignment"))


def _check_unspecialized(kernel, args) -> None:
    values, alignments = _unspecialized(kernel)
    for name, arg in zip(kernel.arg_names, args):
        int_arg = isinstance(arg, int) and not isinstance(arg, bool)
        if (int_arg and name not in values) or (
                isinstance(arg, torch.Tensor) and name not in alignments):
            raise ValueError(f"cached_launch: {kernel.__name__} specializes on its argument "
                             f"{name!r}; list it in do_not_specialize"
                             f"{'' if int_arg else '_on_alignment'}")


# A fast launch keeps at most this many TMA maps per kernel, then starts over: a training step
# meets each call site's few tensors again at the same addresses (the caching allocator), so
# the maps it uses number in the hundreds.
_MAX_TMA_MAPS = 4096


def launch_hooked() -> bool:
    """Whether a Triton launch hook knob (enter or exit) holds something to call; an empty
    chain, the default, does not."""
    return any(hook is not None and bool(getattr(hook, "calls", True))
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


class _Launch:
    """A compiled kernel's later launches, with Triton's per-launch Python skipped.

    At each launch Triton's runner and launcher look up the device, stream and hooks, ask for
    scratch (none here), build the hooks' launch metadata and call the hooks (empty chains by
    default, Triton 3.6), and fill a 128-byte TMA map for each host tensor descriptor
    (``make_tensordesc_arg``) before the C launch. The map depends only on the base address,
    shape, strides, padding and the kernel's block and swizzle for that argument, so it is kept
    by those values: the attention backward passes seven descriptors a call, in a loop or a
    training step at the same addresses each time (the caching allocator). The C launcher is
    called directly, with what the runner would pass.

    Measured (H200, 2026-11-28, ``probe/launch_ab.py``, one process, alternating): the host time
    of an attention fwd+bwd through autograd at B·S 16k, S 1k–4k, 368–526 µs a call against
    441–586 through Triton's runner; the backward's body called directly 0.113 ms (0.16 before);
    outputs bit for bit.

    Triton's runner still launches kernels that need global or profile scratch, launchers not
    laid out as Triton 3.6's CUDA one (its class, base argument format and descriptor wrapper),
    and every launch while a launch hook is set (a profiler such as Proton adds one).
    Descriptors must be positional arguments (``cached_launch``'s ``args``).
    """

    def __init__(self, compiled, tail):
        self.compiled, self.tail, self.raw = compiled, tail, None
        launcher = compiled.run
        # Imported here: the NVIDIA backend's module loads only where that backend is in use.
        from triton.backends.nvidia import driver as nvidia
        if (type(launcher).__name__ != "CudaLauncher" or launcher.global_scratch_size
                or launcher.profile_scratch_size
                or getattr(nvidia, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO"):
            return
        wrapped = launcher.launch
        self.descs = {}
        if getattr(wrapped, "__code__", None) is not None:  # Python: the descriptor wrapper
            cells = dict(zip(wrapped.__code__.co_freevars,
                             (c.cell_contents for c in wrapped.__closure__ or ())))
            if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
                return
            positions = sorted(cells["tensordesc_indices"])
            self.descs = dict(zip(positions, cells["tensordesc_meta"]))
            wrapped = cells["launcher"]
        self.raw = wrapped
        self.head = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                     None, None, compiled.packed_metadata, None, None, None)
        self.stream = triton.runtime.driver.active.get_current_stream
        self.maps = {}
        self.make_map = nvidia.make_tensordesc_arg

    def _map(self, i, desc):
        meta = self.descs[i]
        if meta is None:  # not lowered to a TMA map: base, shape and strides, nothing filled
            return self.make_map(desc, None)
        key = (i, desc.base.data_ptr(), *desc.shape, *desc.strides, desc.padding)
        found = self.maps.get(key)
        if found is None:
            if len(self.maps) >= _MAX_TMA_MAPS:
                self.maps.clear()
            found = self.maps[key] = self.make_map(desc, meta)
        return found

    def __call__(self, grid, args, device):
        if self.raw is None or launch_hooked():
            self.compiled[grid](*args, *self.tail)
            return
        flat = []
        for i, a in enumerate(args):
            if i in self.descs:
                flat.extend(self._map(i, a))
            else:
                flat.append(a)
        self.raw(*grid, self.stream(device), *self.head, *flat, *self.tail)


def cached_launch(kernel, grid, key, *args, **constexprs) -> None:
    """``kernel[grid](*args, **constexprs)`` with the JIT's per-call work done once.

    Triton binds and specializes every argument and hashes a cache key at each launch: 20 of the
    32 µs of host time that launching the attention forward took (H100 host, 2026-11-24), time
    that a small call's GPU waits for. The first launch for (kernel, device, ``key``, constexprs
    and options) goes through the JIT and keeps the compiled kernel; later ones launch that
    directly, through Triton's C launcher with the descriptors' TMA maps kept (``_Launch``).
    This is valid only where the compiled code depends on nothing else:

    - ``key`` names the dtypes of the tensor and descriptor arguments;
    - the kernel lists its int and pointer arguments in ``do_not_specialize`` and
      ``do_not_specialize_on_alignment`` (checked at the first launch, in the interpreter too);
    - an int argument that can reach 2^31 is annotated ``tl.int64``: Triton types an int by its
      value (i32 below 2^31), and a binary compiled with an i32 slot refuses a larger value
      (OverflowError);
    - no ``None`` argument stands where a later call passes a value, and Triton's debug and
      instrumentation knobs do not change after the first launch.

    ``args`` are the kernel's leading parameters in order; the constexprs are the rest, by name.
    """
    if INTERPRET:  # nothing to cache: the interpreter runs the Python function
        _check_unspecialized(kernel, args)
        kernel[grid](*args, **constexprs)
        return
    device = torch.cuda.current_device()
    cache_key = (kernel, device, key, *constexprs.items())
    hit = _compiled.get(cache_key)
    if hit is not None:
        hit((*grid, 1, 1)[:3], args, device)  # the compiled kernel's launcher takes 3-D grids
        return
    _check_unspecialized(kernel, args)
    compiled = kernel[grid](*args, **constexprs)
    if compiled is not None:  # None: a JIT cache hook took the launch over
        _compiled[cache_key] = _Launch(
            compiled, tuple(constexprs[p.name] for p in kernel.params[len(args):]))


def _scratch(size: int, _alignment: int, _stream) -> torch.Tensor:
    """Global scratch for the tensor descriptors the kernels build on the device. Triton's
    allocator protocol also passes an alignment and a stream: the caching allocator's blocks are
    512-byte aligned, and the scratch is used on the current stream it is allocated for."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def aligned16(*tensors: torch.Tensor) -> bool:
    """Every tensor's base address and non-unit strides are multiples of 16 bytes."""
    for t in tensors:
        if t.data_ptr() % 16 or any((st * t.element_size()) % 16 for st in t.stride() if st != 1):
            return False
    return True


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors: Hopper or newer (or the interpreter), 16-byte aligned base and
    non-unit strides (the unit stride is checked by the caller)."""
    first = tensors[0]
    if first.is_cuda:
        if capability(first.device)[0] < 9:
            return False
    elif not INTERPRET:
        return False
    return aligned16(*tensors)


def use_tensor_descriptors() -> None:
    """Install the descriptor scratch allocator; the allocator is a context variable, so this
    runs before every launch (autograd's backward runs in another thread)."""
    triton.set_allocator(_scratch)


@triton.jit
def band_swizzle(local, major_tiles, minor_tiles, BAND: tl.constexpr):
    """Tile ``local`` of a ``major_tiles × minor_tiles`` grid, walked in bands of ``BAND`` major
    tiles, major fastest inside a band: a wave of programs then shares a few rows of one operand
    and a few column strips of the other in L2. Returns ``(tile_major, tile_minor)``."""
    band_size = BAND * minor_tiles
    first = (local // band_size) * BAND
    in_band = tl.minimum(major_tiles - first, BAND)
    return first + (local % band_size) % in_band, (local % band_size) // in_band


def check_segments(offsets_J: torch.Tensor, num_groups: int) -> None:
    """``offsets_J`` lists J row segments, J a positive multiple of the ``num_groups`` weights."""
    if num_groups <= 0 or offsets_J.dim() != 1 or offsets_J.shape[0] == 0 or offsets_J.shape[0] % num_groups:
        raise ValueError(f"offsets_J must be 1-D with a multiple of the {num_groups} weight groups "
                         f"(one entry per row segment), got shape {tuple(offsets_J.shape)}")


def check_rows(name: str, t: torch.Tensor, rows: int | None, D: int, any_row_stride: bool = False) -> None:
    """``t`` must be a contiguous (rows, D) matrix (any row count when ``rows`` is None); with
    ``any_row_stride``, its rows may lie any distance apart but each must be contiguous (a view of
    some columns of a wider buffer, which the row kernels read by their row stride)."""
    if t.dim() != 2 or t.shape[1] != D or (rows is not None and t.shape[0] != rows):
        laid_out = False
    elif any_row_stride:  # a stride of a dimension of size 0 or 1 is never used
        laid_out = t.shape[0] == 0 or D <= 1 or t.stride(1) == 1
    else:
        laid_out = t.is_contiguous()
    if not laid_out:
        want = f"({rows}, {D})" if rows is not None else f"(rows, {D})"
        if any_row_stride:
            raise ValueError(f"{name} must be {want} rows with unit column stride, got {tuple(t.shape)} "
                             f"strides {t.stride()}")
        raise ValueError(f"{name} must be contiguous {want}, got {tuple(t.shape)}")


def check_pair_weights(name: str, w_TK: torch.Tensor | None, T: int, K: int) -> None:
    """Optional combine weights: an fp32 (T, K) tensor."""
    if w_TK is not None and (w_TK.shape != (T, K) or w_TK.dtype != torch.float32):
        raise ValueError(f"{name}: w_TK must be fp32 of shape ({T}, {K}), got {w_TK.dtype} {tuple(w_TK.shape)}")
