"""Topology-aware expert parallelism at the layer level, on 2 simulated nodes (gloo pool of 4 ranks).

Layouts: ep4 with ``ranks_per_node=2`` (2 nodes of 2 ep ranks) and ep2 with ``ranks_per_node=1``
(dp2 x ep2: each ep group spans 2 one-rank nodes). Each feature is compared with its reference:

- node-limited routing, the hierarchical dispatcher and ``dispatch_chunks``: the single-process layer
  of the same seed, every micro-batch a separate forward (outputs, input, expert and router
  gradients, fp32, atol 1e-5), as in tests/test_expert_parallel.py;
- ``routing="expert_choice"``: the single-process layer on the concatenated micro-batches of the
  ep group (the choice is over the ep group's tokens);
- ``dispatch_dtype``: the fp32 dispatch of the same layout, within stated tolerances, and 20 training
  steps.

Inter-node bytes are checked against the exact count the routing implies.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_pool import get_pool, layout
from tests.reference_moe import expert_grad_block, reference_step

WORLD = 4
H, F, E, K = 16, 24, 8, 2
ATOL = 1e-5
# (ep, ranks_per_node): both give 2 nodes per ep group.
TWO_NODES = [(2, 1), (4, 2)]


def _micro_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + rank)
    return torch.randn(2, 6, H, generator=gen), torch.randn(2, 6, H, generator=gen)


def _layer(**options):  # noqa: ANN202
    from lightning_moe.moe import MoELayer

    torch.manual_seed(0)
    return MoELayer(H, F, E, **{"top_k": K, "aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3, **options})


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def reference_case(
    ep: int, ranks_per_node: int, options: dict, reference_options: dict, expert_choice: bool = False
) -> dict:
    """Parallel layer with ``options`` vs the single-process layer with ``reference_options``."""
    from lightning_moe import comm, parallelize

    dims = layout(ep=ep, ranks_per_node=ranks_per_node)
    assert dims.ep_num_nodes == 2
    layer = _layer(**options)
    reference = _layer(**reference_options)
    parallelize(layer, dims, data_parallel="none")
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_peers = dist.get_process_group_ranks(dims.ep_group)
    x, probe = _micro_batch(rank)
    x.requires_grad_(True)
    comm.reset()
    y = layer(x)
    (y * probe).sum().backward()
    counters = comm.snapshot()
    report: dict = {"internode": counters.get("ep_internode", {}).get("bytes", 0)}
    if layer.routing == "topk":
        with torch.no_grad():
            slot_nodes = layer.router(x.reshape(-1, H)).topk_idx // (E // dims.ep_num_nodes)
        report["nodes_per_token"] = max(len(set(row)) for row in slot_nodes.tolist())

    router_grad = layer.router.weight.grad.clone()
    if expert_choice:
        # One forward over the ep group's micro-batches: the experts chose among all of them.
        xs = torch.cat([_micro_batch(r)[0] for r in ep_peers]).requires_grad_(True)
        ps = torch.cat([_micro_batch(r)[1] for r in ep_peers])
        ys = reference(xs)
        (ys * ps).sum().backward()
        me = ep_peers.index(rank)
        ref_out, ref_grad_x = ys[2 * me : 2 * me + 2].detach(), xs.grad[2 * me : 2 * me + 2]
        reference_experts = reference
        dist.all_reduce(router_grad, group=dims.ep_group)
    else:
        step = reference_step(reference, _micro_batch, rank, ep_peers, world)
        ref_out, ref_grad_x, reference_experts = step.out, step.grad_x, step.experts
        dist.all_reduce(router_grad)
    report["out"] = _max_diff(y.detach(), ref_out)
    report["grad_x"] = _max_diff(x.grad, ref_grad_x)
    report["router"] = _max_diff(router_grad, reference.router.weight.grad)
    ep_rank = dims.ep_mesh.get_local_rank()
    for name in ("w1", "w2", "w3"):
        got = getattr(layer.experts, name).grad.to_local()
        report[name] = _max_diff(got, expert_grad_block(reference_experts, name, ep_rank, ep))
    if layer.shared_expert is not None:
        shared = layer.shared_expert.w1.weight.grad.clone()
        dist.all_reduce(shared, group=dims.ep_group if expert_choice else None)
        report["shared"] = _max_diff(shared, reference.shared_expert.w1.weight.grad)
    return report


def _assert_close(reports: list[dict]) -> None:
    for rank, report in enumerate(reports):
        for key in ("out", "grad_x", "router", "w1", "w2", "w3", "shared"):
            if key in report:
                assert report[key] < ATOL, f"rank {rank} {key} differs by {report[key]:.2e}"


CASES = [
    # name, options of the parallel layer, options of the single-process reference
    ("hierarchical", {"dispatcher": "hierarchical"}, {}),
    ("hierarchical_capacity", {"dispatcher": "hierarchical", "capacity_factor": 1.0}, {"capacity_factor": 1.0}),
    ("node_limited_flat", {"max_nodes_per_token": 1}, {"max_nodes_per_token": 1, "num_nodes": 2}),
    ("node_limited_hierarchical", {"max_nodes_per_token": 1, "dispatcher": "hierarchical"},
     {"max_nodes_per_token": 1, "num_nodes": 2}),
    ("chunks3_shared", {"dispatch_chunks": 3, "shared_expert_hidden_size": 8}, {"shared_expert_hidden_size": 8}),
    ("chunks2_hierarchical_sigmoid_bias", {"dispatch_chunks": 2, "dispatcher": "hierarchical", "score_func": "sigmoid",
                                           "expert_bias": True}, {"score_func": "sigmoid", "expert_bias": True}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("ep,ranks_per_node", TWO_NODES, ids=["ep2_2nodes", "ep4_2nodes"])
@pytest.mark.parametrize("name,options,reference_options", CASES, ids=[case[0] for case in CASES])
def test_topology_feature_matches_reference(ep, ranks_per_node, name, options, reference_options):
    reports = get_pool(WORLD).run(
        reference_case, ep=ep, ranks_per_node=ranks_per_node, options=options, reference_options=reference_options
    )
    _assert_close(reports)
    # Node-limited: every token's experts on one node (without the limit, some token uses both).
    assert {report["nodes_per_token"] for report in reports} == ({1} if "max_nodes_per_token" in options else {2})


@pytest.mark.slow
@pytest.mark.parametrize("ep,ranks_per_node", TWO_NODES, ids=["ep2_2nodes", "ep4_2nodes"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "hierarchical"])
def test_expert_choice_matches_one_device_on_the_ep_group_batch(ep, ranks_per_node, dispatcher):
    # No z-loss: it is a mean over each forward's tokens, and the reference runs one forward for two.
    options = {"routing": "expert_choice", "capacity_factor": 1.0, "shared_expert_hidden_size": 8, "z_loss_coeff": 0.0}
    reports = get_pool(WORLD).run(
        reference_case,
        ep=ep,
        ranks_per_node=ranks_per_node,
        options={**options, "dispatcher": dispatcher},
        reference_options=options,
        expert_choice=True,
    )
    _assert_close(reports)


def internode_case(ep: int, ranks_per_node: int, dispatcher: str, max_nodes: int | None) -> dict:
    """Measured inter-node bytes of one forward+backward and the count the routing implies."""
    from lightning_moe import comm, parallelize

    dims = layout(ep=ep, ranks_per_node=ranks_per_node)
    layer = _layer(dispatcher=dispatcher, max_nodes_per_token=max_nodes)
    parallelize(layer, dims, data_parallel="none")
    x, probe = _micro_batch(dist.get_rank())
    x.requires_grad_(True)
    comm.reset()
    (layer(x) * probe).sum().backward()
    measured = comm.snapshot().get("ep_internode", {}).get("bytes", 0)
    topk = layer.router(x.detach().reshape(-1, H)).topk_idx
    nodes, ep_rank = dims.ep_num_nodes, dims.ep_mesh.get_local_rank()
    my_node = dims.ep_node_ids[ep_rank]
    slot_nodes = topk // (E // nodes)
    remote_slots = int((slot_nodes != my_node).sum())
    remote_rows = sum(len(set(row) - {my_node}) for row in slot_nodes.tolist())
    # (token, ep rank on another node holding one of its experts): the default dispatcher's rows
    slot_ranks = topk // (E // ep)
    remote_rank_rows = sum(len({r for r in row if dims.ep_node_ids[r] != my_node}) for row in slot_ranks.tolist())
    return {"measured": measured, "remote_slots": remote_slots, "remote_rows": remote_rows, "remote_rank_rows": remote_rank_rows,
            "remote_peers": sum(n != my_node for n in dims.ep_node_ids), "nodes": nodes}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("ep,ranks_per_node", TWO_NODES, ids=["ep2_2nodes", "ep4_2nodes"])
def test_internode_bytes_equal_what_the_routing_implies(ep, ranks_per_node):
    pool = get_pool(WORLD)
    row = H * 4
    totals = {}
    for dispatcher, max_nodes in (
        ("alltoall", None),
        ("alltoall_dedup", None),
        ("hierarchical", None),
        ("hierarchical", 1),
    ):
        reports = pool.run(
            internode_case, ep=ep, ranks_per_node=ranks_per_node, dispatcher=dispatcher, max_nodes=max_nodes
        )
        measured = sum(r["measured"] for r in reports)
        if dispatcher == "alltoall":
            # Each remote slot: dispatch, combine and both gradients; counts: E/ep int64 per remote peer.
            expected = sum(4 * r["remote_slots"] * row + r["remote_peers"] * (E // ep) * 8 for r in reports)
        elif dispatcher == "alltoall_dedup":
            # Each (token, rank on another node) row: its 4 hidden transfers, slot ids and gate weights;
            # counts: one int64 per remote peer.
            expected = sum(r["remote_rank_rows"] * (4 * row + 3 * K * 4) + r["remote_peers"] * 8 for r in reports)
        else:
            # Each (token, remote node) row: its 4 hidden transfers, slot ids (int32) and gate weights
            # (fp32) forward and back; counts: one int64 per remote node.
            expected = sum(r["remote_rows"] * (4 * row + 3 * K * 4) + (r["nodes"] - 1) * 8 for r in reports)
        assert measured == expected, (dispatcher, max_nodes, measured, expected)
        totals[(dispatcher, max_nodes)] = measured
    assert totals[("hierarchical", None)] < totals[("alltoall", None)]
    assert totals[("hierarchical", 1)] < totals[("hierarchical", None)]


def low_precision_case(ep: int, ranks_per_node: int, dispatcher: str, wire: str, steps: int) -> dict:
    """The same layer with an fp32 and a ``wire`` dispatch: step-0 outputs, gradients and ep bytes, then
    ``steps`` Adam steps on a regression target (non-expert gradients summed over the ranks).

    Also the rows the step-0 routing sends to other ranks: slots whose expert is on another ep rank
    (flat all-to-all), (token, other node) pairs (hierarchical stage 1) and slots whose expert's
    rank has another local index on its node (hierarchical stage 2).
    """
    from lightning_moe import comm, parallelize

    dims = layout(ep=ep, ranks_per_node=ranks_per_node)
    x, _ = _micro_batch(dist.get_rank())
    with torch.no_grad():
        owner = _layer().router(x.reshape(-1, H)).topk_idx // (E // ep)  # the ep rank of each slot's expert
    ep_rank, per_node = dims.ep_mesh.get_local_rank(), ep // dims.ep_num_nodes
    routed_rows = {
        "remote_slots": int((owner != ep_rank).sum()),
        "remote_node_rows": sum(len(set(row) - {ep_rank // per_node}) for row in (owner // per_node).tolist()),
        "remote_local_slots": int((owner % per_node != ep_rank % per_node).sum()),
    }
    results = {}
    for dtype in (None, wire):
        layer = _layer(dispatcher=dispatcher, dispatch_dtype=dtype)
        parallelize(layer, dims, data_parallel="none")
        optimizer = torch.optim.Adam(layer.parameters(), lr=3e-3)
        x, target = _micro_batch(dist.get_rank())
        x.requires_grad_(True)
        losses = []
        comm.reset()
        for step in range(steps + 1):
            y = layer(x)
            loss = (y - target).square().mean()
            loss.backward()
            for param in layer.parameters():
                if not hasattr(param, "to_local") and param.grad is not None:
                    dist.all_reduce(param.grad)
            if step == 0:
                first = {
                    "out": y.detach(),
                    "grad_x": x.grad.clone(),
                    "router": layer.router.weight.grad.clone(),  # summed over the ranks, as the optimizer sees it
                    "w1": layer.experts.w1.grad.to_local().clone(),
                    "w2": layer.experts.w2.grad.to_local().clone(),
                    "ep_bytes": comm.snapshot()["ep"]["bytes"],
                }
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / dist.get_world_size())
            optimizer.step()
            optimizer.zero_grad()
            x.grad = None
        results[dtype] = {**first, "losses": losses}
    base, low = results[None], results[wire]
    report = {
        key: _max_diff(low[key], base[key]) / base[key].abs().max().item()
        for key in ("out", "grad_x", "router", "w1", "w2")
    }
    report["losses"] = max(abs(a - b) / b for a, b in zip(low["losses"], base["losses"]))
    report["ep_bytes"] = {"fp32": base["ep_bytes"], wire: low["ep_bytes"]}
    return {**report, **routed_rows}


# Relative to the largest value of the fp32 dispatch: fp8 has a 3-bit mantissa (2^-4 relative step).
# The router gradient (through the gate weights: a difference of nearby products) is the most sensitive.
LOW_PRECISION_TOL = {
    "bf16": {"out": 1e-2, "grads": 2e-2, "router": 4e-2, "losses": 1e-2},
    "fp8": {"out": 5e-2, "grads": 8e-2, "router": 0.15, "losses": 2e-2},
}


# Bytes of one token row of H values: (dispatch forward, each of the combine forward and the two backwards).
# fp8 sends H float8 values and one fp32 scale, and everything else in bf16.
ROW_BYTES = {"fp32": (4 * H, 4 * H), "bf16": (2 * H, 2 * H), "fp8": (H + 4, 2 * H)}


def expected_ep_bytes(reports: list[dict], dispatcher: str, wire: str, ep: int) -> int:
    """The ep bytes all ranks send in one forward and backward, from the routed rows of each rank.

    Every row sent is received once, so over all ranks each row sent in the dispatch is sent back in
    the combine, and the two backwards send the same rows.
    """
    dispatch_row, other_row = ROW_BYTES[wire]
    per_row = dispatch_row + 3 * other_row
    world, nodes = len(reports), 2
    if dispatcher == "alltoall":
        counts = world * (E * 8 * (ep - 1) // ep)  # E int64 counts, all but this rank's block
        return counts + per_row * sum(r["remote_slots"] for r in reports)
    per_node = ep // nodes
    # Stage 1: one int64 count per other node; stage 2: the node's E / nodes counts over its ep ranks.
    counts = world * (8 * (nodes - 1) + (E // nodes) * 8 * (per_node - 1) // per_node)
    # Each stage-1 row also carries its k slot ids (int32) and k gate weights (fp32, forward and back).
    pairs = sum(r["remote_node_rows"] for r in reports)
    return counts + pairs * (per_row + 3 * K * 4) + per_row * sum(r["remote_local_slots"] for r in reports)


@pytest.mark.slow
@pytest.mark.parametrize(
    "ep,ranks_per_node,dispatcher,wire",
    [(4, 2, "alltoall", "fp8"), (4, 2, "hierarchical", "bf16"), (2, 1, "hierarchical", "fp8")],
)
def test_low_precision_dispatch_within_tolerance(ep, ranks_per_node, dispatcher, wire):
    from lightning_moe.moe.exchange import check_wire

    check_wire(wire)
    reports = get_pool(WORLD).run(
        low_precision_case, ep=ep, ranks_per_node=ranks_per_node, dispatcher=dispatcher, wire=wire, steps=20
    )
    tol = LOW_PRECISION_TOL[wire]
    for rank, report in enumerate(reports):
        assert 0 < report["out"] <= tol["out"], (rank, report)  # 0 would mean the wire format was not used
        for key in ("grad_x", "w1", "w2"):
            assert report[key] <= tol["grads"], (rank, key, report)
        assert report["router"] <= tol["router"], (rank, report)
        assert report["losses"] <= tol["losses"], (rank, report)
    # Exactly the bytes of each format: a wire that falls back to another one sends a different count.
    for dtype in ("fp32", wire):
        measured = sum(report["ep_bytes"][dtype] for report in reports)
        assert measured == expected_ep_bytes(reports, dispatcher, dtype, ep), (dtype, measured, reports)
    assert sum(r["remote_slots"] for r in reports) > 0


def errors_case() -> list[str]:
    from lightning_moe import parallelize

    messages = []
    for sizes, options in (
        ({"ep": 4}, {"dispatcher": "hierarchical"}),  # one node
        ({"ep": 4, "ranks_per_node": 2}, {"max_nodes_per_token": 3}),  # 2 nodes
        ({"ep": 4, "ranks_per_node": 2}, {"dispatcher": "allgather", "dispatch_dtype": "bf16"}),
    ):
        dims = layout(**sizes)
        try:
            parallelize(_layer(**options), dims, data_parallel="none")
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


@pytest.mark.slow
def test_bad_topology_options_fail_before_any_work():
    messages = get_pool(WORLD).run(errors_case)[0]
    assert "same as 'alltoall'" in messages[0] and "ranks_per_node" in messages[0]
    assert "max_nodes_per_token=3 exceeds the 2 node(s)" in messages[1]
    assert "dispatch_dtype='bf16' applies to the all-to-all dispatchers" in messages[2]


# -- one process: the node layout, the routing rules against per-token references, bad input ----------


def test_ranks_per_node_gives_the_ep_node_layout_and_rejects_bad_sizes():
    from lightning_moe import ParallelDims

    def validated(world: int = 8, **sizes):  # noqa: ANN202
        dims = ParallelDims(**sizes)
        dims.validate(world)
        return dims

    assert validated(ep=4, dp=2, ranks_per_node=2).ep_node_ids == [0, 0, 1, 1]
    assert validated(ep=8, ranks_per_node=4).ep_num_nodes == 2
    assert validated(ep=4, tp=2, ranks_per_node=4).ep_node_ids == [0, 0, 1, 1]  # tp stays inside a node
    assert validated(ep=2, dp=4, ranks_per_node=8).ep_num_nodes == 1
    assert ParallelDims(ep=4, ranks_per_node=2).validate(4) is None
    with pytest.raises(ValueError, match="ranks_per_node=3 does not divide the world size 8"):
        validated(ep=8, ranks_per_node=3)
    with pytest.raises(ValueError, match="ranks_per_node=0 must be an integer >= 1"):
        ParallelDims(ep=2, ranks_per_node=0)
    with pytest.warns(UserWarning, match="tp=4 crosses a node boundary"):
        validated(tp=4, ep=2, ranks_per_node=2)
    with pytest.warns(UserWarning, match="tp=3 crosses"):
        uneven = validated(tp=3, ep=4, ranks_per_node=8, world=24)
    assert uneven.ep_rank_nodes == [0, 0, 0, 1]  # counted as it is; two-stage dispatch needs even blocks
    with pytest.raises(ValueError, match="ep=4 ranks do not split evenly over nodes of 8 ranks"):
        uneven.ep_node_ids  # noqa: B018


def _expert_outputs(layer, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """``[T, E, H]``: every expert applied to every token, one expert at a time (no dispatcher)."""
    w1, w3, w2 = layer.experts.w1, layer.experts.w3, layer.experts.w2
    return torch.stack([(torch.nn.functional.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e] for e in range(w1.shape[0])], dim=1)


def test_node_limited_routing_follows_deepseek_v3_rule_per_token():
    layer = _layer(max_nodes_per_token=2, num_nodes=4, top_k=3, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(1))
    routing = layer.router(x)
    scores = torch.softmax(x @ layer.router.weight.T, dim=-1)
    for t in range(x.shape[0]):
        per_node = scores[t].view(4, 2)
        # A node's score: the sum of its ceil(3 / 2) = 2 best scores; keep the 2 best nodes, then top-3 inside.
        nodes = per_node.sum(1).topk(2).indices.tolist()
        allowed = [e for e in range(E) if e // 2 in nodes]
        want = sorted(allowed, key=lambda e: -scores[t, e].item())[:3]
        assert sorted(routing.topk_idx[t].tolist()) == sorted(want)
    assert {len(set((row // 2).tolist())) for row in routing.topk_idx} <= {1, 2}
    y = layer(x)
    reference = (
        routing.topk_weights.unsqueeze(-1)
        * _expert_outputs(layer, x).gather(1, routing.topk_idx.unsqueeze(-1).expand(-1, -1, H))
    ).sum(1)
    torch.testing.assert_close(y, reference, atol=1e-5, rtol=1e-5)


def test_expert_choice_on_one_device_equals_per_expert_top_tokens():
    layer = _layer(routing="expert_choice", capacity_factor=1.5, shared_expert_hidden_size=8)
    x = torch.randn(3, 4, H, generator=torch.Generator().manual_seed(2))
    y = layer(x)
    tokens = x.reshape(-1, H)
    scores = torch.softmax(tokens @ layer.router.weight.T, dim=-1)
    capacity = int(1.5 * 12 * K / E)  # 4 tokens per expert
    outputs = _expert_outputs(layer, tokens)
    reference = layer.shared_expert(tokens)
    for e in range(E):
        for t in scores[:, e].topk(capacity).indices.tolist():
            reference[t] += scores[t, e] * outputs[t, e]
    torch.testing.assert_close(y.reshape(-1, H), reference, atol=1e-5, rtol=1e-5)
    assert layer.stats["tokens_per_expert"].tolist() == [capacity] * E
    picked = torch.zeros(12, dtype=torch.bool)
    for e in range(E):
        picked[scores[:, e].topk(capacity).indices] = True
    assert layer.stats["dropped_fraction"].item() == pytest.approx(1 - picked.float().mean().item())


def test_dispatch_chunks_on_one_device_change_nothing():
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    results = []
    for chunks in (1, 3):
        layer = _layer(dispatch_chunks=chunks, capacity_factor=1.0)
        x.grad = None
        y = layer(x)
        y.square().sum().backward()
        results.append((y.detach(), x.grad.clone(), layer.router.weight.grad, layer.experts.w2.grad))
    for one, chunked in zip(*results):
        torch.testing.assert_close(chunked, one, atol=1e-6, rtol=1e-6)


def test_topology_options_refuse_bad_input(monkeypatch):
    with pytest.raises(ValueError, match="max_nodes_per_token=3 exceeds the 2 node"):
        _layer(max_nodes_per_token=3, num_nodes=2)
    with pytest.raises(ValueError, match="max_nodes_per_token=2 exceeds the 1 node .* set num_nodes"):
        _layer(max_nodes_per_token=2)(torch.randn(4, H))
    with pytest.raises(ValueError, match="num_nodes=3 must be a positive divisor of num_experts=8"):
        _layer(num_nodes=3)
    with pytest.raises(ValueError, match="routing='expert_choice' needs capacity_factor"):
        _layer(routing="expert_choice")
    with pytest.raises(ValueError, match=r"gives C = floor\(0.1 \* 4 tokens \* 2 / 8\) = 0 < 1"):
        _layer(routing="expert_choice", capacity_factor=0.1)(torch.randn(4, H))
    with pytest.raises(ValueError, match="cannot take \\['expert_bias'\\]"):
        _layer(routing="expert_choice", capacity_factor=1.0, expert_bias=True)
    with pytest.raises(ValueError, match="dispatch_chunks=0 must be an integer >= 1"):
        _layer(dispatch_chunks=0)
    with pytest.raises(ValueError, match="dispatch_dtype='fp16' is unknown"):
        _layer(dispatch_dtype="fp16")
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match="dispatch_dtype='fp8' needs torch.float8_e4m3fn, which torch .* lacks"):
        _layer(dispatch_dtype="fp8")
