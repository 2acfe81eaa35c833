"""``dispatcher="alltoall_dedup"``: one copy of a token per destination ep rank.

Outputs and gradients equal the single-process layer's, and the ep bytes are, to the byte, the
(token, other rank) pairs the routing implies times what each pair sends.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

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
    from lightning_moe.planner.communication import comm_records, token_exchange_row_bytes

    config = {"vocab_size": 256, "hidden_size": 64, "num_layers": 1, "num_heads": 4, "ffn_hidden_size": 128}
    seq, ep, layout = 64, 4, Layout(ep=4, microbatches=1)
    rows = {}
    for kind in ("alltoall", "alltoall_dedup"):
        shape = ModelShape.from_config({**config, "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 64, "dispatcher": kind}})
        rows[kind] = {r.what: r.bytes for r in comm_records(shape, layout, seq) if r.dim == "ep"}
    row = token_exchange_row_bytes(64, 4, None)
    pairs = seq * (2 - 1 / 7) * (ep - 1) / ep
    assert rows["alltoall"]["token dispatch/combine all-to-all"] == pytest.approx(seq * 2 * (ep - 1) / ep * row)
    assert rows["alltoall_dedup"] == pytest.approx({
        "dedup dispatch counts all-to-all": (ep - 1) * 8,
        "dedup expert ids and gate weights": pairs * 2 * 12,
        "dedup token dispatch/combine all-to-all": pairs * row,
    })  # fmt: skip
