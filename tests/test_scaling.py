"""The 8-GPU scaling configs, at the sizes a CPU allows.

- configs/olmoe_ep8.yaml and configs/olmoe_ep4_dp2.yaml are the model of
  configs/olmoe_bench.yaml with EP=8 and EP=4 × EDP=2, valid at world 8 only;
- the weak-scaling trio of bench/run_8gpu.sh, scaled down in width and run with gloo:
  olmoe_bench on 2 processes (EP=2), olmoe_ep8 on 4 (EP=4, since the CPU world is 4) and
  olmoe_ep4_dp2 on 4 (EP=2 × EDP=2), each training with the all-to-all timing on, the two
  4-process layouts giving the same losses, and the scaling report built from their logs;
- the timed all-to-all equals the untimed one, forward and backward, and times both;
- world 8 (8 gloo processes; NCCL when 8 GPUs are present): EP=8 × DP=1 and EP=4 × DP=2 give
  the output, losses and every gradient after sync of one process on the concatenated batch,
  dropless and with capacity (the machinery of tests/test_parallel.py).
"""

import math
import os
import subprocess

import pytest
import torch

from moe import MoELayer
from parallel import CommTimer, ParallelDims
from tests.distributed import run_distributed
from tests.test_parallel import Case, _check_case, _check_not_divisible, _run_cases
from tests.test_train import REPO, _metrics, _torchrun
from train.config import ConfigError, load_config
from train.report import summarize, to_markdown

CONFIGS = os.path.join(REPO, "configs")
# the OLMoE-shaped configs cut to CPU size in width, depth and tokens (bytes, not the BPE of 50304);
# experts stay 64 top-8
SCALED_DOWN = [
    "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.vocab_size=256", "--data.tokenizer=bytes",
    "--moe.hidden_dim=64", "--data.seq_len=32", "--data.batch_size=2", "--data.max_bytes=400000",
    "--train.steps=3", "--log.every=1", "--optim.warmup_steps=1", "--log.time_comm=true",
    "--log.wandb_mode=disabled", "--log.progress=false", "--parallel.device=cpu",
]
# (config, processes, EP override, the layout line the run prints)
CPU_RUNS = [
    ("olmoe_bench", 2, 2, "world 2 (ep 2, edp 1)"),
    ("olmoe_ep8", 4, 4, "world 4 (ep 4, edp 1)"),
    ("olmoe_ep4_dp2", 4, 2, "world 4 (ep 2, edp 2)"),
]


def _load(name: str, world: int):
    return load_config(["--config", os.path.join(CONFIGS, f"{name}.yaml")], world_size=world)


def test_8gpu_configs_are_the_benchmark_model_with_ep8_and_ep4_dp2():
    bench = _load("olmoe_bench", 2)
    for name, ep, edp in (("olmoe_ep8", 8, 1), ("olmoe_ep4_dp2", 4, 2)):
        cfg = _load(name, 8)
        for section in ("model", "moe", "data", "optim", "train"):  # same model, same batch per GPU
            assert getattr(cfg, section) == getattr(bench, section), (name, section)
        assert cfg.log.time_comm
        dims = ParallelDims(8, cfg.parallel.ep)
        assert (dims.ep, dims.edp) == (ep, edp)
        assert dims.check_experts(cfg.moe.num_experts) == 64 // ep
    assert (bench.model.dim, bench.model.n_layers, bench.moe.num_experts, bench.moe.top_k, bench.moe.hidden_dim) == (
        2048, 16, 64, 8, 1024)


@pytest.mark.parametrize("name, world", [("olmoe_ep8", 4), ("olmoe_ep8", 2), ("olmoe_ep4_dp2", 2), ("olmoe_ep4_dp2", 6)])
def test_8gpu_configs_reject_a_world_their_ep_does_not_divide(name, world):
    with pytest.raises(ConfigError, match=r"parallel\.ep=\d must divide the world size"):
        _load(name, world)


