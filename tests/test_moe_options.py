"""The MoELayer options real models need (DESIGN section 8) against a naive per-token reference.

``routed_scaling_factor`` (DeepSeek-V3), ``shared_expert_gate`` (Qwen2-MoE), ``router_bias``,
``expert_linear_bias`` and ``activation="gpt_oss"`` (GPT-OSS): outputs and every gradient, on one
device (both expert GEMM paths, padded rows, capacity), under expert parallelism (both dispatchers,
capacity) and under expert tensor parallelism.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_moe.moe import LocalDispatcher, MoELayer
from tests.conftest import get_pool
from tests.dist_pool import layout

H, FFN, E = 16, 24, 8
ATOL = 1e-5

OPTION_CASES = {
    "deepseek_v3": dict(score_func="sigmoid", expert_bias=True, load_balancing="none", num_groups=4, group_topk=2,
                        shared_expert_hidden_size=20, routed_scaling_factor=2.5),
    "scaling_softmax": dict(routed_scaling_factor=1.7, topk_norm=False),
    "qwen2_moe": dict(topk_norm=False, shared_expert_hidden_size=20, shared_expert_gate=True),
    # A small clamp limit, so that both clamps really cut on these inputs (checked below).
    "gpt_oss": dict(router_bias=True, expert_linear_bias=True, activation="gpt_oss", swiglu_limit=0.4),
    "gpt_oss_default_limit": dict(router_bias=True, expert_linear_bias=True, activation="gpt_oss", top_k=3),
    "gpt_oss_capacity": dict(router_bias=True, expert_linear_bias=True, activation="gpt_oss", swiglu_limit=0.4,
                             capacity_factor=0.75, drop_policy="probs"),
    "qwen2_capacity": dict(shared_expert_hidden_size=20, shared_expert_gate=True, capacity_factor=0.6,
                           drop_policy="position"),
    "all_options": dict(score_func="sigmoid", routed_scaling_factor=2.5, shared_expert_hidden_size=20,
                        shared_expert_gate=True, router_bias=True, expert_linear_bias=True, activation="gpt_oss",
                        swiglu_limit=0.4, capacity_factor=1.0),
}


def randomize_options(layer: MoELayer, seed: int = 7) -> MoELayer:
    """Non-zero biases and gates (they start at zero), and confident routing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.router.weight.mul_(3.0)
        if layer.router.use_expert_bias:
            layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, layer.num_experts))
        for name, p in layer.named_parameters():
            if name in ("router.bias", "experts.b1", "experts.b3", "expert_output_bias.weight", "shared_expert_gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layer


def make_layer(seed: int = 0, num_experts: int = E, **kwargs) -> MoELayer:
    kwargs.setdefault("aux_loss_coeff", 0.0)
    torch.manual_seed(seed)
    return randomize_options(MoELayer(H, FFN, num_experts, **kwargs))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def reference_forward(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Loop over tokens and their kept top-k experts, written from DESIGN sections 3 and 8."""
    router, ex = layer.router, layer.experts
    num_experts, k = layer.num_experts, layer.top_k
    tokens = x.reshape(-1, layer.hidden_size)
    logits = tokens @ router.weight.T
    if router.bias is not None:
        logits = logits + router.bias
    routes = []
    for t in range(tokens.shape[0]):
        scores = torch.softmax(logits[t], -1) if router.score_func == "softmax" else torch.sigmoid(logits[t])
        choice = scores.detach().double().clone()
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
        experts = sorted(range(num_experts), key=lambda e: -choice[e].item())[:k]
        weights = [scores[e] for e in experts]
        if router.topk_norm:
            total = sum(weights)
            weights = [w / total for w in weights]
        weights = [w * router.routed_scaling_factor for w in weights]
        routes.append((experts, weights))
    # Capacity: each expert keeps its best (or first) `capacity` slots.
    kept = {(t, j) for t in range(len(routes)) for j in range(k)}
    if layer.capacity_factor is not None:
        capacity = math.ceil(len(routes) * k / num_experts * layer.capacity_factor - 1e-9)
        kept = set()
        for e in range(num_experts):
            mine = [(t, j) for t in range(len(routes)) for j in range(k) if routes[t][0][j] == e]
            if layer.drop_policy == "probs":
                mine.sort(key=lambda s: (-routes[s[0]][1][s[1]].item(), s[0] * k + s[1]))
            kept.update(mine[:capacity])
    w1, w3, w2 = _full(ex.w1), _full(ex.w3), _full(ex.w2)
    rows = []
    for t, (experts, weights) in enumerate(routes):
        xt = tokens[t]
        row = torch.zeros(layer.hidden_size)
        for j, (e, w) in enumerate(zip(experts, weights)):
            if (t, j) not in kept:
                continue
            gate, up = xt @ w1[e], xt @ w3[e]
            if ex.b1 is not None:
                gate, up = gate + _full(ex.b1)[e], up + _full(ex.b3)[e]
            if ex.activation == "swiglu":
                hidden = F.silu(gate) * up
            else:
                g = torch.clamp(gate, max=ex.limit)
                u = torch.clamp(up, min=-ex.limit, max=ex.limit)
                hidden = (u + 1) * g * torch.sigmoid(ex.alpha * g)
            out = hidden @ w2[e]
            if layer.expert_output_bias is not None:
                out = out + layer.expert_output_bias.weight[e]
            row = row + w * out
        if layer.shared_expert is not None:
            s = layer.shared_expert
            shared = s.w2.weight @ (F.silu(s.w1.weight @ xt) * (s.w3.weight @ xt))
            if layer.shared_expert_gate is not None:
                shared = torch.sigmoid(layer.shared_expert_gate.weight @ xt) * shared
            row = row + shared
        rows.append(row)
    return torch.stack(rows).view(x.shape)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("path", ["grouped_mm", "padded_rows", "bmm_fallback"])
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options_match_per_token_reference(case, path):
    layer = make_layer(**OPTION_CASES[case])
    reference = copy.deepcopy(layer)
    layer.dispatcher = LocalDispatcher(E, pad_rows=path == "padded_rows")
    if path == "bmm_fallback":
        layer.experts.use_grouped_mm = False
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, H, generator=gen)
    probe = torch.randn(2, 12, H, generator=gen)

    x_layer = x.clone().requires_grad_(True)
    y = layer(x_layer)
    (y * probe).sum().backward()
    x_ref = x.clone().requires_grad_(True)
    y_ref = reference_forward(reference, x_ref)
    (y_ref * probe).sum().backward()

    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(x_layer.grad, x_ref.grad, atol=ATOL, rtol=0)
    got, want = _grads(layer), _grads(reference)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=0, msg=f"{case}: gradient of {name}")
        # Every parameter of an option really takes part (a zero gradient would hide a missing term).
        assert want[name].abs().max() > 1e-6, f"{case}: {name} has no gradient"


def test_options_change_the_output_and_clamps_cut():
    """Guards for the reference test: each option changes the layer's output on its inputs."""
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(1))
    base = make_layer()
    for kwargs in (dict(routed_scaling_factor=2.5), dict(router_bias=True), dict(expert_linear_bias=True),
                   dict(activation="gpt_oss", swiglu_limit=0.4)):
        assert not torch.allclose(make_layer(**kwargs)(x), base(x), atol=1e-4), kwargs
    shared = make_layer(shared_expert_hidden_size=20)
    gated = make_layer(shared_expert_hidden_size=20, shared_expert_gate=True)
    assert not torch.allclose(shared(x), gated(x), atol=1e-4)
    # The small limit clamps both the gate (above) and the up projection (both sides).
    layer = make_layer(activation="gpt_oss", swiglu_limit=0.4, expert_linear_bias=True)
    ex = layer.experts
    gate, up = x @ ex.w1[0] + ex.b1[0], x @ ex.w3[0] + ex.b3[0]
    assert (gate > 0.4).any() and (up > 0.4).any() and (up < -0.4).any()


def test_shared_expert_gate_weight_shape_and_bad_options():
    layer = MoELayer(H, FFN, E, shared_expert_hidden_size=8, shared_expert_gate=True, router_bias=True,
                     expert_linear_bias=True)
    assert layer.shared_expert_gate.weight.shape == (1, H)
    assert layer.router.bias.shape == (E,)
    assert layer.experts.b1.shape == (E, FFN) and layer.experts.b3.shape == (E, FFN)
    assert layer.expert_output_bias.weight.shape == (E, H)
    plain = MoELayer(H, FFN, E)
    assert plain.router.bias is None and plain.experts.b1 is None and plain.expert_output_bias is None
    with pytest.raises(ValueError, match="set shared_expert_hidden_size"):
        MoELayer(H, FFN, E, shared_expert_gate=True)
    with pytest.raises(ValueError, match="activation='gelu' is unknown"):
        MoELayer(H, FFN, E, activation="gelu")
    with pytest.raises(ValueError, match="routed_scaling_factor must be > 0"):
        MoELayer(H, FFN, E, routed_scaling_factor=0.0)


def test_options_under_autocast_bf16():
    layer = make_layer(**OPTION_CASES["all_options"])
    x = torch.randn(2, 16, H)
    ref = layer(x).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=0.05)
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())


