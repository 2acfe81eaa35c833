"""Read a DCP checkpoint of any layout whole, in one process: inspect it, or consolidate it into one file."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_moe.checkpoint.state import MODEL_PREFIX, STATE_KEY, read_metadata

_OPTIMIZER_PREFIX = "optimizer_"


def _tensor_metadata(checkpoint: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    read_metadata(checkpoint)  # a clear error for a missing folder or another kind of file
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key: item for key, item in metadata.items() if isinstance(item, TensorStorageMetadata)}


def consolidate(checkpoint: str | Path, *, with_optimizer: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors, whole, keyed by parameter name (no process group needed).

    ``with_optimizer`` also returns the optimizer tensors under their DCP keys
    (``optimizer_0.state.<name>.exp_avg``, ...).

    Example::

        state = consolidate("outputs/run/checkpoints/last.ckpt")
        model.load_state_dict(state)      # a single-process MoEGPT of the same config
    """
    import torch.distributed.checkpoint as dcp

    path = Path(checkpoint)
    wanted = {
        key: item
        for key, item in _tensor_metadata(path).items()
        if key.startswith(MODEL_PREFIX) or (with_optimizer and key.startswith(_OPTIMIZER_PREFIX))
    }
    tensors = {key: torch.empty(item.size, dtype=item.properties.dtype) for key, item in wanted.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return {key[len(MODEL_PREFIX) :] if key.startswith(MODEL_PREFIX) else key: value for key, value in tensors.items()}


def save_atomic(state: dict[str, torch.Tensor], output: str | Path) -> None:
    """``torch.save`` through a temporary file and a rename: readers see no partial file."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, output)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def describe(checkpoint: str | Path) -> str:
    """A text report: layout, step, samples seen, then every tensor with its global shape, dtype and bytes."""
    path = Path(checkpoint)
    meta = read_metadata(path)
    tensors = _tensor_metadata(path)
    state = meta.get(STATE_KEY, {})
    layout = (
        " ".join(f"{k}={v}" for k, v in state.get("layout", {}).items()) or "unknown (not written by MoE5DStrategy)"
    )
    loaders = meta.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader") or [{}]
    samples = loaders[0].get("samples_consumed", "unknown") if isinstance(loaders[0], dict) else "unknown"
    lines = [
        f"checkpoint: {path}",
        f"layout: {layout}",
        f"global step: {meta.get('global_step', 'unknown')}  epoch: {meta.get('epoch', 'unknown')}"
        f"  samples consumed in the epoch: {samples}",
        "",
        f"{'tensor':<64} {'global shape':<22} {'dtype':<10} {'bytes':>12}",
    ]
    total = {MODEL_PREFIX: 0, _OPTIMIZER_PREFIX: 0}
    for key, item in sorted(tensors.items()):
        nbytes = item.size.numel() * item.properties.dtype.itemsize
        for prefix in total:
            if key.startswith(prefix):
                total[prefix] += nbytes
        dtype = str(item.properties.dtype).removeprefix("torch.")
        lines.append(f"{key:<64} {str(tuple(item.size)):<22} {dtype:<10} {nbytes:>12,}")
    lines += ["", f"model bytes: {total[MODEL_PREFIX]:,}  optimizer bytes: {total[_OPTIMIZER_PREFIX]:,}"]
    return "\n".join(lines)
