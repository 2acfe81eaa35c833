"""Meta-device initialisation: every rank's materialised shards equal one process's eager model, bit for bit."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.dist_pool import get_pool, layout

MODEL = dict(
    hidden_size=32,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    moe={"num_experts": 4, "ffn_hidden_size": 32},
    moe_layer_freq=2,
)


def meta_init_case(sizes: dict[str, int]) -> dict:
    from torch.distributed.tensor import DTensor

    from lightning_moe import parallelize
    from lightning_moe.models import MoEGPT
    from lightning_moe.parallel.plans.init import materialize_sharded

    dims = layout(**sizes)
    torch.manual_seed(7)
    reference = MoEGPT(**MODEL)  # eager, whole, on one process
    torch.manual_seed(7)
    with torch.device("meta"):
        model = MoEGPT(**MODEL)
    parallelize(model, dims)
    materialize_sharded(model, torch.device("cpu"), model.initial_value)
    want = dict(itertools.chain(reference.named_parameters(), reference.named_buffers()))
    mismatches, checked, local_bytes, expert_bytes = [], 0, 0, 0
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        assert not local.is_meta, name
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if not torch.equal(whole, want[name].detach()):
            mismatches.append(name)
        checked += 1
        if ".experts." in name:
            local_bytes += local.numel() * local.element_size()
    full_expert_bytes = sum(t.numel() * t.element_size() for n, t in reference.named_parameters() if ".experts." in n)
    # Pipeline stages hold half the layers: their expert share is counted against those layers only.
    held_layers = {n.split(".")[1] for n, _ in model.named_parameters() if n.startswith("layers.")}
    expert_bytes = sum(
        t.numel() * t.element_size()
        for n, t in reference.named_parameters()
        if ".experts." in n and n.split(".")[1] in held_layers
    )
    return {
        "mismatches": mismatches,
        "checked": checked,
        "expert_fraction": local_bytes / expert_bytes,
        "stage_fraction": expert_bytes / full_expert_bytes,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,sizes,expert_fraction",
    [
        (4, {"ep": 2}, 1 / 4),  # experts over ep 2, FSDP over edp = dp 2
        (4, {"tp": 2}, 1 / 4),  # expert FFN over etp 2, FSDP over dp 2
        (4, {"pp": 2}, 1 / 2),  # each stage's experts, FSDP over dp 2
        (8, {"pp": 2, "tp": 2, "ep": 2}, 1 / 4),  # three dimensions, 8 processes
    ],
    ids=["ep2", "tp2", "pp2", "pp2_tp2_ep2"],
)
def test_materialised_shards_equal_the_eager_single_process_model(world, sizes, expert_fraction):
    for rank, report in enumerate(get_pool(world).run(meta_init_case, sizes=sizes)):
        assert report["checked"] > 10
        assert not report["mismatches"], f"rank {rank}: {report['mismatches']}"
        assert report["expert_fraction"] == pytest.approx(expert_fraction), report
