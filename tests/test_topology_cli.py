"""Trainer level: node-limited routing and the hierarchical dispatcher under ep4 on 2 simulated nodes
(``parallel.ranks_per_node=2``) train with the single-process per-step losses (rel 1e-5, fp32).

The single-process run states the node layout (``model.moe.num_nodes=2``: 2 nodes of 2 experts of the
TINY_RUN's 4); under ep4 the layer takes it from the topology (``num_nodes`` left null).
"""

from __future__ import annotations

import pytest
import torch

from tests.cli import train_in_pool

NODE_LIMITED = ["model.moe.max_nodes_per_token=1"]
TWO_NODES = ["parallel=ep4", "++parallel.ranks_per_node=2"]


@pytest.fixture(scope="module")
def single_node_limited(tmp_path_factory) -> dict:
    return train_in_pool(
        tmp_path_factory.mktemp("single_nodes") / "run", "parallel=single", *NODE_LIMITED, "model.moe.num_nodes=2"
    )


@pytest.mark.slow
def test_node_limited_hierarchical_overlapped_ep4_two_nodes_matches_single(tmp_path, single_node_limited):
    flat = train_in_pool(tmp_path / "flat", *TWO_NODES, *NODE_LIMITED)
    hierarchical = train_in_pool(
        tmp_path / "hierarchical",
        *TWO_NODES,
        *NODE_LIMITED,
        "model.moe.dispatcher=hierarchical",
        "model.moe.dispatch_chunks=2",
    )
    reference = torch.tensor(single_node_limited["losses"])
    for summary in (flat, hierarchical):
        assert summary["layout"]["ep"] == 4
        torch.testing.assert_close(torch.tensor(summary["losses"]), reference, rtol=1e-5, atol=0.0)
    # One node per token: the flat all-to-all sends both of a token's slots across, hierarchical one row.
    assert "ep_internode_bytes" not in single_node_limited
    assert 0 < hierarchical["ep_internode_bytes"] < flat["ep_internode_bytes"] < flat["comm"]["ep"]["bytes"]
    assert single_node_limited["moe_metrics"]["moe/ep_rank_imbalance"] == 1.0
    assert flat["moe_metrics"]["moe/ep_rank_imbalance"] >= 1.0
    assert flat["moe_metrics"]["moe/layer0/ep_rank_imbalance"] == pytest.approx(
        _ep_rank_imbalance(flat["expert_load"]["layer0"], 4)
    )


def _ep_rank_imbalance(counts: list[float], ep: int) -> float:
    per_rank = torch.tensor(counts).view(ep, -1).sum(1)
    return float(per_rank.max() / per_rank.mean())
