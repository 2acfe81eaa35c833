"""What makes a DCP checkpoint layout-free: safe metadata, step counters, RNG, and a model-match check.

A checkpoint folder (``MoE5DStrategy(save_distributed_checkpoint=True)``) holds the DCP shards of
``state_dict.<name>`` (global shapes, whatever the layout) and ``optimizer_<i>.state.<name>.<key>``
/ ``optimizer_<i>.param_groups.<name>.<key>`` (one flat, per-parameter form under every layout),
plus ``meta.pt``: Lightning's loops, callbacks and schedulers, and under ``lightning_moe``:

- ``layout``: the ``tp, cp, ep, dp, pp, etp`` it was written with (information only);
- ``accumulate_grad_batches``: training batches per optimizer step on that layout, to translate
  Lightning's batch counters to another layout's accumulation;
- ``rng``: global rank 0's torch, Python and NumPy generator states, restored on every rank.

The data position is the data loader's ``samples_consumed`` (see
:class:`lightning_moe.data.ResumableDataLoader`), which no layout changes.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

METADATA_FILE = "meta.pt"
# A save writes <path>.staging, renames the old <path> to <path>.previous, then staging to <path>
# (lightning_moe.checkpoint.writer).
STAGING_SUFFIX = ".staging"
PREVIOUS_SUFFIX = ".previous"
STATE_KEY = "lightning_moe"
MODEL_PREFIX = "state_dict."


def load_safely(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)``: never runs code from a checkpoint.

    A file that holds pickled Python objects (anything beyond tensors, numbers, strings and their
    containers) is refused with a ``ValueError`` saying so.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds pickled Python objects, which lightning-moe refuses to load (loading them could run"
            f" code from the file; only tensors, numbers, strings and containers are accepted): {err}"
        ) from err


def resolve_checkpoint_path(checkpoint: str | Path) -> Path:
    """The checkpoint at ``checkpoint``, whatever moment a save into it was interrupted at.

    Before the first rename ``<path>`` is the old complete checkpoint (a half-written staging
    folder is ignored); between the two renames only ``<path>.previous`` is complete.
    """
    path = Path(checkpoint)
    previous = path.with_name(path.name + PREVIOUS_SUFFIX)
    return previous if not path.exists() and previous.exists() else path


def read_metadata(checkpoint: str | Path) -> dict[str, Any]:
    """The ``meta.pt`` of a DCP checkpoint folder, loaded safely; a missing folder names itself."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist (or is not a DCP checkpoint folder)")
    if not (folder / METADATA_FILE).is_file():
        raise FileNotFoundError(f"{folder} has no {METADATA_FILE}: not a lightning-moe/Lightning DCP checkpoint")
    return load_safely(folder / METADATA_FILE)


def add_strategy_state(checkpoint: MutableMapping[str, Any], dims: Any, accumulate_grad_batches: int) -> None:
    """What a layout-free resume needs besides the weights: the layout it was saved under, the
    accumulation count (the loops' batch counters are in its units) and every RNG state. An epoch
    cut short is rewound (:func:`rewind_epoch_cut_short`)."""
    from lightning_moe.layout import LAYOUT_KEYS

    rewind_epoch_cut_short(checkpoint)
    checkpoint[STATE_KEY] = {
        "layout": {name: getattr(dims, name) for name in LAYOUT_KEYS},
        "accumulate_grad_batches": accumulate_grad_batches,
        "rng": rng_state(),
    }


def restore_strategy_state(metadata: MutableMapping[str, Any], accumulate_grad_batches: int) -> None:
    """Undo :func:`add_strategy_state` on resume: batch counters rescaled to this run's accumulation, RNGs restored."""
    state = metadata.get(STATE_KEY)
    if state is not None:
        rescale_batch_progress(metadata.get("loops", {}), state["accumulate_grad_batches"], accumulate_grad_batches)
        set_rng_state(state["rng"])


