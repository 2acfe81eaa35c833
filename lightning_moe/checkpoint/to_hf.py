"""A Hugging Face folder from a DCP checkpoint of ``HFMoEModule``, or of ``MoEGPT`` as Mixtral (no process group)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_moe.checkpoint.consolidate import consolidate
from lightning_moe.checkpoint.state import read_metadata

MODEL_KINDS = ("moegpt", "hf")


def _kind_of(hparams: dict[str, Any]) -> str:
    if "moe_layer_freq" in hparams:
        return "moegpt"
    if "attn_implementation" in hparams:
        return "hf"
    raise ValueError(
        f"cannot tell which model wrote this checkpoint from its hyper-parameters {sorted(hparams)}: pass --model"
    )


def checkpoint_to_hf(checkpoint: str | Path, output: str | Path, model: str | None = None) -> None:
    """Write ``config.json`` and safetensors that ``AutoModelForCausalLM.from_pretrained(output)`` loads.

    ``model``: ``"moegpt"`` (written as a Mixtral model; refused where MoEGPT's options have no
    Mixtral equivalent) or ``"hf"`` (an ``HFMoEModule`` built from a config or a local folder; its
    multi-token prediction layers are written under the published names);
    ``None`` tells them apart by the checkpoint's hyper-parameters. Needs the ``[hf]`` extra.

    Example::

        checkpoint_to_hf("outputs/run/checkpoints/last.ckpt", "hf_out")
    """
    from lightning_moe.hf.save import write_hf_folder

    hparams = dict(read_metadata(checkpoint).get("hyper_parameters") or {})
    kind = model or _kind_of(hparams)
    if kind not in MODEL_KINDS:
        raise ValueError(f"--model {kind!r} is unknown: choose one of {MODEL_KINDS}")
    state = consolidate(checkpoint)
    if kind == "moegpt":
        from lightning_moe.hf.moegpt import moegpt_to_mixtral
        from lightning_moe.models import MoEGPT

        with torch.device("meta"):
            module = MoEGPT(**hparams)
        module.load_state_dict(state, assign=True)
        config, hf_state = moegpt_to_mixtral(module)
    else:
        from lightning_moe.hf import HFMoEModule
        from lightning_moe.hf.convert import hf_state_dict

        if hparams.get("model") is None:
            raise ValueError(
                "this HFMoEModule was built from a model object, which the checkpoint does not record: build the"
                " module again, load the checkpoint, and call module.save_hf(folder)"
            )
        # A checkpoint written before multi-token prediction trained none (its state holds no MTP layers).
        hparams.setdefault("mtp_depth", 0)
        with torch.device("meta"):
            module = HFMoEModule(**hparams)
        module.load_state_dict(state, assign=True)
        config, hf_state = module.config, hf_state_dict(module.model)
    write_hf_folder(config, hf_state, output)
