"""Train an MoE transformer with data × expert parallelism.

    torchrun --nproc_per_node=W train/train.py --config configs/<name>.yaml [--section.key=value ...]
    torchrun --nproc_per_node=W -m train --config configs/<name>.yaml        # the same, as a module
    python train/train.py --config configs/tiny.yaml          # one process, no torchrun

Sections: config → distributed init → data → model → parallelize → optimizer → (resume) →
loop (forward, loss + aux losses, backward, grad sync, clip, step, schedule) → log → checkpoint.
"""

import os
import sys

if __package__ in (None, ""):  # run as a script: import the repo's packages, not train/'s files
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    sys.path.insert(0, _root)

import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from moe import moe_aux_loss, moe_layers, update_expert_biases  # noqa: E402
from parallel import CommTimer, clip_grad_norm_, sync_gradients  # noqa: E402
from parallel.stats import global_moe_stats, update_expert_biases_global  # noqa: E402
from train import checkpoint as ckpt  # noqa: E402
from train.config import Config, ConfigError, load_config, to_yaml  # noqa: E402
from train.data import TokenStream, load_splits, shard, val_batches  # noqa: E402
from train.flops import param_counts, peak_flops, train_flops_per_token  # noqa: E402
from train.logger import RunLogger  # noqa: E402
from train.model import MoETransformer, num_moe_blocks  # noqa: E402
from train.optim import WarmupCosine, build_optimizer  # noqa: E402
from train.runtime import Runtime, init_runtime  # noqa: E402


def autocast_context(cfg: Config, device: torch.device):
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    if bf16:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


@torch.no_grad()
def evaluate(model, batches, rt: Runtime, autocast) -> float:
    total = 0.0
    for x, y in batches:
        with autocast():
            logits = model(x.to(rt.device))
        total += F.cross_entropy(logits.flatten(0, 1), y.to(rt.device).flatten()).item()
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


