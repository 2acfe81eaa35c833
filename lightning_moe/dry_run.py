"""A layout built for real on torch's fake process group: what each rank would hold, with no memory
allocated, next to the planner's figure (``python -m lightning_moe.plan ... dry_run=true``).

It holds the real ``parallelize`` against the cost model, so it sits above both ``parallel/`` and the
planner, beside ``plan.py``, its entry point."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe._compat import fake_store
from lightning_moe.layout import MESH_DIMS
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.plans.parallelize import parallelize
from lightning_moe.planner import Layout, ModelShape, parameter_bytes_per_rank, rank_parameters

__all__ = ["RankView", "dry_run", "format_dry_run"]


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
    build_module: Callable[[], nn.Module],
    shape: ModelShape,
    layout: Layout,
    *,
    ranks: Sequence[int] | None = None,
) -> list[RankView]:
    """Build ``layout`` for real in this process: torch's fake process group stands in for every rank.

    For each sampled rank (default: first, middle, last) ``build_module()`` runs on the meta device,
    is parallelized with the real :func:`lightning_moe.parallelize` (FSDP2 included) on a mesh of
    ``layout.world_size`` ranks, and its local parameter shapes and bytes are compared with the
    planner's :func:`~lightning_moe.planner.rank_parameters` for ``shape``. Nothing is allocated;
    an invalid layout fails with the code's own error.

    Example::

        views = dry_run(lambda: MoEGPT(num_layers=4), ModelShape(num_layers=4), Layout(tp=2, ep=4, etp=2), ranks=[0, 7])
        [v.matches for v in views]
    """
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group: it starts fake ones")
    world = layout.world_size
    ranks = _sample_ranks(world) if ranks is None else list(ranks)
    views = []
    for rank in ranks:
        if not 0 <= rank < world:
            raise ValueError(f"dry_run rank {rank} is outside world_size={world}")
        dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
        try:
            dims = ParallelDims(
                **layout.parallel_sizes(), etp=layout.etp, fold_ep=layout.fold_ep, dp_replicate=layout.dp_replicate
            )
            dims.validate(world)
            dims.build_mesh("cpu")
            with torch.device("meta"):
                module = build_module()
            parallelize(
                module,
                dims,
                data_parallel="hsdp" if layout.hsdp else "fsdp",
                pp_schedule=layout.pp_schedule,  # the V schedules place a rank's two stages in a V
                pp_stages_per_rank=layout.pp_stages_per_rank,
                pp_stage_layers=layout.pp_stage_layers or None,
            )
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
        mismatches = [
            f"{n}: built {shapes.get(n)}, model {expected.get(n)}"
            for n in sorted(set(shapes) | set(expected))
            if shapes.get(n) != expected.get(n)
        ]
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
    """The dry run's table: per rank, its coordinates and what it holds against the planner's figure."""
    lines = [
        f"Dry run on the fake process group ({seconds:.1f} s):",
        f"| rank | coordinates ({','.join(MESH_DIMS)}) | parameters | bytes | model bytes | padded (FSDP2) | match |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in views:
        coords = ",".join(str(v.coordinates[d]) for d in MESH_DIMS)
        lines.append(
            f"| {v.rank} | {coords} | {v.parameters:,} | {v.parameter_bytes:,} | {v.model_bytes:,} | {v.model_padded_bytes:,} | {'yes' if v.matches else 'NO'} |"
        )
        for m in v.mismatches[:10]:
            lines.append(f"    mismatch {m}")
    return "\n".join(lines)
