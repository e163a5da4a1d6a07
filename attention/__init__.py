"""Attention for the model: Triton FlashAttention (forward + backward; a Gluon forward on Hopper)
and the attention block."""

from attention.flash_attn import flash_attention
from attention.module import Attention
from attention.reference import attention_reference

__all__ = ["Attention", "flash_attention", "attention_reference"]
