"""What lightning-moe needs to know about each supported transformers model family, in one place.

One :class:`ModelFamily` per ``model_type``: the layouts it cannot take (and why), how its
attention runs and which of its parts a tensor-parallel plan or the MoE conversion treats apart.
Code asks :func:`model_family` instead of branching on family names, so that a new family is
described once, here. (How each family's sparse-MoE *block* maps onto ``MoELayer`` is code, not
facts: :data:`lightning_moe.hf.convert.FAMILIES`.) Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["MODEL_FAMILIES", "ModelFamily", "model_family"]


@dataclass(frozen=True)
class ModelFamily:
    """Facts about one transformers MoE model family (a ``model_type``)."""

    model_type: str
    # Layout dims this family cannot take (checked before any work): dim -> why.
    unsupported: Mapping[str, str] = field(default_factory=dict)
    # Whether its attention has an SDPA form; without one the model keeps transformers' default (eager).
    sdpa: bool = True
    # MLA: V heads narrower than q/k heads. Trained through SDPA with V zero-padded, because ring
    # attention (context parallelism) needs equal head dims.
    narrow_value_heads: bool = False
    # q/k norms: "per_head" (over head_dim: tp shards them with the heads), "all_heads" (over every
    # head at once: a tp shard cannot compute them) or None.
    qk_norm: Literal["per_head", "all_heads"] | None = None
    # A per-head ``self_attn.sinks`` parameter (GPT-OSS): tp shards it with the heads.
    attention_sinks: bool = False
    # MLA's ``kv_a_proj_with_mqa``: its trailing columns (the rotary key shared by all heads) reach
    # every tp rank's local heads, so their gradient must be summed over tp.
    shared_rotary_key: bool = False
    # Aux-loss-free balancing through the router's expert bias: no aux loss unless one is asked for.
    expert_bias_balancing: bool = False
    # Multi-token prediction depths published as extra decoder layers ``model.layers.{num_hidden_layers + k}``
    # (``config.num_nextn_predict_layers`` of them), which transformers' causal LM drops: lightning_moe.hf.mtp.
    mtp_layers: bool = False


MODEL_FAMILIES: dict[str, ModelFamily] = {
    f.model_type: f
    for f in (
        ModelFamily("mixtral"),
        ModelFamily("qwen2_moe"),
        ModelFamily("qwen3_moe", qk_norm="per_head"),
        ModelFamily(
            "olmoe",
            unsupported={"tp": "its q/k norms span all heads (a tp shard holds only some heads)"},
            qk_norm="all_heads",
        ),
        ModelFamily(
            "deepseek_v3", narrow_value_heads=True, shared_rotary_key=True, expert_bias_balancing=True, mtp_layers=True
        ),
        ModelFamily(
            "gpt_oss",
            unsupported={
                "cp": "its attention sinks and sliding window need an explicit mask, which ring attention cannot take"
            },
            sdpa=False,
            attention_sinks=True,
        ),
    )
}


def model_family(model_type: str) -> ModelFamily:
    """The :class:`ModelFamily` of ``model_type`` (``"qwen3_moe"``); ``ValueError`` for an unknown one."""
    family = MODEL_FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"unknown Hugging Face MoE model_type {model_type!r}: supported are {tuple(MODEL_FAMILIES)}")
    return family
