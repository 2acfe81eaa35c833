"""Expert parallelism: shard every MoELayer's experts over ``ep`` and plug in an EP dispatcher."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_moe.moe import MoELayer
from lightning_moe.moe.dispatcher import build_dispatcher
from lightning_moe.moe.ep_dispatcher import ExpertTensorParallelDispatcher
from lightning_moe.parallel.dims import ParallelDims


# The FFN dim of each expert weight, sharded over tp under expert tensor parallelism.
_FFN_DIM = {"w1": 2, "w3": 2, "w2": 1}


def apply_expert_parallel(module: nn.Module, dims: ParallelDims) -> None:
    """Shard each MoELayer's experts over ``ep`` (and their FFN dim over ``tp`` when etp = tp).

    Expert weights become DTensors ``Shard(0)`` on ``ep`` (plus ``Shard(ffn dim)`` on ``tp``), so
    checkpoints reshard across layouts. Every rank must hold the same full initial weights (same
    seed); each keeps its own block, so no communication is needed. The layer's dispatcher moves
    tokens within the ep group at a fixed tp coordinate, and its statistics reduce over the ranks
    that share a micro-batch (cp x tp) and over all token-holding ranks (dp x ep x cp x tp).
    """
    check_expert_layout(module, dims)
    expert_tp = dims.etp == dims.tp and dims.tp > 1
    mesh = dims.expert_mesh
    for layer in (m for m in module.modules() if isinstance(m, MoELayer)):
        for name, param in list(layer.experts.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            local = param.detach().chunk(dims.ep, dim=0)[dims.ep_mesh.get_local_rank()]
            placements = [Shard(0), Replicate()]
            if expert_tp:
                local = local.chunk(dims.tp, dim=_FFN_DIM[name])[dims.tp_mesh.get_local_rank()]
                placements[1] = Shard(_FFN_DIM[name])
            sharded = DTensor.from_local(local.clone(), mesh, placements, run_check=False)
            setattr(layer.experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.dispatcher = build_dispatcher(layer.dispatcher_kind, layer.num_experts, dims.ep_group)
        if expert_tp:
            layer.dispatcher = ExpertTensorParallelDispatcher(layer.dispatcher, dims.tp_group)
        layer.sequence_group = _group_if_shared(dims.sequence_group)
        layer.data_group = _group_if_shared(dims.token_group)


def check_expert_layout(module: nn.Module, dims: ParallelDims) -> None:
    """Every MoELayer's experts split over ``ep`` and, under expert TP, its FFN dim over ``tp``."""
    expert_tp = dims.etp == dims.tp and dims.tp > 1
    for layer in (m for m in module.modules() if isinstance(m, MoELayer)):
        if layer.num_experts % dims.ep:
            raise ValueError(
                f"num_experts {layer.num_experts} is not divisible by ep {dims.ep}: choose ep dividing num_experts"
            )
        ffn = layer.experts.w1.shape[2]
        if expert_tp and ffn % dims.tp:
            raise ValueError(f"expert ffn_hidden_size {ffn} is not divisible by etp={dims.tp}: choose etp=1 or a divisible size")


def _group_if_shared(group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    return group if dist.get_world_size(group) > 1 else None
