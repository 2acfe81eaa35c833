"""Hydra entry point: ``python -m lightning_moe.plan [overrides]``: pick a layout for a cluster.

Ranks every valid (tp, cp, ep, dp, pp) layout of a model preset on a cluster preset with the cost
model of :mod:`lightning_moe.planner`, prints the top ones as a table (estimated step
time, MFU and its range from no overlap to perfect overlap, memory per GPU by part and per
activation-checkpointing mode, bytes per step per dimension split intra/inter-node), which of the
cluster's constants are measured and which assumed (:func:`format_constants`), the first one's
estimate as a range, lists the layouts that do not fit with the reason, and writes
``plan.json`` and ``plan.png`` (estimated time vs memory per layout, the chosen one marked) in the
Hydra output directory. ``dry_run=true`` then builds the chosen layout for real on torch's fake
process group (:func:`dry_run`).

Examples::

    python -m lightning_moe.plan model=mixtral_8x7b cluster=h100_sxm world_size=256
    python -m lightning_moe.plan model=deepseek_v3 cluster=h200_sxm world_size=1024 top=5
    python -m lightning_moe.plan model=mixtral_8x7b world_size=64 dry_run=true dry_run_layers=4
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_moe.conf import CONF_DIR
from lightning_moe.dry_run import dry_run as build_on_fake_ranks
from lightning_moe.dry_run import format_dry_run
from lightning_moe.planner import Cluster, Estimate, Layout, ModelShape, estimate, layout_problems, plan
from lightning_moe.planner.presets import layout_from_parallel
from lightning_moe.planner.report import (
    GIB,
    MFU_CONVENTION,
    format_bounds,
    format_constants,
    format_rejected,
    format_same_sizes,
    format_table,
    plan_json,
    plot_plan,
)

__all__ = ["available_presets", "dry_run", "layout_from_parallel", "main", "model_shape", "plan_json", "run_plan"]


def available_presets(group: str) -> list[str]:
    """Names of the presets of a config group (``model``, ``cluster``, ``parallel``)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _check_preset(group: str, choice: str | None) -> None:
    if choice is not None and choice not in available_presets(group):
        raise ValueError(f"{group}={choice!r} is not a preset: choose one of {available_presets(group)}")


def model_shape(
    model_cfg: Mapping[str, Any], name: str = "model", architecture: Mapping[str, Any] | None = None
) -> ModelShape:
    """The planner's :class:`ModelShape` of a composed ``model`` config (MoEGPT arguments), with the
    published model's ``architecture`` terms (``conf/architecture/<model>.yaml``) where given."""
    container = (
        OmegaConf.to_container(model_cfg, resolve=False) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    )
    if isinstance(architecture, DictConfig):
        architecture = OmegaConf.to_container(architecture, resolve=True)  # type: ignore[assignment]
    return ModelShape.from_config(container, name=name, architecture=architecture)


def dry_run(
    model_cfg: Mapping[str, Any], layout: Layout, *, ranks: Sequence[int] | None = None, num_layers: int | None = None
) -> list[Any]:
    """:func:`lightning_moe.dry_run.dry_run` of a ``model`` config (``_target_`` and its arguments):
    ``layout`` built on the fake process group for the sampled ``ranks``; ``num_layers`` overrides the
    model's depth (keep it a multiple of ``pp * pp_stages_per_rank``).

    Example::

        views = dry_run(cfg.model, Layout(tp=8, ep=64, pp=2, dp=1, etp=8), num_layers=4)
        [v.matches for v in views]
    """
    cfg = OmegaConf.create(
        OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    )
    if num_layers is not None:
        cfg.num_layers = int(num_layers)
    return build_on_fake_ranks(partial(hydra.utils.instantiate, cfg), model_shape(cfg), layout, ranks=ranks)


# -- entry ---------------------------------------------------------------------------------------------
def run_plan(
    cfg: DictConfig, output_dir: Path | None = None, choices: Mapping[str, str | None] | None = None
) -> dict[str, Any]:
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
    shape = model_shape(cfg.model, name=choices.get("model") or "model", architecture=cfg.get("architecture"))
    fp8_gemms, imbalance = bool(cfg.get("fp8_gemms", False)), cfg.get("expert_load_imbalance")
    imbalance = None if imbalance is None else float(imbalance)
    world_size, seq_len, gbs = cfg.world_size, cfg.data.seq_len, cfg.data.global_batch_size
    budget = None if cfg.memory_budget_gib is None else float(cfg.memory_budget_gib) * GIB
    if cfg.get("dry_run_layers") is not None and not (isinstance(cfg.dry_run_layers, int) and cfg.dry_run_layers >= 1):
        raise ValueError(
            f"dry_run_layers={cfg.dry_run_layers!r} must be a positive integer (or null for the model's depth)"
        )
    # A micro-batch set in the data config is what will run: rank that one only. Unset, the ranking
    # picks it per layout (the label names it), and a requested layout gets the data modules' default.
    micro_batch = cfg.data.get("micro_batch_size")
    started = time.perf_counter()
    result = plan(
        world_size, shape, cluster, seq_len=seq_len, global_batch_size=gbs, precision=cfg.precision,
        checkpointing=cfg.checkpointing, memory_budget=budget, max_tp=cfg.max_tp,
        micro_batch_sizes=None if micro_batch is None else [int(micro_batch)], fp8_gemms=fp8_gemms, load_imbalance=imbalance,
    )  # fmt: skip
    planned_s = time.perf_counter() - started
    extra: Estimate | None = None
    if cfg.get("parallel") is not None:
        layout = layout_from_parallel(cfg.parallel, world_size, gbs, micro_batch)
        problems = layout_problems(shape, layout, seq_len, gbs, cfg.checkpointing)
        if problems:
            raise ValueError(f"parallel layout {layout.label()} is invalid: " + "; ".join(problems))
        extra = estimate(shape, layout, cluster, seq_len, gbs, precision=cfg.precision, checkpointing=cfg.checkpointing,
                         memory_budget=budget, fp8_gemms=fp8_gemms, load_imbalance=imbalance)  # fmt: skip
    top = result.ranked[: cfg.top]
    print(f"{shape.name}: {shape.total_parameters() / 1e9:.1f}B parameters ({shape.active_parameters() / 1e9:.1f}B active)"
          f" on {world_size} x {cluster.name}, seq_len {seq_len}, global batch {gbs}: {len(result.ranked)} layouts fit,"
          f" {len(result.rejected)} do not ({planned_s:.1f} s)")  # fmt: skip
    if top:
        print(format_table(top, cfg.checkpointing))
        print(format_constants(cluster))
        print()
        print(format_bounds(top[0]))
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
        "constants": cluster.constants(),
        "world_size": world_size,
        "seq_len": seq_len,
        "global_batch_size": gbs,
        "precision": cfg.precision,
        "fp8_gemms": fp8_gemms,
        "expert_load_imbalance": imbalance,
        "architecture": dict(cfg.architecture) if cfg.get("architecture") is not None else None,
        "mfu_convention": MFU_CONVENTION,
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
        print(
            f"Dry run of {target.layout.label()}" + (f" with {cfg.dry_run_layers} layers" if cfg.dry_run_layers else "")
        )
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
