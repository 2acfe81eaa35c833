"""Router-health metrics of every ``MoELayer``, reduced over ranks and logged once per optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torchmetrics import Metric

from lightning_moe.callbacks.base import OptimizerStepCallback, data_parallel_size, log_to_loggers, logging_step
from lightning_moe.callbacks.comm_accounting import uncounted
from lightning_moe.moe import MoELayer

# Per-layer values of a step. Read from MoELayer.stats (means over micro-batches):
STAT_SCALARS: tuple[str, ...] = ("aux_loss", "z_loss", "dropped_fraction", "router_entropy")
# ...read from the router (the bias that routed the step's tokens), for layers with an expert bias:
BIAS_NORM = "expert_bias_norm"
# ...and derived from the tokens per expert of the global batch:
LOAD_METRICS: tuple[str, ...] = ("load_imbalance", "load_cv", "no_token_fraction")
# ...and from the same counts summed per expert-parallel rank (the tokens each ep rank receives):
EP_RANK_IMBALANCE = "ep_rank_imbalance"
# Metrics that depend on the layout by definition (the others equal the single-device run's): logged,
# but kept out of ``history`` / ``moe_history``, the layout-free record of the router's health.
LAYOUT_DEPENDENT: tuple[str, ...] = (EP_RANK_IMBALANCE,)


def data_parallel_sum(trainer: pl.Trainer, tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the data-parallel ranks, giving the single-device number of the global batch.

    Ranks that share samples (the tensor and context parallel ranks of one data-parallel
    coordinate) hold the same per-sample values, so a sum over all ranks counts every sample
    ``world_size / data_parallel_size`` times; it is divided out. Collective: every rank must call it.

    Example::

        tokens = data_parallel_sum(trainer, torch.tensor(float(local_tokens)))  # global batch tokens
    """
    if trainer.world_size == 1:
        return tensor
    # clone: reduce() may work in place and the caller keeps its tensor.
    with uncounted():
        total = trainer.strategy.reduce(tensor.clone(), reduce_op="sum")
    return total * data_parallel_size(trainer) / trainer.world_size


