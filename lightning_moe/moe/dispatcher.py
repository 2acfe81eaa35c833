"""Dispatchers move routed (token, choice) slots to their experts and combine the outputs back.

:class:`Dispatcher` is what :class:`~lightning_moe.moe.layer.MoELayer` asks of one:
``ctx = dispatcher.dispatch(hidden, topk_idx, keep_mask)`` gives the rows grouped by local expert
(``ctx.expert_input``) and their counts; ``dispatcher.combine(expert_output, topk_weights, ctx)``
returns ``[T, H]``, the gate-weighted sum of each token's kept slots. This module holds that
protocol, the single-device path and the building blocks the expert-parallel dispatchers
(:mod:`lightning_moe.moe.ep_dispatcher`, :mod:`lightning_moe.moe.hierarchical`) share; it imports
none of them (:func:`lightning_moe.moe.dispatchers.build_dispatcher` chooses among them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "CUDA_GROUP_ALIGN",
    "DispatchContext",
    "Dispatcher",
    "LocalDispatcher",
    "OverlappingDispatcher",
    "aligned_total_rows",
    "expert_row_alignment",
    "gather_expert_rows",
    "gather_rows",
    "padded_group_rows",
    "pads_expert_rows",
    "permute_by_expert",
    "permute_to_experts",
    "scatter_expert_rows",
    "sort_slots_by_expert",
    "unpermute_and_combine",
]


@dataclass
class DispatchContext:
    """What ``combine`` needs to undo a ``dispatch``."""

    expert_input: torch.Tensor  # [N, H] rows grouped by local expert, expert 0 first
    tokens_per_local_expert: torch.Tensor  # [E_local] int64, sums to N
    sorted_slots: torch.Tensor  # [N'] flat slot index t * k + j of each permuted row, kept slots only
    num_tokens: int  # T: rows of the combined output
    top_k: int
    # Row of expert_input holding each sorted slot when expert groups are padded (None: row n).
    row_positions: torch.Tensor | None = None


@runtime_checkable
class Dispatcher(Protocol):
    """What :class:`~lightning_moe.moe.layer.MoELayer` calls; ``MoELayer.dispatcher`` holds one.

    - ``dispatch(hidden [T, H], topk_idx [T, k] global expert ids, keep_mask [T, k] bool or None)``:
      the kept slots' rows grouped by local expert, expert 0 first (``ctx.expert_input [N, H]``,
      ``ctx.tokens_per_local_expert [num_local_experts]`` summing to N, padding rows included).
    - ``combine(expert_output [N, H] in the order of ctx.expert_input, topk_weights [T, k] fp32, ctx)``:
      ``[T, H]`` in ``hidden``'s dtype, each token's kept slots' outputs times their gate weights,
      summed; dropped slots add zero. Autograd flows through both, collectives included.
    - ``pad_rows``: how expert groups are padded (:func:`expert_row_alignment`).
    """

    num_experts: int  # experts of the whole layer
    num_local_experts: int  # experts whose rows this rank computes
    pad_rows: bool | int | None

    def dispatch(
        self, hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None
    ) -> DispatchContext: ...

    def combine(self, expert_output: torch.Tensor, topk_weights: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class OverlappingDispatcher(ABC):
    """A :class:`Dispatcher` whose all-to-alls are issued by ``*_start`` and waited for by ``*_finish``.

    ``MoELayer(dispatch_chunks=n)`` computes between the two (another chunk's experts, the shared
    expert); ``dispatch`` and ``combine`` issue and wait at once. ``wire``: what the dispatched rows
    travel as (:mod:`lightning_moe.moe.exchange`); the combine travels in bf16 whenever it is set.
    """

    wire: str | None

    @property
    def combine_wire(self) -> str | None:
        return None if self.wire is None else "bf16"

    @abstractmethod
    def dispatch_start(self, hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None) -> Any:
        """Issue the dispatch; returns what ``dispatch_finish`` waits for."""

    @abstractmethod
    def dispatch_finish(self, pending: Any) -> DispatchContext:
        """Wait for the dispatch issued by ``dispatch_start``."""

    @abstractmethod
    def combine_start(self, expert_output: torch.Tensor, topk_weights: torch.Tensor, ctx: Any) -> Any:
        """Issue the combine; returns what ``combine_finish`` waits for."""

    @abstractmethod
    def combine_finish(self, pending: Any) -> torch.Tensor:
        """Wait for the combine issued by ``combine_start``; ``[T, H]``."""

    def dispatch(self, hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None) -> DispatchContext:
        return self.dispatch_finish(self.dispatch_start(hidden, topk_idx, keep_mask))

    def combine(self, expert_output: torch.Tensor, topk_weights: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.combine_finish(self.combine_start(expert_output, topk_weights, ctx))


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


def gather_rows(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``hidden[index]``, differentiable: the backward adds the row gradients in place into one zero buffer."""
    return _GatherRows.apply(hidden, index)


