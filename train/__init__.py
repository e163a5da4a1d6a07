"""Training script for the MoE transformer: config, model, data, loop, checkpoints, logging.

Entry point: ``torchrun --nproc_per_node=N train/train.py --config configs/<name>.yaml``.
"""
