"""Packed documents on every layout: a batch's ``document_ids`` reach the attention and the MoE layers.

The attention mode of the step (document-causal SDPA on one cp rank, ring or all-to-all attention
under cp) masks by the ids of this rank's sequence shard; the MoE layers (``seq_aux_loss`` per
document, routing-replay keys) get the ids of the tokens they see, which under tensor parallelism
is this tp rank's contiguous slice of that shard (sequence parallel: the tp ranks split the tokens
the MoE layers route). A pipeline stage receives each micro-batch's ids with its inputs and hands
them on through :func:`take_document_ids`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lightning_moe.cp.documents import check_document_ids, set_document_ids
from lightning_moe.moe.documents import routing_documents, set_routing_documents

__all__ = ["batch_document_ids", "packed_documents", "take_document_ids"]

# (tp rank, tp size) of the innermost packed_documents context: how a stage slices later micro-batches' ids.
_TP_SLICES: list[tuple[int, int]] = []


def batch_document_ids(batch: Any) -> torch.Tensor | None:
    """The ``document_ids`` of a dict batch, checked against its ``input_ids`` (None when it has none)."""
    if not isinstance(batch, Mapping) or batch.get("document_ids") is None:
        return None
    documents = batch["document_ids"]
    inputs = batch.get("input_ids")
    check_document_ids(documents, inputs.shape if isinstance(inputs, torch.Tensor) else None)
    return documents


def _tokens_routed_here(document_ids: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    if tp == 1:
        return document_ids
    if document_ids.shape[1] % tp:
        raise ValueError(f"document_ids of {document_ids.shape[1]} tokens per row cannot be split over tp={tp}")
    return document_ids.chunk(tp, dim=1)[tp_rank]


@contextlib.contextmanager
def packed_documents(
    attention_mode: contextlib.AbstractContextManager, document_ids: torch.Tensor | None, tp_rank: int = 0, tp: int = 1
) -> Iterator[None]:
    """``attention_mode`` (which already holds ``document_ids``) and, while it is active, the MoE layers'
    view of the same documents."""
    routed = None if document_ids is None else _tokens_routed_here(document_ids, tp_rank, tp)
    _TP_SLICES.append((tp_rank, tp))
    try:
        with attention_mode, routing_documents(routed):
            yield
    finally:
        _TP_SLICES.pop()


def take_document_ids(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook (``with_kwargs=True``) for pipeline stages: the micro-batch's ``document_ids``,
    passed among the stage's inputs, go to the attention mode and the MoE layers instead."""
    if "document_ids" not in kwargs:
        return args, kwargs
    kwargs = dict(kwargs)
    documents = kwargs.pop("document_ids")
    if not _TP_SLICES or not set_document_ids(documents):
        raise RuntimeError(
            "document_ids reached a pipeline stage outside the strategy's step (no attention mode active)"
        )
    set_routing_documents(_tokens_routed_here(documents, *_TP_SLICES[-1]))
    return args, kwargs
