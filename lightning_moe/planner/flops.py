"""FLOPs: what one rank computes per micro-batch, by op kind, and what activation checkpointing adds."""

from __future__ import annotations

from collections.abc import Iterable

from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.model_shape import ModelShape
from lightning_moe.planner.mtp import mtp_flops_per_microbatch

# Activation checkpointing cost in forward passes recomputed during backward: "full" recomputes the
# whole layer forward (Chen et al. 2016, arXiv 1604.06174); "selective" recomputes the SwiGLU/expert
# activation functions and the attention core only, Korthikanti et al. 2022 (arXiv 2205.05198, §5:
# selective recompute costs ~2.7% of FLOPs for GPT-3): modelled as that fraction of one forward.
RECOMPUTE_FORWARDS = {"none": 0.0, "selective": 0.08, "full": 1.0}


def flops_per_microbatch(
    model: ModelShape, layout: Layout, seq_len: int, layers: Iterable[int], last: bool
) -> dict[str, float]:
    """Forward FLOPs one rank runs for one micro-batch, by op kind (``dense``, ``shared_expert``,
    ``expert``, ``attention``); the shared expert is a dense GEMM chain, apart because it is what
    hides the dispatch all-to-all (:func:`lightning_moe.planner.step_time.hidden_ep_seconds`).

    GEMMs are ``2 x m x n x k``; the causal attention core computes half of ``QK^T`` and ``PV``
    (``2 x s^2 / 2 x heads x (qk_head_dim + v_head_dim)`` per sample, ``2 x s^2 x q_dim`` for equal
    head dims); expert tokens are balanced over ep ranks (the imbalance is
    :func:`lightning_moe.planner.step_time.expert_load_imbalance`'s).
    """
    tp, cp = layout.tp, layout.cp
    h = model.hidden_size
    tokens = layout.micro_batch_size * seq_len / cp  # tokens on this cp rank (all tp ranks compute them)
    # Each layer's terms, the same for every layer of a kind: computed once, added layer by layer.
    projections = 2 * tokens * (h * model.q_dim + 2 * h * model.kv_dim + model.q_dim * h) / tp
    # causal attention per sample: 2 FLOP x s^2/2 x (q/k head + v head) per head; cp ranks split it evenly (zigzag)
    core = layout.micro_batch_size * seq_len * seq_len * model.attention_core_dim / tp / cp
    router = 2 * tokens * h * model.num_experts / tp  # on this rank's sequence shard
    shared = 2 * tokens * 3 * h * model.shared_expert_hidden_size / tp if model.shared_expert_hidden_size else 0.0
    experts = 2 * tokens * model.top_k * 3 * h * model.moe_ffn_hidden_size / tp
    ffn = 2 * tokens * 3 * h * model.ffn_hidden_size / tp
    out = {"dense": 0.0, "shared_expert": 0.0, "expert": 0.0, "attention": 0.0}
    for i in layers:
        out["dense"] += projections
        out["attention"] += core
        if model.is_moe(i):
            out["dense"] += router
            out["shared_expert"] += shared
            out["expert"] += experts
        else:
            out["dense"] += ffn
    if last:
        out["dense"] += 2 * tokens * h * model.vocab_size / tp
        if model.mtp_depth:  # each depth's block is a layer of the last layer's kind
            block = flops_per_microbatch(model, layout, seq_len, [model.num_layers - 1], last=False)
            for kind, value in mtp_flops_per_microbatch(model, layout, seq_len, block).items():
                out[kind] += value
    return out
