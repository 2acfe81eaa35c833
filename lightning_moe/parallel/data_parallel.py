"""Data parallelism: FSDP2 ``fully_shard`` or DDP-style ``replicate`` over the dense and expert views."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_moe._compat import force_sum_reduction, replicate_module
from lightning_moe.moe import MoELayer
from lightning_moe.parallel.blocks import block_container
from lightning_moe.parallel.dims import ParallelDims


def apply_data_parallel(module: nn.Module, dims: ParallelDims, kind: str) -> None:
    """Reduce dense gradients over dp x ep x cp and expert gradients over ``edp``.

    Every gradient is *averaged* over the ``dp x ep x cp`` ranks, whatever group reduces it:
    - experts reduce over ``edp``, but their gradient already sums the tokens of their ep (and,
      with etp = 1, tp) peers through the dispatch backward;
    - with tp > 1 the router and shared expert see only their tp rank's tokens, so they reduce
      over the token mesh dp x ep x cp x tp.
    """
    if kind == "none":
        return
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard as wrap
    else:
        wrap = replicate_module

    divisor = float(dims.dense_grad_mesh.size())

    def wrap_averaged(modules: nn.Module | list[nn.Module], mesh: DeviceMesh) -> None:
        wrap(modules, mesh=mesh)
        unit = modules[0] if isinstance(modules, list) else modules
        unit.set_gradient_divide_factor(divisor)
        # FSDP turns a custom divide factor into NCCL's PREMUL_SUM for its reduce-scatter, which
        # gloo lacks: there, sum and scale after. Only for a real reduce-scatter: without one
        # (replicate, or a 1-rank group) torch 2.13 already divides once and would divide twice.
        force_sum_reduction(unit, kind == "fsdp" and mesh.size() > 1 and dist.get_backend(mesh.get_group()) != "nccl")

    for layer in (m for m in module.modules() if isinstance(m, MoELayer)):
        wrap_averaged(layer.experts, dims.edp_mesh)
        if dims.tp > 1:
            wrap_averaged([m for m in (layer.router, layer.shared_expert) if m is not None], dims.token_mesh)
    blocks = block_container(module)
    if blocks is not None:
        for block in blocks._modules.values():
            wrap(block, mesh=dims.dense_grad_mesh)
    if dims.pp > 1:
        # Pipeline stages call the module's children, never the module itself (a stage may be a
        # shallow copy of it): each child holding parameters is a unit of its own, so every unit's
        # hooks run in the stages' forward and backward.
        for child in module.children():
            if child is not blocks and _has_unwrapped_parameters(child):
                wrap(child, mesh=dims.dense_grad_mesh)
        return
    wrap(module, mesh=dims.dense_grad_mesh)


def _has_unwrapped_parameters(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    wrapped = {id(p) for m in module.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    return any(id(p) not in wrapped for p in module.parameters())
