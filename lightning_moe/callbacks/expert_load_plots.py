"""Expert-load heatmaps every N steps and a load-imbalance plot at the end: PNG files and W&B images."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger

from lightning_moe.callbacks.moe_metrics import MoEMetricsCallback, MoEStepResult
from lightning_moe.callbacks.plots import plot_curves, plot_expert_load

HEATMAP_KEY = "moe/expert_load"
IMBALANCE_KEY = "moe/load_imbalance_curve"


class ExpertLoadPlotCallback(Callback):
    """Draw the expert load that :class:`MoEMetricsCallback` measured (global batch, every layout).

    - Every ``every_n_steps`` optimizer steps (and after the last one): a heatmap of the share of
      tokens per expert, layers x experts, saved as ``<dirpath>/expert_load_step{N:06d}.png``
      (``N``: optimizer steps done) and logged to every ``WandbLogger`` as the image
      ``moe/expert_load``;
    - at the end of training: the load imbalance (max/mean tokens per expert) of every MoE layer
      over the steps, ``<dirpath>/load_imbalance.png``, also logged to W&B as
      ``moe/load_imbalance_curve``.

    ``dirpath`` defaults to ``<trainer.default_root_dir>/plots`` (the Hydra output directory under
    ``python -m lightning_moe.train``). Only global rank 0 draws. ``paths`` lists the files written.
    Needs a :class:`MoEMetricsCallback` among the trainer's callbacks (any order).

    Example::

        trainer = pl.Trainer(callbacks=[MoEMetricsCallback(), ExpertLoadPlotCallback(every_n_steps=50)])
        trainer.fit(model, datamodule=dm)   # <root>/plots/expert_load_step000050.png, ...
    """

    def __init__(self, every_n_steps: int = 50, dirpath: str | os.PathLike[str] | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.dirpath = dirpath
        self.paths: list[Path] = []
        self._metrics_cb: MoEMetricsCallback | None = None
        self._last_plotted_step = -1

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        metrics_cb = next((c for c in trainer.callbacks if isinstance(c, MoEMetricsCallback)), None)
        if metrics_cb is None:
            raise ValueError(
                "ExpertLoadPlotCallback draws what MoEMetricsCallback measures: add MoEMetricsCallback() to the "
                "Trainer's callbacks"
            )
        if metrics_cb is not self._metrics_cb:
            metrics_cb.add_step_listener(self._on_moe_step)
            self._metrics_cb = metrics_cb

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.paths = []
        self._last_plotted_step = -1

    def _directory(self, trainer: pl.Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath is not None else Path(trainer.default_root_dir) / "plots"

    def _on_moe_step(self, trainer: pl.Trainer, result: MoEStepResult) -> None:
        if result.step % self.every_n_steps == 0:
            self._heatmap(trainer, result)

    def _heatmap(self, trainer: pl.Trainer, result: MoEStepResult) -> None:
        if not trainer.is_global_zero:
            return
        path = self._directory(trainer) / f"expert_load_step{result.step:06d}.png"
        imbalance = result.metrics.get("moe/load_imbalance", float("nan"))
        plot_expert_load(
            result.counts, path, title=f"share of tokens per expert, step {result.step} (imbalance {imbalance:.2f})"
        )
        self.paths.append(path)
        self._last_plotted_step = result.step
        _log_image(trainer, HEATMAP_KEY, path, step=result.log_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._metrics_cb is not None
        last = self._metrics_cb.last
        if last is None or not trainer.is_global_zero:
            return
        if last.step != self._last_plotted_step:
            self._heatmap(trainer, last)
        path = self._directory(trainer) / "load_imbalance.png"
        plot_curves(
            self._metrics_cb.imbalance_per_layer(),
            path,
            title="load imbalance per MoE layer",
            ylabel="max / mean tokens per expert",
            hline=1.0,
        )
        self.paths.append(path)
        _log_image(trainer, IMBALANCE_KEY, path, step=last.log_step)


def _log_image(trainer: pl.Trainer, key: str, path: Path, step: int) -> None:
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_image(key=key, images=[str(path)], step=step)
