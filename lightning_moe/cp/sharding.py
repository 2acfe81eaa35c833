"""How a sequence is split over the ranks of a context-parallel group.

Two layouts:

- ``"zigzag"`` (the default): the sequence is cut into ``2 * cp`` chunks and rank ``r`` keeps chunks
  ``r`` and ``2 * cp - 1 - r``. Under a causal mask every rank then attends to the same number of
  (query, key) pairs, so no rank waits for another.
- ``"contiguous"``: rank ``r`` keeps chunk ``r`` of ``cp``. Simple, but under a causal mask the last
  rank does ``2 * cp - 1`` times the work of the first; it is kept for comparison.

Everything here is pure tensor slicing (no communication), so the strategy can shard a batch and the
tests can rebuild the full sequence from every rank's piece.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from lightning_moe.layout import cp_chunks, seq_len_problem

Layout = Literal["zigzag", "contiguous"]
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


def chunk_ids(cp_rank: int, cp_size: int, layout: Layout = "zigzag") -> tuple[int, ...]:
    """The indices of the sequence chunks that ``cp_rank`` holds, in local order.

    Example::

        chunk_ids(1, 4)                 # (1, 6): chunks of 8
        chunk_ids(1, 4, "contiguous")   # (1,): chunks of 4
    """
    _check_layout(layout)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp = {cp_size}")
    if layout == "zigzag":
        return (cp_rank, 2 * cp_size - 1 - cp_rank)
    return (cp_rank,)


def num_chunks(cp_size: int, layout: Layout = "zigzag") -> int:
    """How many equal chunks the full sequence is cut into (``2 * cp`` for zigzag, ``cp`` otherwise)."""
    _check_layout(layout)
    return cp_chunks(cp_size, layout)


def check_seq_len(seq_len: int, cp_size: int, layout: Layout = "zigzag") -> None:
    """Raise a ``ValueError`` unless ``seq_len`` splits evenly for this layout.

    Example::

        check_seq_len(30, 2)   # ValueError: seq_len 30 not divisible by 2*cp = 4 ...
    """
    _check_layout(layout)
    problem = seq_len_problem(seq_len, cp_size, layout)
    if problem:
        raise ValueError(problem)


def shard_sequence(
    x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1, layout: Layout = "zigzag"
) -> torch.Tensor:
    """The part of ``x`` (full sequence along ``dim``) that ``cp_rank`` keeps.

    Example::

        local = shard_sequence(input_ids, cp_rank, cp_size, dim=1, layout="zigzag")
    """
    check_seq_len(x.shape[dim], cp_size, layout)
    chunks = x.chunk(num_chunks(cp_size, layout), dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp_rank, cp_size, layout)], dim=dim)


def unshard_sequence(local_per_rank: Sequence[torch.Tensor], dim: int = 1, layout: Layout = "zigzag") -> torch.Tensor:
    """Rebuild the full sequence from every rank's local tensor (in cp-rank order).

    Example::

        full = unshard_sequence([shard_sequence(x, r, 4) for r in range(4)])   # == x
    """
    cp_size = len(local_per_rank)
    pieces: list[torch.Tensor | None] = [None] * num_chunks(cp_size, layout)
    for rank, local in enumerate(local_per_rank):
        ids = chunk_ids(rank, cp_size, layout)
        if local.shape[dim] % len(ids):
            raise ValueError(f"rank {rank}'s local length {local.shape[dim]} does not split into {len(ids)} chunks")
        for idx, piece in zip(ids, local.chunk(len(ids), dim=dim)):
            pieces[idx] = piece
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]  # every slot is filled above


def zigzag_shard(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``cp_rank`` keeps chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of ``2*cp_size``.

    Example::

        x = torch.arange(8)[None]          # [1, 8]
        zigzag_shard(x, 0, 2)              # tensor([[0, 1, 6, 7]])
    """
    return shard_sequence(x, cp_rank, cp_size, dim, "zigzag")


def zigzag_unshard(chunks: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard`: every rank's local tensor, in rank order, to the full sequence.

    Example::

        zigzag_unshard([zigzag_shard(x, r, 2) for r in range(2)])   # == x
    """
    return unshard_sequence(chunks, dim, "zigzag")


def contiguous_shard(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``cp_rank`` keeps chunk ``cp_rank`` of ``cp_size`` (for comparison with zigzag).

    Example::

        contiguous_shard(torch.arange(8)[None], 0, 2)   # tensor([[0, 1, 2, 3]])
    """
    return shard_sequence(x, cp_rank, cp_size, dim, "contiguous")


def contiguous_unshard(chunks: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`contiguous_shard`.

    Example::

        contiguous_unshard([contiguous_shard(x, r, 2) for r in range(2)])   # == x
    """
    return unshard_sequence(chunks, dim, "contiguous")


def zigzag_position_ids(
    seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions (int64, ``[seq_len // cp_size]``) of the tokens ``cp_rank`` holds under zigzag.

    RoPE needs the global position of each local token; the strategy adds these to the batch.

    Example::

        zigzag_position_ids(8, 1, 2)   # tensor([2, 3, 4, 5])
    """
    return zigzag_shard(torch.arange(seq_len, device=device), cp_rank, cp_size, dim=0)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}; choose one of {LAYOUTS}")
