"""Sequence sharding for context parallelism: layouts, round trips and the divisibility error."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.cp import (
    contiguous_shard,
    contiguous_unshard,
    shard_sequence,
    unshard_sequence,
    zigzag_position_ids,
    zigzag_shard,
    zigzag_unshard,
)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_zigzag_round_trip(cp: int, dim: int) -> None:
    x = torch.randn(4, 16, 8).movedim(1, dim)  # the sequence (16) along `dim`
    shards = [zigzag_shard(x, r, cp, dim=dim) for r in range(cp)]
    assert all(s.shape[dim] == 16 // cp for s in shards)
    assert torch.equal(zigzag_unshard(shards, dim=dim), x)


def test_zigzag_chunk_order() -> None:
    seq = torch.arange(16)[None]
    # cp = 2: four chunks of 4; rank 0 keeps chunks 0 and 3, rank 1 keeps chunks 1 and 2.
    assert zigzag_shard(seq, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert zigzag_shard(seq, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert zigzag_shard(seq, 3, 4).tolist() == [[6, 7, 8, 9]]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_contiguous_round_trip(cp: int) -> None:
    x = torch.randn(2, 12, 3)
    shards = [contiguous_shard(x, r, cp) for r in range(cp)]
    assert torch.equal(shards[0], x[:, : 12 // cp])
    assert torch.equal(contiguous_unshard(shards), x)


def test_generic_layout_matches_named_functions() -> None:
    x = torch.randn(2, 16)
    assert torch.equal(shard_sequence(x, 1, 2, layout="zigzag"), zigzag_shard(x, 1, 2))
    assert torch.equal(unshard_sequence([contiguous_shard(x, r, 4) for r in range(4)], layout="contiguous"), x)


def test_position_ids_follow_the_tokens() -> None:
    seq = torch.arange(100, 132)[None]
    for rank in range(4):
        assert torch.equal(zigzag_position_ids(32, rank, 4) + 100, zigzag_shard(seq, rank, 4)[0])
    assert zigzag_position_ids(8, 1, 2).dtype == torch.int64


def test_divisibility_error() -> None:
    with pytest.raises(ValueError, match=r"seq_len 30 not divisible by 2\*cp = 4"):
        zigzag_shard(torch.zeros(1, 30), 0, 2)
    with pytest.raises(ValueError, match=r"seq_len 30 not divisible by cp = 4"):
        contiguous_shard(torch.zeros(1, 30), 0, 4)
    # 12 splits into 4 contiguous chunks but not into 8 zigzag ones.
    with pytest.raises(ValueError, match=r"seq_len 12 not divisible by 2\*cp = 8"):
        zigzag_shard(torch.zeros(1, 12), 0, 4)


def test_bad_rank_and_layout() -> None:
    with pytest.raises(ValueError, match="cp_rank 2 out of range"):
        zigzag_shard(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match="unknown context-parallel layout"):
        shard_sequence(torch.zeros(1, 8), 0, 2, layout="striped")  # type: ignore[arg-type]
