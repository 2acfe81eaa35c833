"""Multi-token prediction (MTP) layers of published Hugging Face checkpoints (DeepSeek-V3).

The checkpoints store MTP depth ``k`` (0-based) as one more decoder layer after the main ones,
``model.layers.{L + k}`` with ``L = config.num_hidden_layers`` (``config.num_nextn_predict_layers``
depths): an ordinary decoder layer's ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``
and ``mlp`` (the MoE block), plus ``enorm``, ``hnorm``, ``eh_proj [hidden, 2 * hidden]`` (embedding
half first), ``shared_head.norm`` and two copies of shared tensors, ``embed_tokens`` (the
embedding) and ``shared_head.head`` (``lm_head``). transformers' causal LM drops them on load.

Here a depth is the family's own decoder layer (its attention and MoE block are the real ones, and
the MoE block is converted to ``MoELayer`` with the main ones) with ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head.norm`` attached, appended to ``model.model.layers`` at index
``L + k``: every name (state dict, sharded reads, ``save_hf``) is then the published one. The
copies are not parameters: the depths use the main embedding and ``lm_head``; a load checks the
copies equal them and :func:`add_published_copies` writes them back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_moe._compat import initialize_module_weights
from lightning_moe.hf.families import MODEL_FAMILIES, model_family

__all__ = [
    "MTP_COPIES",
    "add_mtp_layers",
    "add_published_copies",
    "checkpoint_mtp_depth",
    "main_layers",
    "mtp_copy_keys",
    "mtp_forward",
    "mtp_layers",
    "resolve_mtp_depth",
]

#: The published copies of shared tensors in each MTP layer -> the main model's tensor they copy.
MTP_COPIES: dict[str, str] = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
}

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_mtp_depth(keys: Iterable[str], config: Any) -> int:
    """How many MTP depths ``keys`` (a checkpoint's tensor names) hold: depths ``0, 1, ...`` while
    ``model.layers.{L + k}.eh_proj.weight`` is among them."""
    names = set(keys)
    depth = 0
    while f"model.layers.{config.num_hidden_layers + depth}.eh_proj.weight" in names:
        depth += 1
    return depth


def resolve_mtp_depth(config: Any, requested: int | None, checkpoint: tuple[str, Iterable[str]] | None) -> int:
    """The number of MTP depths to build, or a ``ValueError`` naming the fix.

    ``requested``: the ``mtp_depth`` argument (None: every depth whose weights ``checkpoint`` holds,
    none without a checkpoint). ``checkpoint``: (folder, its tensor names), or None for a model
    built from a config or a model object (its depths start from a random init).
    """
    family = model_family(config.model_type)
    if requested is not None and requested < 0:
        raise ValueError(
            f"mtp_depth must be >= 0 (0: no multi-token prediction, None: the checkpoint's), got {requested}"
        )
    if not family.mtp_layers:
        if requested:
            with_mtp = tuple(f.model_type for f in MODEL_FAMILIES.values() if f.mtp_layers)
            raise ValueError(
                f"mtp_depth={requested}: {config.model_type} models have no multi-token prediction layers (families"
                f" with them: {with_mtp}); use mtp_depth=0"
            )
        return 0
    if checkpoint is None:
        return requested or 0
    folder, keys = checkpoint
    # The config says how many of the layers after the main ones are MTP depths.
    available = min(checkpoint_mtp_depth(keys, config), getattr(config, "num_nextn_predict_layers", 0) or 0)
    if requested is None:
        return available
    if requested > available:
        first = config.num_hidden_layers
        raise ValueError(
            f"mtp_depth={requested} but {folder} holds the weights of {available} MTP layer(s) (model.layers.{first}"
            f" onwards, eh_proj.weight; config.num_nextn_predict_layers="
            f"{getattr(config, 'num_nextn_predict_layers', None)}): use mtp_depth<={available} (None: all of them)"
        )
    return requested


def add_mtp_layers(model: nn.Module, depth: int, published_copies: bool = False) -> None:
    """Append ``depth`` MTP layers to ``model.model.layers`` (a transformers causal LM, not yet converted).

    Each is the class of the model's last decoder layer, built for layer index ``L + k`` (MoE, as
    published), with ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` attached; on the
    device and dtype of the model's embedding. Off the meta device the new weights get the
    model's own initialisation. ``published_copies``: also ``embed_tokens`` and
    ``shared_head.head`` (an empty model that ``save_hf`` fills with the published layout).
    ``config.num_nextn_predict_layers`` becomes ``depth``.
    """
    if depth == 0:
        return
    config = model.config
    layers = model.model.layers
    if len(layers) != config.num_hidden_layers:
        raise ValueError(f"{type(model).__name__} already has {len(layers) - config.num_hidden_layers} MTP layer(s)")
    layer_class = type(layers[-1])
    norm_class = type(layers[-1].input_layernorm)
    reference = model.get_input_embeddings().weight
    hidden, eps = config.hidden_size, config.rms_norm_eps
    with torch.device(reference.device):
        for k in range(depth):
            layer = layer_class(config, config.num_hidden_layers + k)
            layer.enorm = norm_class(hidden, eps=eps)
            layer.hnorm = norm_class(hidden, eps=eps)
            layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
            layer.shared_head = nn.Module()
            layer.shared_head.norm = norm_class(hidden, eps=eps)
            if published_copies:
                layer.embed_tokens = nn.Embedding(config.vocab_size, hidden)
                layer.shared_head.head = nn.Linear(hidden, config.vocab_size, bias=False)
            layer.to(dtype=reference.dtype)
            if reference.device.type != "meta":
                with torch.no_grad():
                    for module in layer.modules():
                        initialize_module_weights(model, module)
            layers.append(layer)
    config.num_nextn_predict_layers = depth


def main_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(key, layer)`` of the main decoder layers present in ``model.model.layers`` (a pipeline stage: its own)."""
    return [
        (key, layer) for key, layer in model.model.layers.named_children() if int(key) < model.config.num_hidden_layers
    ]


def mtp_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(key, layer)`` of the MTP layers of ``model.model.layers``, depth 1 first."""
    return [
        (key, layer) for key, layer in model.model.layers.named_children() if int(key) >= model.config.num_hidden_layers
    ]


def mtp_forward(layer: nn.Module, hidden: torch.Tensor, embeddings: torch.Tensor, **layer_kwargs: Any) -> torch.Tensor:
    """One depth: ``layer(eh_proj([enorm(embeddings); hnorm(hidden)]))``.

    ``hidden``: the previous depth's residual stream (the main model's before its final norm);
    ``embeddings``: of the tokens ``k`` ahead; ``layer_kwargs``: the decoder layer's (positions,
    rotary embeddings, mask). ``lm_head(layer.shared_head.norm(result))`` are the depth's logits.
    """
    combined = torch.cat([layer.enorm(embeddings), layer.hnorm(hidden)], dim=-1)
    return layer(layer.eh_proj(combined), **layer_kwargs)


def add_published_copies(config: Any, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a transformers state dict) with each MTP layer's copies of the embedding and
    ``lm_head`` (:data:`MTP_COPIES`) added under their published names, as new tensors."""
    out = dict(state)
    first = config.num_hidden_layers
    depths = {int(m.group(1)) for key in state if (m := _LAYER_KEY.match(key)) and int(m.group(1)) >= first}
    for index in sorted(depths):
        for copy, main in MTP_COPIES.items():
            # Tied embeddings: lm_head is the embedding (transformers leaves it out of the state dict).
            source = state.get(main, state["model.embed_tokens.weight"])
            out[f"model.layers.{index}.{copy}"] = source.clone()
    return out


def mtp_copy_keys(config: Any, main_key: str, depth: int) -> list[str]:
    """The published copies of ``main_key`` (an entry of :data:`MTP_COPIES`' values) in ``depth`` MTP layers."""
    copy = next((c for c, m in MTP_COPIES.items() if m == main_key), None)
    if copy is None:
        return []
    return [f"model.layers.{config.num_hidden_layers + k}.{copy}" for k in range(depth)]
