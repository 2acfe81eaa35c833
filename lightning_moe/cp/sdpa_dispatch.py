"""Route ``F.scaled_dot_product_attention`` to :func:`ring_attention` without touching the model.

Inside :class:`RingAttentionMode` every call of ``torch.nn.functional.scaled_dot_product_attention``
(from any module, with the sequence already sharded over the cp group) becomes a ring attention call,
so a model written for one process runs under context parallelism unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_moe.cp.ring_attention import ring_attention
from lightning_moe.cp.sharding import Layout


def _sdpa_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> dict[str, Any]:
    """Bind SDPA's positional/keyword arguments to names (same signature as the torch function)."""
    return dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


class RingAttentionMode(TorchFunctionMode):
    """Make ``F.scaled_dot_product_attention`` ring attention over ``group`` while active.

    The inputs must already be this rank's part of the sequence in ``layout`` (the strategy shards
    the batch); ``head_chunks`` is passed to :func:`ring_attention`. A cp group of size 1 leaves
    SDPA untouched. Under cp > 1 an explicit ``attn_mask`` or ``dropout_p > 0`` raises
    ``NotImplementedError``: a dense mask over the full sequence does not exist on any rank, and
    dropout would need one RNG stream across the ring.

    Example::

        with RingAttentionMode(mesh.get_group("cp")):
            loss = model(zigzag_shard(input_ids, cp_rank, cp_size)).sum()   # model calls SDPA
        loss.backward()
    """

    def __init__(self, group: dist.ProcessGroup | None, layout: Layout = "zigzag", head_chunks: int = 1) -> None:
        super().__init__()
        self.group = group
        self.layout = layout
        self.head_chunks = head_chunks
        self.cp_size = dist.get_world_size(group)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.cp_size == 1:
            return func(*args, **kwargs)
        call = _sdpa_arguments(*args, **kwargs)
        q, k, v = call["query"], call["key"], call["value"]
        where = f"scaled_dot_product_attention under context parallelism (cp = {self.cp_size})"
        if call["attn_mask"] is not None:
            raise NotImplementedError(f"{where} does not support attn_mask; use is_causal=True for causal attention")
        if call["dropout_p"] > 0.0:
            raise NotImplementedError(f"{where} does not support dropout_p={call['dropout_p']}; set attention dropout to 0")
        if q.dim() != 4:
            raise ValueError(f"{where} needs [batch, heads, seq, head_dim] inputs, got query of shape {tuple(q.shape)}")
        if k.shape[1] != q.shape[1] and not call["enable_gqa"]:
            raise ValueError(
                f"{where}: {q.shape[1]} query heads but {k.shape[1]} key/value heads; pass enable_gqa=True as SDPA requires"
            )
        return ring_attention(
            q, k, v, self.group, causal=call["is_causal"], layout=self.layout, scale=call["scale"],
            head_chunks=self.head_chunks,
        )


def context_parallel_attention(
    group: dist.ProcessGroup | None, layout: Layout = "zigzag", head_chunks: int = 1
) -> RingAttentionMode:
    """A context manager routing SDPA to ring attention over ``group`` (see :class:`RingAttentionMode`).

    ``head_chunks``: ring passes per attention call, each over an equal share of the K/V heads
    (less memory in flight, more P2P messages; see :func:`ring_attention`).

    Example::

        with context_parallel_attention(cp_group):
            out = attention_module(x_local)
    """
    return RingAttentionMode(group, layout, head_chunks)
