"""Gradient-norm clipping over parameters that live on different meshes (dense vs expert view)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model whose DTensor parameters sit on several meshes.

    Gradients are grouped by mesh and placements; each group's norm is reduced over its own mesh,
    then the groups combine. Returns the total norm (a plain tensor, identical on every rank).

    Example::

        total = clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for param in parameters:
        if param.grad is not None:
            grad = param.grad
            groups[(grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None].append(param)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type=norm_type)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
