"""Two-stage (hierarchical) expert-parallel dispatch: each token crosses the node boundary once.

The ep group is ``nodes x local`` ranks (``ParallelDims.ep_node_mesh``): ep rank ``n * local + l``
sits on node ``n`` at local index ``l`` and owns experts ``[(n * local + l) * E_l, ...)``; node ``n``
holds the contiguous block of ``E_n = E / nodes`` experts.

- Stage 1 (``node_group``: the ranks with local index ``l``, one per node): every token goes once to
  each node that holds one of its kept experts, to the rank there with this rank's local index,
  with the node-local ids of its experts on that node.
- Stage 2 (``local_group``: the ranks of this node): that rank forwards the rows to the ranks of
  its node holding their experts (a flat all-to-all inside the node).
- Combine in reverse: the forwarding rank sums the gate-weighted expert outputs of each token's
  experts on its node (the gate weights travel in stage 1 as ``[rows, k]`` fp32), and one row per
  (token, node) goes back across the node boundary, where the node partials are added.

Stage 1 is :class:`~lightning_moe.moe.ep_dispatcher.PerRankAllToAllDispatcher` over the node group
(one copy per destination node), whose receivers dispatch on with stage 2. Outputs and gradients
equal the flat all-to-all's (up to the order of the fp32 sums).
"""

from __future__ import annotations

import torch.distributed as dist

from lightning_moe.moe.dispatcher import Dispatcher, LocalDispatcher
from lightning_moe.moe.ep_dispatcher import AllToAllDispatcher, PerRankAllToAllDispatcher
from lightning_moe.moe.exchange import check_wire

__all__ = ["HierarchicalDispatcher"]


class HierarchicalDispatcher(PerRankAllToAllDispatcher):
    """``dispatcher="hierarchical"``: stage 1 across nodes, stage 2 inside the node (module docstring).

    Example::

        mesh = dims.ep_node_mesh   # ParallelDims(ep=4, ranks_per_node=2): 2 nodes of 2 ep ranks
        dispatcher = HierarchicalDispatcher(8, mesh.get_group("ep_node"), mesh.get_group("ep_local"))
        ctx = dispatcher.dispatch(x, topk_idx, keep_mask=None)
        y = dispatcher.combine(experts(ctx.expert_input, ctx.tokens_per_local_expert), topk_weights, ctx)
    """

    def __init__(
        self,
        num_experts: int,
        node_group: dist.ProcessGroup,
        local_group: dist.ProcessGroup,
        pad_rows: bool | None = None,
        wire: str | None = None,
    ) -> None:
        check_wire(wire)
        num_nodes = dist.get_world_size(node_group)
        ranks_per_node = dist.get_world_size(local_group)
        if num_nodes < 2:
            raise ValueError(
                "dispatcher='hierarchical' needs ep ranks on more than one node; with one node it is the same as"
                " 'alltoall': use dispatcher='alltoall', or set ranks_per_node smaller to simulate nodes"
            )
        ep = num_nodes * ranks_per_node
        if num_experts % ep:
            raise ValueError(f"num_experts {num_experts} is not divisible by ep {ep}: choose ep dividing num_experts")
        experts_per_node = num_experts // num_nodes
        stage2: Dispatcher
        if ranks_per_node > 1:
            stage2 = AllToAllDispatcher(experts_per_node, local_group, pad_rows, wire=wire)
        else:
            stage2 = LocalDispatcher(experts_per_node, pad_rows)
        # Each rank of the node group sits on its own node: every peer's bytes are inter-node.
        super().__init__(num_experts, node_group, wire=wire, node_ids=list(range(num_nodes)), inner=stage2)
