"""Multi-token prediction in the planner (``lightning_moe.planner.mtp``): the MTP depths' parameters,
gradients and optimizer states, FSDP2 units, activations, logits and memory-bound traffic on the
last pipeline stage, the last stage's embedding copy under pp > 1, and the last stage's time. Hand
counts on a toy MoE model (hidden 64, 4 heads, 4 experts of FFN 64, top-2, vocab 256, fp32)."""

from __future__ import annotations

import pytest

from lightning_moe.planner import Cluster, Layout, ModelShape, estimate, memory_per_rank
from lightning_moe.planner.elementwise import elementwise_bytes_per_microbatch
from lightning_moe.planner.memory import activation_bytes_per_layer
from lightning_moe.planner.step_time import forward_seconds_by_kind

SEQ = 32
FP32 = 4
H, V = 64, 256
# One MTP depth's parameters, the block built like the last (MoE) layer:
ATTENTION = 4 * H * H + 2 * H  # wq, wk, wv, wo and the block's two norms: 16,512
MOE = 3 * 4 * H * 64 + 4 * H  # 4 experts' w1, w3, w2 and the router: 49,408
PER_TOKEN = 2 * H * H + 3 * H  # eh_proj [64, 128], enorm, hnorm, norm: 8,384
MTP_DEPTH_PARAMETERS = ATTENTION + MOE + PER_TOKEN  # 74,304
EMBEDDING = V * H  # the last stage's copy under pp > 1


def toy(mtp_depth: int) -> ModelShape:
    return ModelShape.from_config({
        "vocab_size": V, "hidden_size": H, "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 128, "mtp_depth": mtp_depth,
        "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 64},
    })  # fmt: skip


def memory(mtp_depth: int, layout: Layout, pp_rank: int | None = None):
    return memory_per_rank(toy(mtp_depth), layout, SEQ, "32-true", pp_rank=pp_rank)


@pytest.mark.parametrize("depth", [1, 2])
def test_each_depth_adds_a_blocks_eh_proj_and_norms_parameters_gradients_and_adam_states(depth):
    (base, _), (mtp, _) = memory(0, Layout()), memory(depth, Layout())
    assert mtp.parameters - base.parameters == FP32 * depth * MTP_DEPTH_PARAMETERS
    assert mtp.gradients - base.gradients == FP32 * depth * MTP_DEPTH_PARAMETERS
    assert mtp.optimizer - base.optimizer == 2 * FP32 * depth * MTP_DEPTH_PARAMETERS


def test_the_depths_shard_as_a_layer_does():
    """ep2 on 2 ranks: attention, router, eh_proj and norms sharded by FSDP2 over the dense group of 2
    (64 rows -> 32), the experts split over ep (2 of 4 per rank): half of every term."""
    (base, _), (mtp, _) = memory(0, Layout(ep=2)), memory(1, Layout(ep=2))
    assert mtp.parameters - base.parameters == FP32 * MTP_DEPTH_PARAMETERS // 2


def test_under_pp_the_last_stage_holds_the_depths_and_an_embedding_copy():
    layout = Layout(pp=2)
    mem, pp_rank = memory(1, layout)
    assert pp_rank == 1  # MTP makes the last stage the busiest
    # layer 1 (attention + MoE), final norm, output, the MTP depth and the embedding copy
    last_stage = ATTENTION + MOE + H + V * H + MTP_DEPTH_PARAMETERS + EMBEDDING
    assert mem.parameters == FP32 * last_stage
    base, base_rank = memory(0, layout)
    assert base_rank == 1 and base.parameters == FP32 * (ATTENTION + MOE + H + V * H)


def test_fsdp_buffers_hold_the_mtp_unit_and_the_embedding_copy_gathered_as_roots_under_pp():
    """pp2, one micro-batch per pipeline step: every top-level unit of the last stage is a root,
    gathered from forward to backward; the new roots are ``mtp`` (one depth's attention, router,
    eh_proj and norms) and the embedding copy; the depth's experts are a nested unit as large as the
    layer's, so the largest nested unit and the reduce-scatter input stay."""
    (base, _), (mtp, _) = memory(0, Layout(pp=2)), memory(1, Layout(pp=2))
    mtp_unit = ATTENTION + 4 * H + PER_TOKEN  # 25,152
    assert mtp.fsdp_buffers - base.fsdp_buffers == FP32 * (mtp_unit + EMBEDDING)