# -- expert parallelism ------------------------------------------------------------------------------

DIST_OPTIONS = {
    "gpt_oss": dict(router_bias=True, expert_linear_bias=True, activation="gpt_oss", swiglu_limit=0.4),
    "qwen2_moe": dict(topk_norm=False, shared_expert_hidden_size=8, shared_expert_gate=True),
    "deepseek_v3": dict(score_func="sigmoid", expert_bias=True, load_balancing="none", num_groups=4, group_topk=2,
                        shared_expert_hidden_size=8, routed_scaling_factor=2.5),
}
EXPERT_PARAMS = ("w1", "w3", "w2", "b1", "b3")
_FFN_DIM = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1}


def _micro_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + m)
    return torch.randn(2, 8, H, generator=gen), torch.randn(2, 8, H, generator=gen)


def options_layer_case(option: str, tp: int, ep: int, etp: int, dispatcher: str, capacity_factor: float | None,
                       pad_rows: bool) -> dict:
    """One rank: the parallel layer's output and gradients minus the reference's (max abs)."""
    from lightning_moe import parallelize
    from lightning_moe.parallel import expert_parallel

    # Until parallel/expert_parallel.py knows the expert bias names, shard them like the FFN dim.
    for name, dim in _FFN_DIM.items():
        expert_parallel._FFN_DIM.setdefault(name, dim)
    dims = layout(tp=tp, ep=ep, etp=etp)
    # The balancing losses of a micro-batch split over tp normalise by the whole micro-batch; the
    # reference of a capacity case runs each tp shard separately, so those cases leave them out.
    coeff = 0.0 if capacity_factor is not None and tp > 1 else 1.0
    layer = make_layer(dispatcher=dispatcher, capacity_factor=capacity_factor, aux_loss_coeff=1e-2 * coeff,
                       z_loss_coeff=1e-3 * coeff, **DIST_OPTIONS[option])
    reference = copy.deepcopy(layer)
    # Tokens replicated over tp (a plain tensor): each tp rank dispatches its 1/tp sequence slice.
    parallelize(layer, dims.mesh, data_parallel="none", sequence_parallel=False, etp=etp)
    layer.dispatcher.pad_rows = pad_rows

    seq = 8
    tp_rank = dims.tp_mesh.get_local_rank()
    mine = dims.dp_ep_mesh.get_local_rank()
    x_full, probe = _micro_batch(mine)
    x = x_full.clone().requires_grad_(True)
    y = layer(x)
    (y * probe).sum().backward()

    # With capacity, each tp rank's slice is routed (and capped) on its own: the reference runs
    # the slices separately. Dropless routing does not depend on the split.
    pieces = tp if capacity_factor is not None else 1
    cuts = [slice(t * seq // pieces, (t + 1) * seq // pieces) for t in range(pieces)]
    ep_rank = dims.ep_mesh.get_local_rank()
    ep_peers = [mine - ep_rank + e for e in range(ep)]
    expert_reference = copy.deepcopy(reference)
    for m in ep_peers:
        xs, ps = _micro_batch(m)
        for cut in cuts:
            (expert_reference(xs[:, cut]) * ps[:, cut]).sum().backward()
    for m in range(dims.dp_ep_mesh.size()):
        xs, ps = _micro_batch(m)
        xs.requires_grad_(True)
        ys = torch.cat([reference(xs[:, cut]) for cut in cuts], dim=1)
        (ys * ps).sum().backward()
        if m == mine:
            ref_out, ref_grad = ys.detach(), xs.grad
    report = {"out": (y.detach() - ref_out).abs().max().item(), "grad_x": (x.grad - ref_grad).abs().max().item()}
    local = E // ep
    experts = slice(ep_rank * local, (ep_rank + 1) * local)
    for name in EXPERT_PARAMS:
        param = getattr(layer.experts, name)
        if param is None:
            continue
        got = param.grad.to_local()
        want = getattr(expert_reference.experts, name).grad[experts]
        if etp == tp and tp > 1:
            want = want.chunk(tp, _FFN_DIM[name])[tp_rank]
        else:
            dist.all_reduce(got, group=dims.tp_group)
        report[f"experts.{name}"] = (got - want).abs().max().item()
    ref_params = dict(reference.named_parameters())
    for name, param in layer.named_parameters():
        if name.startswith("experts."):
            continue
        got = param.grad.clone()
        dist.all_reduce(got)  # every rank's tokens contribute a part
        report[name] = (got - ref_params[name].grad).abs().max().item()
    return report


DIST_CASES = [
    # option, tp, ep, etp, dispatcher, capacity_factor, pad_rows
    ("gpt_oss", 1, 2, 1, "alltoall", None, False),
    ("gpt_oss", 1, 4, 1, "allgather", None, True),
    ("gpt_oss", 1, 4, 1, "alltoall", 1.0, False),
    ("gpt_oss", 1, 2, 1, "allgather", 0.75, False),
    ("gpt_oss", 2, 2, 2, "alltoall", None, True),
    ("gpt_oss", 2, 2, 2, "allgather", None, False),
    ("gpt_oss", 2, 1, 2, "alltoall", 1.0, False),
    ("qwen2_moe", 1, 4, 1, "alltoall", None, False),
    ("qwen2_moe", 2, 2, 2, "allgather", 1.0, False),
    ("deepseek_v3", 1, 2, 1, "allgather", 1.25, False),
    ("deepseek_v3", 2, 2, 1, "alltoall", None, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("option,tp,ep,etp,dispatcher,capacity_factor,pad_rows", DIST_CASES)
def test_options_under_expert_and_tensor_parallel(option, tp, ep, etp, dispatcher, capacity_factor, pad_rows):
    reports = get_pool(4).run(
        options_layer_case, option=option, tp=tp, ep=ep, etp=etp, dispatcher=dispatcher,
        capacity_factor=capacity_factor, pad_rows=pad_rows,
    )
    for rank, report in enumerate(reports):
        for key, value in report.items():
            assert value < ATOL, f"rank {rank}: {key} differs by {value:.2e}: {report}"
    assert any(key.startswith("experts.b1") for key in reports[0]) == (option == "gpt_oss")
