"""Hydra entry point: ``python -m lightning_moe.plan [overrides]``: pick a layout for a cluster.

Ranks every valid (tp, cp, ep, dp, pp) layout of a model preset on a cluster preset with the cost
model of :mod:`lightning_moe.planner`, prints the top ones as a table (estimated step
time, MFU, memory per GPU by part and per activation-checkpointing mode, bytes per step per
dimension split intra/inter-node), lists the layouts that do not fit with the reason, and writes
``plan.json`` and ``plan.png`` (estimated time vs memory per layout, the chosen one marked) in the
Hydra output directory. ``dry_run=true`` then builds the chosen layout for real on torch's fake
process group (:func:`dry_run`).

Examples::

    python -m lightning_moe.plan model=mixtral_8x7b cluster=h100_sxm world_size=256
    python -m lightning_moe.plan model=deepseek_v3 cluster=h200_sxm world_size=1024 top=5
    python -m lightning_moe.plan model=mixtral_8x7b world_size=64 dry_run=true dry_run_layers=4
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_moe.conf import CONF_DIR
from lightning_moe.layout import MESH_DIMS, default_micro_batch_size, layout_request, resolve_layout
from lightning_moe.planner import (
    CHECKPOINT_MODES,
    PARALLEL_DIMS,
    Cluster,
    Estimate,
    Layout,
    ModelShape,
    Plan,
    estimate,
    layout_problems,
    parameter_bytes_per_rank,
    plan,
    rank_parameters,
)

GIB = 2**30


def available_presets(group: str) -> list[str]:
    """Names of the presets of a config group (``model``, ``cluster``, ``parallel``)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _check_preset(group: str, choice: str | None) -> None:
    if choice is not None and choice not in available_presets(group):
        raise ValueError(f"{group}={choice!r} is not a preset: choose one of {available_presets(group)}")


def model_shape(model_cfg: Mapping[str, Any], name: str = "model") -> ModelShape:
    """The planner's :class:`ModelShape` of a composed ``model`` config (MoEGPT arguments)."""
    container = OmegaConf.to_container(model_cfg, resolve=False) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    return ModelShape.from_config(container, name=name)


def layout_from_parallel(
    parallel: Mapping[str, Any], world_size: int, global_batch_size: int, micro_batch_size: int | None = None
) -> Layout:
    """The :class:`Layout` a ``parallel`` preset (the strategy's arguments) runs; ``dp="auto"`` fills the rest.

    As the strategy and data modules run it: ``micro_batch_size=None`` is
    :func:`~lightning_moe.data.sampler.default_micro_batch_size`, and under pp > 1 a pipeline step
    runs ``pp_microbatches`` micro-batches (``null``: ``pp``), not all of the optimizer step's.
    """
    if micro_batch_size is None:
        micro_batch_size = default_micro_batch_size(global_batch_size)
    request = layout_request(parallel)
    request["data_parallel"] = request.get("data_parallel") or "fsdp"
    try:
        resolved = resolve_layout(world_size, **request)
    except ValueError as err:
        raise ValueError(f"parallel preset: {err}") from err
    per_rank = global_batch_size // resolved.dp_ep
    microbatches = max(1, per_rank // micro_batch_size)
    pp_microbatches = int(parallel.get("pp_microbatches") or resolved.pp) if resolved.pp > 1 else 0
    return Layout(
        tp=resolved.tp, cp=resolved.cp, ep=resolved.ep, dp=resolved.dp, pp=resolved.pp, etp=resolved.etp,
        micro_batch_size=micro_batch_size, microbatches=microbatches,
        pp_schedule=str(parallel.get("pp_schedule") or "1F1B"), pp_stages_per_rank=int(parallel.get("pp_stages_per_rank") or 1),
        pp_microbatches=pp_microbatches, gather_once_per_step=bool(parallel.get("gather_once_per_step") or False),
        fold_ep=resolved.fold_ep, dp_replicate=resolved.dp_replicate, overlap_ep_comm=bool(parallel.get("overlap_ep_comm") or False),
    )  # fmt: skip


# -- table ---------------------------------------------------------------------------------------------
def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}" if x >= 5e6 else ("0" if x == 0 else f"{x / 1e9:.3f}")


