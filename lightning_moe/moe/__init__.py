"""Mixture-of-Experts building blocks in plain torch: router, losses, capacity, experts, layer.

Example::

    from lightning_moe.moe import MoEConfig, MoELayer, update_expert_biases
    layer = MoELayer(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2)
    same = MoELayer(config=MoEConfig(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2))
    y = layer(torch.randn(2, 16, 64))      # aux losses reach the router by themselves
    update_expert_biases(model)            # once per optimizer step (expert_bias=True layers)

Routing record/replay (docs/routing-replay.md): ``record_routing(model)``, ``replay_routing(model, trace)``.
"""

from lightning_moe.moe.capacity import DROP_POLICIES, capacity_keep_mask, expert_capacity
from lightning_moe.moe.config import MoEConfig
from lightning_moe.moe.dispatcher import DispatchContext, Dispatcher, LocalDispatcher
from lightning_moe.moe.experts import GroupedExperts, SharedExpert
from lightning_moe.moe.layer import DISPATCHERS, LOAD_BALANCING, MoELayer, build_dispatcher, update_expert_biases
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
    RoutingTrace,
    TokenKeys,
    current_token_keys,
    record_routing,
    replay_routing,
    token_keys,
)
from lightning_moe.moe.router import SCORE_FUNCS, RouterOutput, TopKRouter

__all__ = [
    "DISPATCHERS",
    "DROP_POLICIES",
    "LOAD_BALANCING",
    "SCORE_FUNCS",
    "DispatchContext",
    "Dispatcher",
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
    "current_token_keys",
    "expert_capacity",
    "global_aux_loss",
    "load_balancing_loss",
    "record_routing",
    "replay_routing",
    "seq_aux_loss",
    "set_aux_loss_scale",
    "sinkhorn",
    "switch_aux_loss",
    "token_keys",
    "update_expert_biases",
    "z_loss",
]
