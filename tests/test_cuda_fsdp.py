"""FSDP2 gradient divide factors (``data_parallel.wrap_averaged``) on the branches the strategy uses.

The reduced gradient must be ``sum over the group / divisor``, with ``divisor`` the dense data-parallel
size (not the group's own size). Checked in one process on a 1-rank group (the single-rank branch,
gloo on CPU in CI, NCCL where CUDA exists: the GPU machine's torch 2.11 is the version to pin), and
with NCCL's ``PREMUL_SUM`` reduce-scatter on 2 GPUs where there are 2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

HAS_CUDA = torch.cuda.is_available()


def _reduced_grads(
    kind: str, device: str, divisor: float, world: int = 1, rank: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reduced local grad shard, local unreduced reference grad)`` of a Linear wrapped like the experts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_moe._compat import replicate_module
    from lightning_moe.parallel.plans.data_parallel import wrap_averaged

    mesh = init_device_mesh(device, (world,), mesh_dim_names=("edp",))
    torch.manual_seed(0)
    module = nn.Linear(8, 8, bias=False, device=device)
    reference = nn.Linear(8, 8, bias=False, device=device)
    reference.load_state_dict({"weight": module.weight.detach().clone()})
    wrap_averaged(fully_shard if kind == "fsdp" else replicate_module, module, mesh, divisor, kind)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(device)
    module(x).square().sum().backward()
    reference(x).square().sum().backward()
    grad = module.weight.grad
    grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return grad.detach().cpu(), reference.weight.grad.detach().cpu()


def _single_rank(backend: str, device: str, kind: str) -> None:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        got, local = _reduced_grads(kind, device, divisor=4.0)
    finally:
        dist.destroy_process_group()
    # One rank: the sum over the group is the local gradient, divided once (not twice, not never).
    torch.testing.assert_close(got, local / 4.0, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_single_rank_group_divides_once_gloo(kind):
    _single_rank("gloo", "cpu", kind)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_single_rank_group_divides_once_nccl(kind):
    torch.cuda.set_device(0)
    _single_rank("nccl", "cuda", kind)


def _nccl_worker(rank: int, world: int, init_file: str, kind: str, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        got, local = _reduced_grads(kind, "cuda", divisor=4.0, world=world, rank=rank)
        total = local.cuda()
        dist.all_reduce(total)
        torch.save({"got": got, "want": total.cpu() / 4.0}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="NCCL reduce-scatter needs >= 2 GPUs")
@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_premul_sum_reduce_scatter_nccl(kind, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_nccl_worker, args=(2, str(tmp_path / "init"), kind, str(tmp_path / "out")), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"out.{rank}")
        torch.testing.assert_close(result["got"], result["want"], rtol=1e-5, atol=1e-6)
