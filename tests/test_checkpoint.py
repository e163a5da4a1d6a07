"""What a resume rests on: DCP checkpoints reshard, are verified, fall back, never hold
non-finite state; a resumed run's metrics file holds every step once.

Resharding: saved under one layout, loaded under another, the run goes on the same. A layout is
(world size, EP size, data-parallel mode). The saving run trains the model of ``train.model`` for
two steps, saves (model, AdamW state, schedule), and then records the next step: the loss on a
fixed batch, one more optimizer step, and the loss after it. A fresh model (another seed) under
another layout loads the checkpoint and records the same next step. Equal losses before and after
that step mean the parameters and the optimizer's moments were resliced right (a moment put on the
wrong expert, or a stale step count, moves the second loss). Every layout sees the same global
batch (each rank its slice) and routes dropless, so the math is that of one process whatever the
layout; only the reduction order differs.

Verification: two checkpoints (steps 1 and 2) of one process, or of two gloo ranks at EP 2; the
newer one damaged as a disk, a copy or a crash would (64 bytes inverted, truncated, a file missing,
meta.json torn, a file too many). Asked for by name it is one error naming the file; under
``auto`` the older one is loaded, bit for bit, after one line saying so.
"""

import json
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe import moe_aux_loss
from parallel import ParallelDims, clip_grad_norm_
from tests.distributed import run_distributed
from tests.test_fsdp import Case, _config
from train import checkpoint as ckpt
from train.checkpoint import CheckpointError, Checkpointer, list_checkpoints
from train.config import Config
from train.logger import RunLogger
from train.model import MoETransformer
from train.optim import WarmupCosine, build_optimizer
from train.parallelize import parallelize, reduce_gradients
from train.runtime import Runtime

GLOBAL_BATCH, SEQ = 4, 8
RELATIVE = 2e-5  # another layout: the same math in another reduction order (fp32)


def _batch(i: int) -> torch.Tensor:
    return torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + i))


