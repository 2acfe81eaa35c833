"""The planner's model of hiding the expert-parallel token all-to-alls: ``dispatch_chunks``, the shared
expert and ``overlap_ep_comm`` (micro-batch pairing), each capped by the compute it hides behind.

Pure Python, on a toy machine whose figures make the seconds easy to check by hand: 1 GFLOP/s at
every op kind's full efficiency, no latency, no concurrency limit, collectives asynchronous; routing
balanced (``load_imbalance=1.0``: the hand counts send exactly the mean share of slots), one row per
slot (``dispatcher="alltoall"``: the hand counts are of slots).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_moe.planner import (
    Cluster,
    Layout,
    ModelShape,
    enumerate_layouts,
    estimate,
    layout_problems,
    resolve_auto_layout,
)
from lightning_moe.planner.step_time import forward_seconds_by_kind, record_seconds

SEQ = 32
HIDDEN, EXPERT_FFN, TOP_K, LAYERS = 64, 64, 2, 2
# Bytes one rank sends in a step's token all-to-alls per micro-batch of one sample, over ep2 in fp32:
# 4 exchanges (dispatch, combine, their gradients) x half of its 32 x top-2 slots x hidden x 4 bytes
# x 2 MoE layers.
TOKEN_BYTES_PER_MICROBATCH = 4 * (SEQ * TOP_K // 2) * HIDDEN * 4 * LAYERS


def toy_cluster(bandwidth: float) -> Cluster:
    return Cluster(
        name="toy", gpus_per_node=64, memory_bytes=1e12, peak_flops=1e9, hbm_bandwidth=1e12,
        intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth, gemm_efficiency=1.0,
        grouped_gemm_efficiency=1.0, attention_efficiency=1.0, comm_efficiency=1.0, collective_latency=0.0,
    )  # fmt: skip


def toy_model(**moe) -> ModelShape:
    return ModelShape.from_config({
        "vocab_size": 256, "hidden_size": HIDDEN, "num_layers": LAYERS, "num_heads": 4, "ffn_hidden_size": 128,
        "moe": {"num_experts": 4, "top_k": TOP_K, "ffn_hidden_size": EXPERT_FFN, "dispatcher": "alltoall", **moe},
    })  # fmt: skip


def ep2(microbatches: int = 4, **options) -> Layout:
    """ep2 on 2 ranks, one-sample micro-batches, gathered once per step (as overlap_ep_comm needs)."""
    return Layout(ep=2, microbatches=microbatches, gather_once_per_step=True, **options)


def token_seconds(est) -> float:
    return sum(
        record_seconds(r, est.layout, toy_cluster(BANDWIDTH))
        for r in est.records
        if r.dim == "ep" and r.routing_dependent
    )


def run(model: ModelShape, layout: Layout, bandwidth: float):
    return estimate(
        model, layout, toy_cluster(bandwidth), SEQ, 2 * layout.microbatches, precision="32-true", load_imbalance=1.0
    )


TOY_3_LAYERS = {"vocab_size": 256, "hidden_size": HIDDEN, "num_layers": 3, "num_heads": 4, "ffn_hidden_size": 128,
                "moe": {"num_experts": 4, "top_k": TOP_K, "ffn_hidden_size": EXPERT_FFN, "dispatcher": "alltoall"}}  # fmt: skip
BANDWIDTH = 1e6  # bytes/s: 32 KiB of tokens a micro-batch, 33 ms, against ~40 ms of compute
FAST, SLOW = 1e9, 1e4  # comm far below / far above the compute


def test_a_backend_with_synchronous_collectives_hides_no_token_exchange():
    """cpu_local's gloo (``fsdp_overlap=False``): every option is a no-op for the estimate."""
    synchronous = replace(toy_cluster(BANDWIDTH), fsdp_overlap=False)
    model = toy_model(dispatch_chunks=2, shared_expert_hidden_size=EXPERT_FFN)
    est = estimate(model, ep2(overlap_ep_comm=True), synchronous, SEQ, 8, precision="32-true")
    assert sum(est.hidden_ep_comm_time.values()) == 0.0


