"""Callbacks the health tests add to a run from the command line (``+callbacks.<name>._target_=...``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightning_moe.moe import MoELayer


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class StarveExpert(Callback):
    """Give ``expert`` of every MoE layer a router bias so low that no token picks it (expert_bias runs)."""

    def __init__(self, expert: int = 3, bias: float = -100.0) -> None:
        self.expert, self.bias = expert, bias

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for layer in pl_module.modules():
            if isinstance(layer, MoELayer):
                layer.router.expert_bias[self.expert] = self.bias


class StateTrace(Callback):
    """After each optimizer step, this rank's fingerprint of its parameters, optimizer state and expert
    biases (sums in float64), written to ``<run dir>/state_rank<r>.json`` at the end."""

    def __init__(self) -> None:
        self.trace: dict[int, list[float]] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step in self.trace:
            return
        params = [_local(p).double().sum().item() for p in pl_module.parameters()]
        state = [
            _local(value).double().sum().item()
            for optimizer in trainer.optimizers
            for per_param in optimizer.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor)
        ]
        biases = [
            layer.router.expert_bias.double().sum().item()
            for layer in pl_module.modules()
            if isinstance(layer, MoELayer) and layer.router.use_expert_bias
        ]
        self.trace[step] = [sum(params), sum(state), sum(biases)]

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        path = Path(trainer.default_root_dir) / f"state_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.trace))
