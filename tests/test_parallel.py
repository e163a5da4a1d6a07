"""Expert parallelism proven equal to one process.

N spawned ranks (gloo on CPU; NCCL on 2 GPUs in the ``gpu`` test) run a tiny model
``head(x + MoELayer(x))`` with the experts split over the EP group, sync the gradients, and compare
with one process holding all experts on the concatenated batch (same weights, capacity per rank
reproduced by ``capacity_groups=N``): the layer output, the load-balancing loss, the mean loss,
every parameter's gradient, the global stats and the expert-bias update. And a layer's two
reductions (the loss's inputs over the world, the counts over the EP group): one all-reduce when
the two groups are the same ranks, with the same bits as two.

Each world size is spawned once (module fixture) and runs every case; a case reports its errors
as data, so one failing case does not hide the others.
"""

import dataclasses
import functools
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from moe import MoELayer, update_expert_biases
from moe.dispatch import Dispatcher
from moe.stats import MoEStats
from parallel import (
    ParallelDims, all_reduce_sum, all_to_all, global_moe_stats, sync_gradients, update_expert_biases_global,
)
from parallel import flight
from tests.distributed import run_distributed
from tests.peers import share_one_gpu

# max |ours - reference| / max |reference|, per (device type, dtype). fp32 on CUDA: Triton's
# fp32 dot may run in TF32, and the tile config may differ between row counts.
TOLERANCE = {
    ("cpu", torch.float32): 2e-5,
    ("cuda", torch.float32): 5e-3,
    ("cuda", torch.bfloat16): 4e-2,
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    ep: int
    num_experts: int = 4
    top_k: int = 2
    tokens: tuple[int, ...] | int = 12  # per rank; a tuple gives each rank its own count
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    score_func: str = "softmax"
    activation: str = "swiglu"
    route: str = "random"  # "one_expert": every token's first choice is expert 0;
    # "first_rank": every choice is an expert of EP rank 0 (the other ranks receive nothing)
    expert_bias: bool = False
    z_loss_coef: float = 1e-3
    overlap_chunks: int = 1  # the dispatcher pipelines each layer's tokens in this many chunks
    padded: bool = False  # the nccl dispatcher's padded exchange (blocks of max_tokens rows, no host sync)


EXPERT_SCALE = 10.0  # the experts' init gives outputs ~1e-3 of the residual's at these sizes
DIM, HIDDEN = 16, 12  # CPU: odd hidden width; on CUDA the aligned sizes the Triton GEMM tiles
GPU_DIM, GPU_HIDDEN = 64, 32

# how long a P2P rank waits for its peer: in the first runs of two ranks sharing one GPU (a cold
# Triton cache) one rank waited over the dispatcher's default 120 s while the other autotuned (H100)
P2P_TIMEOUT_S = 600.0
WORLD2 = [
    Case("dropless", ep=2),
    Case("capacity_probs", ep=2, capacity_factor=1.0),
    Case("capacity_position_sigmoid_gelu", ep=2, num_experts=6, top_k=3, capacity_factor=0.75,
         drop_policy="position", score_func="sigmoid", activation="gelu"),
    Case("all_to_one_expert", ep=2, top_k=1, route="one_expert"),
    Case("all_to_one_expert_capacity", ep=2, top_k=1, route="one_expert", capacity_factor=1.5),
    Case("rank1_receives_nothing", ep=2, route="first_rank"),
    Case("zero_token_rank", ep=2, tokens=(10, 0), z_loss_coef=0.0),
    Case("expert_bias", ep=2, expert_bias=True, capacity_factor=1.0),
    Case("overlap_2_chunks", ep=2, tokens=(13, 9), overlap_chunks=2, z_loss_coef=0.0),
    Case("overlap_3_chunks_capacity", ep=2, num_experts=6, top_k=3, capacity_factor=0.75, overlap_chunks=3),
    Case("overlap_fewer_tokens_than_chunks", ep=2, tokens=(2, 0), overlap_chunks=3, z_loss_coef=0.0),
    Case("overlap_rank1_receives_nothing", ep=2, route="first_rank", overlap_chunks=2),
    Case("padded_dropless", ep=2, tokens=(13, 9), z_loss_coef=0.0, padded=True),
    Case("padded_capacity_position_gelu", ep=2, num_experts=6, top_k=3, capacity_factor=0.75,
         drop_policy="position", activation="gelu", padded=True),
    Case("padded_all_to_one_expert", ep=2, top_k=1, route="one_expert", padded=True),
    Case("padded_rank1_receives_nothing", ep=2, route="first_rank", padded=True),
    Case("padded_zero_token_rank_3_chunks", ep=2, tokens=(10, 0), overlap_chunks=3, z_loss_coef=0.0, padded=True),
]
WORLD4 = [
    Case("ep2_dp2_dropless", ep=2),
    Case("ep2_dp2_capacity", ep=2, num_experts=6, capacity_factor=1.0),
    Case("ep2_dp2_zero_token_ranks", ep=2, tokens=(8, 0, 6, 0), z_loss_coef=0.0),
    Case("ep2_dp2_one_expert_capacity", ep=2, top_k=1, route="one_expert", capacity_factor=1.0),
    Case("ep2_dp2_expert_bias", ep=2, expert_bias=True),
    Case("ep4_dp1_dropless", ep=4, num_experts=8),
    Case("ep4_dp1_capacity", ep=4, num_experts=8, capacity_factor=1.25, drop_policy="position"),
    Case("ep4_dp1_first_rank_only", ep=4, num_experts=8, route="first_rank"),
    Case("ep2_dp2_overlap_capacity", ep=2, num_experts=6, capacity_factor=1.0, overlap_chunks=2),
    Case("ep1_dp4_capacity", ep=1, capacity_factor=1.0),
    Case("ep4_capacity_3_chunks", ep=4, num_experts=8, top_k=3, capacity_factor=0.75, overlap_chunks=3),
    Case("ep4_zero_token_ranks_2_chunks", ep=4, num_experts=8, tokens=(9, 0, 5, 0), overlap_chunks=2,
         z_loss_coef=0.0),
    Case("ep4_top5_more_pairs_than_ranks", ep=4, num_experts=8, top_k=5, capacity_factor=1.0, drop_policy="position"),
    Case("padded_ep4_capacity_2_chunks", ep=4, num_experts=8, top_k=3, capacity_factor=1.0, overlap_chunks=2,
         padded=True),
    Case("padded_ep4_uneven_tokens", ep=4, num_experts=8, tokens=(9, 0, 5, 7), z_loss_coef=0.0, padded=True),
    Case("padded_ep2_dp2_expert_bias", ep=2, expert_bias=True, capacity_factor=1.0, padded=True),
]


class Tiny(nn.Module):
    def __init__(self, case: Case, dispatcher, capacity_groups: int, device, dtype, dim: int, hidden: int):
        super().__init__()
        self.moe = MoELayer(
            dim, hidden, case.num_experts, case.top_k, capacity_factor=case.capacity_factor,
            drop_policy=case.drop_policy, capacity_groups=capacity_groups, activation=case.activation,
            score_func=case.score_func, expert_bias=case.expert_bias, num_shared_experts=1,
            z_loss_coef=case.z_loss_coef, dispatcher=dispatcher, device=device, dtype=dtype,
        )
        self.head = nn.Linear(dim, dim, device=device, dtype=dtype)
        self.moe.shared_experts.register_forward_hook(lambda _m, _i, out: setattr(self, "shared_out", out))

    def forward(self, x):
        # the routed experts' output, kept for its own comparison: at this init it is ~1e-3 of the
        # output (and of the shared expert's), so an error in the exchanged rows hides in theirs
        moe_out = self.moe(x)
        self.routed_out = moe_out - self.shared_out.to(moe_out.dtype)
        return self.head(x + moe_out)


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double().cpu(), ref.detach().double().cpu()
    if ours.shape != ref.shape:
        return float("inf")
    if ref.numel() == 0:
        return 0.0
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def _force_routes(model: Tiny, case: Case, num_local: int) -> None:
    with torch.no_grad():
        w = model.moe.router.weight
        if case.route == "one_expert":
            w[0] = 1.0  # x has mean +1 in every feature: expert 0's logit ~D dominates
        elif case.route == "first_rank":
            w[:num_local] = 1.0 + 0.3 * torch.randn_like(w[:num_local])


def _dispatcher(dims: ParallelDims, transport: str, case: Case, tokens: tuple[int, ...]):
    if transport in ("p2p", "p2p_copy_engine"):
        from parallel.p2p_dispatcher import P2PDispatcher
        # sized by the case's capacity, as the trainer does: the capped cases run in buffers smaller
        # than dropless's (a bound too small traps there)
        return P2PDispatcher(dims.ep_group, dims.world_group, max_tokens=max(max(tokens), 1), timeout_s=P2P_TIMEOUT_S,
                             capacity_factor=case.capacity_factor, overlap_chunks=case.overlap_chunks,
                             copy_engine=transport == "p2p_copy_engine")
    if case.padded:  # capacity_groups as the layers': the one-process reference's groups are the ranks
        return dims.dispatcher(case.overlap_chunks, max(max(tokens), 1), case.capacity_factor)
    return dims.dispatcher(case.overlap_chunks)


def _equivalence(case: Case, dims: ParallelDims, device, dtype, transport: str = "nccl") -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = case.tokens if isinstance(case.tokens, tuple) else (case.tokens,) * world
    total = sum(tokens)
    start = sum(tokens[:rank])
    num_local = case.num_experts // dims.ep
    lo, hi = dims.ep_rank * num_local, (dims.ep_rank + 1) * num_local
    groups = world if case.capacity_factor is not None else 1
    dim, hidden = (GPU_DIM, GPU_HIDDEN) if device.type == "cuda" else (DIM, HIDDEN)

    gen = torch.Generator().manual_seed(1234)
    x_all = (torch.randn(total, dim, generator=gen) + (1.0 if case.route != "random" else 0.0)).to(device, dtype)
    target_all = torch.randn(total, dim, generator=gen).to(device, dtype)
    torch.manual_seed(99)
    ref = Tiny(case, None, groups, device, dtype, dim, hidden)
    _force_routes(ref, case, num_local)
    with torch.no_grad():  # the routed path at the scale of the others, so its errors show in every gradient
        for p in ref.moe.experts.parameters():
            p.mul_(EXPERT_SCALE)
    par = Tiny(case, _dispatcher(dims, transport, case, tokens), 1, device, dtype, dim, hidden)
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for name, p in par.named_parameters():
            src = ref_params[name]
            p.copy_(src[lo:hi] if name.startswith("moe.experts.") else src)

    # one process, concatenated batch, loss = mean over all tokens + aux
    x_ref = x_all.clone().requires_grad_()
    out_ref = ref(x_ref)
    loss_ref = ((out_ref.float() - target_all.float()) ** 2).mean(-1).mean() + ref.moe.last_aux.loss
    loss_ref.backward()

    # W ranks: each loss is (W / total) · Σ over its tokens, so the mean over ranks is the global mean
    x = x_all[start:start + tokens[rank]].clone().requires_grad_()
    out = par(x)
    per_token = ((out.float() - target_all[start:start + tokens[rank]].float()) ** 2).mean(-1)
    loss = per_token.sum() * (world / total) + par.moe.last_aux.loss
    loss.backward()
    sync_gradients(par, dims)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world

    errors = {
        "output": _rel_err(out, out_ref[start:start + tokens[rank]]),
        "routed_output": _rel_err(par.routed_out, ref.routed_out[start:start + tokens[rank]]),
        "lb_loss": _rel_err(par.moe.last_aux.load_balancing_loss, ref.moe.last_aux.load_balancing_loss),
        "mean_loss": _rel_err(mean_loss, loss_ref),
        # the rank's input gradient is that of its own loss: N times the mean's
        "grad:input": _rel_err(x.grad / world, x_ref.grad[start:start + tokens[rank]]),
    }
    for name, p in par.named_parameters():
        g_ref = ref_params[name].grad
        errors[f"grad:{name}"] = _rel_err(p.grad, g_ref[lo:hi] if name.startswith("moe.experts.") else g_ref)

    ref_stats = ref.moe.last_aux.stats
    world_stats = global_moe_stats(par, dims)["moe"]
    exact = {
        "global_routed_per_expert": torch.equal(world_stats.routed_per_expert.cpu(), ref_stats.routed_per_expert.cpu()),
        "global_tokens_per_expert": torch.equal(world_stats.tokens_per_expert.cpu(), ref_stats.tokens_per_expert.cpu()),
        "global_dropped_fraction": torch.equal(world_stats.dropped_fraction.cpu(), ref_stats.dropped_fraction.cpu()),
        "some_pairs_kept": bool(ref_stats.tokens_per_expert.sum() > 0),
    }
    if case.capacity_factor is not None:
        exact["some_pairs_dropped"] = bool(ref_stats.dropped_pairs > 0)
    if dims.edp == 1:  # the layer's own EP-group counts are then the global ones
        exact["layer_tokens_per_expert"] = torch.equal(
            par.moe.last_aux.stats.tokens_per_expert.cpu(), ref_stats.tokens_per_expert.cpu())
    if case.route == "first_rank" and dims.ep_rank != 0:
        exact["received_nothing"] = int(par.moe.last_aux.stats.tokens_per_expert[lo:hi].sum()) == 0
    if case.expert_bias:
        update_expert_biases(ref)
        update_expert_biases_global(par, dims)
        exact["expert_bias"] = torch.equal(par.moe.router.expert_bias.cpu(), ref.moe.router.expert_bias.cpu())
        exact["bias_moved"] = bool(ref.moe.router.expert_bias.abs().sum() > 0)
    return {"errors": errors, "exact": exact}


def _not_divisible(dims: ParallelDims, num_experts: int, device) -> dict:
    messages = []
    for build in (lambda: dims.check_experts(num_experts),
                  lambda: MoELayer(DIM, HIDDEN, num_experts, 1, dispatcher=dims.dispatcher(), device=device)):
        try:
            build()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    # no collective was left half-issued: the group still works
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    return {"messages": messages, "probe": probe.item()}


def _all_to_all_op(device) -> dict:
    """Uneven and zero splits; rows encode (source, destination, index). Backward = reverse."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sends = [(rank + 2 * dst) % 3 for dst in range(world)]  # 0, 1 or 2 rows, some zero

    def rows(src, dst, n):
        return [[src, dst, i, 1.5] for i in range(n)]

    x = torch.tensor(sum((rows(rank, d, n) for d, n in enumerate(sends)), []), dtype=torch.float32,
                     device=device).reshape(-1, 4).requires_grad_()
    recv = [(src + 2 * rank) % 3 for src in range(world)]
    out = all_to_all(x, recv, sends)
    expected = torch.tensor(sum((rows(s, rank, n) for s, n in enumerate(recv)), []), dtype=torch.float32).reshape(-1, 4)
    (0.5 * out.pow(2).sum()).backward()  # grad_out = out; the reverse exchange returns x itself
    scale = torch.full((3,), float(rank + 1), device=device, requires_grad=True)
    (all_reduce_sum(scale) * (rank + 1)).sum().backward()
    return {
        "forward": torch.equal(out.detach().cpu(), expected),
        "backward": torch.equal(x.grad, x.detach()),
        "all_reduce_forward": bool((scale.detach() == rank + 1).all()),
        "all_reduce_backward": torch.equal(scale.grad.cpu(), torch.full((3,), world * (world + 1) / 2)),
    }


def _reduction_inputs(rank: int, num_experts: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(routed_E, kept_E, prob_sum_E, T) of rank ``rank``: each differs by rank (a sum over the
    wrong ranks shows), kept differs from routed (a swap shows), counts past 2^40 (exact only in
    fp64, not in the fp32 of the probabilities)."""
    routed_E = torch.arange(num_experts, device=device) * (rank + 1) + 2**40 + 3 * rank
    kept_E = routed_E // 2 + rank
    prob_sum_E = torch.linspace(0.1, 0.9, num_experts, device=device) * (rank + 1)
    return routed_E, kept_E, prob_sum_E, 5 + rank


def _counting_all_reduces(fn):
    """fn()'s result, the dtypes of the ``dist.all_reduce`` calls it made and the collectives it
    recorded in the flight recorder."""
    calls, real, seq = [], dist.all_reduce, flight.RECORDER.seq

    def counting(tensor, *args, **kwargs):
        calls.append(str(tensor.dtype).removeprefix("torch."))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        result = fn()
    finally:
        dist.all_reduce = real
    return result, calls, [e.op for e in flight.RECORDER.entries if e.seq > seq]


def _layer_reductions(dims: ParallelDims, device) -> dict:
    """The dispatcher's reduce_aux_and_counts against its two calls (reduce_aux_inputs,
    reduce_counts) on the same inputs and against sums of every rank's inputs; then a layer's
    forward and backward with it and with the base Dispatcher's two calls: the all-reduces each
    forward issues, and whether the output, losses, stats and router gradient are the same bits."""
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = 4
    disp = dims.dispatcher()
    routed_E, kept_E, prob_sum_E, T = _reduction_inputs(rank, num_experts, device)
    prob_fused, prob_two = prob_sum_E.clone().requires_grad_(), prob_sum_E.clone().requires_grad_()
    fused, calls, ops = _counting_all_reduces(lambda: disp.reduce_aux_and_counts(routed_E, kept_E, prob_fused, T))
    two = (*disp.reduce_aux_inputs(routed_E, prob_two, T), disp.reduce_counts(torch.stack([routed_E, kept_E])))
    cotangent_E = torch.arange(1.0, num_experts + 1, device=device)
    (fused[1] * cotangent_E).sum().backward()
    (two[1] * cotangent_E).sum().backward()
    inputs = [_reduction_inputs(r, num_experts, device) for r in range(world)]
    ep_counts_2E = sum(torch.stack(inputs[r][:2]) for r in dist.get_process_group_ranks(dims.ep_group))
    out = {
        "all_reduces": calls,
        "ops": ops,
        "same_as_two_calls": all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(fused, two)),
        "same_gradient": torch.equal(prob_fused.grad, prob_two.grad),
        "routed_is_world_sum": torch.equal(fused[0], sum(i[0] for i in inputs)),
        "tokens_are_world_sum": fused[2].item() == sum(i[3] for i in inputs),
        "counts_are_ep_sums": fused[3].dtype == torch.int64 and torch.equal(fused[3], ep_counts_2E),
        "counts_are_world_sums": torch.equal(fused[3], sum(torch.stack(i[:2]) for i in inputs)),
    }

    torch.manual_seed(5)
    dim, hidden = (GPU_DIM, GPU_HIDDEN) if device.type == "cuda" else (DIM, HIDDEN)
    layer = MoELayer(dim, hidden, num_experts, 2, capacity_factor=1.0, dispatcher=disp, device=device)
    x = torch.randn(12, dim, generator=torch.Generator().manual_seed(rank)).to(device)
    runs = []
    for path in ("layer", "two_calls"):
        if path == "two_calls":
            disp.reduce_aux_and_counts = functools.partial(Dispatcher.reduce_aux_and_counts, disp)
        layer.zero_grad(set_to_none=True)
        (y, aux), calls, _ = _counting_all_reduces(lambda: layer.forward_with_aux(x))
        (y.square().sum() + aux.loss).backward()
        runs.append((calls, y, aux, layer.router.weight.grad))
    (calls, y, aux, grad), (two_calls, y_two, aux_two, grad_two) = runs
    same = {"output": torch.equal(y, y_two), "router_grad": torch.equal(grad, grad_two)}
    for name in ("load_balancing_loss", "z_loss", "loss"):
        same[name] = torch.equal(getattr(aux, name), getattr(aux_two, name))
    for name in MoEStats.NAMES:
        a, b = getattr(aux.stats, name), getattr(aux_two.stats, name)
        same[f"stats.{name}"] = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    out["layer_all_reduces"] = [calls, two_calls]
    out["layer_differs_in"] = [k for k, ok in same.items() if not ok]
    out["layer_dropped_pairs"] = int(aux.stats.dropped_pairs)
    return out


