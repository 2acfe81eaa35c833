"""The planner charges what the hardware pays: one overlap budget per phase shared by every overlapped
collective, the gradient reduction after the last backward exposed, a compute slowdown while
communication overlaps, memory-bound ops, the busiest ep rank, FP8 GEMMs, a published architecture's
shapes, node-limited and fp8 dispatch; and each estimate as a range (no, modelled, perfect overlap).

Pure Python, on toy machines whose figures are easy to follow: 1 GFLOP/s at every op kind's full
efficiency, no latency, collectives asynchronous.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir

from lightning_moe.conf import CONF_DIR
from lightning_moe.plan import model_shape
from lightning_moe.planner import Cluster, Layout, ModelShape, comm_records, enumerate_layouts, estimate, plan
from lightning_moe.planner.comm.ep import expected_nodes_per_token, token_exchange_row_bytes
from lightning_moe.planner.elementwise import elementwise_bytes_per_microbatch
from lightning_moe.planner.flops import flops_per_microbatch
from lightning_moe.planner.step_time import DEFAULT_EXPERT_LOAD_IMBALANCE, forward_seconds_by_kind, record_seconds

SEQ = 32
BALANCED = {"load_imbalance": 1.0}


def toy_cluster(bandwidth: float = 1e9, **extra) -> Cluster:
    return Cluster(
        name="toy", gpus_per_node=64, memory_bytes=1e12, peak_flops=1e9, hbm_bandwidth=1e12,
        intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth, gemm_efficiency=1.0,
        grouped_gemm_efficiency=1.0, attention_efficiency=1.0, comm_efficiency=1.0, collective_latency=0.0, **extra,
    )  # fmt: skip


def toy_model(layers: int = 2, **moe) -> ModelShape:
    return ModelShape.from_config({
        "vocab_size": 256, "hidden_size": 64, "num_layers": layers, "num_heads": 4, "ffn_hidden_size": 128,
        "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 64, **moe},
    })  # fmt: skip


def seconds_of(est, cluster, keep) -> float:
    return sum(record_seconds(r, est.layout, cluster) for r in est.records if keep(r))


# -- one budget per phase -------------------------------------------------------------------------------
@pytest.mark.parametrize("bandwidth", [1e9, 3e5, 1e5, 1e4])
def test_every_overlapped_collective_shares_the_compute(bandwidth):
    """cp2 ring and FSDP over dp2, each alone able to fill the compute at the slow links: together
    they hide at most the compute; what does not fit is exposed, second for second."""
    cluster = toy_cluster(bandwidth)
    est = estimate(toy_model(), Layout(cp=2, dp=2, microbatches=2), cluster, SEQ, 4, precision="32-true")
    ring = seconds_of(est, cluster, lambda r: r.dim == "cp" and r.overlapped)
    fsdp = seconds_of(est, cluster, lambda r: r.dim == "dp" and r.overlapped)
    assert ring > 0 and fsdp > 0
    assert est.overlapped_comm_time <= est.compute_time * (1 + 1e-12)
    assert est.overlapped_comm_time <= ring + fsdp
    exposed_elsewhere = seconds_of(est, cluster, lambda r: not r.overlapped)
    assert est.exposed_comm_time == pytest.approx(exposed_elsewhere + ring + fsdp - est.overlapped_comm_time)
    if bandwidth == 1e4:  # both far beyond the compute: the old model hid up to the compute twice over
        assert est.overlapped_comm_time == pytest.approx(est.compute_time)


def test_the_reduction_after_the_pipelines_last_backward_is_exposed_outside_the_bubble():
    """pp2 under 1F1B: torch's schedule reduces gradients after the stage's last backward
    (``REDUCE_GRAD``), so no compute hides FSDP's reduce-scatters; they add to the step after the
    bubble, once. pp = 1 reduces inside the backward and hides them."""
    cluster = toy_cluster(1e6)
    model = toy_model(layers=4)
    piped = estimate(model, Layout(pp=2, dp=2, microbatches=4, pp_microbatches=4), cluster, SEQ, 8, precision="32-true")
    reductions = seconds_of(piped, cluster, lambda r: r.reduction)
    assert reductions > 0 and piped.end_of_step_reduction_time == pytest.approx(reductions)
    busy = piped.compute_time + piped.exposed_comm_time - reductions + piped.overlap_slowdown_time
    assert piped.step_time == pytest.approx(busy / (1 - piped.bubble_fraction) + reductions + piped.optimizer_time)
    flat = estimate(model, Layout(dp=4, microbatches=2), toy_cluster(1e9), SEQ, 8, precision="32-true")
    never_overlapped = seconds_of(flat, toy_cluster(1e9), lambda r: not r.overlapped)  # Lightning's per-batch flag
    assert flat.end_of_step_reduction_time == 0 and flat.exposed_comm_time == pytest.approx(never_overlapped)


def test_gathered_once_the_reductions_hide_behind_the_last_backward_only():
    """gather_once_per_step reduces every gradient in the step's last backward (2 forwards of one
    micro-batch): reductions beyond it are exposed even though the step's compute is 4x longer."""
    cluster = toy_cluster(1.25e7)
    layout = Layout(dp=2, microbatches=2, gather_once_per_step=True)
    est = estimate(toy_model(), layout, cluster, SEQ, 4, precision="32-true")
    forward = sum(forward_seconds_by_kind(toy_model(), layout, cluster, SEQ).values())
    reductions = seconds_of(est, cluster, lambda r: r.reduction)
    gathers = seconds_of(est, cluster, lambda r: r.overlapped and not r.reduction)
    assert 2 * forward < reductions < 6 * forward and gathers < est.compute_time
    last_backward_left = 2 * forward - gathers * (2 / 6)  # the gathers' share of that backward
    never_overlapped = seconds_of(est, cluster, lambda r: not r.overlapped)  # Lightning's per-batch flag
    assert est.exposed_comm_time == pytest.approx(reductions - last_backward_left + never_overlapped, rel=1e-9)