def main(argv: list[str]) -> dict:
    # ---- config (validated before any process group exists)
    cfg = load_config(argv)

    # ---- distributed init
    rt = init_runtime(cfg.parallel.ep, cfg.parallel.device)
    torch.manual_seed(cfg.train.seed + rt.rank)
    run_dir = os.path.join(cfg.log.dir, cfg.log.run_name)
    ckpt_dir = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")

    # ---- data: every rank reads its own shard
    train_tokens, val_tokens = load_splits(cfg.data.source, cfg.data.path, cfg.data.token_dtype, cfg.data.max_bytes, cfg.data.val_fraction)
    d = cfg.data
    if d.source == "tokens":  # one pass over the memmap; an id past the table would fail deep in the embedding
        top = int(max(train_tokens.max(initial=0), val_tokens.max(initial=0)))
        if top >= cfg.model.vocab_size:
            raise ValueError(f"model.vocab_size={cfg.model.vocab_size} but {d.path} holds token id {top}")
    stream = TokenStream(shard(train_tokens, rt.rank, rt.world_size), d.seq_len, d.batch_size, cfg.train.seed, rt.rank)
    val_set = val_batches(shard(val_tokens, rt.rank, rt.world_size), d.seq_len, d.batch_size, d.val_batches)

    # ---- model, parallelized: the MoE layers get the EP dispatcher and hold E / ep experts
    # (P2P buffers: a training and a validation micro-batch are both batch_size · seq_len tokens,
    # and every MoE block holds a slot from its dispatch to its backward; a model without MoE
    # blocks never dispatches, but a dispatcher has at least one slot)
    dispatcher = rt.dispatcher(cfg.parallel.dispatcher, max_tokens=d.batch_size * d.seq_len,
                               num_buffers=max(num_moe_blocks(cfg), 1))
    # all-to-all timing (ep > 1): every MoE layer shares this dispatcher, hence the one timer
    comm_timer = None
    if cfg.log.time_comm and dispatcher is not None:
        comm_timer = dispatcher.comm_timer = CommTimer()
    with rt.device:  # built on the device: a large model never materialises on the host
        model = MoETransformer(cfg, dispatcher=dispatcher)
    model.init_weights(cfg.train.seed)
    autocast = autocast_context(cfg, rt.device)

    # ---- optimizer and schedule
    optimizer = build_optimizer(model, cfg.optim)
    schedule = WarmupCosine(optimizer, cfg.optim.warmup_steps, cfg.train.steps, cfg.optim.min_lr_ratio)

    # ---- resume
    step = 0
    resume_from = ckpt.find_checkpoint(ckpt_dir, cfg.checkpoint.resume)
    if resume_from is not None:
        info = ckpt.load_checkpoint(resume_from, model, optimizer, schedule, rt)
        step = info["step"]
        stream.load_state_dict(info["data"])

    log = RunLogger(cfg, rt.rank, run_dir, cfg.train.steps, start_step=step)
    counts = param_counts(model, cfg, rt.ep)
    flops_per_token = train_flops_per_token(cfg)
    peak = peak_flops(rt.device)
    tokens_per_step = d.batch_size * d.seq_len * cfg.train.grad_accum * rt.world_size
    if rt.rank == 0:
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
        write_run_info(run_dir, argv, rt, counts, flops_per_token, peak, tokens_per_step)
    log.print(
        f"world {rt.world_size} (ep {rt.ep}, edp {rt.world_size // rt.ep}) on {rt.device} | "
        f"params {counts['params_total'] / 1e6:.2f}M total, {counts['params_active'] / 1e6:.2f}M active | "
        f"{flops_per_token / 1e6:.1f} MFLOP/token (train) | {tokens_per_step} tokens/step"
        + (f" | {dispatcher!r}" if dispatcher is not None else "")
        + (f" | resumed from {resume_from} at step {step}" if resume_from else "")
    )
    history = {"train_loss": {}, "val_loss": {}}

    if step == 0:
        val = evaluate(model, val_set, rt, autocast)
        history["val_loss"][0] = val
        log.log(0, {"val/loss": val})

    # ---- loop
    stop_at = min(cfg.train.steps, step + cfg.checkpoint.stop_after) if cfg.checkpoint.stop_after else cfg.train.steps
    window_start, window_tokens, eval_time = time.perf_counter(), 0, 0.0
    if comm_timer is not None:
        comm_timer.read_ms()  # drop the validation pass's exchanges
    layers = moe_layers(model)
    while step < stop_at:
        lr = schedule.apply()
        ce_sum, aux_sum = torch.zeros((), device=rt.device), torch.zeros((), device=rt.device)
        lb = {n: 0.0 for n in layers}
        zl = {n: 0.0 for n in layers}
        for _ in range(cfg.train.grad_accum):
            x, y = stream.next_batch()
            x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
            with autocast():
                logits = model(x)
            ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            aux = moe_aux_loss(model).to(ce.device)
            ((ce + aux) / cfg.train.grad_accum).backward()
            ce_sum += ce.detach()
            aux_sum += aux.detach()
            for n, m in layers.items():
                lb[n] += m.last_aux.load_balancing_loss.detach() / cfg.train.grad_accum
                zl[n] += m.last_aux.z_loss.detach() / cfg.train.grad_accum
        if rt.distributed:
            sync_gradients(model, rt.dims)
        grad_norm = clip_grad_norm_(model, cfg.optim.grad_clip, rt.dims)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cfg.moe.expert_bias and rt.distributed:
            update_expert_biases_global(model, rt.dims)
        elif cfg.moe.expert_bias:
            update_expert_biases(model)
        schedule.step()
        step += 1
        window_tokens += tokens_per_step
        log.advance()

        # ---- log
        do_val = step == cfg.train.steps or (cfg.train.eval_every and step % cfg.train.eval_every == 0)
        do_log = step % cfg.log.every == 0 or step == stop_at or do_val
        metrics = {}
        if do_log:
            if rt.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - window_start - eval_time
            loss, aux_mean = rt.all_reduce_mean([ce_sum.item() / cfg.train.grad_accum, aux_sum.item() / cfg.train.grad_accum])
            if not math.isfinite(loss):  # checked where the loss is read anyway: no extra host sync
                raise FloatingPointError(f"train/loss is {loss} at step {step}: stopping before it reaches a checkpoint")
            tok_s = window_tokens / max(elapsed, 1e-9)
            metrics = {
                "train/loss": loss, "train/aux_loss": aux_mean, "train/lr": lr, "train/grad_norm": grad_norm.item(),
                "train/tokens": step * tokens_per_step, "perf/tokens_per_s": tok_s,
                "perf/mfu": tok_s * flops_per_token / (peak * rt.world_size) if not math.isnan(peak) else math.nan,
                "perf/step_time_s": elapsed / max(window_tokens // tokens_per_step, 1),
            }
            if comm_timer is not None:  # mean over ranks of the window's all-to-all time
                a2a_ms = rt.all_reduce_mean([comm_timer.read_ms()])[0]
                metrics["time/all_to_all_ms"] = a2a_ms / max(window_tokens // tokens_per_step, 1)
                metrics["time/all_to_all_fraction"] = a2a_ms / max(elapsed * 1e3, 1e-9)
            if rt.device.type == "cuda":
                metrics["perf/max_mem_gb"] = torch.cuda.max_memory_allocated(rt.device) / 2**30
            else:
                metrics["perf/max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            mm, names, stats = moe_metrics(model, rt, {n: float(v) for n, v in lb.items()}, {n: float(v) for n, v in zl.items()})
            metrics.update(mm)
            history["train_loss"][step] = loss
            if cfg.log.heatmap_every and (step % cfg.log.heatmap_every == 0 or step == cfg.train.steps) and stats:
                log.log_experts(step, names, stats)
            window_start, window_tokens, eval_time = time.perf_counter(), 0, 0.0
        if do_val:
            t0 = time.perf_counter()
            metrics["val/loss"] = evaluate(model, val_set, rt, autocast)
            history["val_loss"][step] = metrics["val/loss"]
            eval_time += time.perf_counter() - t0
            if comm_timer is not None:
                comm_timer.read_ms()  # validation is outside the step time
        if metrics:
            log.log(step, metrics)

        # ---- checkpoint
        every = cfg.checkpoint.every and step % cfg.checkpoint.every == 0
        final = step == stop_at and (cfg.checkpoint.save_final or stop_at < cfg.train.steps)
        if every or final:
            path = ckpt.save_checkpoint(ckpt_dir, step, model, optimizer, schedule, stream.state_dict(), rt, cfg.checkpoint.keep)
            log.print(f"saved {path}")

    log.finish()
    rt.barrier()
    rt.shutdown()
    return history


def cli(argv: list[str]) -> None:
    """The command line of ``train/train.py`` and ``python -m train``: ``--help`` prints every
    config key with its default; a config error is one line and exit status 2."""
    if {"-h", "--help"} & set(argv):
        print(__doc__.strip() + "\n\nEvery key of the config tree, with its default:\n\n" + to_yaml(Config()))
        sys.exit(0)
    try:
        main(argv)
    except ConfigError as err:  # a bad key or value: one line naming it, no traceback
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli(sys.argv[1:])
