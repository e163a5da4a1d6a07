"""The memory model: predicted peak GPU memory per GPU of a training run, from its config alone.

    python -m train.memory --config configs/olmoe_bench.yaml --world 2 --ep 2
    python -m train.memory --config configs/olmoe_bench.yaml --world 8 --ep 8 --data-parallel fsdp --ac full
    python -m train.memory --layouts          # Qwen3-30B-A3B and DeepSeek-V3-shaped layouts we cannot run
    python -m train.memory ... --detail       # also each saved tensor of one block, and where the peak is
    python -m train.memory ... --torch 2.11   # the run's torch, if not the installed one (rms_norm's autocast)

Legend: B batch, S sequence length, T = B·S tokens per rank and micro-batch, D model dim, V
vocabulary, H / Hkv / Hd query heads / key-value heads / head dim, E experts, K top-k, L = E / ep
experts on this rank, F expert hidden dim, U width of an MLP's first matmul (2F SwiGLU, F GELU),
P = T·K (token, slot) pairs, R rows the experts compute, J row segments, W world.

Nothing is built and nothing runs on a device: parameter shapes are written out from the config as
train/model.py declares them (tests/test_memory.py checks them against the model built on the meta
device), and every activation byte is read off the code that saves it. Without ``--data-parallel``
/ ``--ac`` one row per (data-parallel mode × activation checkpointing) is printed.

What is counted, per GPU:
- parameters: fp32 masters. replicate: every dense parameter and the rank's L experts per layer;
  fsdp (``parallel/fsdp.py``): dense ones Shard(0) over the W ranks, each expert shard Shard(1)
  over its edp = W / ep ranks; the routers, and the experts when edp = 1, are left out of FSDP
  (ignored_params: whole fp32 parameters, as replicated); FSDP2 pads a shard to
  ceil(size / ranks) rows, so the padded chunk is what a rank allocates.
- gradients: fp32, shaped like the masters; ``zero_grad(set_to_none=True)`` after each step, so
  they appear during the backward (a block's once its backward has run) and are whole only from
  the end of the backward to the optimizer step (with ``train.grad_accum`` > 1, from the start).
- optimizer state: AdamW's exp_avg and exp_avg_sq, fp32, shaped like the masters.
- activations: what autograd keeps from the forward to the backward (``ctx.save_for_backward`` of
  grouped_mm.py, combine.py, flash_attn.py, the dispatchers and train/lm_loss.py; the saved
  tensors of the plain PyTorch ops), by part in ``--detail``; O(E)-sized and scalar ones (the
  load-balancing loss's f_E, token counts) are left out. The LM head and its cross-entropy
  (``model(tokens, targets)``, train/lm_loss.py) keep the gradients they compute in the forward:
  their input's (T, D) and the weight's (V, D), no (T, V) tensor.
- dispatch: what the exchange holds per MoE layer until its backward (the route's index tensors,
  with selective checkpointing the received rows), and with
  ``parallel.dispatcher=p2p`` the symmetric-memory slots (one per MoE block and chunk) and gradient
  buffers (one per chunk);
  these are mapped outside PyTorch's caching allocator, so max_memory_allocated should not count
  them (:attr:`Prediction.outside_allocator`; not verified on a GPU).
- weights: bf16 copies of the weights. replicate: autocast's casts of the linear weights, kept by
  the backward that reads them (autocast also caches every cast of a leaf parameter until the
  autocast region exits: all of them exist at the end of the forward; the LM head's cast lives
  only through the LM head's own forward), and the experts' ``.to(bf16)`` copies, made once per
  optimizer step and held to its end (the trainer's ``moe.master_weight_step``); fsdp: the bf16
  all-gathered parameters held (the root's, never resharded; every block's when
  ``parallel.reshard_after_forward`` is false), and the casts of what FSDP leaves out (the edp = 1
  experts' ``.to(bf16)``, held for the step as when replicated; the routers run in fp32 with
  autocast off).
- transients at the peak: the LM head and loss's chunk (one chunk's logits in bf16 and fp32 or
  its bf16 gradient beside them, the fp32 (V, D) weight-gradient accumulator the GEMM adds into), a block's backward working set (incoming gradients, dgrad outputs, the bf16
  wgrad before its fp32 accumulate), the activations a checkpointed block recomputes, FSDP's
  buffers (below), the all-reduce's flat bucket (every gradient when replicated; the routers'
  under FSDP).

The peak is the largest total over the moments of a step: the end of the forward (the LM head
and loss's chunk loop), each block's backward (the largest of its phases: the FFN's backward,
then the attention's, which never overlap; under FSDP also its units' copy-outs and
reduce-scatters), the end of the backward (FSDP: the root's reduce-scatter), and the gradient
sync + optimizer step (the fused
AdamW step updates param, grad and both moments in place: nothing parameter-sized). Not counted:
the CUDA context, NCCL's and cuBLAS's own buffers, Triton's autotuning scratch, and the validation
pass (no_grad: smaller than a training step).

Assumptions (each one where the code uses it, with its reason):
- training in bf16 on a GPU (``train.precision`` auto or bf16): torch.autocast(bf16), the
  Triton grouped GEMM and FlashAttention. fp32 training on a GPU runs the grouped GEMM's PyTorch
  reference instead, whose saved tensors differ: not modelled.
- balanced routing: a rank's experts compute on average R = T·K rows (NCCL, dropless), at most
  capacity_factor·T·K with a capacity; the local dispatcher packs all T·K pairs, dropped ones too;
  the P2P dispatcher hands the experts its fixed ep·T·K rows, or with a capacity E·Q·C
  (``moe.capacity.max_received_rows``; its docstring says so).
- the residual stream: fp32 with fp32 masters (the embedding's fp32 rows plus bf16 sub-layer
  outputs). Under bf16-gathered FSDP every block's unit casts its forward inputs to bf16
  (MixedPrecisionPolicy.cast_forward_inputs); the experts' unit (edp > 1) does not
  (parallel/fsdp.py), its rows come in the compute dtype from the dispatch. The norms: from
  torch 2.12 autocast runs rms_norm in fp32 (an fp32 cast input kept, fp32 out; the dispatch
  casts the rows to the experts' dtype); before, in its input's dtype, bf16 under FSDP
  (:class:`Numerics`; ``--torch``, default the installed version).
- FSDP (torch/distributed/fsdp/_fully_shard): units are each block's dense group and, at
  edp > 1, its experts. In the backward a unit's pre-backward copies its all-gather out (the flat
  output and the parameters both alive for a moment) and prefetches the unit before it in
  forward order (block → its experts → the previous block), whose all-gather output waits for
  its own copy-out; gradients are unsharded in bf16 until the unit's post-backward reshards it,
  fills the reduce-scatter input (reduce dtype) and frees them; that input lives until the next
  unit's reduce-scatter. The root's forward input (token ids) needs no gradient, so its
  post-backward (and its reduce-scatter) runs only when the backward ends.

Calibration: ``bench/memory_check.py`` prints predicted vs ``torch.cuda.max_memory_allocated``
for real training runs. Measured on 2×H200 (torch 2.11, configs/olmoe_bench.yaml, 10 steps) at
commit 8011bf1 (routers and edp = 1 experts out of FSDP); predictions with ``--torch 2.11``,
before (the model as it was: routers and edp = 1 experts counted as FSDP units, rms_norm in fp32,
every FSDP buffer at once) and after:

| case | mode | AC | old GiB | new GiB | measured | new / measured |
|---|---|---|---|---|---|---|
| olmoe_bench (EP 2) | replicate | none | 74.87 | 74.87 | 74.77 | 1.001 |
| olmoe_bench | replicate | selective | 62.84 | 62.84 | 62.78 | 1.001 |
| olmoe_bench | fsdp | none | 65.90 | 70.88 | 70.96 | 0.999 |
| olmoe_bench, reshard_after_forward=false | fsdp | none | 72.40 | 71.38 | 71.47 | 0.999 |
| olmoe_bench | fsdp | selective | 61.08 | 55.99 | 55.43 | 1.010 |
| olmoe_bench | fsdp | full | 57.88 | 55.99 | 55.27 | 1.013 |
| --parallel.ep=1 (EP 1 × DP 2) | fsdp | none | 68.67 | 64.88 | 64.95 | 0.999 |
| --parallel.ep=1 | fsdp | selective | 64.09 | 56.11 | 55.58 | 1.010 |
| --model.n_layers=30 (EP 2) | replicate | none | 132.74 | 132.74 | 134.33 | 0.988 |
| --model.n_layers=40 (EP 2) | fsdp | full | 132.91 | 131.04 | 130.29 | 1.006 |

Since the NCCL dispatcher sends each token to a rank once and its experts weight their rows
(parallel/dispatcher.py, 2026-11-25), its combine keeps no rows: the predictions of the EP 2 rows
above are smaller by the T·K rows of D it kept per MoE layer (olmoe_bench: 16 × 8192 · 8 · 2048 ·
2 B = 4.0 GiB), not yet measured. The P2P dispatcher's likewise since it hands the experts the
rows' weights (2026-11-25): its combine kept the R_cap = ep·T·K rows it returned (olmoe_bench:
16 × 2 · 8192 · 8 · 2048 · 2 B = 8.0 GiB), not yet measured.

These were measured with the LM head's fp32 logits materialised (``F.cross_entropy`` of
``model(tokens)``, before train/lm_loss.py): the model of that path counted them, the (T, V)
log-softmax output and its backward's temporaries; its predictions are the "new" column. The
chunked path's predictions are smaller by about those (T, V) tensors and are not yet measured.

tests/test_memory.py checks what a forward keeps under each checkpointing setting against a CPU
forward (fp32, the Triton kernels in the interpreter): equal but for the O(E) tensors left out.
Not measured: the P2P dispatcher, gradient accumulation, torch >= 2.12 on a GPU (rms_norm in
fp32: larger FSDP activations), layouts beyond 2 GPUs.
"""

