"""The planner's V schedules (``ZBVZeroBubble``, ``DualPipeV``): placement, the bubble and the
activations in flight from torch's action lists played out with unit costs, ``DualPipeV``'s
overlapped pairs, enumeration and refusals. Small pp and micro-batch counts, checkable by hand.
"""

from __future__ import annotations

import pytest

from lightning_moe.planner import Cluster, Layout, ModelShape, enumerate_layouts, estimate, layout_problems
from lightning_moe.planner.candidate import edge_pp_ranks, holds_first_stage, holds_last_stage, rank_stages
from lightning_moe.planner.step_time import overlapped_pairs, pipeline_bubble
from lightning_moe.planner.v_schedules import Action, rank_actions, v_schedule_timeline

SEQ = 32


def toy_model(layers: int = 8) -> ModelShape:
    return ModelShape.from_config({
        "vocab_size": 256, "hidden_size": 64, "num_layers": layers, "num_heads": 4, "ffn_hidden_size": 128,
        "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 64},
    })  # fmt: skip


def toy_cluster() -> Cluster:
    return Cluster(
        name="toy", gpus_per_node=64, memory_bytes=1e12, peak_flops=1e9, hbm_bandwidth=1e12,
        intra_node_bandwidth=1e6, inter_node_bandwidth=1e6, gemm_efficiency=1.0,
        grouped_gemm_efficiency=1.0, attention_efficiency=1.0, comm_efficiency=1.0, collective_latency=0.0,
    )  # fmt: skip


