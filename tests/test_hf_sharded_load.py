"""Pretrained safetensors load sharded: each rank reads only its slices, and the model equals the unsharded one."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("transformers")

from tests.dist_pool import (
    get_pool,  # noqa: E402
    layout,  # noqa: E402
)

QWEN3 = {
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "intermediate_size": 40,
    "moe_intermediate_size": 24,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "head_dim": 8,
    "max_position_embeddings": 64,
}
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from lightning_moe.hf import HFMoEModule

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwen3_tiny")
    HFMoEModule(QWEN3).save_hf(folder)
    return folder


def sharded_load_case(folder: str, ep: int) -> dict:
    from torch.distributed.tensor import DTensor

    from lightning_moe import parallelize
    from lightning_moe.hf import HFMoEModule
    from lightning_moe.parallel.plans.init import materialize_sharded

    reference = HFMoEModule(pretrained=folder)  # transformers' own from_pretrained, whole
    with torch.device("meta"):
        module = HFMoEModule(pretrained=folder)
    parallelize(module, layout(ep=ep))
    materialize_sharded(module, torch.device("cpu"), module.initial_value)
    want = dict(itertools.chain(reference.named_parameters(), reference.named_buffers()))
    mismatches = [
        name
        for name, t in itertools.chain(module.named_parameters(), module.named_buffers())
        if not torch.equal(t.full_tensor() if isinstance(t, DTensor) else t, want[name].detach())
    ]
    with torch.no_grad():
        logits = (module(TOKENS) - reference(TOKENS)).abs().max().item()
    expert_bytes = sum(p.numel() * p.element_size() for n, p in reference.named_parameters() if ".experts." in n)
    folder_state = module._pretrained_shards.folder
    return {
        "mismatches": mismatches,
        "logits": logits,
        "expert_fraction": folder_state.expert_bytes_read / expert_bytes,
    }


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4])
def test_each_rank_reads_its_share_of_the_experts(pretrained, ep):
    """4 ranks: experts split over ep, then FSDP over the remaining dp = 4 / ep: a quarter each."""
    reports = get_pool(4).run(sharded_load_case, folder=str(pretrained), ep=ep)
    for rank, report in enumerate(reports):
        assert not report["mismatches"], f"rank {rank}: {report['mismatches']}"
        assert report["logits"] < 1e-5, report
        assert report["expert_fraction"] == pytest.approx(1 / 4), report  # <= 0.3 at ep 4
    assert sum(r["expert_fraction"] for r in reports) == pytest.approx(1.0)  # every expert byte read once


def test_one_process_meta_build_equals_from_pretrained(pretrained):
    from lightning_moe.hf import HFMoEModule
    from lightning_moe.parallel.plans.init import materialize_sharded

    reference = HFMoEModule(pretrained=pretrained)
    with torch.device("meta"):
        module = HFMoEModule(pretrained=pretrained)
    assert next(module.parameters()).is_meta  # nothing was read at construction
    materialize_sharded(module, torch.device("cpu"), module.initial_value)
    with torch.no_grad():
        torch.testing.assert_close(module(TOKENS), reference(TOKENS), rtol=0.0, atol=0.0)
    assert module.bytes_read == sum(t.numel() * t.element_size() for t in reference.state_dict().values())