class _Run:
    """The model, optimizer and schedule of one layout, on this rank."""

    def __init__(self, world: int, ep: int, data_parallel: str, seed: int):
        self.rank = dist.get_rank() if world > 1 else 0
        dims = ParallelDims(world, ep).build_mesh("cpu") if world > 1 else None
        self.rt = Runtime(self.rank, self.rank, world, ep, torch.device("cpu"), dims)
        self.cfg = _config(Case("checkpoint", ep=ep, data_parallel=data_parallel), world, ep,
                           GLOBAL_BATCH // world, 1, torch.device("cpu"))
        model = MoETransformer(self.cfg, dispatcher=self.rt.dispatcher()) if dims else MoETransformer(self.cfg)
        model.init_weights(seed)
        self.model = parallelize(model, self.cfg, dims, torch.device("cpu"))
        self.opt = build_optimizer(self.model, self.cfg.optim)
        self.schedule = WarmupCosine(self.opt, 1, 10, 0.1)

    def _loss(self, tokens: torch.Tensor) -> torch.Tensor:
        b = GLOBAL_BATCH // self.rt.world_size
        mine = tokens[self.rank * b:(self.rank + 1) * b]
        logits = self.model(mine[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten()) + moe_aux_loss(self.model)

    def _mean(self, loss: torch.Tensor) -> float:
        loss = loss.detach().clone()
        if self.rt.distributed:
            dist.all_reduce(loss)
        return float(loss) / self.rt.world_size

    def step(self, i: int) -> float:
        self.schedule.apply()
        loss = self._loss(_batch(i))
        loss.backward()
        reduce_gradients(self.model, self.rt.dims)
        clip_grad_norm_(self.model, self.cfg.optim.grad_clip, self.rt.dims)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.schedule.step()
        return self._mean(loss)

    def next_step(self) -> list[float]:
        """The loss of the next step's batch, that step, and the loss after it."""
        before = self.step(2)
        with torch.no_grad():
            after = self._mean(self._loss(_batch(3)))
        return [before, after]


def _save_then_continue(world: int, ep: int, data_parallel: str, path: str, async_save: bool) -> list[float]:
    run = _Run(world, ep, data_parallel, seed=3)
    run.step(0)
    run.step(1)
    saver = Checkpointer(path, run.rt, async_save=async_save, data_parallel=data_parallel)
    saved = saver.save(2, run.model, run.opt, run.schedule, {"epoch": 0, "cursor": 0})
    saver.finish()
    return [saved] + run.next_step()


def _load_then_continue(world: int, ep: int, data_parallel: str, saved: str) -> list[float]:
    run = _Run(world, ep, data_parallel, seed=11)
    info = Checkpointer(saved, run.rt).load(saved, run.model, run.opt, run.schedule)
    assert info["step"] == 2 and run.schedule.step_count == 2
    return run.next_step()


def _world2(rank, world, tmp):
    saved, *reference = _save_then_continue(2, 2, "replicate", f"{tmp}/a", async_save=True)
    return {"saved": saved, "reference": reference,
            "same_layout": _load_then_continue(2, 2, "replicate", saved),
            "ep1_fsdp": _load_then_continue(2, 1, "fsdp", saved)}


def _world4(rank, world, saved_a, tmp):
    saved, *reference = _save_then_continue(4, 4, "fsdp", f"{tmp}/b", async_save=False)
    return {"saved": saved, "reference": reference, "ep2_dp2_fsdp_from_a": _load_then_continue(4, 2, "fsdp", saved_a),
            "ep2_dp2_replicate_from_b": _load_then_continue(4, 2, "replicate", saved)}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dcp"))
    w2 = run_distributed(_world2, 2, tmp, timeout_s=120.0)
    w4 = run_distributed(_world4, 4, w2[0]["saved"], tmp, timeout_s=120.0)
    return w2, w4


def test_same_layout_resumes_bit_exact(layouts):
    w2, _ = layouts
    for rank in w2:
        assert rank["same_layout"] == rank["reference"]


def test_another_ep_size_world_size_and_data_parallel_mode(layouts):
    w2, w4 = layouts
    a, b = w2[0]["reference"], w4[0]["reference"]
    assert w2[0]["ep1_fsdp"] == pytest.approx(a, rel=RELATIVE)  # EP 2 → 1, replicate → fsdp
    assert w4[0]["ep2_dp2_fsdp_from_a"] == pytest.approx(a, rel=RELATIVE)  # world 2 → 4
    assert w4[0]["ep2_dp2_replicate_from_b"] == pytest.approx(b, rel=RELATIVE)  # EP 4 → 2, fsdp → replicate


def test_one_process_loads_a_sharded_checkpoint(layouts):
    _, w4 = layouts
    assert _load_then_continue(1, 1, "replicate", w4[0]["saved"]) == pytest.approx(w4[0]["reference"], rel=RELATIVE)


# ---------------------------------------------------------------- verification and fallback


def _snapshot(run: _Run) -> dict[str, torch.Tensor]:
    """This rank's model, AdamW state and schedule position, copied."""
    state = {f"model.{n}": t.detach().clone() for n, t in run.model.state_dict().items()}
    for n, p in run.model.named_parameters():
        state.update({f"optim.{n}.{k}": v.detach().clone() for k, v in run.opt.state[p].items()})
    state["schedule"] = torch.tensor(run.schedule.step_count)
    return state


def _differences(run: _Run, snapshot: dict[str, torch.Tensor]) -> list[str]:
    """The entries of ``run``'s state that are not bit-identical to ``snapshot``'s."""
    now = _snapshot(run)
    return sorted(k for k in now.keys() | snapshot.keys() if k not in now or k not in snapshot
                  or not torch.equal(now[k], snapshot[k]))


def _restore(run: _Run, ckpt_dir: str, resume: str) -> tuple[dict | None, list[str]]:
    said = []
    return Checkpointer(ckpt_dir, run.rt).restore(resume, run.model, run.opt, run.schedule, say=said.append), said


def _flip(path: str) -> None:
    """64 bytes inverted in the middle of the file: same size, other contents."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        mid = len(data) // 2
        data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
        f.seek(0)
        f.write(data)


def _write(text: str):
    def write(path: str) -> None:
        with open(path, "w") as f:
            f.write(text)
    return write


# name: (the file damaged, the damage, what the error says about it)
DAMAGE = {
    "bit_flip": ("__0_0.distcp", _flip, r"SHA-256 differs from the manifest \(contents altered\)"),
    "truncated": ("__0_0.distcp", lambda p: os.truncate(p, os.path.getsize(p) // 2),
                  r"\d+ bytes, manifest says \d+ \(truncated\)"),
    "missing_file": ("__0_0.distcp", os.remove, "missing"),
    "missing_dcp_metadata": (".metadata", os.remove, "missing"),
    "torn_meta_json": ("meta.json", _write('{"format": "dcp-2", "step": 2, "wor'), r"not valid JSON at line 1 column \d+"),
    "extra_file": ("__0_1.distcp", _write("left over"), r"not in the manifest \(unexpected file\)"),
}


@pytest.fixture
def two_saved(tmp_path) -> tuple[str, list[dict]]:
    """One process's checkpoints of steps 1 and 2, and its state at each."""
    d = str(tmp_path / "ck")
    run = _Run(1, 1, "replicate", seed=3)
    saver = Checkpointer(d, run.rt)
    states = []
    for step in (1, 2):
        run.step(step - 1)
        saver.save(step, run.model, run.opt, run.schedule, {"epoch": 0, "cursor": step})
        states.append(_snapshot(run))
    return d, states


def test_the_manifest_lists_every_file_with_its_size_and_hash(two_saved):
    d, _ = two_saved
    step2 = os.path.join(d, "step_00000002")
    with open(os.path.join(step2, "meta.json")) as f:
        meta = json.load(f)
    assert meta["format"] == "dcp-2"
    assert sorted(meta["files"]) == sorted(set(os.listdir(step2)) - {"meta.json"}) == [".metadata", "__0_0.distcp"]
    for name, entry in meta["files"].items():
        assert entry == ckpt.file_digest(os.path.join(step2, name))
    assert Checkpointer(d, _Run(1, 1, "replicate", seed=11).rt).verify(step2) is True


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_one_error_by_name_and_auto_falls_back(two_saved, damage):
    d, (step1_state, _) = two_saved
    name, harm, problem = DAMAGE[damage]
    newest = os.path.join(d, "step_00000002")
    harm(os.path.join(newest, name))
    run = _Run(1, 1, "replicate", seed=11)
    with pytest.raises(CheckpointError, match=f"^{re.escape(newest)} failed verification: {re.escape(os.path.join(newest, name))}: {problem}$"):
        _restore(run, d, newest)
    info, said = _restore(run, d, "auto")
    assert info["step"] == 1 and info["path"] == os.path.join(d, "step_00000001")
    assert re.fullmatch(f"checkpoint {re.escape(newest)} failed verification \\({re.escape(name)}: {problem}\\): "
                        f"trying the previous one", said[0])
    assert said[1:] == [f"set {newest} aside as {newest}.corrupt: its step will be saved again"]
    assert _differences(run, step1_state) == []
    # the run saves step 2 again, a checkpoint that verifies, instead of finding it "already saved"
    again = Checkpointer(d, run.rt).save(2, run.model, run.opt, run.schedule, {"epoch": 0, "cursor": 2})
    assert list_checkpoints(d)[-1] == again and Checkpointer(d, run.rt).verify(again)


def test_when_every_checkpoint_is_damaged_auto_stops_instead_of_starting_afresh(two_saved):
    d, _ = two_saved
    for step in (1, 2):
        _flip(os.path.join(d, f"step_{step:08d}", "__0_0.distcp"))
    run = _Run(1, 1, "replicate", seed=11)
    with pytest.raises(CheckpointError, match=f"^{re.escape(d)} holds no checkpoint that verifies and loads .*: "
                                              f"{re.escape(d)}/step_00000002: __0_0.distcp: SHA-256 differs.*; "
                                              f"{re.escape(d)}/step_00000001: __0_0.distcp: SHA-256 differs"):
        _restore(run, d, "auto")
    assert [os.path.basename(p) for p in list_checkpoints(d)] == ["step_00000001", "step_00000002"]  # nothing set aside


def test_auto_takes_the_newest_complete_checkpoint_over_a_stale_latest(two_saved):
    d, (_, step2_state) = two_saved
    with open(os.path.join(d, "latest"), "w") as f:  # a crash between the rename and the pointer's update
        f.write("step_00000001\n")
    run = _Run(1, 1, "replicate", seed=11)
    info, said = _restore(run, d, "auto")
    assert info["step"] == 2 and said == [] and _differences(run, step2_state) == []
    assert _restore(run, d, "none") == (None, [])
    assert _restore(run, os.path.join(d, "elsewhere"), "auto") == (None, [])


def _as_dcp1(path: str) -> None:
    """meta.json as the version before the manifest wrote it."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    del meta["files"]
    _write(json.dumps({**meta, "format": "dcp-1"}))(os.path.join(path, "meta.json"))


def test_a_dcp1_checkpoint_loads_unverified_and_falls_back_when_its_load_fails(two_saved):
    d, (step1_state, step2_state) = two_saved
    newest = os.path.join(d, "step_00000002")
    _as_dcp1(newest)
    run = _Run(1, 1, "replicate", seed=11)
    info, said = _restore(run, d, "auto")
    assert info["step"] == 2 and _differences(run, step2_state) == []
    assert said == [f"checkpoint {newest} has no checksums (format dcp-1, written before they existed): loading it unverified"]
    # no manifest to catch a truncated file: DCP's load fails, on every rank, and auto goes back one
    os.truncate(os.path.join(newest, "__0_0.distcp"), 1000)
    run = _Run(1, 1, "replicate", seed=11)
    with pytest.raises(CheckpointError, match=f"^{re.escape(newest)} could not be loaded: {re.escape(newest)}: rank 0: "):
        _restore(run, d, newest)
    info, said = _restore(run, d, "auto")
    assert info["step"] == 1 and _differences(run, step1_state) == []
    assert re.fullmatch(f"checkpoint {re.escape(newest)} could not be loaded \\(rank 0: \\w+: .*\\): trying the previous one",
                        said[1])


@pytest.mark.parametrize("where", ["parameter", "adam_moment"])
def test_non_finite_state_is_never_saved(two_saved, where):
    d, _ = two_saved
    run = _Run(1, 1, "replicate", seed=11)
    _restore(run, d, "auto")
    name, p = next(iter(run.model.named_parameters()))
    with torch.no_grad():
        if where == "parameter":
            p.view(-1)[5] = float("nan")
            named = f"model.{name}"
        else:
            run.opt.state[p]["exp_avg"].view(-1)[5] = float("inf")
            named = f"optim.{name}.exp_avg"
    with pytest.raises(FloatingPointError, match=f"^refusing to save step 3: {re.escape(named)} holds non-finite values$"):
        Checkpointer(d, run.rt).save(3, run.model, run.opt, run.schedule, {"epoch": 0, "cursor": 3})
    assert sorted(os.listdir(d)) == ["latest", "step_00000001", "step_00000002"]
    assert open(os.path.join(d, "latest")).read() == "step_00000002\n"


def _two_ranks_verify(rank: int, world: int, tmp: str) -> dict:
    """Steps 1 and 2 saved by two ranks at EP 2, recording which rank hashed which file; rank 1's
    file of step 2 damaged; resumed by name and by ``auto``; then a NaN in rank 1's experts only."""
    d = f"{tmp}/ck"
    hashed = []
    digest = ckpt.file_digest
    ckpt.file_digest = lambda path: hashed.append(os.path.basename(path)) or digest(path)
    run = _Run(2, 2, "replicate", seed=3)
    saver = Checkpointer(d, run.rt)
    run.step(0)
    saver.save(1, run.model, run.opt, run.schedule, {"epoch": 0, "cursor": 1})
    step1_state = _snapshot(run)
    run.step(1)
    hashed.clear()
    newest = saver.save(2, run.model, run.opt, run.schedule, {"epoch": 0, "cursor": 2})
    hashed_at_save = list(hashed)
    with open(os.path.join(newest, "meta.json")) as f:
        listed = sorted(json.load(f)["files"])
    dist.barrier()
    if rank == 0:
        _flip(os.path.join(newest, "__1_0.distcp"))
    dist.barrier()
    fresh = _Run(2, 2, "replicate", seed=11)
    try:
        _restore(fresh, d, newest)
        by_name = None
    except CheckpointError as e:
        by_name = str(e)
    info, said = _restore(fresh, d, "auto")
    ckpt.file_digest = digest
    experts = sorted(n for n, _ in run.model.named_parameters() if "experts" in n)
    if rank == 1:
        with torch.no_grad():
            dict(run.model.named_parameters())[experts[0]].view(-1)[3] = float("nan")
    try:
        saver.save(3, run.model, run.opt, run.schedule, {"epoch": 0, "cursor": 3})
        refused = None
    except FloatingPointError as e:
        refused = str(e)
    return {"hashed_at_save": hashed_at_save, "listed": listed, "by_name": by_name, "step": info["step"],
            "said": said, "differences": _differences(fresh, step1_state), "refused": refused,
            "expected_refusal": f"refusing to save step 3: model.{experts[0]} holds non-finite values",
            "after": sorted(os.listdir(d))}


def test_two_ranks_hash_their_share_and_agree_on_a_damaged_file(tmp_path):
    ranks = run_distributed(_two_ranks_verify, 2, str(tmp_path), timeout_s=60.0)
    newest = f"{tmp_path}/ck/step_00000002"
    files = [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert ranks[0]["listed"] == files  # every rank's file is in the manifest
    assert ranks[0]["hashed_at_save"] == [files[0], files[2]] and ranks[1]["hashed_at_save"] == [files[1]]
    for r in ranks:  # found by rank 0's hashing, the same verdict on both
        assert r["by_name"] == f"{newest} failed verification: {newest}/__1_0.distcp: SHA-256 differs from the manifest (contents altered)"
        assert r["step"] == 1 and r["differences"] == []
        assert r["refused"] == r["expected_refusal"] == ranks[0]["expected_refusal"]  # the NaN was on rank 1 only
    assert ranks[0]["said"] == [
        f"checkpoint {newest} failed verification (__1_0.distcp: SHA-256 differs from the manifest (contents altered)): "
        f"trying the previous one",
        f"set {newest} aside as {newest}.corrupt: its step will be saved again"]
    assert ranks[1]["said"] == []
    assert ranks[0]["after"] == ["latest", "step_00000001", "step_00000002.corrupt"]


# ---------------------------------------------------------------- a resumed run's metrics


def test_a_resumed_run_keeps_its_metrics_up_to_its_start_step_once(tmp_path):
    cfg = Config()
    cfg.log.wandb_mode, cfg.log.progress = "disabled", False
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "train/loss": 5.0 - s} for s in range(1, 6)] + [{"step": 4, "val/loss": 2.0}]
    # the crash tore the last line
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 6, "train/lo')
    log = RunLogger(cfg, 0, str(tmp_path), 10, start_step=3)
    log.log(4, {"train/loss": 0.5}, console=False)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "time"} for r in kept] == [*records[:3], {"step": 4, "train/loss": 0.5}]
    RunLogger(cfg, 0, str(tmp_path), 10, start_step=0)
    assert path.read_text() == ""  # a fresh run, a fresh file