def test_overlap_slows_the_compute_by_the_clusters_fraction_of_each_hidden_second():
    layout = Layout(cp=2, dp=2, microbatches=2)
    plain = estimate(toy_model(), layout, toy_cluster(3e5), SEQ, 4, precision="32-true")
    slowed = estimate(toy_model(), layout, toy_cluster(3e5, overlap_slowdown=0.2), SEQ, 4, precision="32-true")
    assert plain.overlapped_comm_time > 0 and slowed.overlap_slowdown_time == pytest.approx(
        0.2 * plain.overlapped_comm_time
    )
    assert slowed.step_time - plain.step_time == pytest.approx(0.2 * plain.overlapped_comm_time)
    with pytest.raises(ValueError, match=r"cluster.overlap_slowdown=1.5 must be in \[0, 1\)"):
        Cluster.from_config({**toy_cluster().__dict__, "overlap_slowdown": 1.5})


# -- bounds -----------------------------------------------------------------------------------------------
def test_bounds_order_for_every_layout_and_a_synchronous_backend_has_no_range_above():
    cluster = toy_cluster(3e5, overlap_slowdown=0.15)
    model = toy_model(layers=4)
    layouts = list(enumerate_layouts(4, model, SEQ, 8, gpus_per_node=2))
    assert len(layouts) > 20
    for lay in layouts:
        b = estimate(model, lay, cluster, SEQ, 8, precision="32-true").bounds
        assert b.perfect_overlap <= b.modelled * (1 + 1e-12) and b.modelled <= b.no_overlap * (1 + 1e-12), lay.label()
    synchronous = estimate(
        model, Layout(cp=2, dp=2, microbatches=4), replace(cluster, fsdp_overlap=False), SEQ, 8, precision="32-true"
    )
    assert synchronous.bounds.modelled == pytest.approx(synchronous.bounds.no_overlap)
    assert synchronous.bounds.perfect_overlap < synchronous.bounds.modelled


