"""Time per optimizer step, and the estimate of a layout that gathers it with memory and communication.

Compute / (peak x efficiency of the op kind) plus communication / bandwidth of the tier it crosses,
minus the overlap the code implements (FSDP2 prefetches its all-gathers and reduce-scatters on their
own stream; ring attention sends the next K/V block while the current one computes; expert dispatch,
tensor-parallel collectives and pipeline P2P are exposed), times the pipeline bubble
``(p - 1) / (m + p - 1)`` (interleaved: ``(p-1)/v``), plus the optimizer's memory-bound update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_moe.planner.cluster import Cluster
from lightning_moe.planner.communication import CommRecord, comm_bytes_by_dim, comm_records, record_split
from lightning_moe.planner.dtypes import ADAM_STATE_BYTES, FP32_BYTES
from lightning_moe.planner.flops import RECOMPUTE_FORWARDS, flops_per_microbatch
from lightning_moe.planner.layout import Layout, edge_pp_ranks, holds_last_stage, rank_layers
from lightning_moe.planner.memory import CHECKPOINT_MODES, Memory, memory_per_rank
from lightning_moe.planner.model_shape import ModelShape

# Adam's update reads and writes each parameter's fp32 weight, gradient and two moments:
# (4 + 4 + 8) bytes read and (4 + 8) written (torch.optim.AdamW foreach kernel, memory-bound).
OPTIMIZER_HBM_BYTES_PER_PARAM = (FP32_BYTES + FP32_BYTES + ADAM_STATE_BYTES) + (FP32_BYTES + ADAM_STATE_BYTES)


@dataclass
class Estimate:
    """The cost model's figures for one layout (per optimizer step; bytes per rank)."""

    layout: Layout
    step_time: float
    compute_time: float
    exposed_comm_time: float
    overlapped_comm_time: float
    bubble_fraction: float
    optimizer_time: float
    mfu: float
    tokens_per_second: float
    memory: Memory
    memory_pp_rank: int
    checkpointing: str | None  # mode used (the requested one) when it fits, else None
    fits: bool
    reason: str
    comm: dict[str, dict[str, float]]  # dim -> {"intra": bytes, "inter": bytes}
    ep_internode_bytes: float
    records: list[CommRecord] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = {
            **self.layout.parallel_sizes(),
            "etp": self.layout.etp,
            "fold_ep": list(self.layout.fold_ep),
            "data_parallel": "hsdp" if self.layout.hsdp else "fsdp",
            "dp_replicate": self.layout.dp_replicate,
            "micro_batch_size": self.layout.micro_batch_size,
            "microbatches": self.layout.microbatches,
            "pp_schedule": self.layout.pp_schedule if self.layout.pp > 1 else None,
            "pp_stages_per_rank": self.layout.pp_stages_per_rank,
            "pp_microbatches": self.layout.pipeline_microbatches if self.layout.pp > 1 else None,
            "label": self.layout.label(),
            "step_time_s": self.step_time,
            "compute_time_s": self.compute_time,
            "exposed_comm_time_s": self.exposed_comm_time,
            "overlapped_comm_time_s": self.overlapped_comm_time,
            "bubble_fraction": self.bubble_fraction,
            "optimizer_time_s": self.optimizer_time,
            "mfu": self.mfu,
            "tokens_per_second": self.tokens_per_second,
            "checkpointing": self.checkpointing,
            "fits": self.fits,
            "reason": self.reason,
            "memory_bytes": {
                "parameters": self.memory.parameters,
                "gradients": self.memory.gradients,
                "optimizer": self.memory.optimizer,
                "fsdp_buffers": self.memory.fsdp_buffers,
                "logits": self.memory.logits,
                "activations": dict(self.memory.activations),
                "total": {mode: self.memory.total(mode) for mode in CHECKPOINT_MODES},
                "pp_rank": self.memory_pp_rank,
            },
            "comm_bytes": self.comm,
            "ep_internode_bytes": self.ep_internode_bytes,
            "strategy": self.layout.strategy_kwargs(),
        }
        return out


def microbatch_compute_seconds(model: ModelShape, layout: Layout, cluster: Cluster, seq_len: int, checkpointing: str) -> float:
    """Seconds the busiest pipeline rank computes one micro-batch: forward, backward (2x) and the
    recomputed forward of ``checkpointing``, each op kind at its efficiency of the peak; slowed down
    when more ranks run than compute at once (``cluster.concurrent_ranks``)."""
    peak = cluster.peak_flops
    worst = 0.0
    for pp_rank in edge_pp_ranks(layout):
        layers = rank_layers(model, layout, pp_rank)
        f = flops_per_microbatch(model, layout, seq_len, layers, holds_last_stage(layout, pp_rank))
        passes = 3.0 + RECOMPUTE_FORWARDS[checkpointing]  # forward + backward (2x) + recompute
        t = passes * (
            f["dense"] / (peak * cluster.gemm_efficiency)
            + f["expert"] / (peak * cluster.grouped_gemm_efficiency)
            + f["attention"] / (peak * cluster.attention_efficiency)
        )
        worst = max(worst, t)
    slowdown = 1.0
    if cluster.concurrent_ranks:
        slowdown = max(1.0, layout.world_size / cluster.concurrent_ranks)
    return worst * slowdown


