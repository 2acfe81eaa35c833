"""Time per optimizer step, and the estimate of a layout that gathers it with memory and communication.

Compute: FLOPs / (peak x efficiency of the op kind; FP8 GEMMs at their own peak and efficiency),
plus the memory-bound ops' HBM bytes (:mod:`~lightning_moe.planner.elementwise`), the expert work of
the busiest ep rank (:func:`expert_load_imbalance`). Communication: bytes / bandwidth of the tier it
crosses. Overlap (:func:`overlap_budget`): the expert all-to-all time the overlap options hide
(:func:`hidden_ep_seconds`), FSDP2's gathers and reductions and ring attention's shifts all draw on
one budget per phase, the compute of that phase, never credited twice; the gradient reduction that waits
for the last backward (under pp after it: torch's ``REDUCE_GRAD`` action) is exposed; each hidden
second slows the compute by ``cluster.overlap_slowdown``. Tensor-parallel collectives, all-to-all
context parallelism's exchanges and pipeline P2P are exposed. Then the pipeline bubble
``(p - 1) / (m + p - 1)`` (interleaved: ``(p-1)/v``; the V schedules: played out,
:mod:`~lightning_moe.planner.v_schedules`), plus the optimizer's memory-bound update
(:func:`optimizer_seconds`). Each estimate carries its range: no overlap, the modelled overlap and
perfect overlap (:class:`StepTimeBounds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_moe.cp.comm import CpComm
from lightning_moe.moe.dispatchers import dispatcher_kind
from lightning_moe.planner.candidate import Layout, edge_pp_ranks, holds_last_stage, rank_layers
from lightning_moe.planner.cluster import Cluster
from lightning_moe.planner.comm import comm_records
from lightning_moe.planner.comm.record import CommRecord, comm_bytes_by_dim, record_split
from lightning_moe.planner.comm.step import fsdp_reduces
from lightning_moe.planner.dtypes import ADAM_STATE_BYTES, FP32_BYTES
from lightning_moe.planner.elementwise import elementwise_bytes_per_microbatch
from lightning_moe.planner.flops import RECOMPUTE_FORWARDS, flops_per_microbatch
from lightning_moe.planner.memory import CHECKPOINT_MODES, Memory, memory_per_rank
from lightning_moe.planner.model_shape import ModelShape
from lightning_moe.planner.muon import muon_comm_records, newton_schulz_seconds
from lightning_moe.planner.v_schedules import v_schedule_timeline

_RING = CpComm.RING.value  # ring attention's CommRecord.pattern, read per record

# Adam's update reads and writes each parameter's fp32 weight, gradient and two moments:
# (4 + 4 + 8) bytes read and (4 + 8) written (torch.optim.AdamW foreach kernel, memory-bound).
OPTIMIZER_HBM_BYTES_PER_PARAM = (FP32_BYTES + FP32_BYTES + ADAM_STATE_BYTES) + (FP32_BYTES + ADAM_STATE_BYTES)

# The busiest ep rank's expert tokens over the mean, when routing leaves it to the router (an aux loss
# or a selection bias balances the load only on average): FEPLB (Fig. 1b: 128 experts on 16 H100s,
# trained with an auxiliary loss) measures 18.6% of each MoE layer's GPU time lost waiting for the
# slowest rank, i.e. the slowest rank's expert work 1 / (1 - 0.186) = 1.23 x the mean.
DEFAULT_EXPERT_LOAD_IMBALANCE = 1.23


@dataclass(frozen=True)
class StepTimeBounds:
    """The step time under three readings of overlap: ``no_overlap`` (every collective exposed),
    ``modelled`` (the estimate: what the code overlaps, within the phases' compute, slowed by
    overlap) and ``perfect_overlap`` (every collective hidden behind the compute as far as it
    reaches, at no slowdown; the pipeline bubble and the optimizer step stay). Ordered
    ``perfect_overlap <= modelled <= no_overlap``.

    Example::

        est.bounds.perfect_overlap, est.bounds.modelled, est.bounds.no_overlap
    """

    perfect_overlap: float
    modelled: float
    no_overlap: float


@dataclass
class Estimate:
    """The cost model's figures for one layout (per optimizer step; bytes per rank).

    ``exposed_comm_time``: communication the step waits for (all-to-all context parallelism's
    exchanges, what of the overlapped traffic its phase's compute cannot cover, the reduction after
    the last backward). ``overlapped_comm_time``: communication hidden behind compute (the expert
    all-to-all time the overlap options hide, ``hidden_ep_comm_time`` by mechanism:
    :func:`hidden_ep_seconds`; FSDP's and ring attention's in the compute left,
    :func:`overlap_budget`). ``overlap_slowdown_time``: what the hidden seconds cost the compute.
    ``mfu``: model FLOPs with full attention (the published figures' convention,
    :meth:`~lightning_moe.planner.model_shape.ModelShape.model_flops_per_token`); ``mfu_causal``
    counts the causal half. ``bounds``: :class:`StepTimeBounds`.
    """

    layout: Layout
    step_time: float
    compute_time: float
    exposed_comm_time: float
    overlapped_comm_time: float
    bubble_fraction: float
    optimizer_time: float
    mfu: float
    tokens_per_second: float  # of the whole job (tokens_per_second_per_gpu: per rank)
    memory: Memory
    memory_pp_rank: int
    checkpointing: str | None  # mode used (the requested one) when it fits, else None
    fits: bool
    reason: str
    comm: dict[str, dict[str, float]]  # dim -> {"intra": bytes, "inter": bytes}
    ep_internode_bytes: float
    records: list[CommRecord] = field(default_factory=list, repr=False)
    hidden_ep_comm_time: dict[str, float] = field(default_factory=dict)
    bounds: StepTimeBounds | None = None
    mfu_causal: float = 0.0
    overlap_slowdown_time: float = 0.0
    end_of_step_reduction_time: float = 0.0

    def mfu_at(self, step_time: float) -> float:
        """The MFU the step would reach in ``step_time`` seconds (one of :attr:`bounds`)."""
        return self.mfu * self.step_time / step_time

    @property
    def tokens_per_second_per_gpu(self) -> float:
        """Training tokens per second and rank: the unit published runs give beside MFU."""
        return self.tokens_per_second / self.layout.world_size

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
            "gather_once_per_step": self.layout.gather_once_per_step,
            "overlap_ep_comm": self.layout.overlap_ep_comm,
            "cp_comm": self.layout.cp_comm,
            "label": self.layout.label(),
            "step_time_s": self.step_time,
            "compute_time_s": self.compute_time,
            "exposed_comm_time_s": self.exposed_comm_time,
            "overlapped_comm_time_s": self.overlapped_comm_time,
            "hidden_ep_comm_time_s": dict(self.hidden_ep_comm_time),
            "bubble_fraction": self.bubble_fraction,
            "optimizer_time_s": self.optimizer_time,
            "mfu": self.mfu,
            "mfu_causal": self.mfu_causal,
            "step_time_bounds_s": vars(self.bounds) if self.bounds else None,
            "mfu_bounds": {k: self.mfu_at(v) for k, v in vars(self.bounds).items()} if self.bounds else None,
            "overlap_slowdown_time_s": self.overlap_slowdown_time,
            "end_of_step_reduction_time_s": self.end_of_step_reduction_time,
            "tokens_per_second": self.tokens_per_second,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
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


# The cluster's efficiency for each op kind of :func:`flops_per_microbatch`: the shared expert is a
# plain GEMM chain like the dense layers, the routed experts a grouped GEMM.
KIND_EFFICIENCY = {"dense": "gemm_efficiency", "shared_expert": "gemm_efficiency", "expert": "grouped_gemm_efficiency",
                   "attention": "attention_efficiency"}  # fmt: skip


def expert_load_imbalance(layout: Layout, imbalance: float | None = None) -> float:
    """The busiest ep rank's expert tokens over the mean: ``imbalance`` (default
    :data:`DEFAULT_EXPERT_LOAD_IMBALANCE`) where experts spread over ep > 1 ranks, 1 where one rank
    holds them all (its work is the same whatever the routing)."""
    if layout.ep == 1:
        return 1.0
    return DEFAULT_EXPERT_LOAD_IMBALANCE if imbalance is None else imbalance


def forward_seconds_by_kind(
    model: ModelShape,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    *,
    precision: str = "bf16-mixed",
    fp8_gemms: bool = False,
    imbalance: float = 1.0,
) -> dict[str, float]:
    """Seconds one micro-batch's forward computes on the busiest pipeline rank, by op kind: the GEMM
    kinds at their efficiency of the peak (the routed experts at the dense GEMM's where a rank holds
    one expert, whose grouped GEMM is a plain GEMM; with ``fp8_gemms`` at the FP8 peak and efficiency; the
    attention core stays bf16), the expert GEMMs of the busiest ep rank (``imbalance`` x the mean),
    and ``elementwise``, the memory-bound ops' bytes at ``cluster.elementwise_efficiency`` of the HBM
    bandwidth (none where it is None); slowed down when more ranks run than compute at once
    (``cluster.concurrent_ranks``)."""
    gemm_peak, fp8_efficiency = cluster.gemm_peak(fp8_gemms)
    efficiency = {kind: getattr(cluster, name) for kind, name in KIND_EFFICIENCY.items()}
    if model.num_experts and model.num_experts // layout.ep == 1:
        efficiency["expert"] = cluster.gemm_efficiency  # a grouped GEMM of one group is a plain GEMM
    worst: dict[str, float] = {}
    for pp_rank in edge_pp_ranks(layout):
        layers = rank_layers(model, layout, pp_rank)
        last = holds_last_stage(layout, pp_rank)
        f = flops_per_microbatch(model, layout, seq_len, layers, last)
        seconds = {}
        for kind, flops in f.items():
            if kind == "attention" or fp8_efficiency is None:
                seconds[kind] = flops / (cluster.peak_flops * efficiency[kind])
            else:
                seconds[kind] = flops / (gemm_peak * fp8_efficiency)
        seconds["expert"] *= imbalance
        seconds["elementwise"] = 0.0
        if cluster.elementwise_efficiency is not None:
            traffic = elementwise_bytes_per_microbatch(model, layout, seq_len, layers, last, precision)
            seconds["elementwise"] = traffic / (cluster.hbm_bandwidth * cluster.elementwise_efficiency)
        if sum(seconds.values()) > sum(worst.values()):
            worst = seconds
    slowdown = 1.0
    if cluster.concurrent_ranks:
        slowdown = max(1.0, layout.world_size / cluster.concurrent_ranks)
    return {kind: t * slowdown for kind, t in worst.items()}


def intra_layer_overlap(model: ModelShape, layout: Layout) -> bool:
    """Whether the MoE layer can overlap its own token all-to-alls (``dispatch_chunks``, the shared
    expert): its dispatcher must issue and wait apart, which the all-to-all dispatcher does and the
    expert-tensor-parallel wrapper around it (etp group > 1) does not."""
    return dispatcher_kind(model.dispatcher).capabilities.intra_layer_overlap and layout.size("etp") == 1


def hidden_ep_seconds(
    model: ModelShape, layout: Layout, forward: dict[str, float], token_exchange: float
) -> dict[str, float]:
    """Seconds of the step's token all-to-alls (``token_exchange``: dispatch and combine in forward,
    their gradients in backward, one quarter each) hidden behind compute, by mechanism.

    Per micro-batch and pass (forward; backward computes twice the forward's FLOPs), with ``T`` the
    pass's all-to-all seconds (half of them the dispatch's), ``n = model.dispatch_chunks``, ``E``,
    ``S`` and ``C`` the pass's expert GEMM, shared expert and total compute seconds:

    - ``dispatch_chunks``: chunk i+1's dispatch and chunk i's combine fly while chunk i's (or i+1's)
      experts compute; the first dispatch and the last combine have nothing behind them:
      ``min((n - 1) / n x T, E)``.
    - ``shared_expert``: computed while the first chunk's dispatch flies (in backward, its gradient
      while the dispatch's gradient does): ``min(T / 2 / n, S)``.
    - ``overlap_ep_comm`` (m micro-batches): micro-batch i's backward runs with i+1's forward, each
      one's all-to-alls in flight while the other computes; the step's first forward and last
      backward have no partner. Per pair, what the two mechanisms above left of each pass hides
      behind the other pass's compute they left free (a compute second hides one comm second):
      ``(m - 1) x [min(T_b - h_b, C_f - h_f) + min(T_f - h_f, C_b - h_b)]``, ``h`` what the layer
      hid itself. Under ``DualPipeV`` the pairs are its ``OVERLAP_F_B`` actions, each a forward on
      one of the rank's two stages with a full backward on the other (half the rank's layers each,
      so half a pair's figure): :func:`overlapped_pairs` of them in place of ``m - 1``.

    The first two need a dispatcher that overlaps (:func:`intra_layer_overlap`).
    """
    m = layout.microbatches
    passes = {"forward": 1.0, "backward": 2.0}  # compute of each pass in forwards
    comm = token_exchange / m / 2  # T of one pass of one micro-batch
    n = model.dispatch_chunks
    hidden = {"dispatch_chunks": 0.0, "shared_expert": 0.0, "overlap_ep_comm": 0.0}
    by_layer = dict.fromkeys(passes, 0.0)
    if intra_layer_overlap(model, layout):
        for name, factor in passes.items():
            chunks = min((n - 1) / n * comm, factor * forward["expert"])
            shared = min(comm / 2 / n, factor * forward["shared_expert"])
            hidden["dispatch_chunks"] += chunks * m
            hidden["shared_expert"] += shared * m
            by_layer[name] = chunks + shared
    if layout.overlap_ep_comm and m > 1:
        compute = sum(forward.values())
        free = {name: factor * compute - by_layer[name] for name, factor in passes.items()}
        left = {name: comm - by_layer[name] for name in passes}
        pair = min(left["backward"], free["forward"]) + min(left["forward"], free["backward"])
        hidden["overlap_ep_comm"] = overlapped_pairs(layout) * pair
    return hidden


def overlapped_pairs(layout: Layout) -> float:
    """Forward-backward pairs of ``overlap_ep_comm`` per optimizer step, in whole-rank pairs: ``m - 1``
    at pp = 1; under ``DualPipeV`` the ``OVERLAP_F_B`` actions of the rank with the fewest (the
    first: the step waits for it) per pipeline step, each half a rank's layers."""
    if not layout.v_schedule:
        return layout.microbatches - 1
    timeline = v_schedule_timeline(layout.pp_schedule, layout.pp, layout.pipeline_microbatches)
    return min(timeline.overlapped_pairs) / layout.pp_stages_per_rank * layout.pipeline_steps


