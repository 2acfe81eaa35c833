"""The planner's two ways across the cp ranks: ring attention (K/V blocks around the ring, behind the
block compute) and all-to-all attention (``cp_comm="a2a"``, Ulysses: sequence shards to head shards
and back, exposed), estimated both per layout and the faster kept.

Pure planner (no process group, no tensors), on toy machines whose figures are easy to follow:
1 GFLOP/s at every op kind's full efficiency, no latency, collectives asynchronous.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir

from lightning_moe.conf import CONF_DIR
from lightning_moe.layout import ulysses_kv_heads
from lightning_moe.planner import (
    Cluster,
    Layout,
    ModelShape,
    accounted_comm_bytes,
    comm_records,
    cp_comm_options,
    estimate,
    estimate_cp_comm,
    layout_problems,
    plan,
    ulysses_attention_bytes,
)
from lightning_moe.planner.presets import layout_from_parallel
from lightning_moe.planner.report import format_same_sizes
from lightning_moe.planner.step_time import record_seconds

SEQ, HIDDEN, LAYERS, HEAD_DIM = 64, 64, 2, 16
A2A = "all-to-all attention Q/K/V and output"
RING = "ring attention K/V and dK/dV"


def toy_model(heads: int = 4, kv_heads: int | None = None, hidden: int = HIDDEN, moe: bool = True) -> ModelShape:
    """``heads`` heads of 16 (hidden 64 with 4 heads); dense (no MoE layer) with ``moe=False``."""
    cfg = {"vocab_size": 256, "hidden_size": hidden, "num_layers": LAYERS, "num_heads": heads,
           "num_kv_heads": kv_heads or heads, "ffn_hidden_size": 128,
           "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 64}}  # fmt: skip
    if not moe:
        cfg["moe_layer_freq"] = 0
    return ModelShape.from_config(cfg)


def toy_cluster(intra: float, inter: float, gpus_per_node: int = 64) -> Cluster:
    return Cluster(
        name="toy", gpus_per_node=gpus_per_node, memory_bytes=1e12, peak_flops=1e9, hbm_bandwidth=1e12,
        intra_node_bandwidth=intra, inter_node_bandwidth=inter, gemm_efficiency=1.0, grouped_gemm_efficiency=1.0,
        attention_efficiency=1.0, comm_efficiency=1.0, collective_latency=0.0,
    )  # fmt: skip


def records(model: ModelShape, layout: Layout, seq_len: int = SEQ, what: str = A2A) -> list:
    return [r for r in comm_records(model, layout, seq_len, "32-true") if r.what == what]


# -- bytes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 4])
def test_a2a_bytes_per_step_equal_the_hand_count(cp):
    """4 query heads and 2 K/V heads of 16, fp32, 64 tokens, 2 layers, 2 micro-batches of one sample.

    A rank holds 64/cp tokens of q and the output (4 heads each) and of k and v (2 heads, repeated to
    4 at cp4: fewer K/V heads than cp ranks); each all-to-all sends the (cp-1)/cp of them bound for
    its peers; the backward sends as much again."""
    model = toy_model(heads=4, kv_heads=2)
    layout = Layout(cp=cp, dp=2, microbatches=2, cp_comm="a2a")  # dp2: the cp group is not every rank
    kv = {2: 2, 4: 4}[cp]
    tokens = SEQ // cp
    per_pass = (4 + 4 + kv + kv) * tokens * HEAD_DIM * 4 * (cp - 1) // cp  # bytes one rank sends in a forward
    by_hand = 2 * per_pass * 2 * LAYERS  # forward + backward, 2 micro-batches, 2 layers
    assert per_pass == 12_288  # cp2: 12 heads x 32 tokens x 16 x 4 bytes / 2; cp4: 16 x 16 x 16 x 4 x 3/4
    (rec,) = records(model, layout)
    assert rec.bytes == by_hand and rec.dim == rec.group == "cp"
    assert rec.calls == 4 * 2 * LAYERS  # Q/K/V in, output back, and the two in backward
    assert not rec.overlapped and rec.pattern == "spread" and rec.all_to_all
    assert not records(model, layout, what=RING)  # the ring's K/V shifts are gone
    per_call = ulysses_attention_bytes(1, 4, 2, SEQ, HEAD_DIM, cp, 4)
    assert per_call * 2 * LAYERS == by_hand
    assert ulysses_attention_bytes(1, 4, 2, SEQ, HEAD_DIM, cp, 4, backward=False) == per_pass
    # the comm accounting charges it to cp, with the MoE statistics' all-reduces recorded as cp
    stats = sum(r.bytes for r in comm_records(model, layout, SEQ, "32-true") if r.recorded_as == "cp")
    assert stats > 0 and accounted_comm_bytes(model, layout, SEQ)["cp"] == by_hand + stats


def test_a2a_bytes_per_tp_rank_and_in_bf16():
    """Under tp the heads of one tp rank travel (4/2 query, 2/2 K/V repeated to 2 at cp2); bf16 halves it."""
    model = toy_model(heads=4, kv_heads=2)
    (rec,) = records(model, Layout(tp=2, cp=2, cp_comm="a2a"))
    assert ulysses_kv_heads(2, 1, 2) == 2
    assert rec.bytes == 2 * (2 + 2 + 2 + 2) * (SEQ // 2) * HEAD_DIM * 4 // 2 * LAYERS
    bf16 = [r for r in comm_records(model, Layout(tp=2, cp=2, cp_comm="a2a"), SEQ, "bf16-mixed") if r.what == A2A]
    assert bf16[0].bytes * 2 == rec.bytes
    assert ulysses_attention_bytes(3, 8, 8, 4096, 128, 1, 2) == 0  # cp1: nothing to exchange


def test_ring_is_unchanged_and_a2a_moves_fewer_bytes_at_cp4_with_mha():
    """Ring, fp32: cp-1 shifts of K and V forward and backward plus cp fp32 dK/dV shifts; a2a: 3/4 of
    q, k, v and the output, twice."""
    model = toy_model(heads=4)
    block = 4 * (SEQ // 4) * HEAD_DIM  # K (or V) of one rank
    (ring,) = records(model, Layout(cp=4), what=RING)
    assert ring.bytes == (2 * 3 * 2 * block * 4 + 4 * 2 * block * 4) * LAYERS and ring.overlapped
    (a2a,) = records(model, Layout(cp=4, cp_comm="a2a"))
    assert a2a.bytes == 2 * 4 * block * 4 * 3 // 4 * LAYERS < ring.bytes


# -- heads ---------------------------------------------------------------------------------------------
def test_a2a_is_never_offered_when_the_heads_per_tp_rank_do_not_divide_by_cp():
    """6 heads: cp2 splits them (3 a rank), cp4 cannot, nor can tp2·cp2 (3 heads per tp rank over 2)."""
    model = toy_model(heads=6, hidden=96)
    assert cp_comm_options(model, Layout(cp=2)) == ("ring", "a2a")
    assert cp_comm_options(model, Layout(cp=4)) == ("ring",)
    assert cp_comm_options(model, Layout(tp=2, cp=2)) == ("ring",)
    assert cp_comm_options(model, Layout(dp=4)) == ("ring",)  # no cp: nothing to choose
    assert cp_comm_options(model, Layout(cp=2), kinds=("ring",)) == ("ring",)
    problems = layout_problems(model, Layout(cp=4, cp_comm="a2a"), SEQ, 4)
    assert any("cp_comm='ring'" in p and "6 query heads" in p for p in problems), problems
    assert not layout_problems(model, Layout(cp=2, cp_comm="a2a"), SEQ, 4)
    with pytest.raises(ValueError, match="does not divide 6"):
        ulysses_attention_bytes(1, 6, 6, SEQ, HEAD_DIM, 4, 4)
    # a search on a cluster where a2a wins wherever it may (slow links, little compute)
    slow = toy_cluster(1e6, 1e6)
    result = plan(4, model, slow, seq_len=SEQ, global_batch_size=4, precision="32-true", micro_batch_sizes=[1])
    everything = result.ranked + result.rejected
    a2a = [e.layout for e in everything if e.layout.cp_comm == "a2a"]
    assert a2a, "a2a should win somewhere on this cluster"
    assert all((model.num_heads // lay.tp) % lay.cp == 0 for lay in a2a), [lay.label() for lay in a2a]
    assert not any(e.layout.cp == 4 and e.layout.cp_comm == "a2a" for e in everything)
    assert not any(e.layout.tp == 2 and e.layout.cp == 2 and e.layout.cp_comm == "a2a" for e in everything)


# -- the choice ----------------------------------------------------------------------------------------
def pick(model: ModelShape, layout: Layout, cluster: Cluster, seq_len: int = SEQ) -> tuple[str, float, float]:
    """The search's choice for ``layout`` and both estimates' step times (ring, a2a)."""
    gbs = layout.microbatches * layout.micro_batch_size * layout.dp
    ring, a2a = (
        estimate(model, replace(layout, cp_comm=k), cluster, seq_len, gbs, precision="32-true") for k in ("ring", "a2a")
    )
    chosen = estimate_cp_comm(model, layout, cluster, seq_len, gbs, precision="32-true")
    assert chosen.step_time == min(ring.step_time, a2a.step_time)
    return chosen.layout.cp_comm, ring.step_time, a2a.step_time


def planned_cp4(model: ModelShape, cluster: Cluster, seq_len: int = SEQ) -> Layout:
    """The ranked cp4 layout of a 4-rank search (one sample per step: tp, cp, pp over the 4 ranks)."""
    result = plan(4, model, cluster, seq_len=seq_len, global_batch_size=1, precision="32-true")
    (cp4,) = [e.layout for e in result.ranked if e.layout.cp == 4]
    return cp4


def test_cp_across_slow_node_links_takes_the_all_to_all_and_inside_a_node_the_ring():
    """cp4 over two nodes of 2 with a slow link between them: FSDP over the 4 ranks already fills
    the compute, so the ring's K/V shifts add to the exposed time in full, and they cross the link
    with more bytes than the all-to-all. The same cp4 inside one node of fast links: the ring hides
    behind compute, the all-to-all stays exposed."""
    model = toy_model(heads=4, moe=False)
    across = toy_cluster(intra=1e10, inter=1e6, gpus_per_node=2)
    inside = toy_cluster(intra=1e10, inter=1e6, gpus_per_node=4)
    chosen, ring, a2a = pick(model, Layout(cp=4), across)
    assert chosen == "a2a" and a2a < ring
    assert planned_cp4(model, across).label() == "cp4(a2a) mb1"
    chosen, ring, a2a = pick(model, Layout(cp=4), inside)
    assert chosen == "ring" and ring < a2a
    assert planned_cp4(model, inside).label() == "cp4 mb1"


def test_short_sequences_take_the_all_to_all_and_long_ones_the_ring():
    """One node, links of 10 MB/s: at 64 tokens the compute (1 GFLOP/s) cannot hide FSDP's and the
    ring's traffic, and the all-to-all sends fewer bytes; at 4096 tokens the attention's quadratic
    compute hides the ring, and the all-to-all's exposed seconds decide."""
    model = toy_model(heads=4, moe=False)
    node = toy_cluster(intra=1e7, inter=1e7)
    short, ring, a2a = pick(model, Layout(cp=4), node, seq_len=64)
    assert short == "a2a" and a2a < ring
    long, ring, a2a = pick(model, Layout(cp=4), node, seq_len=4096)
    assert long == "ring" and ring < a2a
    assert planned_cp4(model, node, 64).cp_comm == "a2a" and planned_cp4(model, node, 4096).cp_comm == "ring"


