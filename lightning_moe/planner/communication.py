"""Communication: every collective of one optimizer step, in bytes per rank, split intra/inter-node.

From the same collectives the code issues, counted by the conventions of :mod:`lightning_moe.comm`
(bytes a rank sends to its peers; an all-reduce counts ``2 (n-1)/n``), each split into intra-node
and inter-node bytes by where the group's ranks sit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lightning_moe.cp.comm import CpComm
from lightning_moe.layout import PARALLEL_DIMS, ulysses_kv_heads
from lightning_moe.moe.dispatchers import DispatcherKind, dispatcher_kind
from lightning_moe.planner.cluster import Cluster
from lightning_moe.planner.dtypes import (
    ACTIVATION_BYTES,
    BF16_BYTES,
    FP32_BYTES,
    FP64_BYTES,
    FSDP_GATHER_BYTES,
    FSDP_REDUCE_BYTES,
    INT32_BYTES,
    INT64_BYTES,
)
from lightning_moe.planner.groups import fsdp_shard_group, group_size, nodes_spanned, peer_split, ring_split
from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.model_shape import ModelShape
from lightning_moe.planner.rank_shards import fsdp_units

# The kinds as module constants, read per layout (an enum member read off its class costs a call);
# ``_RING``/``_A2A`` are the plain strings ``Layout.cp_comm`` and ``CommRecord.pattern`` hold.
_RING, _A2A = CpComm.RING.value, CpComm.A2A.value
_ALLTOALL, _ALLTOALL_DEDUP = DispatcherKind.ALLTOALL, DispatcherKind.ALLTOALL_DEDUP
_ALLGATHER, _HIERARCHICAL = DispatcherKind.ALLGATHER, DispatcherKind.HIERARCHICAL

# Lightning broadcasts an int64 "sigterm" flag from rank 0 at every training batch but the first of
# an optimizer step (lightning.pytorch.loops.training_epoch_loop._broadcast_sigterm_tensor).
SIGTERM_FLAG_BYTES = INT64_BYTES
# The pipeline's mean loss is one fp32 broadcast from the last stage per pipeline step
# (lightning_moe.parallel.pipeline_runner.PipelineRunner.broadcast_mean).
PIPELINE_LOSS_BYTES = FP32_BYTES


def peer_chunks_bytes(chunk: int, n: int) -> int:
    """Bytes a rank sends in an all-gather or reduce-scatter over ``n`` ranks of ``chunk`` bytes per
    rank: one chunk to (or for) each of its ``n - 1`` peers."""
    return chunk * (n - 1)


def peer_share_bytes(whole: int, n: int) -> int:
    """Bytes a rank sends in an all-gather, reduce-scatter or all-to-all over ``n`` ranks of a
    ``whole`` tensor: the ``(n - 1) / n`` of it bound for its peers."""
    return whole * (n - 1) // n


def all_reduce_bytes(whole: int, n: int) -> int:
    """Bytes a rank sends in a ring all-reduce of ``whole`` over ``n`` ranks: a reduce-scatter and an
    all-gather, ``2 (n - 1) / n`` of it."""
    return 2 * whole * (n - 1) // n


# ---- all-to-all (Ulysses) context parallelism, as lightning_moe.cp.ulysses runs it ----


def ulysses_attention_bytes(
    batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int, cp: int, dtype_bytes: int, *, backward: bool = True
) -> int:
    """Bytes one rank sends to its cp peers in the all-to-alls of one attention call under
    ``cp_comm="a2a"`` (all-to-all, Ulysses context parallelism).

    Arguments:

    - ``batch``: samples of the micro-batch;
    - ``heads``, ``kv_heads``: query and key/value heads of the rank's attention, i.e. per tp rank
      (``num_heads // tp``, ``num_kv_heads // tp``);
    - ``seq_len``: the full sequence (each cp rank holds ``seq_len / cp`` tokens of it);
    - ``head_dim``: elements per head (q, k, v and the output share it);
    - ``cp``: the cp group's size (0 bytes for cp = 1);
    - ``dtype_bytes``: bytes per element exchanged, the activations' dtype
      (:data:`~lightning_moe.planner.dtypes.ACTIVATION_BYTES`: the runtime casts q, k, v to the
      autocast dtype before the exchange, so 2 under ``bf16-mixed``, 4 under ``32-true``);
    - ``backward``: add the backward's all-to-alls (dQ, dK, dV back to sequence shards and dO to
      head shards: the same bytes again); False gives the forward's alone
      (``lightning_moe.cp.ulysses.ulysses_bytes_per_rank``).

    Forward: one all-to-all of Q, K and V (K and V with :func:`~lightning_moe.layout.ulysses_kv_heads` heads, repeated up to
    a multiple of cp) from ``[batch, H, seq_len/cp, head_dim]`` sequence shards to head shards, one of
    the output back. Of a tensor of ``n`` elements per rank a rank sends the ``(cp - 1) / cp`` bound
    for its peers: ``n = batch x (2 heads + 2 kv') x seq_len / cp x head_dim``, and the forward sends
    ``n (cp - 1) / cp x dtype_bytes``. Independent of the mask (causal or document-causal); the
    document ids' all-gather of packed batches is not counted.

    Example::

        ulysses_attention_bytes(1, 8, 2, 4096, 128, cp=4, dtype_bytes=2)   # 2 x 3/4 x (8+8+4+4) x 1024 x 128 x 2
    """
    if cp <= 1:
        return 0
    if seq_len % cp:
        raise ValueError(f"seq_len {seq_len} is not divisible by cp = {cp}")
    kv = ulysses_kv_heads(heads, kv_heads, cp)
    elements = batch * (2 * heads + 2 * kv) * (seq_len // cp) * head_dim  # q, output, k, v on one rank
    forward = elements // cp * (cp - 1) * dtype_bytes  # heads and kv are multiples of cp: exact
    return 2 * forward if backward else forward


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


@dataclass
class CommRecord:
    """Bytes one rank sends per optimizer step (mean over all ranks) for one kind of collective.

    ``dim``: the parallel dimension it serves; ``group``: the group it runs on (a key of
    :data:`~lightning_moe.planner.groups.GROUP_SPANS` or ``"edp"``); ``recorded_as``: the dim
    :mod:`lightning_moe.comm`'s wrapper names (None: a ``torch.distributed`` or functional
    collective, attributed by its group); ``functional``: a DTensor (functional) collective;
    ``pattern``: ``"spread"`` (to all peers) or ``"ring"``/``"chain"`` (to the next rank; ``"ring"`` is
    ring attention's, ``CpComm.RING``, wrapping around the cp group);
    ``overlapped``: the code overlaps it with compute; ``reduction``: a gradient reduction (FSDP2's
    reduce-scatters, HSDP's all-reduce), whose last one per step waits for the last backward
    (:func:`~lightning_moe.planner.step_time.overlap_budget`); ``split``: the ``(intra, inter)``
    node share of its bytes where its group is not one of the layout's (the hierarchical
    dispatcher's stages: across nodes only, inside the node only); ``all_to_all``: an all-to-all outside ep
    (ep's are known by their dim), whose bytes to in-node and to other nodes' peers flow at once,
    each tier at its own pace, where a ring collective over a group that spans nodes runs at the
    slowest link's (:func:`~lightning_moe.planner.step_time.record_seconds`).
    """

    what: str
    dim: str
    group: str
    bytes: float
    calls: float
    recorded_as: str | None = None
    functional: bool = False
    pattern: str = "spread"
    overlapped: bool = False
    routing_dependent: bool = False
    all_to_all: bool = False
    reduction: bool = False
    split: tuple[float, float] | None = None


def _batches_per_step(layout: Layout) -> int:
    """Lightning training batches per optimizer step (pp > 1: one grouped batch per pipeline step)."""
    return layout.pipeline_steps if layout.pp > 1 else layout.microbatches


def fsdp_reduces(layout: Layout) -> int:
    """FSDP2 gradient reductions per optimizer step: after every micro-batch's backward (pp = 1), once
    (``gather_once_per_step``: gradient sync only in the step's last backward), or in the last
    backward of each pipeline step (pp > 1, ``lightning_moe._compat.pipeline_stage_class``'s
    ``backward_maybe_with_nosync``)."""
    if layout.pp > 1:
        return layout.pipeline_steps
    return 1 if layout.gather_once_per_step else layout.microbatches


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
        raise ValueError(f"top_k={top_k} experts do not fit on max_nodes_per_token={nodes} nodes of {experts_per_node} experts")
    missed = math.comb(pool - experts_per_node, top_k) / math.comb(pool, top_k)
    return nodes * (1 - missed)


def dispatch_chunks_run(model: ModelShape, tokens: float) -> int:
    """The chunks an MoE layer dispatches a rank's ``tokens`` in (``MoELayer``: ``dispatch_chunks``, at
    most one per token). Each exchanges counts of its own, while its rows are a share of the whole;
    records keep one call per micro-batch and layer, and the step time charges each chunk's extra
    calls (:func:`~lightning_moe.planner.step_time.estimate`)."""
    return max(1, min(model.dispatch_chunks, int(tokens)))


def hierarchical_dispatch_records(
    model: ModelShape, tokens: float, num_nodes: int, ranks_per_node: int, activation_bytes: int, per_step: float
) -> list[CommRecord]:
    """The hierarchical dispatcher's collectives for ``tokens`` tokens of one rank, ``per_step`` times
    a step (micro-batches x MoE layers), as ``lightning_moe.moe.hierarchical`` issues them: stage 1
    over the node group (one rank per node) sends each token once to every other node holding one of
    its experts (:func:`expected_nodes_per_token`), with its slots' expert ids (int32) and gate
    weights (fp32, and their gradient), and the combined row back; stage 2, the all-to-all
    dispatcher inside the node, moves the node's slots (``top_k`` per token) among its ranks. Both
    stages' rows send the dispatch, the combine and their gradients (:func:`token_exchange_row_bytes`).
    """
    h, k = model.hidden_size, model.top_k
    experts_per_node = model.num_experts // num_nodes
    nodes = expected_nodes_per_token(num_nodes, experts_per_node, k, model.max_nodes_per_token)
    remote_rows = tokens * nodes * (num_nodes - 1) / num_nodes
    across, inside = (0.0, 1.0), (1.0, 0.0)
    chunks = dispatch_chunks_run(model, tokens)
    records = [
        CommRecord("hierarchical node counts all-to-all", "ep", "ep",
                   chunks * peer_share_bytes(num_nodes * INT64_BYTES, num_nodes) * per_step, per_step, recorded_as="ep", split=across),
        CommRecord("hierarchical expert ids and gate weights", "ep", "ep", remote_rows * k * (INT32_BYTES + 2 * FP32_BYTES) * per_step,
                   3 * per_step, recorded_as="ep", routing_dependent=True, split=across),
        CommRecord("hierarchical rows across nodes", "ep", "ep", remote_rows * token_exchange_row_bytes(h, activation_bytes, model.dispatch_dtype) * per_step,
                   4 * per_step, recorded_as="ep", routing_dependent=True, split=across),
    ]  # fmt: skip
    if ranks_per_node > 1:
        slots_leaving = tokens * k * (ranks_per_node - 1) / ranks_per_node
        records += [
            CommRecord("hierarchical in-node counts all-to-all", "ep", "ep",
                       chunks * peer_share_bytes(experts_per_node * INT64_BYTES, ranks_per_node) * per_step, per_step, recorded_as="ep",
                       split=inside),
            CommRecord("hierarchical rows inside the node", "ep", "ep",
                       slots_leaving * token_exchange_row_bytes(h, activation_bytes, model.dispatch_dtype) * per_step, 4 * per_step,
                       recorded_as="ep", routing_dependent=True, split=inside),
        ]  # fmt: skip
    return records


def comm_records(
    model: ModelShape,
    layout: Layout,
    seq_len: int,
    precision: str = "32-true",
    *,
    gpus_per_node: int | None = None,
    ep_ranks_per_token: float | None = None,
) -> list[CommRecord]:
    """Every collective of one optimizer step, bytes per rank averaged over all ranks.

    Expert dispatch bytes assume balanced routing: each token slot lands on any ep rank with equal
    probability, so ``(ep - 1) / ep`` of a rank's slots leave it (and as many arrive); dropless.
    ``dispatcher="alltoall_dedup"`` (the default) sends a token once per other ep rank among the
    ranks holding its experts: ``ep_ranks_per_token`` of them on average, by default the expectation
    of uniform routing (:func:`expected_nodes_per_token`, each rank a "node" of ``E / ep``); pass a
    measured or replayed routing's mean to count that routing's rows.
    Everything else is deterministic. Sequence parallelism is on (the strategy's default).
    ``gpus_per_node``: where nodes begin, which the hierarchical dispatcher needs (its stages are the
    ep group's nodes and the ranks inside each).

    Example::

        comm_records(shape, Layout(ep=4, microbatches=2), seq_len=4096, precision="bf16-mixed")
        comm_records(shape, Layout(ep=2, microbatches=2), 32, ep_ranks_per_token=2.0)  # every token on both ranks
    """
    a = ACTIVATION_BYTES[precision]
    w = FSDP_GATHER_BYTES[precision]  # unsharded parameters (and their gradients) in FSDP's param dtype
    h, s, b = model.hidden_size, seq_len, layout.micro_batch_size
    tp, cp, ep, pp = layout.tp, layout.cp, layout.ep, layout.pp
    m = layout.microbatches
    records: list[CommRecord] = []
    # Fractions of ranks holding the embedding / the output: pipeline ranks hold 1/pp of the world each.
    first = 1.0 / pp
    last = 1.0 / pp
    # Blocks per rank, averaged over pipeline ranks; each MTP depth runs one more block of the last
    # layer's kind on the last stage (lightning_moe.planner.mtp).
    mtp_blocks = model.mtp_depth * last
    mtp_moe = model.is_moe(model.num_layers - 1)
    layers_per_rank = model.num_layers / pp + mtp_blocks
    moe_per_rank = model.num_moe_layers / pp + (mtp_blocks if mtp_moe else 0)
    dense_per_rank = (model.num_layers - model.num_moe_layers) / pp + (0 if mtp_moe else mtp_blocks)

    def add(*args: Any, **kwargs: Any) -> None:
        rec = CommRecord(*args, **kwargs)
        if rec.bytes or rec.calls:
            records.append(rec)

    # Tokens of one micro-batch on a rank: sequence over cp, then sequence-parallel shard over tp.
    seq_local = s // cp
    act_full = b * seq_local * h * a  # one micro-batch's hidden states on a cp rank
    # ---- tensor parallel (DTensor plan with sequence parallelism) ----
    if tp > 1:
        u = peer_share_bytes(act_full, tp)  # an all-gather or reduce-scatter of the hidden states
        # embedding: reduce-scatter forward, all-gather backward (first stage)
        add("embedding RS/AG", "tp", "tp", 2 * u * m * first, 2 * m * first, functional=True)
        # attention input all-gather + wo reduce-scatter, and their backward
        add("attention AG/RS", "tp", "tp", 4 * u * m * layers_per_rank, 4 * m * layers_per_rank, functional=True)
        add("dense FFN AG/RS", "tp", "tp", 4 * u * m * dense_per_rank, 4 * m * dense_per_rank, functional=True)
        # norm weights: Replicate DTensors whose Partial gradient is all-reduced (2 norms per layer, final
        # norm) when FSDP2 reads it for its reduction (FSDPParam._get_grad_inner_tensor): once per
        # reduction, on the gradient accumulated in the reduce dtype (fp32) over the backwards before it
        reduces = fsdp_reduces(layout)
        grad_bytes = w if reduces == m else FSDP_REDUCE_BYTES
        norm = all_reduce_bytes(h * grad_bytes, tp)
        norms = 2 * layers_per_rank + last + 3 * mtp_blocks  # an MTP depth adds enorm, hnorm and its norm
        add("norm weight grad all-reduce", "tp", "tp", norm * reduces * norms, reduces * norms, functional=True)
        # output: input all-gather (+ backward reduce-scatter), logits all-gather to Replicate; the MTP
        # depths' head inputs join the main one in the same call
        logits = peer_chunks_bytes(b * seq_local * (model.vocab_size // tp) * a, tp)
        add("output AG/RS + logits AG", "tp", "tp", (2 * u + logits) * m * (last + mtp_blocks), 3 * m * last, functional=True)
        if model.mtp_depth:
            # the embedding of every depth's tokens ahead, in one call on the last stage; eh_proj's
            # replicated weight, its gradient all-reduced as the norms' are
            add("MTP embedding RS/AG", "tp", "tp", 2 * u * m * mtp_blocks, 2 * m * last, functional=True)
            eh_proj = all_reduce_bytes(2 * h * h * grad_bytes, tp)
            add("MTP eh_proj weight grad all-reduce", "tp", "tp", eh_proj * reduces * mtp_blocks, reduces * mtp_blocks, functional=True)
        if layout.etp == tp and moe_per_rank:
            # ExpertTensorParallelDispatcher: rows that reached this rank's experts are all-gathered over
            # tp and the partial outputs reduce-scattered back (uneven all-to-alls), forward and backward;
            # plus one all-gather of the int64 counts per local expert.
            rows = b * seq_local // tp * model.top_k  # slots of this rank's tokens (balanced: as many arrive)
            add("expert-TP row all-gather/reduce-scatter", "tp", "tp", 4 * peer_chunks_bytes(rows * h * a, tp) * m * moe_per_rank,
                4 * m * moe_per_rank, recorded_as="tp", routing_dependent=ep > 1)
            counts = dispatch_chunks_run(model, b * seq_local // tp) * peer_chunks_bytes((model.num_experts // ep) * INT64_BYTES, tp)
            add("expert-TP counts all-gather", "tp", "tp", counts * m * moe_per_rank, m * moe_per_rank)
    # ---- MoE statistics over the sequence group (cp x tp), recorded as "cp" ----
    n_seq = cp * tp
    if n_seq > 1 and moe_per_rank:
        totals = all_reduce_bytes((2 * model.num_experts + 4) * FP32_BYTES, n_seq)
        add("MoE statistics all-reduce", "cp", "sequence", totals * m * moe_per_rank, m * moe_per_rank, recorded_as="cp")
        if model.load_balancing == "seq_aux_loss":
            seq_totals = all_reduce_bytes(b * (2 * model.num_experts + 1) * FP32_BYTES, n_seq)
            add("sequence aux-loss all-reduce", "cp", "sequence", seq_totals * m * moe_per_rank, m * moe_per_rank, recorded_as="cp")
    # ---- context parallel: all-to-all (Ulysses) attention, not overlapped: the exchange sits between
    # the projections and the attention kernel. Forward: Q/K/V in one all-to-all, the output in
    # another; backward: their gradients, as many bytes again (lightning_moe.cp.ulysses) ----
    if cp > 1 and layout.cp_comm == _A2A:
        per_attention = ulysses_attention_bytes(b, model.num_heads // tp, model.num_kv_heads // tp, s, model.head_dim, cp, a)
        add("all-to-all attention Q/K/V and output", "cp", "cp", per_attention * m * layers_per_rank,
            4 * m * layers_per_rank, all_to_all=True)
    # ---- context parallel: ring attention ----
    elif cp > 1:
        kv_block = b * (model.num_kv_heads // tp) * seq_local * model.head_dim
        # forward: cp-1 shifts of (K, V); backward: cp-1 shifts of (K, V) and cp shifts of fp32 (dK, dV)
        per_attention = (2 * (cp - 1) * 2 * kv_block * a) + cp * 2 * kv_block * FP32_BYTES
        add("ring attention K/V and dK/dV", "cp", "cp", per_attention * m * layers_per_rank,
            (3 * cp - 2) * m * layers_per_rank, pattern=_RING, overlapped=True)
    if cp > 1:
        if pp > 1:
            # pipeline_batch all-reduces each sample's loss-token count (float64) over cp per pipeline step
            samples = b * layout.pipeline_microbatches
            add("loss-token count all-reduce", "cp", "cp", all_reduce_bytes(samples * FP64_BYTES, cp) * layout.pipeline_steps, layout.pipeline_steps)
    # ---- expert parallel ----
    if ep > 1 and moe_per_rank:
        tokens = b * seq_local // tp  # each tp rank dispatches its sequence shard
        slots = tokens * model.top_k
        chunks = dispatch_chunks_run(model, tokens)
        kind = dispatcher_kind(model.dispatcher)
        if kind is _ALLTOALL:
            counts = chunks * peer_share_bytes(model.num_experts * INT64_BYTES, ep)
            add("dispatch counts all-to-all", "ep", "ep", counts * m * moe_per_rank, m * moe_per_rank, recorded_as="ep")
            leave = slots * (ep - 1) / ep
            add("token dispatch/combine all-to-all", "ep", "ep", token_exchange_row_bytes(h, a, model.dispatch_dtype) * leave * m * moe_per_rank,
                4 * m * moe_per_rank, recorded_as="ep", routing_dependent=True)
        elif kind is _ALLTOALL_DEDUP:
            # One row per (token, other ep rank holding one of its experts), uniform routing over all
            # ep ranks (node limits left out); each with its slots' expert ids (int32) and gate weights
            # (fp32, and their gradient); one int64 row count per peer.
            per_step = m * moe_per_rank
            ranks = ep_ranks_per_token
            if ranks is None:
                ranks = expected_nodes_per_token(ep, model.num_experts // ep, model.top_k)
            elif not 1 <= ranks <= min(ep, model.top_k):
                raise ValueError(
                    f"ep_ranks_per_token={ranks} must lie in [1, min(ep, top_k)] = [1, {min(ep, model.top_k)}]: the mean"
                    " number of distinct ep ranks holding a token's experts (None: uniform routing's expectation)"
                )
            pairs = tokens * ranks * (ep - 1) / ep
            add("dedup dispatch counts all-to-all", "ep", "ep", chunks * peer_share_bytes(ep * INT64_BYTES, ep) * per_step, per_step,
                recorded_as="ep")
            add("dedup expert ids and gate weights", "ep", "ep", pairs * model.top_k * (INT32_BYTES + 2 * FP32_BYTES) * per_step,
                3 * per_step, recorded_as="ep", routing_dependent=True)
            add("dedup token dispatch/combine all-to-all", "ep", "ep", token_exchange_row_bytes(h, a, model.dispatch_dtype) * pairs * per_step,
                4 * per_step, recorded_as="ep", routing_dependent=True)
        elif kind is _HIERARCHICAL:
            if gpus_per_node is None:
                raise ValueError("dispatcher='hierarchical' splits the ep group by node: pass comm_records(..., gpus_per_node=...)")
            num_nodes = nodes_spanned(layout, "ep", gpus_per_node)
            if num_nodes < 2:
                raise ValueError(
                    f"dispatcher='hierarchical' needs ep ranks on more than one node, and {layout.label()}'s ep group sits"
                    f" in one node of {gpus_per_node}: use dispatcher='alltoall'"
                )
            records += hierarchical_dispatch_records(model, tokens, num_nodes, ep // num_nodes, a, m * moe_per_rank)
        elif kind is _ALLGATHER:
            gathered = peer_chunks_bytes(tokens * h * a, ep)
            idx = peer_chunks_bytes(slots * INT64_BYTES, ep)
            weights = peer_chunks_bytes(slots * FP32_BYTES, ep)
            rs = peer_chunks_bytes(tokens * h * a, ep)
            per_layer = 2 * gathered + idx + 2 * weights + 2 * rs
            add("all-gather dispatcher", "ep", "ep", per_layer * m * moe_per_rank, 7 * m * moe_per_rank, recorded_as="ep")
        else:
            raise NotImplementedError(f"dispatcher={kind.value!r} has no byte model: add its records to comm_records")
    # ---- data parallel: FSDP2 all-gathers (forward, and again in backward for non-root units) and
    # reduce-scatters, once per micro-batch; once per optimizer step with gather_once_per_step.
    # HSDP: both within the shard group, then each reduced gradient shard (fp32, padded as FSDP2
    # pads it) all-reduced across the replica groups (foreach_reduce's all_reduce_group) ----
    once = layout.gather_once_per_step and layout.pp == 1
    for unit in fsdp_units(model, layout):
        group = fsdp_shard_group(layout, unit.group)
        n = group_size(layout, group)
        gathers = 1 if once else (1 if unit.root else 2) * m
        scatters = fsdp_reduces(layout)
        frac = unit.ranks_fraction * unit.count
        if n > 1:
            shard = unit.padded_shard_numel * (n - 1)
            add(f"FSDP {unit.name} all-gather", "dp", group, gathers * FSDP_GATHER_BYTES[precision] * shard * frac, gathers * frac,
                overlapped=True)
            add(f"FSDP {unit.name} reduce-scatter", "dp", group, scatters * FSDP_REDUCE_BYTES * shard * frac, scatters * frac,
                overlapped=True, reduction=True)
        if layout.hsdp:
            reduced = all_reduce_bytes(int(unit.padded_shard_numel) * FSDP_REDUCE_BYTES, layout.dp_replicate)
            add(f"HSDP {unit.name} replica all-reduce", "dp", "dp:replicate", reduced * scatters * frac, scatters * frac,
                overlapped=True, reduction=True)
    n_token = group_size(layout, "token")
    if moe_per_rank and n_token > 1:
        if model.load_balancing == "global_aux_loss":
            add("global aux-loss counts", "dp", "token", all_reduce_bytes((model.num_experts + 1) * FP32_BYTES, n_token) * m * moe_per_rank,
                m * moe_per_rank, recorded_as="dp")
        if model.expert_bias:
            add("expert-bias loads", "dp", "token", all_reduce_bytes(model.num_experts * FP32_BYTES, n_token) * moe_per_rank,
                moe_per_rank, recorded_as="dp")
    # ---- pipeline ----
    if pp > 1:
        v = layout.pp_stages_per_rank
        boundary = b * seq_local // tp * h * a  # sequence-parallel shard of the hidden states
        sends = 2 * (pp * v - 1) * m  # forward activations and backward gradients over every stage boundary
        add("stage activations/gradients", "pp", "pp", boundary * sends / pp, sends / pp, pattern="chain")
        steps = layout.pipeline_steps
        add("mean-loss broadcast", "pp", "pp", PIPELINE_LOSS_BYTES * (pp - 1) / pp * steps, steps / pp)
        if model.mtp_depth:
            # the logged loss terms (loss, mtp_loss) from the last stage, once per pipeline step
            add("loss-terms broadcast", "pp", "pp", 2 * PIPELINE_LOSS_BYTES * (pp - 1) / pp * steps, steps / pp)
            records += _tied_embedding_records(model, layout)
    # ---- Lightning's per-batch sigterm flag, broadcast from rank 0 over the world ----
    world = layout.world_size
    batches = _batches_per_step(layout)
    if world > 1 and batches > 1:
        add("Lightning sigterm flag", "dp", "world", (batches - 1) * SIGTERM_FLAG_BYTES * (world - 1) / world, (batches - 1) / world)
    return records


def _tied_embedding_records(model: ModelShape, layout: Layout) -> list[CommRecord]:
    """The gradient sum of the embedding's two copies under pp with MTP (the first stage's and the last
    stage's, :class:`~lightning_moe.parallel.pipeline_runner.PipelineRunner`): once per pipeline step,
    an all-reduce of each rank's local gradient (its FSDP shard, fp32) between the two ranks of its
    pipeline holding one end stage each; none where one rank holds both (V schedules)."""
    from lightning_moe.planner.candidate import holds_first_stage, holds_last_stage
    from lightning_moe.planner.mtp import mtp_units

    ends = sum(holds_first_stage(layout, r) != holds_last_stage(layout, r) for r in range(layout.pp)) / layout.pp
    if not ends:
        return []
    _, _, unsharded, group = mtp_units(model, layout, rank=0)["mtp_embedding"]
    shard = unsharded / group_size(layout, fsdp_shard_group(layout, group))  # the mean local gradient
    steps = layout.pipeline_steps
    return [CommRecord("tied embedding gradient all-reduce", "pp", "pp", all_reduce_bytes(shard * FSDP_REDUCE_BYTES, 2) * steps * ends,
                       steps * ends, reduction=True)]  # fmt: skip


def record_split(rec: CommRecord, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """``(intra, inter)`` fractions of ``rec``'s bytes that stay inside a node and that cross nodes."""
    if rec.split is not None:
        return rec.split
    if rec.pattern == "spread":
        return peer_split(layout, rec.group, cluster.gpus_per_node)
    return ring_split(layout, rec.group, cluster.gpus_per_node, wrap=rec.pattern == _RING)


def comm_bytes_by_dim(records: Iterable[CommRecord], layout: Layout, cluster: Cluster) -> dict[str, dict[str, float]]:
    """``{dim: {"intra": bytes, "inter": bytes}}`` per optimizer step and rank."""
    out = {d: {"intra": 0.0, "inter": 0.0} for d in PARALLEL_DIMS}
    for rec in records:
        intra, inter = record_split(rec, layout, cluster)
        out[rec.dim]["intra"] += rec.bytes * intra
        out[rec.dim]["inter"] += rec.bytes * inter
    return out

