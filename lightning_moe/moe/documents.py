"""Packed documents as the MoE layers see them: which document each routed token belongs to.

A packed batch row holds several documents: ``document_ids [B, S]`` (integers, non-decreasing
along a row, equal ids = one document, restarting at 0 in each row) mark them, and the
``position_ids`` restart at 0 at each document start. Two things in :mod:`lightning_moe.moe`
depend on the documents:

- ``load_balancing="seq_aux_loss"`` (DeepSeek-V3's sequence-wise balance loss) takes each
  document as its own sequence: the loss is the mean over the (row, document) pairs of each
  one's Switch loss (:func:`seq_aux_loss_per_document`), not the Switch loss of the whole row.
- Routing record/replay keys a token by (sample, document, position), since the restarted
  positions alone repeat within a row (:func:`lightning_moe.moe.replay.document_sample_key`).

:func:`routing_documents` holds "the document ids of the tokens this rank's MoE layers see" for
the duration of a forward: ``[B, S_seen]`` where ``S_seen`` is the sequence length of the MoE
layers' input on this rank. Under context or sequence parallelism the strategy hands each rank
the ids of its own shard; the ids are those of the whole row (the same id on two ranks is the
same document), which is what makes the statistics add up over the ranks.

Example::

    with routing_documents(batch["document_ids"]):
        logits = model(batch["input_ids"], batch["position_ids"])   # seq_aux_loss per document
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_moe import comm

__all__ = [
    "agreed_documents_per_row",
    "current_routing_documents",
    "document_balance_loss",
    "document_balance_statistics",
    "recompute_with_routing_documents",
    "routing_documents",
    "seq_aux_loss_per_document",
    "set_routing_documents",
]


@dataclass
class _Holder:
    """The mutable value of a :func:`routing_documents` block (so that :func:`set_routing_documents`
    changes what that block's forwards see, whichever context it is called from)."""

    ids: torch.Tensor | None
    # (ids, group, documents per row) of the last agreement, so the layers of one forward agree once.
    agreed: tuple[torch.Tensor, Any, int] | None = None


_ROUTING_DOCUMENTS: ContextVar[_Holder | None] = ContextVar("lightning_moe_routing_documents", default=None)


def _check(document_ids: torch.Tensor | None) -> None:
    """Cheap checks only (no device sync): an integer ``[B, S]`` tensor, or None."""
    if document_ids is None:
        return
    if (
        not isinstance(document_ids, torch.Tensor)
        or document_ids.dim() != 2
        or document_ids.is_floating_point()
        or document_ids.dtype == torch.bool
    ):
        shape = tuple(document_ids.shape) if isinstance(document_ids, torch.Tensor) else type(document_ids).__name__
        raise ValueError(f"routing documents must be an integer [batch, seq] tensor, got {shape}")


@contextlib.contextmanager
def routing_documents(document_ids: torch.Tensor | None) -> Iterator[None]:
    """Within the block, MoE layers take ``document_ids [B, S_seen]`` as the documents of their tokens.

    ``None`` means no documents (each row is one sequence), also inside an outer block.
    """
    _check(document_ids)
    token = _ROUTING_DOCUMENTS.set(_Holder(document_ids))
    try:
        yield
    finally:
        _ROUTING_DOCUMENTS.reset(token)


def set_routing_documents(document_ids: torch.Tensor | None) -> bool:
    """Replace the ids of the innermost active :func:`routing_documents` block; False when none is active.

    For pipeline stages, which receive a new micro-batch's ids between forwards inside one block.
    """
    holder = _ROUTING_DOCUMENTS.get()
    if holder is None:
        return False
    _check(document_ids)
    holder.ids, holder.agreed = document_ids, None
    return True


def current_routing_documents() -> torch.Tensor | None:
    """The ids of the innermost active :func:`routing_documents` block (None outside, or without documents)."""
    holder = _ROUTING_DOCUMENTS.get()
    return None if holder is None else holder.ids


def recompute_with_routing_documents() -> contextlib.AbstractContextManager:
    """For activation checkpointing: a context that, entered when backward recomputes a forward, puts
    back the routing documents active now (the tensor itself: a pipeline stage may have moved on to
    another micro-batch's ids by then). None active now: none then either, whatever block is active
    when backward runs."""
    return routing_documents(current_routing_documents())


def agreed_documents_per_row(
    document_ids: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device | None = None
) -> int:
    """``1 + max(document_ids)`` over every rank of ``group`` (the ranks holding other shards of the same rows).

    One small MAX all-reduce (of two int64 on ``device``, default the ids') and one host sync; the
    layers of one forward share the result when the ids are those of the active
    :func:`routing_documents` block. ``ValueError`` for a negative id.
    """
    holder = _ROUTING_DOCUMENTS.get()
    if holder is not None and holder.agreed is not None:
        ids, agreed_group, count = holder.agreed
        if ids is document_ids and agreed_group is group:
            return count
    with torch.no_grad():
        if document_ids.numel():
            bounds = torch.stack([document_ids.max() + 1, -document_ids.min()]).to(torch.int64)
        else:
            bounds = torch.zeros(2, dtype=torch.int64, device=document_ids.device)
        if device is not None:
            bounds = bounds.to(device)
        comm.all_reduce_(bounds, group, "cp", op=dist.ReduceOp.MAX)
        count, negative_min = bounds.tolist()
    if negative_min > 0:
        raise ValueError(f"routing documents must be ids >= 0 (numbered from 0 in each row), got {-negative_min}")
    if holder is not None and holder.ids is document_ids:
        holder.agreed = (document_ids, group, count)
    return count


def document_balance_statistics(
    probs: torch.Tensor, topk_idx: torch.Tensor, document_ids: torch.Tensor, documents_per_row: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Switch statistics of each (row, document) group: ``(prob_sum [G, E], counts [G, E], tokens [G])``.

    ``probs [B, S, E]`` (fp32), ``topk_idx [B, S, k]``, ``document_ids [B, S]`` (ids in
    ``[0, documents_per_row)``); group ``g = row * documents_per_row + document``, ``G = B *
    documents_per_row``. ``prob_sum`` keeps the gradient of ``probs``; counts and tokens are float.
    """
    batch, seq, num_experts = probs.shape
    top_k = topk_idx.shape[-1]
    num_groups = batch * documents_per_row
    rows = torch.arange(batch, device=probs.device).view(batch, 1) * documents_per_row
    groups = (document_ids.to(device=probs.device, dtype=torch.int64) + rows).reshape(-1)
    prob_sum = probs.new_zeros(num_groups, num_experts).index_add(0, groups, probs.reshape(-1, num_experts))
    with torch.no_grad():
        slots = (groups.view(-1, 1) * num_experts + topk_idx.reshape(-1, top_k).to(torch.int64)).reshape(-1)
        counts = torch.bincount(slots, minlength=num_groups * num_experts).view(num_groups, num_experts).float()
        tokens = torch.bincount(groups, minlength=num_groups).float()
    return prob_sum, counts, tokens


def document_balance_loss(
    prob_sum: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor, top_k: int, coeff: float
) -> torch.Tensor:
    """``coeff * E * mean_g(sum_i f_gi * P_gi)`` over the groups ``g`` holding at least one token.

    ``f_gi = counts_gi / (tokens_g * top_k)``, ``P_gi = prob_sum_gi / tokens_g``: each group's
    Switch loss (:func:`~lightning_moe.moe.losses.load_balancing_loss` of one sequence), averaged
    over the non-empty groups. ``prob_sum`` may be a rank's partial sum (the loss is linear in it).
    """
    num_experts = prob_sum.shape[-1]
    present = tokens > 0
    safe = torch.where(present, tokens, torch.ones_like(tokens)).unsqueeze(-1)
    per_group = ((counts / (safe * top_k)) * (prob_sum / safe)).sum(-1)
    return coeff * num_experts * per_group.sum() / present.sum().clamp_min(1)


def seq_aux_loss_per_document(
    probs: torch.Tensor, topk_idx: torch.Tensor, document_ids: torch.Tensor, coeff: float
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss with each packed document as its own sequence.

    ``probs [B, S, E]``, ``topk_idx [B, S, k]``, ``document_ids [B, S]`` (ids >= 0, equal ids in a row:
    one document). The Switch loss of each (row, document) pair, averaged over the pairs: with one
    document per row it is :func:`~lightning_moe.moe.losses.seq_aux_loss`. What ``MoELayer`` computes
    for ``load_balancing="seq_aux_loss"`` inside :func:`routing_documents`.
    """
    if tuple(document_ids.shape) != tuple(probs.shape[:2]):
        raise ValueError(
            f"document_ids of shape {tuple(document_ids.shape)} do not match probs' [batch, seq] = {tuple(probs.shape[:2])}"
        )
    if document_ids.numel() and int(document_ids.min()) < 0:
        raise ValueError(f"document_ids must be >= 0, got {int(document_ids.min())}")
    documents_per_row = int(document_ids.max()) + 1 if document_ids.numel() else 0
    prob_sum, counts, tokens = document_balance_statistics(probs, topk_idx, document_ids, documents_per_row)
    return document_balance_loss(prob_sum, counts, tokens, topk_idx.shape[-1], coeff)
