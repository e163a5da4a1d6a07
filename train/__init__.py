"""Training script for the MoE transformer: config, model, data, loop, checkpoints, logging.

Run::

    torchrun --standalone --nproc_per_node=2 train/train.py --config configs/tiny.yaml   # CPU, gloo
    torchrun --standalone --nproc_per_node=2 train/train.py --config configs/ep2.yaml    # 2 GPUs, EP=2
    python train/train.py --config configs/tiny.yaml --parallel.ep=1 --train.steps=50   # one process
    # two "nodes" of two processes on one host (run both; c10d rendezvous on localhost)
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=localhost:29500 --rdzv-id=demo train/train.py --config configs/tiny.yaml --parallel.ep=2
    torchrun --nnodes=2 --node_rank=1 ...same...

Modules: ``config`` (dataclasses, YAML, ``--section.key=value``), ``runtime`` (torchrun env →
device, process group, ParallelDims), ``data`` (stdlib bytes / token memmap / text, rank shards),
``model`` (MoETransformer), ``optim`` (AdamW groups, warmup + cosine), ``checkpoint`` (atomic,
expert-sharded, EP-resizable), ``flops`` (MFU), ``logger`` (wandb, metrics.jsonl, console,
heatmap), ``report`` (markdown from run logs), ``train`` (the loop).

Logged keys (rank 0; MoE counts are world-wide, from the latest micro-batch): ``train/loss``,
``train/aux_loss`` (coefficients applied), ``train/lr``, ``train/grad_norm``,
``train/skipped_steps`` (non-finite steps dropped, ``train.on_nonfinite=skip``), ``val/loss``,
``perf/tokens_per_s``, ``perf/mfu`` (GPUs of known peak), ``perf/step_time_s``, ``perf/max_mem_gb`` (GPU) or
``perf/max_rss_gb`` (CPU), ``moe/layer{i}/{dropped_fraction, tile_utilization, load_max,
load_mean, load_imbalance, router_entropy, aux_loss, z_loss}``, ``moe/dropped_fraction``,
``moe/load_imbalance``, ``moe/tile_utilization``; every ``log.heatmap_every`` steps
``moe/expert_load_heatmap`` (layers × experts) and ``moe/experts_table`` (routed, kept tokens,
tiles, padded slots, dropped per expert). Run directory: ``<log.dir>/<run_name>/`` with
``config.yaml``, ``run_info.json``, ``metrics.jsonl``, ``heatmaps/``, ``wandb/``, ``checkpoints/``.
"""