def test_activations_and_logits_of_each_depth():
    """One micro-batch of 32 tokens on one rank, no checkpointing: per depth an MoE block's
    activations, enorm's and hnorm's inputs, their concatenation and the final norm's input and
    output (6 x hidden per token), and one more set of logits (fp32 logits, fp32 copy and gradient)."""
    block = activation_bytes_per_layer(toy(1), Layout(), SEQ, 1, "none", "32-true")
    # hand count of the MoE block: attention (norm in/out, q/k/v, output, o-proj input, log-sum-exp),
    # then norm in/out, router logits, expert input and output rows, gate/up/product of 64 rows
    attention = SEQ * FP32 * 2 * H + SEQ * FP32 * (H + 3 * H + H) + SEQ * 4 * FP32
    ffn = SEQ * FP32 * 2 * H + SEQ * FP32 * 4 + 2 * SEQ * FP32 * 2 * H + 2 * SEQ * FP32 * 3 * 64
    assert block == attention + ffn == 156_672
    for depth in (1, 2):
        (base, _), (mtp, _) = memory(0, Layout()), memory(depth, Layout())
        assert mtp.activations["none"] - base.activations["none"] == depth * (block + SEQ * 6 * H * FP32)
        assert mtp.logits == (1 + depth) * base.logits == (1 + depth) * SEQ * V * (FP32 + 2 * FP32)
    selective = activation_bytes_per_layer(toy(1), Layout(), SEQ, 1, "selective", "32-true")
    (base, _), (mtp, _) = memory(0, Layout()), memory(1, Layout())
    assert mtp.activations["selective"] - base.activations["selective"] == selective + SEQ * 6 * H * FP32


def test_the_last_stage_counts_its_micro_batches_in_flight_for_the_depths():
    """pp2 1F1B with 4 micro-batches: the last rank holds 1 in flight; under GPipe all 4."""
    for schedule, in_flight in (("1F1B", 1), ("GPipe", 4)):
        layout = Layout(pp=2, microbatches=4, pp_schedule=schedule)
        (base, _), (mtp, _) = memory(0, layout, pp_rank=1), memory(1, layout, pp_rank=1)
        block = activation_bytes_per_layer(toy(1), layout, SEQ, 1, "none", "32-true")
        assert mtp.activations["none"] - base.activations["none"] == in_flight * (block + SEQ * 6 * H * FP32)


def test_memory_bound_traffic_of_each_depth():
    """Per token: a layer of the last layer's kind, enorm, hnorm, concatenation and the final norm
    (10 x hidden elements), and a loss over the vocabulary; only on the last stage."""
    layer = elementwise_bytes_per_microbatch(toy(0), Layout(), SEQ, [1], False, "32-true")
    loss = elementwise_bytes_per_microbatch(toy(0), Layout(), SEQ, [], True, "32-true")
    assert loss == SEQ * V * (FP32 + 3 * FP32)
    for depth in (1, 2):
        with_mtp = elementwise_bytes_per_microbatch(toy(depth), Layout(), SEQ, [0, 1], True, "32-true")
        base = elementwise_bytes_per_microbatch(toy(0), Layout(), SEQ, [0, 1], True, "32-true")
        assert with_mtp - base == depth * (layer + SEQ * 10 * H * FP32 + loss)
    assert elementwise_bytes_per_microbatch(toy(1), Layout(), SEQ, [0], False, "32-true") == layer


TOY = Cluster(name="toy", gpus_per_node=8, memory_bytes=1e12, peak_flops=1e9, hbm_bandwidth=1e12, intra_node_bandwidth=1e9,
              inter_node_bandwidth=1e9, gemm_efficiency=1.0, grouped_gemm_efficiency=1.0, attention_efficiency=1.0,
              comm_efficiency=1.0, collective_latency=0.0)  # fmt: skip