def _one_reduction_across_groups(rank: int) -> list[bool]:
    """Whether a dispatcher sums a layer in one collective, for (EP group, world group) pairs of 2
    ranks each out of 4: the same ranks (yes), and groups of equal size but other ranks (no: the
    counts would be summed over the wrong ranks)."""
    from parallel import AllToAllDispatcher

    pairs = [[0, 1], [2, 3]], [[0, 2], [1, 3]]  # every rank makes every group, in one order
    groups = [[dist.new_group(ranks) for ranks in pair] for pair in pairs]
    ep = groups[0][rank // 2]
    same, other = ep, groups[1][rank % 2]
    return [AllToAllDispatcher(ep, world)._one_reduction for world in (same, other)]


def _run_cases(rank: int, world: int, cases: list[Case], dtypes: list[torch.dtype], not_divisible: list[tuple[int, int]],
               transport: str = "nccl", share_gpu: bool = False) -> dict:
    """``share_gpu``: every rank of the gloo group on cuda:0 (tests/peers.share_one_gpu); gloo
    moves CUDA tensors through the host, so the nccl transport's dispatcher runs there too."""
    if share_gpu:
        share_one_gpu()
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    dims_by_ep = {}
    for ep in sorted({c.ep for c in cases} | {ep for ep, _ in not_divisible}):  # same order on every rank
        dims_by_ep[ep] = ParallelDims(world, ep).build_mesh()
    results = {"all_to_all_op": _all_to_all_op(device)}
    for ep, dims in dims_by_ep.items():
        try:
            results[f"reductions_ep{ep}"] = _layer_reductions(dims, device)
        except Exception:
            results[f"reductions_ep{ep}"] = {"exception": traceback.format_exc()}
    if world == 4:
        results["one_reduction_across_groups"] = _one_reduction_across_groups(rank)
    for ep, num_experts in not_divisible:
        results[f"not_divisible_ep{ep}_E{num_experts}"] = _not_divisible(dims_by_ep[ep], num_experts, device)
    for dtype in dtypes:
        for case in cases:
            key = f"{case.name}:{str(dtype).removeprefix('torch.')}"
            try:
                results[key] = _equivalence(case, dims_by_ep[case.ep], device, dtype, transport)
            except Exception:
                results[key] = {"exception": traceback.format_exc()}
            results[key]["tolerance"] = TOLERANCE[(device.type, dtype)]
    return results


def _check_case(all_ranks: list[dict], key: str) -> None:
    for rank, results in enumerate(all_ranks):
        res = results[key]
        assert "exception" not in res, f"rank {rank}:\n{res.get('exception')}"
        bad = {k: v for k, v in res["errors"].items() if not v <= res["tolerance"]}
        assert not bad, f"rank {rank}: errors over {res['tolerance']}: {bad}"
        wrong = [k for k, ok in res["exact"].items() if not ok]
        assert not wrong, f"rank {rank}: mismatched {wrong}"


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_run_cases, 2, WORLD2, [torch.float32], [(2, 3)], timeout_s=60.0)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_run_cases, 4, WORLD4, [torch.float32], [(2, 3), (4, 6)], timeout_s=60.0)


