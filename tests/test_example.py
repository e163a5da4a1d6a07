"""Your own model under expert parallelism: seeded initialisation independent of the EP size,
a dispatcher of your own with only the abstract methods, ``parallel.check_replicas_agree``,
``init_distributed(seed=...)``, and ``examples/ep_own_model.py`` run under torchrun with 2 gloo
processes against one process on the same global batch."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from moe import MoELayer
from moe.dispatch import Dispatcher, LocalDispatcher
from parallel import ParallelDims, check_replicas_agree, init_distributed
from tests.distributed import run_distributed
from tests.test_train import _concurrently

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "ep_own_model.py")


class _FakeEP(Dispatcher):
    """An expert-parallel group of ``size`` ranks seen from rank ``rank``: enough to build a layer."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    ep_size = property(lambda self: self._size)
    ep_rank = property(lambda self: self._rank)

    def dispatch(self, x_TD, plan):
        raise NotImplementedError

    def combine(self, y_RD, meta, w_TK, out_dtype=None):
        raise NotImplementedError

    def reduce_aux_inputs(self, routed_E, prob_sum_E, num_tokens):
        raise NotImplementedError

    def reduce_counts(self, counts):
        raise NotImplementedError


class _OwnDispatcher(Dispatcher):
    """A user's dispatcher with only the abstract methods: all experts here (as LocalDispatcher),
    its reductions recorded; its counts summed as if over three ranks that saw the same batch."""

    ep_size, ep_rank = 1, 0

    def __init__(self):
        self._local = LocalDispatcher()
        self.calls = []

    def dispatch(self, x_TD, plan, w_TK, row_dtype=None):
        return self._local.dispatch(x_TD, plan, w_TK, row_dtype)

    def combine(self, y_RD, meta, out_dtype=None):
        return self._local.combine(y_RD, meta, out_dtype)

    def reduce_aux_inputs(self, routed_E, prob_sum_E, num_tokens):
        self.calls.append(("reduce_aux_inputs", routed_E, num_tokens))
        return self._local.reduce_aux_inputs(routed_E, prob_sum_E, num_tokens)

    def reduce_counts(self, counts):
        self.calls.append(("reduce_counts", counts))
        return 3 * counts


def test_a_dispatcher_with_only_the_abstract_methods_gets_both_reductions():
    """MoELayer calls Dispatcher.reduce_aux_and_counts, whose default makes the two abstract calls:
    the loss from reduce_aux_inputs' result, the stats from reduce_counts' of [routed, kept]."""
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    layers = []
    for dispatcher in (_OwnDispatcher(), None):
        torch.manual_seed(4)
        layers.append(MoELayer(16, 12, 8, 2, capacity_factor=1.0, dispatcher=dispatcher))
    (out, aux), (ref_out, ref_aux) = (layer.forward_with_aux(x) for layer in layers)
    routed_E, kept_E = ref_aux.stats.routed_per_expert, ref_aux.stats.tokens_per_expert
    assert not torch.equal(routed_E, kept_E)  # the capacity dropped pairs: a swap of the two shows
    calls = layers[0].dispatcher.calls
    assert [c[0] for c in calls] == ["reduce_aux_inputs", "reduce_counts"]
    assert torch.equal(calls[0][1], routed_E) and calls[0][2] == 18
    assert torch.equal(calls[1][1], torch.stack([routed_E, kept_E]))
    assert torch.equal(aux.stats.routed_per_expert, 3 * routed_E)
    assert torch.equal(aux.stats.tokens_per_expert, 3 * kept_E)
    assert torch.equal(out, ref_out) and torch.equal(aux.load_balancing_loss, ref_aux.load_balancing_loss)


