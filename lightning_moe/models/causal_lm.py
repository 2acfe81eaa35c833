"""`CausalLMModule`: the training side shared by every causal LM of lightning-moe.

`MoEGPT` and `lightning_moe.hf.HFMoEModule` differ in how they build and run the network; they
train the same way: the batch dict, the next-token loss, AdamW with warmup and cosine decay, and
the aux-loss-free expert-bias update once per optimizer step, under any strategy.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from lightning_moe.moe import MoELayer, update_expert_biases
from lightning_moe.optim import Muon

__all__ = ["OPTIMIZERS", "CausalLMModule", "check_optimizer", "next_token_loss", "warmup_cosine_factor"]

#: What ``optimizer=`` selects in ``configure_optimizers``.
OPTIMIZERS = ("adamw", "muon")


def check_optimizer(optimizer: str) -> None:
    """Refuse an unknown ``optimizer`` hyperparameter when the module is built, before any work."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f"optimizer={optimizer!r} must be one of {OPTIMIZERS} (model.optimizer=muon on the command line)"
        )


@functools.cache
def _forward_parameters(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def warmup_cosine_factor(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier after `step` optimizer steps: linear warmup then cosine decay.

    `(step + 1) / warmup_steps` while `step < warmup_steps` (the first step already trains), then
    cosine from 1 at `warmup_steps` to `min_lr_ratio` at `max_steps`, constant afterwards.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def next_token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    loss_token_count: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Mean next-token cross entropy (fp32 softmax) over the tokens of `labels` that `loss_mask`
    keeps, divided by `loss_token_count` when given: under context parallelism the strategy passes
    the micro-batch's loss tokens per cp rank, so the cp ranks' losses average to the mean over
    all tokens (not a mean of means)."""
    per_token = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none")
    if loss_mask is not None:
        per_token = per_token * loss_mask.flatten().to(per_token.dtype)
    count = loss_token_count
    if count is None:
        count = loss_mask.sum() if loss_mask is not None else per_token.numel()
    return per_token.sum() / torch.as_tensor(count, dtype=per_token.dtype).clamp_min(1.0)


class CausalLMModule(pl.LightningModule):
    """A LightningModule that trains a causal LM: subclasses provide `forward(input_ids, position_ids)`.

    What it adds:
        - `loss(batch)`: the mean next-token cross entropy of a batch dict (`input_ids`, `labels`,
          optional `position_ids`, `loss_mask`, `loss_token_count`); `loss_from_logits` is the same
          loss from logits, which the strategy calls on the last pipeline stage;
        - `training_step` (logs `train/loss`) and `validation_step` (logs `val/loss`), plus any
          further terms `loss_terms` names (`train/mtp_loss`, ...);
        - `configure_optimizers`: AdamW with weight decay on matrices except embeddings, linear
          warmup then cosine decay to `min_lr_ratio`, stepped every optimizer step;
        - `optimizer_step`: the expert-bias update of every `MoELayer` once per optimizer step
          (after all its micro-batches), unless the strategy does it itself (`MoE5DStrategy`).
          Under another strategy's processes (e.g. DDP) the loads are summed over all of them
          first, so every rank applies the same update (before, each rank used its own loads and
          DDP's buffer broadcast kept rank 0's).

    Hyperparameters read from `self.hparams` (the subclass's `save_hyperparameters()`):
    `warmup_steps`, `max_steps` (None: the trainer's), `min_lr_ratio`, `weight_decay`, `betas` and
    the learning rate under the name `lr_hparam` (`"lr"` for `MoEGPT`, `"learning_rate"` for
    `HFMoEModule`).
    """

    #: The name of the learning-rate hyperparameter.
    lr_hparam: str = "learning_rate"

    def loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross entropy of a batch dict (`input_ids`, `labels`, optional
        `position_ids`, `loss_mask` and `loss_token_count`; masked tokens are left out of the
        mean, which divides by `loss_token_count` when the strategy provides it). Logits are cast
        to fp32 for the softmax."""
        logits = self(batch["input_ids"], batch.get("position_ids"), **self.sample_index_kwargs(batch))
        return self.loss_from_logits(logits, batch["labels"], batch.get("loss_mask"), batch.get("loss_token_count"))

    def sample_index_kwargs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`{"sample_index": batch["sample_index"]}` when the batch has it and `forward` takes it, else `{}`
        (the token keys of routing record/replay, `lightning_moe.moe.replay`)."""
        if "sample_index" not in batch or "sample_index" not in _forward_parameters(type(self)):
            return {}
        return {"sample_index": batch["sample_index"]}

    def loss_from_logits(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        loss_token_count: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        """The loss of `loss()` from logits `[B, S, vocab]`: the mean cross entropy over the tokens
        of `labels [B, S]` that `loss_mask` keeps, divided by `loss_token_count` when given. Under
        pipeline parallelism the strategy calls it on the last stage for every micro-batch."""
        return next_token_loss(logits, labels, loss_mask, loss_token_count)

    def loss_terms(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The objective of a batch and its parts by log name (`loss` first). Here both are `loss()`;
        a module with more terms (`MoEGPT`'s multi-token prediction) returns each beside it."""
        loss = self.loss(batch)
        return loss, {"loss": loss}

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        objective, terms = self.loss_terms(batch)
        for name, value in terms.items():
            self.log(
                f"train/{name}",
                value,
                prog_bar=name == "loss",
                on_step=True,
                on_epoch=False,
                batch_size=batch["input_ids"].shape[0],
            )
        return objective

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        objective, terms = self.loss_terms(batch)
        for name, value in terms.items():
            self.log(
                f"val/{name}",
                value,
                prog_bar=name == "loss",
                on_step=False,
                on_epoch=True,
                sync_dist=True,
                batch_size=batch["input_ids"].shape[0],
            )
        return objective

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step, then the aux-loss-free expert-bias update once per optimizer step (after
        the loads of all its micro-batches were accumulated), unless the strategy does it itself
        (`MoE5DStrategy` does, for any module)."""
        super().optimizer_step(*args, **kwargs)
        if getattr(self.trainer.strategy, "updates_expert_biases", False):
            return
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            update_expert_biases(self)
            return
        # Another strategy's processes (DDP, FSDP, ...): every rank's loads count. Summing over all
        # processes is right whether they hold different samples or copies of the same ones (the
        # rule only takes the sign of mean - load, which a common factor does not change).
        for layer in self.modules():
            if isinstance(layer, MoELayer):
                group = layer.data_group if layer.data_group is not None else dist.group.WORLD
                layer.router.update_expert_bias(group)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW; weight decay on matrices (ndim >= 2: linear, router and expert weights) except
        token embeddings; none on vectors (norm weights, biases). With ``optimizer="muon"``:
        :class:`lightning_moe.optim.Muon` (the same learning rate, betas and weight decay; Muon on
        attention, dense-MLP and per-expert matrices, AdamW on the rest). Linear warmup then cosine
        decay, stepped every optimizer step."""
        hp = self.hparams
        if hp.get("optimizer", "adamw") == "muon":
            optimizer = Muon(self, lr=hp[self.lr_hparam], weight_decay=hp.weight_decay, betas=tuple(hp.betas))
            return self._with_schedule(optimizer)
        # Parameters of nn.Embedding modules (also after tensor parallelism or FSDP, which keep the class).
        embeddings = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        decay, no_decay = [], []
        for param in self.parameters():
            if param.requires_grad:
                wants_decay = param.ndim >= 2 and id(param) not in embeddings
                (decay if wants_decay else no_decay).append(param)
        groups = [
            {"params": params, "weight_decay": wd}
            for params, wd in ((decay, hp.weight_decay), (no_decay, 0.0))
            if params
        ]
        return self._with_schedule(torch.optim.AdamW(groups, lr=hp[self.lr_hparam], betas=tuple(hp.betas)))

    def _with_schedule(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        hp = self.hparams
        schedule = partial(
            warmup_cosine_factor,
            warmup_steps=hp.warmup_steps,
            max_steps=self._total_steps(),
            min_lr_ratio=hp.min_lr_ratio,
        )
        scheduler = LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> int:
        if self.hparams.max_steps is not None:
            return int(self.hparams.max_steps)
        if self.trainer.max_steps > 0:
            return int(self.trainer.max_steps)
        estimated = self.trainer.estimated_stepping_batches
        if not math.isfinite(estimated):
            raise ValueError(
                f"cannot size the cosine schedule: set {type(self).__name__}(max_steps=...) or Trainer(max_steps=...)"
            )
        return int(estimated)
