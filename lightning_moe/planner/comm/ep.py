"""Expert parallelism's collectives: each dispatcher kind's exchange of the routed tokens, keyed by
:class:`~lightning_moe.moe.dispatchers.DispatcherKind` (a kind without a byte model here raises).

Dispatch bytes assume balanced routing: each token slot lands on any ep rank with equal probability,
so ``(ep - 1) / ep`` of a rank's slots leave it (and as many arrive); dropless.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lightning_moe.moe.dispatchers import DispatcherKind, dispatcher_kind
from lightning_moe.planner.comm.collective_bytes import peer_chunks_bytes, peer_share_bytes
from lightning_moe.planner.comm.record import CommRecord
from lightning_moe.planner.comm.step import StepCounts
from lightning_moe.planner.dtypes import BF16_BYTES, FP32_BYTES, INT32_BYTES, INT64_BYTES
from lightning_moe.planner.groups import nodes_spanned
from lightning_moe.planner.model_shape import ModelShape

# Bytes a dispatched row of h elements travels as, by MoELayer(dispatch_dtype=...) (lightning_moe.moe.exchange):
# bf16 2 per element; fp8 1 per element plus the row's fp32 scale.
WIRE_ROW_BYTES = {"bf16": lambda h: BF16_BYTES * h, "fp8": lambda h: h + FP32_BYTES}


def token_exchange_row_bytes(hidden: int, activation_bytes: int, wire: str | None) -> int:
    """Bytes one token slot sends over a step's four token all-to-alls (dispatch and combine, and their
    gradients), as the all-to-all dispatcher sends them: the rows as they are without a ``wire``;
    with one, the dispatch in the wire's format and the combine and both gradients in bf16.

    ``token_exchange_row_bytes(7168, 2, "fp8") == 7172 + 3 * 14336``: fp8 dispatch saves 1/8 of the bytes.
    """
    if wire is None:
        return 4 * hidden * activation_bytes
    return WIRE_ROW_BYTES[wire](hidden) + 3 * BF16_BYTES * hidden


def expected_nodes_per_token(num_nodes: int, experts_per_node: int, top_k: int, max_nodes: int | None = None) -> float:
    """Expected number of distinct nodes holding a token's ``top_k`` experts under uniform routing:
    its experts lie on ``max_nodes`` of the ``num_nodes`` nodes (node-limited routing; every node
    without a limit), those nodes equally likely, the ``top_k`` experts distinct and uniform among
    theirs. A node is missed with the hypergeometric chance that none of its experts is drawn.

    ``expected_nodes_per_token(32, 8, 8, 4)`` is 3.72 (DeepSeek-V3 over 32 nodes, at most 4 per
    token); without the limit 7.27.
    """
    nodes = num_nodes if max_nodes is None else min(max_nodes, num_nodes)
    pool = nodes * experts_per_node
    if top_k > pool:
        raise ValueError(
            f"top_k={top_k} experts do not fit on max_nodes_per_token={nodes} nodes of {experts_per_node} experts"
        )
    missed = math.comb(pool - experts_per_node, top_k) / math.comb(pool, top_k)
    return nodes * (1 - missed)


def token_span_limit(model: ModelShape, num_parts: int) -> int | None:
    """Of ``num_parts`` equal, contiguous parts of the experts (the ep group's nodes, or its ranks),
    how many at most hold one token's experts (None: no limit below all of them).

    - Group-limited routing (``num_groups``, ``group_topk``; DeepSeek's): a token's experts lie in
      ``group_topk`` of ``num_groups`` contiguous expert groups. Where a group spans whole parts
      (``num_groups`` divides ``num_parts``) that is ``group_topk * num_parts / num_groups`` parts;
      where several groups share a part, at most ``group_topk`` parts (an upper bound: two of the
      chosen groups may share one).

    ``max_nodes_per_token`` (a node limit of its own) is applied by the caller where the parts are nodes.

    ``token_span_limit(deepseek_v3, 8)`` is 4 (EP64 over 8 nodes: a group per node) and
    ``token_span_limit(deepseek_v3, 32)`` is 16 (EP256 over 32 nodes: a group over 4 nodes).
    """
    if model.num_groups and model.group_topk:
        if num_parts % model.num_groups == 0:
            return model.group_topk * (num_parts // model.num_groups)
        return min(model.group_topk, num_parts)
    return None


def ep_records(step: StepCounts) -> list[CommRecord]:
    """The ep group's collectives of one optimizer step: those of ``model.dispatcher``'s kind for each
    micro-batch's tokens in each MoE layer (none for ep = 1 or without MoE layers)."""
    if step.layout.ep == 1 or not step.moe_layers:
        return []
    kind = dispatcher_kind(step.model.dispatcher)
    records = _KIND_RECORDS.get(kind)
    if records is None:
        raise NotImplementedError(f"dispatcher={kind.value!r} has no byte model: add its records to planner/comm/ep.py")
    return records(step)


def _alltoall_records(step: StepCounts) -> list[CommRecord]:
    """One row per (token, expert) slot leaving the rank, each way, after an all-to-all of the int64
    counts per expert."""
    model, ep = step.model, step.layout.ep
    m, moe = step.layout.microbatches, step.moe_layers
    counts = step.dispatch_chunks * peer_share_bytes(model.num_experts * INT64_BYTES, ep)
    leave = step.tokens * model.top_k * (ep - 1) / ep
    row = token_exchange_row_bytes(model.hidden_size, step.activation_bytes, model.dispatch_dtype)
    return [
        CommRecord("dispatch counts all-to-all", "ep", "ep", counts * m * moe, m * moe, recorded_as="ep"),
        CommRecord("token dispatch/combine all-to-all", "ep", "ep", row * leave * m * moe, 4 * m * moe,
                   recorded_as="ep", routing_dependent=True),
    ]  # fmt: skip


def _dedup_records(step: StepCounts) -> list[CommRecord]:
    """One row per (token, other ep rank holding one of its experts): ``step.ep_ranks_per_token`` such
    ranks on average, by default the expectation of uniform routing over the ranks its expert groups
    allow (:func:`token_span_limit`; node limits left out), each row with its slots' expert ids (int32) and gate weights (fp32, and their
    gradient); one int64 row count per peer."""
    model, ep = step.model, step.layout.ep
    per_step = step.layout.microbatches * step.moe_layers
    ranks = step.ep_ranks_per_token
    if ranks is None:
        ranks = expected_nodes_per_token(ep, model.num_experts // ep, model.top_k, token_span_limit(model, ep))
    elif not 1 <= ranks <= min(ep, model.top_k):
        raise ValueError(
            f"ep_ranks_per_token={ranks} must lie in [1, min(ep, top_k)] = [1, {min(ep, model.top_k)}]: the mean"
            " number of distinct ep ranks holding a token's experts (None: uniform routing's expectation)"
        )
    pairs = step.tokens * ranks * (ep - 1) / ep
    counts = step.dispatch_chunks * peer_share_bytes(ep * INT64_BYTES, ep)
    row = token_exchange_row_bytes(model.hidden_size, step.activation_bytes, model.dispatch_dtype)
    return [
        CommRecord("dedup dispatch counts all-to-all", "ep", "ep", counts * per_step, per_step, recorded_as="ep"),
        CommRecord("dedup expert ids and gate weights", "ep", "ep",
                   pairs * model.top_k * (INT32_BYTES + 2 * FP32_BYTES) * per_step, 3 * per_step, recorded_as="ep",
                   routing_dependent=True),
        CommRecord("dedup token dispatch/combine all-to-all", "ep", "ep", row * pairs * per_step, 4 * per_step,
                   recorded_as="ep", routing_dependent=True),
    ]  # fmt: skip


def _hierarchical_records(step: StepCounts) -> list[CommRecord]:
    """Two stages, as ``lightning_moe.moe.hierarchical`` issues them: stage 1 over the node group (one
    rank per node) sends each token once to every other node holding one of its experts
    (:func:`expected_nodes_per_token`), with its slots' expert ids (int32) and gate weights (fp32,
    and their gradient), and the combined row back; stage 2, the all-to-all dispatcher inside the
    node, moves the node's slots (``top_k`` per token) among its ranks. Both stages' rows send the
    dispatch, the combine and their gradients (:func:`token_exchange_row_bytes`). The nodes are
    those ``step.gpus_per_node`` makes of the ep group."""
    model, layout, gpus_per_node = step.model, step.layout, step.gpus_per_node
    if gpus_per_node is None:
        raise ValueError(
            "dispatcher='hierarchical' splits the ep group by node: pass comm_records(..., gpus_per_node=...)"
        )
    num_nodes = nodes_spanned(layout, "ep", gpus_per_node)
    if num_nodes < 2:
        raise ValueError(
            f"dispatcher='hierarchical' needs ep ranks on more than one node, and {layout.label()}'s ep group sits"
            f" in one node of {gpus_per_node}: use dispatcher='alltoall'"
        )
    ranks_per_node = layout.ep // num_nodes
    per_step = layout.microbatches * step.moe_layers
    h, k, tokens, chunks = model.hidden_size, model.top_k, step.tokens, step.dispatch_chunks
    row = token_exchange_row_bytes(h, step.activation_bytes, model.dispatch_dtype)
    experts_per_node = model.num_experts // num_nodes
    limits = [n for n in (model.max_nodes_per_token, token_span_limit(model, num_nodes)) if n is not None]
    nodes = expected_nodes_per_token(num_nodes, experts_per_node, k, min(limits, default=None))
    remote_rows = tokens * nodes * (num_nodes - 1) / num_nodes
    across, inside = (0.0, 1.0), (1.0, 0.0)
    node_counts = chunks * peer_share_bytes(num_nodes * INT64_BYTES, num_nodes)
    records = [
        CommRecord("hierarchical node counts all-to-all", "ep", "ep", node_counts * per_step, per_step,
                   recorded_as="ep", split=across),
        CommRecord("hierarchical expert ids and gate weights", "ep", "ep",
                   remote_rows * k * (INT32_BYTES + 2 * FP32_BYTES) * per_step, 3 * per_step, recorded_as="ep",
                   routing_dependent=True, split=across),
        CommRecord("hierarchical rows across nodes", "ep", "ep", remote_rows * row * per_step, 4 * per_step,
                   recorded_as="ep", routing_dependent=True, split=across),
    ]  # fmt: skip
    if ranks_per_node > 1:
        slots_leaving = tokens * k * (ranks_per_node - 1) / ranks_per_node
        local_counts = chunks * peer_share_bytes(experts_per_node * INT64_BYTES, ranks_per_node)
        records += [
            CommRecord("hierarchical in-node counts all-to-all", "ep", "ep", local_counts * per_step, per_step,
                       recorded_as="ep", split=inside),
            CommRecord("hierarchical rows inside the node", "ep", "ep", slots_leaving * row * per_step, 4 * per_step,
                       recorded_as="ep", routing_dependent=True, split=inside),
        ]  # fmt: skip
    return records


def _allgather_records(step: StepCounts) -> list[CommRecord]:
    """Every rank all-gathers the ep group's hidden states (their gradient reduce-scattered back), the
    slots' expert indices (int64) and gate weights (fp32, their gradient reduce-scattered back), and
    reduce-scatters the outputs (their gradient all-gathered): seven collectives per layer."""
    model, ep = step.model, step.layout.ep
    m, moe = step.layout.microbatches, step.moe_layers
    tokens, a = step.tokens, step.activation_bytes
    slots = tokens * model.top_k
    gathered = peer_chunks_bytes(tokens * model.hidden_size * a, ep)
    idx = peer_chunks_bytes(slots * INT64_BYTES, ep)
    weights = peer_chunks_bytes(slots * FP32_BYTES, ep)
    rs = peer_chunks_bytes(tokens * model.hidden_size * a, ep)
    per_layer = 2 * gathered + idx + 2 * weights + 2 * rs
    return [CommRecord("all-gather dispatcher", "ep", "ep", per_layer * m * moe, 7 * m * moe, recorded_as="ep")]


# Each kind's byte model, keyed by the enum: a kind added to DispatcherKind without a row here raises
# in ep_records rather than being counted as another kind's.
_KIND_RECORDS: dict[DispatcherKind, Callable[[StepCounts], list[CommRecord]]] = {
    DispatcherKind.ALLTOALL: _alltoall_records,
    DispatcherKind.ALLTOALL_DEDUP: _dedup_records,
    DispatcherKind.HIERARCHICAL: _hierarchical_records,
    DispatcherKind.ALLGATHER: _allgather_records,
}
