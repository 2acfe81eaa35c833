"""Tensor parallelism's collectives: the DTensor plan with sequence parallelism, the replicated weights'
gradient all-reduces, and expert tensor parallelism's row exchange."""

from __future__ import annotations

from lightning_moe.planner.comm.collective_bytes import all_reduce_bytes, peer_chunks_bytes, peer_share_bytes
from lightning_moe.planner.comm.record import CommRecord
from lightning_moe.planner.comm.step import StepCounts, fsdp_reduces
from lightning_moe.planner.dtypes import FSDP_GATHER_BYTES, FSDP_REDUCE_BYTES, INT64_BYTES


def tp_records(step: StepCounts) -> list[CommRecord]:
    """The tp group's collectives of one optimizer step (none for tp = 1).

    Sequence parallelism all-gathers the hidden states before each tp-split projection and
    reduce-scatters its output (the embedding, each attention, each dense FFN, the output head: once
    forward, once backward), the output head's logits are all-gathered to ``Replicate``; weights
    replicated over tp (the norms, MTP's ``eh_proj``) have their gradient all-reduced; under expert
    tensor parallelism (``etp = tp``) the rows that reached a rank's experts are all-gathered over tp
    and the partial outputs reduce-scattered back.
    """
    model, layout = step.model, step.layout
    tp, ep = layout.tp, layout.ep
    if tp == 1:
        return []
    a, h, m = step.activation_bytes, model.hidden_size, layout.microbatches
    b, seq_local = layout.micro_batch_size, step.seq_local
    first, last, mtp_blocks = step.first, step.last, step.mtp_blocks
    layers, moe, dense = step.layers, step.moe_layers, step.dense_layers
    u = peer_share_bytes(b * seq_local * h * a, tp)  # an all-gather or reduce-scatter of a cp rank's hidden states
    # norm weights: Replicate DTensors whose Partial gradient is all-reduced (2 norms per layer, final
    # norm) when FSDP2 reads it for its reduction (FSDPParam._get_grad_inner_tensor): once per
    # reduction, on the gradient accumulated in the reduce dtype (fp32) over the backwards before it
    reduces = fsdp_reduces(layout)
    grad_bytes = FSDP_GATHER_BYTES[step.precision] if reduces == m else FSDP_REDUCE_BYTES
    norm = all_reduce_bytes(h * grad_bytes, tp)
    norms = 2 * layers + last + 3 * mtp_blocks  # an MTP depth adds enorm, hnorm and its norm
    # the MTP depths' head inputs join the main one in the same call
    logits = peer_chunks_bytes(b * seq_local * (model.vocab_size // tp) * a, tp)
    records = [
        # embedding: reduce-scatter forward, all-gather backward (first stage)
        CommRecord("embedding RS/AG", "tp", "tp", 2 * u * m * first, 2 * m * first, functional=True),
        # attention input all-gather + wo reduce-scatter, and their backward
        CommRecord("attention AG/RS", "tp", "tp", 4 * u * m * layers, 4 * m * layers, functional=True),
        CommRecord("dense FFN AG/RS", "tp", "tp", 4 * u * m * dense, 4 * m * dense, functional=True),
        CommRecord("norm weight grad all-reduce", "tp", "tp", norm * reduces * norms, reduces * norms, functional=True),
        # output: input all-gather (+ backward reduce-scatter), logits all-gather to Replicate
        CommRecord("output AG/RS + logits AG", "tp", "tp", (2 * u + logits) * m * (last + mtp_blocks), 3 * m * last,
                   functional=True),
    ]  # fmt: skip
    if model.mtp_depth:
        # the embedding of every depth's tokens ahead, in one call on the last stage; eh_proj's
        # replicated weight, its gradient all-reduced as the norms' are
        eh_proj = all_reduce_bytes(2 * h * h * grad_bytes, tp)
        records += [
            CommRecord("MTP embedding RS/AG", "tp", "tp", 2 * u * m * mtp_blocks, 2 * m * last, functional=True),
            CommRecord("MTP eh_proj weight grad all-reduce", "tp", "tp", eh_proj * reduces * mtp_blocks,
                       reduces * mtp_blocks, functional=True),
        ]  # fmt: skip
    if layout.etp == tp and moe:
        # ExpertTensorParallelDispatcher: rows that reached this rank's experts are all-gathered over
        # tp and the partial outputs reduce-scattered back (uneven all-to-alls), forward and backward;
        # plus one all-gather of the int64 counts per local expert.
        rows = step.tokens * model.top_k  # slots of this rank's tokens (balanced: as many arrive)
        counts = step.dispatch_chunks * peer_chunks_bytes((model.num_experts // ep) * INT64_BYTES, tp)
        gathered = 4 * peer_chunks_bytes(rows * h * a, tp) * m * moe
        records += [
            CommRecord("expert-TP row all-gather/reduce-scatter", "tp", "tp", gathered, 4 * m * moe, recorded_as="tp",
                       routing_dependent=ep > 1),
            CommRecord("expert-TP counts all-gather", "tp", "tp", counts * m * moe, m * moe),
        ]  # fmt: skip
    return records
