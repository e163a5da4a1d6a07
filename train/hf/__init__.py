"""Hugging Face MoE checkpoints in and out: ``train.init_from`` (:func:`load_weights`) and
``python -m train.export`` (:func:`export`). Supported: see :mod:`train.hf.architectures`."""

from train.hf.architectures import ARCHITECTURES, Architecture, HFError, architecture
from train.hf.load import SafetensorsDir, init_options, load_weights, moe_block_state, moe_config, read_hf_config

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "HFError",
    "SafetensorsDir",
    "architecture",
    "init_options",
    "load_weights",
    "moe_block_state",
    "moe_config",
    "read_hf_config",
]
