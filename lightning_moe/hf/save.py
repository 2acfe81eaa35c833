"""``save_hf``: gather a converted model from any layout and write a transformers folder on rank 0."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_moe._compat import attached_trainer_or_none, tied_weights_keys
from lightning_moe.hf.convert import hf_state_dict
from lightning_moe.hf.mtp import add_mtp_layers, add_published_copies, checkpoint_mtp_depth
from lightning_moe.parallel.dims import parallel_dims_of

__all__ = ["save_hf"]


def _full_cpu(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


def _gather_stages(state: dict[str, torch.Tensor], dims: Any) -> dict[str, torch.Tensor] | None:
    """Merge the pipeline stages' state dicts on global rank 0 (None elsewhere).

    Only the ranks at coordinate 0 of every dim except pp send (the others hold the same tensors).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return state
    sends = True
    if dims is not None:
        # Full mesh (pp, dp, ep, cp, tp): coordinate 0 on every dim but pp.
        sends = all(c == 0 for c in dims.mesh.get_coordinate()[1:])
    rank = dist.get_rank()
    gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(state if sends else None, gathered, dst=0)
    if rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        if part:
            merged.update(part)
    return merged


def save_hf(module: Any, path: str | os.PathLike) -> None:
    """Write ``module.model`` (an :class:`~lightning_moe.hf.HFMoEModule`'s converted model, or a
    converted transformers model) as a transformers folder: ``config.json`` and safetensors.

    Collective under parallelism: every rank calls it; rank 0 alone writes.
    """
    model = getattr(module, "model", module)
    state = hf_state_dict(model, full=_full_cpu)
    dims = parallel_dims_of(attached_trainer_or_none(module))
    merged = _gather_stages(state, dims)
    if merged is not None:
        write_hf_folder(model.config, merged, path)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def write_hf_folder(config: Any, state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Load ``state`` into a fresh transformers model of ``config`` (strictly) and ``save_pretrained`` it.

    Multi-token prediction layers in ``state`` (``model.layers.{num_hidden_layers + k}``) are written
    under the published names with the published copies of the embedding and ``lm_head``
    (:mod:`lightning_moe.hf.mtp`), in the layout transformers writes the main layers in.
    """
    from transformers import AutoModelForCausalLM

    config = type(config).from_dict(config.to_dict())
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = False
    dtype = next(iter(state.values())).dtype
    depth = checkpoint_mtp_depth(state, config)
    if depth:
        state = add_published_copies(config, state)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # save_pretrained writes every module of the model: the MTP layers (published names and
        # expert layout) once they are part of it.
        add_mtp_layers(fresh, depth, published_copies=True)
    missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    tied = set(tied_weights_keys(fresh))
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(
            f"save_hf: state dict does not match {type(fresh).__name__}: missing {missing}, unexpected {unexpected}"
        )
    if tied and getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out)
