"""Data parallel x expert parallel: every parameter's reduced gradient equals the single-process one.

Loss curves alone cannot catch a uniformly mis-scaled gradient (Adam is scale invariant), so this
compares the gradients themselves: each dp x ep rank back-propagates its own micro-batch, FSDP or
DDP reduces, and the full gradients must equal the reference gradient of the mean loss.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.dist_pool import get_pool, layout

ATOL = 2e-6


def _batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (2, 33), generator=gen)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def dp_grad_case(
    ep: int, data_parallel: str, load_balancing: str, clip: float | None = None, cp: int = 1, tp: int = 1
) -> float:
    from contextlib import nullcontext

    from torch.distributed.tensor import DTensor

    from lightning_moe import parallelize
    from lightning_moe.cp import context_parallel_attention
    from lightning_moe.models import MoEGPT
    from lightning_moe.moe import set_aux_loss_scale
    from lightning_moe.parallel.plans.context_parallel import shard_batch_for_context_parallel

    dims = layout(ep=ep, cp=cp, tp=tp)
    torch.manual_seed(0)
    moe = {
        "num_experts": 4,
        "top_k": 2,
        "ffn_hidden_size": 24,
        "load_balancing": load_balancing,
        "aux_loss_coeff": 0.1,
        "z_loss_coeff": 0.01,
    }
    model = MoEGPT(hidden_size=32, num_layers=2, num_heads=4, moe=moe)
    reference = copy.deepcopy(model)
    parallelize(model, dims, data_parallel=data_parallel)

    replicas = dims.dp_ep_mesh.size()
    # As the strategy does: each cp rank holds a partial aux loss, but gradients average over cp.
    set_aux_loss_scale(float(cp))
    batch = _batch(dims.dp_ep_mesh.get_local_rank())
    if cp > 1:
        batch = shard_batch_for_context_parallel(batch, dims)
    with context_parallel_attention(dims.cp_group) if cp > 1 else nullcontext():
        model.loss(batch).backward()
    # The reference: the mean loss over every replica's micro-batch, aux losses averaged alike.
    set_aux_loss_scale(1.0 / replicas)
    for replica in range(replicas):
        (reference.loss(_batch(replica)) / replicas).backward()
    set_aux_loss_scale(1.0)
    worst = 0.0
    if clip is not None:
        from lightning_moe.parallel.runtime.grad_norm import clip_grad_norm_

        total = clip_grad_norm_(model.parameters(), clip)
        ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        assert ref_total > 10 * clip, "the case must actually clip"
        worst = (total - ref_total).abs().item()

    for (name, param), (ref_name, ref_param) in zip(model.named_parameters(), reference.named_parameters()):
        assert name == ref_name
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        worst = max(worst, (grad - ref_param.grad).abs().max().item())
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_reduced_gradients_equal_single_process(ep, data_parallel):
    worst = get_pool(4).run(dp_grad_case, ep=ep, data_parallel=data_parallel, load_balancing="aux_loss")
    assert max(worst) < ATOL, worst


@pytest.mark.slow
def test_seq_aux_loss_gradients_under_dp_ep():
    worst = get_pool(4).run(dp_grad_case, ep=2, data_parallel="fsdp", load_balancing="seq_aux_loss")
    assert max(worst) < ATOL, worst


@pytest.mark.slow
@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_gradient_clipping_across_dense_and_expert_meshes(data_parallel):
    worst = get_pool(4).run(dp_grad_case, ep=2, data_parallel=data_parallel, load_balancing="aux_loss", clip=0.01)
    assert max(worst) < ATOL, worst


@pytest.mark.slow
@pytest.mark.parametrize("cp,ep,tp", [(2, 1, 1), (2, 2, 1), (4, 1, 1), (2, 1, 2)])
@pytest.mark.parametrize("load_balancing", ["aux_loss", "seq_aux_loss"])
def test_context_parallel_gradients_equal_single_process(cp, ep, tp, load_balancing):
    worst = get_pool(4).run(dp_grad_case, ep=ep, data_parallel="fsdp", load_balancing=load_balancing, cp=cp, tp=tp)
    assert max(worst) < ATOL, worst
