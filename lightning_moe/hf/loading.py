"""Loading a transformers causal LM, and the attention implementation lightning-moe trains it with."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe._compat import attention_implementation, set_attention_implementation
from lightning_moe.hf.convert import SUPPORTED_MODEL_TYPES
from lightning_moe.hf.families import model_family

__all__ = ["PADDED_SDPA", "load_causal_lm", "register_padded_sdpa", "use_padded_sdpa_if_needed"]

# The name transformers knows the padded-V SDPA under (``config._attn_implementation``).
PADDED_SDPA = "lightning_moe_sdpa"


def load_causal_lm(
    model: Any, attn_implementation: str | None = "sdpa", dtype: torch.dtype = torch.float32, weights: bool = True
) -> nn.Module:
    """A transformers causal LM from a ``PreTrainedModel``, a ``PretrainedConfig``, a config mapping
    (``{"model_type": ..., **kwargs}``) or a local folder (``from_pretrained``, nothing downloaded;
    ``weights=False``: only its config, the weights are read later shard by shard).

    A config gives a random init from the global RNG (same seed, same model on every rank).
    """
    import transformers
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model
    if isinstance(model, (str, os.PathLike)):
        path = Path(model).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"pretrained model folder {str(path)!r} does not exist: pass a local folder holding config.json and"
                " *.safetensors (e.g. written by save_pretrained or save_hf); nothing is downloaded"
            )
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{str(path)!r} has no config.json: it is not a saved Hugging Face model folder")
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        _check_model_type(config)
        kwargs = _attn_kwargs(config, attn_implementation)
        if not weights:
            return AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **kwargs)
    if isinstance(model, Mapping):
        from lightning_moe.hf.configs import build_config

        spec = dict(model)
        if "model_type" not in spec:
            raise ValueError(
                f"a config mapping needs a 'model_type' key (one of {SUPPORTED_MODEL_TYPES}), got {sorted(spec)}"
            )
        model = build_config(spec.pop("model_type"), **spec)
    if isinstance(model, PretrainedConfig):
        _check_model_type(model)
        return AutoModelForCausalLM.from_config(model, dtype=dtype, **_attn_kwargs(model, attn_implementation))
    raise TypeError(
        f"model must be a transformers PreTrainedModel, a PretrainedConfig, a config mapping or a local folder path,"
        f" got {type(model).__name__}"
    )


def _check_model_type(config: Any) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        archs = getattr(config, "architectures", None) or [config.model_type]
        raise ValueError(
            f"unknown architecture {archs[0]!r} (model_type={config.model_type!r}): lightning_moe.hf supports"
            f" {SUPPORTED_MODEL_TYPES}"
        )


def _attn_kwargs(config: Any, attn_implementation: str | None) -> dict[str, Any]:
    # A family whose attention has no SDPA form (GPT-OSS's sinks) keeps transformers' default (eager).
    if attn_implementation is None or not model_family(config.model_type).sdpa:
        return {}
    return {"attn_implementation": attn_implementation}


def _padded_v_sdpa(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """transformers' SDPA attention with V zero-padded to the q/k head dim and the output cut back.

    MLA (DeepSeek-V3) has ``v_head_dim < qk_head_dim``; ring attention (context parallelism) needs
    equal head dims. The padding columns produce zero outputs that are dropped: the result is exact.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dv = value.shape[-1]
    if dv == query.shape[-1]:
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)
    value = F.pad(value, (0, query.shape[-1] - dv))
    out, weights = sdpa_attention_forward(module, query, key, value, *args, **kwargs)
    return out[..., :dv], weights


def register_padded_sdpa() -> str:
    """Make the padded-V SDPA known to transformers as :data:`PADDED_SDPA` and return that name.

    Idempotent (registering again maps the name to the same function); called by whatever sets a
    model to it, so that importing this module changes nothing in transformers.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(PADDED_SDPA, _padded_v_sdpa)
    return PADDED_SDPA


def use_padded_sdpa_if_needed(model: nn.Module) -> None:
    """Switch an SDPA model whose family has narrower V than q/k heads (MLA) to :data:`PADDED_SDPA`.

    Every config in the model (the top one and any sub-module's) that says ``"sdpa"`` is switched,
    since each attention module reads its own. Other models are left as they are.
    """
    config = model.config
    if not model_family(config.model_type).narrow_value_heads or attention_implementation(config) != "sdpa":
        return
    name = register_padded_sdpa()
    set_attention_implementation(config, name)
    for sub in model.modules():
        sub_config = getattr(sub, "config", None)
        if sub_config is not None and attention_implementation(sub_config) == "sdpa":
            set_attention_implementation(sub_config, name)
