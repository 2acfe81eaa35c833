"""Data parallelism: FSDP2 ``fully_shard`` (flat or HSDP) or DDP-style ``replicate`` over the dense and expert views."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_moe._compat import force_sum_reduction, replicate_module
from lightning_moe.moe import MoELayer
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.plans.blocks import block_container, iter_blocks


def apply_data_parallel(module: nn.Module, dims: ParallelDims, kind: str) -> None:
    """Reduce dense gradients over dp x ep x cp and expert gradients over ``edp``.

    Every gradient is *averaged* over the ``dp x ep x cp`` ranks, whatever group reduces it:
    - experts reduce over ``edp``, but their gradient already sums the tokens of their ep (and,
      with etp = 1, tp) peers through the dispatch backward;
    - with tp > 1 the router and shared expert see only their tp rank's tokens, so they reduce
      over the token mesh dp x ep x cp x tp.

    Under FSDP, experts whose local count (``num_experts / ep``) is smaller than the ``edp`` group
    shard on a non-expert dim (:func:`expert_shard_dim`) instead of FSDP2's dim 0, so each rank
    holds ``1 / (ep * edp)`` of the expert state rather than whole experts plus padding.

    ``kind="hsdp"``: FSDP2 over the 2-D ``(replicate, shard)`` meshes of ``dims`` (``dp_replicate``
    replica groups): parameters shard within a group, gradients reduce-scatter there and all-reduce
    across the groups.
    """
    if kind == "none":
        return
    if kind in ("fsdp", "hsdp"):
        from torch.distributed.fsdp import fully_shard as wrap
    else:
        wrap = replicate_module
    hsdp = kind == "hsdp"
    dense_mesh, token_mesh, edp_mesh = (
        (dims.dense_fsdp_mesh, dims.token_fsdp_mesh, dims.edp_fsdp_mesh) if hsdp
        else (dims.dense_grad_mesh, dims.token_mesh, dims.edp_mesh)
    )  # fmt: skip

    divisor = float(dims.dense_grad_mesh.size())

    def averaged(modules: nn.Module | list[nn.Module], mesh: DeviceMesh, **options: Any) -> None:
        wrap_averaged(wrap, modules, mesh, divisor, kind, **options)

    edp_shard = shard_group_size(edp_mesh)
    for layer in (m for m in module.modules() if isinstance(m, MoELayer)):
        options = {}
        if kind != "ddp" and layer.num_experts // dims.ep < edp_shard:
            options["shard_placement_fn"] = _expert_placement(edp_shard)
        averaged(layer.experts, edp_mesh, **options)
        if dims.tp > 1:
            # Router, shared expert and its gate, output biases: they see this tp rank's tokens only.
            averaged([m for name, m in layer.named_children() if name != "experts" and _has_parameters(m)], token_mesh)
    blocks = block_container(module)
    if blocks is not None:
        for block in iter_blocks(blocks):
            wrap(block, mesh=dense_mesh)
    if dims.pp > 1:
        # Pipeline stages call the module's children, never the module itself (a stage may be a
        # shallow copy of it): each child holding parameters is a unit of its own, so every unit's
        # hooks run in the stages' forward and backward.
        for child in module.children():
            if child is not blocks:
                for unit in _stage_units(child):
                    if _has_unwrapped_parameters(unit):
                        wrap(unit, mesh=dense_mesh)
        return
    wrap(module, mesh=dense_mesh)


def shard_group_size(mesh: DeviceMesh) -> int:
    """Ranks FSDP2 shards over on ``mesh``: its last dim (the shard dim of an HSDP mesh, the only one otherwise)."""
    return mesh.size(mesh.ndim - 1)


def expert_shard_dim(local_shape: Sequence[int], split_dims: set[int] | frozenset[int], group_size: int) -> int:
    """The dim FSDP2 shards an expert parameter on over a data-parallel group of ``group_size`` ranks.

    ``local_shape``: the parameter's shape on this rank after ep (and etp); dim 0 counts its
    experts. ``split_dims``: dims already split over tp (expert tensor parallelism).

    - Dim 0 (FSDP2's default) when the rank holds at least ``group_size`` experts: whole experts per
      rank, padded to ``ceil(experts / group_size)`` of them (under one expert of padding per rank).
    - Otherwise dim 0 would leave each rank whole experts plus padding (one expert over 4 ranks: each
      holds a full expert, three of them padding). Instead: the largest dim other than the expert
      and tp-split dims whose size ``group_size`` divides (FSDP2 shards a dim > 0 only evenly; ties
      go to the lower dim), e.g. ``w1 [E, H, F]`` on F, or on H when etp splits F; so each rank
      holds ``1 / (ep * edp)`` of the expert. A tp-split dim is never chosen: FSDP2 would describe
      it as a ``_StridedShard``. Dim 0 again when no dim qualifies.

    The planner (``lightning_moe.planner.parameters``) applies the same rule; its dry run checks
    both agree on real shards.

    Example: ``expert_shard_dim((1, 32, 24), set(), 2) == 1``; ``expert_shard_dim((4, 32, 24), set(), 2) == 0``.
    """
    if local_shape[0] >= group_size:
        return 0
    candidates = [d for d in range(1, len(local_shape)) if d not in split_dims and local_shape[d] % group_size == 0]
    return max(candidates, key=lambda d: (local_shape[d], -d), default=0)


def _expert_placement(group_size: int) -> Callable[[nn.Parameter], Shard]:
    """FSDP2's ``shard_placement_fn`` for expert parameters: :func:`expert_shard_dim` of each."""

    def placement(param: nn.Parameter) -> Shard:
        if isinstance(param, DTensor):
            split = frozenset(p.dim for p in param.placements if isinstance(p, Shard)) - {0}  # ep splits dim 0
            return Shard(expert_shard_dim(tuple(param.to_local().shape), split, group_size))
        return Shard(expert_shard_dim(tuple(param.shape), frozenset(), group_size))

    return placement


def wrap_averaged(
    wrap: Callable[..., Any],
    modules: nn.Module | list[nn.Module],
    mesh: DeviceMesh,
    divisor: float,
    kind: str,
    **options: Any,
) -> None:
    """``wrap(modules, mesh=mesh, **options)`` (``fully_shard`` or ``replicate``) with the reduced gradient
    equal to the sum over ``mesh`` divided by ``divisor`` (not by ``mesh.size()``). The divide factor
    and the reduction apply alike to every shard dim (``options["shard_placement_fn"]``).

    How FSDP2 (torch 2.13, ``_fsdp_collectives.foreach_reduce``) applies a custom divide factor, with
    fp32 reduction (the strategy never reduces in fp16, which takes other branches):

    - NCCL, reduce-scatter over >= 2 ranks: one ``ReduceOp.PREMUL_SUM(1 / divisor)`` reduce-scatter
      (``AVG`` when ``divisor`` equals the group size), then a plain ``SUM`` all-reduce for HSDP.
      No extra division kernel. Not yet run on a GPU in this project (the gloo tests cover the
      arithmetic; tests/test_cuda_fsdp.py checks NCCL where CUDA exists).
    - gloo has no ``PREMUL_SUM``: ``force_sum_reduction`` makes it ``SUM`` then one division of the
      reduced shard by ``divisor`` (the same result, one more kernel).
    - No reduce-scatter (a 1-rank group, or ``replicate``, whose shard group has one rank): the
      single-rank branch copies the gradient divided by ``divisor`` itself, then (``replicate``) a
      ``SUM`` all-reduce. Forcing the sum there would divide a second time, so it is not forced.
      That branch's division is the torch behaviour tests/test_cuda_fsdp.py pins, on CPU and on
      the GPU machine's torch.
    """
    wrap(modules, mesh=mesh, **options)
    unit = modules[0] if isinstance(modules, list) else modules
    unit.set_gradient_divide_factor(divisor)
    reduce_scatters = kind in ("fsdp", "hsdp") and shard_group_size(mesh) > 1
    force_sum_reduction(unit, reduce_scatters and dist.get_backend(mesh.get_group(mesh.ndim - 1)) != "nccl")


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _stage_units(child: nn.Module) -> list[nn.Module]:
    """The data-parallel units of a pipeline stage's child: the child itself, or for a container
    (no forward of its own, e.g. ``MoEGPT.mtp``) the parts of each member, since the model may call a
    part outside its member's forward (an MTP depth's ``norm``, before the shared head)."""
    if not isinstance(child, (nn.ModuleDict, nn.ModuleList)):
        return [child]
    units = []
    for member in child.children():
        if any(True for _ in member.parameters(recurse=False)):
            raise ValueError(
                f"{type(member).__name__} in a module container holds parameters of its own: under pipeline"
                " parallelism data parallelism wraps its submodules one by one; move them into a submodule"
            )
        units.extend(member.children())
    return units


def _has_unwrapped_parameters(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    wrapped = {id(p) for m in module.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    return any(id(p) not in wrapped for p in module.parameters())
