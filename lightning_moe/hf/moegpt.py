"""``MoEGPT`` as a Hugging Face Mixtral model, where that maps exactly.

MoEGPT's math is Mixtral's when every layer is an MoE layer with softmax routing, top-k weights
renormalised, no shared expert, no expert bias, no capacity limit and no extra options: RMSNorm,
rotate-half RoPE from the same ``theta``, GQA attention, SwiGLU experts, an untied head.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_moe.hf.convert import moe_layer_to_hf
from lightning_moe.moe import MoELayer

# MoEGPT name -> Mixtral name, per block ("{i}") and for the ends.
_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_END_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _check_maps_exactly(model: Any) -> None:
    hp = model.hparams
    layers = list(model.layers.values())
    problems = []
    if any(not isinstance(block.feed_forward, MoELayer) for block in layers):
        problems.append(
            f"moe_layer_freq={hp.moe_layer_freq} leaves dense layers (Mixtral has an MoE FFN in every layer)"
        )
    for block in layers:
        layer = block.feed_forward
        if not isinstance(layer, MoELayer):
            continue
        router = layer.router
        if router.score_func != "softmax" or not router.topk_norm:
            problems.append(
                "routing other than softmax with top-k renormalisation (score_func='softmax', topk_norm=True)"
            )
        if layer.shared_expert is not None or layer.shared_expert_gate is not None:
            problems.append("a shared expert")
        if router.use_expert_bias or router.num_groups is not None or router.use_sinkhorn:
            problems.append("expert bias, group-limited or sinkhorn routing")
        if layer.capacity_factor is not None:
            problems.append(f"capacity_factor={layer.capacity_factor} (Mixtral is dropless)")
        if router.routed_scaling_factor != 1.0 or layer.experts.activation != "swiglu":
            problems.append("routed_scaling_factor or a non-SwiGLU activation")
        if router.bias is not None or layer.experts.b1 is not None or layer.expert_output_bias is not None:
            problems.append("router or expert biases")
        break  # every MoE layer of MoEGPT shares the same options
    if problems:
        raise ValueError("this MoEGPT does not map exactly onto Mixtral: " + "; ".join(dict.fromkeys(problems)))


def moegpt_to_mixtral(model: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(MixtralConfig, state dict)`` of a whole (unsharded) ``MoEGPT``; ``ValueError`` if it does not map exactly.

    Example::

        config, state = moegpt_to_mixtral(model)
        write_hf_folder(config, state, "out/hf")    # from_pretrained("out/hf") gives the same logits
    """
    from transformers import MixtralConfig

    _check_maps_exactly(model)
    hp = model.hparams
    first = next(iter(model.layers.values()))
    moe: MoELayer = first.feed_forward
    config = MixtralConfig(
        vocab_size=hp.vocab_size,
        hidden_size=hp.hidden_size,
        intermediate_size=moe.experts.w1.shape[2],
        num_hidden_layers=hp.num_layers,
        num_attention_heads=hp.num_heads,
        num_key_value_heads=hp.num_kv_heads or hp.num_heads,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        max_position_embeddings=hp.max_seq_len,
        rms_norm_eps=first.attention_norm.eps,
        rope_theta=hp.rope_theta,
        tie_word_embeddings=False,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )
    source = model.state_dict()
    state = {hf: source[ours] for ours, hf in _END_NAMES.items()}
    for key, block in model.layers.items():
        for ours, hf in _BLOCK_NAMES.items():
            state[f"model.layers.{key}.{hf}"] = source[f"layers.{key}.{ours}"]
        for name, value in moe_layer_to_hf(block.feed_forward, family="mixtral").items():
            state[f"model.layers.{key}.mlp.{name}"] = value
    return config, {name: value.detach().contiguous() for name, value in state.items()}
