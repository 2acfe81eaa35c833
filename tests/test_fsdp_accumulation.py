"""``gather_once_per_step``: one FSDP all-gather and reduce-scatter per optimizer step under accumulation.

The run gives the single-process losses, and its measured data-parallel bytes equal the planner's,
whose FSDP part no longer grows with the accumulation count.
"""

from __future__ import annotations

import csv

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_moe.conf import CONF_DIR
from lightning_moe.layout import PARALLEL_DIMS
from lightning_moe.planner import ModelShape, accounted_comm_bytes, comm_records
from lightning_moe.planner.presets import layout_from_parallel
from tests.cli import TINY_RUN, train_in_pool

# The model of TINY_RUN (as tests/test_planner.py spells it for the planner).
TINY = {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 128,
        "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32}}  # fmt: skip
SEQ, GLOBAL_BATCH, MICRO_BATCH = 32, 16, 2  # dp2: 4 micro-batches per optimizer step and rank
RUN = [*TINY_RUN, f"data.global_batch_size={GLOBAL_BATCH}", "trainer.max_steps=3", "logger=csv",
       "trainer.log_every_n_steps=1", "~callbacks.progress_bar"]  # fmt: skip


def _dp2_layout(gather_once: bool, global_batch: int = GLOBAL_BATCH):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        parallel = compose("plan", overrides=["parallel=dp2"]).parallel
    parallel = {**parallel, "gather_once_per_step": gather_once}
    return layout_from_parallel(parallel, 2, global_batch, MICRO_BATCH)


def _fsdp_bytes(gather_once: bool, global_batch: int) -> float:
    layout = _dp2_layout(gather_once, global_batch)
    records = comm_records(ModelShape.from_config(TINY), layout, SEQ, precision="32-true")
    return sum(r.bytes for r in records if r.what.startswith("FSDP"))


def test_planned_fsdp_bytes_stop_growing_with_the_accumulation_count():
    per_micro_batch = [_fsdp_bytes(False, g) for g in (8, 16, 32)]  # 2, 4, 8 micro-batches per step
    once = [_fsdp_bytes(True, g) for g in (8, 16, 32)]
    assert per_micro_batch[1] == 2 * per_micro_batch[0] and per_micro_batch[2] == 4 * per_micro_batch[0]
    assert once[0] == once[1] == once[2] > 0
    # One gather and one reduce-scatter per unit, against 2 gathers (1 for the root) and 1 reduce-scatter per micro-batch.
    assert once[0] < per_micro_batch[0] / 2


def test_gather_once_per_step_is_refused_where_it_cannot_work():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_moe import MoE5DStrategy

    with pytest.raises(
        MisconfigurationException, match=r"gather_once_per_step=True needs data_parallel='fsdp' and pp=1"
    ):
        MoE5DStrategy(ep=2, pp=2, gather_once_per_step=True)
    with pytest.raises(MisconfigurationException, match=r"data_parallel='ddp'"):
        MoE5DStrategy(data_parallel="ddp", gather_once_per_step=True)


@pytest.mark.slow
def test_dp2_gathering_once_per_step_matches_one_process_and_the_planned_bytes(tmp_path):
    # Gradient clipping (on in RUN) makes a mis-scaled gradient change the curve; its norm
    # all-reduces are not in the planner, so the bytes come from a run without it.
    once = train_in_pool(tmp_path / "once", "parallel=dp2", "parallel.gather_once_per_step=true", base=RUN)
    single = train_in_pool(tmp_path / "single", "parallel=single", base=RUN)
    torch.testing.assert_close(torch.tensor(once["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0.0)

    train_in_pool(
        tmp_path / "bytes",
        "parallel=dp2",
        "parallel.gather_once_per_step=true",
        "++trainer.gradient_clip_val=null",
        base=RUN,
    )
    rows = [r for r in csv.DictReader((tmp_path / "bytes" / "csv" / "metrics.csv").open()) if r.get("comm/dp_bytes")]
    measured = {d: float(rows[-1][f"comm/{d}_bytes"]) for d in PARALLEL_DIMS}  # the last step: no set-up
    planned = accounted_comm_bytes(ModelShape.from_config(TINY), _dp2_layout(True), SEQ, precision="32-true")
    assert measured["dp"] == pytest.approx(planned["dp"], abs=0.5), (measured, planned)
