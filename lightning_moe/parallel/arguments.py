"""Checks of ``MoE5DStrategy``'s arguments that need no process: each error names the argument and the fix."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_moe.layout import ResolvedLayout, hsdp_problem, resolve_layout
from lightning_moe.parallel.activation_checkpoint import check_activation_checkpointing
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.parallelize import DATA_PARALLEL_KINDS

# How attention crosses the cp ranks: ring attention or all-to-all (Ulysses).
from lightning_moe.cp.comm import CP_COMM_KINDS

__all__ = ["CP_COMM_KINDS", "auto_layout", "check_strategy_arguments", "check_unreduced_replicas", "resolve_world_size"]


def check_strategy_arguments(
    *,
    layout: str,
    data_parallel: str,
    cp_head_chunks: Any,
    dp: Any,
    cp_comm: Any = "ring",
    pp: int,
    save_distributed_checkpoint: bool,
    activation_checkpointing: str,
    async_checkpoint: Any = False,
    compile: Any,
    gather_once_per_step: Any = False,
    dp_replicate: Any = None,
    dp_shard: Any = None,
    overlap_ep_comm: Any = False,
    ep: int | None = 1,
    pp_schedule: str = "1F1B",
) -> None:
    """Raise ``MisconfigurationException`` for a value ``MoE5DStrategy`` cannot take (sizes: ``ParallelDims``)."""
    if layout not in ("manual", "auto"):
        raise MisconfigurationException(f"layout={layout!r} must be 'manual' (the sizes given) or 'auto' (the planner's)")
    if data_parallel not in DATA_PARALLEL_KINDS:
        raise MisconfigurationException(f"data_parallel={data_parallel!r} must be one of {DATA_PARALLEL_KINDS}")
    if not isinstance(cp_head_chunks, int) or cp_head_chunks < 1:
        raise MisconfigurationException(
            f"cp_head_chunks={cp_head_chunks!r} must be a positive integer dividing the key/value heads"
        )
    if cp_comm not in CP_COMM_KINDS:
        raise MisconfigurationException(
            f"cp_comm={cp_comm!r} must be one of {CP_COMM_KINDS}: 'ring' passes K/V blocks around the cp ranks,"
            " 'a2a' exchanges sequence shards for head shards"
        )
    if dp != "auto" and (not isinstance(dp, int) or dp < 1):
        raise MisconfigurationException(f"dp={dp!r} must be a positive integer or 'auto'")
    if pp > 1 and not save_distributed_checkpoint:
        raise MisconfigurationException(
            f"pp={pp} > 1 needs save_distributed_checkpoint=True: each pipeline stage saves its own parameters"
        )
    if not isinstance(async_checkpoint, bool):
        raise MisconfigurationException(f"async_checkpoint={async_checkpoint!r} must be True or False")
    if async_checkpoint and not save_distributed_checkpoint:
        raise MisconfigurationException(
            "async_checkpoint=True needs save_distributed_checkpoint=True: background saves write DCP folders;"
            " set async_checkpoint=False to save one full file"
        )
    try:
        check_activation_checkpointing(activation_checkpointing)
    except ValueError as err:
        raise MisconfigurationException(str(err)) from err
    if not isinstance(compile, bool):
        raise MisconfigurationException(f"compile={compile!r} must be True or False")
    if not isinstance(gather_once_per_step, bool):
        raise MisconfigurationException(f"gather_once_per_step={gather_once_per_step!r} must be True or False")
    if data_parallel != "hsdp" and (dp_replicate is not None or dp_shard is not None):
        raise MisconfigurationException(
            f"dp_replicate={dp_replicate!r}, dp_shard={dp_shard!r} split dp for HSDP, but data_parallel={data_parallel!r}:"
            " set data_parallel='hsdp' or leave both unset"
        )
    if data_parallel == "hsdp" and dp_replicate is None and dp_shard is None:
        raise MisconfigurationException(hsdp_problem(1))
    if gather_once_per_step and (data_parallel != "fsdp" or pp > 1):
        raise MisconfigurationException(
            f"gather_once_per_step=True needs data_parallel='fsdp' and pp=1 (got data_parallel={data_parallel!r},"
            f" pp={pp}): only FSDP gathers parameters, and pipeline schedules already reduce gradients once per"
            " pipeline step; set gather_once_per_step=False"
        )
    _check_overlap_ep_comm(overlap_ep_comm, ep=ep, pp=pp, pp_schedule=pp_schedule, data_parallel=data_parallel,
                           gather_once_per_step=gather_once_per_step, activation_checkpointing=activation_checkpointing)


def _check_overlap_ep_comm(
    overlap: Any, *, ep: int | None, pp: int, pp_schedule: str, data_parallel: str, gather_once_per_step: bool, activation_checkpointing: str
) -> None:
    """Where micro-batch overlap (:class:`lightning_moe.parallel.accumulation.OverlapEngine`) cannot run, say why
    (``ep=None``: chosen later, by ``layout="auto"``)."""
    if not isinstance(overlap, bool):
        raise MisconfigurationException(f"overlap_ep_comm={overlap!r} must be True or False")
    if not overlap:
        return
    if ep == 1:
        raise MisconfigurationException("overlap_ep_comm=True hides expert-parallel all-to-alls, but ep=1 has none: set ep > 1")
    if pp > 1 and pp_schedule != "DualPipeV":
        raise MisconfigurationException(
            f"overlap_ep_comm=True with pp={pp} needs pp_schedule='DualPipeV' (its paired forward and backward of two"
            f" micro-batches interleave); pp_schedule={pp_schedule!r} runs one micro-batch at a time"
        )
    if activation_checkpointing != "none":
        raise MisconfigurationException(
            f"overlap_ep_comm=True with activation_checkpointing={activation_checkpointing!r}: the recomputation in"
            " backward swaps the random-number state, which the interleaved forward shares; use"
            " activation_checkpointing='none' or overlap_ep_comm=False"
        )
    if data_parallel == "ddp":
        raise MisconfigurationException(
            "overlap_ep_comm=True with data_parallel='ddp': torch's replicate swaps each module's parameters in and out"
            " around its forward, while the interleaved backward still uses them; use data_parallel='fsdp' with"
            " gather_once_per_step=True"
        )
    # Under DualPipeV the paired forward and backward run on the rank's two stages, never on one FSDP unit.
    if pp == 1 and data_parallel in ("fsdp", "hsdp") and not gather_once_per_step:
        fix = "gather_once_per_step=True" if data_parallel == "fsdp" else "data_parallel='fsdp' and gather_once_per_step=True"
        raise MisconfigurationException(
            f"overlap_ep_comm=True with data_parallel={data_parallel!r} needs {fix}: FSDP2 would reshard a block"
            " after the next micro-batch's forward while the previous one's backward still needs it"
        )


def resolve_world_size(
    dims: ParallelDims, world_size: int, data_parallel: str, dp_replicate: int | None, dp_shard: int | None
) -> ResolvedLayout:
    """Fit ``dims`` to ``world_size`` with HSDP's replica groups (:func:`~lightning_moe.layout.resolve_layout`:
    ``ValueError``), then refuse replicas that no gradient reduction keeps equal (``MisconfigurationException``)."""
    split = {"dp_replicate": dp_replicate, "dp_shard": dp_shard} if data_parallel == "hsdp" else {}
    layout = resolve_layout(world_size, **{**dims.requested(), "data_parallel": data_parallel, **split})
    dims.apply(layout)
    check_unreduced_replicas(dims, data_parallel)
    return layout


def check_unreduced_replicas(dims: ParallelDims, data_parallel: str) -> None:
    """``data_parallel="none"`` reduces no gradient: refuse it where replicas would drift apart.

    Across dp x ep x cp ranks every parameter sees different tokens, and across tp ranks the router
    and shared expert do; without a reduction their copies train apart.
    """
    replicas = dims.dp * dims.mesh_ep * dims.cp * dims.tp
    if data_parallel == "none" and replicas > 1:
        raise MisconfigurationException(
            f"data_parallel='none' reduces no gradient, but dp*ep*cp*tp = {dims.dp}*{dims.mesh_ep}*{dims.cp}*{dims.tp} ="
            f" {replicas} ranks hold copies of parameters that see different tokens (they would drift apart):"
            " use data_parallel='fsdp' or 'ddp', or reduce gradients yourself with lightning_moe.parallelize in"
            " configure_model"
        )


def auto_layout(world_size: int, layout_options: dict[str, Any] | None) -> dict[str, Any]:
    """``layout="auto"``: the planner's best layout for ``world_size`` as ``MoE5DStrategy`` keyword
    arguments (:func:`lightning_moe.planner.resolve_auto_layout` documents ``layout_options``); the
    choice and the runner-up are logged on rank 0."""
    from lightning.pytorch.utilities import rank_zero_info

    from lightning_moe.planner import resolve_auto_layout

    try:
        best, runner_up = resolve_auto_layout(world_size, **dict(layout_options or {}))
    except (TypeError, ValueError) as err:
        raise MisconfigurationException(str(err)) from err
    other = f"; runner-up {runner_up.layout.label()} ({runner_up.step_time:.3g} s)" if runner_up else ""
    rank_zero_info(f"layout='auto': {best.layout.label()} (estimated {best.step_time:.3g} s per step){other}")
    return best.layout.strategy_kwargs()
