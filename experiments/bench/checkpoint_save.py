"""What a periodic checkpoint costs a training step: sync saves vs ``async_checkpoint=True`` (DCP ``async_save``).

Two training runs of the same MoEGPT on ep2 (2 CPU processes) with ``callbacks=checkpoint`` saving
every ``every`` optimizer steps, in the foreground and in the background. A callback records each
optimizer step's wall time, from the start of its first batch to the start of the next step's, so
a save counts in the step that triggered it. Ratios are to the median step without a save of the
same run (medians throughout, the first steps left out as warm-up: on a shared machine the load
moves between runs more than within one):

- ``save step``: the step that saved (sync: the whole write; async: copying the tensors to host
  memory, then training goes on);
- ``period``: the mean step of a whole save period (from the step after one save to the next
  save), the background writer's share of the cores included.

    python -m experiments.bench.checkpoint_save
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from experiments.bench.cli import run_training
from experiments.bench.table import print_table

MODEL = [
    "model.hidden_size=256",
    "model.num_layers=4",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "model.moe.num_experts=8",
    "model.moe.ffn_hidden_size=512",
    "data.seq_len=128",
    "data.global_batch_size=8",
]
SIZES = {"model": MODEL, "steps": 38, "every": 6, "warmup": 5}
SMOKE = {
    "model": [
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.moe.num_experts=4",
        "model.moe.ffn_hidden_size=32",
        "data.seq_len=32",
        "data.global_batch_size=8",
    ],
    "steps": 5,
    "every": 2,
    "warmup": 1,
}
COMMON = [
    "parallel=ep2",
    "logger=none",
    "~callbacks.progress_bar",
    "~callbacks.expert_load_plots",
    "trainer.limit_val_batches=0",
    "trainer.val_check_interval=null",
    "data.micro_batch_size=2",
    "data.max_corpus_bytes=400000",
]


class StepTimes(Callback):
    """Writes ``{optimizer step: seconds}`` to ``path`` (rank 0): the start of each step's first batch to the next one's."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.starts: dict[int, float] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.setdefault(trainer.global_step + 1, time.perf_counter())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero:
            steps = sorted(self.starts)
            seconds = {step: self.starts[step + 1] - self.starts[step] for step in steps[:-1]}
            self.path.write_text(json.dumps(seconds))


def step_seconds(folder: Path, name: str, sizes: dict[str, Any], checkpoint: list[str]) -> dict[int, float]:
    """Optimizer step -> wall seconds of one training run (steps after the warm-up)."""
    times = folder / f"{name}.json"
    run_training(
        [
            *COMMON,
            *sizes["model"],
            f"trainer.max_steps={sizes['steps']}",
            *checkpoint,
            "+callbacks.step_times._target_=experiments.bench.checkpoint_save.StepTimes",
            f"+callbacks.step_times.path={times}",
        ],
        folder / name,
    )
    return {int(step): s for step, s in json.loads(times.read_text()).items() if int(step) > sizes["warmup"]}


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in (folder / "checkpoints").rglob("*") if p.is_file() and not p.is_symlink())


def run(smoke: bool = False) -> dict[str, Any]:
    sizes = SMOKE if smoke else SIZES
    every = sizes["every"]
    periodic = [
        "callbacks=checkpoint",
        f"callbacks.checkpoint.every_n_train_steps={every}",
        "callbacks.checkpoint.keep_last=1",
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmoe_bench_ckpt_") as tmp:
        folder = Path(tmp)
        for mode, extra in (("sync", []), ("async", ["parallel.async_checkpoint=true"])):
            steps = step_seconds(folder, mode, sizes, [*periodic, *extra])
            saves = [step for step in steps if step % every == 0]
            plain = statistics.median(seconds for step, seconds in steps.items() if step % every)
            # Each whole period: the steps after one save up to the next save, per step.
            periods = [
                sum(steps[step] for step in range(start + 1, end + 1)) / every for start, end in zip(saves, saves[1:])
            ]
            save_step = statistics.median(steps[step] for step in saves)
            rows.append(
                {
                    "saves": mode,
                    "checkpoint MB": checkpoint_bytes(folder / mode) / 1e6,
                    "plain step ms": 1e3 * plain,
                    "save step ms": 1e3 * save_step,
                    "save step / plain": save_step / plain,
                    "period / plain": statistics.median(periods) / plain,
                    "saves measured": len(saves),
                }
            )
    return {"every": every, "rows": rows}


def main(smoke: bool = False) -> None:
    result = run(smoke)
    print(
        f"Checkpoint save cost per step (ep2, 2 CPU processes, a save every {result['every']} optimizer steps,"
        " ratios to the median step without a save of the same run)"
    )
    print_table(result["rows"])


if __name__ == "__main__":
    main()
