"""The V pipeline schedules (``pp_schedule="DualPipeV"`` / ``"ZBVZeroBubble"``): two stages per rank placed
in a V, the split backward's gradients reduced after the step, evaluation through the V.

DualPipeV with ``overlap_ep_comm`` (the ``pp2_ep2_dualpipev`` preset) is compared with one process by
test_strategy_invariance.py's preset test; here ZB-V, with validation.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_moe import MoE5DStrategy
from lightning_moe.parallel.plans.pipeline import check_pipeline_config, stage_ids, stage_rank
from tests.cli import train_in_pool
from tests.presets import NEEDS_V_SCHEDULE_TORCH

REL = 1e-5


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_the_v_places_the_first_and_last_stage_on_rank_0(pp):
    placed = {rank: stage_ids(rank, pp, 2, v_shape=True) for rank in range(pp)}
    assert placed[0] == [0, 2 * pp - 1] and placed[pp - 1] == [pp - 1, pp]
    assert sorted(s for stages in placed.values() for s in stages) == list(range(2 * pp))
    assert all(stage_rank(stage, pp, v_shape=True) == rank for rank, stages in placed.items() for stage in stages)
    assert all(stage_rank(stage, pp) == rank for rank in range(pp) for stage in stage_ids(rank, pp, 3))


@NEEDS_V_SCHEDULE_TORCH
@pytest.mark.parametrize("schedule", ["DualPipeV", "ZBVZeroBubble"])
def test_the_v_schedules_name_what_they_need(schedule):
    check_pipeline_config(2, schedule, microbatches=4, stages_per_rank=2)
    with pytest.raises(
        ValueError, match=rf"pp_schedule={schedule} runs two stages per rank .* set pp_stages_per_rank=2"
    ):
        check_pipeline_config(2, schedule, microbatches=4, stages_per_rank=1)
    with pytest.raises(ValueError, match=r"pp_microbatches >= the number of stages 2\*pp = 4, got 2"):
        check_pipeline_config(2, schedule, microbatches=2, stages_per_rank=2)
    with pytest.raises(MisconfigurationException, match=r"set pp_stages_per_rank=2"):
        MoE5DStrategy(pp=2, pp_schedule=schedule, pp_microbatches=4)


def test_an_older_torch_is_refused_before_any_work(monkeypatch):
    import lightning_moe._compat.pipelining

    monkeypatch.setattr(lightning_moe._compat.pipelining, "_torch_version", lambda: (2, 11))
    with pytest.raises(
        MisconfigurationException, match=r"pp_schedule='DualPipeV' needs torch >= 2.13, found .*use pp_schedule='1F1B'"
    ):
        MoE5DStrategy(pp=2, pp_schedule="DualPipeV", pp_stages_per_rank=2, pp_microbatches=4)


@NEEDS_V_SCHEDULE_TORCH
def test_only_dualpipev_interleaves_a_pipeline_for_overlap_ep_comm():
    kwargs = {"pp": 2, "ep": 2, "pp_stages_per_rank": 2, "pp_microbatches": 4, "overlap_ep_comm": True}
    assert MoE5DStrategy(pp_schedule="DualPipeV", **kwargs).overlap_ep_comm
    with pytest.raises(
        MisconfigurationException,
        match=r"needs pp_schedule='DualPipeV' .*pp_schedule='ZBVZeroBubble' runs one micro-batch",
    ):
        MoE5DStrategy(pp_schedule="ZBVZeroBubble", **kwargs)


def _validation_losses(run_dir: Path) -> list[float]:
    rows = csv.DictReader((run_dir / "csv" / "metrics.csv").open())
    return [float(row["val/loss"]) for row in rows if row.get("val/loss")]


@pytest.mark.slow
def test_zbv_trains_and_validates_as_one_process(tmp_path):
    """pp2 x ep2 under ZB-V (4 stages of one layer, 4 micro-batches): per-step training losses and the
    validation losses every 2 optimizer steps equal one process's (rel 1e-5). One process runs 8 loader
    batches a step, ZB-V one Lightning batch of 4 on each of its 2 data ranks: validating on the same
    8 loader batches is val_check_interval 16 / limit 8 on one process and 2 / 1 under ZB-V."""
    common = ["model.num_layers=4", "data.global_batch_size=16", "trainer.max_steps=6", "logger=csv",
              "trainer.log_every_n_steps=1"]  # fmt: skip
    single = train_in_pool(tmp_path / "single", "parallel=single", *common, "trainer.val_check_interval=16",
                           "trainer.limit_val_batches=8")  # fmt: skip
    zbv = train_in_pool(tmp_path / "zbv", "parallel=pp2_ep2_dualpipev", "parallel.pp_schedule=ZBVZeroBubble",
                        "parallel.overlap_ep_comm=false", *common, "trainer.val_check_interval=2", "trainer.limit_val_batches=1")  # fmt: skip
    assert zbv["layout"]["pp"] == 2 and zbv["layout"]["ep"] == 2
    torch.testing.assert_close(torch.tensor(zbv["losses"]), torch.tensor(single["losses"]), rtol=REL, atol=0.0)
    single_val, zbv_val = _validation_losses(tmp_path / "single"), _validation_losses(tmp_path / "zbv")
    assert len(single_val) == len(zbv_val) == 3
    torch.testing.assert_close(torch.tensor(zbv_val), torch.tensor(single_val), rtol=REL, atol=0.0)
