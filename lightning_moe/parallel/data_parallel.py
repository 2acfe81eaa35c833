"""Data parallelism: FSDP2 ``fully_shard`` or DDP-style ``replicate`` over the dense and expert views."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from lightning_moe.moe import MoELayer
from lightning_moe.parallel.dims import ParallelDims


def apply_data_parallel(module: nn.Module, dims: ParallelDims, kind: str) -> None:
    """Reduce dense gradients over dp x ep x cp and expert gradients over ``edp``.

    Both are *averaged* over the ``dp x ep x cp`` ranks that hold different tokens: an expert's
    gradient already sums the contributions of its ep peers through the all-to-all backward, so
    the expert groups divide by the dense size rather than by their own.
    """
    if kind == "none":
        return
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard as wrap
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate as wrap

    grad_divisor = float(dims.dense_grad_mesh.size())
    # FSDP turns a custom divide factor into NCCL's PREMUL_SUM for its reduce-scatter, which gloo
    # lacks: there, sum and scale after. Only for a real reduce-scatter: without one (replicate, or
    # a 1-rank group) torch 2.13 already divides once and forcing the sum would divide twice.
    sum_then_scale = kind == "fsdp" and dims.edp_mesh.size() > 1 and dist.get_backend(dims.edp_group) != "nccl"
    for layer in (m for m in module.modules() if isinstance(m, MoELayer)):
        wrap(layer.experts, mesh=dims.edp_mesh)
        layer.experts.set_gradient_divide_factor(grad_divisor)
        layer.experts.set_force_sum_reduction_for_comms(sum_then_scale)
    blocks = getattr(module, "layers", None)
    if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
        for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
            wrap(block, mesh=dims.dense_grad_mesh)
    wrap(module, mesh=dims.dense_grad_mesh)
