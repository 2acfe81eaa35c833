"""Pipeline parallelism's collectives: the stage boundaries' activations and gradients, the loss's
broadcasts from the last stage and, with multi-token prediction, the sum of the embedding's two
copies' gradients."""

from __future__ import annotations

from lightning_moe.planner.candidate import holds_first_stage, holds_last_stage
from lightning_moe.planner.comm.collective_bytes import all_reduce_bytes
from lightning_moe.planner.comm.record import CommRecord
from lightning_moe.planner.comm.step import StepCounts
from lightning_moe.planner.dtypes import FP32_BYTES, FSDP_REDUCE_BYTES
from lightning_moe.planner.groups import fsdp_shard_group, group_size
from lightning_moe.planner.mtp import mtp_units

# The pipeline's mean loss is one fp32 broadcast from the last stage per pipeline step
# (lightning_moe.parallel.engines.pipeline_runner.PipelineRunner.broadcast_mean).
PIPELINE_LOSS_BYTES = FP32_BYTES


def pp_records(step: StepCounts) -> list[CommRecord]:
    """The pp group's collectives of one optimizer step (none for pp = 1): each micro-batch's
    activations forward and gradients backward over every stage boundary between two ranks (a tp rank's
    sequence-parallel shard of the hidden states), point to point along the pipeline; the mean loss
    broadcast from the last stage per pipeline step, and with MTP the logged loss terms and the tied
    embedding's gradient sum (:func:`tied_embedding_records`)."""
    model, layout = step.model, step.layout
    pp = layout.pp
    if pp == 1:
        return []
    v = layout.pp_stages_per_rank
    boundary = step.tokens * model.hidden_size * step.activation_bytes  # a tp rank's sequence-parallel shard
    # Forward activations and backward gradients over every boundary between ranks: in a V the middle
    # boundary (stages pp-1 and pp, both on the last rank) stays on one rank.
    crossings = pp * v - 1 - (1 if layout.v_schedule else 0)
    sends = 2 * crossings * layout.microbatches
    steps = layout.pipeline_steps
    records = [
        CommRecord("stage activations/gradients", "pp", "pp", boundary * sends / pp, sends / pp, pattern="chain"),
        CommRecord("mean-loss broadcast", "pp", "pp", PIPELINE_LOSS_BYTES * (pp - 1) / pp * steps, steps / pp),
    ]
    if model.mtp_depth:
        # the logged loss terms (loss, mtp_loss) from the last stage, once per pipeline step
        terms = 2 * PIPELINE_LOSS_BYTES * (pp - 1) / pp * steps
        records.append(CommRecord("loss-terms broadcast", "pp", "pp", terms, steps / pp))
        records += tied_embedding_records(step)
    return records


def tied_embedding_records(step: StepCounts) -> list[CommRecord]:
    """The gradient sum of the embedding's two copies under pp with MTP (the first stage's and the last
    stage's, :class:`~lightning_moe.parallel.engines.pipeline_runner.PipelineRunner`): once per pipeline step,
    an all-reduce of each rank's local gradient (its FSDP shard, fp32) between the two ranks of its
    pipeline holding one end stage each; none where one rank holds both (V schedules)."""
    model, layout = step.model, step.layout
    ends = sum(holds_first_stage(layout, r) != holds_last_stage(layout, r) for r in range(layout.pp)) / layout.pp
    if not ends:
        return []
    _, _, unsharded, group = mtp_units(model, layout, rank=0)["mtp_embedding"]
    shard = unsharded / group_size(layout, fsdp_shard_group(layout, group))  # the mean local gradient
    steps = layout.pipeline_steps
    summed = all_reduce_bytes(shard * FSDP_REDUCE_BYTES, 2) * steps * ends
    return [CommRecord("tied embedding gradient all-reduce", "pp", "pp", summed, steps * ends, reduction=True)]