def test_plan_json_carries_the_range_and_the_mfu_convention():
    est = estimate(toy_model(), Layout(ep=2, microbatches=2), toy_cluster(1e6), SEQ, 4, precision="32-true")
    out = est.as_dict()
    assert list(out["step_time_bounds_s"]) == ["perfect_overlap", "modelled", "no_overlap"]
    assert out["mfu_bounds"]["modelled"] == pytest.approx(out["mfu"])
    assert out["mfu_bounds"]["no_overlap"] <= out["mfu"] <= out["mfu_bounds"]["perfect_overlap"]
    assert out["mfu_causal"] < out["mfu"]


def test_mfu_counts_full_attention_and_the_causal_figure_half_of_it():
    model = toy_model()
    attention = 6 * model.num_layers * model.num_heads * 2 * model.head_dim * 4096
    assert model.model_flops_per_token(4096) == pytest.approx(6 * model.active_parameters() + attention)
    assert model.model_flops_per_token(4096, causal=True) == pytest.approx(
        6 * model.active_parameters() + attention / 2
    )


# -- what the GEMM peak leaves out ----------------------------------------------------------------------------
def test_memory_bound_ops_count_their_bytes_at_the_hbm_pace():
    """One MoE layer, hidden 64, 4 heads (kv 4), experts of 64, top-2, 4 experts, fp32, 32 tokens:
    norms and residual adds 10 h, rotary 2 (q + kv), router 2 E fp32, per slot 4 h + 3 F."""
    model, layout = toy_model(layers=1), Layout()
    per_token = (10 * 64 + 2 * (64 + 64)) * 4 + 2 * 4 * 4 + 2 * (4 * 64 + 3 * 64) * 4
    assert elementwise_bytes_per_microbatch(model, layout, SEQ, [0], False, "32-true") == SEQ * per_token
    loss = 256 * (4 + 3 * 4)
    assert elementwise_bytes_per_microbatch(model, layout, SEQ, [0], True, "32-true") == SEQ * (per_token + loss)
    cluster = replace(toy_cluster(), elementwise_efficiency=0.5, hbm_bandwidth=1e6)
    seconds = forward_seconds_by_kind(model, layout, cluster, SEQ, precision="32-true")["elementwise"]
    assert seconds == pytest.approx(SEQ * (per_token + loss) / 0.5e6)
    assert forward_seconds_by_kind(model, layout, toy_cluster(), SEQ)["elementwise"] == 0.0


def test_the_busiest_ep_rank_sets_the_expert_time_and_its_all_to_all():
    model = toy_model()
    # fast links: FSDP's traffic hides in full under either compute, the token exchange stays exposed
    balanced = estimate(model, Layout(ep=2, microbatches=2), toy_cluster(), SEQ, 4, precision="32-true", **BALANCED)
    skewed = estimate(
        model, Layout(ep=2, microbatches=2), toy_cluster(), SEQ, 4, precision="32-true", load_imbalance=1.5
    )
    default = estimate(model, Layout(ep=2, microbatches=2), toy_cluster(), SEQ, 4, precision="32-true")
    f = forward_seconds_by_kind(model, Layout(ep=2), toy_cluster(), SEQ, imbalance=1.5)
    assert f["expert"] == pytest.approx(
        1.5 * forward_seconds_by_kind(model, Layout(ep=2), toy_cluster(), SEQ)["expert"]
    )
    tokens = seconds_of(balanced, toy_cluster(), lambda r: r.dim == "ep" and r.routing_dependent)
    assert skewed.exposed_comm_time - balanced.exposed_comm_time == pytest.approx(0.5 * tokens)
    assert balanced.step_time < default.step_time < skewed.step_time and DEFAULT_EXPERT_LOAD_IMBALANCE == 1.23
    # one rank holds every expert: its work does not depend on the routing
    alone = (
        estimate(model, Layout(dp=2, microbatches=2), toy_cluster(), SEQ, 4, load_imbalance=x).step_time
        for x in (1.0, 2.0)
    )
    assert len(set(alone)) == 1
    with pytest.raises(ValueError, match=r"expert_load_imbalance=0.9 must be >= 1"):
        plan(2, model, toy_cluster(), seq_len=SEQ, global_batch_size=4, load_imbalance=0.9)