def record_seconds(rec: CommRecord, layout: Layout, cluster: Cluster) -> float:
    """Seconds ``rec``'s collectives take: its bytes over the bandwidth of the tiers it crosses, plus
    the latency of each call (and ring attention's work around each shift). A ring collective over
    a group that spans nodes moves all its bytes at the inter-node pace; an all-to-all (ep's, and
    ``rec.all_to_all``: all-to-all context parallelism's) and point-to-point traffic send to in-node
    and to other nodes' peers at once, the slower tier setting the time."""
    intra, inter = record_split(rec, layout, cluster)
    bw_intra = cluster.intra_node_bandwidth * cluster.comm_efficiency
    bw_inter = cluster.inter_node_bandwidth * cluster.comm_efficiency
    if rec.pattern == "spread" and inter > 0 and rec.dim != "ep" and not rec.all_to_all:
        # ring collectives over a group that spans nodes run at the slowest link's pace
        seconds = rec.bytes / bw_inter
    else:
        # all-to-all and point-to-point use both tiers at once
        seconds = max(rec.bytes * intra / bw_intra, rec.bytes * inter / bw_inter)
    seconds += rec.calls * cluster.collective_latency
    if rec.pattern == _RING:  # ring attention's per-block work around each shift
        seconds += rec.calls * cluster.ring_step_overhead
    return seconds