@pytest.mark.parametrize("case", [c.name for c in WORLD2])
def test_world2_ep2_equals_one_process(world2, case):
    _check_case(world2, f"{case}:float32")


@pytest.mark.parametrize("case", [c.name for c in WORLD4])
def test_world4_equals_one_process(world4, case):
    _check_case(world4, f"{case}:float32")


def _check_not_divisible(all_ranks, key, num_experts, ep):
    for results in all_ranks:
        res = results[key]
        assert res["probe"] == len(all_ranks)
        for message in res["messages"]:
            assert message is not None and str(num_experts) in message and str(ep) in message, message


def test_experts_not_multiple_of_ep_raises_before_communication(world2, world4):
    _check_not_divisible(world2, "not_divisible_ep2_E3", 3, 2)
    _check_not_divisible(world4, "not_divisible_ep2_E3", 3, 2)
    _check_not_divisible(world4, "not_divisible_ep4_E6", 6, 4)


def test_all_to_all_uneven_zero_splits_and_backward(world2, world4):
    for results in world2 + world4:
        assert results["all_to_all_op"] == dict.fromkeys(results["all_to_all_op"], True), results["all_to_all_op"]


FUSED_OPS = ["all_reduce of the load-balancing inputs and the expert counts"]


def _reductions(all_ranks: list[dict], ep: int) -> list[dict]:
    found = [results[f"reductions_ep{ep}"] for results in all_ranks]
    for rank, res in enumerate(found):
        assert "exception" not in res, f"rank {rank}:\n{res['exception']}"
        assert res["same_as_two_calls"] and res["same_gradient"], (rank, res)
        assert res["routed_is_world_sum"] and res["tokens_are_world_sum"] and res["counts_are_ep_sums"], (rank, res)
        assert res["layer_differs_in"] == [], (rank, res)
        assert res["layer_dropped_pairs"] > 0, (rank, res)  # kept ≠ routed: a swap of the two counts shows
    return found