def record_seconds(rec: CommRecord, layout: Layout, cluster: Cluster) -> float:
    """Seconds ``rec``'s collectives take: its bytes over the bandwidth of the tiers it crosses, plus
    the latency of each call (and ring attention's work around each shift)."""
    intra, inter = record_split(rec, layout, cluster)
    bw_intra = cluster.intra_node_bandwidth * cluster.comm_efficiency
    bw_inter = cluster.inter_node_bandwidth * cluster.comm_efficiency
    if rec.pattern == "spread" and inter > 0 and rec.dim != "ep":
        # ring collectives over a group that spans nodes run at the slowest link's pace
        seconds = rec.bytes / bw_inter
    else:
        # all-to-all and point-to-point use both tiers at once
        seconds = max(rec.bytes * intra / bw_intra, rec.bytes * inter / bw_inter)
    seconds += rec.calls * cluster.collective_latency
    if rec.pattern == "ring":  # ring attention's per-block work around each shift
        seconds += rec.calls * cluster.ring_step_overhead
    return seconds


def pipeline_bubble(layout: Layout) -> float:
    """The pipeline bubble's share of a step: ``(p - 1) / (m + p - 1)`` for ``m`` micro-batches per
    pipeline step, ``(p - 1) / v`` in place of ``p - 1`` under the interleaved schedule."""
    m, p, v = layout.pipeline_microbatches, layout.pp, layout.pp_stages_per_rank
    if p == 1:
        return 0.0
    bubble_units = (p - 1) / v if layout.pp_schedule == "Interleaved1F1B" else (p - 1)
    return bubble_units / (m + bubble_units)


def estimate(
    model: ModelShape,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch_size: int,
    *,
    precision: str = "bf16-mixed",
    checkpointing: str = "none",
    memory_budget: float | None = None,
) -> Estimate:
    """Step time, MFU, memory and communication of one layout (see the module docstring).

    Example::

        est = estimate(shape, Layout(tp=2, ep=2, dp=2, microbatches=4), cluster, seq_len=4096, global_batch_size=16)
        est.step_time, est.memory.total("none"), est.comm["ep"]
    """
    records = comm_records(model, layout, seq_len, precision)
    exposed = overlapped = 0.0
    for rec in records:
        if rec.overlapped:
            overlapped += record_seconds(rec, layout, cluster)
        else:
            exposed += record_seconds(rec, layout, cluster)
    compute = microbatch_compute_seconds(model, layout, cluster, seq_len, checkpointing) * layout.microbatches
    # FSDP and ring traffic hide behind compute (where the backend runs them asynchronously);
    # what does not fit is exposed
    hidden_capacity = compute if cluster.fsdp_overlap else 0.0
    exposed_total = exposed + max(0.0, overlapped - hidden_capacity)
    bubble = pipeline_bubble(layout)
    busy = compute + exposed_total
    step_core = busy / (1.0 - bubble) if bubble < 1 else float("inf")
    mem, pp_rank = memory_per_rank(model, layout, seq_len, precision)
    params_local = mem.parameters / FP32_BYTES
    optimizer_time = params_local * OPTIMIZER_HBM_BYTES_PER_PARAM / cluster.hbm_bandwidth
    step = step_core + optimizer_time
    tokens = global_batch_size * seq_len
    mfu = model.model_flops_per_token(seq_len) * tokens / step / (cluster.peak_flops * layout.world_size)
    budget = cluster.memory_budget if memory_budget is None else memory_budget
    total = mem.total(checkpointing)
    fits = total <= budget
    reason = "" if fits else (
        f"needs {total / 2**30:.1f} GiB per rank with checkpointing={checkpointing} "
        f"(parameters+gradients+optimizer {(mem.parameters + mem.gradients + mem.optimizer) / 2**30:.1f} GiB, "
        f"activations {mem.activations[checkpointing] / 2**30:.1f} GiB, FSDP buffers"
        f" {mem.fsdp_buffers / 2**30:.1f} GiB, logits {mem.logits / 2**30:.1f} GiB), budget {budget / 2**30:.1f} GiB"
    )
    comm = comm_bytes_by_dim(records, layout, cluster)
    ep_inter = comm["ep"]["inter"]
    return Estimate(
        layout=layout,
        step_time=step,
        compute_time=compute,
        exposed_comm_time=exposed_total,
        overlapped_comm_time=overlapped,
        bubble_fraction=bubble,
        optimizer_time=optimizer_time,
        mfu=mfu,
        tokens_per_second=tokens / step,
        memory=mem,
        memory_pp_rank=pp_rank,
        checkpointing=checkpointing if fits else None,
        fits=fits,
        reason=reason,
        comm=comm,
        ep_internode_bytes=ep_inter,
        records=records,
    )

