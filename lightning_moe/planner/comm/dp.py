"""Data parallelism's collectives: FSDP2's all-gathers and reduce-scatters of each unit, HSDP's
all-reduce across the replica groups, the MoE load statistics over the token group, and Lightning's
per-batch flag over the world (which the comm accounting charges to dp)."""

from __future__ import annotations

from lightning_moe.planner.comm.collective_bytes import all_reduce_bytes
from lightning_moe.planner.comm.record import CommRecord
from lightning_moe.planner.comm.step import StepCounts, fsdp_gathers, fsdp_reduces
from lightning_moe.planner.dtypes import FP32_BYTES, FSDP_GATHER_BYTES, FSDP_REDUCE_BYTES, INT64_BYTES
from lightning_moe.planner.groups import fsdp_shard_group, group_size
from lightning_moe.planner.rank_shards import fsdp_units

# Lightning broadcasts an int64 "sigterm" flag from rank 0 at every training batch but the first of
# an optimizer step (lightning.pytorch.loops.training_epoch_loop._broadcast_sigterm_tensor).
SIGTERM_FLAG_BYTES = INT64_BYTES


def dp_records(step: StepCounts) -> list[CommRecord]:
    """The data-parallel groups' collectives of one optimizer step.

    FSDP2 all-gathers each unit in forward, and again in backward for non-root units, once per
    micro-batch; under the V schedules once per pipeline step (the stages stay gathered until the
    step's weight gradients); with ``gather_once_per_step`` once per optimizer step, whatever the
    pipeline. It reduce-scatters the gradients as :func:`~lightning_moe.planner.comm.step.fsdp_reduces` counts.
    HSDP runs both within the shard group, then all-reduces each reduced gradient shard (fp32, padded
    as FSDP2 pads it) across the replica groups (``foreach_reduce``'s ``all_reduce_group``). Over the
    token group, ``global_aux_loss`` all-reduces each MoE layer's expert counts per micro-batch and
    ``expert_bias`` its loads once per step.
    """
    model, layout = step.model, step.layout
    m, moe = layout.microbatches, step.moe_layers
    records = []
    scatters = fsdp_reduces(layout)
    for unit in fsdp_units(model, layout):
        group = fsdp_shard_group(layout, unit.group)
        n = group_size(layout, group)
        gathers = fsdp_gathers(layout, unit.root)
        frac = unit.ranks_fraction * unit.count
        if n > 1:
            shard = unit.padded_shard_numel * (n - 1)
            gathered = gathers * FSDP_GATHER_BYTES[step.precision] * shard * frac
            records += [
                CommRecord(f"FSDP {unit.name} all-gather", "dp", group, gathered, gathers * frac, overlapped=True),
                CommRecord(f"FSDP {unit.name} reduce-scatter", "dp", group, scatters * FSDP_REDUCE_BYTES * shard * frac,
                           scatters * frac, overlapped=True, reduction=True),
            ]  # fmt: skip
        if layout.hsdp:
            reduced = all_reduce_bytes(int(unit.padded_shard_numel) * FSDP_REDUCE_BYTES, layout.dp_replicate)
            records.append(CommRecord(f"HSDP {unit.name} replica all-reduce", "dp", "dp:replicate",
                                      reduced * scatters * frac, scatters * frac, overlapped=True,
                                      reduction=True))  # fmt: skip
    n_token = group_size(layout, "token")
    if moe and n_token > 1:
        if model.load_balancing == "global_aux_loss":
            counts = all_reduce_bytes((model.num_experts + 1) * FP32_BYTES, n_token)
            records.append(CommRecord("global aux-loss counts", "dp", "token", counts * m * moe, m * moe,
                                      recorded_as="dp"))  # fmt: skip
        if model.expert_bias:
            loads = all_reduce_bytes(model.num_experts * FP32_BYTES, n_token)
            records.append(CommRecord("expert-bias loads", "dp", "token", loads * moe, moe, recorded_as="dp"))
    return records


def sigterm_flag_records(step: StepCounts) -> list[CommRecord]:
    """Lightning's sigterm flag, broadcast from rank 0 over the world at each training batch of an
    optimizer step but the first (under pp > 1 a batch is a pipeline step's micro-batches)."""
    layout = step.layout
    world = layout.world_size
    batches = layout.pipeline_steps if layout.pp > 1 else layout.microbatches
    if world < 2 or batches < 2:
        return []
    flags = (batches - 1) * SIGTERM_FLAG_BYTES * (world - 1) / world
    return [CommRecord("Lightning sigterm flag", "dp", "world", flags, (batches - 1) / world)]
