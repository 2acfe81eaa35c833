"""``RoutingReplayCallback``: record the routing during validation, or replay a trace in training.

The CLI builds it from ``+routing.record=<path>`` / ``+routing.replay=<path>``
(docs/routing-replay.md); any LightningModule whose forward keys its tokens (``MoEGPT`` with
batches carrying ``sample_index``) works.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from lightning_moe.moe.replay import RoutingTrace, record_routing, replay_routing

__all__ = ["RoutingReplayCallback"]


class RoutingReplayCallback(pl.Callback):
    """``record``: the path where the routing of every validation run is saved (the last one wins);
    ``replay``: a trace every training batch replays (forward and backward run inside it).

    Recording gathers every rank's tokens (a collective at the end of validation) and rank 0
    writes the file. Validation is never replayed: its samples are not the trained ones.
    """

    def __init__(self, record: str | os.PathLike | None = None, replay: str | os.PathLike | None = None) -> None:
        if record is None and replay is None:
            raise ValueError("RoutingReplayCallback needs record=<path> or replay=<path>")
        self.record_path = Path(record) if record is not None else None
        self.replay_path = Path(replay) if replay is not None else None
        self.trace: RoutingTrace | None = None
        self._stack = contextlib.ExitStack()
        self._recorder: Any = None
        self.recorded: RoutingTrace | None = None  # the last validation's trace (record mode)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.replay_path is not None and self.trace is None:
            if not self.replay_path.exists():
                raise ValueError(f"routing.replay={self.replay_path}: no such trace file")
            self.trace = RoutingTrace.load(self.replay_path)

    # -- replay ------------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.trace is not None:
            self._stack.enter_context(replay_routing(pl_module, self.trace))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._stack.close()

    # -- record ------------------------------------------------------------------------------------
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.record_path is not None and not trainer.sanity_checking:
            self._recorder = self._stack.enter_context(record_routing(pl_module))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        recorder, self._recorder = self._recorder, None
        self._stack.close()
        if recorder is None or self.record_path is None:
            return
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        trace = recorder.trace(group=dist.group.WORLD if distributed else None)
        if trainer.is_global_zero:
            self.record_path.parent.mkdir(parents=True, exist_ok=True)
            trace.save(self.record_path)
        self.recorded = trace

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stack.close()
