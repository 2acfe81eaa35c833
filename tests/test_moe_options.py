"""The MoELayer options real models need (docs/architecture.md, "The MoE layer") against a naive per-token reference.

``routed_scaling_factor`` (DeepSeek-V3), ``shared_expert_gate`` (Qwen2-MoE), ``router_bias``,
``expert_linear_bias`` and ``activation="gpt_oss"`` (GPT-OSS): outputs and every gradient, on one
device (both expert GEMM paths, padded rows, capacity), under expert parallelism (both dispatchers,
capacity) and under expert tensor parallelism.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_moe.moe import LocalDispatcher, MoELayer
from tests.dist_pool import get_pool, layout
from tests.reference_moe import (
    ATOL,
    FFN,
    E,
    H,
    assert_layer_matches_reference,
    expert_grad_block,
    make_layer,
    reference_step,
)

OPTION_CASES = {
    "deepseek_v3": dict(
        score_func="sigmoid",
        expert_bias=True,
        load_balancing="none",
        num_groups=4,
        group_topk=2,
        shared_expert_hidden_size=20,
        routed_scaling_factor=2.5,
    ),
    "scaling_softmax": dict(routed_scaling_factor=1.7, topk_norm=False),
    "qwen2_moe": dict(topk_norm=False, shared_expert_hidden_size=20, shared_expert_gate=True),
    # A small clamp limit, so that both clamps really cut on these inputs (checked below).
    "gpt_oss": dict(router_bias=True, expert_linear_bias=True, activation="gpt_oss", swiglu_limit=0.4),
    "gpt_oss_default_limit": dict(router_bias=True, expert_linear_bias=True, activation="gpt_oss", top_k=3),
    "gpt_oss_capacity": dict(
        router_bias=True,
        expert_linear_bias=True,
        activation="gpt_oss",
        swiglu_limit=0.4,
        capacity_factor=0.75,
        drop_policy="probs",
    ),
    "qwen2_capacity": dict(
        shared_expert_hidden_size=20, shared_expert_gate=True, capacity_factor=0.6, drop_policy="position"
    ),
    "all_options": dict(
        score_func="sigmoid",
        routed_scaling_factor=2.5,
        shared_expert_hidden_size=20,
        shared_expert_gate=True,
        router_bias=True,
        expert_linear_bias=True,
        activation="gpt_oss",
        swiglu_limit=0.4,
        capacity_factor=1.0,
    ),
}


@pytest.mark.parametrize("path", ["grouped_mm", "padded_rows", "bmm_fallback"])
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options_match_per_token_reference(case, path):
    layer = make_layer(**OPTION_CASES[case])
    layer.dispatcher = LocalDispatcher(E, pad_rows=path == "padded_rows")
    if path == "bmm_fallback":
        layer.experts.use_grouped_mm = False
    want = assert_layer_matches_reference(layer, case)
    for name in want:
        # Every parameter of an option really takes part (a zero gradient would hide a missing term).
        assert want[name].abs().max() > 1e-6, f"{case}: {name} has no gradient"


def test_options_change_the_output_and_clamps_cut():
    """Guards for the reference test: each option changes the layer's output on its inputs."""
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(1))
    base = make_layer()
    for kwargs in (
        dict(routed_scaling_factor=2.5),
        dict(router_bias=True),
        dict(expert_linear_bias=True),
        dict(activation="gpt_oss", swiglu_limit=0.4),
    ):
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
    layer = MoELayer(
        H, FFN, E, shared_expert_hidden_size=8, shared_expert_gate=True, router_bias=True, expert_linear_bias=True
    )
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
    "deepseek_v3": dict(
        score_func="sigmoid",
        expert_bias=True,
        load_balancing="none",
        num_groups=4,
        group_topk=2,
        shared_expert_hidden_size=8,
        routed_scaling_factor=2.5,
    ),
}
EXPERT_PARAMS = ("w1", "w3", "w2", "b1", "b3")


def _micro_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + m)
    return torch.randn(2, 8, H, generator=gen), torch.randn(2, 8, H, generator=gen)


def options_layer_case(
    option: str, tp: int, ep: int, etp: int, dispatcher: str, capacity_factor: float | None, pad_rows: bool
) -> dict:
    """One rank: the parallel layer's output and gradients minus the reference's (max abs)."""
    from lightning_moe import parallelize

    dims = layout(tp=tp, ep=ep, etp=etp)
    # The balancing losses of a micro-batch split over tp normalise by the whole micro-batch; the
    # reference of a capacity case runs each tp shard separately, so those cases leave them out.
    coeff = 0.0 if capacity_factor is not None and tp > 1 else 1.0
    layer = make_layer(
        dispatcher=dispatcher,
        capacity_factor=capacity_factor,
        aux_loss_coeff=1e-2 * coeff,
        z_loss_coeff=1e-3 * coeff,
        **DIST_OPTIONS[option],
    )
    reference = copy.deepcopy(layer)
    # Tokens replicated over tp (a plain tensor): each tp rank dispatches its 1/tp sequence slice.
    parallelize(layer, dims, data_parallel="none", sequence_parallel=False)
    layer.dispatcher.pad_rows = pad_rows

    tp_rank = dims.tp_mesh.get_local_rank()
    mine = dims.dp_ep_mesh.get_local_rank()
    x_full, probe = _micro_batch(mine)
    x = x_full.clone().requires_grad_(True)
    y = layer(x)
    (y * probe).sum().backward()

    # With capacity, each tp rank's slice is routed (and capped) on its own: the reference runs
    # the slices separately. Dropless routing does not depend on the split.
    ep_rank = dims.ep_mesh.get_local_rank()
    ep_peers = [mine - ep_rank + e for e in range(ep)]
    pieces = tp if capacity_factor is not None else 1
    step = reference_step(reference, _micro_batch, mine, ep_peers, dims.dp_ep_mesh.size(), pieces=pieces)
    report = {"out": (y.detach() - step.out).abs().max().item(), "grad_x": (x.grad - step.grad_x).abs().max().item()}
    expert_tp = tp if etp == tp else 1
    for name in EXPERT_PARAMS:
        param = getattr(layer.experts, name)
        if param is None:
            continue
        got = param.grad.to_local()
        want = expert_grad_block(step.experts, name, ep_rank, ep, tp_rank, expert_tp)
        if expert_tp == 1:
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
        options_layer_case,
        option=option,
        tp=tp,
        ep=ep,
        etp=etp,
        dispatcher=dispatcher,
        capacity_factor=capacity_factor,
        pad_rows=pad_rows,
    )
    for rank, report in enumerate(reports):
        for key, value in report.items():
            assert value < ATOL, f"rank {rank}: {key} differs by {value:.2e}: {report}"
    assert any(key.startswith("experts.b1") for key in reports[0]) == (option == "gpt_oss")
