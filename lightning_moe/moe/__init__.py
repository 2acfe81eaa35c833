"""Mixture-of-Experts building blocks in plain torch: router, losses, capacity, experts, layer.

Example::

    from lightning_moe.moe import MoEConfig, MoELayer, update_expert_biases
    layer = MoELayer(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2)
    same = MoELayer(config=MoEConfig(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2))
    y = layer(torch.randn(2, 16, 64))      # aux losses reach the router by themselves
    update_expert_biases(model)            # once per optimizer step (expert_bias=True layers)

Routing record/replay (docs/routing-replay.md): ``record_routing(model)``, ``replay_routing(model, trace)``.

Packed documents (:mod:`lightning_moe.moe.documents`): inside ``routing_documents(document_ids)``
``seq_aux_loss`` takes each document as a sequence and replay keys tokens by (sample, document, position).
"""

from lightning_moe.moe.capacity import DROP_POLICIES, capacity_keep_mask, expert_capacity
from lightning_moe.moe.config import MoEConfig
from lightning_moe.moe.dispatcher import DispatchContext, Dispatcher, LocalDispatcher
from lightning_moe.moe.dispatchers import CAPABILITIES, DISPATCHERS, DispatcherKind, ExpertGroups, build_dispatcher
from lightning_moe.moe.documents import (
    current_routing_documents,
    recompute_with_routing_documents,
    routing_documents,
    seq_aux_loss_per_document,
    set_routing_documents,
)
from lightning_moe.moe.experts import GroupedExperts, SharedExpert
from lightning_moe.moe.layer import LOAD_BALANCING, MoELayer, update_expert_biases
from lightning_moe.moe.losses import (
    MoEAuxLossAutoScaler,
    global_aux_loss,
    load_balancing_loss,
    seq_aux_loss,
    set_aux_loss_scale,
    sinkhorn,
    switch_aux_loss,
    z_loss,
)
from lightning_moe.moe.replay import (
    DOCUMENT_KEY_BOUND,
    RoutingTrace,
    TokenKeys,
    current_token_keys,
    document_sample_key,
    record_routing,
    replay_routing,
    token_keys,
)
from lightning_moe.moe.router import SCORE_FUNCS, RouterOutput, TopKRouter

__all__ = [
    "CAPABILITIES",
    "DISPATCHERS",
    "DOCUMENT_KEY_BOUND",
    "DROP_POLICIES",
    "LOAD_BALANCING",
    "SCORE_FUNCS",
    "DispatchContext",
    "Dispatcher",
    "DispatcherKind",
    "ExpertGroups",
    "GroupedExperts",
    "LocalDispatcher",
    "MoEAuxLossAutoScaler",
    "MoEConfig",
    "MoELayer",
    "RouterOutput",
    "RoutingTrace",
    "SharedExpert",
    "TokenKeys",
    "TopKRouter",
    "build_dispatcher",
    "capacity_keep_mask",
    "current_routing_documents",
    "current_token_keys",
    "document_sample_key",
    "expert_capacity",
    "global_aux_loss",
    "load_balancing_loss",
    "recompute_with_routing_documents",
    "record_routing",
    "replay_routing",
    "routing_documents",
    "seq_aux_loss",
    "seq_aux_loss_per_document",
    "set_aux_loss_scale",
    "set_routing_documents",
    "sinkhorn",
    "switch_aux_loss",
    "token_keys",
    "update_expert_biases",
    "z_loss",
]