def test_run_8gpu_script_parses():
    proc = subprocess.run(["bash", "-n", os.path.join(REPO, "bench", "run_8gpu.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- the weak-scaling trio on CPU


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("scaling")
    outputs = {}
    for name, nproc, ep, _ in CPU_RUNS:
        args = ["--config", os.path.join(CONFIGS, f"{name}.yaml"), *SCALED_DOWN, f"--parallel.ep={ep}", f"--log.dir={log_dir}"]
        outputs[name] = _torchrun(nproc, args).stdout
    return log_dir, outputs


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("name, nproc, ep, layout", CPU_RUNS)
def test_scaled_down_config_trains_on_cpu_with_all_to_all_timing(cpu_runs, name, nproc, ep, layout):
    log_dir, outputs = cpu_runs
    assert layout in outputs[name]
    metrics = _metrics(str(log_dir / name))
    steps = sorted(s for s, m in metrics.items() if "train/loss" in m)
    assert steps == [1, 2, 3]
    for s in steps:
        m = metrics[s]
        assert math.isfinite(m["train/loss"]) and math.isfinite(m["train/grad_norm"])
        assert m["time/all_to_all_ms"] > 0
        assert 0 < m["time/all_to_all_fraction"] < 1
    assert metrics[3]["train/tokens"] == 3 * nproc * 2 * 32


@pytest.mark.slow
@pytest.mark.extended
def test_ep4_and_ep2_dp2_layouts_train_the_same(cpu_runs):
    # the two 4-process runs differ only in how the experts are laid out over the world
    log_dir, _ = cpu_runs
    ep4, ep2_dp2 = _metrics(str(log_dir / "olmoe_ep8")), _metrics(str(log_dir / "olmoe_ep4_dp2"))
    for s in (1, 2, 3):
        assert ep2_dp2[s]["train/loss"] == pytest.approx(ep4[s]["train/loss"], rel=1e-5)
        assert ep2_dp2[s]["train/grad_norm"] == pytest.approx(ep4[s]["train/grad_norm"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.extended
def test_scaling_report_from_the_cpu_runs(cpu_runs):
    log_dir, _ = cpu_runs
    runs = [summarize(str(log_dir / name), skip_steps=1) for name, *_ in CPU_RUNS]
    md = to_markdown(runs, "cmd", 1, title="Scaling", baseline="olmoe_bench")
    header = next(line for line in md.splitlines() if line.startswith("| run |"))
    for col in ("tokens/s per GPU", "weak scaling vs olmoe_bench", "all-to-all ms/step", "all-to-all share of step"):
        assert col in header
    rows = [line for line in md.splitlines() if line.startswith("| olmoe")]
    assert len(rows) == 3 and rows[0].split("|")[-4].strip() == "100.0%"  # the baseline against itself
    with pytest.raises(ValueError, match="--baseline"):
        to_markdown(runs, None, 1, baseline="nope")


# ---------------------------------------------------------------- the timed all-to-all


def _timed_vs_untimed(rank: int, world: int) -> dict:
    dims = ParallelDims(world, world).build_mesh()
    gen = torch.Generator().manual_seed(7 + rank)
    x_TD = torch.randn(10 + 3 * rank, 16, generator=gen)
    runs = []
    for timed in (False, True):
        dispatcher = dims.dispatcher()
        if timed:
            dispatcher.comm_timer = CommTimer()
        torch.manual_seed(3)  # the same weights both times
        layer = MoELayer(16, 12, 6, 2, capacity_factor=1.0, dispatcher=dispatcher)
        x = x_TD.clone().requires_grad_()
        out = layer(x)
        forward_ms = dispatcher.comm_timer.read_ms() if timed else None
        out.pow(2).sum().backward()
        backward_ms = dispatcher.comm_timer.read_ms() if timed else None
        again_ms = dispatcher.comm_timer.read_ms() if timed else None
        grads = [x.grad] + [p.grad for p in layer.parameters()]
        runs.append({"out": out.detach(), "grads": grads, "ms": (forward_ms, backward_ms, again_ms)})
    plain, timed = runs
    return {
        "same_output": torch.equal(plain["out"], timed["out"]),
        "same_grads": all(torch.equal(a, b) for a, b in zip(plain["grads"], timed["grads"])),
        "ms": timed["ms"],
        "untimed_has_no_timer": dims.dispatcher().comm_timer is None,
    }


def test_timed_all_to_all_equals_untimed_and_times_forward_and_backward():
    for res in run_distributed(_timed_vs_untimed, 2, timeout_s=60.0):
        assert res["same_output"] and res["same_grads"] and res["untimed_has_no_timer"]
        forward_ms, backward_ms, again_ms = res["ms"]
        assert forward_ms > 0 and backward_ms > 0  # the counts + row exchanges, then the two reverse ones
        assert again_ms == 0.0  # read_ms resets


# ---------------------------------------------------------------- world 8


WORLD8 = [
    Case("ep8_dp1_dropless", ep=8, num_experts=16),
    Case("ep8_dp1_capacity", ep=8, num_experts=16, capacity_factor=1.0),
    Case("ep8_dp1_first_rank_only", ep=8, num_experts=16, route="first_rank"),
    Case("ep4_dp2_dropless", ep=4, num_experts=8),
    Case("ep4_dp2_capacity", ep=4, num_experts=8, capacity_factor=1.25, drop_policy="position"),
    Case("ep4_dp2_zero_token_ranks", ep=4, num_experts=8, tokens=(6, 0, 5, 0, 7, 0, 4, 3), z_loss_coef=0.0),
]
NOT_DIVISIBLE8 = [(4, 6), (8, 12)]


@pytest.fixture(scope="module")
def world8():
    return run_distributed(_run_cases, 8, WORLD8, [torch.float32], NOT_DIVISIBLE8, timeout_s=90.0)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("case", [c.name for c in WORLD8])
def test_world8_equals_one_process(world8, case):
    _check_case(world8, f"{case}:float32")


@pytest.mark.slow
@pytest.mark.extended  # world 4 proves both by default (tests/test_parallel.py); this fixture costs ~37 s
def test_world8_not_divisible_and_all_to_all_op(world8):
    _check_not_divisible(world8, "not_divisible_ep4_E6", 6, 4)
    _check_not_divisible(world8, "not_divisible_ep8_E12", 12, 8)
    for results in world8:
        assert results["all_to_all_op"] == dict.fromkeys(results["all_to_all_op"], True), results["all_to_all_op"]


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 8, reason="needs 8 GPUs on one host")
def test_nccl_eight_gpus_equals_one_process():
    results = run_distributed(_run_cases, 8, WORLD8, [torch.float32, torch.bfloat16], NOT_DIVISIBLE8, backend="nccl")
    for dtype in ("float32", "bfloat16"):
        for case in WORLD8:
            _check_case(results, f"{case.name}:{dtype}")
    _check_not_divisible(results, "not_divisible_ep8_E12", 12, 8)
    assert results[0]["all_to_all_op"] == dict.fromkeys(results[0]["all_to_all_op"], True)