def v_layout(schedule: str, pp: int = 2, microbatches: int = 4, **options) -> Layout:
    return Layout(pp=pp, microbatches=microbatches, pp_schedule=schedule, pp_stages_per_rank=2, **options)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_placement_puts_the_first_and_the_last_stage_on_rank_0(schedule):
    layout = v_layout(schedule, pp=4, microbatches=8)
    assert [rank_stages(layout, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert holds_first_stage(layout, 0) and holds_last_stage(layout, 0)
    assert not any(holds_last_stage(layout, r) or holds_first_stage(layout, r) for r in (1, 2, 3))
    assert edge_pp_ranks(layout) == [0, 3]
    # the loop placement of the interleaved schedule is unchanged: the last stage on the last rank
    assert rank_stages(Layout(pp=4, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2), 0) == [0, 4]


def test_zbv_on_two_ranks_and_four_microbatches_plays_out_by_hand():
    """Rank 0 (stages 0, 3) starts with F0 F1 F2 of stage 0 and then stage 3's F0, which micro-batch 0
    reaches at 3 (stage 0 at 1, rank 1's stages 1 and 2 by 3): no wait. Each rank computes 2 stages x
    4 micro-batches x (F + I + W) = 24 units; the step takes 25, rank 1 having waited for stage 0's
    first forward."""
    assert [a for (a,) in rank_actions("ZBVZeroBubble", 2, 4, 0)][:4] == [
        Action("F", 0, 0),
        Action("F", 0, 1),
        Action("F", 0, 2),
        Action("F", 3, 0),
    ]
    timeline = v_schedule_timeline("ZBVZeroBubble", 2, 4)
    assert (timeline.makespan, timeline.busy) == (25.0, 24.0)
    assert pipeline_bubble(v_layout("ZBVZeroBubble")) == pytest.approx(1 / 25)
    # 1F1B on the same 2 ranks and 4 micro-batches: (p - 1) / (m + p - 1) = 1/5
    assert pipeline_bubble(Layout(pp=2, microbatches=4)) == pytest.approx(1 / 5)


def test_dualpipev_on_two_ranks_and_four_microbatches_plays_out_by_hand():
    """Rank 0's list: F0 F1 F2 (stage 0), F0 I0 W0 F1 (stage 3), then the pairs (0F3; 3B1), (3F2; 0B0),
    3B2, (3F3; 0B1), 3B3 and the zero-bubble tail 0I2 0W2 0I3 0W3: three OVERLAP_F_B."""
    steps = rank_actions("DualPipeV", 2, 4, 0)
    pairs = [step for step in steps if len(step) == 2]
    assert pairs[0] == (Action("F", 0, 3), Action("B", 3, 1))
    timeline = v_schedule_timeline("DualPipeV", 2, 4)
    assert timeline.overlapped_pairs == (3, 3)
    assert (timeline.makespan, timeline.busy) == (26.0, 24.0)
    assert pipeline_bubble(v_layout("DualPipeV")) == pytest.approx(2 / 26)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
@pytest.mark.parametrize("pp,microbatches", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_v_bubbles_are_below_1f1b_and_shrink_with_microbatches(schedule, pp, microbatches):
    one_f_one_b = pipeline_bubble(Layout(pp=pp, microbatches=microbatches))
    bubble = pipeline_bubble(v_layout(schedule, pp, microbatches))
    assert 0 < bubble < one_f_one_b
    assert pipeline_bubble(v_layout(schedule, pp, 2 * microbatches)) < bubble


def test_activations_in_flight_follow_the_action_order():
    """ZB-V holds 2 pp stage activation sets on every rank (pp micro-batches of the whole rank, as
    1F1B's first rank); DualPipeV one more, its paired forward's, freed by the paired backward."""
    assert v_schedule_timeline("ZBVZeroBubble", 4, 8).in_flight == (8, 8, 8, 8)
    assert v_schedule_timeline("DualPipeV", 4, 8).in_flight == (9, 9, 9, 9)


def test_memory_counts_the_v_schedules_activations_in_flight():
    """Per rank the two stages hold 2 layers each: 8 sets of 2 layers is 4 whole-rank micro-batches,
    as many as 1F1B's first rank (pp = 4); DualPipeV's 9 sets are 4.5."""
    model, cluster = toy_model(), toy_cluster()
    per_rank = {}
    for schedule in ("1F1B", "ZBVZeroBubble", "DualPipeV"):
        stages = 1 if schedule == "1F1B" else 2
        layout = Layout(pp=4, microbatches=8, pp_schedule=schedule, pp_stages_per_rank=stages)
        per_rank[schedule] = estimate(model, layout, cluster, SEQ, 8, precision="32-true").memory
    assert per_rank["ZBVZeroBubble"].activations["none"] == pytest.approx(per_rank["1F1B"].activations["none"])
    assert per_rank["DualPipeV"].activations["none"] == pytest.approx(per_rank["1F1B"].activations["none"] * 4.5 / 4)


def test_dualpipev_overlap_pairs_are_its_overlapped_actions_on_the_first_rank():
    """Rank r has 2 (m - 2 pp + r + 1) + (pp - r - 1) OVERLAP_F_B (one fewer on the last rank, whose
    first pair runs apart): 2m - 3pp + 1 on rank 0, the fewest. Each pairs half the rank's layers."""
    timeline = v_schedule_timeline("DualPipeV", 4, 8)
    assert timeline.overlapped_pairs == (5, 6, 7, 7)
    assert overlapped_pairs(v_layout("DualPipeV", 4, 8, ep=2, overlap_ep_comm=True)) == 5 / 2
    assert overlapped_pairs(Layout(ep=2, microbatches=8, gather_once_per_step=True, overlap_ep_comm=True)) == 7
    # two pipeline steps per optimizer step pair twice as many
    assert overlapped_pairs(v_layout("DualPipeV", 4, 16, pp_microbatches=8, ep=2, overlap_ep_comm=True)) == 5


def test_overlap_ep_comm_is_taken_under_dualpipev_only():
    model = toy_model()
    assert not layout_problems(model, v_layout("DualPipeV", ep=2, overlap_ep_comm=True), SEQ, 8)
    assert not layout_problems(model, v_layout("DualPipeV", ep=2, dp=2, dp_replicate=2, overlap_ep_comm=True), SEQ, 16)
    zbv = layout_problems(model, v_layout("ZBVZeroBubble", ep=2, overlap_ep_comm=True), SEQ, 8)
    assert any("needs pp_schedule='DualPipeV'" in p for p in zbv)
    checkpointed = layout_problems(model, v_layout("DualPipeV", ep=2, overlap_ep_comm=True), SEQ, 8, "selective")
    assert any("activation_checkpointing='none'" in p for p in checkpointed)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_schedules_need_two_stages_per_rank_and_2pp_microbatches(schedule):
    model = toy_model()
    assert not layout_problems(model, v_layout(schedule), SEQ, 4)
    assert layout_problems(model, v_layout(schedule, microbatches=3), SEQ, 3)
    one_stage = Layout(pp=2, microbatches=4, pp_schedule=schedule)
    assert any("pp_stages_per_rank=2" in p for p in layout_problems(model, one_stage, SEQ, 4))
    assert layout_problems(toy_model(layers=6), v_layout(schedule), SEQ, 4)  # 6 layers over 4 stages


def test_enumeration_offers_the_v_schedules_where_valid_with_their_kwargs():
    layouts = list(enumerate_layouts(4, toy_model(), SEQ, 8, micro_batch_sizes=[1], folding=False))
    v = [lay for lay in layouts if lay.pp_schedule in ("ZBVZeroBubble", "DualPipeV")]
    # pp2 with 8 micro-batches (dp2 or ep2) and pp4 with 8: never pp4 with fewer than 8
    assert {(lay.pp, lay.pipeline_microbatches) for lay in v} == {(2, 8), (2, 4), (4, 8)}
    assert all(lay.pp_stages_per_rank == 2 for lay in v)
    overlapped = [lay for lay in layouts if lay.overlap_ep_comm and lay.pp > 1]
    assert overlapped and all(lay.pp_schedule == "DualPipeV" and lay.ep > 1 for lay in overlapped)
    dual = next(lay for lay in overlapped if lay.pp == 2)
    assert dual.label() == "ep2·pp2 mb1 DualPipeV pp_microbatches=4 overlap_ep_comm"
    assert dual.strategy_kwargs() == {
        "tp": 1, "cp": 1, "ep": 2, "dp": 1, "pp": 2, "etp": 1, "pp_schedule": "DualPipeV", "pp_microbatches": 4,
        "pp_stages_per_rank": 2, "overlap_ep_comm": True,
    }  # fmt: skip


def test_dualpipev_hides_the_all_to_all_in_proportion_to_its_first_ranks_pairs():
    """pp2: rank 0 has 2m - 3pp + 1 pairs, 3 at m = 4 and 11 at m = 8; each micro-batch's pair hides
    the same seconds, so the hidden time grows 11/3-fold. Without overlap_ep_comm nothing pairs."""
    model, cluster = toy_model(), toy_cluster()
    hidden = {
        m: estimate(model, v_layout("DualPipeV", microbatches=m, ep=2, overlap_ep_comm=True), cluster, SEQ, 2 * m,
                    precision="32-true").hidden_ep_comm_time["overlap_ep_comm"]
        for m in (4, 8)
    }  # fmt: skip
    assert hidden[4] > 0 and hidden[8] == pytest.approx(hidden[4] * 11 / 3)
    plain = estimate(model, v_layout("DualPipeV", ep=2), cluster, SEQ, 8, precision="32-true")
    assert plain.hidden_ep_comm_time["overlap_ep_comm"] == 0
