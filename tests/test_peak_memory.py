"""Measured peak host memory per rank against the planner's estimate (experiments/bench/peak_memory.py).

A short CLI run of an ep2 layout (2 processes) records each rank's import floor and peak resident
set; the busiest rank's peak minus its floor must lie within 15% of
:func:`lightning_moe.planner.memory_per_rank`. The model is sized so that its tensors (~0.57 GB
per rank) dwarf what moves the resident set besides them: run to run the peak varied by ~1.5% (55 MB
of 4.1 GB in two one-process runs of the bench's model) and allocator slack and Python objects are a
few tens of MB, so 15% leaves room for noise while a missing term of the estimate (the experts
unit's FSDP2 buffers alone are 18% of it) fails the test.
"""

from __future__ import annotations

import pytest

from experiments.bench.peak_memory import compare, measure, planned_bytes
from tests.dist_pool import close_pools

# 4 layers of 8 experts of 3 x 512 x 1024: 53M parameters, 26.6M per ep2 rank; 3 AdamW steps.
MODEL = [
    "data.seq_len=64", "data.global_batch_size=8", "model.hidden_size=512", "model.num_layers=4", "model.num_heads=8",
    "model.moe.num_experts=8", "model.moe.ffn_hidden_size=1024",
]  # fmt: skip


@pytest.mark.slow
def test_peak_memory_per_rank_is_within_15_percent_of_the_planner(tmp_path):
    close_pools()  # the test's gloo pool would compete for the 2 cores, not for the measured processes' memory
    ranks = measure("ep2", MODEL, tmp_path / "ep2", timeout=300)
    assert [r["rank"] for r in ranks] == [0, 1]
    figures = compare(ranks, planned_bytes("ep2", MODEL, world_size=2))
    assert figures["floor"] > 0 and figures["peak"] > figures["floor"]
    assert 0.85 <= figures["ratio"] <= 1.15, figures
