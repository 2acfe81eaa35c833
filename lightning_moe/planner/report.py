"""What the planner's results look like to a person: the ranked tables, the layouts that do not fit,
``plan.png`` and ``plan.json``'s text."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_moe.layout import PARALLEL_DIMS
from lightning_moe.planner.candidate import Layout
from lightning_moe.planner.cluster import Cluster
from lightning_moe.planner.memory import CHECKPOINT_MODES
from lightning_moe.planner.search import Plan
from lightning_moe.planner.step_time import Estimate

__all__ = [
    "GIB",
    "MFU_CONVENTION",
    "format_bounds",
    "format_constants",
    "format_rejected",
    "format_same_sizes",
    "format_table",
    "plan_json",
    "plot_plan",
]

GIB = 2**30
MFU_CONVENTION = (
    "model FLOPs per token = 6 x active parameters + the attention core over the full score matrix"
    " (PaLM appendix B; Megatron-LM's num_floating_point_operations counts it the same way), as the"
    " published MFU figures; the causal half is what the kernels compute (mfu_causal)"
)


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}" if x >= 5e6 else ("0" if x == 0 else f"{x / 1e9:.3f}")


def format_table(estimates: Sequence[Estimate], checkpointing: str = "none") -> str:
    """Two markdown tables for the given estimates: time and memory, then bytes per step per dim."""
    head = (
        "| # | layout | step s | MFU | MFU range | tokens/s/GPU | bubble | mem GiB | params | grads | optim | act none/sel/full | fits |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for i, e in enumerate(estimates, 1):
        mem = e.memory
        acts = "/".join(_gib(mem.activations[m]) for m in CHECKPOINT_MODES)
        rows.append(
            f"| {i} | {e.layout.label()} | {e.step_time:.3g} | {e.mfu:.1%} | {_mfu_range(e)} | {e.tokens_per_second_per_gpu:,.0f}"
            f" | {e.bubble_fraction:.1%} | {_gib(mem.total(checkpointing))} | {_gib(mem.parameters)} | {_gib(mem.gradients)}"
            f" | {_gib(mem.optimizer)} | {acts} | {'yes' if e.fits else 'no'} |"
        )
    # A column a dim, and ep's inter-node share after ep's.
    columns = [c for d in PARALLEL_DIMS for c in ((d, "ep inter-node") if d == "ep" else (d,))]
    comm_head = (
        "\nBytes per step and GPU (GB), intra-node / inter-node:\n\n"
        f"| # | layout | {' | '.join(columns)} |\n|---|---|{'---|' * len(columns)}"
    )
    rows.append(comm_head)
    for i, e in enumerate(estimates, 1):
        cells = [
            _gb(e.ep_internode_bytes)
            if c == "ep inter-node"
            else f"{_gb(e.comm[c]['intra'])} / {_gb(e.comm[c]['inter'])}"
            for c in columns
        ]
        rows.append(f"| {i} | {e.layout.label()} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _mfu_range(e: Estimate) -> str:
    """``no overlap–perfect overlap`` MFU of an estimate (its bounds)."""
    if e.bounds is None:
        return ""
    return f"{e.mfu_at(e.bounds.no_overlap):.1%}–{e.mfu_at(e.bounds.perfect_overlap):.1%}"


def format_bounds(e: Estimate) -> str:
    """The first layout's estimate as a range: step time and MFU with no overlap, the modelled
    overlap and perfect overlap, where its time goes, and the MFU convention."""
    b = e.bounds
    assert b is not None
    lines = [
        f"Estimate of {e.layout.label()} as a range (step s / MFU):",
        f"  no overlap {b.no_overlap:.3g} / {e.mfu_at(b.no_overlap):.1%},"
        f" modelled overlap {b.modelled:.3g} / {e.mfu:.1%},"
        f" perfect overlap {b.perfect_overlap:.3g} / {e.mfu_at(b.perfect_overlap):.1%}",
        f"  compute {e.compute_time:.3g} s, hidden communication {e.overlapped_comm_time:.3g} s (slowing the compute by"
        f" {e.overlap_slowdown_time:.3g} s), exposed {e.exposed_comm_time:.3g} s (of which the gradient reduction after"
        f" the last backward {e.end_of_step_reduction_time:.3g} s), bubble {e.bubble_fraction:.1%}, optimizer {e.optimizer_time:.3g} s",
        f"  MFU: {MFU_CONVENTION}: {e.mfu_causal:.1%} with causal attention FLOPs",
    ]
    return "\n".join(lines)


def format_constants(cluster: Cluster) -> str:
    """Which of the cost model's constants (:meth:`Cluster.constants`) the estimates take from a
    measurement on the machine, each with its source, and which are assumptions.

    Example::

        print(format_constants(cluster))   # Constants of h200_sxm: measured none; assumed gemm_efficiency 0.7, ...
    """
    constants = cluster.constants()

    def listed(values: Mapping[str, Any]) -> str:
        return ", ".join(f"{k} {'none' if v is None else f'{v:.4g}'}" for k, v in values.items()) or "none"

    measured = {k: entry["value"] for k, entry in constants["measured"].items()}
    lines = [f"Constants of {cluster.name}: measured {listed(measured)}; assumed {listed(constants['assumed'])}"]
    lines += [f"  {k} measured: {entry['source']}" for k, entry in constants["measured"].items()]
    if cluster.device_name and not measured:
        lines.append(
            "  (calibrate them: `make bench-gpu` on the machine, then"
            f" `python -m lightning_moe.planner.calibrate bench_gpu.json --cluster {cluster.name}`)"
        )
    return "\n".join(lines)


def format_rejected(rejected: Sequence[Estimate], limit: int = 10) -> str:
    if not rejected:
        return "Every valid layout fits in memory."
    lines = [f"{len(rejected)} layouts do not fit in memory (smallest first):"]
    for e in rejected[:limit]:
        lines.append(f"  {e.layout.label()}: {e.reason}")
    if len(rejected) > limit:
        lines.append(f"  ... and {len(rejected) - limit} more (all in plan.json)")
    return "\n".join(lines)


def plot_plan(result: Plan, path: Path, checkpointing: str = "none") -> Path:
    """``plan.png``: estimated step time vs memory per GPU for every layout, the chosen one marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for group, color, label in ((result.ranked, "tab:blue", "fits"), (result.rejected, "tab:gray", "does not fit")):
        if group:
            ax.scatter(
                [e.memory.total(checkpointing) / GIB for e in group],
                [e.step_time for e in group],
                s=10,
                c=color,
                label=label,
                alpha=0.6,
            )
    if result.ranked:
        best = result.ranked[0]
        ax.scatter(
            [best.memory.total(checkpointing) / GIB],
            [best.step_time],
            s=120,
            marker="*",
            c="tab:red",
            label=f"chosen: {best.layout.label()}",
        )
    ax.axvline(result.cluster.memory_budget / GIB, color="tab:red", linestyle=":", linewidth=1, label="memory budget")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("memory per GPU (GiB, estimated)")
    ax.set_ylabel("step time (s, estimated)")
    ax.set_title(f"{result.model.name} on {result.world_size} x {result.cluster.name}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _sizes(layout: Layout) -> tuple[Any, ...]:
    return (*layout.parallel_sizes().values(), layout.etp, layout.fold_ep, layout.dp_replicate)


def format_same_sizes(requested: Estimate, result: Plan) -> str:
    """Where the ranking stands on the requested layout's sizes: the same layout (same label, the
    same estimate) or the fastest variant of its sizes, with the settings that run that variant
    (``parallel.cp_comm=a2a`` where the ranking chose all-to-all attention for a ring request)."""
    same = [(i, e) for i, e in enumerate(result.ranked, 1) if _sizes(e.layout) == _sizes(requested.layout)]
    label = requested.layout.label()
    if not same:
        return f"The ranking has no fitting layout with the sizes of {label}."
    exact = next(((i, e) for i, e in same if e.layout.label() == label), None)
    if exact is not None:
        return f"Ranked #{exact[0]} of {len(result.ranked)} (the same layout and estimate)."
    i, best = same[0]
    lay, req = best.layout, requested.layout
    settings = []
    if lay.micro_batch_size != req.micro_batch_size:
        settings.append(f"data.micro_batch_size={lay.micro_batch_size}")
    if lay.cp_comm != req.cp_comm:
        settings.append(f"parallel.cp_comm={lay.cp_comm}")
    if lay.pp > 1:
        if lay.pipeline_microbatches != req.pipeline_microbatches:
            settings.append(f"parallel.pp_microbatches={lay.pipeline_microbatches}")
        if (lay.pp_schedule, lay.pp_stages_per_rank) != (req.pp_schedule, req.pp_stages_per_rank):
            settings += [
                f"parallel.pp_schedule={lay.pp_schedule}",
                f"parallel.pp_stages_per_rank={lay.pp_stages_per_rank}",
            ]
    for option in ("gather_once_per_step", "overlap_ep_comm"):
        if getattr(lay, option) != getattr(req, option):
            settings.append(f"parallel.{option}={str(getattr(lay, option)).lower()}")
    why = "Not ranked as requested" if requested.fits else "Not ranked: the requested layout does not fit"
    return (
        f"{why}; the ranking's fastest with these sizes is #{i}, {lay.label()}:"
        f" {best.step_time:.3g} s, {best.mfu:.1%} MFU (requested: {requested.step_time:.3g} s, {requested.mfu:.1%})."
        + (f" To train it: {' '.join(settings)}." if settings else "")
    )


def plan_json(out: Mapping[str, Any]) -> str:
    """``plan.json``'s text: a top-level key a line, and each layout of a list on a line of its own.

    ``json.dumps(indent=...)`` runs the pure-Python encoder, seconds for the tens of thousands of
    layouts of a large world; without an indent the C encoder writes each line.
    """

    def value(v: Any) -> str:
        return "[\n" + ",\n".join(json.dumps(x) for x in v) + "\n]" if isinstance(v, list) and v else json.dumps(v)

    return "{\n" + ",\n".join(f"{json.dumps(k)}: {value(v)}" for k, v in out.items()) + "\n}\n"
