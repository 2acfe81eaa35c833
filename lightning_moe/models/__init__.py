"""The reference model (a byte-level Mixture-of-Experts GPT) and the causal-LM training base it shares
with ``lightning_moe.hf.HFMoEModule``."""

from lightning_moe.models.blocks import (
    Attention,
    FeedForward,
    TransformerBlock,
    apply_rotary,
    rotary_cos_sin,
)
from lightning_moe.models.causal_lm import CausalLMModule, next_token_loss, warmup_cosine_factor
from lightning_moe.models.moe_gpt import MoEGPT, is_moe_layer
from lightning_moe.models.mtp import MultiTokenPrediction, add_mtp_targets

__all__ = [
    "Attention",
    "CausalLMModule",
    "FeedForward",
    "MoEGPT",
    "MultiTokenPrediction",
    "TransformerBlock",
    "add_mtp_targets",
    "apply_rotary",
    "is_moe_layer",
    "next_token_loss",
    "rotary_cos_sin",
    "warmup_cosine_factor",
]