def rng_state() -> dict[str, Any]:
    """The torch CPU, Python and NumPy generator states, in types ``weights_only`` loading accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": _to_lists(random.getstate()),
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss],
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, tuple) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value


def rewind_epoch_cut_short(checkpoint: MutableMapping[str, Any]) -> None:
    """Make a checkpoint saved after ``max_steps`` (or a stop) cut an epoch short read as saved at that step, in place.

    Lightning closes the epoch when training stops mid-epoch, so the checkpoint that
    ``ModelCheckpoint`` writes at the end of training records the next epoch: resumed, it would
    start that epoch's sample order and leave the uninterrupted curve. Its counters become those
    of a checkpoint saved in the last step's ``on_train_batch_end``, which resumes in the same
    epoch at the next sample. An epoch that ran out of data (its last batch seen) is left closed.
    """
    fit = checkpoint.get("loops", {}).get("fit_loop")
    if not fit or "epoch_progress" not in fit or "epoch_loop.batch_progress" not in fit:
        return
    epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
    closed = epochs["current"]["completed"] == epochs["current"]["started"] > 0
    batch_finished = batches["current"]["completed"] == batches["current"]["processed"] > 0
    if not closed or not batch_finished or batches.get("is_last_batch", True):
        return
    for scope in ("total", "current"):
        epochs[scope]["completed"] -= 1
        epochs[scope]["processed"] -= 1
        batches[scope]["completed"] -= 1
    from lightning_moe._compat import rewind_saved_logging_step

    rewind_saved_logging_step(fit.get("epoch_loop.state_dict", {}))
    epoch = epochs["current"]["completed"]
    for loader_state in fit.get("state_dict", {}).get("combined_loader") or []:
        if isinstance(loader_state, dict) and "samples_consumed" in loader_state:
            loader_state["epoch"] = epoch
    if "epoch" in checkpoint:
        checkpoint["epoch"] = epoch


def rescale_batch_progress(loops: MutableMapping[str, Any], old_accumulate: int, new_accumulate: int) -> None:
    """Translate the fit loop's batch counters to another accumulation count, in place.

    Lightning counts training batches; an optimizer step is ``accumulate_grad_batches`` of them,
    which depends on the layout (micro-batch size, dp x ep, pipeline micro-batches). A checkpoint
    saved after ``s`` steps holds counters ``s * old`` (``completed`` one less while the batch that
    saved it was running); they become ``s * new`` so that accumulation resumes on step boundaries.
    """
    if old_accumulate == new_accumulate:
        return
    progress = loops.get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not progress:
        return
    for scope in ("total", "current"):
        counters = progress[scope]
        processed = counters["processed"]
        if processed % old_accumulate:
            raise ValueError(
                f"cannot resume with accumulate_grad_batches={new_accumulate}: the checkpoint was saved after"
                f" {processed} training batches, not at an optimizer step of its accumulate_grad_batches={old_accumulate};"
                " resume it on a layout with the same accumulation, or save checkpoints at optimizer steps"
            )
        steps = processed // old_accumulate
        for name, value in counters.items():
            counters[name] = steps * new_accumulate + (value - processed)


def check_model_matches(
    saved: Mapping[str, torch.Size], expected: Mapping[str, torch.Size], *, complete: bool, limit: int = 5
) -> None:
    """Raise ``ValueError`` listing the first mismatches between a checkpoint's model tensors and a model's.

    ``saved``/``expected``: parameter name -> global shape. Every expected name must be saved with
    its shape; with ``complete`` (the model holds every parameter: no pipeline split) the checkpoint
    may hold no other model tensor either.
    """
    problems = []
    for name, shape in expected.items():
        if name not in saved:
            problems.append(f"missing in the checkpoint: {name} {tuple(shape)}")
        elif tuple(saved[name]) != tuple(shape):
            problems.append(
                f"shape differs: {name} is {tuple(saved[name])} in the checkpoint, {tuple(shape)} in the model"
            )
    if complete:
        problems += [
            f"not in the model: {name} {tuple(shape)}" for name, shape in saved.items() if name not in expected
        ]
    if problems:
        shown = "\n  ".join(problems[:limit])
        more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
        raise ValueError(
            f"the checkpoint holds another model ({len(problems)} mismatches; nothing was loaded):\n  {shown}{more}"
        )


def saved_model_shapes(checkpoint: str | Path) -> dict[str, torch.Size]:
    """Model tensor name -> global shape, read from a DCP folder's metadata (no tensor data)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {
        key[len(MODEL_PREFIX) :]: item.size
        for key, item in metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata)
    }


def _flat_options(*, full: bool = False) -> Any:
    """Flat optimizer state on the CPU; ``full``: whole tensors, on global rank 0 only (one-file checkpoints)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True, full_state_dict=full)


def optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, full: bool = False
) -> dict[str, Any]:
    """The optimizer's state in the one form every layout saves and loads: flat, keyed by parameter name
    (``full``: whole tensors on global rank 0, for a one-file checkpoint)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_flat_options(full=full))


def load_one_file_checkpoint(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], checkpoint: str | Path, *, strict: bool = True
) -> dict[str, Any]:
    """Load a one-file checkpoint (``save_distributed_checkpoint=False``: whole tensors, written by rank 0)
    into this rank's (sharded) model and optimizers; returns the rest of it. Every rank reads the file.

    The optimizer states are in the flat form :func:`optimizer_state_dict` saves, which neither
    Lightning's one-file loader nor torch's full-state loading reads: each whole tensor is laid out
    here as this rank's state of its parameter is (``distribute_tensor`` with its mesh and placements).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor, distribute_tensor

    contents = load_safely(checkpoint)
    model_state = contents.pop("state_dict")
    check_model_matches(
        {name: t.shape for name, t in model_state.items()},
        {name: t.shape for name, t in get_model_state_dict(model).items()},
        complete=True,
    )
    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True, strict=strict))
    for optimizer, saved in zip(optimizers, contents.pop("optimizer_states", [])):
        state = optimizer_state_dict(model, optimizer)
        missing = sorted(set(state) - set(saved))
        if missing:
            raise ValueError(
                f"the checkpoint's optimizer state lacks {len(missing)} entries of this optimizer, e.g. {missing[:3]}"
            )
        for key, local in state.items():
            value = saved[key]
            if isinstance(local, DTensor):
                value = distribute_tensor(value.to(local.dtype), local.device_mesh, local.placements)
            state[key] = value
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=_flat_options())
    return contents


def load_model_and_optimizers(
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    checkpoint: str | Path,
    *,
    complete: bool,
    strict: bool = True,
) -> None:
    """Load a DCP checkpoint of any layout into this rank's (sharded) model and optimizers.

    DCP reshards every tensor from its global shape to the placements it has here. The model is
    checked first (:func:`check_model_matches`), so another model's checkpoint loads nothing.
    ``complete``: this rank's model holds every parameter (no pipeline split).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_optimizer_state_dict

    from lightning_moe._compat import distributed_checkpoint_load

    path = Path(checkpoint)
    model_state = get_model_state_dict(model)
    check_model_matches(saved_model_shapes(path), {name: t.shape for name, t in model_state.items()}, complete=complete)
    state = {"state_dict": model_state}
    distributed_checkpoint_load(state, path)
    model.load_state_dict(state["state_dict"], strict=strict)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optim_state = {key: optimizer_state_dict(model, optimizer)}
        distributed_checkpoint_load(optim_state, path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state[key], options=_flat_options())
