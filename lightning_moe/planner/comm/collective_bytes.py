"""Bytes a rank sends in one collective, by the conventions of :mod:`lightning_moe.comm`: the bytes bound
for its peers, an all-reduce counted as a reduce-scatter and an all-gather (``2 (n-1)/n``)."""

from __future__ import annotations


def peer_chunks_bytes(chunk: int, n: int) -> int:
    """Bytes a rank sends in an all-gather or reduce-scatter over ``n`` ranks of ``chunk`` bytes per
    rank: one chunk to (or for) each of its ``n - 1`` peers."""
    return chunk * (n - 1)


def peer_share_bytes(whole: int, n: int) -> int:
    """Bytes a rank sends in an all-gather, reduce-scatter or all-to-all over ``n`` ranks of a
    ``whole`` tensor: the ``(n - 1) / n`` of it bound for its peers."""
    return whole * (n - 1) // n


def all_reduce_bytes(whole: int, n: int) -> int:
    """Bytes a rank sends in a ring all-reduce of ``whole`` over ``n`` ranks: a reduce-scatter and an
    all-gather, ``2 (n - 1) / n`` of it."""
    return 2 * whole * (n - 1) // n
