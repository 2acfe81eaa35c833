"""``experiments/bench/checkpoint_save.py`` (part of ``make bench``) in its smoke sizes: both runs
train, the save steps and periods are measured for sync and async saves, and nothing is left in the
temporary folder. The runs go to the test pool instead of new CLI processes (the same config and
``fit``; tests/cli.py). No timing is asserted."""

from __future__ import annotations

import tempfile

import pytest

from experiments.bench import checkpoint_save
from tests.cli import train_in_pool


@pytest.mark.slow
def test_checkpoint_save_bench_smoke_measures_sync_and_async_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the bench's folder goes
    monkeypatch.setattr(
        checkpoint_save, "run_training", lambda overrides, run_dir: train_in_pool(run_dir, *overrides, base=())
    )
    result = checkpoint_save.run(smoke=True)
    assert list(tmp_path.glob("lmoe_bench_ckpt_*")) == []
    assert [row["saves"] for row in result["rows"]] == ["sync", "async"]
    for row in result["rows"]:
        assert row["saves measured"] == 2, "saves at steps 2 and 4 of 5 (step 1 is warm-up, step 5 has no successor)"
        assert (
            row["checkpoint MB"] > 0
            and row["plain step ms"] > 0
            and row["save step / plain"] > 0
            and row["period / plain"] > 0
        )
