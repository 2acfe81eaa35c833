"""Gradient-norm clipping over parameters that live on different meshes (dense vs expert view)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_moe._compat import foreach_mul_

_COUNTED_ELSEWHERE = "_lightning_moe_norm_counted_elsewhere"


def count_norm_elsewhere(param: torch.Tensor) -> None:
    """Leave ``param`` out of :func:`clip_grad_norm_`'s norm (it is still clipped): a copy of a
    parameter that another rank of the combining ``group`` holds and counts, such as the last pipeline
    stage's copy of a tied embedding."""
    setattr(param, _COUNTED_ELSEWHERE, True)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model whose DTensor parameters sit on several meshes.

    Gradients are grouped by mesh and placements; each group's norm is reduced over its own mesh,
    then the groups combine. ``group``: ranks that hold the *other* parameters of the model (the
    pipeline stages, pp): their norms combine too. Parameters marked by :func:`count_norm_elsewhere`
    are clipped but not counted. Returns the total norm (a plain tensor, identical on every rank).

    Example::

        total = clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for param in parameters:
        if param.grad is not None:
            grad = param.grad
            groups[(grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None].append(param)
    if not groups and (group is None or dist.get_world_size(group) == 1):
        return torch.tensor(0.0)
    norms = []
    for members in groups.values():
        counted = [p.grad for p in members if not getattr(p, _COUNTED_ELSEWHERE, False)]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, norm_type=norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type=norm_type) if norms else torch.tensor(0.0)
    if group is not None and dist.get_world_size(group) > 1:
        total = _combine_over(total, norm_type, group)
    _scale_grads(groups.values(), max_norm, total)
    return total


def _scale_grads(groups: Iterable[list[torch.Tensor]], max_norm: float, total: torch.Tensor) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``'s scaling (by ``min(max_norm / (total + 1e-6), 1)``), applied
    to each gradient's local shard: the same numbers, but no DTensor sharding propagation of a foreach op
    over every gradient, which costs about 1.7 s of CPU on the first step of each process and layout."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device_and_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for members in groups:
        for param in members:
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            by_device_and_dtype[(grad.device, grad.dtype)].append(grad)
    for (device, _), grads in by_device_and_dtype.items():
        foreach_mul_(grads, coef.to(device))


def _combine_over(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    """The norm over the parameters of every rank of ``group`` from each rank's own norm."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else norm.device
    norm = norm.detach().to(device=device, dtype=torch.float32).clone()
    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm**norm_type
    dist.all_reduce(powered, group=group)
    return powered ** (1.0 / norm_type)
