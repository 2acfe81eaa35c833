"""Which module first went non-finite on this rank: the hooks a rerun of a faulty step runs under.

The checks of every step look at the loss and the gradients only (cheap); when a step is rerun, a
:class:`NonFiniteWatch` looks at every module's output in forward and at the gradient reaching it in
backward, and keeps the first non-finite one with its wall-clock time. Across ranks, the earliest
event is where the fault started: a NaN reaches another rank only through a collective, after it
appeared on its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

__all__ = ["NonFiniteEvent", "NonFiniteWatch", "first_event"]


@dataclass
class NonFiniteEvent:
    """The first non-finite value a rank saw: ``where`` is ``"output"`` (a module's forward output),
    ``"gradient"`` (the gradient reaching a module's output), ``"loss"`` or ``"parameter gradient"``."""

    rank: int
    module: str
    where: str
    time: float

    def describe(self) -> str:
        return f"rank {self.rank}, the {self.where} of {self.module}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _non_finite(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.is_floating_point() and not bool(torch.isfinite(local).all())


class NonFiniteWatch:
    """Record the first module of ``model`` whose output or output gradient is non-finite on this rank.

    Example::

        with NonFiniteWatch(model, rank=0) as watch:
            model(batch).sum().backward()
        watch.event   # NonFiniteEvent(rank=0, module="layers.1.moe", where="gradient", ...) or None
    """

    def __init__(self, model: nn.Module, rank: int) -> None:
        self.model = model
        self.rank = rank
        self.event: NonFiniteEvent | None = None
        self._handles: list[RemovableHandle] = []

    def record(self, module: str, where: str) -> None:
        if self.event is None:
            self.event = NonFiniteEvent(self.rank, module, where, time.time())

    def __enter__(self) -> NonFiniteWatch:
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._forward_hook(name or type(module).__name__)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _forward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            for tensor in _tensors(output):
                if _non_finite(tensor):
                    self.record(name, "output")
                    break
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._gradient_hook(name))

        return hook

    def _gradient_hook(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if _non_finite(grad):
                self.record(name, "gradient")

        return hook

    def check_parameter_gradients(self) -> None:
        """After backward: a parameter gradient that is non-finite although nothing upstream was."""
        if self.event is not None:
            return
        for name, param in self.model.named_parameters():
            if param.grad is not None and _non_finite(param.grad):
                self.record(name, "parameter gradient")
                return


def first_event(events: list[dict[str, Any] | None]) -> NonFiniteEvent | None:
    """The earliest of the ranks' events (gathered as dicts), None when no rank saw one."""
    seen = [NonFiniteEvent(**e) for e in events if e is not None]
    return min(seen, key=lambda e: e.time) if seen else None
