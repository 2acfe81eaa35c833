"""Expert parallelism at the layer level: every ep layout equals the single-process reference.

Each rank of a 4-process gloo pool builds the same full layer (same seed) and the inputs of every
rank; the reference runs each rank's micro-batch separately through an unparallelized copy.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.dist_pool import get_pool, layout
from tests.reference_moe import expert_and_router_grad_errors, reference_step

WORLD = 4
H, F, E, K, TOKENS = 16, 24, 8, 2, 12
ATOL = 1e-5


def _inputs(rank: int, positive: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, TOKENS // 2, H, generator=gen)
    if positive:
        x = x.abs()
    probe = torch.randn(2, TOKENS // 2, H, generator=gen)  # a non-uniform upstream gradient
    return x, probe


def ep_layer_case(
    ep: int,
    dispatcher: str,
    capacity_factor: float | None,
    score_func: str,
    expert_bias: bool,
    one_rank: bool,
    pad_rows: bool,
) -> dict:
    from lightning_moe import parallelize
    from lightning_moe.moe import MoELayer

    dims = layout(ep=ep)
    torch.manual_seed(0)
    layer = MoELayer(
        H,
        F,
        E,
        top_k=K,
        score_func=score_func,
        expert_bias=expert_bias,
        capacity_factor=capacity_factor,
        dispatcher=dispatcher,
        aux_loss_coeff=1e-2,
        z_loss_coeff=1e-3,
    )
    if one_rank:
        # Experts 0 and 1 (both on ep rank 0) win for every positive token.
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[0] = 1.0
            layer.router.weight[1] = 0.9
    if expert_bias:
        with torch.no_grad():
            layer.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))
    reference = copy.deepcopy(layer)
    parallelize(layer, dims, data_parallel="none")
    layer.dispatcher.pad_rows = pad_rows  # padded expert groups (the CPU bf16 default) in fp32

    rank, world = dist.get_rank(), dist.get_world_size()
    x, probe = _inputs(rank, one_rank)
    x.requires_grad_(True)
    y = layer(x)
    (y * probe).sum().backward()

    ep_peers = dist.get_process_group_ranks(dims.ep_group)
    step = reference_step(reference, lambda source: _inputs(source, one_rank), rank, ep_peers, world)
    report = {"out": (y.detach() - step.out).abs().max().item(), "grad_x": (x.grad - step.grad_x).abs().max().item()}

    ep_rank = dims.ep_mesh.get_local_rank()
    report.update(expert_and_router_grad_errors(layer, step, reference, ep_rank, ep))
    if one_rank:
        report["slots_outside_ep_rank0"] = layer.stats["tokens_per_expert"][E // ep :].sum().item()
    if expert_bias:
        # Loads are reduced over every data-parallel rank: the reference saw all micro-batches.
        layer.update_expert_bias()
        reference.update_expert_bias()
        report["bias"] = (layer.router.expert_bias - reference.router.expert_bias).abs().max().item()
    return report


CASES = [
    # ep, dispatcher, capacity_factor, score_func, expert_bias, one_rank, pad_rows
    (2, "alltoall", None, "softmax", False, False, False),
    (4, "alltoall", None, "softmax", False, False, False),
    (2, "allgather", None, "softmax", False, False, False),
    (4, "allgather", None, "softmax", False, False, False),
    (2, "alltoall", 1.0, "softmax", False, False, False),
    (4, "allgather", 1.0, "softmax", False, False, False),
    (4, "alltoall", 1.25, "sigmoid", True, False, False),
    (2, "allgather", None, "sigmoid", True, False, False),
    (4, "alltoall", None, "softmax", False, True, False),
    (4, "allgather", None, "softmax", False, True, False),
    (2, "alltoall", None, "softmax", False, False, True),
    (4, "allgather", 1.0, "softmax", False, False, True),
    (4, "alltoall", None, "softmax", False, True, True),
    # one copy per destination rank: with dropped slots; with ranks that receive no rows, padded
    (4, "alltoall_dedup", 1.25, "sigmoid", True, False, False),
    (4, "alltoall_dedup", None, "softmax", False, True, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("ep,dispatcher,capacity_factor,score_func,expert_bias,one_rank,pad_rows", CASES)
def test_expert_parallel_layer_matches_reference(
    ep, dispatcher, capacity_factor, score_func, expert_bias, one_rank, pad_rows
):
    reports = get_pool(WORLD).run(
        ep_layer_case,
        ep=ep,
        dispatcher=dispatcher,
        capacity_factor=capacity_factor,
        score_func=score_func,
        expert_bias=expert_bias,
        one_rank=one_rank,
        pad_rows=pad_rows,
    )
    for rank, report in enumerate(reports):
        for key in ("out", "grad_x", "w1", "w2", "w3", "router", "bias"):
            if key in report:
                assert report[key] < ATOL, f"rank {rank} {key} differs by {report[key]:.2e}: {report}"
    if one_rank:
        # Every routed slot targets ep rank 0's experts: the other ranks receive zero tokens.
        assert all(report["slots_outside_ep_rank0"] == 0 for report in reports)


def protocol_case() -> list[str]:
    """The class of every dispatcher ``parallelize`` builds on ep4 over 2 nodes, if it meets the protocol."""
    from lightning_moe import parallelize
    from lightning_moe.moe import Dispatcher, MoELayer
    from lightning_moe.moe.ep_dispatcher import ExpertTensorParallelDispatcher

    dims = layout(ep=4, ranks_per_node=2)
    names = []
    for kind in ("alltoall", "alltoall_dedup", "allgather", "hierarchical"):
        torch.manual_seed(0)
        layer = MoELayer(H, F, E, top_k=K, dispatcher=kind)
        parallelize(layer, dims, data_parallel="none")
        wrapped = ExpertTensorParallelDispatcher(layer.dispatcher, dims.tp_group)
        names += [type(d).__name__ for d in (layer.dispatcher, wrapped) if isinstance(d, Dispatcher)]
    return names


@pytest.mark.slow
def test_every_dispatcher_meets_the_protocol():
    names = get_pool(WORLD).run(protocol_case)[0]
    assert names == [
        "AllToAllDispatcher",
        "ExpertTensorParallelDispatcher",
        "PerRankAllToAllDispatcher",
        "ExpertTensorParallelDispatcher",
        "AllGatherDispatcher",
        "ExpertTensorParallelDispatcher",
        "HierarchicalDispatcher",
        "ExpertTensorParallelDispatcher",
    ]


def test_moe_modules_import_no_cycle():
    """No module of lightning_moe/moe imports one that imports it back, at module level or in a function.

    The base module (dispatcher.py) imports no dispatcher built on it; the factory lives with its
    caller, the layer.
    """
    import ast
    from pathlib import Path

    import lightning_moe.moe

    package = Path(lightning_moe.moe.__file__).parent
    imports = {}
    for path in package.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_moe.moe."):
                found.add(node.module.split(".")[2])
        imports[path.stem] = found - {path.stem}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for name in imports.get(todo.pop(), set()) - seen:
                seen.add(name)
                todo.append(name)
        return seen

    assert imports["dispatcher"] == set() and imports["exchange"] == set()
    assert [name for name in imports if name in reachable(name)] == []
