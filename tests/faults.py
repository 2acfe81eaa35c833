"""Faults that tests inject into a training run from the command line, as Lightning callbacks::

    python -m lightning_moe.train ... +callbacks.fault._target_=tests.faults.StopRank +callbacks.fault.rank=1 \
        +callbacks.fault.step=3

(``tests`` is importable when the repository root is on ``PYTHONPATH``.)
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl


class StopRank(pl.Callback):
    """Rank ``rank`` stops for ``seconds`` before the collectives of optimizer step ``step``; its peers
    wait for it inside the step's first collective."""

    def __init__(self, rank: int, step: int, seconds: float = 600.0) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            print(f"rank {self.rank} stops at step {self.step} at {time.time():.3f}", flush=True)
            time.sleep(self.seconds)


class KillRank(pl.Callback):
    """Rank ``rank`` is killed (SIGKILL, no clean-up) at the start of optimizer step ``step``, in the first
    attempt of a torchrun job only (``TORCHELASTIC_RESTART_COUNT`` 0), so that the restart runs through."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordSamples(pl.Callback):
    """Each rank appends the ``sample_index`` of every training batch it starts, with the optimizer step
    it belongs to and the torchrun attempt, to ``<default_root_dir>/samples/rank<r>.jsonl``."""

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: dict, batch_idx: int
    ) -> None:
        record = {
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "step": trainer.global_step,
            "samples": batch["sample_index"].flatten().tolist(),
        }
        folder = Path(trainer.default_root_dir) / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank{trainer.global_rank}.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")


def samples_per_step(run_dir: Path, attempt_of_step: Callable[[int], int] = lambda step: 0) -> dict[int, list[int]]:
    """Step -> the sorted samples that trained it, over every rank; each step as seen by ``attempt_of_step(step)``."""
    steps: dict[int, list[int]] = {}
    for log in sorted((run_dir / "samples").glob("rank*.jsonl")):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if record["attempt"] == attempt_of_step(record["step"]):
                steps.setdefault(record["step"], []).extend(record["samples"])
    return {step: sorted(samples) for step, samples in sorted(steps.items())}
