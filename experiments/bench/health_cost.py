"""The cost of the default health checks per optimizer step (docs/health.md).

The default tiny model under ep2 (2 CPU processes), 40 optimizer steps, trained alternately with the
default ``health`` group and with ``health=none``, four times each. Two figures:

- the median over the pairs of runs of their tokens/s ratio (without / with the checks): the whole
  cost, within the noise of runs on a shared machine;
- the time the health callback's own hooks take per step, as a fraction of the step, measured
  inside the runs with the checks (the hooks include the one all-reduce per step, so any wait for a
  slower rank counts as cost: an upper bound).

    python -m experiments.bench.health_cost
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.bench.cli import run_training
from experiments.bench.table import print_table
from lightning_moe.health import HealthCallback

RUNS = 4
OVERRIDES = [
    "parallel=ep2", "trainer.max_steps=40", "logger=none", "trainer.val_check_interval=null",
    "trainer.limit_val_batches=0", "~callbacks.expert_load_plots", "~callbacks.progress_bar",
]  # fmt: skip
TIMED = "health._target_=experiments.bench.health_cost.TimedHealthCallback"


class TimedHealthCallback(HealthCallback):
    """The health callback, timing its own per-step hooks (written to ``health_seconds_rank<r>.json``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hook_seconds = 0.0
        self.started: float | None = None

    def _timed(self, hook: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return hook(*args)
        finally:
            self.hook_seconds += time.perf_counter() - start

    def on_train_batch_start(self, *args: Any) -> None:
        if self.started is None:
            self.started = time.perf_counter()
        self._timed(super().on_train_batch_start, *args)

    def on_before_backward(self, *args: Any) -> None:
        self._timed(super().on_before_backward, *args)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._timed(super().on_before_optimizer_step, *args)

    def on_train_batch_end(self, *args: Any) -> None:
        self._timed(super().on_train_batch_end, *args)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_end(trainer, pl_module)
        path = Path(trainer.default_root_dir) / f"health_seconds_rank{trainer.global_rank}.json"
        assert self.started is not None
        fraction = self.hook_seconds / (time.perf_counter() - self.started)
        path.write_text(json.dumps({"hook_seconds": self.hook_seconds, "fraction_of_training": fraction}))


def run_health_cost_bench() -> dict[str, float]:
    rates: dict[str, list[float]] = {"checks": [], "none": []}
    hook_fractions: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(RUNS):
            for variant, extra in (("checks", [TIMED]), ("none", ["health=none"])):
                run_dir = Path(tmp) / f"{variant}{i}"
                run_training([*OVERRIDES, *extra], run_dir)
                summary = json.loads((run_dir / "summary.json").read_text())
                rates[variant].append(summary["tokens_per_second"])
                if variant == "checks":
                    timing = json.loads((run_dir / "health_seconds_rank0.json").read_text())
                    hook_fractions.append(timing["fraction_of_training"])
    # Each pair ran back to back: the ratio within a pair leaves out the machine's slower drifts.
    ratios = [none / checks for none, checks in zip(rates["none"], rates["checks"])]
    return {
        "slowdown": statistics.median(ratios),
        "slowdown_min": min(ratios),
        "slowdown_max": max(ratios),
        "hook_fraction": statistics.median(hook_fractions),
    }


def main() -> None:
    figures = run_health_cost_bench()
    print("Health checks (default settings), ep2 on 2 CPU processes, default tiny model, 40 steps,")
    print(f"{RUNS} runs each, alternated; medians")
    print_table(
        [
            {
                "figure": "tokens/s without / with the checks (median of pairs)",
                "value": f"{figures['slowdown']:.3f} ({figures['slowdown_min']:.3f}-{figures['slowdown_max']:.3f})",
            },
            {"figure": "health hooks' time / training time (rank 0)", "value": f"{figures['hook_fraction']:.4f}"},
        ]
    )


if __name__ == "__main__":
    main()
