"""FSDP2 × expert parallelism proven equal to one process, on the real model.

W spawned ranks (gloo on CPU; NCCL on 2 GPUs in the ``gpu`` test) build the training model of
``train.model`` through the trainer's own path (dispatcher → :func:`train.parallelize.parallelize`
→ optimizer), each on its own slice of a batch, and take one AdamW step with gradient clipping.
One process holds the whole model (all experts, no FSDP) and takes the same step on the
concatenated batch (``moe.capacity_groups = W`` reproduces each rank's capacity). Compared: the
mean loss, every gradient (gathered from its shards, before clipping), the gradient norm and every
parameter after the clipped step.

These are the tests that catch an expert gradient scaled by the wrong group size (FSDP divides by
its mesh, the EDP group, where the experts need the world: pytorch#160285, Megatron PR #5916), a
dense gradient reduced twice, or a norm that counts a shard twice.
"""

import dataclasses
import math
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from moe import moe_aux_loss
from parallel import ParallelDims, clip_grad_norm_
from tests.distributed import run_distributed
from train.config import Config
from train.model import MoETransformer
from train.optim import build_optimizer
from train.parallelize import parallelize, reduce_gradients

# max |ours - reference| / max |reference| (fp32 on CPU); on a GPU the layers run in bf16 with
# fp32 reductions, so the GPU test compares with a bf16 tolerance
TOLERANCE = {"cpu": 2e-5, "cuda": 3e-2}
# after one AdamW step a parameter moves by about lr wherever its gradient is not ~0. On CPU (fp32)
# the step's error is measured element-wise in units of lr: Adam divides by |g|, so the small
# elements of a gradient carry its rounding error relatively larger (worst measured: 1.1e-3 · lr,
# lm_head at W=4). In bf16 (GPU) an element whose gradient is rounding noise may step the other
# way (2 · lr), so there the update as a whole is compared: |Δ - Δref|₂ / |Δref|₂ (worst measured
# on 2×H200: 0.116, an attention out-projection; the reference keeps fp32 weights under autocast,
# FSDP computes with bf16 ones)
STEP_TOLERANCE = {"cpu": 1e-2, "cuda": 0.25}
SEQ, BATCH, LR, CLIP = 8, 2, 1e-2, 0.05


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    ep: int
    data_parallel: str = "fsdp"
    capacity_factor: float | None = None
    activation_checkpointing: str = "none"
    reshard_after_forward: bool = True
    tie_embeddings: bool = False


WORLD2 = [
    Case("ep2_fsdp_dropless", ep=2),
    Case("ep2_fsdp_capacity", ep=2, capacity_factor=1.0),
    Case("ep2_fsdp_capacity_zero2_tied", ep=2, capacity_factor=1.0, reshard_after_forward=False, tie_embeddings=True),
    Case("ep1_dp2_fsdp_capacity", ep=1, capacity_factor=1.0),
    Case("ep1_dp2_replicate", ep=1, data_parallel="replicate"),
    Case("ep2_replicate_capacity", ep=2, data_parallel="replicate", capacity_factor=1.0),
    Case("ep2_fsdp_selective_ac", ep=2, capacity_factor=1.0, activation_checkpointing="selective"),
    Case("ep2_fsdp_full_ac", ep=2, activation_checkpointing="full"),
]
WORLD4 = [
    Case("ep2_dp2_fsdp_dropless", ep=2),
    Case("ep2_dp2_fsdp_capacity", ep=2, capacity_factor=1.0),
    Case("ep4_fsdp_capacity", ep=4, capacity_factor=1.0),
    Case("ep1_dp4_fsdp_dropless", ep=1),
    Case("ep2_dp2_replicate_capacity", ep=2, data_parallel="replicate", capacity_factor=1.0),
]
WORLD8 = [
    Case("ep2_dp4_fsdp_capacity", ep=2, capacity_factor=1.0),
    Case("ep8_fsdp_dropless", ep=8),
    Case("ep4_dp2_fsdp_full_ac", ep=4, capacity_factor=1.25, activation_checkpointing="full"),
]


