"""``parallelize``: apply expert, tensor, context, pipeline and data parallelism to any module."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from torch import nn

from lightning_moe.layout import V_SCHEDULES
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.plans.data_parallel import apply_data_parallel
from lightning_moe.parallel.plans.expert_parallel import apply_expert_parallel, check_expert_layout
from lightning_moe.parallel.plans.pipeline import check_pipeline_split, split_module
from lightning_moe.parallel.plans.tensor_parallel import apply_tensor_parallel, check_head_counts

DataParallelKind = Literal["fsdp", "hsdp", "ddp", "none"]
DATA_PARALLEL_KINDS: tuple[str, ...] = ("fsdp", "hsdp", "ddp", "none")

_PARALLELIZED_ATTR = "_lightning_moe_parallelized"


def is_parallelized(module: nn.Module) -> bool:
    """True once :func:`parallelize` ran on ``module`` (or the user applied FSDP2/DTensor themselves)."""
    if getattr(module, _PARALLELIZED_ATTR, False):
        return True
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def check_layout(
    module: nn.Module, dims: ParallelDims, pp_stages_per_rank: int = 1, pp_stage_layers: Sequence[int] | None = None
) -> None:
    """Raise ``ValueError`` naming the fix if ``module`` cannot take the layout ``dims``.

    Needs no process group (a module on the meta device will do): heads and KV heads divisible by
    tp (modules exposing ``num_heads``/``num_kv_heads``), experts by ep, expert FFNs by etp, and
    the pipeline split into ``pp * pp_stages_per_rank`` stages (of ``pp_stage_layers`` blocks each, when
    given). :func:`parallelize` calls it first.

    Example::

        with torch.device("meta"):
            model = MoEGPT(num_layers=3)
        check_layout(model, ParallelDims(pp=2))   # ValueError: 3 layers cannot be split evenly ...
    """
    if dims.tp > 1:
        check_head_counts(module, dims.tp)
    check_expert_layout(module, dims)
    if dims.pp > 1:
        check_pipeline_split(module, dims.pp * pp_stages_per_rank, pp_stage_layers)


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    *,
    data_parallel: DataParallelKind = "fsdp",
    sequence_parallel: bool = True,
    pp_stages_per_rank: int = 1,
    pp_schedule: str = "1F1B",
    pp_stage_layers: Sequence[int] | None = None,
) -> nn.Module:
    """Parallelize ``module`` in place over the layout ``dims`` (its full ``(pp, dp, ep, cp, tp)``
    mesh built, :meth:`ParallelDims.build_mesh`) and return it.

    Order: under pp > 1 the pipeline split first (:func:`lightning_moe.parallel.plans.pipeline.split_module`:
    the module keeps only this rank's ``pp_stages_per_rank`` stages, whose modules
    ``pipeline_stage_modules(module)`` returns; ``pp_schedule`` places them, in a V for
    ``"DualPipeV"``/``"ZBVZeroBubble"``; ``pp_stage_layers``: blocks per stage, else an even split), then expert parallel for every ``MoELayer`` (over
    ``dims``' expert view: ``etp``, ``fold_ep``), the module's tensor-parallel plan
    (``tensor_parallel_plan()``, over the layers left), then data parallel last (FSDP2
    ``fully_shard``, DDP-style ``replicate``, or ``"none"``: parameters stay replicated and gradients
    unreduced). Inside a LightningModule run by ``MoE5DStrategy``, ``dims`` is
    ``self.trainer.strategy.parallel_dims``.

    Example::

        dims = ParallelDims(ep=2); dims.validate(dist.get_world_size())
        dims.build_mesh("cpu")
        layer = parallelize(MoELayer(64, 128, num_experts=8), dims, data_parallel="none")
    """
    if not isinstance(dims, ParallelDims):
        raise TypeError(
            f"parallelize(module, dims) takes the ParallelDims of the layout, got {type(dims).__name__}: pass"
            " trainer.strategy.parallel_dims, or ParallelDims(...) after dims.build_mesh(device_type)"
        )
    if data_parallel not in DATA_PARALLEL_KINDS:
        raise ValueError(f"data_parallel={data_parallel!r} is not one of {DATA_PARALLEL_KINDS}")
    check_layout(module, dims, pp_stages_per_rank, pp_stage_layers)
    if dims.pp > 1:
        # Split first: only this rank's layers get sharded for ep, tp and dp.
        split_module(
            module,
            dims.pp_mesh.get_local_rank(),
            dims.pp,
            pp_stages_per_rank,
            pp_schedule in V_SCHEDULES,
            pp_stage_layers,
        )
    apply_expert_parallel(module, dims)
    if dims.tp > 1:
        apply_tensor_parallel(module, dims, sequence_parallel)
    apply_data_parallel(module, dims, data_parallel)
    setattr(module, _PARALLELIZED_ATTR, True)
    return module
