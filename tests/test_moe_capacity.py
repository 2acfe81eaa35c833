"""Capacity: the per-expert limit, which slots each drop policy keeps, and zeros for dropped tokens."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.moe import MoELayer, capacity_keep_mask, expert_capacity

E = 4


def test_expert_capacity_formula():
    assert expert_capacity(100, 8, 2, 1.0) == 25
    assert expert_capacity(100, 8, 2, 1.1) == 28  # ceil(27.5)
    assert expert_capacity(10, 4, 2, 1.2) == 6  # 6.000000000000001 in floats must not become 7
    assert expert_capacity(3, 8, 1, 1.0) == 1


def _routing(tokens: int = 40, k: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=gen)
    logits[:, 0] += 1.5  # expert 0 is over-subscribed
    weights, idx = torch.softmax(logits, -1).topk(k, dim=-1)
    return idx, weights


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_no_expert_exceeds_capacity_and_only_overflow_is_dropped(policy):
    idx, weights = _routing()
    capacity = expert_capacity(40, E, 2, 1.0)
    keep = capacity_keep_mask(idx, weights, E, capacity, policy)
    routed = torch.bincount(idx.flatten(), minlength=E)
    kept = torch.bincount(idx[keep], minlength=E)
    assert routed.max() > capacity, "the test needs an over-subscribed expert"
    assert (kept <= capacity).all()
    torch.testing.assert_close(kept, routed.clamp(max=capacity))


def test_probs_policy_keeps_the_highest_gate_weights():
    idx, weights = _routing()
    capacity = 12
    keep = capacity_keep_mask(idx, weights, E, capacity, "probs")
    for e in range(E):
        mine = idx == e
        if mine.sum() <= capacity:
            assert keep[mine].all()
            continue
        kept_w, dropped_w = weights[mine & keep], weights[mine & ~keep]
        assert len(kept_w) == capacity and kept_w.min() >= dropped_w.max()


def test_position_policy_keeps_the_earliest_tokens():
    idx, weights = _routing()
    capacity = 12
    keep = capacity_keep_mask(idx, weights, E, capacity, "position")
    tokens = torch.arange(idx.shape[0]).unsqueeze(1).expand_as(idx)
    for e in range(E):
        mine = idx == e
        if mine.sum() > capacity:
            assert tokens[mine & keep].max() < tokens[mine & ~keep].min()
            assert torch.equal(tokens[mine & keep], tokens[mine][:capacity])


def test_probs_ties_are_broken_by_position():
    idx = torch.zeros(6, 1, dtype=torch.long)
    keep = capacity_keep_mask(idx, torch.ones(6, 1), 1, 2, "probs")
    assert keep.flatten().tolist() == [True, True, False, False, False, False]


def test_unknown_drop_policy():
    idx, weights = _routing()
    with pytest.raises(ValueError, match="drop_policy"):
        capacity_keep_mask(idx, weights, E, 3, "random")


def test_dropped_tokens_output_zeros():
    torch.manual_seed(0)
    layer = MoELayer(8, 16, E, top_k=1, capacity_factor=0.5, drop_policy="position")
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2, 0] = 5.0  # every token with x[0] > 0 prefers expert 2
    x = torch.randn(16, 8)
    x[:, 0] = 1.0
    x.requires_grad_(True)
    y = layer(x)
    capacity = expert_capacity(16, E, 1, 0.5)  # 2
    assert torch.all(y[:capacity].abs().sum(1) > 0)
    assert torch.equal(y[capacity:], torch.zeros_like(y[capacity:]))
    assert layer.stats["dropped_fraction"].item() == pytest.approx(1 - capacity / 16)
    # Dropped tokens get no gradient through the experts (only through the router).
    y.sum().backward()
    expert_free = MoELayer(8, 16, E, top_k=1, capacity_factor=0.5, drop_policy="position", aux_loss_coeff=0.0)
    expert_free.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    expert_free(x2).sum().backward()
    assert torch.equal(x2.grad[capacity:], torch.zeros_like(x2.grad[capacity:]))
