"""Callbacks for MoE training that work with any LightningModule holding ``MoELayer`` modules.

Example::

    from lightning_moe.callbacks import MoEMetricsCallback, SummaryCallback

    trainer = Trainer(strategy="moe5d", callbacks=[MoEMetricsCallback(), SummaryCallback()])
"""

from lightning_moe.callbacks.moe_metrics import MoEMetricsCallback, data_parallel_size, data_parallel_sum
from lightning_moe.callbacks.summary import SummaryCallback, parallel_layout, write_json_atomic

__all__ = [
    "MoEMetricsCallback",
    "SummaryCallback",
    "data_parallel_size",
    "data_parallel_sum",
    "parallel_layout",
    "write_json_atomic",
]
