"""Ring attention: exact attention over a sequence sharded across a context-parallel group.

Each rank holds the queries, keys and values of its own part of the sequence (see
:mod:`lightning_moe.cp.sharding`). The K/V blocks travel around the ring of cp ranks by P2P; every
rank attends its queries to each block as it passes and merges the partial results with an online
log-sum-exp, so the output equals attention over the whole sequence while no rank ever holds more
than two K/V blocks. The next block's transfer is posted before the current block is computed, so
communication overlaps with compute.

The backward sends the K/V blocks around again, each together with the dK/dV accumulated for it so
far; every rank adds its contribution and passes it on, and after a full turn each block's gradient
arrives back at its owner.

Causal masking under the zigzag layout: rank ``r`` holds query chunks ``(r, 2c-1-r)`` and a K/V block
from rank ``s`` covers key chunks ``(s, 2c-1-s)``. Then

- ``s == r``: the block is the diagonal; plain causal attention on the local sequence is right
  because the local order of positions is increasing;
- ``s < r``: key chunk ``s`` precedes both query chunks and key chunk ``2c-1-s`` follows both, so all
  queries attend to the first half of the block only;
- ``s > r``: both key chunks follow query chunk ``r`` and precede query chunk ``2c-1-r``, so only the
  second half of the queries attends, to the whole block.

Every step therefore costs every rank the same half block, and fully masked work is never done.

Documents (``document_ids``, packed rows): query ``i`` sees key ``j`` when ``j <= i`` in sequence
order and both are in the same document. The ids are all-gathered over the cp group once (a
``[batch, seq]`` integer tensor), and every rank plans, from the documents alone, which rectangles
of which K/V block its queries need (:class:`DocumentPlan`). Its query rows are cut into *pieces*
at chunk borders and document starts:

- a piece of document ``d`` (global rows ``[u, v)``, ``d`` starting at ``s <= u``) sees keys
  ``[s, u)`` completely (one unmasked rectangle per K/V block holding some of them, found by the
  block's global positions) and itself causally (a causal square on the own block);
- documents shorter than ``document_tile`` that start in the same chunk are packed, consecutive,
  into one piece of at most ``document_tile`` rows: one square on the own block, masked
  block-diagonally and causally (the explicit-scores kernel, with a boolean mask).

No block, and no part of one, without a visible pair is computed, in the forward and the backward
alike; the only pairs computed but not visible are those in the masked squares of packed short
documents (:func:`trace_ring_attention` records both counts: ``AttentionTrace.pairs`` and
``visible_pairs``). The K/V blocks (and dK/dV) still travel the whole ring, as later ranks may need
them.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe import _compat
from lightning_moe.cp.documents import check_document_ids
from lightning_moe.cp.sharding import LAYOUTS, Layout, chunk_ids, num_chunks, unshard_sequence

KERNELS = ("auto", "flash", "efficient", "torch")
# Distinct P2P tags: the K/V transfer of step i+1 and the dK/dV transfer of step i are in flight together.
_KV_TAG, _DKV_TAG = 0, 1
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DOCUMENT_TILE = 128  # the default ``document_tile``: the largest piece that packs short documents


# --------------------------------------------------------------------------------------------------
# Which part of a K/V block each rank attends to


class _Block(NamedTuple):
    q: slice  # rows of the local queries that attend to the block
    kv: slice  # rows of the K/V block they attend to
    causal: bool  # a square block on the diagonal, causally masked


def _plan_block(rank: int, src: int, seq_local: int, causal: bool, layout: str) -> _Block | None:
    """The visible part of the K/V block from ``src`` for the queries of ``rank``; None if fully masked."""
    whole = slice(0, seq_local)
    if not causal:
        return _Block(whole, whole, False)
    if src == rank:
        return _Block(whole, whole, True)
    if layout == "contiguous":
        return _Block(whole, whole, False) if src < rank else None
    half = seq_local // 2
    if src < rank:
        return _Block(whole, slice(0, half), False)
    return _Block(slice(half, seq_local), whole, False)


# --------------------------------------------------------------------------------------------------
# Observability: which blocks each rank computed


@dataclass(frozen=True)
class BlockRecord:
    """One attention block computed by ring attention on this rank.

    Example::

        with trace_ring_attention() as trace:
            ring_attention(q, k, v, group)
        [(b.src, b.q_rows, b.kv_rows, b.causal) for b in trace.blocks]   # the zigzag plan, step by step
    """

    phase: str  # "forward" or "backward"
    src: int  # cp rank whose K/V block it was
    q_rows: int
    kv_rows: int
    causal: bool
    batch_heads: int  # batch * query heads
    masked: bool = False  # a document tile computed with a boolean mask (all its pairs computed)
    visible: int | None = None  # visible (query, key) pairs in it, over batch and heads (documents only)

    @property
    def pairs(self) -> int:
        """(query, key) pairs attended, summed over batch and heads (causal blocks count the visible triangle)."""
        per_head = self.q_rows * (self.q_rows + 1) // 2 if self.causal else self.q_rows * self.kv_rows
        return per_head * self.batch_heads

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs the mask lets through (without documents: every pair computed is visible)."""
        return self.pairs if self.visible is None else self.visible


