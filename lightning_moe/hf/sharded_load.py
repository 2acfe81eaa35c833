"""Sharded loading of a pretrained Hugging Face folder: each rank reads only the slices it owns.

A ``model.safetensors`` file or an index-sharded folder (``model.safetensors.index.json``) is opened
with ``safetensors.safe_open`` and every tensor is read through ``get_slice(...)[index]``: the
bytes of the rank's block only. Converted MoE layers read their expert block straight out of
transformers' fused ``experts.gate_up_proj [E, 2F, H]`` / ``experts.down_proj [E, H, F]``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_moe.hf.convert import family_of, moe_layers
from lightning_moe.hf.mtp import MTP_COPIES, mtp_copy_keys, mtp_layers

Index = tuple[slice, ...]


class SafetensorsFolder:
    """The tensors of a saved transformers folder, read slice by slice; ``bytes_read`` counts them.

    Example::

        folder = SafetensorsFolder("qwen3_tiny/")
        block = folder.read("model.embed_tokens.weight", (slice(0, 128), slice(None)))
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.files = {key: self.path / name for key, name in json.loads(index.read_text())["weight_map"].items()}
        elif (self.path / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(self.path / "model.safetensors", framework="pt") as handle:
                self.files = {key: self.path / "model.safetensors" for key in handle.keys()}
        else:
            raise FileNotFoundError(f"{self.path} holds neither model.safetensors nor model.safetensors.index.json")
        self.bytes_read = 0
        self.expert_bytes_read = 0  # of it, the routed experts' weights
        self._handles: dict[Path, Any] = {}

    def read(self, key: str, index: Index) -> torch.Tensor:
        """``tensor[index]`` of ``key``, reading only those elements."""
        from safetensors import safe_open

        if key not in self.files:
            raise KeyError(f"{self.path} has no tensor {key!r}: the folder does not hold this model's weights")
        file = self.files[key]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        block = self._handles[file].get_slice(key)[index]
        nbytes = block.numel() * block.element_size()
        self.bytes_read += nbytes
        if ".experts." in key:
            self.expert_bytes_read += nbytes
        return block


def _shifted(index: slice, offset: int, size: int) -> slice:
    start, stop, _ = index.indices(size)
    return slice(start + offset, stop + offset)


class PretrainedShards:
    """``initial_value(name, tensor, index)`` for a converted model whose weights are in ``folder``.

    ``prefix``: what the module's parameter names put before the transformers model's own names
    (``"model."`` for :class:`~lightning_moe.hf.HFMoEModule`, whose ``model`` is the transformers model).

    A model with multi-token prediction layers (:mod:`lightning_moe.hf.mtp`) reads them under their
    published names like any layer; the block of the embedding or ``lm_head`` a rank reads is
    compared with the same block of each depth's published copy (:meth:`check_copies`).
    """

    def __init__(self, folder: str | Path, model: torch.nn.Module, prefix: str = "model.") -> None:
        self.folder = SafetensorsFolder(folder)
        self.prefix = prefix
        # transformers block name -> (family, MoE layer's name in the module)
        self.moe: dict[str, Any] = {}
        for block, layer in moe_layers(model).items():
            family = family_of(layer.hf_family)
            if family.interleaved:
                raise ValueError(
                    f"sharded loading of {family.name} (interleaved gate_up_proj) is not supported: build the module"
                    " eagerly (not on the meta device) to load it"
                )
            own = next(name for name, module in model.named_modules() if module is layer)
            self.moe[own] = (block, family, layer.experts.w1.shape[-1])
        depth = len(mtp_layers(model)) if hasattr(model, "model") else 0
        self.copies = {main: mtp_copy_keys(model.config, main, depth) for main in MTP_COPIES.values()}

    def __call__(self, name: str, tensor: torch.Tensor, index: Index) -> torch.Tensor:
        key = name.removeprefix(self.prefix)
        for own, (block, family, ffn) in self.moe.items():
            if key.startswith(own + "."):
                return self._moe(key[len(own) + 1 :], block, family, ffn, tensor, index)
        block = self.folder.read(key, index)
        self.check_copies(key, block, index)
        return block

    def check_copies(self, key: str, block: torch.Tensor, index: Index) -> None:
        """Warn where an MTP layer's published copy of ``key`` (the embedding or ``lm_head``) differs
        from ``block``, its part ``index``: the depths use the main tensor, and ``save_hf`` writes copies
        of it, so a differing copy is not what the checkpoint's MTP layers were trained with."""
        for copy in self.copies.get(key, ()):
            if copy not in self.folder.files:
                continue
            theirs = self.folder.read(copy, index)
            if not torch.equal(theirs, block):
                diff = (theirs.float() - block.float()).abs().max().item()
                warnings.warn(
                    f"{self.folder.path}: the MTP copy {copy} differs from {key} (max abs difference {diff:.3g}):"
                    f" the MTP layers use {key} (the copy is ignored, and save_hf writes {key} in its place)",
                    stacklevel=2,
                )

    def _layout(self, block: str) -> tuple[str, str]:
        """(the block's name on disk, how its experts are stored): transformers keeps experts fused in
        memory (``experts.gate_up_proj``) and writes them per expert (``experts.{e}.gate_proj``; Mixtral:
        ``block_sparse_moe.experts.{e}.w1``)."""
        files = self.folder.files
        for on_disk in (block, block.replace(".mlp", ".block_sparse_moe")):
            if f"{on_disk}.experts.gate_up_proj" in files:
                return on_disk, "fused"
            if f"{on_disk}.experts.0.gate_proj.weight" in files:
                return on_disk, "gate_up_down"
            if f"{on_disk}.experts.0.w1.weight" in files:
                return on_disk, "w1_w3_w2"
        raise KeyError(f"{self.folder.path} holds no experts of {block} in a layout transformers writes")

    def _experts(self, rest: str, block: str, style: str, ffn: int, index: Index, num_experts: int) -> torch.Tensor:
        read = self.folder.read
        if style == "fused":
            if rest in ("experts.w1", "experts.w3"):
                experts, hidden, cols = index  # w1/w3 [E, H, F] <- gate_up_proj [E, 2F, H] transposed
                cols = _shifted(cols, ffn if rest == "experts.w3" else 0, ffn)
                return read(f"{block}.experts.gate_up_proj", (experts, cols, hidden)).transpose(1, 2)
            experts, rows, hidden = index  # w2 [E, F, H] <- down_proj [E, H, F] transposed
            return read(f"{block}.experts.down_proj", (experts, hidden, rows)).transpose(1, 2)
        names = {"gate_up_down": ("gate_proj", "up_proj", "down_proj"), "w1_w3_w2": ("w1", "w3", "w2")}[style]
        key = dict(zip(("experts.w1", "experts.w3", "experts.w2"), names))[rest]
        experts, first, second = index
        # Per expert, nn.Linear weights: gate/up [F, H] and down [H, F], i.e. ours transposed.
        return torch.stack(
            [
                read(f"{block}.experts.{e}.{key}.weight", (second, first)).t()
                for e in range(*experts.indices(num_experts))
            ]
        )

    def _moe(self, rest: str, block: str, family: Any, ffn: int, tensor: torch.Tensor, index: Index) -> torch.Tensor:
        on_disk, style = self._layout(block)
        if rest in ("experts.w1", "experts.w3", "experts.w2"):
            return self._experts(rest, on_disk, style, ffn, index, tensor.shape[0])
        if rest == "router.expert_load":  # a running count, not a weight
            return torch.zeros(tensor.shape)[index]
        names = {
            "router.weight": f"{family.router}.weight",
            "router.expert_bias": f"{family.router}.e_score_correction_bias",
            "shared_expert_gate.weight": "shared_expert_gate.weight",
        }
        if family.shared is not None:
            for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                names[f"shared_expert.{ours}.weight"] = f"{family.shared}.{theirs}.weight"
        if rest not in names:
            raise KeyError(f"no pretrained tensor for {block}.{rest}")
        return self.folder.read(f"{on_disk}.{names[rest]}", index)


@torch.no_grad()
def load_mtp_layers(model: torch.nn.Module, folder: str | Path) -> None:
    """Fill the MTP layers of ``model`` (a converted transformers model loaded whole, whose
    ``from_pretrained`` dropped them) from ``folder``, and check the folder's copies of the embedding
    and ``lm_head`` against the model's (:meth:`PretrainedShards.check_copies`)."""
    shards = PretrainedShards(folder, model, prefix="")
    for key, layer in mtp_layers(model):
        prefix = f"model.layers.{key}"
        for name, tensor in [*layer.named_parameters(prefix=prefix), *layer.named_buffers(prefix=prefix)]:
            tensor.copy_(shards(name, tensor, _whole(tensor)))
    state = model.state_dict()
    for main in MTP_COPIES.values():
        if main in state:
            shards.check_copies(main, state[main], _whole(state[main]))


def _whole(tensor: torch.Tensor) -> Index:
    return tuple(slice(None) for _ in tensor.shape)