def format_table(estimates: Sequence[Estimate], checkpointing: str = "none") -> str:
    """Two markdown tables for the given estimates: time and memory, then bytes per step per dim."""
    head = (
        "| # | layout | step s | MFU | tokens/s/GPU | bubble | mem GiB | params | grads | optim | act none/sel/full | fits |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for i, e in enumerate(estimates, 1):
        mem = e.memory
        acts = "/".join(_gib(mem.activations[m]) for m in CHECKPOINT_MODES)
        rows.append(
            f"| {i} | {e.layout.label()} | {e.step_time:.3g} | {e.mfu:.1%} | {e.tokens_per_second / e.layout.world_size:,.0f}"
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
            _gb(e.ep_internode_bytes) if c == "ep inter-node" else f"{_gb(e.comm[c]['intra'])} / {_gb(e.comm[c]['inter'])}"
            for c in columns
        ]
        rows.append(f"| {i} | {e.layout.label()} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


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
            ax.scatter([e.memory.total(checkpointing) / GIB for e in group], [e.step_time for e in group], s=10, c=color, label=label, alpha=0.6)
    if result.ranked:
        best = result.ranked[0]
        ax.scatter([best.memory.total(checkpointing) / GIB], [best.step_time], s=120, marker="*", c="tab:red", label=f"chosen: {best.layout.label()}")
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
    same estimate) or the fastest variant of its sizes, with the settings that run that variant."""
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
    if lay.pp > 1:
        if lay.pipeline_microbatches != req.pipeline_microbatches:
            settings.append(f"parallel.pp_microbatches={lay.pipeline_microbatches}")
        if (lay.pp_schedule, lay.pp_stages_per_rank) != (req.pp_schedule, req.pp_stages_per_rank):
            settings += [f"parallel.pp_schedule={lay.pp_schedule}", f"parallel.pp_stages_per_rank={lay.pp_stages_per_rank}"]
    return (
        f"Not ranked as requested; the ranking's fastest with these sizes is #{i}, {lay.label()}:"
        f" {best.step_time:.3g} s, {best.mfu:.1%} MFU (requested: {requested.step_time:.3g} s, {requested.mfu:.1%})."
        f" To train it: {' '.join(settings)}."
    )


def plan_json(out: Mapping[str, Any]) -> str:
    """``plan.json``'s text: a top-level key a line, and each layout of a list on a line of its own.

    ``json.dumps(indent=...)`` runs the pure-Python encoder, seconds for the tens of thousands of
    layouts of a large world; without an indent the C encoder writes each line.
    """
    def value(v: Any) -> str:
        return "[\n" + ",\n".join(json.dumps(x) for x in v) + "\n]" if isinstance(v, list) and v else json.dumps(v)

    return "{\n" + ",\n".join(f"{json.dumps(k)}: {value(v)}" for k, v in out.items()) + "\n}\n"


# -- dry run -------------------------------------------------------------------------------------------
@dataclass
class RankView:
    """What one rank holds after the real ``parallelize``, next to the cost model's figure."""

    rank: int
    coordinates: dict[str, int]
    parameters: int
    parameter_bytes: int
    model_bytes: int  # the planner's exact figure for this rank
    model_padded_bytes: int  # with FSDP2's padding (the memory estimate)
    shapes: dict[str, tuple[int, ...]]
    mismatches: list[str] = field(default_factory=list)

    @property
    def matches(self) -> bool:
        return not self.mismatches and self.parameter_bytes == self.model_bytes


def _sample_ranks(world_size: int) -> list[int]:
    return sorted({0, world_size // 2, world_size - 1})


def dry_run(
    model_cfg: Mapping[str, Any],
    layout: Layout,
    *,
    ranks: Sequence[int] | None = None,
    num_layers: int | None = None,
) -> list[RankView]:
    """Build ``layout`` for real in this process: torch's fake process group stands in for every rank.

    For each sampled rank (default: first, middle, last) the model is built on the meta device,
    parallelized with the real :func:`lightning_moe.parallelize` (FSDP2 included) on a mesh of
    ``layout.world_size`` ranks, and its local parameter shapes and bytes are compared with
    :func:`lightning_moe.planner.rank_parameters`. Nothing is allocated; an invalid layout
    fails with the code's own error. ``num_layers`` overrides the model's depth (keep it a multiple
    of ``pp * pp_stages_per_rank``).

    Example::

        views = dry_run(cfg.model, Layout(tp=8, ep=64, pp=2, dp=1, etp=8), num_layers=4)
        [v.matches for v in views]
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_moe._compat import fake_store
    from lightning_moe.parallel.dims import ParallelDims
    from lightning_moe.parallel.parallelize import parallelize

    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group: it starts fake ones")
    cfg = OmegaConf.create(OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg))
    if num_layers is not None:
        cfg.num_layers = int(num_layers)
    shape = model_shape(cfg)
    world = layout.world_size
    ranks = _sample_ranks(world) if ranks is None else list(ranks)
    views = []
    for rank in ranks:
        if not 0 <= rank < world:
            raise ValueError(f"dry_run rank {rank} is outside world_size={world}")
        dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
        try:
            dims = ParallelDims(**layout.parallel_sizes(), etp=layout.etp, fold_ep=layout.fold_ep, dp_replicate=layout.dp_replicate)
            dims.validate(world)
            dims.build_mesh("cpu")
            with torch.device("meta"):
                module = hydra.utils.instantiate(cfg)
            parallelize(module, dims, data_parallel="hsdp" if layout.hsdp else "fsdp", pp_stages_per_rank=layout.pp_stages_per_rank)
            shapes = {}
            numel = nbytes = 0
            for name, param in module.named_parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                shapes[name] = tuple(local.shape)
                numel += local.numel()
                nbytes += local.numel() * local.element_size()
        finally:
            dist.destroy_process_group()
        expected = rank_parameters(shape, layout, rank)
        mismatches = [f"{n}: built {shapes.get(n)}, model {expected.get(n)}" for n in sorted(set(shapes) | set(expected)) if shapes.get(n) != expected.get(n)]
        views.append(
            RankView(
                rank=rank,
                coordinates=layout.coordinates(rank),
                parameters=numel,
                parameter_bytes=nbytes,
                model_bytes=parameter_bytes_per_rank(shape, layout, rank),
                model_padded_bytes=parameter_bytes_per_rank(shape, layout, rank, padded=True),
                shapes=shapes,
                mismatches=mismatches,
            )
        )
    return views


def format_dry_run(views: Sequence[RankView], seconds: float) -> str:
    lines = [f"Dry run on the fake process group ({seconds:.1f} s):", f"| rank | coordinates ({','.join(MESH_DIMS)}) | parameters | bytes | model bytes | padded (FSDP2) | match |", "|---|---|---|---|---|---|---|"]
    for v in views:
        coords = ",".join(str(v.coordinates[d]) for d in MESH_DIMS)
        lines.append(f"| {v.rank} | {coords} | {v.parameters:,} | {v.parameter_bytes:,} | {v.model_bytes:,} | {v.model_padded_bytes:,} | {'yes' if v.matches else 'NO'} |")
        for m in v.mismatches[:10]:
            lines.append(f"    mismatch {m}")
    return "\n".join(lines)


# -- entry ---------------------------------------------------------------------------------------------
def run_plan(cfg: DictConfig, output_dir: Path | None = None, choices: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """Plan from a composed ``plan`` config: print the tables, write ``plan.json``/``plan.png``; returns the JSON.

    Example (the config composed as the CLI would)::

        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("plan", overrides=["model=mixtral_8x7b", "world_size=64"])
        run_plan(cfg, Path("/tmp/plan"))
    """
    choices = dict(choices or {})
    _check_preset("model", choices.get("model"))
    _check_preset("cluster", choices.get("cluster"))
    if "cluster" not in cfg or cfg.cluster is None:
        raise ValueError(f"cluster is not set: choose one of {available_presets('cluster')}")
    cluster = Cluster.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))
    shape = model_shape(cfg.model, name=choices.get("model") or "model")
    world_size, seq_len, gbs = cfg.world_size, cfg.data.seq_len, cfg.data.global_batch_size
    budget = None if cfg.memory_budget_gib is None else float(cfg.memory_budget_gib) * GIB
    if cfg.get("dry_run_layers") is not None and not (isinstance(cfg.dry_run_layers, int) and cfg.dry_run_layers >= 1):
        raise ValueError(f"dry_run_layers={cfg.dry_run_layers!r} must be a positive integer (or null for the model's depth)")
    # A micro-batch set in the data config is what will run: rank that one only. Unset, the ranking
    # picks it per layout (the label names it), and a requested layout gets the data modules' default.
    micro_batch = cfg.data.get("micro_batch_size")
    started = time.perf_counter()
    result = plan(
        world_size, shape, cluster, seq_len=seq_len, global_batch_size=gbs, precision=cfg.precision,
        checkpointing=cfg.checkpointing, memory_budget=budget, max_tp=cfg.max_tp,
        micro_batch_sizes=None if micro_batch is None else [int(micro_batch)],
    )  # fmt: skip
    planned_s = time.perf_counter() - started
    extra: Estimate | None = None
    if cfg.get("parallel") is not None:
        layout = layout_from_parallel(cfg.parallel, world_size, gbs, micro_batch)
        problems = layout_problems(shape, layout, seq_len, gbs, cfg.checkpointing)
        if problems:
            raise ValueError(f"parallel layout {layout.label()} is invalid: " + "; ".join(problems))
        extra = estimate(shape, layout, cluster, seq_len, gbs, precision=cfg.precision, checkpointing=cfg.checkpointing, memory_budget=budget)
    top = result.ranked[: cfg.top]
    print(f"{shape.name}: {shape.total_parameters() / 1e9:.1f}B parameters ({shape.active_parameters() / 1e9:.1f}B active)"
          f" on {world_size} x {cluster.name}, seq_len {seq_len}, global batch {gbs}: {len(result.ranked)} layouts fit,"
          f" {len(result.rejected)} do not ({planned_s:.1f} s)")  # fmt: skip
    if top:
        print(format_table(top, cfg.checkpointing))
    else:
        print("No layout fits in memory.")
    if extra is not None:
        print("\nRequested layout (parallel=...):")
        print(format_table([extra], cfg.checkpointing))
        print(format_same_sizes(extra, result))
    print()
    print(format_rejected(result.rejected))
    out: dict[str, Any] = {
        "model": shape.name,
        "cluster": cluster.name,
        "world_size": world_size,
        "seq_len": seq_len,
        "global_batch_size": gbs,
        "precision": cfg.precision,
        "checkpointing": cfg.checkpointing,
        "total_parameters": shape.total_parameters(),
        "active_parameters": shape.active_parameters(),
        "layouts": [e.as_dict() for e in result.ranked],
        "rejected": [e.as_dict() for e in result.rejected],
        "requested": extra.as_dict() if extra is not None else None,
    }
    if cfg.dry_run:
        target = extra if extra is not None else (result.ranked[0] if result.ranked else None)
        if target is None:
            raise ValueError("dry_run=true but no layout fits: pass parallel=<preset> to dry-run a layout anyway")
        started = time.perf_counter()
        views = dry_run(cfg.model, target.layout, ranks=cfg.dry_run_ranks, num_layers=cfg.dry_run_layers)
        seconds = time.perf_counter() - started
        print()
        print(f"Dry run of {target.layout.label()}" + (f" with {cfg.dry_run_layers} layers" if cfg.dry_run_layers else ""))
        print(format_dry_run(views, seconds))
        out["dry_run"] = {
            "layout": target.layout.label(),
            "seconds": seconds,
            "num_layers": cfg.dry_run_layers,
            "ranks": [
                {"rank": v.rank, "parameters": v.parameters, "parameter_bytes": v.parameter_bytes, "model_bytes": v.model_bytes,
                 "model_padded_bytes": v.model_padded_bytes, "matches": v.matches, "mismatches": v.mismatches,
                 "shapes": {name: list(shape) for name, shape in v.shapes.items()}}
                for v in views
            ],
        }  # fmt: skip
        if not all(v.matches for v in views):
            raise RuntimeError("dry run: the built parameter shards differ from the cost model's (listed above)")
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "plan.json").write_text(plan_json(out))
        plot_plan(result, output_dir / "plan.png", cfg.checkpointing)
        print(f"\nplan.json and plan.png: {output_dir}")
    return out


@hydra.main(version_base="1.3", config_path="conf", config_name="plan")
def main(cfg: DictConfig) -> None:
    """``python -m lightning_moe.plan``."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    run_plan(cfg, Path(cfg.output_dir), choices)


if __name__ == "__main__":
    main()
