"""Fault injection: make one rank's step go wrong on purpose, to test the health checks and to drill them.

Off by default (``health.inject.kind=null``). Like Megatron-LM's ``--error-injection-*`` options,
a fault is placed by step and rank, and ``times`` decides whether it is transient (the first
execution of the step only) or persistent (every execution, reruns included).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_moe.moe import MoELayer

__all__ = ["FAULT_KINDS", "FaultInjection"]

FAULT_KINDS = ("nan_grad", "nan_loss", "bitflip_grad", "sleep", "loss_spike")


@dataclass
class FaultInjection:
    """Where and how often a fault happens (``health.inject``).

    - ``kind``: ``nan_grad`` (the gradient at the output of this rank's last MoE layer becomes NaN in
      backward, before any reduction), ``nan_loss`` (the output of this rank's last module with
      parameters becomes NaN, so the loss does), ``bitflip_grad`` (after backward, the top exponent
      bit of one gradient element flips: a large finite value only the silent-data-corruption check
      sees), ``sleep`` (the rank computes ``sleep_s`` seconds longer: a straggler), ``loss_spike``
      (that output is multiplied by -8, so the loss jumps but stays finite); None: no fault;
    - ``step``: Lightning's ``trainer.global_step`` while the faulty optimizer step runs;
    - ``rank``: the global rank;
    - ``times``: executions of that step that fault: 1 only the first (transient), -1 every one,
      reruns included (persistent);
    - ``sleep_s``: the delay of ``sleep``.

    Example (a transient NaN in rank 1's gradients at step 5)::

        HealthCallback(inject=FaultInjection(kind="nan_grad", step=5, rank=1, times=1))
    """

    kind: str | None = None
    step: int = 0
    rank: int = 0
    times: int = 1
    sleep_s: float = 1.0

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in FAULT_KINDS:
            raise ValueError(f"health.inject.kind={self.kind!r} is not one of {', '.join(FAULT_KINDS)} (or null)")
        if self.times != -1 and self.times < 1:
            raise ValueError(f"health.inject.times={self.times}: use 1 (transient), n >= 1, or -1 (every execution)")
        if self.step < 0 or self.rank < 0:
            raise ValueError(f"health.inject.step={self.step} and rank={self.rank} must be >= 0")
        if self.sleep_s < 0:
            raise ValueError(f"health.inject.sleep_s={self.sleep_s} must be >= 0")
        self._executions = 0
        self._handles: list[RemovableHandle] = []

    def check_world(self, world_size: int) -> None:
        if self.kind is not None and self.rank >= world_size:
            raise ValueError(f"health.inject.rank={self.rank} is not a rank of this run (world size {world_size})")

    def begin_execution(self, model: nn.Module, global_step: int, rank: int) -> None:
        """At the start of an execution of an optimizer step (its first run or a rerun): arm the fault's
        hooks when it is this rank's and step's turn."""
        self.end_execution()
        if self.kind is None or global_step != self.step or rank != self.rank:
            return
        self._executions += 1
        if self.times != -1 and self._executions > self.times:
            return
        if self.kind == "sleep":
            _compute_for(self.sleep_s)
        elif self.kind == "nan_grad":
            self._handles.append(_last_moe_or_parametrized(model).register_forward_hook(_nan_gradient_hook))
        elif self.kind in ("nan_loss", "loss_spike"):
            hook = _nan_output_hook if self.kind == "nan_loss" else _scaled_output_hook
            self._handles.append(_last_parametrized_leaf(model).register_forward_hook(hook))

    def after_backward(self, parameters: list[nn.Parameter], global_step: int, rank: int) -> None:
        """After the step's last backward (before any check): ``bitflip_grad`` when armed."""
        if self.kind != "bitflip_grad" or global_step != self.step or rank != self.rank:
            return
        if self.times != -1 and self._executions > self.times:
            return
        grad = next((local_view(p.grad) for p in parameters if p.grad is not None and local_view(p.grad).numel()), None)
        if grad is not None:
            flat = grad.view(-1)
            bits = flat[:1].view(torch.int32) if flat.dtype == torch.float32 else None
            if bits is None:  # other dtypes: the same effect, a huge finite value
                flat[0] = flat[0] * 2.0**60 + 1.0
            else:
                bits ^= 1 << 30  # the top exponent bit: 1e-3 becomes about 3e35

    def end_execution(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _compute_for(seconds: float) -> None:
    """Busy the CPU for ``seconds``, as a slow device would (a sleep would look like waiting)."""
    end = time.perf_counter() + seconds
    x = torch.ones(64, 64)
    while time.perf_counter() < end:
        x = (x @ x).clamp_(-1, 1)


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's block of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nan_gradient_hook(module: nn.Module, inputs: Any, output: Any) -> None:
    # A tensor hook, not a new output: a module's other hooks (the rerun's attribution) then see the
    # NaN gradient at this module's output.
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(lambda grad: grad * math.nan)


def _nan_output_hook(module: nn.Module, inputs: Any, output: Any) -> Any:
    return output * math.nan if isinstance(output, torch.Tensor) else output


def _scaled_output_hook(module: nn.Module, inputs: Any, output: Any) -> Any:
    return output * -8.0 if isinstance(output, torch.Tensor) else output


def _last_moe_or_parametrized(model: nn.Module) -> nn.Module:
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    return layers[-1] if layers else _last_parametrized_leaf(model)


def _last_parametrized_leaf(model: nn.Module) -> nn.Module:
    leaves = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    if not leaves:
        raise ValueError("health.inject: this rank's model holds no parameters to inject a fault into")
    return leaves[-1]
