"""What real runs throw at the trainer (issue #18), each fault injected into the training script
and bounded by a timeout: a killed rank under ``torchrun --max-restarts``, a diverging run, a
rank that never joins a collective, a non-finite step under ``train.on_nonfinite=skip``.

Checkpoint damage is in tests/test_checkpoint.py, ranks that disagree in tests/test_agreement.py.
"""

import json
import os
import time

import pytest
import torch

import train.model
from tests.test_train import EP2_RUN, REPO, SMALL, _concurrently, _free_port, _losses, _metrics, _run_inprocess, _torchrun
from parallel.flight import REPORT_WAIT_S
from train.checkpoint import Checkpointer
from train.config import load_config
from train.model import MoETransformer
from train.nonfinite import NonFiniteGuard
from train.optim import WarmupCosine, build_optimizer
from train.runtime import Runtime

FAULT_RUN = os.path.join(REPO, "tests", "fault_run.py")


def _steps_logged(run_dir: str) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if "train/loss" in r]


# on GPUs: NCCL, and the GPU attention kernel's head dims (SMALL's 4 heads of 16 run only on CPU)
ON = {"cpu": [], "cuda": ["--parallel.device=cuda", "--model.n_heads=2"]}
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.multigpu])]
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path, device, ep2_uninterrupted):
    base = SMALL + ON[device] + EP2_RUN + [f"--log.dir={tmp_path}"]
    full = _losses(str(ep2_uninterrupted(ON[device], env=NCCL_ENV)[0]))  # the same run, uninterrupted
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    ports = set()
    while len(ports) < 2:
        ports.add(_free_port())
    static, c10d = ports
    launchers = {"static": ["--nnodes=1", f"--master_port={static}"],  # hung on restart before
                 "c10d": ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{c10d}", "--nnodes=1"]}
    runs = [lambda name=name, launcher=launcher: _torchrun(
        2, base + [f"--log.run_name={name}"], script=FAULT_RUN, launcher=launcher + ["--max-restarts=1"],
        env={"MOE_TEST_FAULT": "kill:1:5", **NCCL_ENV}) for name, launcher in launchers.items()]
    # the two jobs at once on CPU (independent: their own ports and run directories); one after
    # the other on the GPUs they would share
    procs = _concurrently(*runs) if device == "cpu" else [run() for run in runs]
    for name, proc in zip(launchers, procs):
        assert "resumed from" in proc.stdout and "step_00000004 at step 4" in proc.stdout, name
        assert _losses(str(tmp_path / name)) == full, name  # bit-exact, every step
        assert _steps_logged(str(tmp_path / name)) == [1, 2, 3, 4, 5, 6], name  # step 5 once, not twice


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_rank_that_never_joins_a_collective_is_named_within_the_timeout(tmp_path, device):
    args = SMALL + ON[device] + ["--train.steps=6", "--parallel.ep=2", "--parallel.timeout_s=5", f"--log.dir={tmp_path}"]
    start = time.monotonic()
    proc = _torchrun(2, args, script=FAULT_RUN, env={"MOE_TEST_FAULT": "stall:1:3", **NCCL_ENV}, check=False)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    # the timeout and the watchdog's wait after its report, plus start-up and two steps on 2 CPU cores
    assert elapsed < 5 + REPORT_WAIT_S + 40, elapsed
    out = proc.stderr
    assert ("rank 0: collective timeout: no progress for 5 s (parallel.timeout_s) in #") in out, out[-3000:]
    assert "all_reduce of 2 scalars (loss, logged metrics) over the world (step 3: gradient sync and optimizer)" in out
    if device == "cpu":  # gloo blocks in the call; on a GPU the host waits at its next sync
        assert "train/runtime.py" in out and "all_reduce_mean_" in out
    assert "rank 1: no progress for 5 s (parallel.timeout_s) outside any collective" in out
    assert "the other ranks wait for this one" in out and "fault_run.py" in out


def test_a_diverging_run_names_a_layer_and_writes_no_non_finite_checkpoint(tmp_path):
    args = SMALL + ["--train.steps=30", "--log.every=10", "--checkpoint.every=1", "--checkpoint.keep=0",
                    "--optim.lr=1e4", f"--log.dir={tmp_path}"]
    with pytest.raises(FloatingPointError) as err:
        _run_inprocess(args)
    message = str(err.value)
    assert "the loss or the gradient norm is not finite; first non-finite value: the " in message
    assert "blocks." in message and "nowhere" not in message, message  # a layer, found on replay
    bad = int(message.split(":")[0].removeprefix("step "))
    ckpts = sorted(os.listdir(tmp_path / "tiny" / "checkpoints"))
    assert ckpts[-1] == f"step_{bad - 1:08d}", ckpts  # every step before the bad one, none after
    cfg = load_config(args)
    model = MoETransformer(cfg)
    opt = build_optimizer(model, cfg.optim)
    loader = Checkpointer(str(tmp_path / "tiny" / "checkpoints"), Runtime(0, 0, 1, 1, torch.device("cpu"), None))
    assert loader.restore("auto", model, opt, WarmupCosine(opt, 1, 2, 0.1), say=lambda line: None)["step"] == bad - 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _nan_on_call(monkeypatch, calls: set[int]) -> None:
    """The model's loss (train.lm_loss.linear_cross_entropy) is NaN on the given (1-based) calls."""
    loss, count = train.model.linear_cross_entropy, [0]

    def patched(*a, **k):
        count[0] += 1
        out = loss(*a, **k)
        return out * float("nan") if count[0] in calls else out

    monkeypatch.setattr(train.model, "linear_cross_entropy", patched)


def test_skip_drops_the_bad_steps_update_and_counts_it(tmp_path, monkeypatch):
    # the first call is the step-0 validation's, so call 4 is step 3's loss
    _nan_on_call(monkeypatch, {4})
    _run_inprocess(SMALL + ["--train.steps=5", "--train.on_nonfinite=skip", f"--log.dir={tmp_path}"])
    m = _metrics(str(tmp_path / "tiny"))
    assert [m[s]["train/skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert m[3]["train/loss"] is None and all(m[s]["train/loss"] < 10 for s in (4, 5))  # NaN is written as null


def test_skip_stops_beyond_its_budget(tmp_path, monkeypatch):
    _nan_on_call(monkeypatch, set(range(2, 100)))
    with pytest.raises(FloatingPointError, match=r"3 steps skipped for non-finite values, more than "
                                                 r"train.max_skipped_steps=2; the latest, step 3: first non-finite "
                                                 r"value: the loss, with every layer's output finite"):
        _run_inprocess(SMALL + ["--train.steps=10", "--log.every=5", "--train.on_nonfinite=skip",
                                "--train.max_skipped_steps=2", "--checkpoint.every=3", f"--log.dir={tmp_path}"])


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_guard_leaves_a_bad_steps_state_exactly_as_it_was(policy):
    model = torch.nn.Linear(4, 3)
    bias = torch.zeros(3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = NonFiniteGuard(opt, policy, torch.device("cpu"))

    def step(n: int, loss_value: float) -> None:
        model(torch.randn(2, 4)).sum().backward()
        guard.update(n, torch.tensor([loss_value]), torch.tensor(1.0))
        opt.step()
        opt.zero_grad()
        with guard.guarded([bias]):
            bias.add_(1.0)

    step(1, 1.0)
    before = ({k: v.clone() for k, v in model.state_dict().items()},
              {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}, bias.clone())
    step(2, float("nan"))
    after = (model.state_dict(), {id(p): opt.state[p] for p in model.parameters()}, bias)
    for k in before[0]:
        assert torch.equal(before[0][k], after[0][k]), k
    for pid, state in before[1].items():
        for k, v in state.items():
            assert torch.equal(v, after[1][pid][k]), k  # moments and step count
    assert torch.equal(before[2], after[2])
    step(3, 1.0)  # stop: sticky, nothing changes any more; skip: the next good step applies
    assert torch.equal(bias, before[2]) == (policy == "stop")
    assert guard.read() == (1, 2, 2)  # skipped steps, the first and the latest bad one


def test_guard_needs_a_fused_optimizer():
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), foreach=True)
    with pytest.raises(ValueError, match="fused optimizer"):
        NonFiniteGuard(opt, "stop", torch.device("cpu"))


def _recorder_with_three_entries(device: str, sleep_after: int | None = None):
    """A recorder with three collectives recorded on ``device``; on a GPU the stream sleeps
    after entry ``sleep_after`` (a kernel that has not finished when the recorder is asked)."""
    from parallel.flight import FlightRecorder

    recorder = FlightRecorder()
    for i in (1, 2, 3):
        recorder.phase(f"step {i}: forward")
        recorder.record(f"all_reduce #{i}", layer="blocks.0.moe")
        if device == "cuda":
            torch.ones(1, device="cuda").add_(1)  # work on the stream between the markers
            if i == sleep_after:
                torch.cuda._sleep(2_000_000_000)  # about a second at ~2 GHz
    return recorder


def test_a_cpu_timeout_names_the_last_collective_issued():
    from parallel.flight import timeout_report

    recorder = _recorder_with_three_entries("cpu")
    entry, on_device = recorder.stuck_entry()
    assert (entry.op, on_device) == ("all_reduce #3", False)
    report = timeout_report(0, 5, recorder, stack=[])
    assert report.startswith("rank 0: no progress for 5 s (parallel.timeout_s) outside any collective, after #3 "
                             "all_reduce #3 over the world (step 3: forward, blocks.0.moe)"), report


@pytest.mark.gpu
@pytest.mark.parametrize("sleep_after", [1, 3, None])
def test_a_gpu_timeout_names_the_collective_the_stream_waits_in(sleep_after):
    from parallel.flight import timeout_report

    recorder = _recorder_with_three_entries("cuda", sleep_after)
    if sleep_after is None:
        torch.cuda.synchronize()
    entry, on_device = recorder.stuck_entry()
    report = timeout_report(0, 5, recorder, stack=[])  # before the sleep ends (about a second)
    torch.cuda.synchronize()
    if sleep_after is None:  # an idle GPU: the host's view
        assert (entry.op, on_device) == ("all_reduce #3", False)
        return
    assert (entry.op, on_device) == (f"all_reduce #{sleep_after}", True)
    assert report.startswith(f"rank 0: collective timeout: no progress for 5 s (parallel.timeout_s) in #{sleep_after} "), report