def test_ep_equal_to_the_world_reduces_a_layer_in_one_all_reduce(world2, world4):
    """World 2 with EP 2, world 4 with EP 4: a layer's forward makes one fp64 all-reduce instead
    of the fp64 and int64 pair, with the same bits as the two."""
    for all_ranks, ep in ((world2, 2), (world4, 4)):
        for res in _reductions(all_ranks, ep):
            assert res["all_reduces"] == ["float64"] and res["ops"] == FUSED_OPS, res
            assert res["layer_all_reduces"] == [["float64"], ["float64", "int64"]], res


def test_ep_smaller_than_the_world_sums_the_counts_over_the_ep_group(world4):
    """World 4 with EP 2 (edp 2): the loss's inputs over the world, the counts over the EP group
    (two collectives); EP 1: the counts stay the rank's own (one collective, the loss's)."""
    for res in _reductions(world4, 2):
        assert res["all_reduces"] == ["float64", "int64"], res
        assert res["ops"] == ["all_reduce of the load-balancing inputs", "all_reduce of the expert counts"], res
        assert res["layer_all_reduces"] == [["float64", "int64"]] * 2, res
        assert not res["counts_are_world_sums"], res
    for res in _reductions(world4, 1):
        assert res["all_reduces"] == ["float64"] and res["layer_all_reduces"] == [["float64"]] * 2, res
        assert res["ops"] == ["all_reduce of the load-balancing inputs"], res
    # groups of equal size hold the same ranks only in ParallelDims' layout: the ranks decide
    assert [res["one_reduction_across_groups"] for res in world4] == [[True, False]] * 4


