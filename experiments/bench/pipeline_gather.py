"""Gathering once per optimizer step under a pipeline: data-parallel bytes and peak memory per rank.

pp2 x dp2 on 4 CPU processes, 8 micro-batches of one sample per optimizer step and rank, a
~207M-parameter MoEGPT (the one of :mod:`experiments.bench.peak_memory`), AdamW fp32, 3 steps.
The same layout runs twice: FSDP2 gathering each unit per micro-batch (the default), and with
``gather_once_per_step=True``. Each run records, on its busiest rank, the dp bytes of the last
optimizer step (``comm/dp_bytes``, the comm accounting) and the peak resident set minus the import
floor (:class:`experiments.bench.peak_memory.PeakMemory`); the planner's figures for both stand
beside them, and the last rows give the ratios of the two runs.

    python -m experiments.bench.pipeline_gather
"""

from __future__ import annotations

import csv
import tempfile
from pathlib import Path
from typing import Any

from experiments.bench.peak_memory import MODEL, compare, measure, planned_bytes, planned_run

LAYOUT = "pp2"
WORLD = 4
# dp 2 (4 processes) shares the 16 samples: 8 per rank, all in one pipeline step.
OVERRIDES = [
    *MODEL, "data.global_batch_size=16", "data.micro_batch_size=1", "parallel.pp_microbatches=8",
    "trainer.devices=4", "logger=csv", "trainer.log_every_n_steps=1", "++trainer.gradient_clip_val=null",
]  # fmt: skip
VARIANTS = {"per micro-batch": "false", "once per step": "true"}


def planned_dp_bytes(overrides: list[str]) -> float:
    """The planner's dp bytes per optimizer step and rank for the layout these overrides train."""
    from lightning_moe.plan import model_shape
    from lightning_moe.planner import accounted_comm_bytes

    cfg, layout = planned_run(LAYOUT, overrides, WORLD)
    return accounted_comm_bytes(model_shape(cfg.model), layout, cfg.data.seq_len, precision="32-true")["dp"]


def measured_dp_bytes(run_dir: Path) -> float:
    """``comm/dp_bytes`` of the run's last optimizer step (the first one's set-up left out)."""
    metrics = next(run_dir.rglob("metrics.csv"))
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("comm/dp_bytes")]
    return float(rows[-1]["comm/dp_bytes"])


def run_pipeline_gather_bench() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    figures: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, once) in enumerate(VARIANTS.items()):
            overrides = [*OVERRIDES, f"parallel.gather_once_per_step={once}"]
            run_dir = Path(tmp) / f"run{i}"
            memory = compare(measure(LAYOUT, overrides, run_dir), planned_bytes(LAYOUT, overrides, WORLD))
            figures[label] = {
                "dp": measured_dp_bytes(run_dir),
                "dp_planned": planned_dp_bytes(overrides),
                "used": memory["used"],
                "used_planned": memory["planned"],
            }
            rows.append({
                "pp2·dp2, 8 micro-batches": label,
                "dp MB per step": figures[label]["dp"] / 1e6,
                "planner dp MB": figures[label]["dp_planned"] / 1e6,
                "peak - floor GB": memory["used"] / 1e9,
                "planner GB": memory["planned"] / 1e9,
            })  # fmt: skip
    once, per = figures["once per step"], figures["per micro-batch"]
    rows.append({
        "pp2·dp2, 8 micro-batches": "once / per micro-batch",
        "dp MB per step": once["dp"] / per["dp"],
        "planner dp MB": once["dp_planned"] / per["dp_planned"],
        "peak - floor GB": once["used"] / per["used"],
        "planner GB": once["used_planned"] / per["used_planned"],
    })  # fmt: skip
    return rows


def main() -> None:
    from experiments.bench.table import print_table

    print("Gathering once per step under pp2·dp2 (207M-parameter MoEGPT, 8 micro-batches per step; busiest rank)")
    print_table(run_pipeline_gather_bench())


if __name__ == "__main__":
    main()