def load_metrics(counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """Balance of tokens per expert ``counts [E]``: max/mean (1 is perfect, ``E / top_k`` the worst),
    coefficient of variation (population std / mean) and the fraction of experts with no token.

    Example::

        load_metrics(torch.tensor([4.0, 0.0, 2.0, 2.0]))  # imbalance 2.0, cv 0.707, no_token 0.25
    """
    mean = counts.mean().clamp_min(1e-12)
    return {
        "load_imbalance": counts.max() / mean,
        "load_cv": counts.std(correction=0) / mean,
        "no_token_fraction": (counts == 0).float().mean(),
    }


def ep_rank_imbalance(counts: torch.Tensor, ep: int) -> torch.Tensor:
    """Max/mean of the tokens each of ``ep`` expert-parallel ranks receives (rank r holds the r-th
    contiguous block of ``E / ep`` experts of ``counts [E]``); 1.0 is perfect, and 1.0 for ep = 1.

    Example::

        ep_rank_imbalance(torch.tensor([4.0, 0.0, 2.0, 2.0]), ep=2)  # 1.0: each rank receives 4
    """
    per_rank = counts.reshape(ep, -1).sum(1)
    return per_rank.max() / per_rank.mean().clamp_min(1e-12)


@dataclass(frozen=True)
class MoELayerInfo:
    """One MoE layer of the whole model (all pipeline stages): module name and shape."""

    name: str
    num_experts: int
    has_expert_bias: bool
    ep_size: int = 1  # ranks its experts are split over


class MoEStatsMetric(Metric):
    """Tokens per expert and router scalars of every MoE layer, summed over micro-batches and ranks.

    The state is one fixed-size tensor ``[num_layers, max_experts + num_scalars + 2]`` summed over
    the process group (``dist_reduce_fx="sum"``), so every rank takes part in the same collective
    even when it holds none of the layers (a pipeline stage): it adds zeros for those. Per layer it
    sums the counts, the scalars and the number of (rank, micro-batch) contributions; one column
    counts the updates of every rank. :meth:`compute` turns the sums into the values of the
    single-device run with the same global batch:

    - counts: each sample's counts were added by every rank that shares it (tp x cp ranks of one
      data-parallel coordinate), i.e. ``holders / data_parallel_size`` times, which is divided out;
    - scalars: the mean over the contributions (micro-batches of every data-parallel rank).

    Example::

        metric = MoEStatsMetric(num_experts=[8, 8], num_scalars=2, data_parallel_size=2)
        metric.update(torch.tensor([0]), counts=torch.ones(1, 8), scalars=torch.zeros(1, 2))
        counts, scalars = metric.compute()    # collective when torch.distributed is initialised
    """

    full_state_update = False
    totals: torch.Tensor

    def __init__(
        self, num_experts: Sequence[int], num_scalars: int, data_parallel_size: int = 1, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.num_experts = list(num_experts)
        self.max_experts = max(self.num_experts, default=0)
        self.num_scalars = num_scalars
        self.data_parallel_size = data_parallel_size
        width = self.max_experts + num_scalars + 2
        self.add_state("totals", torch.zeros(len(self.num_experts), width, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, layer_index: torch.Tensor, counts: torch.Tensor, scalars: torch.Tensor) -> None:
        """Add one micro-batch: ``counts [n, max_experts]`` (zero-padded) and ``scalars [n, num_scalars]``
        of the layers ``layer_index [n]`` this rank holds (``n`` may be 0)."""
        ones = torch.ones(len(layer_index), 1, dtype=torch.float64, device=self.totals.device)
        rows = torch.cat([counts.double(), scalars.double(), ones, torch.zeros_like(ones)], dim=1)
        self.totals.index_add_(0, layer_index.to(self.totals.device), rows)
        self.totals[:, -1] += 1

    def compute(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``(counts, scalars)``: tokens per expert of the global batch, one ``[E_l]`` per layer, and
        the scalars ``[num_layers, num_scalars]`` averaged over micro-batches and data-parallel ranks."""
        totals = self.totals
        world_size = dist.get_world_size(self.process_group) if dist.is_available() and dist.is_initialized() else 1
        micro_batches = totals[:, -1].clamp_min(1) / world_size  # per rank, the same on every rank
        contributions = totals[:, -2].clamp_min(1)
        holders = contributions / micro_batches
        count_sums = totals[:, : self.max_experts] * (self.data_parallel_size / holders)[:, None]
        counts = [row[:experts] for row, experts in zip(count_sums, self.num_experts)]
        scalars = totals[:, self.max_experts : self.max_experts + self.num_scalars] / contributions[:, None]
        return counts, scalars


@dataclass
class MoEStepResult:
    """What :class:`MoEMetricsCallback` computed for one optimizer step (the same on every rank).

    ``step``: optimizer steps completed (1 for the first); ``log_step``: Lightning's logging step;
    ``counts``: tokens per expert of the global batch, per MoE layer; ``per_layer``: metric name ->
    one value per MoE layer; ``metrics``: the logged keys.
    """

    step: int
    log_step: int
    counts: list[list[float]]
    per_layer: dict[str, list[float]]
    metrics: dict[str, float] = field(default_factory=dict)


class MoEMetricsCallback(OptimizerStepCallback):
    """Log the router health of every ``MoELayer`` once per optimizer step.

    After each micro-batch it reads ``MoELayer.stats``; at the end of the optimizer step a
    :class:`MoEStatsMetric` (torchmetrics, summed over all ranks) turns them into the numbers of the
    single-device run with the same global batch, for every parallel layout. Per MoE layer ``i``
    (numbered in module order over the whole model, pipeline stages included):

    - ``moe/layer{i}/aux_loss``, ``z_loss``, ``dropped_fraction``, ``router_entropy``: means over
      the step's micro-batches (entropy of the routing distribution in nats, per token);
    - ``moe/layer{i}/expert_bias_norm``: L2 norm of ``router.expert_bias`` that routed the step
      (only when some layer has an expert bias);
    - ``moe/layer{i}/load_imbalance`` (max/mean tokens per expert over the global batch: 1.0 is
      perfect balance, ``num_experts / top_k`` the worst), ``load_cv`` (std/mean) and
      ``no_token_fraction`` (experts that received no token);
    - ``moe/layer{i}/ep_rank_imbalance``: max/mean of the tokens received per expert-parallel rank
      (the same counts summed over each rank's block of experts; with dp > 1 each ep position's load
      is summed over its dp replicas). 1.0 without expert parallelism. It depends on the layout by
      definition, so ``history`` leaves it out.

    Summaries over layers: ``moe/<name>`` (mean), ``moe/<name>_p50``, ``moe/<name>_p90`` (or the
    ``percentiles`` given) and ``moe/<name>_max``. Per-layer keys can be switched off with
    ``per_layer=False``. The progress bar shows ``aux_loss`` and ``imbalance`` (``prog_bar``).

    Every rank must run the callback (its reductions are collectives); ranks holding no MoE layer
    contribute zeros. Metrics reach ``trainer.loggers`` every ``log_every_n_steps`` optimizer
    steps, at the step of the training loss. ``metrics`` and ``expert_load`` keep the last step's
    logged values and tokens per expert, ``last`` its whole :class:`MoEStepResult`; ``history``
    keeps, for every optimizer step, the mean over layers of each metric and the load imbalance of
    each layer. :meth:`add_step_listener` lets other callbacks (plots) receive each result.
    :class:`~lightning_moe.callbacks.SummaryCallback` writes :meth:`summary_fields` to ``summary.json``.

    Example::

        trainer = pl.Trainer(strategy="moe5d", callbacks=[metrics_cb := MoEMetricsCallback()])
        trainer.fit(model, datamodule=dm)
        metrics_cb.expert_load["layer0"]  # [tokens of expert 0, tokens of expert 1, ...]
    """

    SCALARS: tuple[str, ...] = STAT_SCALARS

    def __init__(self, per_layer: bool = True, percentiles: Sequence[float] = (50, 90), prog_bar: bool = True) -> None:
        self.per_layer = per_layer
        self.percentiles = tuple(percentiles)
        self.prog_bar = prog_bar
        self.metrics: dict[str, float] = {}
        self.expert_load: dict[str, list[float]] = {}
        self.last: MoEStepResult | None = None
        # Series over optimizer steps: "<name>" (mean over layers) and "layer{i}/load_imbalance".
        self.history: dict[str, list[float]] = {}
        self.layers: list[MoELayerInfo] = []
        self._listeners: list[Callable[[pl.Trainer, MoEStepResult], None]] = []
        self._local: list[MoELayer] = []
        self._local_index = torch.zeros(0, dtype=torch.long)
        self._metric: MoEStatsMetric | None = None
        self._bias_norms: torch.Tensor | None = None

    def add_step_listener(self, listener: Callable[[pl.Trainer, MoEStepResult], None]) -> None:
        """Call ``listener(trainer, result)`` on every rank after each optimizer step's metrics (once,
        however often it is added)."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    @property
    def scalar_names(self) -> tuple[str, ...]:
        with_bias = any(layer.has_expert_bias for layer in self.layers)
        return (*self.SCALARS, BIAS_NORM) if with_bias else self.SCALARS

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Layers exist only after configure_model() and parallelization, both done by now.
        named = [(name, m) for name, m in pl_module.named_modules() if isinstance(m, MoELayer)]
        local_infos = [MoELayerInfo(name, m.num_experts, m.router.use_expert_bias, m.ep_size) for name, m in named]
        self.layers = _gather_layer_infos(local_infos)
        position = {info.name: i for i, info in enumerate(self.layers)}
        self._local = [m for _, m in named]
        self._local_index = torch.tensor([position[name] for name, _ in named], dtype=torch.long)
        self._metric = MoEStatsMetric(
            [info.num_experts for info in self.layers], len(self.scalar_names), data_parallel_size(trainer)
        ).to(pl_module.device)
        self.last = None
        self.history = {}

    def on_step_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        # The bias changes once per step, after the optimizer: read the one that routes this step.
        if BIAS_NORM in self.scalar_names:
            self._bias_norms = torch.stack([_bias_norm(layer) for layer in self._local]) if self._local else None

    def on_micro_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any) -> None:
        if self._metric is None or not self.layers:
            return
        # Stats are overwritten by the next forward: read them after every micro-batch.
        device = self._metric.device
        max_experts = self._metric.max_experts
        counts = torch.zeros(len(self._local), max_experts, device=device)
        scalars = torch.zeros(len(self._local), len(self.scalar_names), device=device)
        for row, layer in enumerate(self._local):
            stats = layer.stats
            counts[row, : layer.num_experts] = stats["tokens_per_expert"].detach().float()
            scalars[row, : len(self.SCALARS)] = torch.stack(
                [stats[k].detach().float().reshape(()) for k in self.SCALARS]
            )
        if self._bias_norms is not None:
            scalars[:, -1] = self._bias_norms
        self._metric.update(self._local_index, counts, scalars)

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._metric is None or not self.layers:
            return
        with uncounted():
            counts, scalars = self._metric.compute()
        self._metric.reset()
        per_layer = {name: scalars[:, j] for j, name in enumerate(self.scalar_names)}
        loads = [load_metrics(c) for c in counts]
        for name in LOAD_METRICS:
            per_layer[name] = torch.stack([load[name] for load in loads])
        per_layer[EP_RANK_IMBALANCE] = torch.stack(
            [ep_rank_imbalance(c, info.ep_size) for c, info in zip(counts, self.layers)]
        )
        # One device sync for everything.
        table = torch.stack(list(per_layer.values()))
        summaries = self._summaries(table)
        values, summary_values, counts_list = table.tolist(), summaries.tolist(), [c.tolist() for c in counts]
        result = MoEStepResult(
            step=trainer.global_step,
            log_step=logging_step(trainer),
            counts=counts_list,
            per_layer=dict(zip(per_layer, values)),
        )
        result.metrics = self._metric_keys(result.per_layer, summary_values)
        self.last, self.metrics = result, result.metrics
        self.expert_load = {f"layer{i}": c for i, c in enumerate(counts_list)}
        self._record_history(result)
        log_to_loggers(trainer, result.metrics)
        if self.prog_bar:
            pl_module.log("aux_loss", result.metrics["moe/aux_loss"], prog_bar=True, logger=False, batch_size=1)
            pl_module.log("imbalance", result.metrics["moe/load_imbalance"], prog_bar=True, logger=False, batch_size=1)
        for listener in self._listeners:
            listener(trainer, result)

    def _summaries(self, table: torch.Tensor) -> torch.Tensor:
        """``[names, 2 + len(percentiles)]``: mean, percentiles and max over layers of each metric."""
        quantiles = torch.tensor([p / 100 for p in self.percentiles], dtype=table.dtype, device=table.device)
        columns = [table.mean(1, keepdim=True)]
        if len(quantiles):
            columns.append(torch.quantile(table, quantiles, dim=1).T)
        columns.append(table.amax(1, keepdim=True))
        return torch.cat(columns, dim=1)

    def _metric_keys(self, per_layer: dict[str, list[float]], summaries: list[list[float]]) -> dict[str, float]:
        suffixes = ["", *(f"_p{p:g}" for p in self.percentiles), "_max"]
        metrics: dict[str, float] = {}
        for name, row in zip(per_layer, summaries):
            for suffix, value in zip(suffixes, row):
                metrics[f"moe/{name}{suffix}"] = value
        if self.per_layer:
            for name, values in per_layer.items():
                for i, value in enumerate(values):
                    metrics[f"moe/layer{i}/{name}"] = value
        return metrics

    def _record_history(self, result: MoEStepResult) -> None:
        # Compact on purpose: a few floats per step, not every logged key, so long runs stay small.
        for name in result.per_layer:
            if name in LAYOUT_DEPENDENT:
                continue
            self.history.setdefault(name, []).append(result.metrics[f"moe/{name}"])
        for i, value in enumerate(result.per_layer["load_imbalance"]):
            self.history.setdefault(f"layer{i}/load_imbalance", []).append(value)

    def imbalance_per_layer(self) -> dict[str, list[float]]:
        """``{"layer{i}": [load imbalance at step 1, 2, ...]}`` of every MoE layer."""
        suffix = "/load_imbalance"
        return {key[: -len(suffix)]: values for key, values in self.history.items() if key.endswith(suffix)}

    def summary_fields(self) -> dict[str, Any]:
        """Fields for ``summary.json``:

        - ``expert_load``: tokens per expert of the last step, per MoE layer;
        - ``moe_metrics``: the last step's logged metrics;
        - ``moe_history``: per metric name, one value per optimizer step (mean over MoE layers);
        - ``load_imbalance_per_layer``: per MoE layer, its load imbalance at every optimizer step.
        """
        if self.last is None:
            return {"expert_load": self.expert_load}
        return {
            "expert_load": self.expert_load,
            "moe_metrics": self.metrics,
            "moe_history": {name: self.history[name] for name in self.last.per_layer if name in self.history},
            "load_imbalance_per_layer": self.imbalance_per_layer(),
        }


def _bias_norm(layer: MoELayer) -> torch.Tensor:
    bias = getattr(layer.router, "expert_bias", None)
    # torch.zeros, not weight.new_zeros: under FSDP the weight is a DTensor.
    return bias.detach().float().norm() if bias is not None else torch.zeros((), device=layer.router.weight.device)


def _gather_layer_infos(local: list[MoELayerInfo]) -> list[MoELayerInfo]:
    """The MoE layers of the whole model: the union over ranks, sorted by module path.

    Paths compare numerically where a part is an index (``layers.10`` after ``layers.9``), so
    ``ModuleList`` layers come in model order on every layout, also under interleaved pipeline
    stages where rank order would give layers 0, 2, 1, 3. Collective (once per fit) when
    torch.distributed is initialised.
    """
    gathered: list[list[MoELayerInfo]] = [list(local)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [[] for _ in range(dist.get_world_size())]
        with uncounted():
            dist.all_gather_object(gathered, local)
    seen: dict[str, MoELayerInfo] = {}
    for infos in gathered:
        for info in infos:
            seen.setdefault(info.name, info)
    return sorted(seen.values(), key=lambda info: _module_path_key(info.name))


def _module_path_key(name: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in name.split("."))
