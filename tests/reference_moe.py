"""The oracles of the MoELayer tests, written from docs/architecture.md's "The MoE layer" without the library's code.

- :func:`reference_forward`: the layer as a loop over tokens and their kept top-k experts, for
  every routing and expert option (sinkhorn, expert bias, groups, capacity, router and expert biases,
  ``routed_scaling_factor``, the GPT-OSS activation, the shared expert and its gate).
- :func:`assert_layer_matches_reference`: a layer's output and every gradient against it.
- :func:`reference_step` and :func:`expert_grad_block`: what the single-process layer gives one
  rank of a parallel layer (tests of expert, tensor and topology-aware parallelism).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.moe import MoELayer

H, FFN, E = 16, 24, 8
ATOL = 1e-5

# The FFN dim of each expert parameter: sharded over tp under expert tensor parallelism.
FFN_DIM = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1}

Route = tuple[list[int], list[torch.Tensor]]  # a token's chosen experts and their gate weights
MicroBatch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # m -> (input, upstream gradient)


def make_layer(seed: int = 0, num_experts: int = E, **kwargs: object) -> MoELayer:
    """``MoELayer(H, FFN, num_experts, **kwargs)`` without aux loss unless asked, confident routing (no
    near-ties between implementations) and non-zero biases and gates (they start at zero)."""
    kwargs.setdefault("aux_loss_coeff", 0.0)
    torch.manual_seed(seed)
    layer = MoELayer(H, FFN, num_experts, **kwargs)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        layer.router.weight.mul_(3.0)
        if layer.router.use_expert_bias:
            layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, num_experts))
        for name, p in layer.named_parameters():
            if name in (
                "router.bias",
                "experts.b1",
                "experts.b3",
                "expert_output_bias.weight",
                "shared_expert_gate.weight",
            ):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layer


def reference_sinkhorn(logits: torch.Tensor, iters: int = 3000) -> torch.Tensor:
    """Alternate row/column normalisation of exp(logits) to marginals 1/T, 1/E (float64)."""
    plan = torch.exp(logits.double() - logits.double().max())
    num_tokens, num_experts = plan.shape
    for _ in range(iters):
        plan = plan / (plan.sum(1, keepdim=True) * num_tokens)
        plan = plan / (plan.sum(0, keepdim=True) * num_experts)
    return plan


def reference_routing(layer: MoELayer, tokens: torch.Tensor) -> list[Route]:
    """Per token: the chosen experts and their (normalised, scaled) gate weights."""
    router, num_experts = layer.router, layer.num_experts
    logits = tokens @ router.weight.T
    if router.bias is not None:
        logits = logits + router.bias
    plan = reference_sinkhorn(logits.detach()) if router.use_sinkhorn and layer.training else None
    routes = []
    for t in range(tokens.shape[0]):
        scores = torch.softmax(logits[t], -1) if router.score_func == "softmax" else torch.sigmoid(logits[t])
        choice = (plan[t] if plan is not None else scores).detach().double().clone()
        if router.use_expert_bias:
            choice += router.expert_bias.double()
        if router.num_groups is not None:
            size = num_experts // router.num_groups
            group_scores = []
            for g in range(router.num_groups):
                members = sorted(choice[g * size : (g + 1) * size].tolist(), reverse=True)
                group_scores.append(sum(members[:2]) if router.score_func == "sigmoid" else members[0])
            best = sorted(range(router.num_groups), key=lambda g: -group_scores[g])[: router.group_topk]
            for g in range(router.num_groups):
                if g not in best:
                    choice[g * size : (g + 1) * size] = float("-inf")
        experts = sorted(range(num_experts), key=lambda e: -choice[e].item())[: router.top_k]
        weights = [scores[e] for e in experts]
        if router.topk_norm:
            total = sum(weights)
            weights = [w / total for w in weights]
        routes.append((experts, [w * router.routed_scaling_factor for w in weights]))
    return routes


def reference_keep(layer: MoELayer, routes: list[Route]) -> set[tuple[int, int]]:
    """The (token, choice) slots each expert keeps under the capacity rule: its best (or first) ones."""
    k = layer.top_k
    slots = [(t, j) for t in range(len(routes)) for j in range(k)]
    if layer.capacity_factor is None:
        return set(slots)
    capacity = math.ceil(len(routes) * k / layer.num_experts * layer.capacity_factor - 1e-9)
    kept = set()
    for e in range(layer.num_experts):
        mine = [(t, j) for t, j in slots if routes[t][0][j] == e]
        if layer.drop_policy == "probs":
            mine.sort(key=lambda s: (-routes[s[0]][1][s[1]].item(), s[0] * k + s[1]))
        kept.update(mine[:capacity])
    return kept


def reference_expert(layer: MoELayer, e: int, xt: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` on one token: SwiGLU, or GPT-OSS's clamped variant, with its biases."""
    ex = layer.experts
    gate, up = xt @ ex.w1[e], xt @ ex.w3[e]
    if ex.b1 is not None:
        gate, up = gate + ex.b1[e], up + ex.b3[e]
    if ex.activation == "swiglu":
        hidden = F.silu(gate) * up
    else:
        g = torch.clamp(gate, max=ex.limit)
        u = torch.clamp(up, min=-ex.limit, max=ex.limit)
        hidden = (u + 1) * g * torch.sigmoid(ex.alpha * g)
    out = hidden @ ex.w2[e]
    if layer.expert_output_bias is not None:
        out = out + layer.expert_output_bias.weight[e]
    return out


