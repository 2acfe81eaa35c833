"""Swap the sparse-MoE blocks of a transformers causal LM for :class:`~lightning_moe.moe.MoELayer` and back.

Each supported block class has a :class:`Family` entry: the ``MoELayer`` arguments its config
implies, the copy of its weights in (:func:`convert_moe_blocks`) and the names and layouts of its
weights out (:func:`moe_layer_to_hf`, used by ``save_hf``). The mapping is exact: transformers'
fused ``gate_up_proj [E, 2F, H]`` (gate rows first) becomes ``experts.w1/w3 [E, H, F]`` and
``down_proj [E, H, F]`` becomes ``experts.w2 [E, F, H]``; GPT-OSS stores ``gate_up_proj [E, H, 2F]``
with gate and up *interleaved* (even columns gate, odd columns up) and its biases likewise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_moe.hf.families import model_family
from lightning_moe.moe import DispatcherKind, MoEConfig, MoELayer

__all__ = [
    "FAMILIES",
    "HFMoELayer",
    "HFMoETupleLayer",
    "Family",
    "convert_moe_blocks",
    "family_of",
    "hf_state_dict",
    "moe_layer_to_hf",
    "moe_layers",
]


class HFMoELayer(MoELayer):
    """An :class:`MoELayer` that remembers which transformers block it replaced (``hf_family``)."""

    hf_family: str = ""


class HFMoETupleLayer(nn.Module):
    """GPT-OSS's decoder layer unpacks ``(hidden, router_scores)`` from its MLP: this wrapper returns
    ``(moe(x), None)``, so that the ``MoELayer`` itself (``.moe``) returns a tensor like any other
    (tensor-parallel hooks and plans see a plain MoE layer). Its weights map to the block's names."""

    def __init__(self, moe: HFMoELayer) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.moe(x), None