def _config(case: Case, world: int, ep: int, batch: int, capacity_groups: int, device) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.dim, m.n_layers, m.n_heads, m.dense_hidden_dim = 64, 32, 2, 2, 40
    m.tie_embeddings = case.tie_embeddings
    if device.type == "cuda":  # the Triton tiles' alignment
        m.dim, m.dense_hidden_dim = 64, 64
    e = cfg.moe
    e.num_experts, e.top_k, e.hidden_dim = 8, 2, 24 if device.type == "cpu" else 32
    e.capacity_factor, e.capacity_groups = case.capacity_factor, capacity_groups
    e.aux_loss_coef, e.z_loss_coef = 0.01, 1e-3
    cfg.parallel.ep, cfg.parallel.data_parallel = ep, case.data_parallel
    cfg.parallel.reshard_after_forward = case.reshard_after_forward
    cfg.train.activation_checkpointing = case.activation_checkpointing
    cfg.data.seq_len, cfg.data.batch_size = SEQ, batch
    cfg.optim.lr, cfg.optim.grad_clip = LR, CLIP
    return cfg


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _loss_and_grads(model, tokens, cfg, dims, device) -> tuple[torch.Tensor, dict]:
    """Forward, backward and the gradient reduction; the loss and every reduced gradient, whole."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    with autocast:
        logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + moe_aux_loss(model).to(device)
    loss.backward()
    reduce_gradients(model, dims)
    return loss.detach(), {n: _full(p.grad) for n, p in model.named_parameters()}


def _equivalence(case: Case, dims: ParallelDims, device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = world if case.capacity_factor is not None else 1
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (world * BATCH, SEQ + 1), generator=gen)

    ref_cfg = _config(case, world, 1, world * BATCH, groups, device)
    ref = MoETransformer(ref_cfg).to(device)
    ref.init_weights(3)
    ref_opt = build_optimizer(ref, ref_cfg.optim)
    loss_ref, ref_grads = _loss_and_grads(ref, tokens, ref_cfg, None, device)
    norm_ref = clip_grad_norm_(ref, CLIP, None)
    ref_before = {n: p.detach().float().cpu().clone() for n, p in ref.named_parameters()}
    ref_opt.step()

    cfg = _config(case, world, case.ep, BATCH, 1, device)
    model = MoETransformer(cfg, dispatcher=dims.dispatcher()).to(device)
    model.init_weights(3)
    model = parallelize(model, cfg, dims, device)
    opt = build_optimizer(model, cfg.optim)
    loss, grads = _loss_and_grads(model, tokens[rank * BATCH:(rank + 1) * BATCH], cfg, dims, device)
    dist.all_reduce(loss)
    norm = clip_grad_norm_(model, CLIP, dims, optimizer=opt)  # the reference clips the gradients, this the step
    opt.step()
    params = {n: _full(p) for n, p in model.named_parameters()}

    num_local = cfg.moe.num_experts // dims.ep
    lo = dims.ep_rank * num_local

    def mine(name: str, t: torch.Tensor) -> torch.Tensor:
        return t[lo:lo + num_local] if ".experts." in name else t

    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    errors = {"loss": _rel(loss.cpu() / world, loss_ref.cpu()), "grad_norm": _rel(norm.cpu(), norm_ref.cpu())}
    for name in ref_grads:
        errors[f"grad:{name}"] = _rel(grads[name], mine(name, ref_grads[name]))
    step_errors = {}
    for name, p in ref.named_parameters():
        after, before = mine(name, p.detach().float().cpu()), mine(name, ref_before[name])
        if device.type == "cpu":
            step_errors[f"param:{name}"] = float((params[name] - after).abs().max() / LR)
        else:
            step_errors[f"param:{name}"] = float((params[name] - after).norm() / (after - before).norm())
    return {
        "errors": errors, "step_errors": step_errors,
        "exact": {
            "clipped": bool(norm_ref > CLIP),  # the clipping path is exercised
            "every_parameter_moved": all(not torch.equal(p.detach().float().cpu(), ref_before[n])
                                         for n, p in ref.named_parameters()),
            # under FSDP everything but the routers (and the experts at EP = W) is sharded
            # a fused AdamW step (GPU) refuses a group mixing plain tensors and DTensors
            "optimizer_groups_homogeneous": all(
                len({p.device_mesh if isinstance(p, DTensor) else None for p in g["params"]}) == 1
                for g in opt.param_groups),
            "sharded_iff_fsdp": bool(sharded) == (case.data_parallel == "fsdp")
            and not any(".router." in n for n in sharded)
            and any(".experts." in n for n in sharded) == (case.data_parallel == "fsdp" and dims.edp > 1),
        },
    }


def _run_cases(rank: int, world: int, cases: list[Case]) -> dict:
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    dims_by_ep = {ep: ParallelDims(world, ep).build_mesh(device.type) for ep in sorted({c.ep for c in cases})}
    results = {}
    for case in cases:
        try:
            results[case.name] = _equivalence(case, dims_by_ep[case.ep], device)
        except Exception:
            results[case.name] = {"exception": traceback.format_exc()}
        results[case.name]["device"] = device.type
    return results


def _check(all_ranks: list[dict], name: str) -> None:
    for rank, results in enumerate(all_ranks):
        res = results[name]
        assert "exception" not in res, f"rank {rank}:\n{res['exception']}"
        tol, step_tol = TOLERANCE[res["device"]], STEP_TOLERANCE[res["device"]]
        bad = {k: v for k, v in res["errors"].items() if not v <= tol}
        assert not bad, f"rank {rank}: errors over {tol}: {bad}"
        bad = {k: v for k, v in res["step_errors"].items() if not v <= step_tol}
        assert not bad, f"rank {rank}: parameters after the step differ by more than {step_tol}·lr: {bad}"
        wrong = [k for k, ok in res["exact"].items() if not ok]
        assert not wrong, f"rank {rank}: {wrong}"


def _row_weight_dtypes(rank: int, world: int) -> dict:
    """EP 1 × DP 2 under FSDP with bf16 parameters on CPU: the experts are an FSDP unit of their
    own, and the local dispatcher hands them the combine weights; the dtypes they arrive in."""
    from moe.experts import GroupedExperts

    dims = ParallelDims(world, 1).build_mesh("cpu")
    cfg = _config(Case("ep1_bf16", ep=1), world, 1, BATCH, 1, torch.device("cpu"))
    cfg.parallel.param_dtype = "bf16"
    model = MoETransformer(cfg, dispatcher=dims.dispatcher())
    model.init_weights(3)
    model = parallelize(model, cfg, dims, torch.device("cpu"))
    seen = []
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.register_forward_pre_hook(lambda _, args: seen.append((str(args[0].dtype), str(args[2].dtype))))
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return {"seen": seen, "loss": float(loss)}


def test_fsdp_bf16_experts_unit_keeps_fp32_row_weights():
    """FSDP's default mixed precision casts a unit's floating inputs to param_dtype: the combine
    weights would reach the experts in bf16 (which they refuse). The experts' unit does not cast."""
    for res in run_distributed(_row_weight_dtypes, 2, timeout_s=120.0):
        assert res["seen"] and all(s == ("torch.bfloat16", "torch.float32") for s in res["seen"]), res["seen"]
        assert math.isfinite(res["loss"])


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_run_cases, 2, WORLD2, timeout_s=120.0)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_run_cases, 4, WORLD4, timeout_s=120.0)


@pytest.mark.parametrize("case", [c.name for c in WORLD2])
def test_world2_fsdp_equals_one_process(world2, case):
    _check(world2, case)


@pytest.mark.parametrize("case", [c.name for c in WORLD4])
def test_world4_fsdp_equals_one_process(world4, case):
    _check(world4, case)


@pytest.mark.slow
@pytest.mark.extended
def test_world8_fsdp_equals_one_process():
    results = run_distributed(_run_cases, 8, WORLD8, timeout_s=300.0)
    for case in WORLD8:
        _check(results, case.name)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nccl_two_gpus_fsdp_equals_one_process():
    results = run_distributed(_run_cases, 2, WORLD2, backend="nccl", timeout_s=120.0)
    for case in WORLD2:
        _check(results, case.name)