def test_the_toy_token_exchange_takes_its_bytes_over_the_bandwidth():
    est = run(toy_model(), ep2(), BANDWIDTH)
    assert sum(r.bytes for r in est.records if r.dim == "ep" and r.routing_dependent) == 4 * TOKEN_BYTES_PER_MICROBATCH
    assert token_seconds(est) == pytest.approx(4 * TOKEN_BYTES_PER_MICROBATCH / BANDWIDTH)
    # expert forward: 32 tokens x top-2 x 3 GEMMs of 64 x 64 x 2 FLOP x 2 layers at 1 GFLOP/s
    assert forward_seconds_by_kind(toy_model(), ep2(), toy_cluster(BANDWIDTH), SEQ)["expert"] == pytest.approx(
        SEQ * TOP_K * 3 * HIDDEN * EXPERT_FFN * 2 * LAYERS / 1e9
    )
    assert est.hidden_ep_comm_time == {"dispatch_chunks": 0.0, "shared_expert": 0.0, "overlap_ep_comm": 0.0}


@pytest.mark.parametrize("microbatches", [2, 4, 8])
def test_micro_batch_overlap_hides_all_but_the_unpaired_first_forward_and_last_backward(microbatches):
    """Compute ample: (m - 1)/m of the token exchange hides; exposed comm, step time drop by it."""
    model = toy_model()
    plain, paired = run(model, ep2(microbatches), FAST), run(model, ep2(microbatches, overlap_ep_comm=True), FAST)
    tokens = microbatches * TOKEN_BYTES_PER_MICROBATCH / FAST
    hidden = paired.hidden_ep_comm_time["overlap_ep_comm"]
    assert hidden == pytest.approx(tokens * (microbatches - 1) / microbatches)
    assert plain.exposed_comm_time - paired.exposed_comm_time == pytest.approx(hidden)
    assert paired.overlapped_comm_time - plain.overlapped_comm_time == pytest.approx(hidden)
    assert plain.step_time - paired.step_time == pytest.approx(hidden)


def test_micro_batch_overlap_is_capped_by_the_partners_compute():
    """Comm far above compute: each pair hides its forward's and backward's compute, 3 forwards."""
    model, layout = toy_model(), ep2(4, overlap_ep_comm=True)
    est = run(model, layout, SLOW)
    forward = sum(forward_seconds_by_kind(model, layout, toy_cluster(SLOW), SEQ).values())
    assert est.hidden_ep_comm_time["overlap_ep_comm"] == pytest.approx(3 * 3 * forward)  # (m - 1) pairs
    assert est.hidden_ep_comm_time["overlap_ep_comm"] == pytest.approx(est.compute_time * 3 / 4)


def test_micro_batch_overlap_per_pass_caps():
    """Between the two limits: a pass's comm above the forward's compute but below the backward's,
    so a pair hides the forward's compute (behind which the backward's comm flies) plus all of the
    forward's comm (behind the backward's compute)."""
    model, layout = toy_model(), ep2(2, overlap_ep_comm=True)
    forward = sum(forward_seconds_by_kind(model, layout, toy_cluster(1.0), SEQ).values())
    per_pass_bytes = TOKEN_BYTES_PER_MICROBATCH / 2  # dispatch and combine (or their gradients)
    bandwidth = per_pass_bytes / (1.5 * forward)  # each pass's comm: 1.5 forwards
    est = run(model, layout, bandwidth)
    assert est.hidden_ep_comm_time["overlap_ep_comm"] == pytest.approx(forward + 1.5 * forward)


def test_dispatch_chunks_hide_at_most_the_chunks_after_the_first_dispatch_and_before_the_last_combine():
    two, four = toy_model(dispatch_chunks=2), toy_model(dispatch_chunks=4)
    tokens = 4 * TOKEN_BYTES_PER_MICROBATCH / FAST
    assert run(two, ep2(), FAST).hidden_ep_comm_time["dispatch_chunks"] == pytest.approx(tokens / 2)
    assert run(four, ep2(), FAST).hidden_ep_comm_time["dispatch_chunks"] == pytest.approx(tokens * 3 / 4)
    # comm far above compute: only behind the expert GEMMs, forward and backward (3 forwards), 4 micro-batches
    expert = forward_seconds_by_kind(two, ep2(), toy_cluster(SLOW), SEQ)["expert"]
    assert run(two, ep2(), SLOW).hidden_ep_comm_time["dispatch_chunks"] == pytest.approx(4 * 3 * expert)
    # each chunk's exchanges are calls of their own: chunking without overlap only adds latency
    latency = Cluster(**{**toy_cluster(FAST).__dict__, "collective_latency": 1e-3})
    plain = estimate(toy_model(), ep2(), latency, SEQ, 8, precision="32-true", load_imbalance=1.0)
    chunked = estimate(two, ep2(), latency, SEQ, 8, precision="32-true", load_imbalance=1.0)
    ep_calls = sum(r.calls for r in plain.records if r.dim == "ep")
    hidden = chunked.hidden_ep_comm_time["dispatch_chunks"]
    # and each chunk's own count exchange, its bytes at the link's pace
    counts = sum(r.bytes for r in chunked.records if r.dim == "ep") - sum(
        r.bytes for r in plain.records if r.dim == "ep"
    )
    assert counts > 0
    assert chunked.exposed_comm_time + hidden - plain.exposed_comm_time == pytest.approx(
        ep_calls * 1e-3 + counts / FAST
    )


