"""Checkpoints and weights across layouts: layout-free DCP checkpoints and the ``lightning_moe.checkpoint`` CLI."""

from lightning_moe.checkpoint.state import (
    check_model_matches,
    load_safely,
    read_metadata,
    rescale_batch_progress,
    rewind_epoch_cut_short,
    saved_model_shapes,
)

__all__ = ["check_model_matches", "load_safely", "read_metadata", "rescale_batch_progress", "rewind_epoch_cut_short",
           "saved_model_shapes"]
