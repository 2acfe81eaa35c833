"""``gather_once_per_step``: one FSDP all-gather and reduce-scatter per optimizer step under accumulation,
with or without a pipeline (every schedule), under FSDP and HSDP.

The runs give the single-process losses, and their measured data-parallel bytes equal the planner's,
whose FSDP part no longer grows with the micro-batches or the pipeline steps.
"""

from __future__ import annotations

import csv
import dataclasses

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


@pytest.mark.slow
def test_an_evaluation_inside_an_optimizer_step_under_a_pipeline_is_refused(tmp_path):
    """Validation after one of the 4 pipeline steps of an optimizer step would discard the gradients the
    stages hold unreduced: the run stops with the fix instead of training on wrong gradients."""
    overrides = [*PP2_DP2, "parallel.pp_microbatches=2", "parallel.gather_once_per_step=true", "trainer.max_steps=2",
                 "trainer.val_check_interval=1", "trainer.limit_val_batches=1"]  # fmt: skip
    with pytest.raises(Exception, match=r"evaluation forward ran in the middle of an optimizer step"):
        train_in_pool(tmp_path / "run", *overrides, base=PP_RUN)


@pytest.mark.slow
def test_gathering_once_under_a_pipeline_sends_the_planned_dp_bytes_whatever_the_micro_batches(tmp_path):
    """pp2 x dp2, 8 micro-batches per optimizer step in 1 pipeline step or in 4 of 2: the measured dp
    bytes are the planner's to the byte, the same for both, and under a fifth of gathering per
    micro-batch (whose planned bytes equal the measured ones: tests/test_planner.py, pp presets).
    DualPipeV without the option gathers once per pipeline step (2 of 4 here), and its middle stage
    boundary stays on one rank: dp and pp to the byte too."""
    once = {}
    for microbatches in (8, 2):
        overrides = [*PP2_DP2, f"parallel.pp_microbatches={microbatches}", "parallel.gather_once_per_step=true"]
        measured = _measured_bytes(tmp_path / f"mb{microbatches}", overrides)["dp"]
        assert measured == pytest.approx(_planned_bytes(overrides)["dp"], abs=0.5), microbatches
        once[microbatches] = measured
    assert once[8] == once[2] > 0
    per_micro_batch = _planned_bytes([*PP2_DP2, "parallel.pp_microbatches=8"])["dp"]
    assert once[8] * 5 <= per_micro_batch, (once, per_micro_batch)

    dualpipev = ["parallel=pp2_ep2_dualpipev"]
    measured, planned = _measured_bytes(tmp_path / "dualpipev", dualpipev), _planned_bytes(dualpipev)
    assert measured["dp"] == pytest.approx(planned["dp"], abs=0.5) and measured["dp"] > 0, (measured, planned)
    assert measured["pp"] == pytest.approx(planned["pp"], abs=0.5) and measured["pp"] > 0, (measured, planned)


def _planned_bytes(overrides: list[str]) -> dict[str, float]:
    return accounted_comm_bytes(ModelShape.from_config(PP_MODEL), _pp_layout(overrides), SEQ, precision="32-true")


def _measured_bytes(run_dir, overrides: list[str]) -> dict[str, float]:
    # Clipping's norm all-reduces are not in the planner: the bytes come from a run without it.
    train_in_pool(run_dir, *overrides, "trainer.max_steps=3", "++trainer.gradient_clip_val=null", "logger=csv",
                  "trainer.log_every_n_steps=1", "~callbacks.progress_bar", base=PP_RUN)  # fmt: skip
    rows = [r for r in csv.DictReader((run_dir / "csv" / "metrics.csv").open()) if r.get("comm/dp_bytes")]
    return {d: float(rows[-1][f"comm/{d}_bytes"]) for d in PARALLEL_DIMS}  # the last step: no set-up


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
        # the other schedules: GPipe (one pipeline step of 8) and ZB-V (2 pipeline steps of 4, ep2)
        pytest.param([*PP2_DP2, "parallel.pp_schedule=GPipe", "parallel.pp_microbatches=8"], id="GPipe_dp2"),
        pytest.param(
            ["parallel=pp2_ep2_dualpipev", "parallel.pp_schedule=ZBVZeroBubble", "parallel.overlap_ep_comm=false"],
            id="ZBVZeroBubble_ep2",
        ),  # fmt: skip
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


def test_the_search_offers_gathering_once_under_a_pipeline_where_it_saves_bytes():
    """Under pp the search tries ``gather_once_per_step`` with 1F1B, GPipe and Interleaved1F1B, whose
    units gather per micro-batch otherwise, but not with the V schedules, which gather once per
    pipeline step already (one pipeline step per optimizer step in the search); under HSDP too."""
    from lightning_moe.planner import enumerate_layouts

    layouts = list(enumerate_layouts(8, ModelShape.from_config(PP_MODEL), SEQ, 16, gpus_per_node=2))
    once = [lay for lay in layouts if lay.gather_once_per_step]
    assert {lay.pp_schedule for lay in once if lay.pp > 1} >= {"1F1B", "Interleaved1F1B"}
    assert not any(lay.v_schedule for lay in once) and any(lay.v_schedule for lay in layouts)
    assert any(lay.hsdp and lay.pp > 1 for lay in once)
    # Twins differ in bytes: the option is offered only where it changes them.
    for lay in once:
        base = dataclasses.replace(lay, gather_once_per_step=False)
        shape = ModelShape.from_config(PP_MODEL)
        assert accounted_comm_bytes(shape, lay, SEQ)["dp"] < accounted_comm_bytes(shape, base, SEQ)["dp"], lay.label()


def test_a_plan_names_the_gathering_setting_of_the_ranked_variant():
    """A requested layout that gathers once but does not fit the memory budget, where gathering per
    micro-batch fits: the report says the request is not ranked and which setting trains the variant."""
    from lightning_moe.planner import Layout, estimate, memory_per_rank, plan
    from lightning_moe.planner.report import format_same_sizes
    from tests.test_planner import cluster

    shape, h100 = ModelShape.from_config(PP_MODEL), cluster("h100_sxm")
    sizes = dict(dp=4, micro_batch_size=1, microbatches=4)
    once, per_micro_batch = Layout(**sizes, gather_once_per_step=True), Layout(**sizes)
    needs = {lay: memory_per_rank(shape, lay, SEQ, "32-true")[0].total("none") for lay in (once, per_micro_batch)}
    assert needs[once] > needs[per_micro_batch]
    budget = (needs[once] + needs[per_micro_batch]) / 2
    options = dict(seq_len=SEQ, global_batch_size=16, precision="32-true", memory_budget=budget)
    result = plan(4, shape, h100, micro_batch_sizes=[1], **options)
    requested = estimate(shape, once, h100, SEQ, 16, precision="32-true", memory_budget=budget)
    assert not requested.fits
    text = format_same_sizes(requested, result)
    assert text.startswith("Not ranked: the requested layout does not fit"), text
    assert "parallel.gather_once_per_step=false" in text, text