def test_a_shared_expert_hides_the_dispatch_not_the_combine():
    shared = toy_model(shared_expert_hidden_size=4 * EXPERT_FFN)  # twice the routed experts' FLOPs
    tokens = 4 * TOKEN_BYTES_PER_MICROBATCH / FAST
    assert run(shared, ep2(), FAST).hidden_ep_comm_time["shared_expert"] == pytest.approx(tokens / 2)
    small = toy_model(shared_expert_hidden_size=EXPERT_FFN)
    seconds = forward_seconds_by_kind(small, ep2(), toy_cluster(SLOW), SEQ)["shared_expert"]
    assert run(small, ep2(), SLOW).hidden_ep_comm_time["shared_expert"] == pytest.approx(4 * 3 * seconds)
    # with chunks, behind the first chunk's dispatch only; the chunks hide the rest of what they can
    both = run(toy_model(shared_expert_hidden_size=4 * EXPERT_FFN, dispatch_chunks=2), ep2(), FAST).hidden_ep_comm_time
    assert (both["shared_expert"], both["dispatch_chunks"]) == (pytest.approx(tokens / 4), pytest.approx(tokens / 2))


def test_options_together_never_hide_more_than_the_comm_or_the_compute():
    for bandwidth in (FAST, BANDWIDTH, SLOW):
        model = toy_model(shared_expert_hidden_size=EXPERT_FFN, dispatch_chunks=2)
        est = run(model, ep2(4, overlap_ep_comm=True), bandwidth)
        hidden = sum(est.hidden_ep_comm_time.values())
        assert hidden <= 4 * TOKEN_BYTES_PER_MICROBATCH / bandwidth * (1 + 1e-9)
        assert hidden <= est.compute_time * (1 + 1e-9)
        assert all(v >= 0 for v in est.hidden_ep_comm_time.values())


def test_expert_tensor_parallelism_leaves_the_layer_nothing_to_overlap_but_micro_batches_still_pair():
    """etp = tp = 2 wraps the all-to-all dispatcher in one that issues and waits at once; micro-batch
    overlap hands over inside the inner all-to-alls, so it still hides."""
    model = toy_model(dispatch_chunks=2, shared_expert_hidden_size=EXPERT_FFN)
    expert_tp = Layout(tp=2, etp=2, ep=2, microbatches=4, gather_once_per_step=True, overlap_ep_comm=True)
    est = estimate(model, expert_tp, toy_cluster(FAST), SEQ, 8, precision="32-true")
    assert est.hidden_ep_comm_time["dispatch_chunks"] == est.hidden_ep_comm_time["shared_expert"] == 0.0
    assert est.hidden_ep_comm_time["overlap_ep_comm"] > 0


def test_the_search_offers_overlap_ep_comm_only_where_the_strategy_takes_it():
    model = toy_model()
    layouts = list(enumerate_layouts(4, model, SEQ, 8, gpus_per_node=2))
    overlapped = [lay for lay in layouts if lay.overlap_ep_comm]
    assert overlapped
    for lay in overlapped:
        assert lay.ep > 1 and lay.pp == 1 and lay.gather_once_per_step and lay.microbatches > 1, lay.label()
    assert any(lay.hsdp for lay in overlapped)
    # every valid twin without it is offered too, and the labels stay unique
    labels = {lay.label() for lay in layouts}
    assert len(labels) == len(layouts)
    assert all(lay.label().replace(" overlap_ep_comm", "") in labels for lay in overlapped)
    assert not any(lay.overlap_ep_comm for lay in enumerate_layouts(4, model, SEQ, 8, checkpointing="full"))
    allgather = toy_model(dispatcher="allgather")
    assert not any(lay.overlap_ep_comm for lay in enumerate_layouts(4, allgather, SEQ, 8))