def test_the_all_to_all_is_exposed_and_spread_over_the_cp_group():
    """cp4 over two nodes of 2: a rank sends 1/3 of its all-to-all bytes in its node and 2/3 across,
    both at once (not the whole at the slow link's pace, as a ring all-reduce over nodes); with the
    FSDP traffic hidden (fast links, the cross-node tier 10x slower), the exposed time is exactly that."""
    model = toy_model(heads=4, moe=False)
    cluster = toy_cluster(intra=1e10, inter=1e9, gpus_per_node=2)
    layout = Layout(cp=4, cp_comm="a2a")
    est = estimate(model, layout, cluster, SEQ, 1, precision="32-true")
    (rec,) = [r for r in est.records if r.what == A2A]
    assert est.comm["cp"]["intra"] == pytest.approx(rec.bytes / 3) and est.comm["cp"]["inter"] == pytest.approx(
        rec.bytes * 2 / 3
    )
    seconds = max(rec.bytes / 3 / 1e10, rec.bytes * 2 / 3 / 1e9)
    assert record_seconds(rec, layout, cluster) == pytest.approx(seconds)
    overlapped = sum(record_seconds(r, layout, cluster) for r in est.records if r.overlapped)
    assert overlapped < est.compute_time  # FSDP hides
    assert est.exposed_comm_time == pytest.approx(seconds)
    assert est.overlapped_comm_time == pytest.approx(overlapped)


