"""``gather_once_per_step``: one FSDP all-gather and reduce-scatter per optimizer step under accumulation,
with or without a pipeline (every schedule), under FSDP and HSDP.

The runs give the single-process losses, and their measured data-parallel bytes equal the planner's,
whose FSDP part no longer grows with the micro-batches or the pipeline steps.
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

    for data_parallel in ("ddp", "none"):
        with pytest.raises(
            MisconfigurationException,
            match=rf"gather_once_per_step=True needs data_parallel='fsdp' or 'hsdp' \(got data_parallel='{data_parallel}'\)",
        ):
            MoE5DStrategy(ep=2, pp=2, data_parallel=data_parallel, gather_once_per_step=True)
    assert MoE5DStrategy(ep=2, pp=2, gather_once_per_step=True).gather_once_per_step


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


# -- under a pipeline ------------------------------------------------------------------------------------
# Four layers (interleaved and V schedules run 4 stages), one sample per micro-batch: pp2 x dp2 runs 8
# micro-batches per optimizer step and rank.
PP_MODEL = {**TINY, "num_layers": 4}
PP_RUN = [*TINY_RUN, "model.num_layers=4", "data.global_batch_size=16", "data.micro_batch_size=1"]
PP2_DP2 = ["parallel=pp2", "trainer.devices=4"]


def _pp_layout(overrides: list[str]):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        parallel = compose("train", overrides=[*PP_RUN, *overrides]).parallel
    return layout_from_parallel(parallel, 4, 16, 1)


def _planned_dp_bytes(overrides: list[str]) -> float:
    return accounted_comm_bytes(ModelShape.from_config(PP_MODEL), _pp_layout(overrides), SEQ, precision="32-true")["dp"]


@pytest.mark.slow
def test_gathering_once_under_a_pipeline_sends_the_planned_dp_bytes_whatever_the_micro_batches(tmp_path):
    """pp2 x dp2, 8 micro-batches per optimizer step in 1 pipeline step or in 4 of 2: the measured dp
    bytes are the planner's to the byte, the same for both, and under a fifth of gathering per
    micro-batch (whose planned bytes equal the measured ones: tests/test_planner.py, pp presets)."""
    once = {}
    for microbatches in (8, 2):
        overrides = [*PP2_DP2, f"parallel.pp_microbatches={microbatches}", "parallel.gather_once_per_step=true"]
        measured = _measured_dp_bytes(tmp_path / f"mb{microbatches}", overrides)
        assert measured == pytest.approx(_planned_dp_bytes(overrides), abs=0.5), microbatches
        once[microbatches] = measured
    assert once[8] == once[2] > 0
    per_micro_batch = _planned_dp_bytes([*PP2_DP2, "parallel.pp_microbatches=8"])
    assert once[8] * 5 <= per_micro_batch, (once, per_micro_batch)


def _measured_dp_bytes(run_dir, overrides: list[str]) -> float:
    # Clipping's norm all-reduces are not in the planner: the bytes come from a run without it.
    train_in_pool(run_dir, *overrides, "trainer.max_steps=3", "++trainer.gradient_clip_val=null", "logger=csv",
                  "trainer.log_every_n_steps=1", "~callbacks.progress_bar", base=PP_RUN)  # fmt: skip
    rows = [r for r in csv.DictReader((run_dir / "csv" / "metrics.csv").open()) if r.get("comm/dp_bytes")]
    return float(rows[-1]["comm/dp_bytes"])  # the last step: no set-up


@pytest.fixture(scope="module")
def pp_single_losses(tmp_path_factory) -> list[float]:
    run = tmp_path_factory.mktemp("pp_single")
    return train_in_pool(run, "parallel=single", "trainer.max_steps=20", base=PP_RUN)["losses"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param([*PP2_DP2, "parallel.pp_microbatches=8"], id="1F1B_dp2_8_microbatches"),
        # 4 pipeline steps of 2 micro-batches: the gradients accumulate unsharded across them
        pytest.param(
            ["parallel=pp2_interleaved", "trainer.devices=4", "parallel.pp_microbatches=2"],
            id="Interleaved1F1B_dp2_4_pipeline_steps",
        ),
        # 2 pipeline steps of 4, experts on 2 ranks, paired forward and backward interleaved
        pytest.param(["parallel=pp2_ep2_dualpipev"], id="DualPipeV_ep2_overlap"),
        # 2 replica groups of 1 rank: only the replica all-reduce, once per step
        pytest.param(
            [*PP2_DP2, "parallel.data_parallel=hsdp", "parallel.dp_replicate=2", "parallel.pp_microbatches=4"],
            id="1F1B_hsdp",
        ),
        # and without a pipeline: HSDP's shard groups of 2 reduce-scatter once, then all-reduce once
        pytest.param(["parallel=dp2x2_hsdp"], id="no_pipeline_hsdp_2x2"),
    ],
)
def test_gathering_once_under_a_pipeline_or_hsdp_matches_one_process(tmp_path, pp_single_losses, overrides):
    once = train_in_pool(
        tmp_path / "once", *overrides, "parallel.gather_once_per_step=true", "trainer.max_steps=20", base=PP_RUN
    )
    torch.testing.assert_close(torch.tensor(once["losses"]), torch.tensor(pp_single_losses), rtol=1e-5, atol=0.0)