@dataclass
class AttentionTrace:
    """The blocks computed while a :func:`trace_ring_attention` context was open.

    Example::

        with trace_ring_attention() as trace:
            ring_attention(q, k, v, group).backward(grad)
        forward_flops = 4 * trace.pairs("forward") * head_dim
    """

    blocks: list[BlockRecord] = field(default_factory=list)

    def pairs(self, phase: str = "forward") -> int:
        """Attended (query, key) pairs of ``phase`` (FLOPs = 4 * pairs * head_dim in the forward)."""
        return sum(b.pairs for b in self.blocks if b.phase == phase)

    def visible_pairs(self, phase: str = "forward") -> int:
        """Visible (query, key) pairs among those computed in ``phase``. With ``document_ids`` every
        visible pair is computed exactly once, so over all cp ranks this is the ideal,
        ``document_causal_mask(ids, ids).sum() * heads``; ``pairs(phase) / visible_pairs(phase)``
        is the cost of the masked tiles of packed short documents."""
        return sum(b.visible_pairs for b in self.blocks if b.phase == phase)


_ACTIVE_TRACES: list[AttentionTrace] = []


@contextmanager
def trace_ring_attention() -> Iterator[AttentionTrace]:
    """Record every attention block this process computes inside the context.

    Example::

        with trace_ring_attention() as trace:
            ring_attention(q, k, v, group).sum().backward()
        trace.pairs("forward"), [b.src for b in trace.blocks]
    """
    trace = AttentionTrace()
    _ACTIVE_TRACES.append(trace)
    try:
        yield trace
    finally:
        _ACTIVE_TRACES.remove(trace)


# --------------------------------------------------------------------------------------------------
# Block kernels: forward (q, k, v, causal, scale) -> (out, lse fp32 [B, H, Sq], aux)
#                backward (dout, q, k, v, out, lse, causal, scale, aux) -> (dq, dk, dv)
# The backward receives the *final* output and log-sum-exp of the query rows, so the softmax it
# rebuilds is the global one and the per-block gradients simply add up.


class _Kernel(NamedTuple):
    forward: Callable[..., tuple[Tensor, Tensor, tuple]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def _wide(t: Tensor, mask: Tensor | None) -> Tensor:
    """fp32 (fp64 for fp64 inputs under a mask: the document path keeps fp64 exact)."""
    return t.float() if mask is None else t.to(_acc_dtype(t.dtype))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_scores(q: Tensor, k: Tensor, causal: bool, scale: float, mask: Tensor | None = None) -> Tensor:
    scores = torch.matmul(_wide(q, mask), _wide(k, mask).transpose(-1, -2)).mul_(scale)
    if causal:
        rows, cols = scores.shape[-2:]
        scores.masked_fill_(torch.ones(rows, cols, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    if mask is not None:  # boolean [rows, cols] (or broadcastable): True where the query sees the key
        scores.masked_fill_(~mask, float("-inf"))
    return scores


def _finite_lse(lse: Tensor, mask: Tensor | None) -> Tensor:
    """The log-sum-exp to subtract from a row's scores. Under a mask a row may see no key of the tile
    (lse = -inf); subtracting 0 there makes its probabilities exp(-inf) = 0 instead of NaN."""
    return lse if mask is None else lse.masked_fill(torch.isneginf(lse), 0.0)


def _torch_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, tuple]:
    scores = _block_scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(_finite_lse(lse, mask).unsqueeze(-1)).exp_()
    return torch.matmul(probs, _wide(v, mask)), lse, ()  # rows that see nothing: output 0, lse -inf


def _torch_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    aux: tuple,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    dout = _wide(dout, mask)
    probs = _block_scores(q, k, causal, scale, mask).sub_(_finite_lse(lse, mask).unsqueeze(-1)).exp_()
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    # softmax backward: dS = P * (dP - rowsum(dO * O)), with O the final output of the rows
    delta = (dout * _wide(out, mask)).sum(-1, keepdim=True)
    dscores = probs.mul_(torch.matmul(dout, _wide(v, mask).transpose(-1, -2)).sub_(delta)).mul_(scale)
    return torch.matmul(dscores, _wide(k, mask)), torch.matmul(dscores.transpose(-1, -2), _wide(q, mask)), dv


def _cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, tuple]:
    out, lse = _compat.flash_attention_cpu(q, k, v, causal, scale)
    return out, lse, ()


def _cpu_flash_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    aux: tuple,
) -> tuple[Tensor, Tensor, Tensor]:
    return _compat.flash_attention_cpu_backward(dout, q, k, v, out, lse, causal, scale)


# CUDA kernels (not yet run on a GPU in this project: tests/test_cuda.py checks them where CUDA exists).
# Each block is a dense (not varlen) call; causal blocks are square, so top-left and bottom-right
# causal alignment agree. The backward gets the final output and merged log-sum-exp (see above).


