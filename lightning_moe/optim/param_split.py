"""Which parameters Muon orthogonalizes and which AdamW updates.

Muon's update is the orthogonalized momentum of a weight *matrix*; it means nothing for a vector, and
for embeddings and the output head (rows looked up or scored one token at a time) AdamW is the
established choice (Moonlight, Kimi K2). Routers and gates pick experts by comparing rows, so they stay
on AdamW as well. Routed experts are stacks ``[num_experts, in, out]`` of independent matrices: each
expert's slice is orthogonalized on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

from lightning_moe.moe import MoELayer
from lightning_moe.moe.experts import GroupedExperts, SharedExpert

__all__ = ["adamw_only_parameters", "expert_stacks", "muon_parameter_groups"]


def expert_stacks(module: nn.Module) -> set[int]:
    """Ids of the routed experts' weight stacks ``[num_experts, in, out]`` in ``module`` (not their
    per-expert biases ``[num_experts, out]``, which are vectors per expert)."""
    return {
        id(param)
        for experts in module.modules()
        if isinstance(experts, GroupedExperts)
        for param in experts.parameters(recurse=False)
        if param.ndim == 3
    }


def _vocabulary_sizes(module: nn.Module) -> set[int]:
    """Row counts of the token embeddings, and the ``vocab_size`` a module declares in its
    hyperparameters or (transformers) its config: a pipeline's last stage has the head but no embedding."""
    sizes = {m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)}
    for sub in module.modules():
        for holder in (getattr(sub, "hparams", None), getattr(sub, "config", None)):
            size = holder.get("vocab_size") if isinstance(holder, Mapping) else getattr(holder, "vocab_size", None)
            if isinstance(size, int):
                sizes.add(size)
    return sizes


def _output_heads(module: nn.Module) -> Iterable[nn.Module]:
    """Linear layers that score the vocabulary."""
    vocab_sizes = _vocabulary_sizes(module)
    return (m for m in module.modules() if isinstance(m, nn.Linear) and m.out_features in vocab_sizes)


def adamw_only_parameters(module: nn.Module) -> set[int]:
    """Ids of the matrices that stay on AdamW although they are 2-D: token embeddings, the output head,
    and every MoE layer's router, gate and expert biases (its shared expert, a dense MLP, is Muon's)."""
    excluded = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    excluded |= {id(p) for m in _output_heads(module) for p in m.parameters()}
    for layer in module.modules():
        if isinstance(layer, MoELayer):
            shared = {id(p) for m in layer.modules() if isinstance(m, SharedExpert) for p in m.parameters()}
            excluded |= {id(p) for p in layer.parameters()} - shared - expert_stacks(layer)
    return excluded


def muon_parameter_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """The default split of ``module``'s trainable parameters, as optimizer groups flagged ``use_muon``.

    Muon: 2-D matrices (attention, dense MLPs, shared experts) and routed-expert stacks, with
    ``weight_decay``. AdamW: everything else, with ``weight_decay`` on matrices (output head, routers)
    and none on vectors (norms, biases) or token embeddings, as ``CausalLMModule``'s AdamW does.

    Example::

        groups = muon_parameter_groups(model, weight_decay=0.1)
        [g["use_muon"] for g in groups]  # [True, False, False]
    """
    stacks, adamw_only = expert_stacks(module), adamw_only_parameters(module)
    embeddings = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    muon, decay, no_decay = [], [], []
    for param in module.parameters():
        if not param.requires_grad:
            continue
        if id(param) in stacks or (param.ndim == 2 and id(param) not in adamw_only):
            muon.append(param)
        elif param.ndim >= 2 and id(param) not in embeddings:
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [
        {"params": muon, "use_muon": True, "weight_decay": weight_decay},
        {"params": decay, "use_muon": False, "weight_decay": weight_decay},
        {"params": no_decay, "use_muon": False, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]
