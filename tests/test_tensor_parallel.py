"""Tensor, sequence and expert-tensor parallelism of an MoELayer against the single-process layer.

4 gloo ranks; micro-batch m = dp_ep rank. With sequence parallelism each tp rank holds its
sequence shard of the micro-batch; without it every tp rank holds the whole micro-batch and the
layer keeps only its slice for dispatch (no token crosses the ep network twice).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.dist_pool import get_pool, layout
from tests.reference_moe import expert_grad_block, reference_step

H, F, E, K, SEQ = 16, 24, 8, 2, 8
ATOL = 1e-5


def _micro_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + m)
    return torch.randn(2, SEQ, H, generator=gen), torch.randn(2, SEQ, H, generator=gen)


def tp_layer_case(
    tp: int, ep: int, etp: int, sequence_parallel: bool, dispatcher: str = "alltoall", pad_rows: bool = False
) -> dict:
    from lightning_moe import comm, parallelize
    from lightning_moe.moe import MoELayer

    dims = layout(tp=tp, ep=ep, etp=etp)
    torch.manual_seed(0)
    layer = MoELayer(
        H,
        F,
        E,
        top_k=K,
        dispatcher=dispatcher,
        aux_loss_coeff=1e-2,
        z_loss_coeff=1e-3,
        load_balancing="seq_aux_loss",
        shared_expert_hidden_size=8,
    )
    reference = copy.deepcopy(layer)
    parallelize(layer, dims, data_parallel="none", sequence_parallel=sequence_parallel)
    layer.dispatcher.pad_rows = pad_rows  # padded expert groups (the CPU bf16 default) in fp32

    tp_rank = dims.tp_mesh.get_local_rank()
    shard = slice(tp_rank * SEQ // tp, (tp_rank + 1) * SEQ // tp)
    mine = dims.dp_ep_mesh.get_local_rank()
    x_full, probe_full = _micro_batch(mine)
    x = (x_full[:, shard] if sequence_parallel else x_full).clone().requires_grad_(True)
    probe = probe_full[:, shard] if sequence_parallel else probe_full
    comm.reset()
    if sequence_parallel:
        # Sequence shards reach the layer as a DTensor Shard(seq) over tp; a plain tensor means replicated.
        from torch.distributed.tensor import DTensor, Shard

        y = layer(DTensor.from_local(x, dims.tp_mesh, [Shard(1)], run_check=False))
        assert isinstance(y, DTensor) and y.placements == (Shard(1),)
        y = y.to_local()
    else:
        y = layer(x)
    (y * probe).sum().backward()
    ep_bytes = torch.tensor(float(comm.snapshot().get("ep", {"bytes": 0})["bytes"]))

    ep_rank = dims.ep_mesh.get_local_rank()
    ep_peers = [mine - ep_rank + e for e in range(dims.ep)]
    step = reference_step(reference, _micro_batch, mine, ep_peers, dims.dp_ep_mesh.size())
    ref_out, ref_grad_x = step.out, step.grad_x
    if sequence_parallel:
        ref_out, ref_grad_x = ref_out[:, shard], ref_grad_x[:, shard]
    report = {
        "out": (y.detach() - ref_out).abs().max().item(),
        "grad_x": (x.grad - ref_grad_x).abs().max().item(),
        "ep_bytes": ep_bytes.item(),
    }
    expert_tp = tp if etp == tp else 1
    for name in ("w1", "w3", "w2"):
        got = getattr(layer.experts, name).grad.to_local()
        want = expert_grad_block(step.experts, name, ep_rank, ep, tp_rank, expert_tp)
        if expert_tp == 1:
            # Experts replicated over tp: each tp rank's gradient holds its own tokens only.
            dist.all_reduce(got, group=dims.tp_group)
        report[name] = (got - want).abs().max().item()
    for name in ("router.weight", "shared_expert.w1.weight", "shared_expert.w2.weight"):
        got = dict(layer.named_parameters())[name].grad.clone()
        dist.all_reduce(got)  # every rank's tokens contribute a part
        report[name] = (got - dict(reference.named_parameters())[name].grad).abs().max().item()
    report["aux_loss"] = abs(layer.stats["aux_loss"].item() - _reference_aux(reference, mine))
    return report


def _reference_aux(reference, m: int) -> float:
    xs, _ = _micro_batch(m)
    with torch.no_grad():
        reference(xs)
    return reference.stats["aux_loss"].item()


LAYOUTS = [
    # tp, ep, etp, sequence_parallel
    (2, 1, 2, True),
    (2, 1, 2, False),
    (2, 2, 2, True),
    (2, 2, 1, True),
    (2, 2, 2, False),
    (2, 2, 1, False),
    (4, 1, 4, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,etp,sequence_parallel", LAYOUTS)
def test_moe_layer_under_tp_matches_reference(tp, ep, etp, sequence_parallel):
    reports = get_pool(4).run(tp_layer_case, tp=tp, ep=ep, etp=etp, sequence_parallel=sequence_parallel)
    for rank, report in enumerate(reports):
        for key, value in report.items():
            if key != "ep_bytes":
                assert value < ATOL, f"rank {rank}: {key} differs by {value:.2e}: {report}"


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher,pad_rows", [("allgather", False), ("allgather", True), ("alltoall", True)])
def test_dispatchers_under_expert_tp(dispatcher, pad_rows):
    reports = get_pool(4).run(
        tp_layer_case, tp=2, ep=2, etp=2, sequence_parallel=True, dispatcher=dispatcher, pad_rows=pad_rows
    )
    assert all(value < ATOL for report in reports for key, value in report.items() if key != "ep_bytes"), reports


@pytest.mark.slow
def test_no_token_crosses_the_ep_network_twice():
    """tp=2 without SP dispatches the same token bytes as tp=1 for the same micro-batches."""
    deduplicated = sum(
        r["ep_bytes"] for r in get_pool(4).run(tp_layer_case, tp=2, ep=2, etp=1, sequence_parallel=False)
    )
    # ep=2 x dp=2: ranks 0 and 1 (dp replica 0) process micro-batches 0 and 1, like the tp=2 layout.
    baseline = sum(
        r["ep_bytes"] for r in get_pool(4).run(tp_layer_case, tp=1, ep=2, etp=1, sequence_parallel=False)[:2]
    )
    # The only extra traffic: two more ranks exchange their per-expert counts (E int64, half remote).
    count_exchange = 2 * E * 8 // 2
    assert baseline > 0
    assert deduplicated == baseline + count_exchange


def tp_error_case(kind: str) -> str:
    from torch import nn

    from lightning_moe import parallelize
    from lightning_moe.models import MoEGPT
    from lightning_moe.moe import MoELayer

    dims = layout(tp=4 if kind == "ffn" else 2)
    module = {
        "heads": lambda: MoEGPT(
            hidden_size=48, num_layers=1, num_heads=3, moe={"num_experts": 4, "ffn_hidden_size": 32}
        ),
        "kv_heads": lambda: MoEGPT(
            hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=1, moe={"num_experts": 4, "ffn_hidden_size": 32}
        ),
        "ffn": lambda: MoELayer(16, 6, 4),
        "no_plan": lambda: nn.Sequential(nn.Linear(16, 16), MoELayer(16, 32, 4)),
    }[kind]()
    try:
        parallelize(module, dims, data_parallel="none")
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,message",
    [
        ("heads", r"num_heads=3 is not divisible by tp=2"),
        ("kv_heads", r"num_kv_heads=1 is not divisible by tp=2"),
        ("ffn", r"ffn_hidden_size 6 is not divisible by etp=4"),
        ("no_plan", r"Sequential has no tensor_parallel_plan\(\)"),
    ],
)
def test_tensor_parallel_errors_name_the_fix(kind, message):
    import re

    for text in get_pool(4).run(tp_error_case, kind=kind):
        assert re.search(message, text), text
