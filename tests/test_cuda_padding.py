"""The CUDA grouped-GEMM row alignment, checked on CPU by forcing it (``pad_rows=<rows>``).

On CUDA the dispatchers pad every expert group to a multiple of ``CUDA_GROUP_ALIGN`` rows for
``torch._grouped_mm``, with a buffer whose size is known without reading the counts on the host.
The same code runs on CPU when ``pad_rows`` is an int: outputs and gradients must equal the
unpadded layer.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.moe import MoELayer
from lightning_moe.moe.dispatcher import (
    CUDA_GROUP_ALIGN,
    aligned_total_rows,
    expert_row_alignment,
    gather_expert_rows,
    padded_group_rows,
)

COUNTS = [
    pytest.param([4, 0, 7, 1, 3], id="some_empty"),
    pytest.param([0, 0, 9, 0, 0], id="one_expert"),
    pytest.param([0, 0, 0, 0, 6], id="last_only"),
    pytest.param([16, 32, 1, 17, 15], id="on_and_off_boundaries"),
]


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("align", [8, 16])
def test_aligned_groups_are_multiples_and_sum_to_the_static_total(counts, align):
    counts_t = torch.tensor(counts)
    num_rows = sum(counts)
    total = aligned_total_rows(num_rows, len(counts), align)
    padded, positions = padded_group_rows(counts_t, align, total, num_rows=num_rows)
    assert int(padded.sum()) == total and total % align == 0
    assert all(p % align == 0 and p >= max(c, align) for p, c in zip(padded.tolist(), counts))
    # Every real row lands inside its own group, in order, at distinct rows.
    starts = (torch.cumsum(padded, 0) - padded).tolist()
    expected = [starts[e] + i for e, c in enumerate(counts) for i in range(c)]
    assert positions.tolist() == expected


def test_alignment_choice_by_device_and_dtype():
    x32, x16 = torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16)
    assert expert_row_alignment(x32, None) is None  # CPU fp32: MKL has no per-shape cost
    assert expert_row_alignment(x16, None) == 0  # CPU bf16: coarse sizes
    assert expert_row_alignment(x16, False) is None
    assert expert_row_alignment(x32, True) == 0
    assert expert_row_alignment(x32, 8) == 8  # forced CUDA-style alignment
    assert CUDA_GROUP_ALIGN % 8 == 0  # bf16: 16 bytes / 2 bytes per element


def test_gather_sizes_the_buffer_without_reading_counts():
    rows = torch.randn(10, 4)
    counts = torch.tensor([3, 0, 7])
    source = torch.arange(10)
    # Any host read of counts would show up as .item()/.tolist()/int() on a tensor.
    calls = []
    original = torch.Tensor.__int__
    try:
        torch.Tensor.__int__ = lambda self: calls.append("int") or original(self)  # type: ignore[method-assign]
        expert_input, gemm_counts, positions = gather_expert_rows(rows, source, counts, 16)
    finally:
        torch.Tensor.__int__ = original  # type: ignore[method-assign]
    assert not calls
    assert expert_input.shape[0] == aligned_total_rows(10, 3, 16) == int(gemm_counts.sum())
    torch.testing.assert_close(expert_input[positions], rows)


def _layer_pair(pad_rows: int, **kwargs):
    torch.manual_seed(0)
    ref = MoELayer(32, 48, 6, top_k=2, **kwargs)
    padded = MoELayer(32, 48, 6, top_k=2, **kwargs)
    padded.load_state_dict(ref.state_dict())
    ref.dispatcher.pad_rows = False
    padded.dispatcher.pad_rows = pad_rows
    return ref, padded


@pytest.mark.parametrize(
    "kwargs, use_grouped_mm",
    [
        pytest.param({}, True, id="dropless"),
        pytest.param({}, False, id="dropless_bmm"),
        pytest.param({"capacity_factor": 1.0}, True, id="capacity"),
        pytest.param({"expert_linear_bias": True, "activation": "gpt_oss"}, True, id="biases"),
    ],
)
def test_forced_alignment_equals_the_unpadded_layer(kwargs, use_grouped_mm):
    ref, padded = _layer_pair(CUDA_GROUP_ALIGN, **kwargs)
    ref.experts.use_grouped_mm = padded.experts.use_grouped_mm = use_grouped_mm
    if kwargs.get("expert_linear_bias"):
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if "b" in name.rsplit(".", 1)[-1] and p.dim() <= 2 and "router" not in name:
                    p.normal_()
            padded.load_state_dict(ref.state_dict())
    x = torch.randn(2, 37, 32)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = ref(xa), padded(xb)
    torch.testing.assert_close(yb, ya, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(ya)
    ya.backward(grad)
    yb.backward(grad)
    torch.testing.assert_close(xb.grad, xa.grad, atol=1e-5, rtol=1e-5)
    grads_ref = dict(ref.named_parameters())
    for name, p in padded.named_parameters():
        want = grads_ref[name].grad
        if want is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-5, msg=name)


def test_forced_alignment_in_bf16_autocast():
    ref, padded = _layer_pair(8)
    x = torch.randn(64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yb = ref(x), padded(x)
    # Identical bf16 GEMMs per row (padding only adds rows): equal up to bf16 kernel blocking.
    torch.testing.assert_close(yb.float(), ya.float(), atol=2e-2, rtol=2e-2)


# Expert parallelism: the all-to-all and all-gather dispatchers pad their received rows with the same
# helper; CUDA's alignment forced on the CPU gloo pool (the case function of test_expert_parallel).
EP_CASES = [
    # ep, dispatcher, capacity_factor, score_func, expert_bias, one_rank
    (2, "alltoall", None, "softmax", False, False),
    (4, "allgather", None, "softmax", False, False),
    (4, "alltoall", None, "softmax", False, True),  # ranks that receive no rows at all
]


@pytest.mark.slow
@pytest.mark.parametrize("ep,dispatcher,capacity_factor,score_func,expert_bias,one_rank", EP_CASES)
def test_forced_alignment_under_expert_parallelism(ep, dispatcher, capacity_factor, score_func, expert_bias, one_rank):
    from tests.dist_pool import get_pool
    from tests.test_expert_parallel import ATOL, WORLD, ep_layer_case

    reports = get_pool(WORLD).run(
        ep_layer_case,
        ep=ep,
        dispatcher=dispatcher,
        capacity_factor=capacity_factor,
        score_func=score_func,
        expert_bias=expert_bias,
        one_rank=one_rank,
        pad_rows=CUDA_GROUP_ALIGN,
    )
    for rank, report in enumerate(reports):
        for key in ("out", "grad_x", "w1", "w2", "w3", "router"):
            assert report[key] < ATOL, f"rank {rank} {key} differs by {report[key]:.2e}: {report}"