def _half_rows(rank: int, world: int) -> dict:
    """The dispatcher with 16-bit rows of odd and even widths (the unique rows' headers are bit-cast
    into them), against the same per-expert functions applied on this rank: out, dx, dw."""
    from moe.capacity import plan_routing
    from parallel import AllToAllDispatcher

    E, K, T = 6, 3, 11
    L = E // world
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        for D in (9, 10, 16):
            gen = torch.Generator().manual_seed(7 * D + rank)
            experts_TK = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
            plan = plan_routing(experts_TK, torch.rand(T, K, generator=gen), E, 2)  # a capacity drops some
            x0, dout = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
            w0 = torch.rand(T, K, generator=gen) * plan.kept_TK

            def expert_fn(rows, e):  # nonlinear and different for every expert
                return rows * (e[:, None] + 1.0) + torch.sin(rows)

            def experts(rows_RD, offsets_J, w_R, me=rank):
                e = me * L + torch.searchsorted(offsets_J.long(), torch.arange(rows_RD.shape[0]), right=True) % L
                return (expert_fn(rows_RD.float(), e.float()) * w_R[:, None]).to(rows_RD.dtype)

            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            y = AllToAllDispatcher().run_experts(experts, x, plan, experts_TK, w, torch.float32, row_dtype=dtype)
            y.backward(dout)
            xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            xq = xr.to(dtype).float()
            ref = sum(wr[:, k, None] * expert_fn(xq, experts_TK[:, k].float()) for k in range(K))
            ref.backward(dout)
            out[f"{dtype} D={D}"] = [_rel_err(y, ref), _rel_err(x.grad, xr.grad),
                                     _rel_err(w.grad, wr.grad * plan.kept_TK)]
    # padded, a layer of more tokens than max_tokens is refused before any collective, also when
    # its chunks would fit their blocks (11 tokens in 3 chunks of <= 4, max_tokens 10)
    try:
        AllToAllDispatcher(overlap_chunks=3, max_tokens=T - 1).run_experts(experts, x0, plan, experts_TK, w0)
        out["too_many_tokens"] = [1.0]
    except ValueError as e:
        out["too_many_tokens"] = [0.0 if "11 tokens on rank" in str(e) and "exceed max_tokens=10" in str(e) else 1.0]
    return out