def test_fp8_gemms_run_at_the_fp8_peak_and_attention_stays_bf16():
    model, layout = toy_model(), Layout()
    cluster = toy_cluster(fp8_peak_flops=4e9, fp8_gemm_efficiency=0.5)
    bf16 = forward_seconds_by_kind(model, layout, cluster, SEQ)
    fp8 = forward_seconds_by_kind(model, layout, cluster, SEQ, fp8_gemms=True)
    for kind in ("dense", "expert"):
        assert fp8[kind] == pytest.approx(bf16[kind] / 2)  # 4x the peak at half the efficiency
    assert fp8["attention"] == bf16["attention"]
    with pytest.raises(ValueError, match=r"fp8_gemms=true needs cluster.fp8_peak_flops"):
        plan(2, model, toy_cluster(), seq_len=SEQ, global_batch_size=4, fp8_gemms=True)


# -- a published architecture ---------------------------------------------------------------------------------
def test_deepseek_v3_is_planned_with_its_published_shapes_and_built_as_moegpt():
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("plan", overrides=["model=deepseek_v3"])
    published = model_shape(cfg.model, architecture=cfg.architecture)
    trained = model_shape(cfg.model)
    assert (published.first_dense_layers, published.qk_head_dim, published.v_head_dim) == (3, 192, 128)
    assert not any(published.is_moe(i) for i in range(3)) and published.num_moe_layers == 58
    assert trained.num_moe_layers == 61 and trained.head_dim == 56
    # the attention core: 128 heads x (192 + 128) per token and key against MoEGPT's 128 x (56 + 56)
    layout = Layout(tp=8, etp=8)
    core = {s: flops_per_microbatch(s, layout, 4096, [0], False)["attention"] for s in (published, trained)}
    assert core[published] / core[trained] == pytest.approx(320 / 112)
    assert published.total_parameters() == pytest.approx(671e9, rel=0.01)  # published: 671B (MLA's projections aside)
    with pytest.raises(ValueError, match=r"architecture has unknown keys \['kv_lora_rank'\]"):
        ModelShape.from_config({"hidden_size": 64}, architecture={"kv_lora_rank": 512})


def test_fp8_dispatch_sends_the_rows_in_one_byte_and_their_gradients_in_bf16():
    assert token_exchange_row_bytes(64, 2, None) == 4 * 64 * 2
    assert token_exchange_row_bytes(64, 4, "bf16") == 4 * 64 * 2
    assert token_exchange_row_bytes(64, 2, "fp8") == 64 + 4 + 3 * 64 * 2
    layout = Layout(ep=2, microbatches=2)
    rows = {wire: sum(r.bytes for r in comm_records(toy_model(dispatch_dtype=wire), layout, SEQ, "bf16-mixed")
                      if r.routing_dependent) for wire in (None, "fp8")}  # fmt: skip
    # One copy per (token, rank): each row also sends its 2 slots' expert ids (int32) and gate
    # weights (fp32, forward and backward), 24 bytes whatever the wire.
    assert rows["fp8"] / rows[None] == pytest.approx((64 + 4 + 3 * 128 + 24) / (4 * 128 + 24))
    per_slot = {wire: sum(r.bytes for r in comm_records(toy_model(dispatch_dtype=wire, dispatcher="alltoall"), layout, SEQ,
                                                        "bf16-mixed") if r.routing_dependent) for wire in (None, "fp8")}  # fmt: skip
    assert per_slot["fp8"] / per_slot[None] == pytest.approx((64 + 4 + 3 * 128) / (4 * 128))