def reference_shared(layer: MoELayer, xt: torch.Tensor) -> torch.Tensor:
    """The shared expert on one token, times its sigmoid gate when there is one."""
    s = layer.shared_expert
    shared = s.w2.weight @ (F.silu(s.w1.weight @ xt) * (s.w3.weight @ xt))
    if layer.shared_expert_gate is not None:
        shared = torch.sigmoid(layer.shared_expert_gate.weight @ xt) * shared
    return shared


def reference_forward(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Loop over tokens and their kept top-k experts: ``y_t = sum_j w_j expert_{i_j}(x_t)`` (+ shared)."""
    tokens = x.reshape(-1, layer.hidden_size)
    routes = reference_routing(layer, tokens)
    kept = reference_keep(layer, routes)
    rows = []
    for t, (experts, weights) in enumerate(routes):
        row = torch.zeros(layer.hidden_size)
        for j, (e, w) in enumerate(zip(experts, weights)):
            if (t, j) in kept:
                row = row + w * reference_expert(layer, e, tokens[t])
        if layer.shared_expert is not None:
            row = row + reference_shared(layer, tokens[t])
        rows.append(row)
    return torch.stack(rows).view(x.shape)


def assert_layer_matches_reference(layer: MoELayer, context: str) -> dict[str, torch.Tensor]:
    """``layer`` and the per-token reference of a copy of it, forward and backward on the same 2 x 12
    tokens with a non-uniform upstream gradient: output, input gradient and every parameter gradient
    within ``ATOL``. Returns the reference's parameter gradients."""
    reference = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, layer.hidden_size, generator=gen)
    probe = torch.randn(2, 12, layer.hidden_size, generator=gen)

    x_layer = x.clone().requires_grad_(True)
    y = layer(x_layer)
    (y * probe).sum().backward()
    x_ref = x.clone().requires_grad_(True)
    y_ref = reference_forward(reference, x_ref)
    (y_ref * probe).sum().backward()

    assert y.shape == x.shape
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(x_layer.grad, x_ref.grad, atol=ATOL, rtol=0, msg=f"{context}: gradient of the input")
    got = {name: p.grad for name, p in layer.named_parameters()}
    want = {name: p.grad for name, p in reference.named_parameters()}
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=0, msg=f"{context}: gradient of {name}")
    return want


@dataclass
class ReferenceStep:
    """What the single-process reference gives one rank of a parallel layer for one step."""

    out: torch.Tensor  # the output of this rank's micro-batch
    grad_x: torch.Tensor  # its input gradient
    experts: nn.Module  # a copy that ran only the micro-batches whose tokens reach this rank's experts


def reference_step(
    reference: nn.Module,
    micro_batch: MicroBatch,
    mine: int,
    ep_peers: list[int],
    num_micro_batches: int,
    pieces: int = 1,
) -> ReferenceStep:
    """Every micro-batch of the step through ``reference``, each a separate forward and backward of
    ``(y * probe).sum()``.

    ``reference`` then holds the gradients that the non-expert parameters of all ranks sum to; the
    returned ``experts`` copy ran only ``ep_peers``' micro-batches (this rank's ep group sends it its
    experts' tokens). ``pieces``: each micro-batch's sequence (dim 1) is routed as that many
    separate slices (tp ranks that route, and cap, their own slice).
    """
    experts = copy.deepcopy(reference)

    def slices(seq: int) -> list[slice]:
        return [slice(p * seq // pieces, (p + 1) * seq // pieces) for p in range(pieces)]

    for m in ep_peers:
        xs, ps = micro_batch(m)
        for cut in slices(xs.shape[1]):
            (experts(xs[:, cut]) * ps[:, cut]).sum().backward()
    for m in range(num_micro_batches):
        xs, ps = micro_batch(m)
        xs.requires_grad_(True)
        ys = torch.cat([reference(xs[:, cut]) for cut in slices(xs.shape[1])], dim=1)
        (ys * ps).sum().backward()
        if m == mine:
            out, grad_x = ys.detach(), xs.grad
    return ReferenceStep(out, grad_x, experts)


def expert_grad_block(
    layer: nn.Module, name: str, ep_rank: int, ep: int, tp_rank: int = 0, tp: int = 1
) -> torch.Tensor:
    """The gradient of ``layer.experts.<name>`` that ep rank ``ep_rank`` holds: its block of E/ep experts
    and, with expert tensor parallelism over ``tp`` ranks, tp rank ``tp_rank``'s FFN shard of it."""
    grad = getattr(layer.experts, name).grad
    local = grad.shape[0] // ep
    block = grad[ep_rank * local : (ep_rank + 1) * local]
    return block.chunk(tp, FFN_DIM[name])[tp_rank] if tp > 1 else block


def expert_and_router_grad_errors(
    layer: nn.Module, step: ReferenceStep, reference: nn.Module, ep_rank: int, ep: int
) -> dict[str, float]:
    """Largest absolute differences from the reference of an ep layer's expert gradients (this rank's
    block, ``w1``/``w2``/``w3``) and of its router gradient summed over all ranks (a collective)."""
    import torch.distributed as dist

    errors = {
        name: (getattr(layer.experts, name).grad.to_local() - expert_grad_block(step.experts, name, ep_rank, ep))
        .abs()
        .max()
        .item()
        for name in ("w1", "w2", "w3")
    }
    # The sum over ranks of the local router gradients equals the reference's over all micro-batches.
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    errors["router"] = (router_grad - reference.router.weight.grad).abs().max().item()
    return errors
