"""train.cuda_graph (train/step_graph.py): a run whose micro-batches replay one captured CUDA graph
trains exactly like the eager run, step for step, through validation, capacity drops, gradient
clipping and activation checkpointing."""

import subprocess
import sys

import pytest
import torch

from tests.test_train import REPO, SMALL, _losses, _metrics, _torchrun
from train.config import load_config
from train.step_graph import MicroBatchGraph
from train.trainer import Trainer


def _trainer(tmp_path, name: str, *extra: str) -> Trainer:
    # 2 heads: the GPU attention kernel takes head dims 32/64/128 (SMALL's 4 heads of 16 run on CPU only);
    # grad_accum 3: the captured micro-batch replays for the others and for every later step;
    # validation at step 2 replaces the layers' last_aux between replays
    argv = SMALL + ["--model.n_heads=2", "--parallel.device=cuda", "--train.steps=4", "--train.grad_accum=3",
                    "--train.eval_every=2", f"--log.dir={tmp_path}", f"--log.run_name={name}", *extra]
    return Trainer(load_config(argv, world_size=1), argv)


def _trained(tmp_path, name: str, *extra: str):
    """The history, final parameters and the trainer of a 4-step run on the GPU."""
    trainer = _trainer(tmp_path, name, *extra)
    history = trainer.fit()
    trainer.close()
    params = {k: v.detach().float().cpu() for k, v in trainer.model.state_dict().items()}
    return history, params, trainer


@pytest.mark.gpu
@pytest.mark.parametrize("options", [
    [],  # configs/tiny.yaml: capacity 1.5 (drops), grad_clip 1.0, bf16 autocast, fp32 master experts
    ["--moe.capacity_factor=none", "--train.activation_checkpointing=selective"],
    ["--moe.first_dense_layers=1", "--moe.num_shared_experts=1", "--model.tie_embeddings=false"],
])
def test_graph_replays_train_exactly_like_eager(tmp_path, options):
    eager, eager_params, _ = _trained(tmp_path, "eager", *options)
    graphed, graphed_params, trainer = _trained(tmp_path, "graphed", "--train.cuda_graph=true", *options)
    assert trainer.graph.replays == 3 * 3  # steps 2-4, 3 micro-batches each
    assert trainer.graph.graph is None  # released by close()
    assert sorted(graphed["train_loss"]) == [1, 2, 3, 4]
    assert graphed == eager  # the losses of every step and validation, bit for bit
    _same_logged_metrics(tmp_path / "eager", tmp_path / "graphed")
    for name, value in eager_params.items():
        torch.testing.assert_close(graphed_params[name], value, rtol=0, atol=0, msg=name)


def _same_logged_metrics(eager_dir, graphed_dir) -> None:
    """Every logged metric but the timings (losses, gradient norms, each layer's routing stats),
    bit for bit, at every logged step."""
    logged = [{step: {k: v for k, v in m.items() if k != "time" and not k.startswith(("perf/", "time/"))}
               for step, m in _metrics(str(run)).items()} for run in (eager_dir, graphed_dir)]
    assert sorted(logged[1]) == sorted(logged[0])
    for step, metrics in logged[0].items():
        assert logged[1][step] == metrics, step


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("chunks, copy", [(1, "kernels"), (2, "kernels"), (2, "copy_engine")])
def test_graph_replays_at_ep2_with_the_p2p_dispatcher_train_like_eager(tmp_path, chunks, copy):
    # the exchange inside the graph: the P2P kernels' flag targets advance on the device at every
    # replay; the aux losses' all-reduces over the EP group are captured NCCL calls; with 2 chunks
    # the exchange runs on the dispatcher's side stream, forked from and joined to the capture's;
    # with the copy engines the rows move as captured memcpy nodes into the peer's buffers (chunks
    # of fixed buffers come without a capacity: the config refuses both)
    base = SMALL + ["--model.n_heads=2", "--train.steps=4", "--train.grad_accum=3", "--train.eval_every=2",
                    "--parallel.ep=2", "--parallel.device=cuda", "--parallel.dispatcher=p2p",
                    f"--parallel.overlap_chunks={chunks}", f"--parallel.p2p_copy={copy}",
                    "--parallel.data_parallel=replicate", f"--log.dir={tmp_path}",
                    *(["--moe.capacity_factor=none"] if chunks > 1 else [])]
    _torchrun(2, base + ["--log.run_name=eager"])
    _torchrun(2, base + ["--train.cuda_graph=true", "--log.run_name=graphed"])
    _same_logged_metrics(tmp_path / "eager", tmp_path / "graphed")
    if copy == "copy_engine":  # the same rows by other means: the kernels' run, bit for bit
        _torchrun(2, [a for a in base if not a.startswith("--parallel.p2p_copy")] + ["--log.run_name=kernels"])
        _same_logged_metrics(tmp_path / "kernels", tmp_path / "eager")
    elif chunks > 1:  # two layers' chunks in flight train as one chunk does, up to the summation order
        _torchrun(2, [a for a in base if not a.startswith("--parallel.overlap_chunks")] + ["--log.run_name=one_chunk"])
        one, chunked = _losses(str(tmp_path / "one_chunk")), _losses(str(tmp_path / "eager"))
        assert sorted(chunked) == sorted(one) == [1, 2, 3, 4]
        for step, loss in one.items():
            assert chunked[step] == pytest.approx(loss, rel=2e-3), step


@pytest.mark.gpu
def test_graph_refuses_other_shapes_and_replaced_gradients(tmp_path):
    trainer = _trainer(tmp_path, "graphed", "--train.cuda_graph=true")
    for _ in range(2):  # eager, then captured
        trainer.train_step()
    tokens = trainer.graph.tokens_BS
    with pytest.raises(ValueError, match=r"captured for tokens \(4, 32\), got \(2, 32\)"):
        trainer.graph.replay(tokens[:2], tokens[:2])
    trainer.model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"a parameter's \.grad was replaced or set to None since the capture"):
        trainer.train_step()
    trainer.close()


def test_a_model_off_the_gpu_is_refused():
    with pytest.raises(ValueError, match="train.cuda_graph=true needs the model on a CUDA GPU, got cpu"):
        MicroBatchGraph(torch.nn.Linear(2, 2))


_SYNC_IN_STEP = """
import sys
from tests.test_step_graph import _trainer
trainer = _trainer(sys.argv[1], "sync", "--train.cuda_graph=true")
trainer.train_step()  # eager: the launch's first step
trainer.model.norm.register_forward_hook(lambda module, args, out: out.sum().item())
trainer.train_step()
"""


@pytest.mark.gpu
def test_a_host_sync_in_the_micro_batch_is_one_clear_error(tmp_path):
    # in a process of its own: a failed capture leaves the CUDA generator expecting one, and every
    # later random draw on the GPU in that process fails ("Offset increment outside graph capture")
    proc = subprocess.run([sys.executable, "-c", _SYNC_IN_STEP, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = "RuntimeError: train.cuda_graph=true: the micro-batch could not be captured"
    assert error in proc.stderr, proc.stderr[-3000:]
