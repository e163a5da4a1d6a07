"""The training run as one object: :class:`Trainer` holds the sections of ``train/train.py``'s
job in order.

``Trainer(cfg, argv)`` builds them: distributed init → data → model (:meth:`Trainer.build_model`:
the MoE layers get the expert-parallel dispatcher) → optimizer and schedule → resume → logger and
run files. :meth:`Trainer.fit` runs the loop: :meth:`Trainer.train_step` (forward, loss + aux
losses, backward over ``train.grad_accum`` micro-batches, gradient sync, clip, step, expert
biases, schedule), :meth:`Trainer.log_step` (train metrics, :meth:`Trainer.validate`),
:meth:`Trainer.save_checkpoint`. :meth:`Trainer.close` ends the run on every rank.
"""

import contextlib
import faulthandler
import gc
import json
import math
import os
import platform
import resource
import time
from dataclasses import dataclass

import torch
import triton

from moe import master_weight_step, moe_aux_loss, moe_layers, update_expert_biases
from parallel import CommTimer, clip_grad_norm_, flight
from parallel.flight import Watchdog
from parallel.stats import global_moe_stats, update_expert_biases_global
from train.agreement import check_ranks_agree, config_facts, data_facts
from train.checkpoint import Checkpointer, list_checkpoints
from train.config import Config, ConfigError, to_yaml
from train.data import TokenStream, shard, unigram_counts, val_batches
from train.flops import param_counts, peak_flops, train_flops_per_token
from train.logger import RunLogger
from train.hf import load_weights, read_hf_config
from train.model import MoETransformer, num_moe_blocks
from train.nonfinite import NonFiniteGuard, first_nonfinite
from train.optim import WarmupCosine, build_optimizer
from train.parallelize import is_sharded, parallelize, reduce_gradients, set_gradient_sync, trains_in_bf16
from train.rundir import check_run_dir, ckpt_dir_of, clear_run_dir, run_dir_of
from train.runtime import Runtime, init_runtime
from train.step_graph import MicroBatchGraph
from train.tokenizer import load_tokens


@contextlib.contextmanager
def planned_gc(every: int):
    """Inside, Python's automatic cyclic garbage collection is off (``every`` > 0; the caller
    collects every ``every`` steps at one point of the step, the same on every rank): a collection
    that starts by itself pauses one rank at a moment of its own, and every other rank then waits
    for it in the next collective. One full collection first, so the model's construction leaves
    no garbage behind; the automatic collector comes back on leaving. ``every`` 0: nothing changes."""
    if not every or not gc.isenabled():
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def autocast_context(cfg: Config, device: torch.device):
    if trains_in_bf16(cfg, device):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


@torch.no_grad()
def evaluate(model, batches, rt: Runtime, autocast) -> float:
    total = 0.0
    for x, y in batches:
        with autocast():
            total += model(x.to(rt.device), y.to(rt.device)).item()
    return rt.all_reduce_mean([total / len(batches)])[0]


def moe_metrics(model, rt: Runtime, lb_losses: dict, z_losses: dict) -> tuple[dict, list, list]:
    """Per-layer scalars of the latest micro-batch, over the whole world (collective)."""
    stats = global_moe_stats(model, rt.dims) if rt.distributed else {n: m.last_aux.stats for n, m in moe_layers(model).items()}
    metrics, names, values = {}, [], []
    for i, (name, s) in enumerate(stats.items()):
        sc = s.scalars()
        key = f"moe/layer{i}"
        metrics.update({
            f"{key}/dropped_fraction": sc["dropped_fraction"], f"{key}/tile_utilization": sc["tile_utilization"],
            f"{key}/load_max": sc["max_load"], f"{key}/load_mean": sc["mean_load"],
            f"{key}/load_imbalance": sc["load_imbalance"], f"{key}/router_entropy": sc["router_entropy"],
            f"{key}/aux_loss": lb_losses[name], f"{key}/z_loss": z_losses[name],
        })
        names.append(name)
        values.append(s)
    if values:
        routed = sum(float(s.routed_per_expert.sum()) for s in values)
        kept = sum(float(s.tokens_per_expert.sum()) for s in values)
        metrics["moe/dropped_fraction"] = (routed - kept) / max(routed, 1.0)
        metrics["moe/load_imbalance"] = max(metrics[f"moe/layer{i}/load_imbalance"] for i in range(len(values)))
        metrics["moe/tile_utilization"] = sum(metrics[f"moe/layer{i}/tile_utilization"] for i in range(len(values))) / len(values)
    return metrics, names, values