def moe_layers(model: nn.Module) -> dict[str, MoELayer]:
    """``{transformers block name: MoELayer}`` of a converted model (a tuple wrapper's ``.moe`` is
    named after the wrapper, the block it replaced)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            if name.endswith(".moe") and isinstance(model.get_submodule(name[: -len(".moe")]), HFMoETupleLayer):
                name = name[: -len(".moe")]
            out[name] = module
    return out


@dataclass(frozen=True)
class Family:
    """How one transformers sparse-MoE block maps onto ``MoELayer``."""

    name: str  # the transformers model_type
    block_class: str
    layer_kwargs: Callable[[Any, nn.Module], dict[str, Any]]  # (config, block) -> MoELayer kwargs
    router: str  # the block's router attribute ("gate" or "router")
    shared: str | None = None  # the block's shared-expert attribute
    interleaved: bool = False  # GPT-OSS: gate_up_proj [E, H, 2F], gate/up interleaved, with biases
    returns_tuple: bool = False


def _experts_kwargs(block: nn.Module) -> dict[str, Any]:
    ex = block.experts
    return dict(num_experts=ex.num_experts, hidden_size=ex.hidden_dim, ffn_hidden_size=ex.intermediate_dim)


def _check_silu(config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{config.model_type}: hidden_act={act!r} is not supported by MoELayer (SwiGLU needs 'silu')")


def _mixtral(config: Any, block: nn.Module) -> dict[str, Any]:
    _check_silu(config)
    if getattr(config, "router_jitter_noise", 0.0):
        raise ValueError(
            f"mixtral: router_jitter_noise={config.router_jitter_noise} is not supported: set it to 0.0 in the config"
        )
    return dict(**_experts_kwargs(block), top_k=block.gate.top_k, topk_norm=True)


def _norm_topk(config: Any, block: nn.Module) -> dict[str, Any]:
    _check_silu(config)
    return dict(**_experts_kwargs(block), top_k=block.gate.top_k, topk_norm=bool(block.gate.norm_topk_prob))


def _qwen2_moe(config: Any, block: nn.Module) -> dict[str, Any]:
    return dict(
        **_norm_topk(config, block),
        shared_expert_hidden_size=block.shared_expert.gate_proj.out_features,
        shared_expert_gate=True,
    )


def _deepseek_v3(config: Any, block: nn.Module) -> dict[str, Any]:
    _check_silu(config)
    gate = block.gate
    groups = dict(num_groups=gate.num_group, group_topk=gate.topk_group) if gate.num_group > 1 else {}
    return dict(
        **_experts_kwargs(block),
        top_k=gate.top_k,
        score_func="sigmoid",
        topk_norm=bool(gate.norm_topk_prob),
        routed_scaling_factor=float(gate.routed_scaling_factor),
        expert_bias=True,
        load_balancing="none",
        shared_expert_hidden_size=block.shared_experts.gate_proj.out_features,
        **groups,
    )


def _gpt_oss(config: Any, block: nn.Module) -> dict[str, Any]:
    ex = block.experts
    return dict(
        num_experts=ex.num_experts,
        hidden_size=ex.hidden_size,
        ffn_hidden_size=ex.intermediate_size,
        top_k=block.router.top_k,
        topk_norm=True,  # softmax over the top-k logits = renormalised top-k softmax probabilities
        router_bias=True,
        expert_linear_bias=True,
        activation="gpt_oss",
        swiglu_alpha=float(ex.alpha),
        swiglu_limit=float(ex.limit),
    )


FAMILIES: dict[str, Family] = {
    f.block_class: f
    for f in (
        Family("mixtral", "MixtralSparseMoeBlock", _mixtral, "gate"),
        Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", _qwen2_moe, "gate", shared="shared_expert"),
        Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", _norm_topk, "gate"),
        Family("olmoe", "OlmoeSparseMoeBlock", _norm_topk, "gate"),
        Family("deepseek_v3", "DeepseekV3MoE", _deepseek_v3, "gate", shared="shared_experts"),
        Family("gpt_oss", "GptOssMLP", _gpt_oss, "router", interleaved=True, returns_tuple=True),
    )
}
_BY_NAME = {f.name: f for f in FAMILIES.values()}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_BY_NAME)

# Class-name fragments of sparse-MoE blocks: a module matching one that is not in FAMILIES is refused.
_MOE_HINTS = ("SparseMoe", "MoeBlock", "MoE", "Experts")


def family_of(name: str) -> Family:
    """The :class:`Family` of a model_type (``"qwen3_moe"``) or block class name."""
    family = _BY_NAME.get(name) or FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown Hugging Face MoE family {name!r}: supported are {SUPPORTED_MODEL_TYPES}")
    return family


def _unknown_blocks(model: nn.Module) -> list[str]:
    """Class names that look like sparse-MoE parts (``_MOE_HINTS``) outside any known block."""
    inside_known = {id(m) for block in model.modules() if type(block).__name__ in FAMILIES for m in block.modules()}
    return sorted(
        {
            type(m).__name__
            for m in model.modules()
            if id(m) not in inside_known
            and not isinstance(m, MoELayer)
            and type(m).__module__.startswith("transformers")
            and any(h in type(m).__name__ for h in _MOE_HINTS)
        }
    )


def check_supported(model: nn.Module) -> None:
    """Raise a ``ValueError`` naming the architecture and block classes this module cannot convert."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    unknown = _unknown_blocks(model)
    if (model_type is not None and model_type not in _BY_NAME) or unknown:
        blocks = ", ".join(unknown) or "no known sparse-MoE block"
        raise ValueError(
            f"{type(model).__name__} (model_type={model_type!r}, blocks: {blocks}) is not a supported Hugging Face MoE"
            f" architecture: supported model types are {SUPPORTED_MODEL_TYPES} (blocks {tuple(FAMILIES)})"
        )


