"""The model's shape: its dimensions, parameter counts and the MFU numerator."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

@dataclass(frozen=True)
class ModelShape:
    """The shape of an :class:`~lightning_moe.models.MoEGPT` (its constructor's keyword arguments).

    Example::

        shape = ModelShape.from_config({"hidden_size": 64, "num_layers": 2, "moe": {"num_experts": 8}})
        shape.total_parameters()
    """

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    ffn_hidden_size: int = 384
    moe_layer_freq: int = 1
    num_experts: int = 8
    top_k: int = 2
    moe_ffn_hidden_size: int = 384
    shared_expert_hidden_size: int | None = None
    dispatcher: str = "alltoall"
    load_balancing: str = "aux_loss"
    expert_bias: bool = False
    capacity_factor: float | None = None
    dispatch_chunks: int = 1
    name: str = "model"

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], name: str | None = None) -> ModelShape:
        """From an MoEGPT config (``conf/model/*.yaml`` or ``MoEGPT.hparams``), with MoEGPT's defaults."""
        if not isinstance(cfg, Mapping):
            raise ValueError(f"model config must be a mapping of MoEGPT arguments, got {type(cfg).__name__}")
        hidden = int(cfg.get("hidden_size", 128))
        heads = int(cfg.get("num_heads", 4))
        kv = cfg.get("num_kv_heads")
        ffn = cfg.get("ffn_hidden_size")
        ffn = 64 * math.ceil(8 * hidden / 3 / 64) if ffn is None else int(ffn)
        moe = dict(cfg.get("moe") or {})
        shared = moe.get("shared_expert_hidden_size")
        cf = moe.get("capacity_factor")
        shape = cls(
            vocab_size=int(cfg.get("vocab_size", 256)),
            hidden_size=hidden,
            num_layers=int(cfg.get("num_layers", 4)),
            num_heads=heads,
            num_kv_heads=heads if kv is None else int(kv),
            ffn_hidden_size=ffn,
            moe_layer_freq=int(cfg.get("moe_layer_freq", 1)),
            num_experts=int(moe.get("num_experts", 8)),
            top_k=int(moe.get("top_k", 2)),
            moe_ffn_hidden_size=int(moe.get("ffn_hidden_size", ffn)),
            shared_expert_hidden_size=None if shared is None else int(shared),
            dispatcher=str(moe.get("dispatcher", "alltoall")),
            load_balancing=str(moe.get("load_balancing", "aux_loss")),
            expert_bias=bool(moe.get("expert_bias", False)),
            capacity_factor=None if cf is None else float(cf),
            dispatch_chunks=int(moe.get("dispatch_chunks", 1)),
            name=name or str(cfg.get("name", "model")),
        )
        shape.check()
        return shape

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

    def is_moe(self, layer: int) -> bool:
        """Same rule as :func:`lightning_moe.models.moe_gpt.is_moe_layer`."""
        return self.moe_layer_freq > 0 and (layer + 1) % self.moe_layer_freq == 0

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
            total += self.expert_parameters() + self.moe_dense_parameters() if self.is_moe(i) else 3 * h * self.ffn_hidden_size
        return total

    def active_parameters(self) -> float:
        """As :func:`lightning_moe.callbacks.throughput.active_parameters`: no embedding, experts x top_k/E."""
        return self._active_parameters

    @cached_property
    def _active_parameters(self) -> float:
        h = self.hidden_size
        total = float(self.vocab_size * h + h)
        for i in range(self.num_layers):
            total += self.attention_parameters()
            if self.is_moe(i):
                total += self.expert_parameters() * self.top_k / self.num_experts + self.moe_dense_parameters()
            else:
                total += 3 * h * self.ffn_hidden_size
        return total

    def model_flops_per_token(self, seq_len: int) -> float:
        """MFU numerator, as :func:`lightning_moe.callbacks.throughput.model_flops_per_token`:
        ``6 x active parameters + 12 x layers x heads x head_dim x seq_len`` (PaLM, appendix B)."""
        return 6.0 * self.active_parameters() + 12.0 * self.num_layers * self.q_dim * seq_len

