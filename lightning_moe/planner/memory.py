"""Memory per rank: parameter shards, fp32 gradients and Adam states, FSDP2's unsharded buffers,
activations under each activation-checkpointing mode and the logits, on the busiest pipeline rank.

Each term is bytes of tensors the code holds at the peak, in backward (measured on CPU by
``experiments/bench/peak_memory.py``: the peak resident set less the import floor within 5% of the
total on one process, ep4, ep2·dp2 and ep2·dp2 as HSDP):

- parameters, gradients (fp32 shards: FSDP2 reduces into the sharded gradient) and Adam's two fp32
  moments, which the first optimizer step creates and every later step keeps;
- FSDP2's buffers (:func:`fsdp_buffer_bytes`): the gathered parameters of the unit in backward
  and of the prefetched one, that unit's unsharded gradients and the reduce-scatter input they are
  copied into, and the root units, gathered through backward (pp = 1: embedding, norm and output;
  pp > 1: every top-level unit of the stage, with every unit's gradients accumulated unsharded
  until the pipeline step's last backward);
- activations of the micro-batches in flight and the logits (compute dtype, fp32 copy, gradient).

The last stage's rank adds multi-token prediction's terms (:mod:`~lightning_moe.planner.mtp`): its
depths' parameters in their FSDP2 units (under pp > 1 with the last stage's embedding copy), their
activations and each depth's logits.

Shards are FSDP2's padded allocation (:func:`~lightning_moe.planner.parameters.local_shape`): experts
fewer per ep rank than their edp group split evenly on a non-expert dim
(:func:`~lightning_moe.planner.parameters.expert_fsdp_dim`), so gradients and Adam states, which
follow the shards, hold ``1 / (ep * edp)`` of the expert state rather than whole experts plus padding."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_moe.layout import experts_split_over_tp
from lightning_moe.planner.candidate import Layout, edge_pp_ranks, holds_last_stage, rank_layers
from lightning_moe.planner.dtypes import (
    ACTIVATION_BYTES,
    ADAM_STATE_BYTES,
    FP32_BYTES,
    FSDP_GATHER_BYTES,
    FSDP_REDUCE_BYTES,
)
from lightning_moe.planner.model_shape import ModelShape
from lightning_moe.planner.mtp import mtp_activation_bytes, mtp_units
from lightning_moe.planner.parameters import kind_counts, representative_numels
from lightning_moe.planner.v_schedules import v_schedule_timeline

CHECKPOINT_MODES: tuple[str, ...] = ("none", "selective", "full")


def activation_bytes_per_layer(
    model: ModelShape, layout: Layout, seq_len: int, layer: int, mode: str, precision: str
) -> float:
    """Activations one layer keeps for backward, for one micro-batch, on one rank.

    Counted tensor by tensor for this model (Korthikanti et al. 2022, arXiv 2205.05198, §4, for the
    method): ``none`` keeps the norms' inputs and outputs, q/k/v, the attention output (flash-style
    attention keeps only its fp32 log-sum-exp, no ``s^2`` term), SwiGLU's gate/up/product and, for
    MoE, the router logits, the dispatched rows and their expert intermediates; ``selective`` drops
    the SwiGLU intermediates and the attention internals (recomputed); ``full`` keeps only the layer
    input. Sequence parallelism shards everything over tp.
    """
    a = ACTIVATION_BYTES[precision]
    h = model.hidden_size
    tokens = layout.micro_batch_size * seq_len / layout.cp / layout.tp  # this rank's token shard
    if mode == "full":
        return tokens * h * a
    heads_local = model.num_heads / layout.tp
    attention = tokens * a * (2 * h) + tokens * layout.tp * a * (
        h + (model.q_dim + 2 * model.kv_dim) / layout.tp + model.q_dim / layout.tp
    )
    attention += tokens * layout.tp * heads_local * FP32_BYTES  # log-sum-exp
    if mode == "selective":
        attention = tokens * a * (2 * h) + tokens * layout.tp * a * (h + (model.q_dim + 2 * model.kv_dim) / layout.tp)
    if model.is_moe(layer):
        k, f = model.top_k, model.moe_ffn_hidden_size
        rows = tokens * k  # dispatched rows per rank (balanced routing), before expert-TP gathering
        expert_tp = experts_split_over_tp(layout.tp, layout.etp)
        f_local = f / layout.tp if expert_tp else f
        rows_local = rows * layout.tp if expert_tp else rows
        ffn = tokens * a * 2 * h + tokens * FP32_BYTES * model.num_experts  # norm in/out, router logits
        ffn += rows_local * a * 2 * h  # expert input and output rows
        if mode == "none":
            ffn += rows_local * a * 3 * f_local  # gate, up, product
        if model.shared_expert_hidden_size:
            ffn += tokens * a * (3 * model.shared_expert_hidden_size if mode == "none" else 0)
    else:
        ffn = tokens * a * 2 * h + tokens * layout.tp * a * h
        if mode == "none":
            ffn += tokens * layout.tp * a * 3 * model.ffn_hidden_size / layout.tp
    return attention + ffn


@dataclass
class Memory:
    """Bytes per rank on the busiest pipeline rank."""

    parameters: float
    gradients: float
    optimizer: float
    fsdp_buffers: float  # unsharded parameters and gradients of the units in flight (fsdp_buffer_bytes)
    activations: dict[str, float]  # per checkpointing mode
    logits: float

    def total(self, mode: str) -> float:
        return (
            self.parameters + self.gradients + self.optimizer + self.fsdp_buffers + self.activations[mode] + self.logits
        )


def fsdp_buffer_bytes(
    unit_sizes: dict[str, float], unit_counts: dict[str, int], gathered: float, layout: Layout, precision: str
) -> float:
    """FSDP2's unsharded buffers at the peak of backward, from ``unit_sizes`` (elements of each unit's
    unsharded parameters on this rank: ``"first"`` the embedding, ``"last"`` the final norm and
    output, ``"layer<i>"`` a block's own parameters, ``"layer<i>.experts"``/``".router"`` units nested
    in it), ``unit_counts`` (how many units like it the rank holds) and ``gathered`` (all units'
    elements, each counted as often as the rank holds it).

    - ``gather_once_per_step``, and the V schedules (whose stages ``PipelineRunner`` keeps gathered
      through each pipeline step): every unit of the rank (all its pipeline stages) stays gathered
      with its unsharded gradients, accumulated in fp32 (``gathered x (param dtype + fp32)``), plus
      the reduce-scatter input of the largest unit when the last backward reduces it.
    - Otherwise, the backward of the largest nested (non-root) unit: its gathered parameters and the
      next unit's, prefetched (2 units in the param dtype); then a unit's unsharded gradients (param
      dtype) and the flat reduce-scatter input ``foreach_reduce`` copies them into (fp32, the reduce
      dtype) before it frees them. FSDP2 does not reshard a root unit after forward
      (``FSDPState._lazy_init``): under pp = 1 the root (embedding, final norm, output) stays gathered
      through backward and its gradients wait, unsharded, for its reduction at the end of backward;
      under pp > 1 every top-level unit (embedding, each block, norm, output) is a root of its own,
      so the stage's blocks stay gathered from their forward to their backward; and with several
      micro-batches per pipeline step every unit's unsharded gradients wait, accumulated in the
      reduce dtype, for the step's last backward (``backward_maybe_with_nosync``).
    """
    g = FSDP_GATHER_BYTES[precision]
    if layout.gather_once_per_step or layout.v_schedule:
        return gathered * (g + FP32_BYTES) + max(unit_sizes.values(), default=0) * FSDP_REDUCE_BYTES
    roots = [u for u in unit_sizes if u in ("first", "last") or (layout.pp > 1 and "." not in u)]
    held = sum(unit_counts[u] * unit_sizes[u] for u in roots) * g
    if layout.pp == 1:
        held += sum(unit_sizes[u] for u in roots) * g  # the root's unsharded gradients
    nested = max((size for unit, size in unit_sizes.items() if unit not in roots), default=0)
    reduced = nested if layout.pp == 1 else max(unit_sizes.values(), default=0)
    if layout.pp > 1 and layout.pipeline_microbatches > 1:
        # Gradient sync only in the pipeline step's last backward: the earlier ones leave every unit's
        # unsharded gradients accumulated in the reduce dtype until it (FSDP2's no-sync accumulation),
        # beside the sharded gradients of the previous pipeline step.
        return held + nested * 2 * g + gathered * FSDP_REDUCE_BYTES + reduced * FSDP_REDUCE_BYTES
    return held + nested * 2 * g + reduced * (g + FSDP_REDUCE_BYTES)


def memory_per_rank(
    model: ModelShape, layout: Layout, seq_len: int, precision: str = "32-true", *, pp_rank: int | None = None
) -> tuple[Memory, int]:
    """Memory of the pipeline rank that needs the most (``(memory, pp_rank)``), of the first and the
    last (:func:`~lightning_moe.planner.candidate.edge_pp_ranks`); with ``pp_rank``, that rank's."""
    best: tuple[Memory, int] | None = None
    for pp_rank in edge_pp_ranks(layout) if pp_rank is None else [pp_rank]:
        rank = pp_rank * (layout.world_size // layout.pp)
        counts = kind_counts(model, layout, pp_rank)
        params = gathered = 0.0
        unit_sizes: dict[str, float] = {}
        unit_counts: dict[str, int] = {}
        for spec, kind, shard, unsharded in representative_numels(model, layout, rank):
            n = counts[kind]
            if not n:
                continue
            unit_counts[spec.unit] = n
            params += n * shard
            # every unit, over one rank too: fully_shard wraps it all the same and FSDP2's unshard
            # then copies the shard into a buffer of its own (FSDPParamGroup.unshard, world_size == 1)
            unit_sizes[spec.unit] = unit_sizes.get(spec.unit, 0) + unsharded
            gathered += n * unsharded
        last_stage = holds_last_stage(layout, pp_rank)
        for unit, (n, shard, unsharded, _) in (mtp_units(model, layout, rank) if last_stage else {}).items():
            unit_counts.setdefault(unit, n)  # "last" (pp = 1): the MTP modules join the root unit
            params += n * shard
            unit_sizes[unit] = unit_sizes.get(unit, 0) + unsharded
            gathered += n * unsharded
        buffers = fsdp_buffer_bytes(unit_sizes, unit_counts, gathered, layout, precision)
        layers = rank_layers(model, layout, pp_rank)
        # micro-batches in flight on this rank: GPipe all of them, 1F1B up to pp - pp_rank,
        # interleaved the 1F1B figure times (1 + (p-1)/(p v)) (Korthikanti et al. 2022, §4.2.3), the V
        # schedules the peak of their action order, in stage activation sets over the rank's stages
        m, p, v = layout.pipeline_microbatches, layout.pp, layout.pp_stages_per_rank
        if p == 1:
            in_flight = 1.0
        elif layout.v_schedule:
            in_flight = v_schedule_timeline(layout.pp_schedule, p, m).in_flight[pp_rank] / v
        elif layout.pp_schedule == "GPipe":
            in_flight = float(m)
        else:
            in_flight = float(min(m, p - pp_rank))
            if layout.pp_schedule == "Interleaved1F1B":
                in_flight *= 1 + (p - 1) / (p * v)
        examples = {
            "moe": next((i for i in layers if model.is_moe(i)), None),
            "dense": next((i for i in layers if not model.is_moe(i)), None),
        }
        per_layer = {
            (kind, mode): activation_bytes_per_layer(model, layout, seq_len, i, mode, precision)
            for kind, i in examples.items() if i is not None for mode in CHECKPOINT_MODES
        }  # fmt: skip
        acts = {
            mode: in_flight
            * sum(counts[kind] * per_layer[(kind, mode)] for kind, i in examples.items() if i is not None)
            for mode in CHECKPOINT_MODES
        }
        if last_stage and model.mtp_depth:  # the MTP depths run after the last layer, on every micro-batch in flight
            for mode in CHECKPOINT_MODES:
                block = activation_bytes_per_layer(model, layout, seq_len, model.num_layers - 1, mode, precision)
                acts[mode] += in_flight * mtp_activation_bytes(model, layout, seq_len, block, precision)
        if layers:  # full recompute rebuilds one layer's activations at a time
            acts["full"] += max(per_layer[(kind, "none")] for kind, i in examples.items() if i is not None)
        logits = 0.0
        if last_stage:
            # logits in the compute dtype, their fp32 copy for the loss and its gradient: the main
            # head's and each MTP depth's, all held until the loss's backward
            tokens = layout.micro_batch_size * seq_len / layout.cp
            heads = 1 + model.mtp_depth
            logits = heads * tokens * model.vocab_size / layout.tp * (ACTIVATION_BYTES[precision] + 2 * FP32_BYTES)
        mem = Memory(params * FP32_BYTES, params * FP32_BYTES, params * ADAM_STATE_BYTES, buffers, acts, logits)
        if best is None or mem.total("none") > best[0].total("none"):
            best = (mem, pp_rank)
    assert best is not None
    return best
