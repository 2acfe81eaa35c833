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

Outputs and gradients equal the flat all-to-all's (up to the order of the fp32 sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_moe.moe.dispatcher import DispatchContext, LocalDispatcher, OverlappingDispatcher, gather_rows
from lightning_moe.moe.ep_dispatcher import AllToAllDispatcher
from lightning_moe.moe.exchange import Exchange, check_wire, exchange, exchange_splits, exchange_start, exchange_wait

__all__ = ["HierarchicalContext", "HierarchicalDispatcher"]


@dataclass
class HierarchicalContext(DispatchContext):
    inner: DispatchContext | None = None
    pair_token: torch.Tensor | None = None  # [P] the token of each (token, node) row this rank sent
    on_node: torch.Tensor | None = None  # [P, k] which of the token's slots live on that row's node
    recv_slot_ids: torch.Tensor | None = None  # [R, k] node-local expert of each received row's slots (-1: none)
    input_splits: list[int] | None = None  # rows sent to each node
    output_splits: list[int] | None = None  # rows received from each node


@dataclass
class _PendingDispatch:
    rows: Exchange
    ids: torch.Tensor
    pair_token: torch.Tensor
    on_node: torch.Tensor
    num_tokens: int
    top_k: int


class HierarchicalDispatcher(OverlappingDispatcher):
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
        self.num_nodes = dist.get_world_size(node_group)
        self.ranks_per_node = dist.get_world_size(local_group)
        if self.num_nodes < 2:
            raise ValueError(
                "dispatcher='hierarchical' needs ep ranks on more than one node; with one node it is the same as"
                " 'alltoall': use dispatcher='alltoall', or set ranks_per_node smaller to simulate nodes"
            )
        ep = self.num_nodes * self.ranks_per_node
        if num_experts % ep:
            raise ValueError(f"num_experts {num_experts} is not divisible by ep {ep}: choose ep dividing num_experts")
        self.num_experts = num_experts
        self.experts_per_node = num_experts // self.num_nodes
        self.num_local_experts = num_experts // ep
        self.node_group, self.local_group = node_group, local_group
        self.node = dist.get_rank(node_group)
        self.remote = [n != self.node for n in range(self.num_nodes)]
        self.wire = wire
        self.inner: AllToAllDispatcher | LocalDispatcher
        if self.ranks_per_node > 1:
            self.inner = AllToAllDispatcher(self.experts_per_node, local_group, pad_rows, wire=wire)
        else:
            self.inner = LocalDispatcher(self.experts_per_node, pad_rows)

    @property
    def pad_rows(self) -> bool | None:
        return self.inner.pad_rows

    @pad_rows.setter
    def pad_rows(self, value: bool | None) -> None:
        self.inner.pad_rows = value

    def dispatch_start(self, hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None) -> _PendingDispatch:
        num_tokens, top_k = topk_idx.shape
        slot_node = topk_idx // self.experts_per_node  # [T, k]
        kept = torch.ones_like(topk_idx, dtype=torch.bool) if keep_mask is None else keep_mask
        # present[t, n]: token t has a kept expert on node n; rows go by node, then token.
        present = torch.zeros(num_tokens, self.num_nodes, dtype=torch.int64, device=topk_idx.device)
        present.scatter_add_(1, slot_node, kept.long())
        pair_node, pair_token = (present.t() > 0).nonzero(as_tuple=True)
        send_counts = (present > 0).sum(0)
        on_node = (slot_node.index_select(0, pair_token) == pair_node.unsqueeze(1)) & kept.index_select(0, pair_token)
        local_ids = topk_idx.index_select(0, pair_token) - pair_node.unsqueeze(1) * self.experts_per_node
        local_ids = torch.where(on_node, local_ids, -1).to(torch.int32)

        _, input_splits, output_splits = exchange_splits(send_counts, self.node_group, self.remote)
        ids = exchange(local_ids, output_splits, input_splits, self.node_group, remote=self.remote)
        rows = exchange_start(
            gather_rows(hidden, pair_token), output_splits, input_splits, self.node_group,
            wire=self.wire, remote=self.remote,
        )
        return _PendingDispatch(rows, ids, pair_token, on_node, num_tokens, top_k)

    def dispatch_finish(self, pending: _PendingDispatch) -> HierarchicalContext:
        received = exchange_wait(pending.rows)
        ids = pending.ids.long()
        inner = self.inner.dispatch(received, ids.clamp(min=0), ids >= 0)
        return HierarchicalContext(
            expert_input=inner.expert_input,
            tokens_per_local_expert=inner.tokens_per_local_expert,
            sorted_slots=inner.sorted_slots,
            num_tokens=pending.num_tokens,
            top_k=pending.top_k,
            inner=inner,
            pair_token=pending.pair_token,
            on_node=pending.on_node,
            recv_slot_ids=ids,
            input_splits=pending.rows.input_splits,
            output_splits=pending.rows.output_splits,
        )

    def combine_start(
        self, expert_output: torch.Tensor, topk_weights: torch.Tensor, ctx: HierarchicalContext
    ) -> tuple[Exchange, HierarchicalContext]:
        assert ctx.pair_token is not None and ctx.on_node is not None and ctx.inner is not None
        # The gate weights of each row's slots on its node (0 elsewhere) travel to the forwarding rank.
        pair_weights = topk_weights.index_select(0, ctx.pair_token) * ctx.on_node.to(topk_weights.dtype)
        weights = exchange(pair_weights, ctx.output_splits, ctx.input_splits, self.node_group, remote=self.remote)
        partial = self.inner.combine(expert_output, weights, ctx.inner)  # [R, H]: one row per (token, node)
        handle = exchange_start(
            partial, ctx.input_splits, ctx.output_splits, self.node_group, wire=self.combine_wire, remote=self.remote
        )
        return handle, ctx

    def combine_finish(self, pending: tuple[Exchange, HierarchicalContext]) -> torch.Tensor:
        handle, ctx = pending
        returned = exchange_wait(handle)
        out = returned.new_zeros(ctx.num_tokens, returned.shape[1])
        return out.index_add(0, ctx.pair_token, returned)
