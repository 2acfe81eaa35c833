"""GroupedExperts (grouped GEMM and fallback) against a loop over experts; the local dispatcher."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.moe import GroupedExperts, LocalDispatcher, build_dispatcher
from lightning_moe.moe.experts import grouped_mm_available

H, FFN, E = 16, 24, 5


def loop_reference(experts: GroupedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    outs = []
    for e, rows in enumerate(x.split(counts)):
        outs.append((F.silu(rows @ experts.w1[e]) * (rows @ experts.w3[e])) @ experts.w2[e])
    return torch.cat(outs)


PATHS = [pytest.param(True, id="grouped_mm"), pytest.param(False, id="fallback")]
COUNTS = [
    pytest.param([4, 0, 7, 1, 3], id="some_empty"),
    pytest.param([0, 0, 9, 0, 0], id="one_expert"),
    pytest.param([0, 0, 0, 0, 6], id="last_only"),
    pytest.param([2, 2, 2, 2, 2], id="balanced"),
    pytest.param([0, 0, 0, 0, 0], id="no_tokens"),
]


@pytest.mark.parametrize("use_grouped_mm", PATHS)
@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_experts_match_a_loop(use_grouped_mm, counts):
    if use_grouped_mm and not grouped_mm_available(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm is not available in this torch")
    torch.manual_seed(0)
    experts = GroupedExperts(E, H, FFN, use_grouped_mm=use_grouped_mm)
    reference = GroupedExperts(E, H, FFN)
    reference.load_state_dict(experts.state_dict())
    x = torch.randn(sum(counts), H)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)

    y = experts(xa, torch.tensor(counts))
    y_ref = loop_reference(reference, xb, counts)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    # .sum() sends a stride-0 gradient, which _grouped_mm's own backward rejects.
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-5, rtol=0)
    for name in ("w1", "w2", "w3"):
        got, want = getattr(experts, name).grad, getattr(reference, name).grad
        want = torch.zeros_like(got) if want is None else want
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)
        for e, c in enumerate(counts):
            if c == 0:  # experts without tokens get an exact zero gradient, not garbage
                assert torch.equal(got[e], torch.zeros_like(got[e]))


def test_counts_on_any_device_and_int_dtype():
    experts = GroupedExperts(E, H, FFN)
    x = torch.randn(6, H)
    a = experts(x, torch.tensor([1, 2, 0, 3, 0], dtype=torch.int32))
    b = experts(x, torch.tensor([1, 2, 0, 3, 0]))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("use_grouped_mm", PATHS)
def test_autocast_bf16_runs_in_bf16(use_grouped_mm):
    torch.manual_seed(0)
    experts = GroupedExperts(E, H, FFN, use_grouped_mm=use_grouped_mm)
    x = torch.randn(10, H, requires_grad=True)
    counts = torch.tensor([3, 0, 4, 2, 1])
    ref = experts(x, counts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = experts(x, counts)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=0.03, rtol=0.03)
    y.float().sum().backward()
    assert experts.w1.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


# -- the local dispatcher ---------------------------------------------------------------------


def test_local_dispatcher_permutes_by_expert_and_combines():
    gen = torch.Generator().manual_seed(0)
    tokens, k, num_experts = 9, 2, 4
    hidden = torch.randn(tokens, H, generator=gen, requires_grad=True)
    topk_idx = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen, requires_grad=True)
    keep = torch.rand(tokens, k, generator=gen) > 0.3
    dispatcher = LocalDispatcher(num_experts)
    ctx = dispatcher.dispatch(hidden, topk_idx, keep)

    kept_experts = topk_idx[keep]
    assert torch.equal(ctx.tokens_per_local_expert, torch.bincount(kept_experts, minlength=num_experts))
    # Rows are grouped by expert, tokens in order within an expert.
    expected_rows = [
        t for e in range(num_experts) for t in range(tokens) for j in range(k) if keep[t, j] and topk_idx[t, j] == e
    ]
    torch.testing.assert_close(ctx.expert_input, hidden[expected_rows])

    # combine(f(rows)) = sum over kept slots of weight * f(row)
    scale = torch.arange(1.0, ctx.expert_input.shape[0] + 1).unsqueeze(1)
    y = dispatcher.combine(ctx.expert_input * scale, weights, ctx)
    want = torch.zeros(tokens, H)
    row = 0
    for e in range(num_experts):
        for t in range(tokens):
            for j in range(k):
                if keep[t, j] and topk_idx[t, j] == e:
                    row += 1
                    want[t] += weights[t, j] * hidden[t] * row
    torch.testing.assert_close(y, want)
    g = torch.randn(tokens, H, generator=gen)
    got = torch.autograd.grad(y, (hidden, weights), g)
    expected = torch.autograd.grad(want, (hidden, weights), g)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    assert torch.equal(got[1][~keep], torch.zeros_like(got[1][~keep]))


def test_padded_group_rows_bound_padding_and_shapes():
    from lightning_moe.moe.dispatcher import padded_group_rows

    counts = torch.arange(0, 5000)
    padded, positions = padded_group_rows(counts)
    assert padded[0] == 0 and torch.all(padded >= counts)
    assert torch.all(padded - counts < torch.clamp(counts / 16, min=16))
    for octave in range(4, 12):  # few distinct GEMM shapes: 16 steps per power of two, and its top
        in_octave = padded[(counts >= 2**octave) & (counts < 2 ** (octave + 1))]
        assert len(set(in_octave.tolist())) <= 17
    # Real rows keep their order and land inside their own padded group.
    small = torch.tensor([3, 0, 20, 1])
    padded, positions = padded_group_rows(small)
    assert padded.tolist() == [16, 0, 32, 16]
    assert positions.tolist() == [0, 1, 2, *range(16, 36), 48]


def test_local_dispatcher_pads_cpu_low_precision_rows_only():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, H, generator=gen)
    topk_idx = torch.randint(0, 3, (10, 1), generator=gen)
    real = torch.bincount(topk_idx.reshape(-1), minlength=3)
    for dtype, pad_rows, padded in [
        (torch.float32, None, False),
        (torch.bfloat16, None, True),
        (torch.bfloat16, False, False),
        (torch.float32, True, True),
    ]:
        ctx = LocalDispatcher(3, pad_rows=pad_rows).dispatch(hidden.to(dtype), topk_idx, None)
        rows = ctx.expert_input.shape[0]
        assert (rows > 10) == padded and int(ctx.tokens_per_local_expert.sum()) == rows
        assert torch.all(ctx.tokens_per_local_expert >= real)


def test_combine_in_bf16_returns_bf16_close_to_fp32():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, H, generator=gen)
    topk_idx = torch.tensor([[0, 1]] * 6)
    weights = torch.rand(6, 2, generator=gen)
    dispatcher = LocalDispatcher(2)
    ctx = dispatcher.dispatch(hidden.bfloat16(), topk_idx, None)
    y = dispatcher.combine(ctx.expert_input, weights, ctx)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), hidden * weights.sum(1, keepdim=True), atol=0.02, rtol=0.02)


def test_build_dispatcher():
    assert isinstance(build_dispatcher("alltoall", 8), LocalDispatcher)
    assert isinstance(build_dispatcher("allgather", 8, None), LocalDispatcher)
    with pytest.raises(ValueError, match="dispatcher"):
        build_dispatcher("ring", 8)


def test_unaligned_ffn_shard_falls_back_instead_of_failing():
    """An FFN dim of 6 fp32 values (24 bytes, e.g. 24 sharded over etp=4) is not 16-byte aligned."""
    from lightning_moe.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 6)
    counts = torch.tensor([3, 0, 2, 5])
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)
    y = experts(x, counts)
    reference = torch.cat(
        [
            (torch.nn.functional.silu(rows @ experts.w1[e]) * (rows @ experts.w3[e])) @ experts.w2[e]
            for e, rows in enumerate(x.split(counts.tolist()))
        ]
    )
    torch.testing.assert_close(y, reference, atol=1e-5, rtol=1e-5)
    y.sum().backward()
    assert x.grad is not None