def test_node_limited_routing_sends_each_token_to_few_nodes_under_the_hierarchical_dispatcher():
    assert expected_nodes_per_token(2, 1, 2) == 2.0  # two nodes of one expert each, top-2: both
    assert expected_nodes_per_token(4, 2, 2) == pytest.approx(4 * (1 - 15 / 28))  # C(6,2)/C(8,2) misses a node
    assert expected_nodes_per_token(32, 8, 8, 4) == pytest.approx(3.72, abs=0.01)
    assert expected_nodes_per_token(32, 8, 8) == pytest.approx(7.27, abs=0.01)
    # 32 experts over ep 16 across 4 nodes of 4 ranks (top-4, at most 2 nodes a token)
    model = {"hierarchical": toy_model(num_experts=32, top_k=4, dispatcher="hierarchical", max_nodes_per_token=2),
             "flat": toy_model(num_experts=32, top_k=4)}  # fmt: skip
    layout = Layout(ep=16, microbatches=1)
    four_per_node = replace(toy_cluster(), gpus_per_node=4)
    inter = {name: estimate(shape, layout, four_per_node, SEQ, 16).comm["ep"]["inter"] for name, shape in model.items()}
    nodes = expected_nodes_per_token(4, 8, 4, 2)
    assert inter["hierarchical"] < 0.6 * inter["flat"]  # 1.44 rows a token cross nodes against 3 of its 4 slots
    rows = sum(r.bytes for r in comm_records(model["hierarchical"], layout, SEQ, "bf16-mixed", gpus_per_node=4)
               if r.what == "hierarchical rows across nodes")  # fmt: skip
    assert rows == pytest.approx(
        SEQ * nodes * 3 / 4 * 4 * 64 * 2 * 2
    )  # tokens x remote nodes x 4 exchanges x h x bf16 x 2 layers
    # an ep group inside one node has no second stage: the search leaves it out, as the runtime refuses it
    one_node = plan(4, model["hierarchical"], four_per_node, seq_len=SEQ, global_batch_size=8)
    assert all(e.layout.ep == 1 for e in one_node.ranked)


def test_group_limited_routing_bounds_the_nodes_and_ranks_a_token_reaches():
    """DeepSeek-V3's 8 expert groups, of which a token takes 4: at EP64 over 8 nodes a group is a node
    (at most 4 nodes), at EP256 over 32 nodes a group spans 4 (at most 16: 6.60 expected, not the 3.72
    of a 4-node limit). The hierarchical dispatcher's rows across nodes and the default dispatcher's
    rows per rank follow."""
    from lightning_moe.planner.comm.ep import token_span_limit

    groups = toy_model(num_experts=256, top_k=8, num_groups=8, group_topk=4, dispatcher="hierarchical")
    assert (token_span_limit(groups, 8), token_span_limit(groups, 32)) == (4, 16)
    assert token_span_limit(toy_model(num_experts=256, top_k=8), 32) is None
    assert token_span_limit(replace(groups, num_groups=64, group_topk=4), 32) == 4  # 2 groups a node: a bound
    assert expected_nodes_per_token(32, 8, 8, 16) == pytest.approx(6.60, abs=0.01)
    layout = Layout(ep=256, microbatches=1)

    def across(model):
        records = comm_records(model, layout, SEQ, "bf16-mixed", gpus_per_node=8)
        return sum(r.bytes for r in records if r.what == "hierarchical rows across nodes")

    unlimited = replace(groups, num_groups=None, group_topk=None)
    assert across(groups) / across(unlimited) == pytest.approx(
        expected_nodes_per_token(32, 8, 8, 16) / expected_nodes_per_token(32, 8, 8)
    )
    # a node limit of its own still applies, the tighter of the two
    assert across(replace(groups, max_nodes_per_token=4)) / across(unlimited) == pytest.approx(
        expected_nodes_per_token(32, 8, 8, 4) / expected_nodes_per_token(32, 8, 8)
    )
