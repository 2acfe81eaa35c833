"""The step engine a layout runs, chosen once; and the engine a data module asks for its batch plan."""

from __future__ import annotations

from typing import Any

from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.engines.accumulation import AccumulationEngine, OverlapEngine
from lightning_moe.parallel.engines.lightning_pipeline import PipelineEngine
from lightning_moe.parallel.engines.step_engine import StepEngine
from lightning_moe.parallel.plans.pipeline import check_pipeline_config

__all__ = ["choose_step_engine", "step_engine_of"]


def choose_step_engine(
    dims: ParallelDims,
    *,
    pp_schedule: str = "1F1B",
    pp_microbatches: int | None = None,
    pp_stages_per_rank: int = 1,
    overlap_ep_comm: bool = False,
    gather_once_per_step: bool = False,
) -> StepEngine:
    """The engine of a layout: the pipeline under pp > 1 (``pp_microbatches`` default: pp; with
    ``overlap_ep_comm`` DualPipeV interleaves its paired forward and backward), else gradient
    accumulation, with micro-batch overlap when ``overlap_ep_comm``. ``ValueError`` naming the fix
    for a pipeline the schedule cannot run.

    Example::

        engine = choose_step_engine(ParallelDims(pp=2), pp_microbatches=4)   # PipelineEngine, 4 per step
    """
    microbatches = dims.pp if pp_microbatches is None else pp_microbatches
    if dims.pp > 1:
        return PipelineEngine(
            dims, pp_schedule, microbatches, pp_stages_per_rank, overlap_ep_comm, gather_once_per_step
        )
    # The pipeline's arguments are checked on every layout, so a preset fails alike whatever its pp.
    check_pipeline_config(dims.pp, pp_schedule, microbatches, pp_stages_per_rank)
    engine = OverlapEngine if overlap_ep_comm else AccumulationEngine
    return engine(cp=dims.cp, gather_once_per_step=gather_once_per_step)


def step_engine_of(trainer: Any) -> StepEngine:
    """The engine of ``trainer``'s strategy (``MoE5DStrategy.step_engine``), or, for any other strategy
    or no trainer, plain gradient accumulation: one loader micro-batch per Lightning batch."""
    engine = getattr(getattr(trainer, "strategy", None), "step_engine", None)
    return engine if isinstance(engine, StepEngine) else AccumulationEngine()
