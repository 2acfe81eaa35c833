"""Router-health metrics of every ``MoELayer``, logged once per optimizer step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_moe.moe import MoELayer


def data_parallel_size(trainer: pl.Trainer) -> int:
    """Number of ranks that hold different samples: the sampler's replica count (``dp x ep`` under
    ``MoE5DStrategy``), the world size under plain DDP, 1 on one device."""
    sampler_kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(sampler_kwargs.get("num_replicas", trainer.world_size))


def data_parallel_sum(trainer: pl.Trainer, tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the data-parallel ranks, giving the single-device number of the global batch.

    Ranks that share samples (the tensor and context parallel ranks of one data-parallel
    coordinate) hold the same per-sample values, so a sum over all ranks counts every sample
    ``world_size / data_parallel_size`` times; it is divided out. Collective: every rank must call it.

    Example::

        counts = data_parallel_sum(trainer, layer.stats["tokens_per_expert"])  # global batch counts
    """
    if trainer.world_size == 1:
        return tensor
    # clone: reduce() may work in place and the caller keeps its tensor.
    total = trainer.strategy.reduce(tensor.clone(), reduce_op="sum")
    return total * data_parallel_size(trainer) / trainer.world_size


class MoEMetricsCallback(Callback):
    """Log load-balancing statistics of every ``MoELayer`` once per optimizer step.

    After each training micro-batch it reads ``MoELayer.stats`` (aux loss, z-loss, dropped fraction
    and router entropy of that micro-batch, tokens per expert). At the end of an optimizer step it
    averages the scalars over the micro-batches and data-parallel ranks, sums the token counts over
    them (see :func:`data_parallel_sum`), and logs, so every parallel layout logs the numbers of the
    single-device run with the same global batch:

    - ``moe/aux_loss``, ``moe/z_loss``, ``moe/dropped_fraction``, ``moe/router_entropy``:
      mean over micro-batches, ranks and MoE layers;
    - ``moe/load_imbalance``: max / mean tokens per expert over the global batch (1.0 is perfect
      balance, ``num_experts / top_k`` the worst), averaged over MoE layers;
    - the same per MoE layer as ``moe/layer{i}/<name>`` when ``per_layer`` (``i`` numbers the MoE
      layers in module order, dense layers are skipped).

    They reach ``trainer.loggers`` every ``log_every_n_steps`` optimizer steps, at the step of the
    training loss. ``metrics`` keeps the values of the last step and ``expert_load`` its global
    tokens per expert, per MoE layer;
    :class:`~lightning_moe.callbacks.SummaryCallback` writes it to ``summary.json`` through
    :meth:`summary_fields`.

    Example::

        trainer = pl.Trainer(strategy="moe5d", callbacks=[metrics_cb := MoEMetricsCallback()])
        trainer.fit(model, datamodule=dm)
        metrics_cb.expert_load["layer0"]  # [tokens of expert 0, tokens of expert 1, ...]
    """

    SCALARS: tuple[str, ...] = ("aux_loss", "z_loss", "dropped_fraction", "router_entropy")

    def __init__(self, per_layer: bool = True) -> None:
        self.per_layer = per_layer
        self.metrics: dict[str, float] = {}
        self.expert_load: dict[str, list[float]] = {}
        self._layers: list[MoELayer] = []
        self._reset_step()

    def _reset_step(self) -> None:
        self._counts: list[torch.Tensor] | None = None  # per layer [E], summed over micro-batches
        self._scalars: torch.Tensor | None = None  # [layers, len(SCALARS)], summed over micro-batches
        self._micro_batches = 0
        self._step_at_batch_start = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Layers exist only after configure_model() and parallelization, both done by now.
        self._layers = [m for m in pl_module.modules() if isinstance(m, MoELayer)]
        self._reset_step()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._layers:
            return
        # Stats are overwritten by the next forward: read them after every micro-batch.
        counts = [layer.stats["tokens_per_expert"].detach().float() for layer in self._layers]
        scalars = torch.stack(
            [torch.stack([layer.stats[k].detach().float().reshape(()) for k in self.SCALARS]) for layer in self._layers]
        )
        if self._counts is None or self._scalars is None:
            self._counts, self._scalars = counts, scalars
        else:
            self._counts = [a + b for a, b in zip(self._counts, counts)]
            self._scalars = self._scalars + scalars
        self._micro_batches += 1
        # global_step advances when this micro-batch completed an optimizer step.
        if trainer.global_step > self._step_at_batch_start:
            self._log_step(trainer)

    def _log_step(self, trainer: pl.Trainer) -> None:
        assert self._counts is not None and self._scalars is not None
        sizes = [c.numel() for c in self._counts]
        num_layers = len(self._layers)
        # One collective per step: counts and per-rank scalar means travel in one tensor.
        packed = torch.cat([*self._counts, (self._scalars / self._micro_batches).flatten()])
        packed = data_parallel_sum(trainer, packed)
        counts = list(packed[: sum(sizes)].split(sizes))
        # Per-rank means summed over the replicas: divide by their number for the global mean.
        scalars = (packed[sum(sizes) :] / data_parallel_size(trainer)).view(num_layers, len(self.SCALARS))

        imbalance = torch.stack([c.max() / c.mean().clamp_min(1e-12) for c in counts])
        per_layer = torch.cat([scalars, imbalance[:, None]], dim=1).tolist()  # one device sync
        names = [*self.SCALARS, "load_imbalance"]
        metrics: dict[str, float] = {}
        for j, name in enumerate(names):
            metrics[f"moe/{name}"] = sum(row[j] for row in per_layer) / num_layers
        if self.per_layer:
            for i, row in enumerate(per_layer):
                for j, name in enumerate(names):
                    metrics[f"moe/layer{i}/{name}"] = row[j]
        self.metrics = metrics
        self.expert_load = {f"layer{i}": c.tolist() for i, c in enumerate(counts)}
        self._reset_step()
        # Straight to the loggers at Lightning's cadence and step, as LearningRateMonitor does:
        # self.log() costs milliseconds per key, too much for dozens of per-layer keys every step.
        if trainer._logger_connector.should_update_logs:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)

    def summary_fields(self) -> dict[str, Any]:
        """Fields for ``summary.json``: ``expert_load`` of the last step, per MoE layer."""
        return {"expert_load": self.expert_load}