def test_half_precision_rows_of_any_width():
    for res in run_distributed(_half_rows, 2, timeout_s=60.0):
        bad = {k: v for k, v in res.items() if max(v) > 2e-2}
        assert not bad, bad


def test_parallel_dims_validation():
    dims = ParallelDims(4, 2)
    assert (dims.ep, dims.edp) == (2, 2)
    assert [dims.ep_ranks(r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [dims.edp_ranks(r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert dims.check_experts(6) == 3
    with pytest.raises(ValueError, match="num_experts=5 is not a multiple of ep=2"):
        dims.check_experts(5)
    with pytest.raises(ValueError, match="ep=3 must divide world_size=4"):
        ParallelDims(4, 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            ParallelDims(4, bad)
    with pytest.raises(RuntimeError, match="build_mesh"):
        dims.ep_group


def _fails_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits on the failed rank: must end by timeout, not hang
    return rank


def test_launcher_reports_a_failing_rank_instead_of_hanging():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_distributed(_fails_on_rank_1, 2, timeout_s=10.0)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nccl_two_gpus_equals_one_process():
    cases = [c for c in WORLD2]
    results = run_distributed(_run_cases, 2, cases, [torch.float32, torch.bfloat16], [(2, 3)], backend="nccl")
    for dtype in ("float32", "bfloat16"):
        for case in cases:
            _check_case(results, f"{case.name}:{dtype}")
    _check_not_divisible(results, "not_divisible_ep2_E3", 3, 2)
    assert results[0]["all_to_all_op"] == dict.fromkeys(results[0]["all_to_all_op"], True)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("transport", ["p2p", "p2p_copy_engine"])
def test_p2p_two_gpus_equals_one_process(transport):
    """The P2P (symmetric memory) dispatcher, its rows moved by its kernels or as blocks on the
    copy engines: same cases, same reference, on 2 GPUs."""
    cases = [c for c in WORLD2]
    results = run_distributed(_run_cases, 2, cases, [torch.float32, torch.bfloat16], [], transport, backend="nccl")
    for dtype in ("float32", "bfloat16"):
        for case in cases:
            _check_case(results, f"{case.name}:{dtype}")


def _p2p_slots(rank: int, world: int, share_gpu: bool = False, copy_engine: bool = False) -> dict:
    """Two dispatch/combine pairs (experts that only weight their rows) in flight before one
    backward: with two buffer slots the output and gradients are exact; with one, the backward
    raises. Each dispatcher first runs a step that fills its slots with more rows than the
    checked step keeps (a capacity drops pairs there): the checked step's padding rows, weights
    and gradient rows hold stale values, which nothing may read."""
    if share_gpu:
        share_one_gpu()
    from parallel.p2p_dispatcher import P2PDispatcher
    from moe.capacity import plan_routing

    device, (T, D, E, K) = torch.device("cuda", 0 if share_gpu else rank), (37, 24, 4, 2)
    gen = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(T, D, device=device, generator=gen, requires_grad=True)
    experts = torch.rand(T, E, device=device, generator=gen).topk(K, dim=-1).indices
    priority = torch.rand(T, K, device=device, generator=gen)
    full, capped = plan_routing(experts, priority, E, None), plan_routing(experts, priority, E, 6)
    w = torch.rand(T, K, device=device, generator=gen, requires_grad=True)
    g = torch.randn(T, D, device=device, generator=gen)

    def two_layers(p2p, plan):
        h = x
        for _ in range(2):
            rows, _, w_R, meta = p2p.dispatch(h, plan, w * plan.kept_TK)
            h = p2p.combine(rows * w_R[:, None], meta)
        return h

    out = {}
    for slots in (2, 1):
        p2p = P2PDispatcher(None, None, max_tokens=T, num_buffers=slots, timeout_s=P2P_TIMEOUT_S, copy_engine=copy_engine)
        if slots == 2:  # stale rows, weights and gradients in every slot
            (two_layers(p2p, full) * 1e3).sum().backward()
        x.grad = w.grad = None
        h = two_layers(p2p, capped)
        try:
            h.backward(g)
        except RuntimeError as e:
            out[slots] = str(e)
            continue
        m = capped.kept_TK
        s = (w.detach() * m).sum(-1, keepdim=True)
        y1 = x.detach() * s
        out[slots] = {
            "some_dropped": bool((~m).any()),
            "out": torch.allclose(h.detach(), y1 * s, rtol=1e-5, atol=1e-5),
            "dx": torch.allclose(x.grad, g * s * s, rtol=1e-5, atol=1e-5),
            "dw": torch.allclose(w.grad, ((g * y1).sum(-1, keepdim=True) + (g * s * x.detach()).sum(-1, keepdim=True)) * m,
                                 rtol=1e-4, atol=1e-4),
        }
    return out


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("copy_engine", [False, True], ids=["kernels", "copy_engine"])
def test_p2p_buffer_slots_two_layers_in_flight(copy_engine):
    for res in run_distributed(_p2p_slots, 2, False, copy_engine, backend="nccl"):
        assert res[2] == {"some_dropped": True, "out": True, "dx": True, "dw": True}, res
        assert "num_buffers" in res[1], res[1]


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["nccl", "p2p", "p2p_copy_engine"])
def test_two_ranks_sharing_one_gpu_equal_one_process(transport):
    """Both dispatchers' whole path on CUDA tensors where only one GPU is lent: two ranks of a
    gloo group on cuda:0. "nccl": the all-to-all dispatcher (its Triton token-row kernels
    compiled, the exchanges through gloo); "p2p": the peer-store kernels' flags and waits between
    two live processes, their buffers shared by CUDA IPC, and the slots; "p2p_copy_engine": the
    same with the rows copied as blocks into the other process's mapped buffers. The two-GPU tests
    above run the same functions over NCCL and NVLink."""
    cases = [c for c in WORLD2]
    results = run_distributed(_run_cases, 2, cases, [torch.float32, torch.bfloat16], [], transport, True,
                              timeout_s=P2P_TIMEOUT_S)
    for dtype in ("float32", "bfloat16"):
        for case in cases:
            _check_case(results, f"{case.name}:{dtype}")
    assert results[0]["all_to_all_op"] == dict.fromkeys(results[0]["all_to_all_op"], True)
    if transport != "nccl":
        for res in run_distributed(_p2p_slots, 2, True, transport == "p2p_copy_engine", timeout_s=P2P_TIMEOUT_S):
            assert res[2] == {"some_dropped": True, "out": True, "dx": True, "dw": True}, res
            assert "num_buffers" in res[1], res[1]


def test_overlap_chunks_validation():
    """parallel.overlap_chunks: a positive int, under EP only (either dispatcher); and
    split_plan cuts a plan into exactly that many chunks that together keep its pairs."""
    from moe.capacity import plan_routing, split_plan
    from train.config import ConfigError, load_config

    for bad in ("0", "-2"):
        with pytest.raises(ConfigError, match="parallel.overlap_chunks: must be > 0"):
            load_config(["--config", "tiny", f"--parallel.overlap_chunks={bad}"], world_size=2)
    with pytest.raises(ConfigError, match="parallel.overlap_chunks=2 is ignored with parallel.ep=1"):
        load_config(["--config", "tiny", "--parallel.ep=1", "--parallel.overlap_chunks=2"], world_size=2)
    assert load_config(["--config", "tiny", "--parallel.dispatcher=p2p", "--parallel.overlap_chunks=2",
                        "--moe.capacity_factor=none"], world_size=2).parallel.overlap_chunks == 2
    gen = torch.Generator().manual_seed(5)
    experts_TK = torch.rand(7, 6, generator=gen).topk(3, dim=1).indices
    plan = plan_routing(experts_TK, torch.rand(7, 3, generator=gen), 6, capacity=2)
    for n in (1, 3, 9):
        chunks = split_plan(plan, experts_TK, n)
        assert len(chunks) == n
        assert torch.equal(torch.cat([p.kept_TK for _, p in chunks]), plan.kept_TK)
        assert torch.equal(sum(p.kept_per_expert_E for _, p in chunks), plan.kept_per_expert_E)
        for tokens, p in chunks:
            kept = int(p.kept_TK.sum())
            flat = experts_TK[tokens].reshape(-1)[p.order_P[:kept]]
            assert torch.equal(flat, flat.sort().values)  # kept pairs sorted by expert
            assert bool(p.kept_TK.reshape(-1)[p.order_P[:kept]].all()) and not bool(p.kept_TK.reshape(-1)[p.order_P[kept:]].any())
