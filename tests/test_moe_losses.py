"""Load-balancing losses, z-loss, Sinkhorn, the auto-scaler, and the statistics the layer records."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_moe.moe import (
    MoEAuxLossAutoScaler,
    MoELayer,
    global_aux_loss,
    seq_aux_loss,
    set_aux_loss_scale,
    sinkhorn,
    switch_aux_loss,
    z_loss,
)

H, FFN, E, K = 16, 24, 8, 2


@pytest.fixture(autouse=True)
def _reset_scale():
    yield
    set_aux_loss_scale(1.0)


def explicit_switch(probs: torch.Tensor, topk_idx: torch.Tensor, coeff: float) -> float:
    """coeff * E * sum_i f_i P_i with loops: f_i = slots to i / (T*k), P_i = mean prob of i."""
    tokens, k = topk_idx.shape
    experts = probs.shape[1]
    total = 0.0
    for i in range(experts):
        f = sum(int(topk_idx[t, j] == i) for t in range(tokens) for j in range(k)) / (tokens * k)
        p = sum(probs[t, i].item() for t in range(tokens)) / tokens
        total += f * p
    return coeff * experts * total


def test_aux_loss_equals_coeff_under_uniform_routing():
    tokens = 16
    probs = torch.full((tokens, E), 1.0 / E)
    topk_idx = torch.arange(tokens * K).view(tokens, K) % E  # every expert gets T*k/E slots
    assert switch_aux_loss(probs, topk_idx, 0.01).item() == pytest.approx(0.01, rel=1e-6)
    # Collapsed routing costs E times more.
    collapsed = torch.zeros(tokens, E)
    collapsed[:, 0] = 1.0
    assert switch_aux_loss(collapsed, torch.zeros(tokens, 1, dtype=torch.long), 0.01).item() == pytest.approx(0.01 * E)


def test_switch_aux_loss_matches_formula():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(10, E, generator=gen), -1)
    topk_idx = torch.randint(0, E, (10, K), generator=gen)
    assert switch_aux_loss(probs, topk_idx, 0.1).item() == pytest.approx(
        explicit_switch(probs, topk_idx, 0.1), rel=1e-5
    )


def test_seq_aux_loss_matches_formula():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(3, 7, E, generator=gen), -1)
    topk_idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(21)]).view(3, 7, K)
    want = sum(explicit_switch(probs[b], topk_idx[b], 0.1) for b in range(3)) / 3
    assert seq_aux_loss(probs, topk_idx, 0.1).item() == pytest.approx(want, rel=1e-5)
    # Not the same as the batch-level loss on these inputs.
    assert switch_aux_loss(probs.view(21, E), topk_idx.view(21, K), 0.1).item() != pytest.approx(want, rel=1e-3)


def test_global_aux_loss_matches_formula():
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(6, E, generator=gen), -1)
    global_counts = torch.tensor([10.0, 2, 0, 4, 8, 6, 1, 9])  # 40 slots of 20 tokens, top-2
    want = 0.1 * E * sum((global_counts[i] / 40) * probs[:, i].mean() for i in range(E))
    assert global_aux_loss(probs, global_counts, 20, K, 0.1).item() == pytest.approx(want.item(), rel=1e-5)


def test_z_loss_matches_mean_logsumexp_squared():
    logits = torch.randn(9, E) * 3
    want = 1e-3 * torch.stack([torch.log(torch.exp(row).sum()) ** 2 for row in logits]).mean()
    torch.testing.assert_close(z_loss(logits, 1e-3), want)


def test_sinkhorn_is_doubly_stochastic():
    logits = torch.randn(32, E)
    plan = sinkhorn(logits)
    torch.testing.assert_close(plan.sum(1), torch.full((32,), 1 / 32), rtol=1e-3, atol=0)
    torch.testing.assert_close(plan.sum(0), torch.full((E,), 1 / E), rtol=1e-3, atol=0)
    # A square plan scaled by its size is doubly stochastic.
    square = sinkhorn(torch.randn(E, E)) * E
    torch.testing.assert_close(square.sum(0), torch.ones(E), rtol=1e-3, atol=0)
    torch.testing.assert_close(square.sum(1), torch.ones(E), rtol=1e-3, atol=0)


def test_sinkhorn_balances_a_skewed_router():
    torch.manual_seed(0)
    layer = MoELayer(H, FFN, E, load_balancing="sinkhorn")
    plain = copy.deepcopy(layer)
    plain.router.use_sinkhorn = False
    with torch.no_grad():
        for m in (layer, plain):
            m.router.weight[0] += 1.0
    x = torch.randn(256, H).abs()
    layer(x)
    plain(x)
    balanced, skewed = layer.stats["tokens_per_expert"], plain.stats["tokens_per_expert"]
    assert balanced.max() < 0.6 * skewed.max()


# -- the layer's losses and statistics ------------------------------------------------------------


def _layer(seed: int = 0, **kwargs) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(H, FFN, E, top_k=K, **kwargs)
    with torch.no_grad():
        layer.router.weight.mul_(3.0)
    return layer


def _reference_losses(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux and z loss of the layer's routing of x, recomputed from the formulas."""
    routing = layer.router(x.reshape(-1, H))  # for the chosen experts only
    logits = x.reshape(-1, H) @ layer.router.weight.T
    if layer.router.score_func == "softmax":
        probs = torch.softmax(logits, -1)
    else:  # sigmoid scores normalised per token, as DeepSeek-V3 does
        probs = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)
    if layer.load_balancing == "seq_aux_loss":
        shape = (-1, x.shape[-2])
        aux = seq_aux_loss(probs.view(*shape, E), routing.topk_idx.view(*shape, K), layer.aux_loss_coeff)
    elif layer.load_balancing in ("aux_loss", "global_aux_loss"):
        aux = switch_aux_loss(probs, routing.topk_idx, layer.aux_loss_coeff)
    else:
        aux = torch.zeros(())
    return aux, z_loss(logits, layer.z_loss_coeff)


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_layer_records_losses_and_their_gradients_reach_the_router(balancing, score_func):
    layer = _layer(load_balancing=balancing, score_func=score_func, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    no_loss = _layer(load_balancing=balancing, score_func=score_func, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    x = torch.randn(3, 8, H, generator=torch.Generator().manual_seed(3))
    probe = torch.randn(3, 8, H, generator=torch.Generator().manual_seed(4))

    aux, z = _reference_losses(layer, x)
    (loss_grad,) = torch.autograd.grad(aux + z, layer.router.weight)
    assert loss_grad.abs().max() > 1e-4

    (layer(x) * probe).sum().backward()
    (no_loss(x) * probe).sum().backward()
    torch.testing.assert_close(layer.stats["aux_loss"], aux.detach())
    torch.testing.assert_close(layer.stats["z_loss"], z.detach())
    assert no_loss.stats["aux_loss"] == 0 and no_loss.stats["z_loss"] == 0
    # The task loss alone trained the router on aux + z: the difference is their gradient.
    torch.testing.assert_close(layer.router.weight.grad - no_loss.router.weight.grad, loss_grad, atol=1e-6, rtol=1e-4)


def test_aux_loss_scale_multiplies_the_aux_gradient():
    x = torch.randn(32, H)
    diffs = []
    for scale in (1.0, 3.0):
        set_aux_loss_scale(scale)
        with_loss, without = _layer(aux_loss_coeff=0.1, z_loss_coeff=0.01), _layer(aux_loss_coeff=0.0)
        with_loss(x).sum().backward()
        without(x).sum().backward()
        diffs.append(with_loss.router.weight.grad - without.router.weight.grad)
    assert diffs[0].abs().max() > 1e-4
    torch.testing.assert_close(diffs[1], 3.0 * diffs[0])


def test_auto_scaler_passes_output_and_gives_aux_the_scale():
    out = torch.randn(4, 3, requires_grad=True)
    aux = torch.tensor(0.5, requires_grad=True)
    set_aux_loss_scale(0.25)
    y = MoEAuxLossAutoScaler.apply(out, aux)
    assert torch.equal(y, out)
    y.sum().backward()
    assert torch.equal(out.grad, torch.ones(4, 3))
    assert aux.grad.item() == 0.25
    assert MoEAuxLossAutoScaler.main_loss_backward_scale == 0.25


def test_no_aux_loss_for_none_and_sinkhorn():
    for balancing in ("none", "sinkhorn"):
        layer = _layer(load_balancing=balancing, aux_loss_coeff=0.1)
        y = layer(torch.randn(16, H))
        assert layer.stats["aux_loss"] == 0
        assert y.grad_fn is not None and "AutoScaler" not in type(y.grad_fn).__name__


def test_statistics():
    layer = _layer(capacity_factor=0.5)
    x = torch.randn(20, H)
    layer(x)
    stats = layer.stats
    routing = layer.router(x)
    assert set(stats) == {"tokens_per_expert", "aux_loss", "z_loss", "dropped_fraction", "router_entropy"}
    assert all(not v.requires_grad and v.dtype == torch.float32 for v in stats.values())
    torch.testing.assert_close(
        stats["tokens_per_expert"], torch.bincount(routing.topk_idx.flatten(), minlength=E).float()
    )
    assert stats["tokens_per_expert"].sum() == 20 * K  # counted before dropping
    capacity = 3  # ceil(20 * 2 / 8 * 0.5)
    dropped = (stats["tokens_per_expert"] - capacity).clamp_min(0).sum() / (20 * K)
    torch.testing.assert_close(stats["dropped_fraction"], dropped)
    p = routing.probs
    torch.testing.assert_close(stats["router_entropy"], -(p * p.log()).sum(1).mean())


# -- under a sequence group: 4 ranks share the tokens of one micro-batch ---------------------------


def sequence_group_case(balancing: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4 * world, H, generator=gen)
    probe = torch.randn(2, 4 * world, H, generator=gen)
    layer = _layer(load_balancing=balancing, aux_loss_coeff=0.1, z_loss_coeff=0.01, score_func="sigmoid")
    reference = copy.deepcopy(layer)
    layer.sequence_group = dist.group.WORLD
    layer.data_group = dist.group.WORLD
    mine = slice(4 * rank, 4 * (rank + 1))  # this rank's part of every sequence
    (layer(x[:, mine]) * probe[:, mine]).sum().backward()
    (reference(x) * probe).sum().backward()
    grad = layer.router.weight.grad.clone()
    dist.all_reduce(grad)
    report = {"router_grad": (grad - reference.router.weight.grad).abs().max().item()}
    for key in ("tokens_per_expert", "aux_loss", "z_loss", "router_entropy"):
        report[key] = (layer.stats[key] - reference.stats[key]).abs().max().item()
    report["aux_value"] = reference.stats["aux_loss"].item()
    return report


@pytest.mark.slow
@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_sequence_group_losses_sum_to_the_full_micro_batch(balancing):
    from tests.dist_pool import get_pool

    for rank, report in enumerate(get_pool(4).run(sequence_group_case, balancing=balancing)):
        assert report["aux_value"] > 0
        for key, diff in report.items():
            if key != "aux_value":
                assert diff < 1e-5, f"rank {rank}: {key} differs by {diff:.2e}"
