"""MoELayer against a naive per-token reference, for every routing option; expert bias; bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_moe.moe import LocalDispatcher, MoELayer, TopKRouter, update_expert_biases
from tests.reference_moe import ATOL, FFN, E, H, assert_layer_matches_reference, make_layer, reference_forward

ROUTING_CASES = {
    "softmax": dict(),
    "softmax_top1": dict(top_k=1),
    "softmax_no_norm": dict(topk_norm=False),
    "sigmoid": dict(score_func="sigmoid"),
    "sigmoid_no_norm_bias": dict(score_func="sigmoid", topk_norm=False, expert_bias=True, load_balancing="none"),
    "softmax_bias": dict(expert_bias=True, load_balancing="none"),
    # With max as group score, group_topk >= top_k never restricts: one group for both choices does.
    "softmax_groups": dict(num_groups=4, group_topk=1),
    "deepseek_like": dict(
        score_func="sigmoid",
        expert_bias=True,
        load_balancing="none",
        num_groups=4,
        group_topk=2,
        shared_expert_hidden_size=20,
    ),
    "sinkhorn": dict(load_balancing="sinkhorn"),
    "sinkhorn_sigmoid": dict(load_balancing="sinkhorn", score_func="sigmoid", top_k=1),
    "capacity_probs": dict(capacity_factor=1.0, drop_policy="probs"),
    "capacity_position": dict(capacity_factor=0.6, drop_policy="position"),
    "capacity_sigmoid_probs": dict(capacity_factor=0.75, score_func="sigmoid"),
    "shared_expert": dict(shared_expert_hidden_size=20),
    "z_and_seq_aux_zero": dict(load_balancing="seq_aux_loss", z_loss_coeff=0.0),
}


@pytest.mark.parametrize("pad_rows", [False, True], ids=["exact_rows", "padded_rows"])
@pytest.mark.parametrize("case", list(ROUTING_CASES))
def test_layer_matches_per_token_reference(case, pad_rows):
    layer = make_layer(**ROUTING_CASES[case])
    layer.dispatcher = LocalDispatcher(E, pad_rows=pad_rows)
    want = assert_layer_matches_reference(layer, case)
    # The gate weights depend on the router: its gradient must not be trivially zero (unless top-1 normalised).
    if not (layer.top_k == 1 and layer.router.topk_norm):
        assert want["router.weight"].abs().max() > 1e-4


def test_capacity_cases_really_drop_and_groups_really_restrict():
    """Guards for the reference test: these options must change the routing on its inputs."""
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(1))
    layer = make_layer(capacity_factor=0.6, drop_policy="position")
    layer(x)
    assert layer.stats["dropped_fraction"] > 0.1
    free = make_layer().router(x).topk_idx
    grouped = make_layer(num_groups=4, group_topk=1).router(x).topk_idx
    assert not torch.equal(free.sort(1).values, grouped.sort(1).values)
    assert torch.equal(grouped[:, 0] // 2, grouped[:, 1] // 2)  # both choices in one group of 2
    sigmoid = dict(score_func="sigmoid", expert_bias=True, load_balancing="none")
    free = make_layer(**sigmoid).router(x).topk_idx
    grouped = make_layer(**sigmoid, num_groups=4, group_topk=2).router(x).topk_idx
    assert not torch.equal(free.sort(1).values, grouped.sort(1).values)


def test_eval_mode_sinkhorn_routes_by_scores():
    layer = make_layer(load_balancing="sinkhorn").eval()
    plain = make_layer().eval()
    x = torch.randn(20, H)
    with torch.no_grad():
        assert torch.equal(layer.router(x).topk_idx, plain.router(x).topk_idx)
        torch.testing.assert_close(layer(x), reference_forward(layer, x), atol=ATOL, rtol=0)


def test_grouped_experts_fallback_inside_layer():
    layer = make_layer(capacity_factor=1.0)
    layer.experts.use_grouped_mm = False
    x = torch.randn(24, H)
    torch.testing.assert_close(layer(x), reference_forward(layer, x), atol=ATOL, rtol=0)


# -- expert bias -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"score_func": "sigmoid", "shared_expert_hidden_size": 6}, {"capacity_factor": 1.0}],
    ids=["softmax", "sigmoid_shared", "capacity"],
)
def test_float64_layer_passes_gradcheck(kwargs):
    """float64 has no grouped-GEMM kernel: the layer takes the bmm path, and its gradients are exact.

    ``load_balancing="none"``: the aux loss reaches the router's gradient without being part of the
    output, which gradcheck would (rightly) report as a mismatch.
    """
    torch.manual_seed(0)
    layer = MoELayer(4, 6, num_experts=4, top_k=2, load_balancing="none", **kwargs).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))
    names = [name for name, _ in layer.named_parameters()]
    params = tuple(p.detach().requires_grad_() for p in layer.parameters())
    assert torch.autograd.gradcheck(
        lambda *ps: torch.func.functional_call(layer, dict(zip(names, ps)), (x.detach(),)), params
    )
    assert layer(x).dtype == torch.float64


def test_expert_bias_changes_selection_not_gate_weights():
    torch.manual_seed(0)
    router = TopKRouter(H, E, 2, score_func="sigmoid", expert_bias=True)
    x = torch.randn(64, H)
    before = router(x)
    with torch.no_grad():
        router.expert_bias.copy_(torch.linspace(-0.5, 0.5, E))
    after = router(x)
    assert not torch.equal(before.topk_idx, after.topk_idx)
    # Gate weights are the unbiased scores of the chosen experts, normalised.
    raw = torch.sigmoid(x @ router.weight.T).gather(1, after.topk_idx)
    torch.testing.assert_close(after.topk_weights, raw / raw.sum(1, keepdim=True))
    torch.testing.assert_close(after.scores, before.scores)


def test_expert_bias_update_rule_and_accumulation():
    layer = make_layer(score_func="sigmoid", expert_bias=True, load_balancing="none", bias_update_rate=0.01)
    bias0 = layer.router.expert_bias.clone()
    x1, x2 = torch.randn(10, H), torch.randn(2, 7, H)
    layer(x1)
    counts1 = layer.stats["tokens_per_expert"].clone()
    layer(x2)
    counts2 = layer.stats["tokens_per_expert"].clone()
    with torch.no_grad():  # no accumulation without grad (evaluation)
        layer(torch.randn(30, H))
    load = counts1 + counts2
    torch.testing.assert_close(layer.router.expert_load, load)
    assert len(set(load.tolist())) > 1, "degenerate loads make the sign rule untested"
    update_expert_biases(nn.Sequential(nn.Identity(), layer))
    torch.testing.assert_close(layer.router.expert_bias, bias0 + 0.01 * torch.sign(load.mean() - load))
    assert layer.router.expert_load.abs().sum() == 0
    # Without new loads the rule leaves the bias unchanged.
    bias1 = layer.router.expert_bias.clone()
    layer.update_expert_bias()
    torch.testing.assert_close(layer.router.expert_bias, bias1)


def test_expert_bias_steers_load_towards_balance():
    torch.manual_seed(0)
    layer = MoELayer(H, FFN, E, score_func="sigmoid", expert_bias=True, load_balancing="none", bias_update_rate=0.05)
    with torch.no_grad():
        layer.router.weight[0] += 2.0  # expert 0 is hugely over-used
    x = torch.randn(256, H).abs()
    layer(x)
    first = layer.stats["tokens_per_expert"].clone()
    for _ in range(40):
        layer(x)
        layer.update_expert_bias()
    layer(x)
    last = layer.stats["tokens_per_expert"]
    assert last.max() - last.min() < 0.5 * (first.max() - first.min())


def test_update_expert_bias_without_bias_is_noop():
    layer = make_layer()
    layer(torch.randn(5, H))
    layer.update_expert_bias()
    assert not hasattr(layer.router, "expert_bias")


# -- precision ------------------------------------------------------------------------------------


def test_autocast_bf16_keeps_router_fp32_and_tracks_fp32():
    layer = make_layer(aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    x = torch.randn(2, 16, H, requires_grad=True)
    ref = layer(x).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = layer.router(x.reshape(-1, H))
        y = layer(x)
    assert routing.logits.dtype == torch.float32 and routing.topk_weights.dtype == torch.float32
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert layer.stats["aux_loss"].dtype == torch.float32
    torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.05)
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())


def test_pure_bf16_parameters():
    layer = make_layer(score_func="sigmoid", expert_bias=True, load_balancing="none", shared_expert_hidden_size=20)
    ref = layer(torch.ones(4, H)).detach()
    layer = layer.to(torch.bfloat16)
    assert layer.router.expert_bias.dtype == torch.float32  # the bias steps need fp32
    x = torch.ones(4, H, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert layer.router(x).logits.dtype == torch.float32
    torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=0.05)
    y.sum().backward()
    assert x.grad is not None and layer.experts.w1.grad.dtype == torch.bfloat16
    layer.update_expert_bias()


def test_attributes_for_parallelization():
    layer = MoELayer(H, FFN, E, dispatcher="allgather")
    assert layer.dispatcher_kind == "allgather"
    assert type(layer.dispatcher).__name__ == "LocalDispatcher"
    assert layer.sequence_group is None and layer.data_group is None
    assert layer.router.weight.shape == (E, H)
    assert layer.experts.w1.shape == (E, H, FFN) and layer.experts.w3.shape == (E, H, FFN)
    assert layer.experts.w2.shape == (E, FFN, H)


# -- bad input ------------------------------------------------------------------------------------

BAD = [
    (dict(num_experts=4, top_k=5), "top_k"),
    (dict(num_experts=0), "num_experts"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(capacity_factor=-1.0), "capacity_factor"),
    (dict(score_func="relu"), "score_func"),
    (dict(load_balancing="expert_bias"), "load_balancing"),
    (dict(drop_policy="random"), "drop_policy"),
    (dict(dispatcher="nccl"), "dispatcher"),
    (dict(group_topk=2), "group_topk=2 requires num_groups"),
    (dict(num_groups=4), "num_groups=4 requires group_topk"),
    (dict(num_groups=3, group_topk=1), "not divisible by num_groups"),
    (dict(num_groups=4, group_topk=5), "group_topk=5"),
    (dict(num_groups=8, group_topk=1, top_k=2), "raise group_topk"),
    (dict(load_balancing="sinkhorn", expert_bias=True), "pick one"),
    (dict(aux_loss_coeff=-1.0), "aux_loss_coeff"),
]


@pytest.mark.parametrize("kwargs,match", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_raise_value_error(kwargs, match):
    kwargs = {"num_experts": E, **kwargs}
    with pytest.raises(ValueError, match=match):
        MoELayer(H, FFN, **kwargs)


def test_wrong_hidden_size_raises():
    with pytest.raises(ValueError, match="expects inputs"):
        MoELayer(H, FFN, E)(torch.randn(3, H + 1))
