"""Expert parallelism: shard every MoELayer's experts over ``ep`` and plug in an EP dispatcher."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_moe.layout import expert_ffn_problem, experts_problem, experts_split_over_tp
from lightning_moe.moe import ExpertGroups, MoELayer
from lightning_moe.parallel.dims import ParallelDims

# The FFN dim of each expert weight, sharded over tp under expert tensor parallelism.
_FFN_DIM = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1}


def apply_expert_parallel(module: nn.Module, dims: ParallelDims) -> None:
    """Shard each MoELayer's experts over ``ep`` (and their FFN dim over ``tp`` when etp = tp).

    Expert weights become DTensors ``Shard(0)`` on ``ep`` (plus ``Shard(ffn dim)`` on ``tp``), so
    checkpoints reshard across layouts. Every rank must hold the same full initial weights (same
    seed); each keeps its own block, so no communication is needed. The layer's dispatcher moves
    tokens within the ep group at a fixed tp coordinate, and its statistics reduce over the ranks
    that share a micro-batch (cp x tp) and over all token-holding ranks (dp x ep x cp x tp).
    """
    check_expert_layout(module, dims)
    expert_tp = experts_split_over_tp(dims.tp, dims.etp)
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
            # A fresh row-major copy, not clone()'s preserved strides: with one expert per rank the
            # block is "contiguous" (a size-1 dim's stride is free) yet keeps the full tensor's
            # expert stride, which DTensor scales into a global stride FSDP rejects as non-contiguous.
            local = local.clone(memory_format=torch.contiguous_format)
            sharded = DTensor.from_local(local, mesh, placements, run_check=False)
            setattr(layer.experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.dispatcher = layer.new_dispatcher(expert_groups(layer, dims, expert_tp))
        layer.ep_group, layer.ep_size = dims.ep_group, dims.ep
        if layer.num_nodes is None and layer.max_nodes_per_token is not None and dims.ep > 1:
            # Node-limited routing follows where the experts live (a stated num_nodes is kept).
            layer.router.set_nodes(dims.ep_num_nodes)
        layer.sequence_group = _group_if_shared(dims.sequence_group)
        layer.data_group = _group_if_shared(dims.token_group)


def expert_groups(layer: MoELayer, dims: ParallelDims, expert_tp: bool) -> ExpertGroups:
    """The groups ``layer``'s dispatcher runs over (``MoELayer.new_dispatcher`` builds it)."""
    # Any split of the ep group over nodes is counted; a dispatcher in node stages needs an even one.
    rank_nodes = dims.ep_rank_nodes if dims.ep > 1 else [0]
    node_ids = rank_nodes if max(rank_nodes) > 0 else None
    node_groups = None
    if layer.dispatcher_kind.capabilities.node_stages and node_ids is not None:
        node_ids = dims.ep_node_ids
        mesh = dims.ep_node_mesh
        node_groups = (mesh.get_group("ep_node"), mesh.get_group("ep_local"))
    return ExpertGroups(dims.ep_group, node_ids, node_groups, dims.tp_group if expert_tp else None)


def check_expert_layout(module: nn.Module, dims: ParallelDims) -> None:
    """Every MoELayer's experts split over ``ep`` and, under expert TP, its FFN dim over ``tp``; the
    topology options fit the nodes (``ValueError`` naming the fix, before any work)."""
    for layer in (m for m in module.modules() if isinstance(m, MoELayer)):
        node_stages = layer.dispatcher_kind.capabilities.node_stages
        needs_nodes = node_stages or (layer.num_nodes is None and layer.max_nodes_per_token is not None)
        if dims.ep > 1 and dims.dp != -1 and needs_nodes:  # the node layout needs the world size
            nodes = dims.ep_num_nodes  # ValueError for an uneven split over nodes
            if node_stages and nodes < 2:
                raise ValueError(
                    f"dispatcher={layer.dispatcher_kind.value!r} with all {dims.ep} ep ranks on one node is the same as 'alltoall': use"
                    f" dispatcher='alltoall', or set ranks_per_node below {dims.ep * dims.cp * dims.tp} to simulate nodes"
                )
            if layer.num_nodes is None and layer.max_nodes_per_token is not None and layer.max_nodes_per_token > nodes:
                raise ValueError(
                    f"max_nodes_per_token={layer.max_nodes_per_token} exceeds the {nodes} node(s) of the ep group"
                    f" (ep={dims.ep}, ranks_per_node={dims.node_size}): lower it or spread ep over more nodes"
                )
        if node_stages and dims.fold_ep:
            raise ValueError(
                f"dispatcher={layer.dispatcher_kind.value!r} splits the mesh's ep dim by node, which fold_ep={list(dims.fold_ep)} leaves"
                " incomplete: use dispatcher='alltoall' with folding, or unfold ep"
            )
        if layer.routing == "expert_choice" and dims.tp * dims.cp > 1:
            raise ValueError(
                "routing='expert_choice' ranks the tokens of the ep group only; under tp or cp > 1 each tp/cp rank"
                " would choose among its own share: use routing='topk' with tp/cp, or tp=cp=1"
            )
        problem = experts_problem(layer.num_experts, dims.ep)
        if problem:
            raise ValueError(problem)
        problem = expert_ffn_problem(layer.experts.w1.shape[2], dims.tp, dims.etp)
        if problem:
            raise ValueError(problem)


def _group_if_shared(group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    return group if dist.get_world_size(group) > 1 else None
