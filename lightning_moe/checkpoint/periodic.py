"""``PeriodicCheckpoint``: Lightning's ``ModelCheckpoint`` every N optimizer steps and/or every T minutes, keeping the last K."""

from __future__ import annotations

import time
from typing import Any, Literal

from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override


class PeriodicCheckpoint(ModelCheckpoint):
    """Save every ``every_n_train_steps`` optimizer steps and/or every ``every_n_minutes``, keeping the newest ``keep_last``.

    Saves happen only right after an optimizer step (never inside gradient accumulation), whichever
    trigger fires first; the clock restarts at each save, and global rank 0's clock decides for every
    rank. Files are ``step_<n>.ckpt`` (6 digits: they sort by step, and a Hydra override names one
    without the quoting that ``=`` in Lightning's default names needs); ``save_last`` adds
    ``last.ckpt`` (``"link"``: a symlink, no second write). Everything else is ``ModelCheckpoint``'s (``dirpath``, ``verbose``, ...).
    With ``MoE5DStrategy`` each save is atomic and marked complete (docs/checkpoints.md);
    ``lightning_moe.checkpoint.latest_checkpoint(dirpath)`` finds the newest complete one.

    Example::

        from lightning_moe.checkpoint import PeriodicCheckpoint

        trainer = Trainer(strategy=MoE5DStrategy(ep=2, async_checkpoint=True), devices=2, callbacks=[
            PeriodicCheckpoint("outputs/run/checkpoints", every_n_train_steps=500, every_n_minutes=30, keep_last=3),
        ])
    """

    def __init__(
        self,
        dirpath: str | None = None,
        *,
        every_n_train_steps: int | None = None,
        every_n_minutes: float | None = None,
        keep_last: int = 3,
        save_last: bool | Literal["link"] | None = "link",
        filename: str = "step_{step:06d}",
        auto_insert_metric_name: bool = False,
        **kwargs: Any,
    ) -> None:
        for name, value, kinds in (
            ("every_n_train_steps", every_n_train_steps, int),
            ("every_n_minutes", every_n_minutes, (int, float)),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, kinds) or value <= 0):
                kind = "integer" if kinds is int else "number"
                raise ValueError(
                    f"PeriodicCheckpoint({name}={value!r}) must be a positive {kind}, or null to turn it off"
                )
        if every_n_train_steps is None and every_n_minutes is None:
            raise ValueError("PeriodicCheckpoint needs every_n_train_steps and/or every_n_minutes (when to save)")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last == 0 or keep_last < -1:
            raise ValueError(
                f"PeriodicCheckpoint(keep_last={keep_last!r}) must be a positive integer, or -1 to keep all"
            )
        # ModelCheckpoint considers a save after every optimizer step; on_train_batch_end lets through only the due ones.
        # Keep-last-K is its top-k on the step counter.
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            auto_insert_metric_name=auto_insert_metric_name,
            monitor="step",
            mode="max",
            save_top_k=keep_last,
            save_last=save_last,
            every_n_train_steps=1,
            enable_version_counter=False,
            **kwargs,
        )
        self.every_n_steps = every_n_train_steps
        self.every_n_seconds = None if every_n_minutes is None else 60.0 * every_n_minutes
        self._step_considered: int | None = None
        self._clock_start = time.monotonic()

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        self._step_considered = trainer.global_step  # a resumed run counts from its checkpoint's step
        self._clock_start = time.monotonic()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._step_considered:
            return  # no optimizer step in this batch: accumulating
        self._step_considered = trainer.global_step
        due = self.every_n_steps is not None and trainer.global_step % self.every_n_steps == 0
        if self.every_n_seconds is not None:
            # Every rank must take the same decision: global rank 0's clock decides.
            due = bool(trainer.strategy.broadcast(due or time.monotonic() - self._clock_start >= self.every_n_seconds))
        if due:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            self._clock_start = time.monotonic()