def sort_slots_by_expert(
    topk_idx: torch.Tensor, keep_mask: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_slots [N], counts [num_experts] int64)``: kept slots grouped by expert, slot order kept.

    One stable argsort of the flat expert ids; dropped slots (``keep_mask`` False) get the sentinel
    id ``num_experts`` so they sort last and are cut off.
    """
    experts = topk_idx.reshape(-1)
    if keep_mask is not None:
        experts = experts.masked_fill(~keep_mask.reshape(-1), num_experts)
    counts = torch.bincount(experts, minlength=num_experts + 1)[:num_experts]
    sorted_slots = torch.argsort(experts, stable=True)
    if keep_mask is not None:
        sorted_slots = sorted_slots[: int(counts.sum())]
    return sorted_slots, counts


def permute_by_expert(
    hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each kept slot's token row, grouped by expert (slot order kept within an expert).

    Returns ``(permuted [N, H], sorted_slots [N], counts [num_experts] int64)``: one
    :func:`sort_slots_by_expert` and one ``index_select``.
    """
    sorted_slots, counts = sort_slots_by_expert(topk_idx, keep_mask, num_experts)
    return gather_rows(hidden, sorted_slots // topk_idx.shape[1]), sorted_slots, counts


# Rows per expert group on CUDA: ``torch._grouped_mm``'s CUTLASS kernels want each group's rows
# aligned (torchtitan pads to 8 rows for bf16, 16 for fp8); 16 covers both, at most 15 rows per group.
CUDA_GROUP_ALIGN = 16


def padded_group_rows(
    counts: torch.Tensor, align: int | None = None, total_rows: int | None = None, num_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(padded_counts [E], positions [N])``: each group's rows rounded up.

    - ``align=None`` (CPU low precision): a group of ``c >= 1`` rows grows to the next multiple of
      ``max(16, 2**(floor(log2 c) - 4))``: it gains fewer than ``max(16, c/16)`` rows, and the sizes
      the expert GEMMs see take about 16 values per power of two (empty groups stay empty).
    - ``align=a`` (CUDA ``_grouped_mm``): every group, empty ones included, grows to a multiple of
      ``a`` rows, at least ``a``; with ``total_rows`` (a multiple of ``a``, at least
      ``aligned_total_rows``) the last group also takes the slack, so the counts sum to exactly
      ``total_rows``, a size known without reading ``counts`` on the host.

    ``num_rows``: ``counts.sum()`` when the caller knows it (no host sync to size the result).
    ``positions[n]`` is the padded row of the n-th real row.
    """
    if align is None:
        bits = torch.log2(counts.clamp(min=1).double()).floor().long()
        step = torch.pow(2, (bits - 4).clamp(min=4))
        padded = (counts + step - 1) // step * step
    else:
        padded = ((counts + align - 1) // align * align).clamp(min=align)
        if total_rows is not None:
            last = total_rows - padded[:-1].sum()
            padded = torch.cat([padded[:-1], last.view(1)])
    group_of_row = torch.repeat_interleave(
        torch.arange(counts.numel(), device=counts.device), counts, output_size=num_rows
    )
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)
    positions = torch.arange(group_of_row.numel(), device=counts.device) + shift[group_of_row]
    return padded, positions


def aligned_total_rows(num_rows: int, num_groups: int, align: int) -> int:
    """A static bound on the rows of ``num_rows`` rows in ``num_groups`` groups padded to ``align``:
    each group gains fewer than ``align`` rows, or ``align`` when empty."""
    return -(-num_rows // align) * align + num_groups * align


def expert_row_alignment(rows: torch.Tensor, pad_rows: bool | int | None) -> int | None:
    """How expert groups are padded: ``None`` (not), ``0`` (coarse CPU sizes) or ``a`` (align to ``a`` rows).

    ``pad_rows``: ``False`` never, an ``int`` aligns to that many rows (also on CPU: tests force
    the CUDA padding there), ``True`` pads in the device's way, ``None`` (default) pads where it
    pays: CPU bf16/fp16 (oneDNN builds a GEMM kernel for every new low-precision shape, and
    dropless routing gives new row counts every step) and CUDA whenever the experts compute in
    bf16 (``torch._grouped_mm`` there wants aligned groups). fp32 on CUDA is not padded: the
    experts take the ``bmm`` fallback (see :class:`~lightning_moe.moe.experts.GroupedExperts`).
    """
    if pad_rows is False:
        return None
    if not isinstance(pad_rows, bool) and isinstance(pad_rows, int):
        return pad_rows
    cuda = rows.device.type == "cuda"
    if pad_rows is True:
        return CUDA_GROUP_ALIGN if cuda else 0
    dtype = torch.get_autocast_dtype(rows.device.type) if torch.is_autocast_enabled(rows.device.type) else rows.dtype
    if cuda:
        return CUDA_GROUP_ALIGN if dtype == torch.bfloat16 else None
    return 0 if rows.dtype in (torch.bfloat16, torch.float16) else None


def pads_expert_rows(rows: torch.Tensor, pad_rows: bool | int | None) -> bool:
    """Whether expert groups get padded rows (:func:`expert_row_alignment` is not None)."""
    return expert_row_alignment(rows, pad_rows) is not None


def gather_expert_rows(
    rows: torch.Tensor, source: torch.Tensor, counts: torch.Tensor, pad_rows: bool | int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``rows[source]`` grouped by expert, each group padded as :func:`expert_row_alignment` says.

    Returns ``(expert_input, counts for the expert GEMMs, positions)``: ``positions[n]`` is the row
    of ``expert_input`` holding ``rows[source[n]]`` (None without padding: row n). Padding rows copy
    row 0 of ``rows``; whoever combines must give them zero weight, so they get zero gradient.
    Aligned padding sizes ``expert_input`` from ``source.numel()`` alone (no host sync).
    """
    positions = None
    align = expert_row_alignment(rows, pad_rows)
    if align is not None and source.numel():
        if align:
            total = aligned_total_rows(source.numel(), counts.numel(), align)
            counts, positions = padded_group_rows(counts, align, total, num_rows=source.numel())
        else:
            counts, positions = padded_group_rows(counts, num_rows=source.numel())
            total = int(counts.sum())  # CPU only: reading a CPU tensor costs no device sync
        source = source.new_zeros(total).index_copy_(0, positions, source)
    return gather_rows(rows, source), counts, positions


def scatter_expert_rows(
    expert_output: torch.Tensor, order: torch.Tensor, positions: torch.Tensor | None
) -> torch.Tensor:
    """Inverse of ``expert_input = rows[order]`` (:func:`gather_expert_rows` with a permutation ``order``).

    Row ``order[n]`` of the result is the expert output at ``positions[n]`` (or ``n``); padding rows
    are left out, and their gradient is zero.
    """
    rows_of = positions if positions is not None else torch.arange(order.numel(), device=order.device)
    return gather_rows(expert_output, torch.empty_like(order).index_copy_(0, order, rows_of))


def permute_to_experts(
    hidden: torch.Tensor,
    topk_idx: torch.Tensor,
    keep_mask: torch.Tensor | None,
    num_experts: int,
    pad_rows: bool | None,
) -> DispatchContext:
    """The context of a dispatch whose experts are all here: kept slots' rows grouped by expert.

    ``topk_idx`` holds ids in ``[0, num_experts)``; groups are padded as :func:`gather_expert_rows`
    decides, and :func:`unpermute_and_combine` undoes it.
    """
    top_k = topk_idx.shape[1]
    sorted_slots, counts = sort_slots_by_expert(topk_idx, keep_mask, num_experts)
    expert_input, counts, positions = gather_expert_rows(hidden, sorted_slots // top_k, counts, pad_rows)
    return DispatchContext(expert_input, counts, sorted_slots, hidden.shape[0], top_k, positions)


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
            grad_weights = torch.linalg.vecdot(grad_per_row, rows).to(weights.dtype)
        return grad_rows, grad_weights, None, None


def unpermute_and_combine(rows: torch.Tensor, topk_weights: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
    """``y [T, H]``: each token's kept slots' rows times their gate weights, summed.

    ``rows`` are in the order of ``ctx.sorted_slots``; dropped slots contribute zero (their weight
    is not renormalised away). The fp32 weights are cast to ``rows.dtype``, the result's dtype.
    """
    weights = topk_weights.reshape(-1).index_select(0, ctx.sorted_slots)
    token_index = ctx.sorted_slots // ctx.top_k
    if ctx.row_positions is not None:
        # Padding rows get weight 0 and token 0: they add exact zeros and receive zero gradient.
        num_rows = rows.shape[0]
        weights = weights.new_zeros(num_rows).index_copy(0, ctx.row_positions, weights)
        token_index = token_index.new_zeros(num_rows).index_copy_(0, ctx.row_positions, token_index)
    return _WeightedScatterAdd.apply(rows, weights, token_index, ctx.num_tokens)


class LocalDispatcher:
    """Single-device dispatcher: a permutation by expert and its weighted inverse.

    ``pad_rows``: round each expert's row count up (:func:`padded_group_rows`) with rows that
    repeat token 0 and are weighted 0 in ``combine``, so the expert GEMMs see few distinct shapes;
    ``None`` (default) pads where new shapes are costly (:func:`pads_expert_rows`: CPU bf16/fp16).

    Example::

        dispatcher = LocalDispatcher(num_experts=8)
        ctx = dispatcher.dispatch(x, topk_idx, keep_mask=None)
        y = dispatcher.combine(experts(ctx.expert_input, ctx.tokens_per_local_expert), topk_weights, ctx)
    """

    def __init__(self, num_experts: int, pad_rows: bool | None = None) -> None:
        self.num_experts = num_experts
        self.num_local_experts = num_experts
        self.pad_rows = pad_rows

    def dispatch(self, hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None) -> DispatchContext:
        return permute_to_experts(hidden, topk_idx, keep_mask, self.num_experts, self.pad_rows)

    def combine(self, expert_output: torch.Tensor, topk_weights: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        return unpermute_and_combine(expert_output, topk_weights, ctx)
