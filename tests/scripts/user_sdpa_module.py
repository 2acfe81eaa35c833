"""A user LightningModule that is not MoEGPT: plain attention through F.scaled_dot_product_attention.

Run as a script (Lightning's launcher re-executes it per process):
    python tests/scripts/user_sdpa_module.py <cp> <out.json>
Prints nothing; rank 0 writes the per-step losses (mean over the cp ranks) to out.json.
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe import MoE5DStrategy

VOCAB, HIDDEN, HEADS, SEQ = 64, 32, 4, 16


class TinyAttentionLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(SEQ, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.position(position_ids)
        q, k, v = self.qkv(h).view(*h.shape[:2], 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(h + self.proj(attn.transpose(1, 2).flatten(2)))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(SEQ).expand_as(batch["input_ids"])
        logits = self(batch["input_ids"], positions)
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())


def main(cp: int, out: str) -> None:
    L.seed_everything(0)
    tokens = torch.randint(0, VOCAB, (32, SEQ + 1), generator=torch.Generator().manual_seed(1))
    samples = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    loader = torch.utils.data.DataLoader(samples, batch_size=4)
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cp,
        strategy=MoE5DStrategy(cp=cp),
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[recorder],
    )
    trainer.fit(TinyAttentionLM(), loader)
    if trainer.is_global_zero:
        with open(out, "w") as f:
            json.dump(recorder.losses, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