def pipeline_bubble(layout: Layout) -> float:
    """The pipeline bubble's share of a step: ``(p - 1) / (m + p - 1)`` for ``m`` micro-batches per
    pipeline step, ``(p - 1) / v`` in place of ``p - 1`` under the interleaved schedule; the V
    schedules' from their action lists played out (:func:`~lightning_moe.planner.v_schedules.v_schedule_timeline`)."""
    m, p, v = layout.pipeline_microbatches, layout.pp, layout.pp_stages_per_rank
    if p == 1:
        return 0.0
    if layout.v_schedule:
        return v_schedule_timeline(layout.pp_schedule, p, m).bubble_fraction
    bubble_units = (p - 1) / v if layout.pp_schedule == "Interleaved1F1B" else (p - 1)
    return bubble_units / (m + bubble_units)


def overlap_budget(
    layout: Layout, compute: float, last_backward: float, hidden_ep: float, spread: float, reductions: float
) -> dict[str, tuple[float, float]]:
    """``{phase: (traffic, compute left)}``: the overlapped FSDP and ring communication seconds each
    phase of the step asks to hide, and the compute seconds left to hide them behind once the expert
    all-to-all's overlap (``hidden_ep``, spread over the step like the compute, each mechanism
    already bound to the compute it runs beside) has taken its share: one second of compute covers
    at most one second of communication, whatever runs beside it.

    ``spread``: traffic spread over the whole step (FSDP2's all-gathers, ring attention's shifts),
    each phase taking its share by its share of the compute; ``reductions``: the gradient reductions
    (FSDP2's reduce-scatters, HSDP's all-reduce). At pp = 1 FSDP2 issues them in each reducing
    backward, layer by layer, the step's last one in the last micro-batch's backward
    (``last_backward`` seconds; all of them there with ``gather_once_per_step``), so they hide
    behind that backward or not at all. Under pp > 1 torch's schedules run them in a ``REDUCE_GRAD``
    action after the stage's last backward, with nothing beside them: they belong to no phase (the
    caller exposes them).
    """
    if layout.pp > 1 or compute <= 0:
        return {"step": (spread, compute - hidden_ep)}
    reductions_last = reductions / fsdp_reduces(layout)
    share_last = last_backward / compute
    return {
        "before the last backward": (
            spread * (1 - share_last) + reductions - reductions_last,
            (compute - last_backward) - hidden_ep * (1 - share_last),
        ),
        "last backward": (spread * share_last + reductions_last, last_backward - hidden_ep * share_last),
    }