# Forward FLOPs of one micro-batch of 32 tokens: an MoE block (q/k/v/o projections, the causal
# attention core, router, 2 routed experts a token), the output head, one MTP depth's eh_proj and head.
BLOCK = 2 * SEQ * 4 * H * H + SEQ * SEQ * 4 * (16 + 16) + 2 * SEQ * H * 4 + 2 * SEQ * 2 * 3 * H * 64  # 2,768,896
HEAD = 2 * SEQ * H * V  # 1,048,576
MTP_EXTRA = 2 * SEQ * (2 * H * H + H * V)  # 1,572,864


def test_the_last_stage_with_its_depths_sets_the_pipelines_pace():
    """pp2: rank 0 computes layer 0; rank 1 layer 1, the head and the MTP depth, the slowest stage,
    whose forward sets every micro-batch's compute (and the bubble's, (p-1) of its micro-batches)."""
    layout = Layout(pp=2, microbatches=4)
    base = forward_seconds_by_kind(toy(0), layout, TOY, SEQ)
    mtp = forward_seconds_by_kind(toy(1), layout, TOY, SEQ)
    assert sum(base.values()) == pytest.approx((BLOCK + HEAD) / 1e9)
    assert sum(mtp.values()) == pytest.approx((2 * BLOCK + HEAD + MTP_EXTRA) / 1e9)
    est = estimate(toy(1), layout, TOY, SEQ, 4, precision="32-true", load_imbalance=1.0)
    assert est.compute_time == pytest.approx(3 * 4 * (2 * BLOCK + HEAD + MTP_EXTRA) / 1e9)
    assert est.bubble_fraction == pytest.approx(1 / 5)
    # the step: the slowest stage's 4 + (p - 1) micro-batches, plus what the rest adds (P2P, optimizer),
    # and after the last backward the gradient sum of the embedding's two copies (V x H fp32 between 2 ranks)
    end = est.end_of_step_reduction_time
    assert end == pytest.approx(V * H * 4 / 1e9)
    rest = est.step_time - est.compute_time / (1 - est.bubble_fraction)
    assert rest == pytest.approx((est.exposed_comm_time - end) / (1 - est.bubble_fraction) + end + est.optimizer_time)
    assert est.memory_pp_rank == 1


def test_a_v_schedule_places_the_depths_on_rank_0_with_the_first_stage():
    layout = Layout(pp=2, microbatches=4, pp_schedule="ZBVZeroBubble", pp_stages_per_rank=2)
    (mtp, rank) = memory(1, layout)
    assert rank == 0
    base, _ = memory(0, layout)
    assert mtp.parameters - base.parameters == FP32 * (MTP_DEPTH_PARAMETERS + EMBEDDING)


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(ep=2)], ids=["tp2", "ep2"])
def test_the_depths_planned_shards_are_the_ones_parallelize_builds(layout):
    """Dry run on the fake process group (pp = 1): every rank's MTP parameters (``mtp.0.*``,
    ``mtp.1.*``) have the local shapes the planner gives them."""
    from hydra import compose, initialize_config_dir

    from lightning_moe.conf import CONF_DIR
    from lightning_moe.plan import dry_run

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        model = compose("plan", overrides=["model=tiny", "model.mtp_depth=2"]).model
    views = dry_run(model, layout)
    assert all(v.matches for v in views), [v.mismatches for v in views]
    assert all(any(name.startswith("mtp.1.block.") for name in v.shapes) for v in views)


def test_fsdp_gathers_and_reduces_the_depths_parameters():
    """ep2 (the dense FSDP group: 2 ranks), one micro-batch, fp32: the depth's attention, router,
    eh_proj and norms join the root unit, gathered once (the root is not resharded) and
    reduce-scattered once, each rank sending its half; its experts' group (edp) is 1 rank: no traffic."""
    from lightning_moe.planner import comm_records

    def dp_bytes(depth: int) -> float:
        return sum(r.bytes for r in comm_records(toy(depth), Layout(ep=2), SEQ, "32-true") if r.dim == "dp")

    rest = (ATTENTION + 4 * H + PER_TOKEN) // 2  # one rank's shard
    assert dp_bytes(1) - dp_bytes(0) == 2 * FP32 * rest