# -- the layout's face ---------------------------------------------------------------------------------
def test_label_strategy_arguments_and_plan_json_carry_cp_comm():
    a2a = Layout(cp=4, dp=2, cp_comm="a2a")
    assert a2a.label() == "cp4(a2a)·dp2 mb1"
    assert a2a.strategy_kwargs() == {"tp": 1, "cp": 4, "ep": 1, "dp": 2, "pp": 1, "etp": 1, "cp_comm": "a2a"}
    assert "cp_comm" not in Layout(cp=4, dp=2).strategy_kwargs() and Layout(cp=4).label() == "cp4 mb1"
    folded = Layout(tp=2, cp=2, ep=4, fold_ep="cp", cp_comm="a2a")
    assert folded.label() == "tp2·cp2(a2a)·ep4(fold cp)·etp1 mb1"
    assert Layout(cp=1, cp_comm="a2a") == Layout()  # no cp, no choice: one layout
    with pytest.raises(ValueError, match="cp_comm='ulysses' must be one of"):
        Layout(cp=2, cp_comm="ulysses")
    out = estimate(toy_model(), a2a, toy_cluster(1e9, 1e9), SEQ, 2, precision="32-true").as_dict()
    assert out["cp_comm"] == "a2a" and out["strategy"]["cp_comm"] == "a2a" and out["label"] == "cp4(a2a)·dp2 mb1"


