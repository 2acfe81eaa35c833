"""Checks of ``MoE5DStrategy``'s layout against the world size (the checks that need none:
:class:`~lightning_moe.parallel.config.ParallelConfig`; ``layout="auto"`` is the strategy's, above the
planner)."""

from __future__ import annotations

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_moe.layout import ResolvedLayout, resolve_layout
from lightning_moe.parallel.dims import ParallelDims

__all__ = ["check_unreduced_replicas", "resolve_world_size"]


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
