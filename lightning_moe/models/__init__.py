"""The reference model: a byte-level Mixture-of-Experts GPT."""

from lightning_moe.models.blocks import (
    Attention,
    FeedForward,
    TransformerBlock,
    apply_rotary,
    rotary_cos_sin,
)
from lightning_moe.models.moe_gpt import MoEGPT, is_moe_layer, warmup_cosine_factor

__all__ = [
    "Attention",
    "FeedForward",
    "MoEGPT",
    "TransformerBlock",
    "apply_rotary",
    "is_moe_layer",
    "rotary_cos_sin",
    "warmup_cosine_factor",
]
