"""``MoEConfig``: every setting of an :class:`~lightning_moe.moe.MoELayer`, validated in one place.

The layer's keyword arguments are this dataclass's fields: ``MoELayer(64, 128, 8, top_k=2)`` builds
``MoEConfig(64, 128, 8, top_k=2)`` and keeps it as ``layer.config``; ``MoELayer(config=cfg)`` takes a
ready one. The planner's :class:`~lightning_moe.planner.ModelShape` takes its MoE defaults from here.

Example::

    cfg = MoEConfig(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2, score_func="sigmoid",
                    load_balancing="none", expert_bias=True)
    layer = MoELayer(config=cfg)
    wider = MoELayer(config=cfg.replace(num_experts=16))
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import Any

from lightning_moe.moe.capacity import DROP_POLICIES
from lightning_moe.moe.dispatchers import DEFAULT_DISPATCHER, DISPATCHERS, DispatcherKind, check_dispatcher
from lightning_moe.moe.experts import ACTIVATIONS
from lightning_moe.moe.router import check_node_limit, check_routing

__all__ = ["DEFAULT_NUM_EXPERTS", "DISPATCHERS", "LOAD_BALANCING", "ROUTINGS", "MoEConfig", "check_dispatcher"]

LOAD_BALANCING: tuple[str, ...] = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
ROUTINGS: tuple[str, ...] = ("topk", "expert_choice")
# The expert count of a model config that names none (MoEGPT's ``moe`` and the planner's ModelShape);
# MoELayer/MoEConfig themselves require it.
DEFAULT_NUM_EXPERTS = 8


@dataclass(frozen=True)
class MoEConfig:
    """The settings of one :class:`~lightning_moe.moe.MoELayer` (its constructor's arguments).

    Frozen and checked on construction (also by :meth:`replace`): a bad value raises ``ValueError``
    naming the argument and the fix, so ``MoEConfig(...)`` succeeding means ``MoELayer(config=...)``
    builds. ``hidden_size``, ``ffn_hidden_size`` (each expert's SwiGLU width), ``num_experts`` and
    ``top_k`` may be given by position; the rest by keyword. The meaning of every field is in
    :class:`~lightning_moe.moe.MoELayer`'s docstring and docs/moe-layer.md.

    ``num_nodes=None`` means "follow the ep topology" (``lightning_moe.parallelize`` sets the
    router's), as on the layer.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    top_k: int = 2
    _: KW_ONLY
    # routing
    score_func: str = "softmax"
    topk_norm: bool = True
    routing: str = "topk"
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    max_nodes_per_token: int | None = None
    num_nodes: int | None = None
    # load balancing
    load_balancing: str = "aux_loss"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    # capacity
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    # experts
    shared_expert_hidden_size: int | None = None
    shared_expert_gate: bool = False
    expert_linear_bias: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # token exchange
    dispatcher: str = DEFAULT_DISPATCHER.value  # lightning_moe.moe.dispatchers
    dispatch_dtype: str | None = None
    dispatch_chunks: int = 1

    def __post_init__(self) -> None:
        self._check_layer()
        check_routing(
            self.num_experts, self.top_k, self.score_func, self.num_groups, self.group_topk, self.bias_update_rate
        )
        check_node_limit(self.num_nodes, self.max_nodes_per_token, self.num_experts, self.top_k)
        check_dispatcher(self.dispatcher, self.dispatch_dtype)
        if isinstance(self.dispatcher, DispatcherKind):  # kept as the plain string Hydra and YAML take
            object.__setattr__(self, "dispatcher", self.dispatcher.value)

    def _check_layer(self) -> None:
        """The checks across settings (the router's and the dispatcher's follow in ``__post_init__``)."""
        if self.hidden_size < 1 or self.ffn_hidden_size < 1:
            raise ValueError(
                f"hidden_size and ffn_hidden_size must be >= 1, got {self.hidden_size} and {self.ffn_hidden_size}"
            )
        if self.load_balancing not in LOAD_BALANCING:
            raise ValueError(f"load_balancing={self.load_balancing!r} is unknown: choose one of {LOAD_BALANCING}")
        if self.load_balancing == "sinkhorn" and self.expert_bias:
            raise ValueError("expert_bias=True and load_balancing='sinkhorn' both balance the load: pick one")
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            raise ValueError(
                f"aux_loss_coeff and z_loss_coeff must be >= 0, got {self.aux_loss_coeff} and {self.z_loss_coeff}"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None for dropless routing), got {self.capacity_factor}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy={self.drop_policy!r} is unknown: choose one of {DROP_POLICIES}")
        if self.shared_expert_hidden_size is not None and self.shared_expert_hidden_size < 1:
            raise ValueError(f"shared_expert_hidden_size must be >= 1 (or None), got {self.shared_expert_hidden_size}")
        if self.shared_expert_gate and self.shared_expert_hidden_size is None:
            raise ValueError("shared_expert_gate=True gates the shared expert: set shared_expert_hidden_size as well")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is unknown: choose one of {ACTIVATIONS}")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        chunks = self.dispatch_chunks
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"dispatch_chunks={chunks!r} must be an integer >= 1 (1: no overlap)")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r} is unknown: choose one of {ROUTINGS}")
        if self.routing == "expert_choice":
            if self.capacity_factor is None:
                raise ValueError(
                    "routing='expert_choice' needs capacity_factor: each expert picks capacity_factor * T * top_k / E tokens"
                )
            clashes = [name for name, on in (
                ("expert_bias", self.expert_bias), ("num_groups", self.num_groups is not None),
                ("max_nodes_per_token", self.max_nodes_per_token is not None),
                ("load_balancing='sinkhorn'", self.load_balancing == "sinkhorn"),
            ) if on]  # fmt: skip
            if clashes:
                raise ValueError(
                    f"routing='expert_choice' (experts pick tokens) cannot take {clashes}: use routing='topk'"
                )

    def replace(self, **changes: Any) -> MoEConfig:
        """A copy with ``changes`` applied, checked again (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field ``name`` (``KeyError`` for a field without one: the first three)."""
        value = cls.__dataclass_fields__[name].default
        if value is dataclasses.MISSING:
            raise KeyError(f"MoEConfig.{name} has no default: it must be given")
        return value