def write_run_info(run_dir, argv, rt: Runtime, counts, flops_per_token, peak, tokens_per_step) -> None:
    info = {
        "argv": argv, "device": torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else platform.processor() or "cpu",
        "device_type": rt.device.type, "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "world_size": rt.world_size, "ep": rt.ep, **counts,
        "train_flops_per_token": flops_per_token, "peak_flops_per_gpu": peak, "tokens_per_step": tokens_per_step,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    with open(os.path.join(run_dir, "run_info.json"), "w") as f:
        json.dump(info, f, indent=1)


@dataclass
class StepScalars:
    """What :meth:`Trainer.train_step` returns: the step's scalars, left on the device (reading
    one syncs the host, so only logging steps read them)."""

    lr: float  # the learning rate the step used
    losses: torch.Tensor  # (2,) cross-entropy and aux losses (coefficients applied), mean over micro-batches and ranks
    grad_norm: torch.Tensor  # () the global gradient norm before clipping
    lb_losses: dict[str, torch.Tensor]  # MoE layer name → load-balancing loss, mean over the micro-batches
    z_losses: dict[str, torch.Tensor]  # MoE layer name → z-loss, mean over the micro-batches


class Trainer:
    """One training run on this rank; every method that talks to other ranks is called by all.

    ``history`` is what :meth:`fit` returns: ``{"train_loss": {step: loss}, "val_loss": {step:
    loss}}`` of the logged and validated steps.
    """

    def __init__(self, cfg: Config, argv: list[str]):
        """Builds the run from a validated config (``argv``: the command line, for run_info.json)
        and resumes from ``checkpoint.resume`` when it finds one."""
        self.cfg = cfg
        changes = check_run_dir(cfg)  # a rerun into an earlier run's directory: resume or refuse, before any group
        self.rt = rt = init_runtime(cfg.parallel.ep, cfg.parallel.device, cfg.parallel.timeout_s)
        # a collective one rank never joins ends the run in parallel.timeout_s, naming it; a
        # collective the ranks issue with different sizes aborts gloo at once (C++ terminate):
        # faulthandler then prints every thread's Python stack, the main thread's at its call
        self.watchdog = None
        if rt.distributed:
            self.watchdog = Watchdog(cfg.parallel.timeout_s, rt.rank)
            faulthandler.enable()
        check_ranks_agree("config", config_facts(cfg))  # before anything that depends on it
        torch.manual_seed(cfg.train.seed + rt.rank)
        self.run_dir, self.ckpt_dir = run_dir_of(cfg), ckpt_dir_of(cfg)
        if cfg.log.overwrite:
            if rt.rank == 0:
                clear_run_dir(cfg)
            rt.barrier()  # nobody reads the run directory before it is cleared
        self.build_data()
        self.model = self.build_model()
        self.moe_layers = moe_layers(self.model)
        self.autocast = autocast_context(cfg, rt.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.schedule = WarmupCosine(self.optimizer, cfg.optim.warmup_steps, cfg.train.steps, cfg.optim.min_lr_ratio)
        self.guard = NonFiniteGuard(self.optimizer, cfg.train.on_nonfinite, rt.device)
        self.graph = None
        if cfg.train.cuda_graph:
            if is_sharded(cfg, rt.dims):  # torchrun with one process: FSDP still wraps the model
                raise ConfigError("train.cuda_graph=true with parallel.data_parallel=fsdp under torchrun: FSDP gathers "
                                  "and reduce-scatters from host-side hooks; use parallel.data_parallel=replicate")
            self.graph = MicroBatchGraph(self.model)
        # the data position before each step since the last finiteness check: a bad step's
        # batches can be replayed to find where its values went non-finite
        self._replay: dict[int, dict] = {}

        self.step = 0
        about = {"config": cfg.to_dict()}
        if cfg.train.init_from:
            about["hf_config"] = read_hf_config(cfg.train.init_from)
        self.checkpointer = Checkpointer(self.ckpt_dir, rt, cfg.checkpoint.keep, cfg.checkpoint.async_save,
                                         cfg.parallel.data_parallel, about)
        # verified; under resume=auto the newest checkpoint that verifies and loads
        flight.phase("checkpoint restore")
        info = self.checkpointer.restore(cfg.checkpoint.resume, self.model, self.optimizer, self.schedule,
                                         say=lambda line: print(line, flush=True))
        resume_from = None if info is None else info["path"]
        if info is not None:
            if changes and rt.rank == 0:
                print(changes, flush=True)
            self.step = info["step"]
            self.stream.load_state_dict(info["data"])
        # checkpoint.stop_after ends this launch early (a preemptible slot); the schedule still
        # runs to train.steps
        self.start_step = self.step
        stop_after = cfg.checkpoint.stop_after
        self.stop_at = min(cfg.train.steps, self.step + stop_after) if stop_after else cfg.train.steps

        self.log = RunLogger(cfg, rt.rank, self.run_dir, cfg.train.steps, start_step=self.step)
        self.flops_per_token = train_flops_per_token(cfg)
        self.peak = peak_flops(rt.device)
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * cfg.train.grad_accum * rt.world_size
        self._write_run_files(argv, resume_from)
        self.history = {"train_loss": {}, "val_loss": {}}

    def build_data(self) -> None:
        """The token stream and validation batches of this rank's shard: every rank reads its own."""
        cfg, rt, d = self.cfg, self.rt, self.cfg.data
        train_tokens, val_tokens, tokenizer = load_tokens(d, cfg.model.vocab_size, rt.local_rank)
        check_ranks_agree("data", data_facts(train_tokens, val_tokens, tokenizer))  # the same files on every node
        if d.source == "tokens":  # one pass over the memmap; an id past the table would fail deep in the embedding
            top = int(max(train_tokens.max(initial=0), val_tokens.max(initial=0)))
            if top >= cfg.model.vocab_size:
                raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} but data.path={d.path} holds token id {top}: "
                                  f"set --model.vocab_size={top + 1} or more (the tokenizer's vocabulary size)")
        # the LM head's bias starts at the training split's unigram frequencies (every rank counts the
        # whole split, not its shard, so all start alike; sampled above 2^26 tokens)
        self.token_counts = unigram_counts(train_tokens, cfg.model.vocab_size) if cfg.model.lm_head_bias else None
        self.stream = TokenStream(shard(train_tokens, rt.rank, rt.world_size), d.seq_len, d.batch_size, cfg.train.seed, rt.rank)
        self.val_set = val_batches(shard(val_tokens, rt.rank, rt.world_size), d.seq_len, d.batch_size, d.val_batches)

    def build_model(self) -> torch.nn.Module:
        """The model, parallelized: its MoE layers get the EP dispatcher and hold E / ep experts.

        Every wrapping of the model belongs here, before the optimizer and the checkpoint see it.
        Sets ``dispatcher`` (None: one process) and ``comm_timer`` (None unless
        ``log.time_comm`` and ep > 1).
        """
        cfg, rt, d = self.cfg, self.rt, self.cfg.data
        # P2P buffers: a training and a validation micro-batch are both batch_size · seq_len tokens,
        # and every MoE block holds a slot from its dispatch to its backward; a model without MoE
        # blocks never dispatches, but a dispatcher has at least one slot
        self.dispatcher = rt.dispatcher(cfg.parallel.dispatcher, max_tokens=d.batch_size * d.seq_len,
                                        num_buffers=max(num_moe_blocks(cfg), 1), overlap_chunks=cfg.parallel.overlap_chunks,
                                        timeout_s=cfg.parallel.timeout_s, capacity_factor=cfg.moe.capacity_factor,
                                        capacity_groups=cfg.moe.capacity_groups, nccl_sizes=cfg.parallel.nccl_sizes,
                                        p2p_copy=cfg.parallel.p2p_copy)
        # all-to-all timing (ep > 1): every MoE layer shares this dispatcher, hence the one timer
        self.comm_timer = None
        if cfg.log.time_comm and rt.ep > 1:
            self.comm_timer = self.dispatcher.comm_timer = CommTimer()
        with rt.device:  # built on the device: a large model never materialises on the host
            model = MoETransformer(cfg, dispatcher=self.dispatcher)
        model.init_weights(cfg.train.seed)
        if self.token_counts is not None:
            model.init_lm_bias(torch.from_numpy(self.token_counts))
        if cfg.train.init_from:
            seconds = load_weights(model, cfg.train.init_from, cfg)
            if rt.rank == 0:
                print(f"loaded the weights of {cfg.train.init_from} in {seconds:.1f} s (each rank its own experts)", flush=True)
        model = parallelize(model, cfg, rt.dims, rt.device)
        for i, block in enumerate(model.blocks):  # the collective record names the block (before FSDP's hooks)
            block.register_forward_pre_hook(lambda *_, name=f"blocks.{i}": flight.enter_layer(name), prepend=True)
        return model

    def _write_run_files(self, argv: list[str], resume_from: str | None) -> None:
        """config.yaml and run_info.json (rank 0), and the run's one-line summary."""
        rt, dispatcher = self.rt, self.dispatcher
        counts = param_counts(self.model, self.cfg, rt.ep)
        if rt.rank == 0:
            with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(self.cfg))
            write_run_info(self.run_dir, argv, rt, counts, self.flops_per_token, self.peak, self.tokens_per_step)
        self.log.print(
            f"world {rt.world_size} (ep {rt.ep}, edp {rt.world_size // rt.ep}) on {rt.device} | "
            f"params {counts['params_total'] / 1e6:.2f}M total, {counts['params_active'] / 1e6:.2f}M active | "
            f"{self.flops_per_token / 1e6:.1f} MFLOP/token (train) | {self.tokens_per_step} tokens/step"
            + (f" | {dispatcher!r}" if dispatcher is not None else "")
            + (f" | resumed from {resume_from} at step {self.step}" if resume_from else "")
        )

    def fit(self) -> dict:
        """Train from ``step`` to ``stop_at`` (validating first on a fresh run); returns ``history``."""
        if self.step == 0:
            self.log.log(0, {"val/loss": self.validate()})
        self._start_window()
        with planned_gc(self.cfg.train.gc_every):
            while self.step < self.stop_at:
                scalars = self.train_step()
                self.log_step(scalars)
                every = self.cfg.checkpoint.every and self.step % self.cfg.checkpoint.every == 0
                final = self.step == self.stop_at and (self.cfg.checkpoint.save_final or self.stop_at < self.cfg.train.steps)
                if every or final:
                    self.save_checkpoint()
                self.collect_garbage()
        self.check_finite()
        return self.history

    def collect_garbage(self) -> None:
        """Under :func:`planned_gc`, after a step: a full collection every ``train.gc_every``
        steps (a young-generation one, torchtitan's, never frees a cycle that was still alive at
        an earlier collection: it is in the old generation by then, which only a full one reads)."""
        if self.cfg.train.gc_every and self.step % self.cfg.train.gc_every == 0:
            gc.collect(2)

    def train_step(self) -> StepScalars:
        """One optimizer step over ``train.grad_accum`` micro-batches; advances ``step``."""
        cfg, rt, model, accum = self.cfg, self.rt, self.model, self.cfg.train.grad_accum
        self._replay[self.step + 1] = self.stream.state_dict()
        lr = self.schedule.apply()
        ce_sum, aux_sum = torch.zeros((), device=rt.device), torch.zeros((), device=rt.device)
        lb = {n: 0.0 for n in self.moe_layers}
        zl = {n: 0.0 for n in self.moe_layers}
        # the launch's first step runs eagerly (it compiles and autotunes the kernels), the graph
        # is captured in the second
        graphed = self.graph is not None and self.step > self.start_step
        # the experts' fp32 weights cast once for all micro-batches
        with master_weight_step(model, keep_copies=self.graph is not None):
            for micro in range(accum):
                set_gradient_sync(model, cfg, rt.dims, micro == accum - 1)
                flight.phase(f"step {self.step + 1}, micro-batch {micro}: forward and backward")
                x_BS, y_BS = self._next_batch()
                if graphed:
                    ce, aux = self.graph.run(self._micro_batch, x_BS, y_BS)
                else:
                    ce, aux = self._micro_batch(x_BS, y_BS)
                ce_sum += ce.detach()
                aux_sum += aux.detach()
                for n, m in self.moe_layers.items():
                    lb[n] += m.last_aux.load_balancing_loss.detach() / accum
                    zl[n] += m.last_aux.z_loss.detach() / accum
        # the summed micro-batch gradients of this rank → those of one process on the global batch
        flight.phase(f"step {self.step + 1}: gradient sync and optimizer")
        reduce_gradients(model, rt.dims)
        grad_norm = clip_grad_norm_(model, cfg.optim.grad_clip, rt.dims, self.optimizer)  # clipped in the AdamW kernel
        losses = rt.all_reduce_mean_(torch.stack([ce_sum, aux_sum]) / accum)
        self.guard.update(self.step + 1, losses, grad_norm)  # a bad step: the fused AdamW skips it
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.graph is None)  # a graph adds into the same tensors
        with self.guard.guarded(m.router.expert_bias for m in self.moe_layers.values() if m.router.expert_bias is not None):
            if cfg.moe.expert_bias and rt.distributed:
                update_expert_biases_global(model, rt.dims)
            elif cfg.moe.expert_bias:
                update_expert_biases(model)
        self.schedule.step()
        self.step += 1
        return StepScalars(lr, losses, grad_norm, lb, zl)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x_BS, y_BS = self.stream.next_batch()
        return x_BS.to(self.rt.device, non_blocking=True), y_BS.to(self.rt.device, non_blocking=True)

    def _loss(self, x_BS: torch.Tensor, y_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward of one micro-batch: (cross-entropy, aux losses)."""
        with self.autocast():  # the LM head and its cross-entropy in chunks: no (B·S, V) logits
            ce = self.model(x_BS, y_BS)
        return ce, moe_aux_loss(self.model).to(ce.device)

    def _micro_batch(self, x_BS: torch.Tensor, y_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch (the gradients added into ``.grad``, scaled for
        ``train.grad_accum``): (cross-entropy, aux losses)."""
        ce, aux = self._loss(x_BS, y_BS)
        ((ce + aux) / self.cfg.train.grad_accum).backward()
        return ce, aux

    def check_finite(self) -> int:
        """Read the non-finite bookkeeping (one host sync; collective when it raises): the
        steps skipped so far. Raises FloatingPointError when ``train.on_nonfinite`` says stop,
        naming the bad step and where its values first went non-finite."""
        cfg = self.cfg.train
        skipped, first, latest = self.guard.read()
        stop = first >= 0 if cfg.on_nonfinite == "stop" else skipped > cfg.max_skipped_steps
        if stop:
            bad = first if cfg.on_nonfinite == "stop" else latest
            where = self._locate_nonfinite(bad)
            saved = list_checkpoints(self.ckpt_dir)
            last = f"the newest checkpoint is {saved[-1]}" if saved else "no checkpoint exists"
            if cfg.on_nonfinite == "stop":
                raise FloatingPointError(
                    f"step {bad}: the loss or the gradient norm is not finite; first non-finite value: {where}. "
                    f"The run stopped at step {self.step} with the model as after step {bad - 1} (no update since) "
                    f"and no checkpoint written after it ({last}). Lower optim.lr, check the data, or set "
                    f"train.on_nonfinite=skip")
            raise FloatingPointError(
                f"{skipped} steps skipped for non-finite values, more than train.max_skipped_steps="
                f"{cfg.max_skipped_steps}; the latest, step {bad}: first non-finite value: {where} ({last})")
        self._replay.clear()
        return skipped

    def _locate_nonfinite(self, step: int) -> str:
        """Replay ``step``'s micro-batches (on every rank) until one shows where its values first
        went non-finite (under the parameters as they are now: those of that step under stop)."""
        resume_at = self.stream.state_dict()
        self.stream.load_state_dict(self._replay[step])
        set_gradient_sync(self.model, self.cfg, self.rt.dims, True)
        where = ""
        for _ in range(self.cfg.train.grad_accum):
            where = first_nonfinite(self.model, lambda: sum(self._loss(*self._next_batch())))
            if not where.startswith("nowhere"):
                break
        self.stream.load_state_dict(resume_at)
        return where

    def _start_window(self) -> None:
        """Throughput is measured over the steps between two logged ones, validation time excluded."""
        self._window_start, self._window_tokens, self._eval_time = time.perf_counter(), 0, 0.0

    def log_step(self, scalars: StepScalars) -> None:
        """Log the step just taken: the train metrics every ``log.every`` steps, at ``stop_at``
        and on validation steps; ``val/loss`` every ``train.eval_every`` steps and at the last.
        Collective on the steps it logs."""
        cfg, step = self.cfg, self.step
        self._window_tokens += self.tokens_per_step
        self.log.advance()
        do_val = step == cfg.train.steps or (cfg.train.eval_every and step % cfg.train.eval_every == 0)
        # the first step of a launch too: on a slow machine it says at once that training runs
        do_log = step % cfg.log.every == 0 or step == self.stop_at or do_val or step == self.start_step + 1
        flight.phase(f"step {step}: logging")
        metrics = self._train_metrics(scalars) if do_log else {}
        if do_val:
            t0 = time.perf_counter()
            metrics["val/loss"] = self.validate()
            self._eval_time += time.perf_counter() - t0
        if metrics:
            self.log.log(step, metrics)

    def _train_metrics(self, scalars: StepScalars) -> dict:
        """Reads the step's scalars (mean over ranks) and the window's throughput, records the
        loss in ``history``, writes the expert heatmap when due, and starts the next window.
        Raises FloatingPointError where :meth:`check_finite` does."""
        cfg, rt, step = self.cfg, self.rt, self.step
        skipped = self.check_finite()  # syncs the host with the device
        elapsed = time.perf_counter() - self._window_start - self._eval_time
        steps = max(self._window_tokens // self.tokens_per_step, 1)
        loss, aux_mean = scalars.losses.tolist()
        tok_s = self._window_tokens / max(elapsed, 1e-9)
        metrics = {
            "train/loss": loss, "train/aux_loss": aux_mean, "train/lr": scalars.lr, "train/grad_norm": scalars.grad_norm.item(),
            "train/skipped_steps": skipped, "train/tokens": step * self.tokens_per_step, "perf/tokens_per_s": tok_s,
            "perf/step_time_s": elapsed / steps,
        }
        if not math.isnan(self.peak):  # a device of unknown peak (a CPU) has no MFU
            metrics["perf/mfu"] = tok_s * self.flops_per_token / (self.peak * rt.world_size)
        if self.comm_timer is not None:  # mean over ranks of the window's all-to-all time
            a2a_ms = rt.all_reduce_mean([self.comm_timer.read_ms()])[0]
            metrics["time/all_to_all_ms"] = a2a_ms / steps
            metrics["time/all_to_all_fraction"] = a2a_ms / max(elapsed * 1e3, 1e-9)
        if rt.device.type == "cuda":
            metrics["perf/max_mem_gb"] = torch.cuda.max_memory_allocated(rt.device) / 2**30
        else:
            metrics["perf/max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        mm, names, stats = moe_metrics(self.model, rt, {n: float(v) for n, v in scalars.lb_losses.items()},
                                       {n: float(v) for n, v in scalars.z_losses.items()})
        metrics.update(mm)
        self.history["train_loss"][step] = loss
        if cfg.log.heatmap_every and (step % cfg.log.heatmap_every == 0 or step == cfg.train.steps) and stats:
            self.log.log_experts(step, names, stats)
        self._start_window()
        return metrics

    def validate(self) -> float:
        """val/loss at ``step``: mean over the rank's validation batches, then over ranks
        (collective); recorded in ``history``."""
        flight.phase(f"step {self.step}: validation")
        val = evaluate(self.model, self.val_set, self.rt, self.autocast)
        self.history["val_loss"][self.step] = val
        if self.comm_timer is not None:
            self.comm_timer.read_ms()  # validation's exchanges are outside the step time
        return val

    def save_checkpoint(self) -> str:
        """The model, optimizer, schedule and data position at ``step`` (collective); returns its
        path. Never after a step that :meth:`check_finite` stops on."""
        self.check_finite()
        flight.phase(f"step {self.step}: checkpoint save")
        path = self.checkpointer.save(self.step, self.model, self.optimizer, self.schedule, self.stream.state_dict())
        self.log.print(f"saving {path} in the background" if self.cfg.checkpoint.async_save else f"saved {path}")
        return path

    def close(self) -> None:
        """Publish an async checkpoint in flight, flush the logs and leave the process group,
        together with every rank."""
        flight.phase("the end of the run")
        if self.graph is not None:
            self.graph.release()
        self.checkpointer.finish()
        self.log.finish(self.ckpt_dir)
        self.rt.barrier()
        if self.watchdog is not None:
            self.watchdog.stop()
        self.rt.shutdown()
