"""Train tiny Hugging Face MoE models (HFMoEModule) under one moe5d layout; optionally save_hf.

Run with torchrun for several processes (one launch trains every family in turn), or plainly for
the single-process reference:
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/scripts/hf_train.py '{"ep": 2}' OUT [--save-hf]
    python tests/scripts/hf_train.py '{}' OUT
HF_FAMILIES (comma-separated model types, default qwen3_moe,deepseek_v3) picks the families.

Rank 0 writes OUT/<family>.json: the loss of every optimizer step (mean over the global batch). With
--save-hf every rank calls ``save_hf(OUT/<family>_hf)`` after training, and rank 0 also writes
OUT/<family>_logits.pt: the trained module's logits on fixed tokens (computed under the layout; not
under pp, where no rank holds the whole model).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

from lightning_moe import MoE5DStrategy
from lightning_moe.data import ByteTextDataModule
from lightning_moe.hf import TINY_CONFIGS, HFMoEModule

FAMILIES = os.environ.get("HF_FAMILIES", "qwen3_moe,deepseek_v3").split(",")
STEPS = 6
SEQ = 32


class LossRecorder(L.Callback):
    """The mean loss of every optimizer step: Lightning's step outputs are already divided by the
    accumulation count, so they add up over a step's micro-batches; ranks are averaged (cp ranks
    hold partial sums of one micro-batch, dp/ep ranks different samples)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        value = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item()
        step = batch_idx // trainer.accumulate_grad_batches
        if step == len(self.losses):
            self.losses.append(0.0)
        self.losses[step] += value


def main(layout: dict, out: Path, save_hf: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for family in FAMILIES:
        train_one(family, layout, out, save_hf)
        gc.collect()  # the previous family's module and trainer are gone before the next fit


def train_one(family: str, layout: dict, out: Path, save_hf: bool) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    L.seed_everything(0)
    config = dict(TINY_CONFIGS[family], max_position_embeddings=SEQ)
    module = HFMoEModule({"model_type": family, **config}, learning_rate=3e-3, warmup_steps=2, max_steps=STEPS)
    data = ByteTextDataModule(
        seq_len=SEQ,
        global_batch_size=4,
        micro_batch_size=1,
        max_corpus_bytes=100_000,
        val_fraction=0.0,
        cache_dir=out / "cache",
    )
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=MoE5DStrategy(**layout),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[recorder],
        gradient_clip_val=0.05,
    )
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        (out / f"{family}.json").write_text(json.dumps(recorder.losses))
    if save_hf:
        module.save_hf(out / f"{family}_hf")
        if layout.get("pp", 1) > 1:
            return  # a pipeline stage cannot run the whole model: compare the saved folder instead
        ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(5))
        module.eval()
        with torch.no_grad():
            logits = module(ids)
        if trainer.is_global_zero:
            torch.save(
                {"ids": ids, "logits": logits.full_tensor() if hasattr(logits, "full_tensor") else logits},
                out / f"{family}_logits.pt",
            )


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]), "--save-hf" in sys.argv[3:])
