"""Callbacks for MoE training that work with any LightningModule holding ``MoELayer`` modules.

Example::

    from lightning_moe.callbacks import (
        CommAccountingCallback, ExpertLoadPlotCallback, MoEMetricsCallback, ParameterSummary, StepProgressBar,
        SummaryCallback, ThroughputCallback,
    )

    trainer = Trainer(strategy="moe5d", max_steps=200, callbacks=[
        MoEMetricsCallback(), ExpertLoadPlotCallback(every_n_steps=50), CommAccountingCallback(),
        ThroughputCallback(), SummaryCallback(), StepProgressBar(), ParameterSummary(),
    ])
"""

from lightning_moe.callbacks.base import OptimizerStepCallback, data_parallel_size, log_to_loggers
from lightning_moe.callbacks.comm_accounting import (
    CommAccountingCallback,
    GroupDims,
    count_collectives,
    group_dims,
    uncounted,
)
from lightning_moe.callbacks.console import (
    ParameterSummary,
    StepProgressBar,
    counts_optimizer_steps,
    use_lightning_moe_displays,
)
from lightning_moe.callbacks.expert_load_plots import ExpertLoadPlotCallback
from lightning_moe.callbacks.moe_metrics import (
    MoEMetricsCallback,
    MoEStatsMetric,
    MoEStepResult,
    data_parallel_sum,
    load_metrics,
)
from lightning_moe.callbacks.plots import plot_curves, plot_expert_load
from lightning_moe.callbacks.summary import SummaryCallback, parallel_layout, write_json_atomic
from lightning_moe.callbacks.throughput import ThroughputCallback, active_parameters, model_flops_per_token
from lightning_moe.checkpoint.periodic import PeriodicCheckpoint

__all__ = [
    "CommAccountingCallback",
    "ExpertLoadPlotCallback",
    "GroupDims",
    "MoEMetricsCallback",
    "MoEStatsMetric",
    "MoEStepResult",
    "OptimizerStepCallback",
    "ParameterSummary",
    "PeriodicCheckpoint",
    "StepProgressBar",
    "SummaryCallback",
    "ThroughputCallback",
    "active_parameters",
    "count_collectives",
    "counts_optimizer_steps",
    "data_parallel_size",
    "data_parallel_sum",
    "group_dims",
    "load_metrics",
    "log_to_loggers",
    "model_flops_per_token",
    "parallel_layout",
    "plot_curves",
    "plot_expert_load",
    "uncounted",
    "use_lightning_moe_displays",
    "write_json_atomic",
]
