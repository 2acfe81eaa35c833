"""Route ``F.scaled_dot_product_attention`` to :func:`ring_attention` without touching the model.

Inside :class:`RingAttentionMode` every call of ``torch.nn.functional.scaled_dot_product_attention``
(from any module, with the sequence already sharded over the cp group) becomes a ring attention call,
so a model written for one process runs under context parallelism unchanged. With ``document_ids``
(packed rows) the causal calls become document-causal ring attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_moe.cp.documents import SequenceShardedAttentionMode
from lightning_moe.cp.ring_attention import DOCUMENT_TILE, DocumentPlan, document_plan, ring_attention
from lightning_moe.cp.sharding import LAYOUTS, Layout


class RingAttentionMode(SequenceShardedAttentionMode):
    """Make ``F.scaled_dot_product_attention`` ring attention over ``group`` while active.

    The inputs must already be this rank's part of the sequence in ``layout`` (the strategy shards
    the batch); ``head_chunks`` is passed to :func:`ring_attention`. A cp group of size 1 leaves
    SDPA untouched. Under cp > 1 an explicit ``attn_mask`` or ``dropout_p > 0`` raises
    ``NotImplementedError``: a dense mask over the full sequence does not exist on any rank, and
    dropout would need one RNG stream across the ring.

    ``document_ids``: this rank's ``[batch, seq_local]`` ids of packed documents, sharded like the
    sequence (``zigzag_shard(document_ids, cp_rank, cp_size)``). While set, causal calls
    (``is_causal=True``) are document-causal ring attention: the ids are all-gathered over
    ``group`` at the first such call and the plan of what each rank computes
    (:func:`~lightning_moe.cp.ring_attention.document_plan`, with ``document_tile``) is reused by
    every later layer; non-causal calls pass the documents by (as
    :class:`~lightning_moe.cp.documents.DocumentAttentionMode` does); an explicit ``attn_mask``
    raises ``ValueError``; ids whose shape is not the queries' ``[batch, seq_local]`` raise
    ``ValueError`` before any communication. :meth:`set_document_ids` replaces them for the next
    micro-batch without leaving the mode (None: plain causal attention again);
    :func:`lightning_moe.cp.documents.set_document_ids` reaches the innermost active mode. On a cp
    group of size 1 the documents mask as in ``DocumentAttentionMode``.

    Example::

        with RingAttentionMode(mesh.get_group("cp")):
            loss = model(zigzag_shard(input_ids, cp_rank, cp_size)).sum()   # model calls SDPA
        loss.backward()

        with RingAttentionMode(cp_group) as mode:                 # packed documents, one per micro-batch
            for batch in micro_batches:
                mode.set_document_ids(zigzag_shard(batch["document_ids"], cp_rank, cp_size))
                model(zigzag_shard(batch["input_ids"], cp_rank, cp_size)).sum().backward()
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        layout: Layout = "zigzag",
        head_chunks: int = 1,
        document_ids: torch.Tensor | None = None,
        *,
        document_tile: int = DOCUMENT_TILE,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown context-parallel layout {layout!r}; choose one of {LAYOUTS}")
        if isinstance(document_tile, bool) or not isinstance(document_tile, int) or document_tile < 1:
            raise ValueError(f"document_tile must be a positive number of tokens, got {document_tile!r}")
        super().__init__(group, document_ids)
        self.layout = layout
        self.head_chunks = head_chunks
        self.document_tile = document_tile
        # Plans for self.document_ids by (device, batch, seq_local); rebuilt when the ids change.
        self._plans: dict[tuple, DocumentPlan] = {}
        self._plans_for: torch.Tensor | None = None

    def _document_plan(self, q: torch.Tensor) -> DocumentPlan:
        documents = self.document_ids
        assert documents is not None
        if self._plans_for is not documents:
            self._plans, self._plans_for = {}, documents
        key = (q.device, q.shape[0], q.shape[2])
        plan = self._plans.get(key)
        if plan is None:
            if tuple(documents.shape) != (q.shape[0], q.shape[2]):
                raise ValueError(
                    f"document_ids of shape {tuple(documents.shape)} do not match this rank's queries {tuple(q.shape)}"
                    f" ([batch, heads, seq_local, head_dim]): pass this rank's shard of the ids, one per local token"
                    " (e.g. zigzag_shard(document_ids, cp_rank, cp_size))"
                )
            plan = self._plans[key] = document_plan(
                documents.to(q.device), self.group, self.layout, document_tile=self.document_tile
            )
        return plan

    def sharded_attention(self, call: dict[str, Any], where: str) -> torch.Tensor:
        q, k, v = call["query"], call["key"], call["value"]
        if q.dim() != 4:
            raise ValueError(f"{where} needs [batch, heads, seq, head_dim] inputs, got query of shape {tuple(q.shape)}")
        if k.shape[1] != q.shape[1] and not call["enable_gqa"]:
            raise ValueError(
                f"{where}: {q.shape[1]} query heads but {k.shape[1]} key/value heads; pass enable_gqa=True as SDPA requires"
            )
        if self.document_ids is not None and call["is_causal"]:
            return ring_attention(
                q,
                k,
                v,
                self.group,
                causal=True,
                layout=self.layout,
                scale=call["scale"],
                head_chunks=self.head_chunks,
                document_ids=self._document_plan(q),
            )
        return ring_attention(
            q,
            k,
            v,
            self.group,
            causal=call["is_causal"],
            layout=self.layout,
            scale=call["scale"],
            head_chunks=self.head_chunks,
        )


def context_parallel_attention(
    group: dist.ProcessGroup | None,
    layout: Layout = "zigzag",
    head_chunks: int = 1,
    document_ids: torch.Tensor | None = None,
    *,
    document_tile: int = DOCUMENT_TILE,
) -> RingAttentionMode:
    """A context manager routing SDPA to ring attention over ``group`` (see :class:`RingAttentionMode`).

    ``head_chunks``: ring passes per attention call, each over an equal share of the K/V heads
    (less memory in flight, more P2P messages; see :func:`ring_attention`). ``document_ids``: this
    rank's ``[batch, seq_local]`` ids of packed documents (causal calls become document-causal);
    ``document_tile``: the largest masked tile that packs documents shorter than it.

    Example::

        with context_parallel_attention(cp_group):
            out = attention_module(x_local)
        with context_parallel_attention(cp_group, document_ids=zigzag_shard(ids, cp_rank, cp_size)):
            out = attention_module(x_local)
    """
    return RingAttentionMode(group, layout, head_chunks, document_ids, document_tile=document_tile)
