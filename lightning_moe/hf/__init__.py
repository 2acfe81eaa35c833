"""Hugging Face MoE models under lightning-moe (optional extra ``[hf]``: transformers >= 5).

The only part of lightning-moe that imports ``transformers``; see docs/hf.md.

- :func:`convert_moe_blocks`: swap each sparse-MoE block of a transformers causal LM for an
  equal :class:`~lightning_moe.moe.MoELayer` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3,
  GPT-OSS);
- :class:`HFMoEModule`: a LightningModule around such a model (loading and SDPA: ``loading``; TP
  plan and pipeline split: ``plans``; what differs between families: ``families``);
- :func:`save_hf`: gather from any layout and write a folder ``from_pretrained`` loads;
- ``mtp``: DeepSeek-V3's multi-token prediction layers (``model.layers.{num_hidden_layers + k}``),
  which transformers drops, built, loaded, trained and written back by ``HFMoEModule``;
- :func:`upcycle`: a dense Llama/Mistral/Qwen2/Qwen3 becomes an equal MoE module (sparse upcycling).
"""

from lightning_moe.hf.configs import TINY_CONFIGS, build_config
from lightning_moe.hf.convert import (
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    check_supported,
    convert_moe_blocks,
    hf_state_dict,
    moe_layer_to_hf,
)
from lightning_moe.hf.loading import load_causal_lm
from lightning_moe.hf.module import HFMoEModule
from lightning_moe.hf.save import save_hf
from lightning_moe.hf.upcycle import UpcycledHFMoEModule, upcycle

__all__ = [
    "FAMILIES",
    "HFMoEModule",
    "SUPPORTED_MODEL_TYPES",
    "TINY_CONFIGS",
    "UpcycledHFMoEModule",
    "build_config",
    "check_supported",
    "convert_moe_blocks",
    "hf_state_dict",
    "load_causal_lm",
    "moe_layer_to_hf",
    "save_hf",
    "upcycle",
]
