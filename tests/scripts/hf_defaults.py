"""HFMoEModule trained with nothing but the defaults a user types (issue 21, items 2 and 7).

    python tests/scripts/hf_defaults.py single OUT       # one process: moe5d and a plain Trainer
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/scripts/hf_defaults.py ep2 OUT

Every fit is ``HFMoEModule(<tiny config>)`` with ``ByteTextDataModule(global_batch_size=4,
seq_len=32)`` for 3 steps: no learning rate, no micro-batch size, no schedule is set (DeepSeek-V3:
``global_batch_size=8``, so that DDP accumulates two micro-batches per step). Rank 0 writes
``OUT/<run>_<family>.pt``: the per-step losses, the trained module's logits on fixed tokens, every
MoE layer's expert bias (``rank_biases``: on every rank) and, per optimizer step, the expert loads
the bias rule sees (summed over the processes). Runs:

- ``single``: ``moe5d_qwen3_moe`` and ``moe5d_deepseek_v3`` (``MoE5DStrategy()`` on one process)
  and ``auto_deepseek_v3`` (``Trainer(strategy="auto")``: no lightning-moe strategy at all);
- ``ep2``: ``ep2_qwen3_moe`` (``MoE5DStrategy(ep=2)`` on two processes) and ``ddp_deepseek_v3``
  (Lightning's ``strategy="ddp"`` on the same two processes).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from hf_train import LossRecorder  # the script's folder is on sys.path (run as a script or by torchrun)
from torch.distributed.tensor import DTensor

from lightning_moe import MoE5DStrategy
from lightning_moe.data import ByteTextDataModule
from lightning_moe.hf import TINY_CONFIGS, HFMoEModule
from lightning_moe.moe import MoELayer

STEPS = 3


class LoadRecorder(L.Callback):
    """Per optimizer step, the expert loads of every expert-bias layer accumulated over the step's
    micro-batches, summed over the processes: what the bias rule must see."""

    def __init__(self) -> None:
        self.loads: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        loads = [
            m.router.expert_load.clone()
            for m in pl_module.modules()
            if isinstance(m, MoELayer) and m.router.use_expert_bias
        ]
        if not loads:
            return
        total = torch.stack(loads)
        if trainer.world_size > 1:
            dist.all_reduce(total)
        self.loads.append(total)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def fit(name: str, family: str, strategy: Any, devices: int, out: Path) -> None:
    L.seed_everything(0)
    module = HFMoEModule({"model_type": family, **TINY_CONFIGS[family]})
    data = ByteTextDataModule(global_batch_size=8 if family == "deepseek_v3" else 4, seq_len=32)
    recorder, loads = LossRecorder(), LoadRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, loads],
    )
    trainer.fit(module, datamodule=data)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    module.eval()
    with torch.no_grad():
        logits = _full(module(ids))
    biases = {
        n: _full(m.router.expert_bias)
        for n, m in module.named_modules()
        if isinstance(m, MoELayer) and m.router.use_expert_bias
    }
    rank_biases = [biases]
    if trainer.world_size > 1:
        rank_biases = [None] * trainer.world_size
        dist.all_gather_object(rank_biases, biases)
    if trainer.is_global_zero:
        torch.save(
            {
                "losses": recorder.losses,
                "ids": ids,
                "logits": logits,
                "biases": biases,
                "rank_biases": rank_biases,
                "loads": loads.loads,
            },
            out / f"{name}_{family}.pt",
        )
    del module, trainer
    gc.collect()


def main(run: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if run == "single":
        # The plain Trainer first: no process group of an earlier fit is around.
        fit("auto", "deepseek_v3", "auto", 1, out)
        fit("moe5d", "deepseek_v3", MoE5DStrategy(), 1, out)
        fit("moe5d", "qwen3_moe", MoE5DStrategy(), 1, out)
    elif run == "ep2":
        fit("ep2", "qwen3_moe", MoE5DStrategy(ep=2), 2, out)
        fit("ddp", "deepseek_v3", "ddp", 2, out)
    else:
        raise SystemExit(f"unknown run {run!r}: use single or ep2")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
