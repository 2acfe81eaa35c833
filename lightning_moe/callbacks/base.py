"""Plumbing shared by the observability callbacks: optimizer-step boundaries and direct logging."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_moe._compat import trainer_logging_step, trainer_should_update_logs


class OptimizerStepCallback(Callback):
    """A callback that acts once per optimizer step, whatever ``accumulate_grad_batches`` is.

    Subclasses implement any of three hooks instead of Lightning's per-batch ones:

    - :meth:`on_step_start`: before the forward of the step's first micro-batch;
    - :meth:`on_micro_batch_end`: after every micro-batch (its forward and backward);
    - :meth:`on_step_end`: after the micro-batch that stepped the optimizer (gradients reduced,
      parameters updated, ``trainer.global_step`` advanced);
    - :meth:`on_step_rerun`: the step's micro-batches ran again (the ``health`` checks' rerun).

    A subclass that overrides ``on_train_batch_start`` or ``on_train_batch_end`` must call
    ``super()``.

    Example::

        class StepTimer(OptimizerStepCallback):
            def on_step_start(self, trainer, pl_module, batch):
                self.start = time.perf_counter()

            def on_step_end(self, trainer, pl_module):
                print(trainer.global_step, time.perf_counter() - self.start)
    """

    # Class attributes: subclasses need not call Callback.__init__ for these to exist.
    _in_step: bool = False
    _step_at_batch_start: int = -1

    def on_step_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """Called before the forward of the first micro-batch of an optimizer step."""

    def on_micro_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any) -> None:
        """Called after every micro-batch."""

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Called after the micro-batch that completed an optimizer step."""

    def on_step_rerun(self, trainer: pl.Trainer, pl_module: pl.LightningModule, losses: list[torch.Tensor]) -> None:
        """Called when the health checks ran the step's micro-batches again on the same data (before the
        optimizer step); ``losses``: the rerun's, one per micro-batch, as ``training_step`` returned
        them. The step's last :meth:`on_micro_batch_end` still follows, with the first run's outputs."""

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step
        if not self._in_step:
            self._in_step = True
            self.on_step_start(trainer, pl_module, batch)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.on_micro_batch_end(trainer, pl_module, outputs, batch)
        # global_step advances when this micro-batch completed an optimizer step.
        if trainer.global_step > self._step_at_batch_start:
            self._in_step = False
            self.on_step_end(trainer, pl_module)


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs the current optimizer step's training loss at (0 for the first step)."""
    return trainer_logging_step(trainer)


def log_to_loggers(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Send ``metrics`` to every logger at Lightning's cadence (``log_every_n_steps``) and step.

    Straight to the loggers, as ``LearningRateMonitor`` does: ``LightningModule.log`` costs
    milliseconds per key, too much for dozens of per-layer keys every step. Call it from
    :meth:`OptimizerStepCallback.on_step_end`; it is a no-op on ranks without loggers.
    """
    if metrics and trainer_should_update_logs(trainer):
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=logging_step(trainer))


def count_tokens(batch: Any) -> int:
    """Tokens of a batch: ``input_ids`` of a dict batch (docs/architecture.md, "Batches"), else the
    first tensor's elements."""
    if isinstance(batch, dict) and "input_ids" in batch:
        return int(batch["input_ids"].numel())
    tensor = batch if isinstance(batch, torch.Tensor) else next(t for t in batch if isinstance(t, torch.Tensor))
    return int(tensor.numel())


def data_parallel_size(trainer: pl.Trainer) -> int:
    """Number of ranks that hold different samples: the sampler's replica count (``dp x ep`` under
    ``MoE5DStrategy``), the world size under plain DDP, 1 on one device."""
    sampler_kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(sampler_kwargs.get("num_replicas", trainer.world_size))


class StepClock:
    """Wall-clock seconds and tokens of optimizer steps, validation excluded, the first step apart.

    The first step holds the start-up (lazy initialisation, first allocations), so rates are
    taken over the later steps when there are any.

    Example::

        clock = StepClock()
        clock.start()                    # first micro-batch of the run
        seconds = clock.lap(tokens=4096)  # each optimizer step's end: that step's seconds
        tokens, seconds = clock.totals()  # over every step but the first
    """

    def __init__(self) -> None:
        self._last: float | None = None  # end of the previous step (start of the first)
        self._paused_at: float | None = None
        self._paused = 0.0  # paused seconds since the previous step
        self.first: tuple[float, float] | None = None  # (tokens, seconds) of the first step
        self.after_first = (0.0, 0.0)  # (tokens, seconds) of every later step

    def start(self) -> None:
        """Start timing (no-op once started)."""
        if self._last is None:
            self._last = time.perf_counter()

    def pause(self) -> None:
        """Stop counting time (validation), until :meth:`resume`; no-op before :meth:`start`."""
        if self._last is not None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused += time.perf_counter() - self._paused_at
            self._paused_at = None

    def lap(self, tokens: float) -> float:
        """End an optimizer step that processed ``tokens``; returns its seconds."""
        assert self._last is not None, "StepClock.start() was not called"
        now = time.perf_counter()
        seconds = max(now - self._last - self._paused, 1e-9)
        self._last, self._paused = now, 0.0
        if self.first is None:
            self.first = (tokens, seconds)
        else:
            self.after_first = (self.after_first[0] + tokens, self.after_first[1] + seconds)
        return seconds

    def totals(self) -> tuple[float, float] | None:
        """``(tokens, seconds)`` of every step but the first, or of the first if it is the only one."""
        return self.after_first if self.after_first[1] else self.first