import argparse
import copy
import importlib.metadata
import math
import sys
from dataclasses import dataclass

from kernel_floor import cdiv
from moe.capacity import max_received_rows
from parallel.grad_sync import BUCKET_BYTES
from train.config import Config, ConfigError, load_config, validate
from train.lm_loss import chunk_rows

GiB = 1 << 30
DATA_PARALLEL = ("replicate", "fsdp")
CHECKPOINTING = ("none", "selective", "full")
# an "80 GB" H100/A100 shows 79.6 GiB (nvidia-smi: 81,559 MiB); what max_memory_allocated does not
# see (CUDA context, NCCL and cuBLAS buffers, the allocator's free cached blocks) takes a few GiB
FIT_GIB = 76.0


@dataclass(frozen=True)
class ModelShape:
    """The sizes the memory depends on, from the config (``moe_blocks`` may be given instead of
    ``moe.every_n_layers``, e.g. DeepSeek-V3's first three dense blocks)."""

    D: int
    V: int
    H: int
    Hkv: int
    Hd: int
    F_dense: int
    tied: bool
    E: int
    K: int
    F: int
    F_shared: int  # width of the fused shared-expert MLP (num_shared_experts · shared_hidden_dim), 0: none
    swiglu: bool
    capacity_factor: float | None
    renormalize: bool
    moe_blocks: tuple[bool, ...]
    qk_norm: str = "none"  # model.qk_norm: gains of Hd (head) or H·Hd and Hkv·Hd (full); activations not counted
    qkv_bias: bool = False
    shared_gate: bool = False  # moe.shared_expert_gate: a (1, D) weight
    lm_bias: bool = False  # model.lm_head_bias: a (V,) parameter
    sigmoid: bool = False  # moe.score_func == "sigmoid": the balancing loss normalises the scores per token
    capacity_groups: int = 1  # moe.capacity_groups: Q, the groups a rank's tokens are capped in

    @classmethod
    def of(cls, cfg: Config, moe_blocks: tuple[bool, ...] | None = None) -> "ModelShape":
        m, e = cfg.model, cfg.moe
        return cls(
            D=m.dim, V=m.vocab_size, H=m.n_heads, Hkv=m.n_kv_heads or m.n_heads, Hd=m.head_dim or m.dim // m.n_heads,
            F_dense=m.dense_hidden_dim, tied=m.tie_embeddings, E=e.num_experts, K=e.top_k, F=e.hidden_dim,
            F_shared=e.num_shared_experts * (e.shared_hidden_dim or e.hidden_dim), swiglu=e.activation == "swiglu",
            capacity_factor=e.capacity_factor, renormalize=e.renormalize,
            moe_blocks=moe_blocks or tuple(e.is_moe_layer(i) for i in range(m.n_layers)),
            qk_norm=m.qk_norm, qkv_bias=m.qkv_bias, shared_gate=e.shared_expert_gate, lm_bias=m.lm_head_bias,
            sigmoid=e.score_func == "sigmoid", capacity_groups=e.capacity_groups,
        )

    def up(self, hidden: int) -> int:
        """U, the first matmul's width for this hidden width (SwiGLU: gate and up in one matmul)."""
        return 2 * hidden if self.swiglu else hidden


def param_shapes(s: ModelShape) -> dict[str, list[tuple[int, ...]]]:
    """Every parameter's shape as train/model.py declares it (nn.Linear weights are (out, in); the
    experts' with all E experts), by group: ``embed``, ``head``, ``norm`` (the final one) and per
    block i ``blocks.i.dense`` (its norms, attention and dense or shared MLP), ``blocks.i.router``,
    ``blocks.i.experts``."""
    D = s.D
    groups = {"embed": [(s.V, D)], "head": ([] if s.tied else [(s.V, D)]) + ([(s.V,)] if s.lm_bias else []),
              "norm": [(D,)]}
    for i, moe in enumerate(s.moe_blocks):
        dense = [(D,), ((s.H + 2 * s.Hkv) * s.Hd, D), (D, s.H * s.Hd), (D,)]
        if s.qkv_bias:
            dense.append(((s.H + 2 * s.Hkv) * s.Hd,))
        if s.qk_norm != "none":
            dense += [(s.Hd,), (s.Hd,)] if s.qk_norm == "head" else [(s.H * s.Hd,), (s.Hkv * s.Hd,)]
        hidden = s.F_shared if moe else s.F_dense
        if hidden:
            dense += [(s.up(hidden), D), (D, hidden)]
        if moe and s.shared_gate:
            dense.append((1, D))
        groups[f"blocks.{i}.dense"] = dense
        groups[f"blocks.{i}.router"] = [(s.E, D)] if moe else []
        groups[f"blocks.{i}.experts"] = [(s.E, D, s.up(s.F)), (s.E, s.F, D)] if moe else []
    return groups