def convert_moe_blocks(
    model: nn.Module,
    *,
    aux_loss_coeff: float | None = None,
    z_loss_coeff: float = 0.0,
    load_balancing: str | None = None,
    capacity_factor: float | None = None,
    dispatcher: str = DispatcherKind.ALLTOALL_DEDUP.value,
    bias_update_rate: float = 1e-3,
) -> nn.Module:
    """Replace, in place, every transformers sparse-MoE block of ``model`` by an equal ``MoELayer``.

    The new layer sits where the block was (``model.layers.3.mlp``) and holds the block's weights
    (same dtype and device; blocks on the meta device stay unmaterialised). Supported blocks:
    Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and GPT-OSS; anything else raises a
    ``ValueError`` naming the block class.

    Balancing: ``aux_loss_coeff=None`` takes the config's ``router_aux_loss_coef`` (Switch aux loss,
    added through the MoE autoscaler, never by the caller); DeepSeek-V3 uses its aux-loss-free
    expert bias (``e_score_correction_bias``, updated by ``update_expert_bias``) and no aux loss.
    Pass ``aux_loss_coeff=0.0`` for a pure forward equivalence (the transformers model adds no aux
    loss unless ``output_router_logits``).

    Example::

        model = transformers.AutoModelForCausalLM.from_config(config)
        convert_moe_blocks(model)          # model.model.layers[i].mlp is now an MoELayer
    """
    check_supported(model)
    config = model.config
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in FAMILIES]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no sparse-MoE block to convert (already converted?)")
    for name, block in targets:
        family = FAMILIES[type(block).__name__]
        kwargs = family.layer_kwargs(config, block)
        if not model_family(family.name).expert_bias_balancing:
            coeff = (
                aux_loss_coeff if aux_loss_coeff is not None else getattr(config, "router_aux_loss_coef", None) or 0.0
            )
            kwargs.update(aux_loss_coeff=float(coeff), load_balancing=load_balancing or "aux_loss")
        else:
            kwargs.update(aux_loss_coeff=float(aux_loss_coeff or 0.0), load_balancing=load_balancing or "none")
        kwargs.update(
            z_loss_coeff=z_loss_coeff,
            capacity_factor=capacity_factor,
            dispatcher=dispatcher,
            bias_update_rate=bias_update_rate,
        )
        layer = _new_layer(family, kwargs, block)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    # transformers' own router loss would count the balancing twice.
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = False
    return model


def _new_layer(family: Family, kwargs: dict[str, Any], block: nn.Module) -> nn.Module:
    reference = next(iter(block.parameters()))
    with torch.device("meta"):
        layer = HFMoELayer(config=MoEConfig(**kwargs))
    layer.hf_family = family.name
    layer.to(dtype=reference.dtype)
    layer.to_empty(device=reference.device)
    if reference.device.type != "meta":
        with torch.no_grad():
            _copy_in(family, layer, block)
    return HFMoETupleLayer(layer) if family.returns_tuple else layer


@torch.no_grad()
def _copy_in(family: Family, layer: MoELayer, block: nn.Module) -> None:
    router = getattr(block, family.router)
    layer.router.weight.copy_(router.weight)
    ex, mine = block.experts, layer.experts
    if family.interleaved:
        mine.w1.copy_(ex.gate_up_proj[..., ::2])
        mine.w3.copy_(ex.gate_up_proj[..., 1::2])
        mine.w2.copy_(ex.down_proj)
        mine.b1.copy_(ex.gate_up_proj_bias[..., ::2])
        mine.b3.copy_(ex.gate_up_proj_bias[..., 1::2])
        layer.expert_output_bias.weight.copy_(ex.down_proj_bias)
        layer.router.bias.copy_(router.bias)
    else:
        ffn = mine.w1.shape[-1]
        mine.w1.copy_(ex.gate_up_proj[:, :ffn].transpose(1, 2))
        mine.w3.copy_(ex.gate_up_proj[:, ffn:].transpose(1, 2))
        mine.w2.copy_(ex.down_proj.transpose(1, 2))
    if family.shared is not None:
        shared = getattr(block, family.shared)
        layer.shared_expert.w1.weight.copy_(shared.gate_proj.weight)
        layer.shared_expert.w3.weight.copy_(shared.up_proj.weight)
        layer.shared_expert.w2.weight.copy_(shared.down_proj.weight)
    if layer.shared_expert_gate is not None:
        layer.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
    if layer.router.use_expert_bias:
        layer.router.expert_bias.copy_(router.e_score_correction_bias)
        layer.router.expert_load.zero_()


