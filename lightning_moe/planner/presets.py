"""A ``parallel`` preset (the strategy's arguments, as the training configs give them) as the planner's
:class:`~lightning_moe.planner.candidate.Layout`, sized by :func:`lightning_moe.layout.resolve_layout`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_moe.cp.comm import CpComm
from lightning_moe.layout import default_micro_batch_size, layout_request, resolve_layout
from lightning_moe.planner.candidate import Layout

__all__ = ["layout_from_parallel"]


def layout_from_parallel(
    parallel: Mapping[str, Any], world_size: int, global_batch_size: int, micro_batch_size: int | None = None
) -> Layout:
    """The :class:`Layout` a ``parallel`` preset (the strategy's arguments) runs; ``dp="auto"`` fills the rest.

    As the strategy and data modules run it: ``micro_batch_size=None`` is
    :func:`~lightning_moe.data.sampler.default_micro_batch_size`, and under pp > 1 a pipeline step
    runs ``pp_microbatches`` micro-batches (``null``: ``pp``), not all of the optimizer step's.
    ``cp_comm`` (``ring``, the default, or ``a2a``) is read too: ``parallel=cp2 parallel.cp_comm=a2a``.
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
        cp_comm=str(parallel.get("cp_comm") or CpComm.RING), pp_stage_layers=tuple(parallel.get("pp_stage_layers") or ()),
    )  # fmt: skip