@dataclass(frozen=True)
class Layout:
    """Where a run's state lives: W ranks, expert-parallel size ep, the data-parallel mode and the
    activation checkpointing, plus the config keys of those choices."""

    world: int
    ep: int
    data_parallel: str
    checkpointing: str
    dispatcher: str = "nccl"
    nccl_sizes: str = "exact"  # parallel.nccl_sizes
    reshard_after_forward: bool = True
    param_bytes: int = 2  # fsdp: the dtype parameters are gathered in (parallel.param_dtype)
    reduce_bytes: int = 4  # fsdp: the dtype gradients are reduce-scattered in
    chunks: int = 1  # parallel.overlap_chunks: the dispatches a MoE layer makes (ep > 1)

    @property
    def edp(self) -> int:
        return self.world // self.ep

    @property
    def sharded(self) -> bool:
        # one process has nothing to shard: train/parallelize.py then trains the plain model
        return self.data_parallel == "fsdp" and self.world > 1

    @property
    def experts_sharded(self) -> bool:
        # parallel/fsdp.py leaves the experts out of FSDP (ignored_params) when edp = 1: plain fp32
        return self.sharded and self.edp > 1

    @property
    def transport(self) -> str:
        """How MoE rows move: ``local`` (ep 1), ``nccl`` or ``p2p``."""
        return "local" if self.ep == 1 else self.dispatcher

    @property
    def padded(self) -> bool:
        """The NCCL dispatcher's padded exchange: its experts take R_cap rows, as P2P's."""
        return self.transport == "nccl" and self.nccl_sizes == "padded"

    @property
    def bf16_params(self) -> bool:
        return self.sharded and self.param_bytes == 2


def local_numel(group: str, shape: tuple[int, ...], lay: Layout) -> int:
    """Elements of one parameter a rank holds as its fp32 master (and gradient, and each AdamW
    moment). FSDP2 splits the sharded dimension in equal chunks, padding the last ones."""
    if group.endswith("experts"):
        L, rows, rest = shape[0] // lay.ep, shape[1], math.prod(shape[2:])
        return L * (cdiv(rows, lay.edp) if lay.experts_sharded else rows) * rest
    if lay.sharded and not group.endswith("router"):  # the routers are ignored_params: replicated
        return cdiv(shape[0], lay.world) * math.prod(shape[1:])
    return math.prod(shape)


def unsharded_numel(group: str, shape: tuple[int, ...], lay: Layout) -> int:
    """Elements of one parameter as the forward uses it (the rank's L experts, all of any other)."""
    return math.prod(shape) // lay.ep if group.endswith("experts") else math.prod(shape)


@dataclass(frozen=True)
class Numerics:
    """What the saved tensors' sizes depend on beyond the shapes.

    compute_bytes: matmul operands and outputs (2: bf16 under autocast; 4: fp32).
    fused_norm: CUDA dispatches rms_norm to _fused_rms_norm, which saves (input, rstd); elsewhere
        its composite also saves x·rstd (T, D).
    norm_fp32: CUDA autocast runs rms_norm in fp32 (torch >= 2.12 put it on the fp32 list of
        ATen's autocast_mode.h, pytorch#174824): it saves an fp32 (cast) input and returns fp32,
        so a linear fed by a norm saves a cast copy. Before 2.12 rms_norm runs in its input's
        dtype: fp32 with fp32 masters, but bf16 under FSDP's bf16 parameters and block inputs.
    """

    compute_bytes: int
    fused_norm: bool
    norm_fp32: bool = True

    @property
    def casts(self) -> bool:
        return self.compute_bytes != 4


GPU_BF16 = Numerics(compute_bytes=2, fused_norm=True)


def gpu_numerics(torch_version: str) -> Numerics:
    """The bf16 GPU numerics of a torch version ("2.11.0+cu128"): rms_norm under autocast's fp32
    policy from 2.12 on."""
    major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    return Numerics(compute_bytes=2, fused_norm=True, norm_fp32=(major, minor) >= (2, 12))


def norm_bytes(lay: "Layout", num: Numerics) -> int:
    """Bytes per element of what a norm saves and returns: fp32 with fp32 masters (fp32 residual
    stream); under bf16-gathered FSDP the block inputs are bf16 (FSDP casts every unit's forward
    inputs to param_dtype, MixedPrecisionPolicy.cast_forward_inputs) and so is the norm's weight:
    fp32 only where autocast upcasts rms_norm (torch >= 2.12), else bf16."""
    return 4 if num.norm_fp32 or not num.casts or not lay.bf16_params else 2


@dataclass(frozen=True)
class Part:
    """One tensor kept for the backward (per block or for the whole model).

    region: what ``train.activation_checkpointing=selective`` recomputes: ``attention`` (the norm
    and attention sub-layer), ``experts`` (the grouped-GEMM MLP), ``rest`` (kept). dispatch: held
    by the dispatch/combine (the dispatch column) rather than an activation.
    """

    name: str
    nbytes: int
    region: str = "rest"
    dispatch: bool = False


@dataclass(frozen=True)
class Rows:
    """One MoE layer's rows on one rank, balanced routing: R the experts compute, J row segments
    of the grouped GEMM."""

    R: int
    J: int


