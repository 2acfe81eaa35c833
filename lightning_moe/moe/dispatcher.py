"""Dispatchers move routed (token, choice) slots to their experts and combine the outputs back.

See docs/CONTRACTS.md: ``ctx = dispatcher.dispatch(hidden, topk_idx, keep_mask)`` gives the rows
grouped by local expert (``ctx.expert_input``) and their counts; ``dispatcher.combine(expert_output,
topk_weights, ctx)`` returns ``[T, H]``, the gate-weighted sum of each token's kept slots.
This module holds the single-device path and the two building blocks the expert-parallel
dispatchers (:mod:`lightning_moe.moe.ep_dispatcher`) share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DISPATCHERS",
    "DispatchContext",
    "LocalDispatcher",
    "build_dispatcher",
    "permute_by_expert",
    "unpermute_and_combine",
]

DISPATCHERS: tuple[str, ...] = ("alltoall", "allgather")


@dataclass
class DispatchContext:
    """What ``combine`` needs to undo a ``dispatch``."""

    expert_input: torch.Tensor  # [N, H] rows grouped by local expert, expert 0 first
    tokens_per_local_expert: torch.Tensor  # [E_local] int64, sums to N
    sorted_slots: torch.Tensor  # [N'] flat slot index t * k + j of each permuted row, kept slots only
    num_tokens: int  # T: rows of the combined output
    top_k: int


class _GatherRows(torch.autograd.Function):
    """``hidden[index]`` whose backward adds the row gradients in place into one zero buffer."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.num_rows = hidden.shape[0]
        return hidden.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.num_rows, grad.shape[1]).index_add_(0, index, grad), None


def permute_by_expert(
    hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each kept slot's token row, grouped by expert (slot order kept within an expert).

    Returns ``(permuted [N, H], sorted_slots [N], counts [num_experts] int64)``: one stable argsort
    of the flat expert ids and one ``index_select``. Dropped slots (``keep_mask`` False) get the
    sentinel id ``num_experts`` so they sort last and are cut off.
    """
    top_k = topk_idx.shape[1]
    experts = topk_idx.reshape(-1)
    if keep_mask is not None:
        experts = experts.masked_fill(~keep_mask.reshape(-1), num_experts)
    counts = torch.bincount(experts, minlength=num_experts + 1)[:num_experts]
    sorted_slots = torch.argsort(experts, stable=True)
    if keep_mask is not None:
        sorted_slots = sorted_slots[: int(counts.sum())]
    return _GatherRows.apply(hidden, sorted_slots // top_k), sorted_slots, counts


class _WeightedScatterAdd(torch.autograd.Function):
    """``y[token[n]] += weight[n] * rows[n]`` in ``rows.dtype``, with fp32 gate weights.

    Hand-written so that every elementwise product runs in one dtype: autograd of the composed ops
    would multiply bf16 rows by fp32 weights on torch's slow mixed-dtype path. The products are
    rounded to ``rows.dtype`` before the (at most ``top_k``-term) sum, like any bf16 layer output.
    """

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, weights: torch.Tensor, token_index: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        ctx.save_for_backward(rows, weights, token_index)
        weighted = rows * weights.to(rows.dtype).unsqueeze(1)
        return weighted.new_zeros(num_tokens, rows.shape[1]).index_add_(0, token_index, weighted)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        rows, weights, token_index = ctx.saved_tensors
        grad_per_row = grad.to(rows.dtype).index_select(0, token_index)
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_rows = grad_per_row * weights.to(rows.dtype).unsqueeze(1)
        if ctx.needs_input_grad[1]:
            grad_weights = torch.linalg.vecdot(grad_per_row, rows).float()
        return grad_rows, grad_weights, None, None


def unpermute_and_combine(rows: torch.Tensor, topk_weights: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
    """``y [T, H]``: each token's kept slots' rows times their gate weights, summed.

    ``rows`` are in the order of ``ctx.sorted_slots``; dropped slots contribute zero (their weight
    is not renormalised away). The fp32 weights are cast to ``rows.dtype``, the result's dtype.
    """
    weights = topk_weights.reshape(-1).index_select(0, ctx.sorted_slots)
    return _WeightedScatterAdd.apply(rows, weights, ctx.sorted_slots // ctx.top_k, ctx.num_tokens)


class LocalDispatcher:
    """Single-device dispatcher: a permutation by expert and its weighted inverse.

    Example::

        dispatcher = LocalDispatcher(num_experts=8)
        ctx = dispatcher.dispatch(x, topk_idx, keep_mask=None)
        y = dispatcher.combine(experts(ctx.expert_input, ctx.tokens_per_local_expert), topk_weights, ctx)
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.num_local_experts = num_experts

    def dispatch(self, hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None) -> DispatchContext:
        permuted, sorted_slots, counts = permute_by_expert(hidden, topk_idx, keep_mask, self.num_experts)
        return DispatchContext(permuted, counts, sorted_slots, hidden.shape[0], topk_idx.shape[1])

    def combine(self, expert_output: torch.Tensor, topk_weights: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        return unpermute_and_combine(expert_output, topk_weights, ctx)


def build_dispatcher(kind: str, num_experts: int, ep_group: dist.ProcessGroup | None = None) -> Any:
    """The dispatcher for ``kind`` (``"alltoall"`` or ``"allgather"``) over ``ep_group``.

    A :class:`LocalDispatcher` when there is no expert parallelism (group None or of size 1).
    """
    if kind not in DISPATCHERS:
        raise ValueError(f"dispatcher={kind!r} is unknown: choose one of {DISPATCHERS}")
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return LocalDispatcher(num_experts)
    # Imported here: the expert-parallel dispatchers build on this module.
    from lightning_moe.moe.ep_dispatcher import AllGatherDispatcher, AllToAllDispatcher

    cls = AllToAllDispatcher if kind == "alltoall" else AllGatherDispatcher
    return cls(num_experts, ep_group)