def compose_parallel(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("plan", overrides=list(overrides), return_hydra_config=False).parallel


def test_a_cp_preset_composes_with_cp_comm_a2a():
    ring = layout_from_parallel(compose_parallel("parallel=cp2"), 4, 8)
    a2a = layout_from_parallel(compose_parallel("parallel=cp2", "parallel.cp_comm=a2a"), 4, 8)
    assert (ring.cp, ring.dp, ring.cp_comm) == (2, 2, "ring")
    assert a2a == replace(ring, cp_comm="a2a") and a2a.strategy_kwargs()["cp_comm"] == "a2a"
    assert layout_from_parallel({"cp": 2, "cp_comm": None}, 2, 8).cp_comm == "ring"


def test_a_ring_request_is_pointed_at_the_ranked_a2a_variant():
    """``parallel=cp4`` on a cluster where the ranking takes a2a for its sizes: plan names the setting."""
    model = toy_model(heads=4, moe=False)
    across = toy_cluster(intra=1e10, inter=1e6, gpus_per_node=2)
    result = plan(4, model, across, seq_len=SEQ, global_batch_size=1, precision="32-true")
    requested = estimate(model, Layout(cp=4), across, SEQ, 1, precision="32-true")
    text = format_same_sizes(requested, result)
    assert "cp4(a2a) mb1" in text and "parallel.cp_comm=a2a" in text, text
