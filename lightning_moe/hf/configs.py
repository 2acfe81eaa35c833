"""Tiny random configs of the supported families (tests, Hydra presets): nothing is downloaded."""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_CONFIGS", "build_config"]

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

# Per family: the config kwargs of a 2-layer, hidden-32, 8-expert model (DeepSeek-V3: a dense first layer).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(_COMMON, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        _COMMON,
        intermediate_size=40,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=20,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        _COMMON,
        intermediate_size=40,
        moe_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        head_dim=8,
    ),
    "olmoe": dict(_COMMON, intermediate_size=24, num_experts=8, num_experts_per_tok=2, eos_token_id=1, pad_token_id=0),
    "deepseek_v3": dict(
        _COMMON,
        intermediate_size=40,
        moe_intermediate_size=24,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_key_value_heads=4,
        routed_scaling_factor=2.5,
        rope_scaling=None,
    ),
    "gpt_oss": dict(
        _COMMON,
        intermediate_size=24,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=8,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_scaling=None,
    ),
}


def build_config(model_type: str, **kwargs: Any) -> Any:
    """A transformers ``PretrainedConfig`` of ``model_type`` from keyword arguments (no download)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kwargs)