@pytest.mark.parametrize(
    "layout,checkpointing,problem",
    [
        (Layout(dp=2, microbatches=4, gather_once_per_step=True, overlap_ep_comm=True), "none", "needs ep > 1"),
        (Layout(ep=2, pp=2, microbatches=4, overlap_ep_comm=True), "none", "use pp=1"),
        (Layout(ep=2, microbatches=4, overlap_ep_comm=True), "none", "gather_once_per_step=True"),
        (Layout(ep=2, dp=2, dp_replicate=2, microbatches=4, overlap_ep_comm=True), "none", "gather_once_per_step=True"),
        (ep2(overlap_ep_comm=True), "selective", "activation_checkpointing='none'"),
    ],
)
def test_invalid_overlap_ep_comm_layouts_are_named(layout, checkpointing, problem):
    assert any(problem in p for p in layout_problems(toy_model(num_experts=4), layout, SEQ, 64, checkpointing))
    assert not layout_problems(toy_model(), ep2(overlap_ep_comm=True), SEQ, 8)


def test_the_layout_names_and_hands_on_overlap_ep_comm():
    layout = ep2(overlap_ep_comm=True)
    assert layout.label() == "ep2 mb1 gather_once_per_step overlap_ep_comm"
    assert layout.strategy_kwargs() == {"tp": 1, "cp": 1, "ep": 2, "dp": 1, "pp": 1, "etp": 1, "gather_once_per_step": True,
                                        "overlap_ep_comm": True}  # fmt: skip
    assert "overlap_ep_comm" not in ep2().strategy_kwargs()
    out = run(toy_model(), layout, BANDWIDTH).as_dict()
    assert out["overlap_ep_comm"] is True and out["strategy"]["overlap_ep_comm"] is True
    assert out["hidden_ep_comm_time_s"]["overlap_ep_comm"] > 0


def test_layout_auto_carries_the_overlap_it_ranked_with():
    """2 ranks, 3 layers (no pipeline split), links 4x the toy's (FSDP's traffic 2/3 of the compute):
    ep2 with overlap_ep_comm beats dp2, tp2 and its own twin without, and the strategy's
    arguments carry it. The gain is below the all-to-all time the pairing hides: that time takes
    compute FSDP's reductions in the last backward would otherwise hide behind."""
    best, runner_up = resolve_auto_layout(2, model=TOY_3_LAYERS, cluster=toy_cluster(4 * BANDWIDTH), seq_len=SEQ, global_batch_size=8,
                                          micro_batch_size=1, precision="32-true")  # fmt: skip
    assert best.layout == Layout(ep=2, microbatches=4, gather_once_per_step=True, overlap_ep_comm=True), (
        best.layout.label()
    )
    assert best.layout.strategy_kwargs()["overlap_ep_comm"] is True
    assert runner_up is not None and runner_up.step_time >= best.step_time
    twin = estimate(ModelShape.from_config(TOY_3_LAYERS), replace(best.layout, overlap_ep_comm=False), toy_cluster(4 * BANDWIDTH),
                    SEQ, 8, precision="32-true")  # fmt: skip
    assert 0 < twin.step_time - best.step_time < best.hidden_ep_comm_time["overlap_ep_comm"]


def test_overlap_ep_comm_gains_nothing_where_fsdp_traffic_already_fills_the_compute():
    """The toy's links: FSDP's traffic (0.33 s) exceeds the whole compute (0.13 s), so the compute has
    no second left for the pairing to hide the all-to-all behind; the old model hid both behind the
    same compute. The step equals its twin's, and no layout's estimate hides more than its compute."""
    model, cluster = ModelShape.from_config(TOY_3_LAYERS), toy_cluster(BANDWIDTH)
    plain, paired = (
        estimate(model, ep2(4, overlap_ep_comm=on), cluster, SEQ, 8, precision="32-true") for on in (False, True)
    )
    assert paired.step_time == pytest.approx(plain.step_time)
    assert paired.overlapped_comm_time == pytest.approx(paired.compute_time)
    fsdp = sum(record_seconds(r, paired.layout, cluster) for r in paired.records if r.dim == "dp")
    assert fsdp > paired.compute_time


def test_dispatch_chunks_comes_from_the_model_config():
    assert toy_model().dispatch_chunks == 1 and toy_model(dispatch_chunks=3).dispatch_chunks == 3
    with pytest.raises(ValueError, match=r"model.moe.dispatch_chunks=0 must be >= 1"):
        toy_model(dispatch_chunks=0)


def test_layout_auto_offers_no_overlap_under_activation_checkpointing():
    best, _ = resolve_auto_layout(2, model=TOY_3_LAYERS, cluster=toy_cluster(BANDWIDTH), seq_len=SEQ, global_batch_size=8,
                                  micro_batch_size=1, precision="32-true", checkpointing="full")  # fmt: skip
    assert not best.layout.overlap_ep_comm and best.checkpointing == "full", best.layout.label()
