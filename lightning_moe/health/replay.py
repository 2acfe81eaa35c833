"""Run an optimizer step's micro-batches again, on the same data, from the same state.

A rerun starts as the step started: the gradients cleared, the random generators back where they
were at the step's first micro-batch, the routers' expert loads of the step forgotten. It then runs
each micro-batch through the strategy's ``training_step`` and ``backward`` as Lightning's loop did
(:func:`lightning_moe._compat.replay_training_batch`), so every step engine (gradient accumulation,
micro-batch overlap, the pipeline schedules, FSDP's gather once per step) runs its own path. The
optimizer does not step: the caller decides what happens with the new gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_moe._compat import replay_training_batch
from lightning_moe.moe import MoELayer

__all__ = ["StepRecord", "clear_step_state", "sample_indices"]


@dataclass
class StepRecord:
    """The training batches of the optimizer step in progress (as the loop handed them to
    ``training_step``) and the random state before its first one."""

    batches: list[tuple[Any, int]] = field(default_factory=list)
    cpu_rng: torch.Tensor | None = None
    cuda_rng: list[torch.Tensor] | None = None

    def begin(self) -> None:
        self.batches = []
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def add(self, batch: Any, batch_idx: int) -> None:
        self.batches.append((batch, batch_idx))

    def restore_rng(self) -> None:
        if self.cpu_rng is not None:
            torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def rerun(
        self, trainer: Any, optimizer: Any, parameters: list[nn.Parameter], model: nn.Module
    ) -> list[torch.Tensor]:
        """Run the step's batches again (forward and backward); returns their losses as ``training_step``
        returned them."""
        clear_step_state(parameters, model)
        self.restore_rng()
        losses = []
        for i, (batch, batch_idx) in enumerate(self.batches):
            loss = replay_training_batch(
                trainer, batch, batch_idx, optimizer, steps_optimizer=i == len(self.batches) - 1
            )
            if loss is not None:
                losses.append(loss)
        return losses


def clear_step_state(parameters: list[nn.Parameter], model: nn.Module) -> None:
    """Forget what a step left behind before its optimizer step: the gradients (set to None, so that
    an optimizer step now changes neither the parameters nor the optimizer state) and the routers'
    expert loads (so that the expert-bias update after it changes nothing)."""
    for param in parameters:
        param.grad = None
    for layer in model.modules():
        if isinstance(layer, MoELayer) and layer.router.use_expert_bias:
            layer.router.expert_load.zero_()


def sample_indices(batch: Any) -> list[int]:
    """The ``sample_index`` values a batch carries (dict batches of the library's data modules), else []."""
    if isinstance(batch, dict) and isinstance(batch.get("sample_index"), torch.Tensor):
        return [int(i) for i in batch["sample_index"].reshape(-1).tolist()]
    if isinstance(batch, (list, tuple)):
        return [i for item in batch for i in sample_indices(item)]
    return []