def moe_layer_to_hf(
    layer: MoELayer, family: str | None = None, full: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The transformers weights of one converted layer, keyed relative to the block (``"gate.weight"``).

    ``full`` turns a (possibly sharded) tensor into the whole tensor (default: itself).
    """
    fam = family_of(family or getattr(layer, "hf_family", ""))
    get = full or (lambda t: t)
    out: dict[str, torch.Tensor] = {}
    r = fam.router
    out[f"{r}.weight"] = get(layer.router.weight)
    ex = layer.experts
    w1, w3, w2 = get(ex.w1), get(ex.w3), get(ex.w2)
    if fam.interleaved:
        num_experts, hidden, ffn = w1.shape
        out["experts.gate_up_proj"] = torch.stack([w1, w3], dim=-1).reshape(num_experts, hidden, 2 * ffn)
        b1, b3 = get(ex.b1), get(ex.b3)
        out["experts.gate_up_proj_bias"] = torch.stack([b1, b3], dim=-1).reshape(num_experts, 2 * ffn)
        out["experts.down_proj"] = w2
        out["experts.down_proj_bias"] = get(layer.expert_output_bias.weight)
        out[f"{r}.bias"] = get(layer.router.bias)
    else:
        out["experts.gate_up_proj"] = torch.cat([w1, w3], dim=2).transpose(1, 2)
        out["experts.down_proj"] = w2.transpose(1, 2)
    if fam.shared is not None:
        s = layer.shared_expert
        out[f"{fam.shared}.gate_proj.weight"] = get(s.w1.weight)
        out[f"{fam.shared}.up_proj.weight"] = get(s.w3.weight)
        out[f"{fam.shared}.down_proj.weight"] = get(s.w2.weight)
    if layer.shared_expert_gate is not None:
        out["shared_expert_gate.weight"] = get(layer.shared_expert_gate.weight)
    if layer.router.use_expert_bias:
        out[f"{r}.e_score_correction_bias"] = get(layer.router.expert_bias)
    return {k: v.contiguous() for k, v in out.items()}


def hf_state_dict(
    model: nn.Module, full: Callable[[torch.Tensor], torch.Tensor] | None = None, grads: bool = False
) -> dict[str, torch.Tensor]:
    """The transformers state dict of a converted model (or of its gradients with ``grads=True``).

    Non-MoE entries keep their names; every converted ``MoELayer`` is mapped back with
    :func:`moe_layer_to_hf`. ``full`` gathers sharded tensors (DTensors) into whole ones.
    """
    get = full or (lambda t: t)
    if grads:
        params = dict(model.named_parameters())
        source: dict[str, torch.Tensor] = {n: p.grad for n, p in params.items() if p.grad is not None}
    else:
        source = dict(model.state_dict())
    moe_prefixes = moe_layers(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in source.items():
        if not any(key.startswith(p + ".") for p in moe_prefixes):
            out[key] = get(value)
    for prefix, layer in moe_prefixes.items():
        if grads:
            proxy = _GradView(layer)
            mapped = moe_layer_to_hf(proxy, getattr(layer, "hf_family", ""), get)  # type: ignore[arg-type]
        else:
            mapped = moe_layer_to_hf(layer, getattr(layer, "hf_family", ""), get)
        for key, value in mapped.items():
            if value is not None:
                out[f"{prefix}.{key}"] = value
    return out


class _GradView:
    """Reads a layer's parameters as their gradients (buffers read as zeros), for :func:`hf_state_dict`."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if isinstance(value, nn.Parameter):
            return value.grad if value.grad is not None else torch.zeros_like(value)
        if isinstance(value, torch.Tensor):
            return torch.zeros_like(value)
        if isinstance(value, nn.Module):
            return _GradView(value)
        return value