def _dense(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The backward kernels get row slices of the saved tensors; give them dense copies, so that
    ``out`` and ``dout`` share one layout whatever stride checks a kernel version makes."""
    return tuple(t.contiguous() for t in tensors)


def _cuda_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, tuple]:
    out, lse, philox_seed, philox_offset = _compat.flash_attention_cuda(q, k, v, causal, scale)
    return out, lse, (philox_seed, philox_offset)


def _cuda_flash_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    aux: tuple,
) -> tuple[Tensor, Tensor, Tensor]:
    # Without dropout the RNG state is never read; any forward's state has the right type.
    philox_seed, philox_offset = aux
    dout, q, k, v, out = _dense(dout, q, k, v, out)
    return _compat.flash_attention_cuda_backward(dout, q, k, v, out, lse, causal, scale, philox_seed, philox_offset)


def _cuda_efficient_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, tuple]:
    # -> (out, logsumexp [B, H, ceil(Sq / 32) * 32] fp32, philox_seed, philox_offset). The padded
    # log-sum-exp columns are cut here (the merge wants [B, H, Sq]) and restored for the backward.
    out, lse, philox_seed, philox_offset = _compat.efficient_attention_cuda(q, k, v, causal, scale)
    return out, lse[:, :, : q.shape[2]], (philox_seed, philox_offset)


def _pad_lse(lse: Tensor, multiple: int = 32) -> Tensor:
    """``lse [B, H, S]`` in the layout the memory-efficient kernel produced: ``S`` padded to ``multiple``."""
    rows = lse.shape[-1]
    padded = -(-rows // multiple) * multiple
    if padded == rows:
        return lse.contiguous()
    return torch.cat([lse, lse.new_zeros(*lse.shape[:-1], padded - rows)], dim=-1)


def _cuda_efficient_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    aux: tuple,
) -> tuple[Tensor, Tensor, Tensor]:
    philox_seed, philox_offset = aux
    dout, q, k, v, out = _dense(dout, q, k, v, out)
    return _compat.efficient_attention_cuda_backward(
        dout, q, k, v, out, _pad_lse(lse), causal, scale, philox_seed, philox_offset
    )


_TORCH = _Kernel(_torch_forward, _torch_backward)
_CPU_FLASH = _Kernel(_cpu_flash_forward, _cpu_flash_backward)
_CUDA_FLASH = _Kernel(_cuda_flash_forward, _cuda_flash_backward)
_CUDA_EFFICIENT = _Kernel(_cuda_efficient_forward, _cuda_efficient_backward)


def _sdpa_params(q: Tensor) -> Any:
    # Same-shaped K/V stand in for the (possibly grouped) blocks: the check is about dtype, head dim and GPU.
    return torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)


def _flash_kernel(q: Tensor) -> _Kernel | None:
    """The fused kernel with log-sum-exp output for these inputs, or None where there is none."""
    if q.device.type == "cpu":
        return _CPU_FLASH if _compat.flash_attention_cpu_available() and q.dtype in _CPU_FLASH_DTYPES else None
    if q.device.type == "cuda" and torch.backends.cuda.flash_sdp_enabled():
        return _CUDA_FLASH if torch.backends.cuda.can_use_flash_attention(_sdpa_params(q)) else None
    return None


def _efficient_kernel(q: Tensor) -> _Kernel | None:
    """CUDA's memory-efficient kernel (fp32 too, head dims flash lacks), or None."""
    if q.device.type == "cuda" and torch.backends.cuda.mem_efficient_sdp_enabled():
        return _CUDA_EFFICIENT if torch.backends.cuda.can_use_efficient_attention(_sdpa_params(q)) else None
    return None


def _select_kernel(kernel: str, q: Tensor) -> _Kernel:
    if kernel not in KERNELS:
        raise ValueError(f"unknown ring attention kernel {kernel!r}; choose one of {KERNELS}")
    if kernel == "torch":
        return _TORCH
    if kernel == "efficient":
        efficient = _efficient_kernel(q)
        if efficient is None:
            raise ValueError(
                f"no memory-efficient attention kernel for {q.dtype} on {q.device} (CUDA only); use kernel='auto' or 'torch'"
            )
        return efficient
    flash = _flash_kernel(q)
    if flash is None and kernel == "flash":
        raise ValueError(f"no flash attention kernel for {q.dtype} on {q.device}; use kernel='torch' or 'auto'")
    return flash or _efficient_kernel(q) or _TORCH


# --------------------------------------------------------------------------------------------------
# The ring


class _Pending:
    """Tensors being received from the previous rank; ``wait()`` returns them once they arrived."""

    def __init__(self, tensors: list[Tensor], works: list[Any]) -> None:
        self._tensors, self._works = tensors, works

    def wait(self) -> list[Tensor]:
        for work in self._works:
            work.wait()
        return self._tensors


class _Ring:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def shift(self, tensors: list[Tensor], tag: int) -> _Pending:
        """Send ``tensors`` to the next rank and receive same-shaped ones from the previous rank."""
        if self.size == 1:
            return _Pending(tensors, [])
        received = [torch.empty_like(t) for t in tensors]
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops = []
        for i, (out, into) in enumerate(zip(tensors, received)):
            ops.append(dist.P2POp(dist.isend, out, group=self.group, group_peer=nxt, tag=2 * i + tag))
            ops.append(dist.P2POp(dist.irecv, into, group=self.group, group_peer=prev, tag=2 * i + tag))
        return _Pending(received, dist.batch_isend_irecv(ops))


def _expand_kv(t: Tensor, groups: int) -> Tensor:
    """Grouped-query K/V repeated to one head per query head (SDPA's ``enable_gqa`` convention)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv(t: Tensor, groups: int) -> Tensor:
    """The gradient of :func:`_expand_kv`: sum the query heads that shared a K/V head."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


def _record(phase: str, src: int, block: _Block, q: Tensor, seq_local: int) -> None:
    if _ACTIVE_TRACES:
        rows = range(seq_local)
        record = BlockRecord(phase, src, len(rows[block.q]), len(rows[block.kv]), block.causal, q.shape[0] * q.shape[1])
        for trace in _ACTIVE_TRACES:
            trace.blocks.append(record)


@dataclass
class _Config:
    ring: _Ring
    causal: bool
    scale: float
    layout: str
    kernel: _Kernel
    groups: int  # query heads per K/V head
    head_chunks: int  # ring passes, each over an equal share of the K/V heads
    documents: DocumentPlan | None = None  # document-causal attention: what this rank computes of each block


def _head_slices(cfg: _Config, kv_heads: int) -> Iterator[tuple[slice, slice]]:
    """``(query heads, K/V heads)`` of each ring pass."""
    per_pass = kv_heads // cfg.head_chunks
    for start in range(0, kv_heads, per_pass):
        yield slice(start * cfg.groups, (start + per_pass) * cfg.groups), slice(start, start + per_pass)


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, cfg: _Config) -> tuple[Tensor, Tensor, tuple]:
    ring, seq_local = cfg.ring, q.shape[2]
    out: Tensor | None = None  # fp32 accumulators, filled by the own block (step 0)
    lse: Tensor | None = None
    aux: tuple = ()
    kv = [k, v]
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        pending = ring.shift(kv, _KV_TAG) if step + 1 < ring.size else None
        block = _plan_block(ring.rank, src, seq_local, cfg.causal, cfg.layout)
        if block is not None:
            _record("forward", src, block, q, seq_local)
            out, lse, aux = _forward_block(q, kv, block, cfg, out, lse)
        if pending is not None:
            kv = pending.wait()
    assert out is not None and lse is not None  # step 0 is the own block, never fully masked
    return out.to(q.dtype), lse, aux