def expert_rows(s: ModelShape, T: int, lay: Layout) -> Rows:
    P = T * s.K
    if lay.transport == "local":
        # LocalDispatcher packs every pair, the dropped ones last (moe/dispatch.py)
        return Rows(P, s.E)
    if lay.transport == "p2p" or lay.padded:
        # P2PDispatcher and the padded NCCL exchange hand the experts a fixed R_cap rows a dispatch
        # (parallel/p2p_dispatcher.py, parallel/dispatcher.py), one dispatch per chunk, all held
        # until the backward; one segment per local expert each
        return Rows(lay.chunks * received_rows_cap(s, T, lay), lay.chunks * s.E // lay.ep)
    # balanced routing: every rank sends and receives its T·K pairs, fewer when the capacity
    # C = capacity_factor·T·K / E per expert caps them
    kept = P if s.capacity_factor is None else min(P, math.ceil(s.capacity_factor * P))
    return Rows(kept, s.E // lay.ep)


def _norm(name: str, T: int, D: int, num: Numerics, region: str, nbytes: int = 4) -> list[Part]:
    parts = [Part(f"{name} input ({'fp32' if nbytes == 4 else 'bf16'})", T * D * nbytes, region),
             Part(f"{name} rstd", T * 4, region)]
    if not num.fused_norm:
        parts.append(Part(f"{name} x·rstd (composite rms_norm)", T * D * nbytes, region))
    return parts


def _mlp(name: str, T: int, D: int, hidden: int, s: ModelShape, num: Numerics, shares_input: bool) -> list[Part]:
    """moe.DenseMLP: its input (a cast copy of the fp32 norm output, or that output itself, which
    the router already keeps when ``shares_input``), the first matmul's output (SwiGLU: silu keeps
    the gate half, the product the up half), the activation's output and the product."""
    c = num.compute_bytes
    parts = [] if shares_input and not num.casts else [Part(f"{name} input", T * D * c)]
    parts.append(Part(f"{name} first matmul output", T * s.up(hidden) * c))
    if s.swiglu:
        parts += [Part(f"{name} silu(gate)", T * hidden * c), Part(f"{name} silu(gate)·up", T * hidden * c)]
    else:
        parts.append(Part(f"{name} gelu output", T * hidden * c))
    return parts


def block_parts(s: ModelShape, moe: bool, B: int, S: int, lay: Layout, num: Numerics) -> list[Part]:
    """What one block keeps for its backward without activation checkpointing."""
    T, D, c = B * S, s.D, num.compute_bytes
    nb = norm_bytes(lay, num)
    parts = _norm("attn_norm", T, D, num, "attention", nb) + [
        Part("qkv input", T * D * c, "attention"),
        # v is a view of the fused qkv output, so FlashAttention's saved v keeps all of it
        Part("qkv output (saved v is a view of it)", T * (s.H + 2 * s.Hkv) * s.Hd * c, "attention"),
        Part("q, k after RoPE", T * (s.H + s.Hkv) * s.Hd * c, "attention"),
        # rope_cos_sin builds the (S, Hd/2) cos and sin tables anew in every block; the products keep them
        Part("RoPE cos, sin tables", S * s.Hd * 4, "attention"),
        # o is empty_like(q) in (B, S, H, Hd) memory: the out projection's input is a view of it
        Part("attention output o", T * s.H * s.Hd * c, "attention"),
        Part("attention log-sum-exp (fp32)", T * s.H * 4, "attention"),
    ] + _norm("ffn_norm", T, D, num, "rest", nb)
    if not moe:
        return parts + _mlp("dense MLP", T, D, s.F_dense, s, num, shares_input=False)
    P, rows = T * s.K, expert_rows(s, T, lay)
    parts += [
        # the router's 3xTF32 kernel keeps the norm output as it is (fp32, or bf16 without a copy)
        Part("router input (the norm output)", T * D * nb),
        Part("router scores (softmax/sigmoid output)", T * s.E * 4),
        Part("router logits (z-loss logsumexp)", T * s.E * 4),
        Part("z-loss logsumexp", T * 4),
        Part("top-k indices", P * 8),
        Part("kept mask (bool)", P),
    ]
    if s.sigmoid:  # softmax scores enter the balancing loss as they are (moe.MoELayer._normalized)
        parts.append(Part("balancing-loss score sums", 2 * T * 4))
    if s.renormalize:
        parts.append(Part("chosen scores and their sums", P * 4 + 2 * T * 4))
    if s.F_shared:
        parts += _mlp("shared experts", T, D, s.F_shared, s, num, shares_input=True)
    U = s.up(s.F)
    parts += [
        # GroupedExperts casts the rows to the compute dtype; the expert MLP saves x and z (the
        # pre-activation); with SwiGLU in 16 bits it is one GroupedSwiGLUMLPFn, which recomputes
        # h in the backward, otherwise the second GEMM keeps its input h
        Part("expert pre-activation z", rows.R * U * c, "experts"),
        Part("grouped-GEMM offsets", rows.J * 4, "experts"),
    ]
    # (P2P's rows are copied out of its symmetric token buffer, in the compute dtype: the cast is
    # a no-op, the copy is kept as the others' casts are)
    parts.insert(len(parts) - 2, Part("expert rows (compute dtype)", rows.R * D * c, "experts"))
    if not (s.swiglu and c == 2):
        parts.append(Part("expert hidden h", rows.R * s.F * c, "experts"))
    # the experts weight their output rows (moe.Dispatcher.dispatch's w_R): the SwiGLU node keeps
    # the row weights (and so does the experts' checkpoint, an input of theirs: "rest"; P2P's are
    # a view of its symmetric memory, counted in p2p_buffer_bytes); the other paths scale the
    # output rows in a node that keeps them (what the weighted combine kept); the combine only sums
    if lay.transport != "p2p":
        parts.append(Part("expert row weights (fp32)", rows.R * 4))
    if not (s.swiglu and c == 2):
        parts.append(Part("expert output rows (row scaling)", rows.R * D * c, "experts"))
    if lay.transport == "local":
        parts += [Part("dispatch gather index", P * 8, dispatch=True),
                  Part("combine: row of each pair", P * 8, dispatch=True)]
    elif lay.transport == "nccl":
        # parallel/dispatcher.py: the row tables (K + ep entries a token) and each pair's rank,
        # and the row table of the tokens received (at most one per token of each other rank;
        # padded: a block of T rows from each)
        received = (lay.ep - 1) * (T if lay.padded else min(T, cdiv(rows.R, lay.ep)))
        parts += [Part("route: row tables and each pair's rank", (T * (s.K + lay.ep) + P) * 8, dispatch=True),
                  Part("row table of the received tokens", received * s.K * 8, dispatch=True)]
    else:  # parallel/p2p_dispatcher.py's _P2PRoute
        parts.append(Part("route: row, rank and token row of each pair", 3 * P * 8, dispatch=True))
    return parts


def root_parts(s: ModelShape, B: int, S: int, num: Numerics, lay: "Layout | None" = None) -> list[Part]:
    """What the embedding and the final norm keep."""
    T = B * S
    nb = norm_bytes(lay, num) if lay else 4
    return [Part("token ids (embedding)", T * 8)] + _norm("final norm", T, s.D, num, "rest", nb)


def head_weight_bytes(lay: "Layout | None") -> int:
    """Bytes per element of the LM head's weight as the forward reads it: the fp32 master, or under
    FSDP the root's gathered copy (param dtype)."""
    return lay.param_bytes if lay and lay.sharded else 4


def loss_parts(s: ModelShape, B: int, S: int, num: Numerics, lay: "Layout | None" = None) -> list[Part]:
    """train/lm_loss.py: the LM head and its cross-entropy compute their gradients in the forward
    and keep them, the input's in the final norm output's dtype and the weight's in its own."""
    T = B * S
    nb = norm_bytes(lay, num) if lay else 4
    return [Part("LM head + loss: gradient of its input", T * s.D * nb),
            Part("LM head + loss: gradient of the weight", s.V * s.D * head_weight_bytes(lay))]


def lm_head_forward_bytes(s: ModelShape, T: int, lay: Layout, num: Numerics) -> int:
    """The LM head and loss's forward at its largest on a GPU, besides what it keeps
    (train/lm_loss.py): the fp32 weight-gradient accumulator, plus the larger of one chunk's
    working set (n rows: the compute-dtype logits, which the Triton softmax pass overwrites with
    their gradient, no fp32 copy; the chunk's input cast; the weight gradient is accumulated into
    the fp32 sum by the GEMM itself, with no (V, D) product) and, when the weight is not fp32, the
    accumulator's cast to it at the end."""
    V, D, c = s.V, s.D, num.compute_bytes
    n = min(T, chunk_rows(V))
    cast_input = n * D * c if norm_bytes(lay, num) != c else 0
    chunk = cast_input + n * V * c
    wb = head_weight_bytes(lay)
    return V * D * 4 + max(chunk, V * D * wb if wb != 4 else 0)


def residual_bytes(s: ModelShape, i: int, lay: Layout) -> int:
    """Bytes per element of block i's input. fp32 masters: the embedding's fp32 output plus bf16
    sub-layer outputs stays fp32. bf16-gathered (fsdp): every block is an FSDP unit whose
    MixedPrecisionPolicy casts its forward inputs to param_dtype (cast_forward_inputs, the
    default), so the block sees (and its checkpoint keeps) bf16 whatever the stream's dtype."""
    return 2 if lay.bf16_params else 4


def checkpointed(parts: list[Part], s: ModelShape, i: int, B: int, S: int, lay: Layout,
                 num: Numerics = GPU_BF16) -> list[Part]:
    """What block i keeps under ``lay.checkpointing`` (train/model.py's Block): none: everything;
    selective: the attention sub-layer and the experts' MLP keep only their inputs (the block
    input; the rows and offsets); full: the block input only."""
    T = B * S
    block_input = Part("block input (checkpoint)", T * s.D * residual_bytes(s, i, lay))
    if lay.checkpointing == "full":
        return [block_input]
    if lay.checkpointing == "none":
        return parts
    kept = [p for p in parts if p.region == "rest"] + [block_input]
    if s.moe_blocks[i]:
        rows = expert_rows(s, T, lay)
        # the experts' checkpoint keeps the rows as dispatched: the norm output's rows (a gather,
        # or the all-to-all's receive buffer), in param_dtype when the experts are an FSDP unit
        # (bf16 FSDP computes in bf16, the dtype the dispatch casts the rows to); P2P's are copied
        # out of its token buffer in the rows' dtype
        rb = lay.param_bytes if lay.experts_sharded else norm_bytes(lay, num)
        rb = num.compute_bytes if lay.transport == "p2p" else rb
        kept.append(Part(f"expert input rows ({'fp32' if rb == 4 else 'bf16'}, checkpoint)", rows.R * s.D * rb,
                         dispatch=True))
        kept.append(Part("grouped-GEMM offsets", rows.J * 4))
    return kept


def saved_for_backward(cfg: Config, lay: Layout, num: Numerics = GPU_BF16, shape: ModelShape | None = None) -> list[Part]:
    """Every tensor one forward and its loss keep for the backward: each block's, then the root's."""
    s = shape or ModelShape.of(cfg)
    B, S = cfg.data.batch_size, cfg.data.seq_len
    blocks = [checkpointed(block_parts(s, moe, B, S, lay, num), s, i, B, S, lay, num)
              for i, moe in enumerate(s.moe_blocks)]
    return [p for parts in blocks for p in parts] + root_parts(s, B, S, num, lay) + loss_parts(s, B, S, num, lay)


@dataclass(frozen=True)
class BlockState:
    """One block's bytes: ``kept`` for its backward, what its backward holds besides, its weights.

    Its backward has two phases that do not overlap: the FFN's (the experts' or the MLP's
    backward, with what it recomputes) and then the attention sub-layer's."""

    kept: list[Part]
    recompute_ffn: int  # activations (and weight casts) rebuilt and alive during the FFN's backward
    recompute_attn: int  # ... during the attention sub-layer's backward
    workspace_ffn: int  # the FFN backward's incoming gradients, dgrad outputs and bf16 wgrad
    workspace_attn: int  # the attention backward's
    master: int  # fp32 master bytes on this rank (= gradient = one AdamW moment)
    expert_master: int  # of which the experts'
    dense_master: int  # of which the dense group's (the block's FSDP unit under fsdp)
    ignored_master: int  # of which FSDP leaves out of its units (routers; the experts at edp = 1)
    unit: int  # elements of the block's FSDP unit (its dense group), as gathered
    expert_unit: int  # elements of its experts' FSDP unit (edp > 1), as gathered
    ffn_unit: int  # of ``unit``, the FFN's part (ffn_norm, the dense or shared MLP)
    casts_kept: int  # bf16 weight casts its backward reads, kept from the forward (experts' aside)
    casts_forward: int  # bf16 weight casts alive at the end of the forward (autocast's cache)
    step_casts: int  # the experts' bf16 casts: made by the step's first forward, freed after its last backward


def _sum(parts: list[Part], dispatch: bool | None = None) -> int:
    return sum(p.nbytes for p in parts if dispatch is None or p.dispatch == dispatch)


def block_state(s: ModelShape, groups: dict, i: int, B: int, S: int, lay: Layout, num: Numerics) -> BlockState:
    """Block i's :class:`BlockState`; ``groups``: :func:`param_shapes` of ``s``."""
    T, D, c = B * S, s.D, num.compute_bytes
    moe = s.moe_blocks[i]
    masters = {kind: 4 * sum(local_numel(f"blocks.{i}.{kind}", shape, lay) for shape in groups[f"blocks.{i}.{kind}"])
               for kind in ("dense", "router", "experts")}
    master = sum(masters.values())
    ignored = masters["router"] + (masters["experts"] if lay.sharded and not lay.experts_sharded else 0)
    unit = sum(math.prod(shape) for shape in groups[f"blocks.{i}.dense"]) if lay.sharded else 0
    expert_unit = sum(unsharded_numel(f"blocks.{i}.experts", shape, lay) for shape in groups[f"blocks.{i}.experts"]
                      ) if lay.experts_sharded else 0

    # bf16 casts of fp32 weights (training in bf16 where a weight is an fp32 master, not a bf16
    # gathered copy: everywhere without FSDP, and the experts FSDP leaves out at edp = 1): autocast
    # casts every linear weight (the router runs with autocast off), GroupedExperts .to()s its own
    attn_w = (s.H + 2 * s.Hkv) * s.Hd * D + s.H * s.Hd * D
    hidden = s.F_shared if moe else s.F_dense
    mlp_w = (s.up(hidden) + hidden) * D if hidden else 0
    ffn_unit = (D + mlp_w) if lay.sharded else 0
    expert_w = s.E // lay.ep * (s.up(s.F) + s.F) * D if moe else 0
    cast = 2 if num.casts and not lay.bf16_params else 0
    expert_cast = 2 if num.casts and not (lay.bf16_params and lay.experts_sharded) else 0
    recomputed = {"none": (), "selective": ("attention", "experts"), "full": ("attention", "experts", "rest")}
    casts_by_region = {"attention": cast * attn_w, "experts": expert_cast * expert_w, "rest": cast * mlp_w}
    # the experts' casts of fp32 masters are made once per optimizer step and held to its end
    # (the trainer's moe.master_weight_step), whatever is recomputed: 2xH200 measured the selective
    # and full peaks of olmoe_bench 5.6 and 5.4 GiB above a model that had them recomputed per
    # block. master_weight_step leaves FSDP units alone: experts sharded over edp > 1 (cast, with
    # fp32 parameters, by every forward) keep the per-block rule.
    step_casts = casts_by_region["experts"] if not lay.experts_sharded else 0
    per_block = {**casts_by_region, "experts": casts_by_region["experts"] - step_casts}
    casts_kept = sum(b for r, b in per_block.items() if r not in recomputed[lay.checkpointing])
    # autocast caches linear-weight casts until the region exits; a per-block .to() of the
    # experts is not cached
    casts_forward = cast * (attn_w + mlp_w) + step_casts + (per_block["experts"] if lay.checkpointing == "none" else 0)

    parts = block_parts(s, moe, B, S, lay, num)
    kept = checkpointed(parts, s, i, B, S, lay, num)
    by_region = {r: _sum([p for p in parts if p.region == r]) + per_block[r] for r in per_block}
    rows = expert_rows(s, T, lay)
    U = s.up(s.F)
    # backward working sets: attention (dO, dq/dk/dv, the re-fused dqkv, delta); the experts' first
    # GEMM backward (dh, dz, dx and, from fp32 masters, the bf16 dw1 before its fp32 accumulate;
    # FSDP's unsharded gradients are counted with its buffers; the second GEMM's set is smaller
    # since U >= F); an MLP (dh, dz, dx); plus the residual gradient in and out (fp32)
    attn_ws = T * (s.H + 2 * (s.H + 2 * s.Hkv)) * s.Hd * c + T * s.H * 4
    expert_ws = rows.R * (s.F + U + D) * c + (s.E // lay.ep * D * U * expert_cast if moe else 0)
    mlp_ws = T * (s.up(hidden) + hidden + D) * c if hidden else 0
    workspace_ffn = max(expert_ws if moe else 0, mlp_ws) + 2 * T * D * 4
    workspace_attn = attn_ws + 2 * T * D * 4
    # the FFN's backward runs (and frees what it recomputed) before the attention sub-layer's;
    # full: the whole block is recomputed as its backward starts
    if lay.checkpointing == "full":
        recompute_ffn, recompute_attn = _sum(parts) + sum(per_block.values()), by_region["attention"]
    elif lay.checkpointing == "selective":
        recompute_ffn, recompute_attn = (by_region["experts"] if moe else 0), by_region["attention"]
    else:
        recompute_ffn = recompute_attn = 0
    return BlockState(kept, recompute_ffn, recompute_attn, workspace_ffn, workspace_attn, master, masters["experts"],
                      masters["dense"], ignored, unit, expert_unit, ffn_unit, casts_kept, casts_forward, step_casts)


def received_rows_cap(s: ModelShape, T: int, lay: Layout) -> int:
    """R_cap, the rows of each P2P receive buffer (what the trainer's P2PDispatcher allocates) and
    of the padded NCCL exchange's experts' input, per dispatch: ep·T_c·K for a chunk of T_c =
    ceil(T / chunks) tokens, or the capacity's bound over the layer's T where smaller (a chunk may
    hold all of an expert's kept pairs)."""
    T_c = cdiv(T, lay.chunks)
    return min(lay.ep * T_c * s.K, max_received_rows(T, s.E, s.K, s.capacity_factor, s.capacity_groups, lay.ep))


def p2p_buffer_bytes(s: ModelShape, T: int, lay: Layout, row_bytes: int) -> int:
    """P2PDispatcher's symmetric memory: one slot per MoE block and chunk (received token rows,
    returned rows, the received pairs' token rows and sources, their fp32 weights and the returned
    weight gradients, the count matrix, two flags; each region 256-byte aligned) and one gradient
    buffer of token rows per chunk, in the rows' dtype: the experts' (``row_bytes``; the dispatch
    casts the norm output to it). A chunk holds ceil(T / chunks) tokens."""
    if lay.transport != "p2p":
        return 0
    T_c = cdiv(T, lay.chunks)
    R_cap, P_cap = received_rows_cap(s, T, lay), T_c * s.K
    # a token's row crosses to a rank once each way: the receive, return and gradient buffers hold
    # one row per (rank, token)
    token_rows = lay.ep * T_c * s.D * row_bytes
    regions = [token_rows, token_rows, R_cap * 8, R_cap * 8, R_cap * 4, P_cap * 4, lay.ep * s.E * 8, 8, 8]
    slot = sum(cdiv(n, 256) * 256 for n in regions)
    return lay.chunks * (sum(s.moe_blocks) * slot + cdiv(token_rows, 256) * 256)


COLUMNS = ("params", "grads", "optimizer", "activations", "dispatch", "weights", "transient")


@dataclass(frozen=True)
class Moment:
    """Bytes per GPU at one moment of a training step, by column."""

    name: str
    params: int
    grads: int
    optimizer: int
    activations: int
    dispatch: int
    weights: int
    transient: int

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in COLUMNS)


@dataclass(frozen=True)
class Prediction:
    """The peak moment of a layout, every moment evaluated, and the bytes outside PyTorch's caching
    allocator (P2P symmetric memory: torch.cuda.max_memory_allocated does not count them)."""

    layout: Layout
    peak: Moment
    moments: list[Moment]
    outside_allocator: int


def layout_of(cfg: Config, world: int, data_parallel: str, checkpointing: str) -> Layout:
    p = cfg.parallel
    if cfg.train.precision == "fp32":
        raise ConfigError("train.precision=fp32: the memory model covers bf16 training on a GPU (fp32 runs the grouped "
                          "GEMM's PyTorch reference, which saves other tensors)")
    return Layout(world, p.ep, data_parallel, checkpointing, dispatcher=p.dispatcher, nccl_sizes=p.nccl_sizes,
                  reshard_after_forward=p.reshard_after_forward, param_bytes=4 if p.param_dtype == "fp32" else 2,
                  reduce_bytes=2 if p.reduce_dtype == "bf16" else 4, chunks=p.overlap_chunks)


def predict(cfg: Config, lay: Layout, shape: ModelShape | None = None, num: Numerics = GPU_BF16) -> Prediction:
    """The peak memory per GPU of ``cfg`` trained in layout ``lay`` (see the module docstring)."""
    s = shape or ModelShape.of(cfg)
    B, S, accum = cfg.data.batch_size, cfg.data.seq_len, cfg.train.grad_accum
    T, V, D = B * S, s.V, s.D
    n = len(s.moe_blocks)
    groups = param_shapes(s)
    blocks = [block_state(s, groups, i, B, S, lay, num) for i in range(n)]
    root_master = {g: 4 * sum(local_numel(g, shape, lay) for shape in groups[g]) for g in ("embed", "head", "norm")}
    root_unsharded = sum(math.prod(shape) for g in ("embed", "head", "norm") for shape in groups[g])
    params = sum(root_master.values()) + sum(b.master for b in blocks)
    optimizer = 2 * params
    root = _sum(root_parts(s, B, S, num, lay))
    grad_h = _sum(loss_parts(s, B, S, num, lay)[:1])  # the LM head's input gradient, written chunk by chunk
    p2p = p2p_buffer_bytes(s, T, lay, num.compute_bytes)  # rows move in the experts' dtype
    pb, rb = lay.param_bytes, lay.reduce_bytes

    # the LM head weight's cast (tied: the embedding's) lives through the LM head's forward only
    head_cast = 2 * V * D if num.casts and not lay.bf16_params else 0
    # FSDP: the root (embeddings, final norm, LM head) stays gathered from its forward through the
    # backward (parallel/fsdp.py: never resharded after the forward); a block's unit (its dense
    # group) and its experts' unit (edp > 1) are gathered in the param dtype; the routers, and the
    # experts at edp = 1, are not in any unit (ignored_params): nothing gathered, their masters read
    gathered = [(b.unit + b.expert_unit) * pb for b in blocks]
    root_gathered = root_unsharded * pb if lay.sharded else 0
    held = root_gathered + (0 if lay.reshard_after_forward else sum(gathered))
    # with gradient accumulation the gradients exist from the first micro-batch's backward on;
    # FSDP without sync between micro-batches accumulates its units' unsharded in the reduce dtype
    grads_before = 0
    if accum > 1:
        grads_before = params
        if lay.sharded:
            grads_before += (sum(b.unit + b.expert_unit for b in blocks) + root_unsharded) * rb
    step_casts = sum(b.step_casts for b in blocks)  # the experts' casts, held from the first forward to the last backward
    acts = [_sum(b.kept, dispatch=False) for b in blocks]
    disp = [_sum(b.kept, dispatch=True) for b in blocks]

    # the forward's last op is the LM head and loss (its backward only scales what it kept, in
    # place): every block's activations, autocast's cache of every linear-weight cast (the region
    # exits after the loss), the input gradient it fills and its chunk's working set; what it keeps
    # at the end (the weight's gradient) is never more than its fp32 accumulator was
    moments = [
        Moment("forward end (LM head + loss)", params, grads_before, optimizer, sum(acts) + root + grad_h,
               sum(disp) + p2p, held + head_cast + sum(b.casts_forward for b in blocks),
               lm_head_forward_bytes(s, T, lay, num)),
    ]
    # the head, the final norm and (tied) the embedding have their gradients once the blocks' begin;
    # FSDP reduce-scatters the root's only when the backward ends (its forward's input, the token
    # ids, needs no gradient, so its post-backward runs in the final callback): until then they are
    # unsharded in the param dtype
    root_grads = ("head", "norm") + (("embed",) if s.tied else ())
    grads_done = (pb * sum(math.prod(shape) for g in root_grads for shape in groups[g]) if lay.sharded
                  else sum(root_master[g] for g in root_grads))
    resid = 2 * T * D * 4  # the residual gradient in and out (fp32)
    for i in reversed(range(n)):
        b = blocks[i]
        acts_i, disp_i = sum(acts[:i + 1]) + T * 8, sum(disp[:i + 1]) + p2p  # + the embedding's token ids
        weights = root_gathered + sum(bb.casts_kept for bb in blocks[:i + 1]) + step_casts
        if not lay.sharded:
            grads_done += b.master
            # the FFN's backward and the attention's do not overlap
            work = max(b.workspace_ffn + b.recompute_ffn, b.workspace_attn + b.recompute_attn)
            moments.append(Moment(f"block {i} backward", params, max(grads_done, grads_before), optimizer,
                                  acts_i, disp_i, weights, work))
            continue
        if not lay.reshard_after_forward:
            weights += sum(gathered[:i])  # the blocks before it still hold their gathered copies
        own, own_x = b.unit * pb, b.expert_unit * pb
        # FSDP2 prefetches one unit ahead in the backward; the block's unit prefetches the one
        # before it in forward order (its experts' unit, else the previous block's), and the
        # experts' unit the previous block's: its all-gather output waits there for its copy-out
        # (none when nothing was resharded after the forward)
        prefetch = blocks[i - 1].unit * pb if i and lay.reshard_after_forward else 0
        # the last reduce-scatter's input (the block after it's unit) lives until the next one's
        prev_rs = blocks[i + 1].unit * rb if i + 1 < n else 0
        # sharded gradients exist once reduce-scattered; FSDP leaves routers' (and edp = 1 experts')
        # fp32 .grad to accumulate in the backward
        g_ffn = grads_done + b.ignored_master
        g_attn = grads_done + b.master - b.dense_master
        phases = []  # (phase, grads, FSDP buffers, working set + recomputed)
        if lay.reshard_after_forward:
            # pre-backward: the unit's copy-out (all-gather output + parameters), then the next prefetch
            phases.append(("unshard", grads_done, own + prev_rs + max(own, own_x or prefetch), resid))
            if b.expert_unit:
                # the experts' copy-out, while the combine's backward hands them the rows' gradient
                # (full: inside the block's recompute)
                rc = b.recompute_ffn if lay.checkpointing == "full" else 0
                phases.append(("experts unshard", g_ffn, own + 2 * own_x + prev_rs,
                               resid + expert_rows(s, T, lay).R * D * num.compute_bytes + rc))
        # the FFN's backward: the unsharded bf16 gradients of the experts' unit and the FFN's weights
        phases.append(("ffn", g_ffn, own + own_x + prefetch + prev_rs + pb * (b.expert_unit + b.ffn_unit),
                       b.workspace_ffn + b.recompute_ffn))
        if b.expert_unit:
            # the experts' post-backward: resharded, the previous input freed, then the reduce-scatter
            # input (reduce dtype) filled while their unsharded gradients live (Shard(1)'s
            # per-parameter torch.cat copy comes before and is smaller)
            rc = b.recompute_attn if lay.checkpointing == "full" else 0
            phases.append(("experts reduce-scatter", g_ffn,
                           own + prefetch + pb * b.ffn_unit + (pb + rb) * b.expert_unit,
                           resid + expert_rows(s, T, lay).R * D * num.compute_bytes + rc))
        # the attention's backward: the experts' reduce-scatter input (else the previous one) still
        # alive, the block's unsharded gradients
        phases.append(("attention", g_attn, own + prefetch + (b.expert_unit * rb or prev_rs) + pb * b.unit,
                       b.workspace_attn + b.recompute_attn))
        # the block's post-backward: resharded, the previous input freed, its reduce-scatter input
        phases.append(("reduce-scatter", g_attn, prefetch + (pb + rb) * b.unit, resid))
        grads_done += b.master
        best = max(phases, key=lambda ph: max(ph[1], grads_before) + ph[2] + ph[3])
        moments.append(Moment(f"block {i} backward ({best[0]})", params, max(best[1], grads_before), optimizer,
                              acts_i, disp_i, weights, best[2] + best[3]))
    if lay.sharded:
        # the final callback: the root's post-backward reshards it, frees block 0's reduce-scatter
        # input and fills its own from the root's unsharded gradients (the embedding's now too)
        moments.append(Moment("backward end (root reduce-scatter)", params,
                              max(sum(b.master for b in blocks), grads_before), optimizer, 0, p2p, step_casts,
                              (pb + rb) * root_unsharded))
    # the all-reduce flattens gradients into 64 MiB buckets, a larger gradient alone
    # (parallel/grad_sync.py); it runs before the step, whose fused AdamW allocates nothing; it
    # reduces what FSDP does not: every parameter when replicated, the routers under FSDP (the
    # experts only over an EDP group of more than one rank)
    bucket = 0
    if lay.world > 1:
        reduced = [4 * local_numel(g, shape, lay) for g, shapes in groups.items() for shape in shapes
                   if (g.endswith("router") or not lay.sharded) and (lay.edp > 1 or not g.endswith("experts"))]
        if reduced:
            bucket = max(max(reduced), min(BUCKET_BYTES, sum(reduced)))
    moments.append(Moment("grad sync + optimizer step", params, params, optimizer, 0, p2p, 0, bucket))
    peak = max(moments, key=lambda m: m.total)
    return Prediction(lay, peak, moments, p2p)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f}"


def table(predictions: list[Prediction], fit_gib: float | None = None) -> str:
    """A markdown table, one row per prediction: the columns at its peak moment, in GiB."""
    head = ["data parallel", "AC"] + list(COLUMNS) + ["total GiB", "peak at"] + (
        [f"fits {fit_gib:g} GiB"] if fit_gib else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in predictions:
        row = [p.layout.data_parallel, p.layout.checkpointing] + [_gib(getattr(p.peak, c)) for c in COLUMNS]
        row += [f"**{_gib(p.peak.total)}**", p.peak.name]
        if fit_gib:
            row.append("yes" if p.peak.total <= fit_gib * GiB else "no")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def describe(cfg: Config, world: int, shape: ModelShape | None = None) -> str:
    """One line: the model's size and the per-rank tokens and rows the table is for."""
    s = shape or ModelShape.of(cfg)
    total = sum(math.prod(shape) for shapes in param_shapes(s).values() for shape in shapes)
    T = cfg.data.batch_size * cfg.data.seq_len
    lay = layout_of(cfg, world, "replicate", "none")
    return (f"{total / 1e9:.2f}B parameters, {len(s.moe_blocks)} blocks ({sum(s.moe_blocks)} MoE), world {world}, "
            f"ep {cfg.parallel.ep} (edp {world // cfg.parallel.ep}), {cfg.parallel.dispatcher} | T = "
            f"{cfg.data.batch_size}·{cfg.data.seq_len} = {T} tokens/rank, grad_accum {cfg.train.grad_accum} | "
            f"expert rows R = {expert_rows(s, T, lay).R} per MoE layer (balanced routing)")


def detail(cfg: Config, lay: Layout, shape: ModelShape | None = None, num: Numerics = GPU_BF16) -> str:
    """The saved tensors of one MoE (else dense) block and of the root, and every moment's total."""
    s = shape or ModelShape.of(cfg)
    B, S = cfg.data.batch_size, cfg.data.seq_len
    i = s.moe_blocks.index(True) if any(s.moe_blocks) else 0
    state = block_state(s, param_shapes(s), i, B, S, lay, num)
    lines = [f"block {i} keeps ({lay.data_parallel}, AC {lay.checkpointing}), MiB:"]
    lines += [f"  {p.nbytes / 2**20:10.1f}  {p.name}{' [dispatch]' if p.dispatch else ''}" for p in state.kept]
    lines.append(f"  backward also: FFN phase recompute {state.recompute_ffn / 2**20:.1f}, working set "
                 f"{state.workspace_ffn / 2**20:.1f}; attention phase recompute {state.recompute_attn / 2**20:.1f}, "
                 f"working set {state.workspace_attn / 2**20:.1f}; bf16 weight casts kept {state.casts_kept / 2**20:.1f}, "
                 f"the experts' held for the step {state.step_casts / 2**20:.1f}")
    lines.append("root keeps, MiB:")
    lines += [f"  {p.nbytes / 2**20:10.1f}  {p.name}" for p in root_parts(s, B, S, num, lay) + loss_parts(s, B, S, num, lay)]
    lines.append("moments, GiB: " + ", ".join(f"{m.name} {_gib(m.total)}" for m in predict(cfg, lay, s, num).moments))
    return "\n".join(lines)


def predictions(cfg: Config, world: int, data_parallel: str | None = None, checkpointing: str | None = None,
                shape: ModelShape | None = None, num: Numerics = GPU_BF16) -> tuple[list[Prediction], list[str]]:
    """One prediction per (data-parallel mode × checkpointing), or only the ones given, that the
    config's checks allow (train.config.validate), and one line per combination they refuse."""
    done, refused = [], []
    for dp in [data_parallel] if data_parallel else DATA_PARALLEL:
        for ac in [checkpointing] if checkpointing else CHECKPOINTING:
            trial = copy.deepcopy(cfg)
            trial.parallel.data_parallel, trial.train.activation_checkpointing = dp, ac
            try:
                validate(trial, world)
            except ConfigError as err:
                refused.append(f"{dp} × {ac}: not allowed ({err})")
                continue
            done.append(predict(cfg, layout_of(cfg, world, dp, ac), shape, num))
    return done, refused


# Qwen3-30B-A3B: 48 MoE blocks (no dense one), GQA 32/4 heads of 128 (its q/k norms, 2·128
# parameters a block, are left out), 128 experts top-8 of width 768, untied 151,936-row vocabulary
QWEN3_30B_A3B = ["--model.dim=2048", "--model.n_layers=48", "--model.n_heads=32", "--model.n_kv_heads=4",
                 "--model.head_dim=128", "--model.vocab_size=151936", "--model.tie_embeddings=false",
                 "--moe.num_experts=128", "--moe.top_k=8", "--moe.hidden_dim=768"]
# DeepSeek-V3-shaped: 61 blocks, the first 3 dense (width 18432), 256 routed experts top-8 of width
# 2048 and 1 shared, sigmoid scores; its MLA attention is out of scope: modelled as attention
# with 128 query and 128 key/value heads of 128 (more attention weights than MLA's low-rank ones)
DEEPSEEK_V3 = ["--model.dim=7168", "--model.n_layers=61", "--model.n_heads=128", "--model.n_kv_heads=128",
               "--model.head_dim=128", "--model.vocab_size=129280", "--model.tie_embeddings=false",
               "--model.dense_hidden_dim=18432", "--moe.num_experts=256", "--moe.top_k=8", "--moe.hidden_dim=2048",
               "--moe.num_shared_experts=1", "--moe.score_func=sigmoid", "--moe.expert_bias=true"]
DEEPSEEK_V3_MOE_BLOCKS = (False,) * 3 + (True,) * 58
LONG_CONTEXT = ["--data.seq_len=4096", "--data.batch_size=1"]
LAYOUTS = [
    ("Qwen3-30B-A3B, 8 GPUs (one node), EP=8", QWEN3_30B_A3B + LONG_CONTEXT, 8, 8, None),
    ("Qwen3-30B-A3B, 4 nodes × 8, EP=8", QWEN3_30B_A3B + LONG_CONTEXT, 32, 8, None),
    ("Qwen3-30B-A3B, 4 nodes × 8, EP=32", QWEN3_30B_A3B + LONG_CONTEXT, 32, 32, None),
    ("DeepSeek-V3-shaped, 256 GPUs, EP=64", DEEPSEEK_V3 + LONG_CONTEXT, 256, 64, DEEPSEEK_V3_MOE_BLOCKS),
    ("DeepSeek-V3-shaped, 256 GPUs, EP=256", DEEPSEEK_V3 + LONG_CONTEXT, 256, 256, DEEPSEEK_V3_MOE_BLOCKS),
]


def layouts_report(fit_gib: float = FIT_GIB) -> str:
    """The tables of :data:`LAYOUTS` (seq 4096, batch 1 per GPU), each row marked by whether it fits
    an 80 GB GPU (``fit_gib``: what max_memory_allocated may reach there)."""
    out = []
    for title, overrides, world, ep, moe_blocks in LAYOUTS:
        cfg = load_config(overrides + [f"--parallel.ep={ep}"], world_size=world)
        shape = ModelShape.of(cfg, moe_blocks)
        done, refused = predictions(cfg, world, shape=shape)
        out += [f"### {title}", "", describe(cfg, world, shape), "", table(done, fit_gib), *refused, ""]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, help="W, GPUs of the run")
    parser.add_argument("--ep", type=int, help="expert-parallel size (default: the config's parallel.ep)")
    parser.add_argument("--data-parallel", choices=DATA_PARALLEL, help="one mode (default: both)")
    parser.add_argument("--ac", choices=CHECKPOINTING, help="one activation checkpointing setting (default: all three)")
    parser.add_argument("--layouts", action="store_true", help="the layouts we cannot run (Qwen3-30B-A3B, DeepSeek-V3)")
    parser.add_argument("--detail", action="store_true", help="each saved tensor of one block, and every moment")
    parser.add_argument("--torch", default=None, help="the torch version the run uses (default: the installed "
                        "one); before 2.12 autocast runs rms_norm in its input's dtype")
    args, rest = parser.parse_known_args(argv)
    num = gpu_numerics(args.torch or importlib.metadata.version("torch"))
    if args.layouts:
        print(layouts_report())
        return
    if args.world is None:
        parser.error("--world is required (or --layouts)")
    if args.ep is not None:
        rest.append(f"--parallel.ep={args.ep}")
    cfg = load_config(rest, world_size=args.world)
    print(describe(cfg, args.world) + "\n")
    results, refused = predictions(cfg, args.world, args.data_parallel, args.ac, num=num)
    print("\n".join([table(results), *refused]))
    if args.detail:
        for p in results:
            print("\n" + detail(cfg, p.layout, num=num))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
