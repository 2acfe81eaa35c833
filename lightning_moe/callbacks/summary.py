"""``summary.json``: the layout, loss curve and throughput of a run, for sweeps and reports."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_moe.callbacks.base import OptimizerStepCallback, StepClock, count_tokens
from lightning_moe.callbacks.comm_accounting import uncounted
from lightning_moe.callbacks.moe_metrics import data_parallel_sum
from lightning_moe.layout import LAYOUT_KEYS
from lightning_moe.parallel.dims import parallel_dims_of


def parallel_layout(trainer: pl.Trainer) -> dict[str, int | str]:
    """``{tp, cp, ep, dp, pp, etp}`` of the run: from ``trainer.strategy.parallel_dims`` when the
    strategy has it (``MoE5DStrategy``), otherwise plain data parallel over ``trainer.world_size``.
    A folded layout adds ``fold_ep`` (e.g. ``"cp,tp"``).

    Example::

        parallel_layout(trainer)  # {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 1, "etp": 1}
    """
    dims = parallel_dims_of(trainer)
    if dims is None:
        return {"tp": 1, "cp": 1, "ep": 1, "dp": trainer.world_size, "pp": 1, "etp": 1}
    layout: dict[str, int | str] = {name: int(getattr(dims, name)) for name in LAYOUT_KEYS}
    if getattr(dims, "fold_ep", ()):
        layout["fold_ep"] = ",".join(dims.fold_ep)
    return layout


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same directory: os.replace stays atomic
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class SummaryCallback(OptimizerStepCallback):
    """Write ``summary.json`` at the end of training (global rank 0, atomically).

    Fields:

    - ``layout``: ``{tp, cp, ep, dp, pp, etp}`` (see :func:`parallel_layout`);
    - ``losses``: per optimizer step, the mean training loss over the global batch (the mean of the
      step's micro-batch losses, averaged over data-parallel ranks), identical on every rank and
      equal to the single-device run's value for the same global batch;
    - ``final_loss``: the last entry of ``losses``;
    - ``tokens_per_second``: training tokens of the global batch per wall-clock second, without
      the first optimizer step (start-up) and without validation;
    - whatever other callbacks contribute through a ``summary_fields() -> dict`` method, e.g.
      ``expert_load`` and ``moe_history`` from :class:`~lightning_moe.callbacks.MoEMetricsCallback`,
      ``comm`` from :class:`~lightning_moe.callbacks.CommAccountingCallback`.

    A run that raises writes no ``summary.json``; global rank 0 writes ``error.txt`` (the
    exception) instead, so sweep reports can tell a crashed job from one still running.

    The file goes to ``dirpath``, by default ``trainer.default_root_dir`` (the Hydra output
    directory under ``python -m lightning_moe.train``). ``path`` holds its location once written.

    Example::

        summary = SummaryCallback()
        trainer = pl.Trainer(max_steps=10, callbacks=[MoEMetricsCallback(), summary])
        trainer.fit(model, datamodule=dm)
        json.loads(summary.path.read_text())["final_loss"]
    """

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, filename: str = "summary.json") -> None:
        self.dirpath = dirpath
        self.filename = filename
        self.path: Path | None = None
        self._reset()

    def _reset(self) -> None:
        self.layout: dict[str, int] = {}
        self.losses: list[float] = []
        # The optimizer step in progress (this rank's micro-batches).
        self._step_loss_sum = torch.zeros((), dtype=torch.float64)
        self._step_micro_batches = 0
        self._step_tokens = 0
        self._rerun_last_loss: torch.Tensor | None = None
        self._clock = StepClock()

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        # parallel_dims is complete (dp inferred) once the strategy is set up.
        self.layout = parallel_layout(trainer)

    def on_step_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self._clock.start()

    def on_micro_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if loss is None:  # training_step skipped this batch
            return
        # Under automatic optimization Lightning hands callbacks the loss already divided by
        # accumulate_grad_batches (it is the loss that was backpropagated); undo it.
        scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        # A tensor sum: no device sync per micro-batch.
        value = loss.detach().double() * scale
        if self._rerun_last_loss is not None:  # the step ran again: its last micro-batch's loss is the rerun's
            value, self._rerun_last_loss = self._rerun_last_loss, None
        self._step_loss_sum = self._step_loss_sum + value
        self._step_micro_batches += 1
        self._step_tokens += count_tokens(batch)

    def on_step_rerun(self, trainer: pl.Trainer, pl_module: pl.LightningModule, losses: list[torch.Tensor]) -> None:
        # The step's loss is the rerun's: the earlier micro-batches' now, the last one's when it ends.
        self._step_loss_sum = sum((loss.double() for loss in losses[:-1]), torch.zeros((), dtype=torch.float64))
        self._step_micro_batches = len(losses) - 1
        self._rerun_last_loss = losses[-1].double() if losses else None

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._step_micro_batches:  # training_step skipped every micro-batch
            return
        local_mean = self._step_loss_sum / self._step_micro_batches
        # Every data-parallel rank ran the same number of micro-batches, so the mean of the ranks'
        # means is the mean over the global batch.
        with uncounted():
            self.losses.append(float(trainer.strategy.reduce(local_mean, reduce_op="mean")))
        self._clock.lap(self._step_tokens)
        self._step_loss_sum, self._step_micro_batches, self._step_tokens = torch.zeros((), dtype=torch.float64), 0, 0

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.pause()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.resume()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        tokens_per_second = self._tokens_per_second(trainer)  # collective: before the rank-0 check
        if not trainer.is_global_zero:
            return
        summary: dict[str, Any] = {
            "layout": self.layout,
            "losses": self.losses,
            "final_loss": self.final_loss,
            "tokens_per_second": tokens_per_second,
        }
        for callback in trainer.callbacks:
            fields = getattr(callback, "summary_fields", None)
            if callable(fields):
                summary.update(fields())
        self.path = self._directory(trainer) / self.filename
        write_json_atomic(self.path, summary)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.is_global_zero:
            error = self._directory(trainer) / "error.txt"
            error.parent.mkdir(parents=True, exist_ok=True)
            error.write_text(f"{type(exception).__name__}: {exception}\n")

    def _directory(self, trainer: pl.Trainer) -> Path:
        return Path(self.dirpath if self.dirpath is not None else trainer.default_root_dir)

    def _tokens_per_second(self, trainer: pl.Trainer) -> float | None:
        totals = self._clock.totals()
        if totals is None:
            return None
        local_tokens, seconds = totals
        tokens = data_parallel_sum(trainer, torch.tensor(float(local_tokens), device=trainer.strategy.root_device))
        return float(tokens) / seconds