def _forward_block(
    q: Tensor,
    kv: list[Tensor],
    block: _Block,
    cfg: _Config,
    out: Tensor | None,
    lse: Tensor | None,
) -> tuple[Tensor, Tensor, tuple]:
    """Attend to one block and fold it into (out, lse); the block's own output dies on return."""
    blk_out, blk_lse, aux = cfg.kernel.forward(
        q[:, :, block.q],
        _expand_kv(kv[0][:, :, block.kv], cfg.groups),
        _expand_kv(kv[1][:, :, block.kv], cfg.groups),
        block.causal,
        cfg.scale,
    )
    if out is None or lse is None:
        return blk_out.float(), blk_lse.float(), aux
    _merge(out[:, :, block.q], lse[:, :, block.q], blk_out, blk_lse)
    return out, lse, aux


def _merge(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """Fold one block's softmax-normalised output into the running (out, lse), in place (fp32)."""
    new_lse = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(blk_out.float() * torch.exp(blk_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def _ring_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    aux: tuple,
    cfg: _Config,
) -> tuple[Tensor, Tensor, Tensor]:
    ring, seq_local = cfg.ring, q.shape[2]
    saved = (dout, q, out, lse, aux)
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = [k, v]
    incoming: _Pending | None = None  # dK/dV of the block in hand, accumulated by the ranks before
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        pending_kv = ring.shift(kv, _KV_TAG) if step + 1 < ring.size else None
        block = _plan_block(ring.rank, src, seq_local, cfg.causal, cfg.layout)
        grads = None
        if block is not None:
            _record("backward", src, block, q, seq_local)
            grads = _backward_block(*saved, kv, block, cfg, dq)
        # Wait for the earlier ranks' share only now, so it travelled while this rank computed.
        acc = incoming.wait() if incoming is not None else [torch.zeros_like(t, dtype=torch.float32) for t in kv]
        if block is not None and grads is not None:
            for total, part in zip(acc, grads):
                total[:, :, block.kv] += part
        del grads  # free before the next block's kernel allocates its own
        # Pass the block's gradient on with it; the last send delivers each block's gradient home.
        incoming = ring.shift(acc, _DKV_TAG)
        if pending_kv is not None:
            kv = pending_kv.wait()
    assert incoming is not None
    dk, dv = incoming.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _backward_block(
    dout: Tensor,
    q: Tensor,
    out: Tensor,
    lse: Tensor,
    aux: tuple,
    kv: list[Tensor],
    block: _Block,
    cfg: _Config,
    dq: Tensor,
) -> tuple[Tensor, Tensor]:
    """Add one block's dQ into ``dq`` and return its dK, dV (per K/V head)."""
    rows = block.q
    dq_blk, dk_blk, dv_blk = cfg.kernel.backward(
        dout[:, :, rows],
        q[:, :, rows],
        _expand_kv(kv[0][:, :, block.kv], cfg.groups),
        _expand_kv(kv[1][:, :, block.kv], cfg.groups),
        out[:, :, rows],
        lse[:, :, rows].contiguous(),  # the fused kernels want dense lse rows
        block.causal,
        cfg.scale,
        aux,
    )
    dq[:, :, rows] += dq_blk
    return _reduce_kv(dk_blk, cfg.groups), _reduce_kv(dv_blk, cfg.groups)


# --------------------------------------------------------------------------------------------------
# Documents: which rectangles of which K/V block each rank's queries see


@dataclass(frozen=True)
class _DocItem:
    """One kernel call of the document path: query rows ``q`` against rows ``kv`` of one K/V block."""

    rows: slice  # batch rows (all, when every row packs its documents alike; else one)
    q: slice  # local query rows
    kv: slice  # rows of the K/V block
    causal: bool  # the piece's own square (``q == kv`` on the own block), causally masked
    mask: Tensor | None  # [q, kv] bool for packed short documents (block-diagonal, causal); else None
    visible: int  # visible (query, key) pairs per batch row and head


@dataclass(frozen=True)
class DocumentPlan:
    """What one cp rank computes of every K/V block under document-causal attention.

    Built by :func:`document_plan` (one all-gather of the ids over the cp group) and reusable by every
    attention call over the same documents (:class:`~lightning_moe.cp.RingAttentionMode` builds it
    once per micro-batch and passes it to :func:`ring_attention` as ``document_ids``).

    Example::

        plan = document_plan(zigzag_shard(document_ids, cp_rank, cp), cp_group, document_tile=64)
        plan.computed_pairs / plan.visible_pairs    # 1.0 unless short documents were packed
        out = ring_attention(q, k, v, cp_group, document_ids=plan)
    """

    shape: tuple[int, int]  # this rank's [batch, seq_local]
    layout: str
    cp_rank: int
    cp_size: int
    document_tile: int
    items: tuple[tuple[_DocItem, ...], ...]  # by source cp rank of the K/V block

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs this rank's queries may attend to, per head (summed over the batch)."""
        return sum(it.visible * _rows(it.rows, self.shape[0]) for items in self.items for it in items)

    @property
    def computed_pairs(self) -> int:
        """(query, key) pairs this rank computes per head in the forward (= visible + masked-tile waste)."""
        return sum(_item_pairs(it) * _rows(it.rows, self.shape[0]) for items in self.items for it in items)


def _rows(rows: slice, batch: int) -> int:
    return len(range(batch)[rows])


def _item_pairs(item: _DocItem) -> int:
    n_q, n_kv = item.q.stop - item.q.start, item.kv.stop - item.kv.start
    return n_q * (n_q + 1) // 2 if item.causal else n_q * n_kv


def _key_rows(spans: list[tuple[int, int]], chunk: int, lo: int, hi: int) -> slice | None:
    """The local rows of a rank holding global keys ``[lo, hi)`` (contiguous: local order follows the
    global one), or None. ``spans``: the rank's chunks as (global start, local start)."""
    first = last = None
    for g0, l0 in spans:
        a, b = max(lo, g0), min(hi, g0 + chunk)
        if a < b:
            first = l0 + a - g0 if first is None else first
            last = l0 + b - g0
    return None if first is None else slice(first, last)


def _pieces(starts: list[int], lo: int, hi: int, tile: int) -> list[tuple[int, int, int, tuple[int, ...] | None]]:
    """Cut global rows ``[lo, hi)`` (one chunk) into ``(u, v, doc_start, packed)`` pieces: one per
    document run, except that consecutive documents shorter than ``tile`` starting in the chunk are
    packed into pieces of at most ``tile`` rows (``packed``: their lengths; None for one document)."""
    pieces: list[tuple[int, int, int, tuple[int, ...] | None]] = []
    group: list[int] = []  # lengths of the short documents being packed
    group_start = lo

    def flush() -> None:
        if len(group) == 1:
            pieces.append((group_start, group_start + group[0], group_start, None))
        elif group:
            pieces.append((group_start, group_start + sum(group), group_start, tuple(group)))
        group.clear()

    i = bisect_right(starts, lo) - 1
    u = lo
    while u < hi:
        start = starts[i]
        v = min(starts[i + 1], hi) if i + 1 < len(starts) else hi
        if start < u or v - u >= tile:  # a document begun before the chunk, or a long one: its own piece
            flush()
            pieces.append((u, v, start, None))
        else:
            if group and sum(group) + v - u > tile:
                flush()
            if not group:
                group_start = u
            group.append(v - u)
        u, i = v, i + 1
    flush()
    return pieces


def _packed_mask(lengths: tuple[int, ...], device: torch.device) -> Tensor:
    """Block-diagonal causal ``[n, n]`` mask of consecutive documents of ``lengths``."""
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    n = doc.shape[0]
    return (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool, device=device).tril_()


def _plan_documents(
    documents: Tensor, rank: int, cp: int, layout: str, tile: int, device: torch.device
) -> tuple[tuple[_DocItem, ...], ...]:
    """The kernel calls of ``rank`` for each K/V block, from the full-sequence ``documents [B, S]``."""
    batch, seq = documents.shape
    chunk = seq // num_chunks(cp, layout)
    tile = max(1, min(tile, chunk))
    spans = [[(cid * chunk, i * chunk) for i, cid in enumerate(chunk_ids(s, cp, layout))] for s in range(cp)]
    documents = documents.cpu()
    changes = documents[:, 1:] != documents[:, :-1]  # a document starts at the next token
    if batch == 1 or bool((changes == changes[:1]).all()):
        row_sets = [(slice(None), changes[0])]  # every row packs alike: one call covers the batch
    else:
        row_sets = [(slice(b, b + 1), changes[b]) for b in range(batch)]
    items: list[list[_DocItem]] = [[] for _ in range(cp)]
    for rows, row_changes in row_sets:
        starts = [0] + (torch.nonzero(row_changes).flatten() + 1).tolist()
        for g0, l0 in spans[rank]:
            for u, v, start, packed in _pieces(starts, g0, g0 + chunk, tile):
                q = slice(l0 + u - g0, l0 + v - g0)
                n = v - u
                if packed is not None:
                    visible = sum(length * (length + 1) // 2 for length in packed)
                    items[rank].append(_DocItem(rows, q, q, False, _packed_mask(packed, device), visible))
                    continue
                for src in range(cp):  # the earlier part of the document: seen by every row of the piece
                    kv = _key_rows(spans[src], chunk, start, u)
                    if kv is not None:
                        items[src].append(_DocItem(rows, q, kv, False, None, n * (kv.stop - kv.start)))
                items[rank].append(_DocItem(rows, q, q, n > 1, None, n * (n + 1) // 2))
    return tuple(tuple(block) for block in items)


def _check_document_args(document_ids: Tensor, shape: tuple[int, int] | None, layout: str, document_tile: int) -> None:
    """Local checks of :func:`document_plan`'s arguments (before any communication)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}; choose one of {LAYOUTS}")
    if isinstance(document_tile, bool) or not isinstance(document_tile, int) or document_tile < 1:
        raise ValueError(f"document_tile must be a positive number of tokens, got {document_tile!r}")
    if shape is not None and isinstance(document_ids, Tensor) and tuple(document_ids.shape) != shape:
        raise ValueError(
            f"document_ids of shape {tuple(document_ids.shape)} do not match this rank's queries [batch, seq_local] ="
            f" {shape}: pass this rank's shard of the ids, in the layout of q, k and v"
            " (e.g. zigzag_shard(document_ids, cp_rank, cp_size))"
        )
    check_document_ids(document_ids)


def _gather_documents(document_ids: Tensor, ring: _Ring, layout: str) -> Tensor:
    """The full-sequence ``[batch, seq]`` ids from every rank's shard (one all-gather)."""
    local = document_ids.to(torch.int64).contiguous()
    parts = [local]
    if ring.size > 1:
        parts = [torch.empty_like(local) for _ in range(ring.size)]
        dist.all_gather(parts, local, group=ring.group)
    documents = unshard_sequence(parts, dim=1, layout=layout)  # type: ignore[arg-type]
    check_document_ids(documents)  # every rank sees the same ids: a decrease between shards fails everywhere
    return documents


def _document_plan(document_ids: Tensor, ring: _Ring, layout: str, document_tile: int) -> DocumentPlan:
    documents = _gather_documents(document_ids, ring, layout)
    items = _plan_documents(documents, ring.rank, ring.size, layout, document_tile, document_ids.device)
    shape = (int(document_ids.shape[0]), int(document_ids.shape[1]))
    return DocumentPlan(shape, layout, ring.rank, ring.size, document_tile, items)


def document_plan(
    document_ids: Tensor,
    group: dist.ProcessGroup | None,
    layout: Layout = "zigzag",
    *,
    document_tile: int = DOCUMENT_TILE,
) -> DocumentPlan:
    """Plan document-causal ring attention over ``group`` for this rank's ``document_ids [batch, seq_local]``.

    Checks the ids locally (integer ``[batch, seq]``, not decreasing), all-gathers them over
    ``group`` (a collective: every rank of the group must call it), checks the whole rows and plans
    which part of every K/V block this rank's queries see (see the module docstring). The masks of
    packed short documents are made on ``document_ids.device``. Pass the plan to
    :func:`ring_attention` as ``document_ids`` to reuse it across layers.

    Example::

        plan = document_plan(local_ids, cp_group, document_tile=64)
        for layer in layers:
            x = layer(x, attention=lambda q, k, v: ring_attention(q, k, v, cp_group, document_ids=plan))
    """
    _check_document_args(document_ids, None, layout, document_tile)
    ring = _Ring(group)
    if layout == "zigzag" and document_ids.shape[1] % 2:
        raise ValueError(
            f"zigzag local sequence length {document_ids.shape[1]} is odd: each rank holds two equal chunks"
        )
    return _document_plan(document_ids, ring, layout, document_tile)


def _record_item(phase: str, src: int, item: _DocItem, q: Tensor) -> None:
    if _ACTIVE_TRACES:
        batch_heads = _rows(item.rows, q.shape[0]) * q.shape[1]
        record = BlockRecord(
            phase,
            src,
            item.q.stop - item.q.start,
            item.kv.stop - item.kv.start,
            item.causal,
            batch_heads,
            masked=item.mask is not None,
            visible=item.visible * batch_heads,
        )
        for trace in _ACTIVE_TRACES:
            trace.blocks.append(record)


def _merge_documents(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """:func:`_merge` for rows that may have seen no key yet (lse = -inf on either side): they keep
    output 0 and lse -inf until a block with a visible key arrives, without NaNs."""
    top = torch.maximum(lse, blk_lse)
    top = top.masked_fill(torch.isneginf(top), 0.0)
    w_old, w_blk = torch.exp(lse - top), torch.exp(blk_lse - top)
    total = w_old + w_blk  # 0 where neither side saw a key
    norm = total.masked_fill(total == 0, 1.0)
    out.mul_((w_old / norm).unsqueeze(-1)).add_(blk_out.to(out.dtype) * (w_blk / norm).unsqueeze(-1))
    lse.copy_(top + torch.log(total))


def _item_kv(kv: list[Tensor], item: _DocItem, groups: int) -> tuple[Tensor, Tensor]:
    return (_expand_kv(kv[0][item.rows, :, item.kv], groups), _expand_kv(kv[1][item.rows, :, item.kv], groups))


def _document_ring_forward(q: Tensor, k: Tensor, v: Tensor, cfg: _Config) -> tuple[Tensor, Tensor, tuple]:
    ring, plan = cfg.ring, cfg.documents
    assert plan is not None
    acc = _acc_dtype(q.dtype)  # fp32; fp64 for fp64 inputs
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    aux: tuple = ()  # of a fused kernel call, for the fused backward calls (masked tiles need none)
    kv = [k, v]
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        pending = ring.shift(kv, _KV_TAG) if step + 1 < ring.size else None
        for item in plan.items[src]:  # empty: this rank sees nothing of the block, it only passes it on
            _record_item("forward", src, item, q)
            q_rows, (k_rows, v_rows) = q[item.rows, :, item.q], _item_kv(kv, item, cfg.groups)
            if item.mask is not None:
                blk_out, blk_lse, _ = _torch_forward(q_rows, k_rows, v_rows, False, cfg.scale, mask=item.mask)
            else:
                blk_out, blk_lse, blk_aux = cfg.kernel.forward(q_rows, k_rows, v_rows, item.causal, cfg.scale)
                aux = blk_aux or aux
            _merge_documents(out[item.rows, :, item.q], lse[item.rows, :, item.q], blk_out, blk_lse)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse, aux


def _document_ring_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    aux: tuple,
    cfg: _Config,
) -> tuple[Tensor, Tensor, Tensor]:
    ring, plan = cfg.ring, cfg.documents
    assert plan is not None
    acc_dtype = _acc_dtype(q.dtype)
    dq = torch.zeros_like(q, dtype=acc_dtype)
    kv = [k, v]
    incoming: _Pending | None = None  # dK/dV of the block in hand, accumulated by the ranks before
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        pending_kv = ring.shift(kv, _KV_TAG) if step + 1 < ring.size else None
        items = plan.items[src]
        own = [torch.zeros_like(t, dtype=acc_dtype) for t in kv] if items else None
        for item in items:
            _record_item("backward", src, item, q)
            rows, q_part = item.rows, item.q
            args = (
                dout[rows, :, q_part],
                q[rows, :, q_part],
                *_item_kv(kv, item, cfg.groups),
                out[rows, :, q_part],
                lse[rows, :, q_part].contiguous(),
            )
            if item.mask is not None:
                dq_blk, dk_blk, dv_blk = _torch_backward(*args, False, cfg.scale, (), mask=item.mask)
            else:
                dq_blk, dk_blk, dv_blk = cfg.kernel.backward(*args, item.causal, cfg.scale, aux)
            dq[rows, :, q_part] += dq_blk
            assert own is not None
            own[0][rows, :, item.kv] += _reduce_kv(dk_blk, cfg.groups)
            own[1][rows, :, item.kv] += _reduce_kv(dv_blk, cfg.groups)
        # Wait for the earlier ranks' share only now, so it travelled while this rank computed.
        if incoming is not None:
            acc = incoming.wait()
            if own is not None:
                for total, part in zip(acc, own):
                    total += part
        else:
            acc = own if own is not None else [torch.zeros_like(t, dtype=acc_dtype) for t in kv]
        del own
        incoming = ring.shift(acc, _DKV_TAG)
        if pending_kv is not None:
            kv = pending_kv.wait()
    assert incoming is not None
    dk, dv = incoming.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """The ring over all heads at once, or one pass per head chunk into preallocated results.

    Heads are independent, so a pass over a share of them holds only that share of the in-flight
    K/V and dK/dV buffers: the per-rank working set shrinks by ``head_chunks``.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, cfg: _Config) -> Tensor:
        k, v = k.contiguous(), v.contiguous()  # P2P sends need dense buffers
        ring_forward = _ring_forward if cfg.documents is None else _document_ring_forward
        with torch.autocast(q.device.type, enabled=False):  # fp32 statistics must stay fp32
            if cfg.head_chunks == 1:
                out, lse, aux = ring_forward(q, k, v, cfg)
            else:
                out = torch.empty_like(q)
                lse_dtype = torch.float32 if cfg.documents is None else _acc_dtype(q.dtype)
                lse = q.new_empty(q.shape[:3], dtype=lse_dtype)
                for q_heads, kv_heads in _head_slices(cfg, k.shape[1]):
                    kv = (k[:, kv_heads].contiguous(), v[:, kv_heads].contiguous())
                    out[:, q_heads], lse[:, q_heads], aux = ring_forward(q[:, q_heads], *kv, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg, ctx.aux = cfg, aux
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        cfg, dout = ctx.cfg, dout.contiguous()
        ring_backward = _ring_backward if cfg.documents is None else _document_ring_backward
        with torch.autocast(q.device.type, enabled=False):
            if cfg.head_chunks == 1:
                dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.aux, cfg)
            else:
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                for q_heads, kv_heads in _head_slices(cfg, k.shape[1]):
                    kv = (k[:, kv_heads].contiguous(), v[:, kv_heads].contiguous())
                    q_part = (dout[:, q_heads], q[:, q_heads])
                    dq[:, q_heads], dk[:, kv_heads], dv[:, kv_heads] = ring_backward(
                        *q_part, *kv, out[:, q_heads], lse[:, q_heads], ctx.aux, cfg
                    )
        return dq, dk, dv, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    causal: bool = True,
    layout: Layout = "zigzag",
    *,
    scale: float | None = None,
    kernel: str = "auto",
    head_chunks: int = 1,
    document_ids: Tensor | DocumentPlan | None = None,
    document_tile: int = DOCUMENT_TILE,
) -> Tensor:
    """Attention of the local queries over the whole sequence sharded across ``group``.

    ``q`` is ``[batch, heads, seq_local, head_dim]``, ``k`` and ``v`` are
    ``[batch, kv_heads, seq_local, head_dim]`` with ``heads % kv_heads == 0`` (grouped-query
    attention), all holding this rank's part of the sequence in ``layout``
    (:func:`~lightning_moe.cp.zigzag_shard`). The result is this rank's part of
    ``F.scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale, enable_gqa=True)`` on the
    full sequence; gradients flow to ``q``, ``k`` and ``v``. ``scale`` defaults to
    ``1 / sqrt(head_dim)``. ``kernel``: ``"flash"`` (fused kernel with log-sum-exp: the CPU flash
    kernel, or FlashAttention on CUDA for fp16/bf16), ``"efficient"`` (CUDA's memory-efficient
    kernel, also fp32), ``"torch"`` (blockwise matmul + logsumexp, always available) or ``"auto"``
    (flash, else efficient, else torch). The CUDA kernels have not yet run on a GPU in this project. ``head_chunks``: run the ring once per
    equal share of the K/V heads (a divisor of ``kv_heads``): the K/V and dK/dV blocks in flight
    shrink by that factor, for ``head_chunks`` times as many (smaller) P2P messages. Softmax
    statistics and accumulation are fp32 for every input dtype (with ``document_ids``, fp64 for fp64
    inputs); under autocast the inputs are cast to the autocast dtype, as SDPA
    does. ``group=None`` is the default process group.

    ``document_ids``: this rank's ``[batch, seq_local]`` document ids of packed rows, sharded like
    the sequence of ``q``, ``k`` and ``v`` (``zigzag_shard(document_ids, cp_rank, cp_size)``), or a
    :class:`DocumentPlan` made from them by :func:`document_plan`. The result is then this rank's
    part of ``SDPA(Q, K, V, attn_mask=document_causal_mask(ids, ids))``: query ``i`` sees key ``j <=
    i`` of its own document only. Needs ``causal=True``. The ids are all-gathered over ``group`` on
    each call with a tensor (a plan is gathered once); every pair that no document spans is skipped,
    and documents shorter than ``document_tile`` tokens are packed into masked tiles of at most that
    many rows (smaller: closer to the visible pairs, more kernel calls; see the module docstring and
    :meth:`AttentionTrace.visible_pairs`). Bad ids (wrong shape, decreasing along a row, float)
    raise ``ValueError`` before any communication; ids that only decrease across the shards of a row
    raise it on every rank after the gather.

    Example::

        cp_group = mesh.get_group("cp")
        q, k, v = (zigzag_shard(t, cp_rank, cp_size, dim=2) for t in (Q, K, V))
        out = ring_attention(q, k, v, cp_group, causal=True)   # == zigzag_shard(SDPA(Q, K, V), ..., dim=2)
        out = ring_attention(q, k, v, cp_group, document_ids=zigzag_shard(ids, cp_rank, cp_size))   # packed documents
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}; choose one of {LAYOUTS}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        raise ValueError(f"ring_attention expects [batch, heads, seq, head_dim] tensors, got {shapes}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: batch, local sequence and head_dim must agree"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if head_chunks < 1 or k.shape[1] % head_chunks:
        raise ValueError(f"head_chunks={head_chunks} must divide the {k.shape[1]} key/value heads")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"zigzag local sequence length {q.shape[2]} is odd: each rank holds two equal chunks")
    if document_ids is not None:
        if not causal:
            raise ValueError(
                "document_ids make attention document-causal (query i sees key j <= i of its own document):"
                " pass causal=True, or no document_ids for full attention"
            )
        local_shape = (q.shape[0], q.shape[2])
        if isinstance(document_ids, DocumentPlan):
            if document_ids.shape != local_shape or document_ids.layout != layout:
                raise ValueError(
                    f"the document plan is for [batch, seq_local] = {document_ids.shape} in layout"
                    f" {document_ids.layout!r}, the queries are {local_shape} in {layout!r}: plan these documents again"
                )
        else:
            _check_document_args(document_ids, local_shape, layout, document_tile)
    if torch.is_autocast_enabled(q.device.type):
        # As SDPA does under autocast: attention runs in the autocast dtype.
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    block_kernel = _select_kernel(kernel, q)
    ring = _Ring(group)
    plan = document_ids
    if isinstance(plan, DocumentPlan) and (plan.cp_rank, plan.cp_size) != (ring.rank, ring.size):
        raise ValueError(
            f"the document plan is for cp rank {plan.cp_rank} of {plan.cp_size},"
            f" this is rank {ring.rank} of {ring.size}"
        )
    if isinstance(plan, Tensor):
        plan = _document_plan(plan.to(q.device), ring, layout, document_tile)
    cfg = _Config(
        ring=ring,
        causal=causal,
        scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
        layout=layout,
        kernel=block_kernel,
        groups=q.shape[1] // k.shape[1],
        head_chunks=head_chunks,
        documents=plan,
    )
    return _RingAttention.apply(q, k, v, cfg)
