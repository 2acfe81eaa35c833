"""Expert-parallel dispatchers: move routed tokens to the ep ranks that own their experts.

Experts are split contiguously over the ep group: rank r owns experts ``[r*L, (r+1)*L)`` with
``L = num_experts // ep``. Every dispatcher is differentiable end to end and follows the contract
of :mod:`lightning_moe.moe.dispatcher` (``dispatch`` -> context, ``combine`` -> ``[T, H]``).

- :class:`PerRankAllToAllDispatcher` (``dispatcher="alltoall_dedup"``, the default): each token goes
  once to each rank holding one of its experts, which expands it to its experts and sums their
  gate-weighted outputs before one row goes back.
- :class:`AllToAllDispatcher` (``dispatcher="alltoall"``): one row per (token, expert) slot each way;
  more rows whenever a token has several experts on one rank, kept to compare against.
- :class:`AllGatherDispatcher` (``dispatcher="allgather"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_moe import comm
from lightning_moe.moe.dispatcher import (
    DispatchContext,
    Dispatcher,
    LocalDispatcher,
    OverlappingDispatcher,
    gather_expert_rows,
    gather_rows,
    permute_by_expert,
    permute_to_experts,
    scatter_expert_rows,
    unpermute_and_combine,
)
from lightning_moe.moe.exchange import Exchange, check_wire, exchange, exchange_splits, exchange_start, exchange_wait


def regroup_by_local_expert(counts: torch.Tensor) -> torch.Tensor:
    """Permutation from rows ordered (peer, local expert) to (local expert, peer).

    ``counts[peer, expert]`` rows arrived from each peer for each local expert; the grouped GEMM
    needs each expert's rows together.
    """
    peers, local = counts.shape
    block_of_row = torch.repeat_interleave(torch.arange(peers * local, device=counts.device), counts.reshape(-1))
    return torch.argsort((block_of_row % local) * peers + block_of_row // local, stable=True)


def remote_peers(node_ids: list[int] | None, group: dist.ProcessGroup) -> list[bool] | None:
    """Which ranks of ``group`` sit on another node than this one (``node_ids[r]``: the node of rank r;
    None: not known), for the inter-node byte count of :mod:`lightning_moe.moe.exchange`."""
    if node_ids is None:
        return None
    mine = node_ids[dist.get_rank(group)]
    return [node != mine for node in node_ids]


class _ExpertParallelDispatcher:
    """The ep group and this rank's contiguous block of ``num_experts // ep`` experts.

    ``pad_rows``: pad each local expert's rows for the expert GEMMs (see
    :class:`~lightning_moe.moe.dispatcher.LocalDispatcher`); None pads on CPU in bf16/fp16.
    """

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup, pad_rows: bool | None = None) -> None:
        self.num_experts = num_experts
        self.pad_rows = pad_rows
        self.group = ep_group
        self.ep_size = dist.get_world_size(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts {num_experts} is not divisible by ep {self.ep_size}: choose ep dividing num_experts"
            )
        self.num_local_experts = num_experts // self.ep_size
        self.first_expert = dist.get_rank(ep_group) * self.num_local_experts


@dataclass
class AllToAllContext(DispatchContext):
    input_splits: list[int] | None = None
    output_splits: list[int] | None = None
    regroup: torch.Tensor | None = None
    expert_rows: torch.Tensor | None = None  # padded row of each regrouped row (None: unpadded)


@dataclass
class _PendingDispatch:
    exchange: Exchange
    recv_counts: torch.Tensor
    sorted_slots: torch.Tensor
    num_tokens: int
    top_k: int


class AllToAllDispatcher(_ExpertParallelDispatcher, OverlappingDispatcher):
    """``dispatcher="alltoall"``: one row per (token, expert) slot, exchanged with
    ``all_to_all_single`` (uneven splits) after the per-expert counts, and back.

    - ``wire``: what the token rows travel as (``MoELayer(dispatch_dtype=...)``, see
      :mod:`lightning_moe.moe.exchange`): the dispatch forward in that format, the combine forward
      and both backwards in bf16 when it is set.
    - ``node_ids``: the node of each ep rank (``ParallelDims.ep_node_ids``); bytes sent to ranks on
      other nodes are counted as ``comm`` ``"ep_internode"``.
    - ``dispatch_start``/``dispatch_finish`` and ``combine_start``/``combine_finish`` split each
      all-to-all into issue and wait, for the chunked overlap of ``MoELayer(dispatch_chunks=n)``.

    Example::

        dispatcher = AllToAllDispatcher(num_experts=8, ep_group=dims.ep_group)
        ctx = dispatcher.dispatch(x, topk_idx, keep_mask=None)
        y = dispatcher.combine(experts(ctx.expert_input, ctx.tokens_per_local_expert), topk_weights, ctx)
    """

    def __init__(
        self,
        num_experts: int,
        ep_group: dist.ProcessGroup,
        pad_rows: bool | None = None,
        wire: str | None = None,
        node_ids: list[int] | None = None,
    ) -> None:
        super().__init__(num_experts, ep_group, pad_rows)
        check_wire(wire)
        self.wire = wire
        self.set_nodes(node_ids)

    def set_nodes(self, node_ids: list[int] | None) -> None:
        """Mark which ep peers sit on another node (``node_ids[r]``: the node of ep rank r)."""
        self.remote = remote_peers(node_ids, self.group)

    def dispatch_start(
        self, hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None
    ) -> _PendingDispatch:
        permuted, sorted_slots, counts = permute_by_expert(hidden, topk_idx, keep_mask, self.num_experts)
        # recv_counts[s, l]: tokens that source rank s sends to my local expert l.
        recv_counts, input_splits, output_splits = exchange_splits(
            counts.view(self.ep_size, self.num_local_experts), self.group, self.remote
        )
        pending = exchange_start(permuted, output_splits, input_splits, self.group, wire=self.wire, remote=self.remote)
        return _PendingDispatch(pending, recv_counts, sorted_slots, hidden.shape[0], topk_idx.shape[1])

    def dispatch_finish(self, pending: _PendingDispatch) -> AllToAllContext:
        received = exchange_wait(pending.exchange)
        regroup = regroup_by_local_expert(pending.recv_counts)
        expert_input, gemm_counts, positions = gather_expert_rows(
            received, regroup, pending.recv_counts.sum(0), self.pad_rows
        )
        return AllToAllContext(
            expert_input=expert_input,
            tokens_per_local_expert=gemm_counts,
            sorted_slots=pending.sorted_slots,
            num_tokens=pending.num_tokens,
            top_k=pending.top_k,
            input_splits=pending.exchange.input_splits,
            output_splits=pending.exchange.output_splits,
            regroup=regroup,
            expert_rows=positions,
        )

    def combine_start(
        self, expert_output: torch.Tensor, topk_weights: torch.Tensor, ctx: AllToAllContext
    ) -> tuple[Exchange, torch.Tensor, AllToAllContext]:
        by_source = scatter_expert_rows(expert_output, ctx.regroup, ctx.expert_rows)
        pending = exchange_start(
            by_source, ctx.input_splits, ctx.output_splits, self.group, wire=self.combine_wire, remote=self.remote
        )
        return pending, topk_weights, ctx

    def combine_finish(self, pending: tuple[Exchange, torch.Tensor, AllToAllContext]) -> torch.Tensor:
        handle, topk_weights, ctx = pending
        return unpermute_and_combine(exchange_wait(handle), topk_weights, ctx)


@dataclass
class PerRankContext(DispatchContext):
    local: DispatchContext | None = None  # the received rows grouped by this rank's experts
    pair_token: torch.Tensor | None = None  # [P] the token of each (token, destination rank) row sent
    on_rank: torch.Tensor | None = None  # [P, k] which of the token's slots live on that row's rank
    input_splits: list[int] | None = None  # rows sent to each rank
    output_splits: list[int] | None = None  # rows received from each rank


@dataclass
class _PendingPerRank:
    rows: Exchange
    ids: torch.Tensor
    pair_token: torch.Tensor
    on_rank: torch.Tensor
    num_tokens: int
    top_k: int


class PerRankAllToAllDispatcher(OverlappingDispatcher):
    """One copy of a token per destination rank: ``dispatcher="alltoall_dedup"``.

    Each token goes once to every rank of ``ep_group`` holding at least one of its kept experts,
    with the rank-local ids of those experts (``[k]`` int32, -1 for slots elsewhere); the receiver
    expands the row to its experts (``inner``, a :class:`~lightning_moe.moe.dispatcher.LocalDispatcher`
    over its ``num_experts // ep`` experts unless given). The combine sends the token's gate weights
    for that rank (``[k]`` fp32), the receiver sums the gate-weighted outputs of its experts, and one
    row per (token, rank) goes back, where the ranks' partial sums are added. Outputs and gradients
    equal :class:`AllToAllDispatcher`'s up to the order of the sums; the rows sent shrink from
    ``top_k`` per token to the number of distinct ranks holding its experts.

    ``wire``, ``node_ids`` and the ``*_start``/``*_finish`` split are those of :class:`AllToAllDispatcher`;
    ``pad_rows`` that of the default ``inner`` (:class:`~lightning_moe.moe.hierarchical.HierarchicalDispatcher`
    passes its in-node all-to-all).

    Example::

        dispatcher = PerRankAllToAllDispatcher(num_experts=8, ep_group=dims.ep_group)
        ctx = dispatcher.dispatch(x, topk_idx, keep_mask=None)
        y = dispatcher.combine(experts(ctx.expert_input, ctx.tokens_per_local_expert), topk_weights, ctx)
    """

    def __init__(
        self,
        num_experts: int,
        ep_group: dist.ProcessGroup,
        pad_rows: bool | None = None,
        wire: str | None = None,
        node_ids: list[int] | None = None,
        inner: Dispatcher | None = None,
    ) -> None:
        check_wire(wire)
        self.group = ep_group
        self.ep_size = dist.get_world_size(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts {num_experts} is not divisible by ep {self.ep_size}: choose ep dividing num_experts"
            )
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // self.ep_size
        self.inner = inner if inner is not None else LocalDispatcher(self.experts_per_rank, pad_rows)
        self.num_local_experts = self.inner.num_local_experts
        self.wire = wire
        self.remote = remote_peers(node_ids, ep_group)  # peers on other nodes, for the inter-node byte count

    @property
    def pad_rows(self) -> bool | int | None:
        return self.inner.pad_rows

    @pad_rows.setter
    def pad_rows(self, value: bool | int | None) -> None:
        self.inner.pad_rows = value

    def dispatch_start(
        self, hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None
    ) -> _PendingPerRank:
        num_tokens, top_k = topk_idx.shape
        slot_rank = topk_idx // self.experts_per_rank  # [T, k]
        kept = torch.ones_like(topk_idx, dtype=torch.bool) if keep_mask is None else keep_mask
        # present[t, r]: token t has a kept expert on rank r; rows go by rank, then token.
        present = torch.zeros(num_tokens, self.ep_size, dtype=torch.int64, device=topk_idx.device)
        present.scatter_add_(1, slot_rank, kept.long())
        pair_rank, pair_token = (present.t() > 0).nonzero(as_tuple=True)
        send_counts = (present > 0).sum(0)
        on_rank = (slot_rank.index_select(0, pair_token) == pair_rank.unsqueeze(1)) & kept.index_select(0, pair_token)
        local_ids = topk_idx.index_select(0, pair_token) - pair_rank.unsqueeze(1) * self.experts_per_rank
        local_ids = torch.where(on_rank, local_ids, -1).to(torch.int32)

        _, input_splits, output_splits = exchange_splits(send_counts, self.group, self.remote)
        ids = exchange(local_ids, output_splits, input_splits, self.group, remote=self.remote)
        rows = exchange_start(
            gather_rows(hidden, pair_token), output_splits, input_splits, self.group, wire=self.wire, remote=self.remote
        )
        return _PendingPerRank(rows, ids, pair_token, on_rank, num_tokens, top_k)

    def dispatch_finish(self, pending: _PendingPerRank) -> PerRankContext:
        received = exchange_wait(pending.rows)
        ids = pending.ids.long()
        local = self.inner.dispatch(received, ids.clamp(min=0), ids >= 0)
        return PerRankContext(
            expert_input=local.expert_input,
            tokens_per_local_expert=local.tokens_per_local_expert,
            sorted_slots=local.sorted_slots,
            num_tokens=pending.num_tokens,
            top_k=pending.top_k,
            local=local,
            pair_token=pending.pair_token,
            on_rank=pending.on_rank,
            input_splits=pending.rows.input_splits,
            output_splits=pending.rows.output_splits,
        )

    def combine_start(
        self, expert_output: torch.Tensor, topk_weights: torch.Tensor, ctx: PerRankContext
    ) -> tuple[Exchange, PerRankContext]:
        assert ctx.pair_token is not None and ctx.on_rank is not None and ctx.local is not None
        # Each row's gate weights for its rank's slots (0 elsewhere) travel to that rank.
        pair_weights = topk_weights.index_select(0, ctx.pair_token) * ctx.on_rank.to(topk_weights.dtype)
        weights = exchange(pair_weights, ctx.output_splits, ctx.input_splits, self.group, remote=self.remote)
        partial = self.inner.combine(expert_output, weights, ctx.local)  # [R, H]: one row per (token, rank)
        handle = exchange_start(
            partial, ctx.input_splits, ctx.output_splits, self.group, wire=self.combine_wire, remote=self.remote
        )
        return handle, ctx

    def combine_finish(self, pending: tuple[Exchange, PerRankContext]) -> torch.Tensor:
        handle, ctx = pending
        returned = exchange_wait(handle)
        return returned.new_zeros(ctx.num_tokens, returned.shape[1]).index_add(0, ctx.pair_token, returned)


class AllGatherDispatcher(_ExpertParallelDispatcher):
    """All-gather the tokens of the ep group, compute the local experts, reduce-scatter the outputs.

    Every rank of the group must hold the same number of tokens (same micro-batch shape).
    """

    def dispatch(self, hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None) -> DispatchContext:
        all_hidden = comm.all_gather_autograd(hidden, self.group, "ep")
        all_idx = comm.all_gather_autograd(topk_idx, self.group, "ep")
        local_idx = all_idx - self.first_expert
        mine = (local_idx >= 0) & (local_idx < self.num_local_experts)
        if keep_mask is not None:
            # gloo cannot gather bool tensors
            mine &= comm.all_gather_autograd(keep_mask.to(torch.uint8), self.group, "ep").bool()
        local_experts = local_idx.clamp(0, self.num_local_experts - 1)
        return permute_to_experts(all_hidden, local_experts, mine, self.num_local_experts, self.pad_rows)

    def combine(self, expert_output: torch.Tensor, topk_weights: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        all_weights = comm.all_gather_autograd(topk_weights, self.group, "ep")
        partial = unpermute_and_combine(expert_output, all_weights, ctx)
        return comm.reduce_scatter_autograd(partial, self.group, "ep")


@dataclass
class ExpertTensorParallelContext(DispatchContext):
    inner: DispatchContext | None = None
    rows_per_rank: list[int] | None = None
    regroup: torch.Tensor | None = None
    expert_rows: torch.Tensor | None = None  # padded row of each regrouped row (None: unpadded)


class ExpertTensorParallelDispatcher:
    """Expert tensor parallelism (``etp = tp``) around any dispatcher.

    Each tp rank holds every local expert's FFN dim sharded (w1/w3 by column, w2 by row). After
    the inner dispatch, the tp ranks all-gather the rows their local experts received, so each
    computes its FFN shard for all of them; the partial outputs are summed back to their owner
    (reduce-scatter) before the inner combine. Tokens cross the ep network once.
    """

    def __init__(self, inner: Dispatcher, tp_group: dist.ProcessGroup, pad_rows: bool | None = None) -> None:
        self.inner = inner
        self.pad_rows = pad_rows
        inner.pad_rows = False  # the rows are padded once, here, after the tp all-gather
        self.group = tp_group
        self.tp_size = dist.get_world_size(tp_group)
        self.num_experts = inner.num_experts
        self.num_local_experts = inner.num_local_experts

    def dispatch(
        self, hidden: torch.Tensor, topk_idx: torch.Tensor, keep_mask: torch.Tensor | None
    ) -> ExpertTensorParallelContext:
        inner = self.inner.dispatch(hidden, topk_idx, keep_mask)
        tp, local = self.tp_size, self.num_local_experts
        counts = inner.tokens_per_local_expert.to(torch.int64)
        all_counts = torch.empty(tp * local, dtype=torch.int64, device=counts.device)
        # torch 2.13 deprecates all_gather_into_tensor (a FutureWarning per rank) for all_gather_single,
        # the same call, which older releases lack; looked up per call so the comm accounting sees it.
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        gather(all_counts, counts, group=self.group)
        all_counts = all_counts.view(tp, local)
        rows_per_rank = all_counts.sum(1).tolist()
        gathered = comm.all_gather_uneven_autograd(inner.expert_input, rows_per_rank, self.group, "tp")
        regroup = regroup_by_local_expert(all_counts)
        expert_input, gemm_counts, positions = gather_expert_rows(gathered, regroup, all_counts.sum(0), self.pad_rows)
        return ExpertTensorParallelContext(
            expert_input=expert_input,
            tokens_per_local_expert=gemm_counts,
            sorted_slots=inner.sorted_slots,
            num_tokens=inner.num_tokens,
            top_k=inner.top_k,
            inner=inner,
            rows_per_rank=rows_per_rank,
            regroup=regroup,
            expert_rows=positions,
        )

    def combine(
        self, expert_output: torch.Tensor, topk_weights: torch.Tensor, ctx: ExpertTensorParallelContext
    ) -> torch.Tensor:
        by_rank = scatter_expert_rows(expert_output, ctx.regroup, ctx.expert_rows)
        mine = comm.reduce_scatter_uneven_autograd(by_rank, ctx.rows_per_rank, self.group, "tp")
        return self.inner.combine(mine, topk_weights, ctx.inner)
