"""Peak host memory per rank on CPU, measured, next to the planner's estimate.

Training runs of a ~207M-parameter MoEGPT (hidden 512, 8 layers of 16 experts of FFN 1024, AdamW,
fp32, 3 optimizer steps of 8 samples of 64 tokens) on five layouts: one process, ep4, ep2·dp2,
ep2·dp2 as HSDP with 2 replica groups and pp2·ep2 (4 processes each). Each rank records, through :class:`PeakMemory`:

- the import floor: its resident set (``VmRSS``) when training is set up, before the model is
  built (Python, torch, Lightning, the data; what no tensor of the model accounts for);
- its peak resident set over the run (``VmHWM`` at the end of fit).

The strategy fixes glibc's mmap threshold on CPU (:mod:`lightning_moe.parallel.runtime.host_memory`), so
freed tensors leave the process and the peak follows the live tensors. The planner's estimate
(:func:`lightning_moe.planner.memory_per_rank`, checkpointing ``none``) of the same layout is
compared with the busiest rank's peak minus its floor; the last column is that rank's peak
(floor included) over the one-process run's.

    python -m experiments.bench.peak_memory
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from experiments.bench.cli import run_training

OUT_ENV = "LMOE_PEAK_MEMORY_DIR"  # where each rank writes its figures

RUN = [
    "logger=none", "trainer.max_steps=3", "~callbacks.progress_bar", "~callbacks.expert_load_plots",
    "trainer.limit_val_batches=0", "trainer.val_check_interval=null", "data.max_corpus_bytes=200000",
    "+callbacks.peak_memory._target_=experiments.bench.peak_memory.PeakMemory",
]  # fmt: skip
# The ~207M-parameter model: 16 experts of 3 x 512 x 1024 in each of 8 layers (201M expert parameters).
MODEL = [
    "data.seq_len=64", "data.global_batch_size=8", "model.hidden_size=512", "model.num_layers=8", "model.num_heads=8",
    "model.moe.num_experts=16", "model.moe.ffn_hidden_size=1024",
]  # fmt: skip
LAYOUTS: dict[str, tuple[str, int]] = {
    "single": ("single", 1), "ep4": ("ep4", 4), "ep2·dp2": ("dp2_ep2", 4),
    "ep2·hsdp2x1": ("dp2_ep2_hsdp", 4),  # HSDP: experts whole on each rank of their 1-rank shard group
    "pp2·ep2": ("pp2_ep2", 4),  # 2 micro-batches per pipeline step: unsharded gradients accumulate
}  # fmt: skip


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in bytes (the file gives KiB)."""
    with open("/proc/self/status") as status:
        return 1024 * next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))


class PeakMemory(pl.Callback):
    """Writes this rank's import floor and peak resident set to ``$LMOE_PEAK_MEMORY_DIR/rank<r>.json``.

    The floor is ``VmRSS`` at ``setup``, which Lightning calls before the strategy builds and
    shards the model; the peak is ``VmHWM`` (the kernel's high-water mark of the resident set)
    at the end of fit. Added to a CLI run with
    ``+callbacks.peak_memory._target_=experiments.bench.peak_memory.PeakMemory``.
    """

    def __init__(self) -> None:
        self.floor: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.floor is None:
            self.floor = _status_bytes("VmRSS")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        out = os.environ.get(OUT_ENV)
        if out:
            figures = {"rank": trainer.global_rank, "floor": self.floor, "peak": _status_bytes("VmHWM")}
            Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(figures))


def measure(parallel: str, overrides: Sequence[str], run_dir: Path, timeout: float = 900) -> list[dict[str, int]]:
    """Run ``python -m lightning_moe.train parallel=<parallel> <overrides>`` with :class:`PeakMemory`;
    every rank's ``{"rank", "floor", "peak"}`` in bytes, by rank."""
    run_dir.mkdir(parents=True, exist_ok=True)
    run_training([*RUN, f"parallel={parallel}", *overrides], run_dir, env={OUT_ENV: str(run_dir)}, timeout=timeout)
    ranks = sorted(run_dir.glob("rank*.json"))
    return sorted((json.loads(p.read_text()) for p in ranks), key=lambda r: r["rank"])


def planned_run(parallel: str, overrides: Sequence[str], world_size: int) -> tuple[Any, Any]:
    """The training config ``parallel=<parallel>`` with these overrides composes, and the planner's
    ``Layout`` of it on ``world_size`` ranks."""
    from hydra import compose, initialize_config_dir

    from lightning_moe.conf import CONF_DIR
    from lightning_moe.planner.presets import layout_from_parallel

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"parallel={parallel}", "trainer.default_root_dir=/tmp/unused"])
    return cfg, layout_from_parallel(
        cfg.parallel, world_size, cfg.data.global_batch_size, cfg.data.get("micro_batch_size")
    )


def planned_bytes(parallel: str, overrides: Sequence[str], world_size: int) -> float:
    """The planner's memory per rank (busiest pipeline rank, no activation checkpointing) for the
    layout ``parallel=<parallel>`` trains with these overrides."""
    from lightning_moe.plan import model_shape
    from lightning_moe.planner import memory_per_rank

    cfg, layout = planned_run(parallel, overrides, world_size)
    precision = "bf16-mixed" if str(cfg.trainer.get("precision") or "32-true").startswith("bf16") else "32-true"
    memory, _ = memory_per_rank(model_shape(cfg.model), layout, cfg.data.seq_len, precision)
    return memory.total("none")


def compare(ranks: Sequence[dict[str, int]], planned: float) -> dict[str, float]:
    """The busiest rank's peak, floor, peak minus floor and its ratio to the estimate."""
    busiest = max(ranks, key=lambda r: r["peak"] - r["floor"])
    used = busiest["peak"] - busiest["floor"]
    return {
        "peak": busiest["peak"],
        "floor": busiest["floor"],
        "used": used,
        "planned": planned,
        "ratio": used / planned,
    }


def run_peak_memory_bench() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    single_peak = math.nan
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, (parallel, world)) in enumerate(LAYOUTS.items()):  # one run at a time: RSS is per process
            figures = compare(measure(parallel, MODEL, Path(tmp) / f"run{i}"), planned_bytes(parallel, MODEL, world))
            if parallel == "single":
                single_peak = figures["peak"]
            rows.append({
                "layout": label,
                "peak RSS GB": figures["peak"] / 1e9,
                "import floor GB": figures["floor"] / 1e9,
                "peak - floor GB": figures["used"] / 1e9,
                "planner GB": figures["planned"] / 1e9,
                "measured / planned": figures["ratio"],
                "peak / one process": figures["peak"] / single_peak,
            })  # fmt: skip
    return rows


def main() -> None:
    from experiments.bench.table import print_table

    print("Peak host memory per rank vs the planner (207M-parameter MoEGPT, AdamW fp32, 3 steps; busiest rank)")
    print_table(run_peak_memory_bench())


if __name__ == "__main__":
    main()