def overlapped_hidden_seconds(
    layout: Layout, compute: float, last_backward: float, hidden_ep: float, spread: float, reductions: float
) -> float:
    """Seconds of the overlapped FSDP and ring attention traffic hidden behind compute: in each phase of
    :func:`overlap_budget` (same arguments) its traffic up to the compute the phase has left. What
    :func:`estimate` hides on a backend with asynchronous collectives; the rest is exposed.

    Example (one ring attention call: 0.4 s of shifts behind 0.3 s of forward and backward compute)::

        overlapped_hidden_seconds(Layout(cp=4), 0.3, 0.2, 0.0, 0.4, 0.0)   # 0.3
    """
    phases = overlap_budget(layout, compute, last_backward, hidden_ep, spread, reductions)
    return sum(min(traffic, max(0.0, left)) for traffic, left in phases.values())


def optimizer_seconds(mem: Memory, cluster: Cluster) -> float:
    """Seconds of the optimizer step on one rank: AdamW's memory-bound pass over the rank's fp32
    parameters (:data:`OPTIMIZER_HBM_BYTES_PER_PARAM`). An optimizer with other terms adds them here."""
    return mem.parameters / FP32_BYTES * OPTIMIZER_HBM_BYTES_PER_PARAM / cluster.hbm_bandwidth


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
    fp8_gemms: bool = False,
    load_imbalance: float | None = None,
) -> Estimate:
    """Step time (with its :class:`StepTimeBounds`), MFU, memory and communication of one layout (see
    the module docstring). ``fp8_gemms``: the GEMMs run in FP8 (the cluster's FP8 peak and
    efficiency; attention in bf16); ``load_imbalance``: the busiest ep rank's expert tokens over the
    mean (:func:`expert_load_imbalance`).

    Example::

        est = estimate(shape, Layout(tp=2, ep=2, dp=2, microbatches=4), cluster, seq_len=4096, global_batch_size=16)
        est.step_time, est.bounds.no_overlap, est.memory.total("none"), est.comm["ep"]
    """
    records = comm_records(model, layout, seq_len, precision, gpus_per_node=cluster.gpus_per_node)
    records += muon_comm_records(model, layout) if model.optimizer == "muon" else []
    imbalance = expert_load_imbalance(layout, load_imbalance)
    exposed = spread = reductions = token_exchange = 0.0
    for rec in records:
        seconds = record_seconds(rec, layout, cluster)
        if rec.dim == "ep":  # each dispatch chunk exchanges its counts and tokens in calls of its own
            seconds += (model.dispatch_chunks - 1) * rec.calls * cluster.collective_latency
        if rec.dim == "ep" and rec.routing_dependent:  # the token all-to-alls: the busiest rank receives the most
            seconds *= imbalance
            token_exchange += seconds
        if rec.reduction:
            reductions += seconds
        elif rec.overlapped:
            spread += seconds
        else:
            exposed += seconds
    all_comm = exposed + spread + reductions
    forward = forward_seconds_by_kind(
        model, layout, cluster, seq_len, precision=precision, fp8_gemms=fp8_gemms, imbalance=imbalance
    )
    passes = 3.0 + RECOMPUTE_FORWARDS[checkpointing]
    compute = passes * sum(forward.values()) * layout.microbatches
    last_backward = (passes - 1.0) * sum(forward.values())
    # a backend that runs collectives synchronously (cluster.fsdp_overlap False: gloo on CPU) hides nothing
    asynchronous = cluster.fsdp_overlap
    hidden_ep = hidden_ep_seconds(model, layout, forward, token_exchange if asynchronous else 0.0)
    hidden = sum(hidden_ep.values())
    if asynchronous:
        hidden += overlapped_hidden_seconds(layout, compute, last_backward, hidden, spread, reductions)
    end_of_step = reductions if layout.pp > 1 else 0.0  # after the pipeline's last backward: outside the bubble
    in_step_comm = all_comm - end_of_step
    slowdown = cluster.overlap_slowdown * hidden
    exposed_total = all_comm - hidden
    bubble = pipeline_bubble(layout)
    mem, pp_rank = memory_per_rank(model, layout, seq_len, precision)
    optimizer_time = optimizer_seconds(mem, cluster)
    if model.optimizer == "muon":
        optimizer_time += newton_schulz_seconds(model, layout, cluster)

    def step_with(in_step_exposed: float, end_exposed: float) -> float:
        busy = compute + in_step_exposed
        return (busy / (1.0 - bubble) if bubble < 1 else float("inf")) + end_exposed + optimizer_time

    step = step_with(exposed_total - end_of_step + slowdown, end_of_step)
    spare = max(0.0, compute - in_step_comm)
    bounds = StepTimeBounds(
        perfect_overlap=step_with(max(0.0, in_step_comm - compute), max(0.0, end_of_step - spare)),
        modelled=step,
        no_overlap=step_with(in_step_comm, end_of_step),
    )
    tokens = global_batch_size * seq_len
    peak = cluster.peak_flops * layout.world_size
    mfu = model.model_flops_per_token(seq_len) * tokens / step / peak
    mfu_causal = model.model_flops_per_token(seq_len, causal=True) * tokens / step / peak
    budget = cluster.memory_budget if memory_budget is None else memory_budget
    total = mem.total(checkpointing)
    fits = total <= budget
    reason = (
        ""
        if fits
        else (
            f"needs {total / 2**30:.1f} GiB per rank with checkpointing={checkpointing} "
            f"(parameters+gradients+optimizer {(mem.parameters + mem.gradients + mem.optimizer) / 2**30:.1f} GiB, "
            f"activations {mem.activations[checkpointing] / 2**30:.1f} GiB, FSDP buffers"
            f" {mem.fsdp_buffers / 2**30:.1f} GiB, logits {mem.logits / 2**30:.1f} GiB), budget {budget / 2**30:.1f} GiB"
        )
    )
    comm = comm_bytes_by_dim(records, layout, cluster)
    ep_inter = comm["ep"]["inter"]
    return Estimate(
        layout=layout,
        step_time=step,
        compute_time=compute,
        exposed_comm_time=exposed_total,
        overlapped_comm_time=hidden,
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
        hidden_ep_comm_time=hidden_ep,
        bounds=bounds,
        mfu_causal=mfu_causal,
        overlap_slowdown_time=slowdown,
        end_of_step_reduction_time=end_of_step,
    )
