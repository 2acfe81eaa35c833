"""All-to-all context parallelism (DeepSpeed Ulysses; Megatron's ``cp_comm_type="a2a"``).

Under context parallelism each cp rank holds its part of the sequence (``[B, H, S/cp, D]`` after the
projections, in a layout of :mod:`lightning_moe.cp.sharding`). Ulysses trades the sequence split for
a head split: one all-to-all over the cp group turns the sequence shards of Q, K and V into head
shards (``[B, H/cp, S, D]``: the whole sequence for ``H/cp`` heads), attention runs on the full
sequence with any kernel and any mask (document masks included), and a second all-to-all turns the
output back into sequence shards. Each rank sends ``(cp - 1) / cp`` of its Q, K, V and output per
attention call (:func:`~lightning_moe.layout.ulysses_bytes_per_rank`, with the head rule, in the layout
module, which the planner shares), the same again in the backward, independently of
how the attention is masked; the ring (:func:`~lightning_moe.cp.ring_attention`) instead sends
K/V ``cp - 1`` times but overlaps it with compute and has no head-count limit.

Heads:

- the query heads must divide by cp (each rank takes ``Hq / cp`` of them), else ``ValueError``;
- grouped-query attention: query head ``h`` uses K/V head ``h // (Hq / Hkv)`` (SDPA's
  ``enable_gqa``). Rank ``r`` takes query heads ``[r Hq/cp, (r+1) Hq/cp)`` and K/V heads
  ``[r Hkv'/cp, (r+1) Hkv'/cp)``, which are exactly the K/V heads of its query heads when
  ``Hkv' % cp == 0``. When ``Hkv`` is not a multiple of cp (fewer K/V heads than cp ranks, say),
  each K/V head is first repeated ``e = cp / gcd(Hkv, cp)`` times in place (``repeat_interleave``
  along the heads, :func:`ulysses_kv_heads` gives ``Hkv' = e Hkv``); ``e`` always divides the group
  size ``Hq / Hkv``, so query head ``h`` still meets (a copy of) its K/V head, and the gradient of
  the copies is summed back into the original head by autograd.

Example::

    q, k, v = (zigzag_shard(t, cp_rank, cp, dim=2) for t in (Q, K, V))
    out = ulysses_attention(q, k, v, cp_group)          # == zigzag_shard(SDPA(Q, K, V, is_causal=True), ...)
    with all_to_all_attention(cp_group):                # or: any module calling SDPA
        y = model(zigzag_shard(x, cp_rank, cp))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.cp.documents import DocumentAttentionMode, SequenceShardedAttentionMode, check_document_ids
from lightning_moe.cp.sharding import LAYOUTS, Layout, shard_sequence
from lightning_moe.layout import ulysses_bytes_per_rank, ulysses_heads_problem, ulysses_kv_heads

__all__ = [
    "UlyssesAttentionMode",
    "all_to_all_attention",
    "ulysses_attention",
    "ulysses_bytes_per_rank",
    "ulysses_kv_heads",
]


# --------------------------------------------------------------------------------------------------
# The exchange


def _exchange(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``all_to_all_single`` of equal blocks along dim 0 (block ``s`` to rank ``s``, block ``s`` from it).

    Called through the module attribute, so that :func:`~lightning_moe.callbacks.count_collectives`
    charges it to the group's dim (``"cp"`` for the strategy's cp group), as the ring's P2P.
    """
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """The equal-block all-to-all; it is its own inverse, so the backward sends the gradient back the same way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _exchange(grad, ctx.group), None


def _gathered_positions(seq_len: int, cp: int, layout: str, device: torch.device) -> Tensor | None:
    """Global positions of the tokens in source-rank order (rank 0's shard, rank 1's, ...); None if natural."""
    if layout == "contiguous":
        return None
    positions = torch.arange(seq_len, device=device)
    return torch.cat([shard_sequence(positions, rank, cp, dim=0, layout=layout) for rank in range(cp)])


def _heads_to_full_sequence(
    tensors: list[Tensor], group: dist.ProcessGroup | None, cp: int, order: Tensor | None
) -> list[Tensor]:
    """Sequence shards ``[B, H_i, S/cp, D_i]`` -> head shards ``[B, H_i/cp, S, D_i]`` in natural order.

    One all-to-all for all the tensors: each rank's block is the flat concatenation of their parts."""
    blocks = [t.unflatten(1, (cp, -1)).transpose(0, 1).reshape(cp, -1) for t in tensors]  # [cp, B*H/cp*S_l*D]
    received = _AllToAll.apply(torch.cat(blocks, dim=1), group)  # block s: rank s's tokens of my heads
    out = []
    for t, part in zip(tensors, received.split([b.shape[1] for b in blocks], dim=1)):
        batch, heads, seq_local, dim = t.shape
        full = (
            part.view(cp, batch, heads // cp, seq_local, dim)
            .permute(1, 2, 0, 3, 4)
            .reshape(batch, heads // cp, cp * seq_local, dim)
        )
        out.append(full if order is None else full.index_select(2, order))
    return out


def _full_sequence_to_heads(out: Tensor, group: dist.ProcessGroup | None, cp: int, positions: Tensor | None) -> Tensor:
    """Head shard ``[B, H/cp, S, D]`` in natural order -> this rank's sequence shard ``[B, H, S/cp, D]``."""
    if positions is not None:
        out = out.index_select(2, positions)  # source-rank order
    batch, heads, seq, dim = out.shape
    blocks = out.unflatten(2, (cp, seq // cp)).permute(2, 0, 1, 3, 4)  # [cp, B, H/cp, S_l, D], any strides
    received = _AllToAll.apply(blocks, group)  # block s: my tokens of rank s's heads
    return received.transpose(0, 1).reshape(batch, heads * cp, seq // cp, dim)


def _gather_documents(document_ids: Tensor, group: dist.ProcessGroup | None, layout: str) -> Tensor:
    """Every rank's local ``[B, S/cp]`` document ids -> the full ``[B, S]`` in sequence order (one all-gather)."""
    cp = dist.get_world_size(group)
    local = document_ids.to(torch.int64).contiguous()
    if cp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local, group=group)
    gathered = torch.cat(parts, dim=1)
    positions = _gathered_positions(gathered.shape[1], cp, layout, gathered.device)
    return gathered if positions is None else gathered.index_select(1, torch.argsort(positions))


# --------------------------------------------------------------------------------------------------
# Attention


def _check(q: Tensor, k: Tensor, v: Tensor, cp: int, layout: str, enable_gqa: bool) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}; choose one of {LAYOUTS}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        raise ValueError(f"ulysses_attention expects [batch, heads, seq, head_dim] tensors, got {shapes}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: batch, local sequence and heads must agree"
            " (and q, k one head_dim)"
        )
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(
            f"{q.shape[1]} query heads but {k.shape[1]} key/value heads; pass enable_gqa=True as SDPA requires"
        )
    problem = ulysses_heads_problem(q.shape[1], k.shape[1], cp)
    if problem:
        raise ValueError(problem)
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"zigzag local sequence length {q.shape[2]} is odd: each rank holds two equal chunks")


def _attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, documents: Tensor | None) -> Tensor:
    """Attention on the full sequence of this rank's heads."""
    gqa = q.shape[1] != k.shape[1]
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    # The one-process document mask: a flex-attention block mask on CUDA, a dense boolean one on CPU.
    with DocumentAttentionMode(documents):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def _ulysses(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    causal: bool,
    layout: str,
    scale: float | None,
    documents: Tensor | None,
) -> Tensor:
    """:func:`ulysses_attention` after the checks, with the full-sequence ``documents`` (or None)."""
    cp = dist.get_world_size(group)
    if torch.is_autocast_enabled(q.device.type):
        # SDPA would cast to the autocast dtype anyway; casting first halves the bytes exchanged.
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if not q.dtype == k.dtype == v.dtype:  # one exchange carries all three
        raise ValueError(f"q, k and v must share one dtype (as SDPA requires), got {q.dtype}, {k.dtype}, {v.dtype}")
    repeats = ulysses_kv_heads(q.shape[1], k.shape[1], cp) // k.shape[1]
    if repeats > 1:  # whole K/V heads per rank; autograd sums the copies' gradients back
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    if cp == 1:
        return _attend(q, k, v, causal, scale, documents)
    positions = _gathered_positions(q.shape[2] * cp, cp, layout, q.device)
    order = None if positions is None else torch.argsort(positions)
    q, k, v = _heads_to_full_sequence([q, k, v], group, cp, order)
    out = _attend(q, k, v, causal, scale, documents)
    return _full_sequence_to_heads(out, group, cp, positions)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool = True,
    layout: Layout = "zigzag",
    scale: float | None = None,
    enable_gqa: bool = False,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Attention of this rank's part of the sequence over the whole sequence, by head-sharding all-to-alls.

    ``q`` is ``[batch, heads, seq_local, head_dim]``, ``k`` and ``v`` ``[batch, kv_heads, seq_local,
    head_dim]`` (``v`` may have its own head_dim), this rank's part of the sequence in ``layout``
    (:func:`~lightning_moe.cp.zigzag_shard`). Returns this rank's part of
    ``F.scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale, enable_gqa=enable_gqa)``
    on the full sequence; gradients flow to ``q``, ``k`` and ``v``. ``heads`` must divide by the cp
    size (``ValueError`` before any communication); K/V heads are repeated to a multiple of cp as the
    module docstring describes. ``document_ids``: this rank's ``[batch, seq_local]`` document ids
    (same layout): the attention is then document-causal (:mod:`lightning_moe.cp.documents`); they
    are all-gathered over ``group`` on every call (:class:`UlyssesAttentionMode` gathers them once
    per micro-batch). ``group=None`` is the default process group.

    Example::

        q, k, v = (zigzag_shard(t, cp_rank, cp, dim=2) for t in (Q, K, V))
        out = ulysses_attention(q, k, v, cp_group, enable_gqa=True)
    """
    cp = dist.get_world_size(group)
    _check(q, k, v, cp, layout, enable_gqa)
    documents = None
    if document_ids is not None:
        if not causal:
            raise ValueError("document_ids make attention document-causal: pass causal=True, or no document_ids")
        check_document_ids(document_ids, (q.shape[0], q.shape[2]))
        documents = _gather_documents(document_ids.to(q.device), group, layout)
        check_document_ids(documents)
    return _ulysses(q, k, v, group, causal, layout, scale, documents)


# --------------------------------------------------------------------------------------------------
# Routing SDPA


class UlyssesAttentionMode(SequenceShardedAttentionMode):
    """Make ``F.scaled_dot_product_attention`` all-to-all (Ulysses) attention over ``group`` while active.

    The inputs must already be this rank's part of the sequence in ``layout``. Causal calls
    (``is_causal=True``) and full ones (no mask) become :func:`ulysses_attention`; with
    ``document_ids`` (this rank's ``[batch, seq_local]``; :meth:`set_document_ids` per micro-batch)
    the causal ones are document-causal, the non-causal ones pass the documents by (as
    :class:`~lightning_moe.cp.documents.DocumentAttentionMode` does). The documents are all-gathered
    over ``group`` at the first attention call after they were set and reused by the later layers.
    Under cp > 1 an explicit ``attn_mask`` or ``dropout_p > 0`` raises ``NotImplementedError`` (no
    rank holds the full sequence of the mask's rows, and dropout would need the one-process RNG
    stream). A cp group of size 1 leaves SDPA untouched (document-causal when documents are set).

    Example::

        with UlyssesAttentionMode(mesh.get_group("cp")) as mode:
            mode.set_document_ids(zigzag_shard(document_ids, cp_rank, cp))
            loss = model(zigzag_shard(input_ids, cp_rank, cp)).sum()   # model calls SDPA
        loss.backward()
    """

    communication = "all-to-all context parallelism"

    def __init__(
        self, group: dist.ProcessGroup | None, layout: Layout = "zigzag", document_ids: Tensor | None = None
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown context-parallel layout {layout!r}; choose one of {LAYOUTS}")
        self._documents: Tensor | None = None  # the full-sequence ids, gathered at first use
        super().__init__(group, document_ids)
        self.layout = layout

    def set_document_ids(self, document_ids: Tensor | None) -> None:
        """This rank's ``[batch, seq_local]`` document ids for the next attention calls (None: plain causal)."""
        super().set_document_ids(document_ids)
        self._documents = None

    def _full_documents(self, device: torch.device) -> Tensor:
        assert self.document_ids is not None
        if self._documents is None:
            self._documents = _gather_documents(self.document_ids.to(device), self.group, self.layout)
            check_document_ids(self._documents)
        return self._documents.to(device)

    def sharded_attention(self, call: dict[str, Any], where: str) -> Tensor:
        q, k, v = call["query"], call["key"], call["value"]
        _check(q, k, v, self.cp_size, self.layout, call["enable_gqa"])
        documents = None
        if call["is_causal"] and self.document_ids is not None:
            if tuple(self.document_ids.shape) != (q.shape[0], q.shape[2]):
                raise ValueError(
                    f"document_ids of shape {tuple(self.document_ids.shape)} do not match this rank's queries"
                    f" {tuple(q.shape)}: one id per local token"
                )
            documents = self._full_documents(q.device)
        return _ulysses(q, k, v, self.group, call["is_causal"], self.layout, call["scale"], documents)


def all_to_all_attention(
    group: dist.ProcessGroup | None, layout: Layout = "zigzag", document_ids: Tensor | None = None
) -> UlyssesAttentionMode:
    """A context manager routing SDPA to all-to-all attention over ``group`` (see :class:`UlyssesAttentionMode`).

    Example::

        with all_to_all_attention(cp_group):
            out = attention_module(x_local)
    """
    return UlyssesAttentionMode(group, layout, document_ids)
