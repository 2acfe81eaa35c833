"""Pipeline bubble: measured idle fraction per rank against the theoretical ``(p-1)/(m+p-1)``.

Two gloo processes (p = 2 stages) run GPipe and 1F1B schedules of ``torch.distributed.pipelining``
on a stack of dense MLP blocks split by :func:`lightning_moe.parallel.plans.pipeline.split_module`. Each
rank times the compute of its stage (``forward_one_chunk`` + ``backward_one_chunk``) and the wall
time of the whole step; ``bubble = 1 - compute / step`` (idle time over step time), the median over
the measured steps, then the mean over the ranks. The model is large enough that compute dominates the P2P sends.

    python -m experiments.bench.pipeline_bubble
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from experiments.bench.table import print_table

PP = 2
HIDDEN = 512
TOKENS_PER_MICROBATCH = 256
BLOCKS_PER_STAGE = 2
WARMUP_STEPS = 1
STEPS = 5


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class _Stack(nn.Module):
    """``layers`` only: the default split convention cuts it into equal stages."""

    def __init__(self, hidden: int, num_blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _Block(hidden) for i in range(num_blocks)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _timed(stage: Any, busy: list[float]) -> None:
    """Add the time spent in the stage's compute calls to ``busy[0]``."""
    for name in ("forward_one_chunk", "backward_one_chunk"):
        original = getattr(stage, name)

        def wrapper(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start

        setattr(stage, name, wrapper)


def _measure(rank: int, schedule_name: str, microbatches: int) -> float:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from lightning_moe.parallel.plans.pipeline import split_module

    torch.manual_seed(0)
    model = _Stack(HIDDEN, PP * BLOCKS_PER_STAGE)
    ((index, module),) = split_module(model, rank, PP)
    stage = PipelineStage(module, index, PP, torch.device("cpu"))
    busy = [0.0]
    _timed(stage, busy)
    cls = ScheduleGPipe if schedule_name == "GPipe" else Schedule1F1B
    schedule = cls(stage, microbatches, loss_fn=lambda out, target: F.mse_loss(out, target))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(microbatches * TOKENS_PER_MICROBATCH, HIDDEN, generator=gen)
    target = torch.randn(microbatches * TOKENS_PER_MICROBATCH, HIDDEN, generator=gen)
    fractions = []
    for step in range(WARMUP_STEPS + STEPS):
        busy[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        if index == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=[])
        wall = time.perf_counter() - start
        if step >= WARMUP_STEPS:
            fractions.append(1.0 - busy[0] / wall)
        model.zero_grad(set_to_none=True)
    return statistics.median(fractions)


def _worker(rank: int, store: str, configs: list[tuple[str, int]], results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=PP)
    try:
        for name, m in configs:
            results.put((rank, name, m, _measure(rank, name, m)))
    finally:
        dist.destroy_process_group()


def run_pipeline_bubble_bench(
    schedules: tuple[str, ...] = ("GPipe", "1F1B"), microbatches: tuple[int, ...] = (4, 8)
) -> list[dict]:
    """One row per (schedule, m): measured bubble per rank and averaged, and the theoretical value."""
    configs = [(name, m) for name in schedules for m in microbatches]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(rank, f"{tmp}/store", configs, results)) for rank in range(PP)]
        for proc in procs:
            proc.start()
        measured: dict[tuple[str, int], dict[int, float]] = {}
        for _ in range(len(configs) * PP):
            rank, name, m, fraction = results.get(timeout=600)
            measured.setdefault((name, m), {})[rank] = fraction
        for proc in procs:
            proc.join(timeout=60)
    rows = []
    for name, m in configs:
        per_rank = measured[(name, m)]
        rows.append(
            {
                "schedule": name,
                "p": PP,
                "m": m,
                "bubble rank 0": per_rank[0],
                "bubble rank 1": per_rank[1],
                "bubble measured": sum(per_rank.values()) / PP,
                "bubble theory (p-1)/(m+p-1)": (PP - 1) / (m + PP - 1),
            }
        )
    return rows


def main() -> None:
    print(
        f"Pipeline bubble (idle / step time per rank; p={PP} stages, {BLOCKS_PER_STAGE} MLP blocks of hidden"
        f" {HIDDEN} per stage, {TOKENS_PER_MICROBATCH} tokens per micro-batch, gloo on CPU)"
    )
    print_table(run_pipeline_bubble_bench())


if __name__ == "__main__":
    main()
