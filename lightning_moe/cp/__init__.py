"""Context parallelism: sequence sharding and exact ring attention (pure torch, no Lightning).

Packed documents (``document_ids``): :func:`document_attention` makes causal SDPA attend within
documents on one process; ring attention takes the same ids under cp.

Example::

    from lightning_moe.cp import ring_attention, zigzag_shard, context_parallel_attention

    q, k, v = (zigzag_shard(t, cp_rank, cp_size, dim=2) for t in (Q, K, V))
    out = ring_attention(q, k, v, cp_group)            # this rank's part of causal attention
    with context_parallel_attention(cp_group):         # or: any module calling SDPA
        y = model(zigzag_shard(x, cp_rank, cp_size))
"""

from lightning_moe.cp.comm import CP_COMM_KINDS, CpComm
from lightning_moe.cp.documents import (
    DocumentAttentionMode,
    check_document_ids,
    document_attention,
    document_causal_mask,
    set_document_ids,
)
from lightning_moe.cp.ring_attention import AttentionTrace, BlockRecord, ring_attention, trace_ring_attention
from lightning_moe.cp.sdpa_dispatch import RingAttentionMode, context_parallel_attention
from lightning_moe.cp.sharding import (
    LAYOUTS,
    Layout,
    check_seq_len,
    chunk_ids,
    contiguous_shard,
    contiguous_unshard,
    num_chunks,
    shard_sequence,
    unshard_sequence,
    zigzag_position_ids,
    zigzag_shard,
    zigzag_unshard,
)
from lightning_moe.cp.ulysses import UlyssesAttentionMode, all_to_all_attention, ulysses_attention

__all__ = [
    "CP_COMM_KINDS",
    "LAYOUTS",
    "AttentionTrace",
    "BlockRecord",
    "CpComm",
    "DocumentAttentionMode",
    "UlyssesAttentionMode",
    "all_to_all_attention",
    "Layout",
    "RingAttentionMode",
    "check_document_ids",
    "check_seq_len",
    "chunk_ids",
    "context_parallel_attention",
    "contiguous_shard",
    "contiguous_unshard",
    "document_attention",
    "document_causal_mask",
    "num_chunks",
    "ring_attention",
    "set_document_ids",
    "shard_sequence",
    "trace_ring_attention",
    "ulysses_attention",
    "unshard_sequence",
    "zigzag_position_ids",
    "zigzag_shard",
    "zigzag_unshard",
]
