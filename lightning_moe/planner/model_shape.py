"""The model's shape: its dimensions, parameter counts and the MFU numerator."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from lightning_moe.moe.config import DEFAULT_NUM_EXPERTS, MoEConfig

# The MoE settings the planner reads: ModelShape field -> the MoEConfig field it is. Their defaults are
# MoEConfig's (num_experts: DEFAULT_NUM_EXPERTS, moe_ffn_hidden_size: the dense ffn_hidden_size, as
# MoEGPT fills them in); ModelShape.from_config reads them from ``moe`` under the MoEConfig names.
MOE_FIELDS: dict[str, str] = {
    "num_experts": "num_experts",
    "top_k": "top_k",
    "moe_ffn_hidden_size": "ffn_hidden_size",
    "shared_expert_hidden_size": "shared_expert_hidden_size",
    "dispatcher": "dispatcher",
    "load_balancing": "load_balancing",
    "expert_bias": "expert_bias",
    "capacity_factor": "capacity_factor",
    "dispatch_chunks": "dispatch_chunks",
    "dispatch_dtype": "dispatch_dtype",
    "max_nodes_per_token": "max_nodes_per_token",
    "num_groups": "num_groups",
    "group_topk": "group_topk",
}
# Terms of a published architecture that MoEGPT cannot build, read by the planner alone from the plan
# config's ``architecture`` (conf/architecture/<model>.yaml): leading dense layers, and attention
# head dims apart from hidden / heads (multi-head latent attention's q/k and v heads).
ARCHITECTURE_FIELDS: tuple[str, ...] = ("first_dense_layers", "qk_head_dim", "v_head_dim")

_CASTS: dict[str, Any] = {"int": int, "float": float, "str": str, "bool": bool}


def _cast(annotation: str, value: Any) -> Any:
    """``value`` as the type of a field annotated ``annotation`` (``"int"``, ``"float | None"``, ...)."""
    if annotation.endswith(" | None") and value is None:
        return None
    return _CASTS[annotation.removesuffix(" | None")](value)


@dataclass(frozen=True)
class ModelShape:
    """The shape of an :class:`~lightning_moe.models.MoEGPT` (its constructor's keyword arguments).

    The MoE fields (``MOE_FIELDS``) are the planner's part of the MoE layers'
    :class:`~lightning_moe.moe.MoEConfig`, with its defaults; :attr:`moe` gives them back as one, and
    :meth:`from_moe_config` builds a shape around one.

    Example::

        shape = ModelShape.from_config({"hidden_size": 64, "num_layers": 2, "moe": {"num_experts": 8}})
        shape.total_parameters()
        shape.moe                        # MoEConfig(hidden_size=64, ffn_hidden_size=192, num_experts=8, ...)
        ModelShape.from_moe_config(MoEConfig(64, 256, num_experts=8, top_k=1), num_layers=2, num_heads=4)
    """

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    ffn_hidden_size: int = 384
    moe_layer_freq: int = 1
    # MoE layers: MOE_FIELDS
    num_experts: int = DEFAULT_NUM_EXPERTS
    top_k: int = MoEConfig.default("top_k")
    moe_ffn_hidden_size: int = 384  # the dense ffn_hidden_size's default
    shared_expert_hidden_size: int | None = MoEConfig.default("shared_expert_hidden_size")
    dispatcher: str = MoEConfig.default("dispatcher")
    load_balancing: str = MoEConfig.default("load_balancing")
    expert_bias: bool = MoEConfig.default("expert_bias")
    capacity_factor: float | None = MoEConfig.default("capacity_factor")
    dispatch_chunks: int = MoEConfig.default("dispatch_chunks")
    dispatch_dtype: str | None = MoEConfig.default("dispatch_dtype")
    max_nodes_per_token: int | None = MoEConfig.default("max_nodes_per_token")
    num_groups: int | None = MoEConfig.default("num_groups")  # group-limited routing: expert groups,
    group_topk: int | None = MoEConfig.default("group_topk")  # of which each token takes this many
    # ARCHITECTURE_FIELDS: the published model's terms (None: MoEGPT's hidden / heads)
    first_dense_layers: int = 0
    qk_head_dim: int | None = None
    v_head_dim: int | None = None
    name: str = "model"
    optimizer: str = "adamw"  # "muon": the step adds lightning_moe.planner.muon's gathers and Newton-Schulz
    mtp_depth: int = 0  # multi-token prediction depths on the last stage: lightning_moe.planner.mtp

    @classmethod
    def from_config(
        cls, cfg: Mapping[str, Any], name: str | None = None, architecture: Mapping[str, Any] | None = None
    ) -> ModelShape:
        """From an MoEGPT config (``conf/model/*.yaml`` or ``MoEGPT.hparams``), with MoEGPT's defaults;
        ``architecture``: the published model's :data:`ARCHITECTURE_FIELDS` the planner estimates in
        its place (``{"first_dense_layers": 3, "qk_head_dim": 192, "v_head_dim": 128}``)."""
        if not isinstance(cfg, Mapping):
            raise ValueError(f"model config must be a mapping of MoEGPT arguments, got {type(cfg).__name__}")
        architecture = dict(architecture or {})
        unknown = sorted(set(architecture) - set(ARCHITECTURE_FIELDS))
        if unknown:
            raise ValueError(f"architecture has unknown keys {unknown}: the keys are {list(ARCHITECTURE_FIELDS)}")
        hidden = int(cfg.get("hidden_size", 128))
        heads = int(cfg.get("num_heads", 4))
        kv = cfg.get("num_kv_heads")
        ffn = cfg.get("ffn_hidden_size")
        ffn = 64 * math.ceil(8 * hidden / 3 / 64) if ffn is None else int(ffn)
        moe = dict(cfg.get("moe") or {})
        moe_defaults = {"num_experts": DEFAULT_NUM_EXPERTS, "ffn_hidden_size": ffn}  # MoEGPT's
        moe_fields = {}
        for field, key in MOE_FIELDS.items():
            default = moe_defaults[key] if key in moe_defaults else MoEConfig.default(key)
            moe_fields[field] = _cast(cls.__dataclass_fields__[field].type, moe.get(key, default))
        shape = cls(
            vocab_size=int(cfg.get("vocab_size", 256)),
            hidden_size=hidden,
            num_layers=int(cfg.get("num_layers", 4)),
            num_heads=heads,
            num_kv_heads=heads if kv is None else int(kv),
            ffn_hidden_size=ffn,
            moe_layer_freq=int(cfg.get("moe_layer_freq", 1)),
            **moe_fields,
            **{key: None if value is None else int(value) for key, value in architecture.items()},
            name=name or str(cfg.get("name", "model")),
            optimizer=str(cfg.get("optimizer", "adamw")),
            mtp_depth=int(cfg.get("mtp_depth", 0)),
        )
        shape.check()
        return shape

    @classmethod
    def from_moe_config(cls, moe: MoEConfig, **fields: Any) -> ModelShape:
        """The shape of a model whose MoE layers are ``moe`` (which gives ``hidden_size`` too);
        ``fields``: the other fields (``num_layers``, ``num_heads``, ...), checked as :meth:`from_config`."""
        taken = sorted(set(fields) & {"hidden_size", *MOE_FIELDS})
        if taken:
            raise ValueError(f"{taken} come from the MoEConfig: set them there (moe.replace(...)), not as fields")
        moe_fields = {field: getattr(moe, name) for field, name in MOE_FIELDS.items()}
        shape = cls(hidden_size=moe.hidden_size, **moe_fields, **fields)
        shape.check()
        return shape

    @property
    def moe(self) -> MoEConfig:
        """The :class:`~lightning_moe.moe.MoEConfig` of the MoE layers as far as the shape knows it (the
        ``MOE_FIELDS``; the other settings at their defaults). ``ValueError`` if those do not make one."""
        return MoEConfig(self.hidden_size, **{name: getattr(self, field) for field, name in MOE_FIELDS.items()})

    def check(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}:"
                " hidden_size must be divisible by num_heads and num_heads by num_kv_heads"
            )
        if self.dispatch_chunks < 1:
            raise ValueError(f"model.moe.dispatch_chunks={self.dispatch_chunks} must be >= 1 (1: no chunking)")
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ValueError(
                f"architecture.first_dense_layers={self.first_dense_layers} must be between 0 and num_layers={self.num_layers}"
            )
        for key in ("qk_head_dim", "v_head_dim"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(
                    f"architecture.{key}={getattr(self, key)} must be >= 1 (or null: hidden_size / num_heads)"
                )
        if self.num_moe_layers and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"model.moe.top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")

    # shape helpers, read in every layer's FLOPs and activations: computed once (``cached_property``
    # keeps them in the instance's ``__dict__``, apart from the frozen fields equality and the hash read)
    @cached_property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @cached_property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @cached_property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @cached_property
    def attention_core_dim(self) -> int:
        """Elements per token of one layer's attention core, ``heads x (q/k head + v head)``: the
        ``QK^T`` and ``PV`` products each take ``2 x s`` FLOPs per key and element of their head dim."""
        return self.num_heads * ((self.qk_head_dim or self.head_dim) + (self.v_head_dim or self.head_dim))

    def is_moe(self, layer: int) -> bool:
        """Same rule as :func:`lightning_moe.models.moe_gpt.is_moe_layer`, after the published
        architecture's ``first_dense_layers``."""
        return layer >= self.first_dense_layers and self.moe_layer_freq > 0 and (layer + 1) % self.moe_layer_freq == 0

    # The counts below loop over every layer and the planner asks for them per layout: computed once.
    @cached_property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.num_layers))

    # parameter counts (global)
    def attention_parameters(self) -> int:
        h = self.hidden_size
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 2 * h  # + the two norms

    def expert_parameters(self) -> int:
        return 3 * self.num_experts * self.hidden_size * self.moe_ffn_hidden_size

    def moe_dense_parameters(self) -> int:
        """Router and shared expert of one MoE layer."""
        shared = 3 * self.hidden_size * self.shared_expert_hidden_size if self.shared_expert_hidden_size else 0
        return self.num_experts * self.hidden_size + shared

    def total_parameters(self) -> int:
        return self._total_parameters

    @cached_property
    def _total_parameters(self) -> int:
        h = self.hidden_size
        total = 2 * self.vocab_size * h + h
        for i in range(self.num_layers):
            total += self.attention_parameters()
            total += (
                self.expert_parameters() + self.moe_dense_parameters()
                if self.is_moe(i)
                else 3 * h * self.ffn_hidden_size
            )
        return total

    def active_parameters(self) -> float:
        """As :func:`lightning_moe.callbacks.throughput.active_parameters`: no embedding, experts x top_k/E."""
        return self._active_parameters

    @cached_property
    def _active_parameters(self) -> float:
        h = self.hidden_size
        total = float(self.vocab_size * h + h)
        total += sum(self._layer_active_parameters(i) for i in range(self.num_layers))
        # An MTP depth: a block of the last layer's kind, eh_proj [H, 2H], enorm, hnorm and its norm.
        mtp = self._layer_active_parameters(self.num_layers - 1) + 2 * h * h + 3 * h
        return total + self.mtp_depth * mtp

    def _layer_active_parameters(self, layer: int) -> float:
        if self.is_moe(layer):
            ffn = self.expert_parameters() * self.top_k / self.num_experts + self.moe_dense_parameters()
        else:
            ffn = 3 * self.hidden_size * self.ffn_hidden_size
        return self.attention_parameters() + ffn

    def model_flops_per_token(self, seq_len: int, *, causal: bool = False) -> float:
        """MFU numerator, as :func:`lightning_moe.callbacks.throughput.model_flops_per_token`:
        ``6 x active parameters + 6 x layers x heads x (qk + v head dims) x seq_len`` (PaLM, appendix B:
        ``12 x layers x q_dim x seq_len`` for equal head dims), the attention core over the full score
        matrix, as PaLM and Megatron-LM's ``num_floating_point_operations`` count it (the convention of
        the published MFU figures); ``causal=True`` counts the half a causal kernel computes. The MTP
        depths count as Megatron-LM counts them: their blocks as layers, and the shared head once more
        per depth (``vocab x hidden``)."""
        attention = 6.0 * (self.num_layers + self.mtp_depth) * self.attention_core_dim * seq_len
        head_again = self.mtp_depth * self.vocab_size * self.hidden_size
        return 6.0 * (self.active_parameters() + head_again) + (attention / 2 if causal else attention)
