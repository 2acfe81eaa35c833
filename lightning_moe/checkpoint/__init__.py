"""Checkpoints and weights across layouts: layout-free DCP checkpoints, periodic atomic saves
(:class:`PeriodicCheckpoint`, :func:`latest_checkpoint`) and the ``lightning_moe.checkpoint`` CLI."""

from lightning_moe.checkpoint.commit import latest_checkpoint
from lightning_moe.checkpoint.periodic import PeriodicCheckpoint
from lightning_moe.checkpoint.state import (
    check_model_matches,
    load_safely,
    read_metadata,
    rescale_batch_progress,
    rewind_epoch_cut_short,
    saved_model_shapes,
)

__all__ = [
    "PeriodicCheckpoint",
    "check_model_matches",
    "latest_checkpoint",
    "load_safely",
    "read_metadata",
    "rescale_batch_progress",
    "rewind_epoch_cut_short",
    "saved_model_shapes",
]
