"""Checks of ``MoE5DStrategy``'s layout against the world size, and ``layout="auto"``'s choice (the checks that
need neither: :class:`~lightning_moe.parallel.config.ParallelConfig`)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_moe.layout import ResolvedLayout, resolve_layout
from lightning_moe.parallel.dims import ParallelDims

__all__ = ["auto_layout", "check_unreduced_replicas", "resolve_world_size"]


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
