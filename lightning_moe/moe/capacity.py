"""Expert capacity: how many (token, choice) slots each expert accepts, and which slots it keeps."""

from __future__ import annotations

import math

import torch

__all__ = ["DROP_POLICIES", "capacity_keep_mask", "expert_capacity"]

DROP_POLICIES: tuple[str, ...] = ("probs", "position")


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """``ceil(num_tokens * top_k / num_experts * capacity_factor)`` slots per expert."""
    # Rounded first so that e.g. 10 * 2 / 4 * 1.2 = 6.000000000000001 gives 6, not 7.
    return math.ceil(round(num_tokens * top_k / num_experts * capacity_factor, 6))


@torch.no_grad()
def capacity_keep_mask(
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    capacity: int,
    drop_policy: str = "probs",
) -> torch.Tensor:
    """Which slots each expert keeps when it accepts at most ``capacity`` of them.

    ``topk_idx``/``topk_weights``: ``[T, k]`` chosen experts and gate weights. Returns a bool
    ``[T, k]`` mask (False = dropped). ``"probs"`` keeps, per expert, the slots with the highest
    gate weight (ties: earlier token first); ``"position"`` keeps the earliest tokens.

    Example::

        keep = capacity_keep_mask(topk_idx, topk_weights, num_experts=8, capacity=3)
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy={drop_policy!r} is unknown: choose one of {DROP_POLICIES}")
    experts = topk_idx.reshape(-1)
    if drop_policy == "probs":
        by_weight = torch.argsort(topk_weights.reshape(-1), descending=True, stable=True)
        order = by_weight[torch.argsort(experts[by_weight], stable=True)]
    else:
        # Slots are token-major (t * k + j), so a stable sort by expert keeps token order.
        order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    sorted_experts = experts[order]
    rank_in_expert = torch.arange(experts.numel(), device=experts.device) - starts[sorted_experts]
    keep = torch.empty_like(experts, dtype=torch.bool)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(topk_idx)
