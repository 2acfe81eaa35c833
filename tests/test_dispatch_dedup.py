"""``dispatcher="alltoall_dedup"`` (the default): one copy of a token per destination ep rank.

Outputs and gradients equal the single-process layer's, and the ep bytes are, to the byte, the
(token, other rank) pairs the routing implies times what each pair sends; at trainer level too,
for the layouts the presets leave out (chunked and fp8 dispatch; tests/test_strategy_invariance.py
runs every preset, ep ones included, with the default dispatcher).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.cli import TINY_RUN, train_in_pool
from tests.dist_pool import get_pool, layout
from tests.reference_moe import expert_and_router_grad_errors, reference_step

WORLD = 4
H, F, E, K, TOKENS = 16, 24, 8, 2, 12
# Bytes of one row of H values in each format: (dispatch forward, each of the combine forward and
# the two backwards). fp8 sends H float8 values and one fp32 scale, and the rest in bf16.
ROW_BYTES = {None: (4 * H, 4 * H), "fp8": (H + 4, 2 * H)}
# Besides its row, each (token, rank) pair sends its K local expert ids (int32) and K gate weights
# (fp32, forward and backward).
PAIR_EXTRA_BYTES = 3 * K * 4
COUNT_BYTES = 8  # one int64 row count per peer and chunk


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, TOKENS // 2, H, generator=gen), torch.randn(2, TOKENS // 2, H, generator=gen)


def dedup_case(ep: int, wire: str | None, chunks: int) -> dict:
    """One forward and backward of the deduplicated dispatch: differences to the one-process layer,
    the measured ep bytes and the (token, other ep rank) pairs of this rank's routing."""
    from lightning_moe import comm, parallelize
    from lightning_moe.moe import MoELayer

    dims = layout(ep=ep)
    torch.manual_seed(0)
    layer = MoELayer(H, F, E, top_k=K, dispatcher="alltoall_dedup", dispatch_dtype=wire, dispatch_chunks=chunks)
    reference = copy.deepcopy(layer)
    parallelize(layer, dims, data_parallel="none")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, probe = _inputs(rank)
    x.requires_grad_(True)
    comm.reset()
    y = layer(x)
    (y * probe).sum().backward()
    measured = comm.snapshot().get("ep", {}).get("bytes", 0)

    ep_rank = dims.ep_mesh.get_local_rank()
    topk = layer.router(x.detach().reshape(-1, H)).topk_idx
    slot_ranks = [[expert // (E // ep) for expert in row] for row in topk.tolist()]
    pairs = sum(len(set(ranks) - {ep_rank}) for ranks in slot_ranks)
    remote_slots = sum(rank != ep_rank for ranks in slot_ranks for rank in ranks)

    step = reference_step(reference, _inputs, rank, dist.get_process_group_ranks(dims.ep_group), world)
    report = {"measured": measured, "pairs": pairs, "remote_slots": remote_slots, "out": (y.detach() - step.out).abs().max().item(),
              "grad_x": (x.grad - step.grad_x).abs().max().item()}  # fmt: skip
    report.update(expert_and_router_grad_errors(layer, step, reference, ep_rank, ep))
    return report


# fp32: the one-process values at 1e-5; fp8 dispatch: within its quantisation error (the largest
# difference measured is 0.09, on an expert weight gradient).
TOLERANCE = {None: 1e-5, "fp8": 0.2}


@pytest.mark.slow
@pytest.mark.parametrize("ep,wire,chunks", [(4, None, 2), (2, "fp8", 1)], ids=["ep4_chunked", "ep2_fp8"])
def test_dedup_dispatch_matches_one_process_and_sends_one_row_per_token_and_rank(ep, wire, chunks):
    reports = get_pool(WORLD).run(dedup_case, ep=ep, wire=wire, chunks=chunks)
    dispatch_row, other_row = ROW_BYTES[wire]
    for rank, report in enumerate(reports):
        for key in ("out", "grad_x", "w1", "w2", "w3", "router"):
            assert report[key] < TOLERANCE[wire], f"rank {rank} {key} differs by {report[key]:.2e}: {report}"
    # Over all ranks every row sent is received once: each dispatched pair's row comes back in the
    # combine, and the backwards send the same rows (one rank's own bytes depend on what it receives).
    pairs = sum(report["pairs"] for report in reports)
    counts = WORLD * chunks * (ep - 1) * COUNT_BYTES
    expected = pairs * (dispatch_row + 3 * other_row + PAIR_EXTRA_BYTES) + counts
    assert sum(report["measured"] for report in reports) == expected, (reports, expected)
    # Fewer rows than slots: some tokens have both experts on one rank, and that rank gets one row.
    assert 0 < pairs < sum(report["remote_slots"] for report in reports)


def test_the_planner_counts_one_row_per_token_and_expected_destination_rank():
    """Top-2 of 8 experts over ep 4 (2 per rank): a token's experts share a rank with chance 1/7, so
    it reaches 2 - 1/7 ranks on average, 3/4 of them other ranks; the per-slot path sends 2 x 3/4."""
    from lightning_moe.planner import ModelShape
    from lightning_moe.planner.candidate import Layout
    from lightning_moe.planner.comm import comm_records
    from lightning_moe.planner.comm.ep import token_exchange_row_bytes

    config = {"vocab_size": 256, "hidden_size": 64, "num_layers": 1, "num_heads": 4, "ffn_hidden_size": 128}
    seq, ep, layout = 64, 4, Layout(ep=4, microbatches=1)
    rows = {}
    for kind in ("alltoall", "alltoall_dedup"):
        shape = ModelShape.from_config(
            {**config, "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 64, "dispatcher": kind}}
        )
        rows[kind] = {r.what: r.bytes for r in comm_records(shape, layout, seq) if r.dim == "ep"}
    row = token_exchange_row_bytes(64, 4, None)
    pairs = seq * (2 - 1 / 7) * (ep - 1) / ep
    assert rows["alltoall"]["token dispatch/combine all-to-all"] == pytest.approx(seq * 2 * (ep - 1) / ep * row)
    assert rows["alltoall_dedup"] == pytest.approx({
        "dedup dispatch counts all-to-all": (ep - 1) * 8,
        "dedup expert ids and gate weights": pairs * 2 * 12,
        "dedup token dispatch/combine all-to-all": pairs * row,
    })  # fmt: skip
    # A routing's own mean (here every token on 2 ranks) replaces uniform routing's 2 - 1/7.
    given = {r.what: r.bytes for r in comm_records(shape, layout, seq, ep_ranks_per_token=2.0) if r.dim == "ep"}
    assert given["dedup token dispatch/combine all-to-all"] == pytest.approx(seq * 2 * (ep - 1) / ep * row)
    with pytest.raises(ValueError, match=r"ep_ranks_per_token=3.0 must lie in \[1, min\(ep, top_k\)\] = \[1, 2\]"):
        comm_records(shape, layout, seq, ep_ranks_per_token=3.0)


# -- trainer level ---------------------------------------------------------------------------------
# TINY_RUN's model: hidden 32, 2 MoE layers of 4 experts, top-2; 2 samples of 32 tokens a micro-batch,
# 2 micro-batches a rank per optimizer step at ep2 (global batch 8).
TINY = dict(o.split("=", 1) for o in TINY_RUN)
TINY_H, TINY_E, TINY_SEQ = int(TINY["model.hidden_size"]), int(TINY["model.moe.num_experts"]), int(TINY["data.seq_len"])
TINY_LAYERS, TINY_MICRO_BATCH = int(TINY["model.num_layers"]), int(TINY["data.micro_batch_size"])
TINY_GLOBAL_BATCH = int(TINY["data.global_batch_size"])


def routing_trace_by_position(path: Path, experts: torch.Tensor, num_experts: int, mtp_depth: int = 0) -> Path:
    """A routing trace (docs/routing-replay.md) that gives the token at position s the experts
    ``experts[s]`` (``[seq_len, top_k]``) in every MoE layer of TINY_RUN's model (and of its
    ``mtp_depth`` MTP blocks), for every training window of its corpus, so that each rank's routing is
    known whatever samples it gets."""
    from lightning_moe.moe import RoutingTrace

    windows = int(TINY["data.max_corpus_bytes"]) // (TINY_SEQ + 1) + 1
    assert experts.shape[0] == TINY_SEQ, (tuple(experts.shape), TINY_SEQ)
    names = [f"layers.{i}.feed_forward" for i in range(TINY_LAYERS)] + [
        f"mtp.{k}.block.feed_forward" for k in range(mtp_depth)
    ]
    pattern = experts[None, :, None, :].expand(windows, TINY_SEQ, len(names), experts.shape[1]).contiguous()
    trace = RoutingTrace(torch.arange(windows), pattern, names, [num_experts] * len(names))
    trace.save(path)
    return path


# Position s takes experts s % 4 and (s + 1) % 4. At ep2 (experts 0-1 | 2-3), of each rank's tokens
# a quarter have both experts on it (no row), a quarter both on the other rank (one row for two
# slots) and half one on each (one row): 3 rows per 4 tokens where the per-slot path sends 4.
_POSITIONS = torch.arange(TINY_SEQ)
MIXED_EXPERTS = torch.stack([_POSITIONS % TINY_E, (_POSITIONS + 1) % TINY_E], -1)
# No gradient clipping: its norm of the expert gradients is all-reduced over ep too (2 calls a step),
# and only the dispatch is counted here. Adam without clipping hides a gradient scaled as a whole,
# not one scaled per token or per expert, which a wrong dispatch would give.
SHORT_RUN = ["trainer.max_steps=4", "++trainer.gradient_clip_val=null"]


def ep2_bytes_per_step(wire: str | None, chunks: int) -> int:
    """The ep bytes a rank sends per optimizer step at ep2 under :data:`MIXED_EXPERTS`, counted from
    the routing alone: one row per (token, other rank holding one of its experts), 4 transfers of it
    (dispatch and combine, and their gradients), its ids and gate weights, plus one int64 count per
    chunk; per layer and micro-batch."""
    ep, per_rank = 2, TINY_E // 2
    dispatch_row, other_row = {None: (4 * TINY_H, 4 * TINY_H), "fp8": (TINY_H + 4, 2 * TINY_H)}[wire]
    microbatches = TINY_GLOBAL_BATCH // (TINY_MICRO_BATCH * ep)
    ranks_of_token = [{e // per_rank for e in row} for row in MIXED_EXPERTS.tolist()]
    per_rank_pairs = [TINY_MICRO_BATCH * sum(len(ranks - {rank}) for ranks in ranks_of_token) for rank in range(ep)]
    assert per_rank_pairs[0] == per_rank_pairs[1]  # the mean over ranks is either rank's
    per_pass = per_rank_pairs[0] * (dispatch_row + 3 * other_row + PAIR_EXTRA_BYTES) + chunks * (ep - 1) * COUNT_BYTES
    return microbatches * TINY_LAYERS * per_pass


@pytest.fixture(scope="module")
def mixed_routing(tmp_path_factory) -> tuple[Path, list[float]]:
    """The trace of :data:`MIXED_EXPERTS` and the single-process losses under it."""
    trace = routing_trace_by_position(tmp_path_factory.mktemp("trace") / "mixed.safetensors", MIXED_EXPERTS, TINY_E)
    single = train_in_pool(tmp_path_factory.mktemp("single") / "run", *SHORT_RUN, f"+routing.replay={trace}")
    return trace, single["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("wire,chunks,rel", [(None, 2, 1e-5), ("fp8", 1, 2e-2)], ids=["ep2_chunked", "ep2_fp8"])
def test_trainer_default_dispatch_gives_one_process_losses_and_the_counted_bytes(
    tmp_path, mixed_routing, wire, chunks, rel
):
    """ep2 with the default dispatcher, chunked (the one-process losses at rel 1e-5) and with fp8
    dispatch (within its quantisation error, as tests/test_topology.py bounds it: one process has no
    wire to quantise on); each rank's ep bytes per step equal the count of its (token, other rank)
    pairs times a pair's bytes, to the byte."""
    trace, single = mixed_routing
    wire_option = "null" if wire is None else wire
    summary = train_in_pool(tmp_path / "ep2", *SHORT_RUN, "parallel=ep2", f"+routing.replay={trace}", f"model.moe.dispatch_chunks={chunks}",
                            f"model.moe.dispatch_dtype={wire_option}")  # fmt: skip
    assert summary["layout"]["ep"] == 2
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(single), rtol=rel, atol=0.0)
    assert summary["comm"]["ep"]["bytes"] == ep2_bytes_per_step(wire, chunks)
