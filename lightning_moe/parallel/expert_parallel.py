"""Expert parallelism: shard every MoELayer's experts over ``ep`` and plug in an EP dispatcher."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_moe.moe import MoELayer
from lightning_moe.moe.dispatcher import build_dispatcher
from lightning_moe.parallel.dims import ParallelDims


def apply_expert_parallel(module: nn.Module, dims: ParallelDims) -> None:
    """Make each MoELayer's expert weights DTensors ``Shard(0)`` over ``ep`` and wire its groups.

    Every rank must hold the same full initial weights (same seed); each keeps its contiguous
    block of ``num_experts // ep`` experts, so no communication is needed.
    """
    ep_mesh = dims.ep_mesh
    ep_rank = ep_mesh.get_local_rank()
    for layer in (m for m in module.modules() if isinstance(m, MoELayer)):
        if layer.num_experts % dims.ep:
            raise ValueError(
                f"num_experts {layer.num_experts} is not divisible by ep {dims.ep}: choose ep dividing num_experts"
            )
        for name, param in list(layer.experts.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            local = param.detach().chunk(dims.ep, dim=0)[ep_rank].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(layer.experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.dispatcher = build_dispatcher(layer.dispatcher_kind, layer.num_experts, dims.ep_group)
        # Ranks holding different tokens of one optimizer step: loads and global counts sum over them.
        layer.data_group = dims.dense_grad_group if dist.get_world_size(dims.dense_grad_group) > 1 else None