def _model(dispatcher, dtype=torch.float32) -> nn.Sequential:
    # two layers: the second's draws come after the first's, so a consumption that depended on
    # the EP size would show there; shared experts and the expert bias exercise the rest
    kw = dict(num_shared_experts=1, expert_bias=True, dispatcher=dispatcher, dtype=dtype)
    return nn.Sequential(MoELayer(16, 12, 8, 2, **kw), nn.Linear(16, 16), MoELayer(16, 12, 8, 2, activation="gelu", **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_init_is_independent_of_the_ep_size(ep, dtype):
    torch.manual_seed(3)
    ref = dict(_model(None, dtype).named_parameters())
    after_ref = torch.randn(4)  # where the global RNG stands after building
    for rank in range(ep):
        torch.manual_seed(3)
        model = _model(_FakeEP(ep, rank), dtype)
        assert torch.equal(torch.randn(4), after_ref), "building consumed EP-dependent RNG"
        for name, p in model.named_parameters():
            want = ref[name]
            if ".experts." in name:
                L = want.shape[0] // ep
                want = want[rank * L:(rank + 1) * L]
            assert p.shape == want.shape and torch.equal(p, want), f"ep {ep} rank {rank}: {name}"
    # distinct experts, not one stream repeated
    w1 = ref["0.experts.w1_LDU"]
    assert not torch.equal(w1[0], w1[1]) and not torch.equal(w1[0], ref["2.experts.w1_LDU"][0])


def test_init_distributed_seeds_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.manual_seed(7)
    want = torch.randn(3)
    torch.manual_seed(8)
    assert init_distributed(seed=7)[1] == 1
    assert torch.equal(torch.randn(3), want)
    with pytest.raises(TypeError, match="seed"):
        init_distributed(seed=1.5)


# ---------------------------------------------------------------- check_replicas_agree, 2 ranks

def _expect_raise(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _replica_checks(rank: int, world: int) -> dict:
    out = {}
    ep2 = ParallelDims(world, 2).build_mesh()  # experts split: only dense params have replicas
    ep1 = ParallelDims(world, 1).build_mesh()  # experts replicated over the EDP group (both ranks)
    for key, dims in (("ep2", ep2), ("ep1", ep1)):
        torch.manual_seed(11)  # what init_distributed(seed=11) does, on every rank
        model = _model(dims.dispatcher())
        out[f"{key}_agree"] = check_replicas_agree(model, dims)
        with torch.no_grad():
            if rank == 1:
                model[2].router.weight[3, 5] += 1e-6
        out[f"{key}_router"] = _expect_raise(lambda: check_replicas_agree(model, dims))
        out[f"{key}_router_rtol"] = _expect_raise(lambda: check_replicas_agree(model, dims, rtol=1e-3))
    torch.manual_seed(11)
    model = _model(ep1.dispatcher())
    with torch.no_grad():
        if rank == 1:  # two experts swapped: sums and sums of squares unchanged
            w = model[0].experts.w2_LFD
            w[[0, 1]] = w[[1, 0]]
    out["ep1_expert_swap"] = _expect_raise(lambda: check_replicas_agree(model, ep1))
    torch.manual_seed(11 + rank)  # the bug of issue #19: every rank its own seed
    out["own_seeds"] = _expect_raise(lambda: check_replicas_agree(_model(ep2.dispatcher()), ep2))
    out["other_model"] = _expect_raise(
        lambda: check_replicas_agree(_model(ep2.dispatcher()) if rank == 0 else nn.Linear(3, 3), ep2))
    probe = torch.ones(1)
    dist.all_reduce(probe)  # nothing left half-issued
    out["probe"] = probe.item()
    return out


def test_check_replicas_agree_names_the_differing_parameter():
    results = run_distributed(_replica_checks, 2, timeout_s=60.0)
    for rank, res in enumerate(results):
        assert res["probe"] == 2
        # ep 2: the 2 routers, 2 shared MLPs (2 each), the linear (2): 8 dense tensors, 1 pair each;
        # ep 1: + 2 · 2 expert tensors
        assert (res["ep2_agree"], res["ep1_agree"]) == (8, 12), res
        for key in ("ep2_router", "ep1_router"):
            msg = res[key]
            assert msg is not None and msg.startswith("2.router.weight differs between rank 0 and rank 1"), (rank, msg)
            assert "torch.manual_seed" in msg and "init_distributed(seed=" in msg
            assert res[key + "_rtol"] is None  # within rtol: the perturbation is 1e-6
        msg = res["ep1_expert_swap"]
        assert msg is not None and msg.startswith("0.experts.w2_LFD differs between rank 0 and rank 1"), msg
        assert "expert-data-parallel" in msg
        assert res["own_seeds"] is not None and res["own_seeds"].startswith("0.router.weight differs"), res["own_seeds"]
        assert "built different models" in res["other_model"], res["other_model"]


# ---------------------------------------------------------------- the example, 2 ranks vs 1

def _env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # as a user runs it: the PyTorch paths on CPU
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# the losses of one process and of 2 ranks differ only by fp32 summation order (the all-reduces,
# each rank's half of the batch): measured 1e-6 over 5 AdamW steps; AdamW's normalised update
# turns gradient rounding into at most ~1e-6 of a parameter (measured 1.3e-6 after 8 steps at lr 1e-2)
LOSS_ATOL = 1e-5  # on losses of ~4.3: a relative 2.3e-6
PARAM_ATOL = 1e-5  # 0.1% of one AdamW step at lr 1e-2


@pytest.mark.slow
def test_example_two_ranks_train_like_one_process(tmp_path):
    steps = 5
    one, two = tmp_path / "one", tmp_path / "two"
    out1, out2 = _concurrently(  # independent: at once
        lambda: _run([sys.executable, EXAMPLE, f"--steps={steps}", f"--out={one}.json", f"--save-state={one}.pt"]),
        lambda: _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=localhost:{_free_port()}", "--nnodes=1", EXAMPLE, f"--steps={steps}",
                      f"--out={two}.json", f"--save-state={two}.pt"]))
    assert f"replicas agree after {steps} steps" in out2 and "replicas agree after init" in out2, out2
    r1, r2 = json.loads((tmp_path / "one.json").read_text()), json.loads((tmp_path / "two.json").read_text())
    assert (r1["world"], r1["ep"], r2["world"], r2["ep"]) == (1, 1, 2, 2)
    printed = [float(line.split()[3]) for line in out1.splitlines() if line.startswith("step ")]
    assert printed == pytest.approx(r1["losses"], abs=1e-6) and len(printed) == steps
    assert r2["losses"] == pytest.approx(r1["losses"], abs=LOSS_ATOL, rel=0)
    assert r1["losses"][-1] < r1["losses"][0]  # it trains
    s1, s2 = torch.load(f"{one}.pt"), torch.load(f"{two}.pt")
    assert s1.keys() == s2.keys()
    for name in s1:
        diff = (s1[name] - s2[name]).abs().max().item()
        assert diff <= PARAM_ATOL, f"{name}: {diff}"
