"""One process: `lightning_moe.optim.Muon` equals torch.optim.Muon on the matrices it owns (each expert's
slice on its own) and torch.optim.AdamW on the rest; bad groups are refused with the fix."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.models import MoEGPT
from lightning_moe.optim import Muon, muon_parameter_groups

HYPER = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
BETAS = (0.8, 0.9)


def _model() -> MoEGPT:
    torch.manual_seed(0)
    moe = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 24, "shared_expert_hidden_size": 16}
    return MoEGPT(hidden_size=32, num_layers=2, num_heads=4, moe=moe)


def test_default_split_puts_matrices_and_expert_stacks_on_muon():
    model = _model()
    names = {id(p): name for name, p in model.named_parameters()}
    muon, decay, no_decay = ([names[id(p)] for p in g["params"]] for g in muon_parameter_groups(model, 0.1))
    assert "layers.0.attention.wq.weight" in muon and "layers.0.feed_forward.experts.w2" in muon
    assert "layers.1.feed_forward.shared_expert.w1.weight" in muon
    assert sorted(decay) == [
        "layers.0.feed_forward.router.weight",
        "layers.1.feed_forward.router.weight",
        "output.weight",
    ]
    assert "tok_embeddings.weight" in no_decay and "norm.weight" in no_decay
    assert len(muon) + len(decay) + len(no_decay) == len(list(model.parameters()))


def test_equals_torch_muon_per_matrix_and_per_expert_and_adamw_elsewhere():
    model = _model()
    ours = Muon(model, betas=BETAS, ns_dtype="bfloat16", **HYPER)  # torch's Newton-Schulz runs in bf16
    stacks = {id(p) for g in ours.param_groups if g["use_muon"] for p in g["params"] if p.ndim == 3}
    assert len(stacks) == 6  # w1, w2, w3 of two layers
    # The reference: every matrix and every expert slice a parameter of its own.
    reference: dict[str, list[torch.Tensor]] = {}
    torch_muon, torch_adamw = [], []
    for group in ours.param_groups:
        for param in group["params"]:
            name = next(n for n, p in model.named_parameters() if p is param)
            pieces = (
                [s.detach().clone().requires_grad_() for s in param]
                if id(param) in stacks
                else [param.detach().clone().requires_grad_()]
            )
            reference[name] = pieces
            (torch_muon if group["use_muon"] else torch_adamw).append(
                {"params": pieces, "weight_decay": group["weight_decay"]}
            )
    muon_ref = torch.optim.Muon(torch_muon, adjust_lr_fn="match_rms_adamw", **HYPER)
    adamw_ref = torch.optim.AdamW(torch_adamw, lr=HYPER["lr"], betas=BETAS)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for name, param in model.named_parameters():
            param.grad = torch.randn(param.shape, generator=gen)
            for piece, grad in zip(reference[name], param.grad if len(reference[name]) > 1 else [param.grad]):
                piece.grad = grad.clone()
        ours.step()
        muon_ref.step()
        adamw_ref.step()
    for name, param in model.named_parameters():
        expected = torch.stack(reference[name]) if len(reference[name]) > 1 else reference[name][0]
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=0, atol=0, msg=name)


def test_explicit_groups_override_the_split_and_bad_ones_are_refused():
    model = _model()
    norm = model.norm.weight
    with pytest.raises(
        ValueError,
        match=r"norm.weight of shape \(32,\), neither a 2-D matrix nor a routed-expert stack.*use_muon=False",
    ):
        Muon(model, param_groups=[{"params": [norm], "use_muon": True}])
    with pytest.raises(ValueError, match=r"param_groups\[0\] has no 'use_muon' key"):
        Muon(model, param_groups=[{"params": [norm]}])
    with pytest.raises(TypeError, match=r"Muon\(self\) in configure_optimizers"):
        Muon(list(model.parameters()))
    # The user's split wins: the output head on Muon, everything else on AdamW with their own lr.
    head = model.output.weight
    rest = [p for p in model.parameters() if p is not head]
    optimizer = Muon(
        model, param_groups=[{"params": [head], "use_muon": True}, {"params": rest, "use_muon": False, "lr": 1e-4}]
    )
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, len(rest)]
    assert optimizer.param_groups[1]["lr"] == 1e-4


def test_unknown_optimizer_name_is_refused_when_the_module_is_built():
    with pytest.raises(ValueError, match=r"optimizer='sgd' must be one of \('adamw', 'muon'\) \(model.optimizer=muon"):
        MoEGPT(hidden_size=32, num_layers=1, num_heads=4, optimizer="sgd")


def test_planner_adds_muon_bytes_and_newton_schulz_time_when_the_model_config_asks_for_muon():
    from lightning_moe.planner.candidate import Layout
    from lightning_moe.planner.cluster import Cluster
    from lightning_moe.planner.model_shape import ModelShape
    from lightning_moe.planner.muon import muon_comm_bytes, newton_schulz_seconds
    from lightning_moe.planner.step_time import estimate

    config = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "moe": {"num_experts": 4, "ffn_hidden_size": 32}}
    adamw, muon = ModelShape.from_config(config), ModelShape.from_config({**config, "optimizer": "muon"})
    assert (adamw.optimizer, muon.optimizer) == ("adamw", "muon")
    cluster = Cluster(
        name="toy",
        gpus_per_node=8,
        memory_bytes=80e9,
        peak_flops=1e15,
        hbm_bandwidth=3e12,
        intra_node_bandwidth=4e11,
        inter_node_bandwidth=5e10,
    )
    layout = Layout(tp=2, etp=2)
    plain, with_muon = (estimate(shape, layout, cluster, seq_len=32, global_batch_size=8) for shape in (adamw, muon))
    extra = with_muon.comm["tp"]["intra"] - plain.comm["tp"]["intra"]
    assert extra == muon_comm_bytes(muon, layout)["tp"] > 0
    assert with_muon.optimizer_time - plain.optimizer_time == pytest.approx(
        newton_schulz_seconds(muon, layout, cluster)
    )
