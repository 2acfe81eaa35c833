"""MoEConfig: the settings of an MoELayer, built from its keywords or given whole; ModelShape's MoE defaults."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_moe.moe import MoEConfig, MoELayer
from lightning_moe.moe.config import DEFAULT_NUM_EXPERTS
from lightning_moe.planner import ModelShape
from lightning_moe.planner.model_shape import MOE_FIELDS

H, FFN, E = 8, 12, 4
OPTIONS = dict(
    top_k=2,
    score_func="sigmoid",
    load_balancing="none",
    expert_bias=True,
    z_loss_coeff=1e-3,
    shared_expert_hidden_size=6,
    capacity_factor=1.5,
    drop_policy="position",
)


def test_keyword_layer_holds_the_equal_config():
    layer = MoELayer(H, FFN, E, **OPTIONS)
    assert layer.config == MoEConfig(H, FFN, E, **OPTIONS)
    assert layer.config == MoEConfig(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, **OPTIONS)
    # The attributes other code reads come from it.
    assert (layer.hidden_size, layer.num_experts, layer.top_k) == (H, E, 2)
    assert (layer.load_balancing, layer.capacity_factor, layer.drop_policy) == ("none", 1.5, "position")
    assert (layer.z_loss_coeff, layer.aux_loss_coeff, layer.dispatcher_kind, layer.routing) == (
        1e-3,
        1e-2,
        "alltoall_dedup",
        "topk",
    )
    assert (layer.dispatch_chunks, layer.dispatch_dtype, layer.num_nodes, layer.max_nodes_per_token) == (
        1,
        None,
        None,
        None,
    )


def test_config_is_frozen_and_replace_checks_again():
    cfg = MoEConfig(H, FFN, E)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.top_k = 1  # type: ignore[misc]
    assert cfg.replace(top_k=1).top_k == 1 and cfg.top_k == 2
    with pytest.raises(ValueError, match=r"top_k=5 exceeds num_experts=4: choose top_k <= num_experts"):
        cfg.replace(top_k=5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(aux_loss_coeff=-1.0), r"aux_loss_coeff and z_loss_coeff must be >= 0, got -1.0 and 0.0"),
        (dict(dispatch_chunks=0), r"dispatch_chunks=0 must be an integer >= 1 \(1: no overlap\)"),
        (dict(score_func="relu"), r"score_func='relu' is unknown: choose one of"),
        (dict(dispatcher="nccl"), r"dispatcher='nccl' is unknown: choose one of"),
        (dict(num_nodes=3), r"num_nodes=3 must be a positive divisor of num_experts=4"),
        (dict(routing="expert_choice"), r"routing='expert_choice' needs capacity_factor"),
    ],
)
def test_bad_field_raises_the_layers_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(H, FFN, E, **kwargs)
    with pytest.raises(ValueError, match=match):  # the same text from the keyword-built layer
        MoELayer(H, FFN, E, **kwargs)


def test_layer_from_config_matches_the_keyword_layer():
    x = torch.randn(2, 5, H)
    torch.manual_seed(0)
    by_keywords = MoELayer(H, FFN, E, **OPTIONS)
    torch.manual_seed(0)
    by_config = MoELayer(config=MoEConfig(H, FFN, E, **OPTIONS))
    assert by_config.config == by_keywords.config
    torch.testing.assert_close(by_config.state_dict(), by_keywords.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(by_config(x), by_keywords(x), rtol=0, atol=0)


def test_config_and_arguments_together_is_a_type_error():
    cfg = MoEConfig(H, FFN, E)
    with pytest.raises(TypeError, match=r"not both .*config.replace"):
        MoELayer(config=cfg, top_k=1)
    with pytest.raises(TypeError, match=r"not both"):
        MoELayer(H, config=cfg)
    with pytest.raises(TypeError, match=r"config must be an MoEConfig, got dict"):
        MoELayer(config={"hidden_size": H})  # type: ignore[arg-type]


def test_model_shape_moe_fields_come_from_moe_config():
    shape = ModelShape()
    for field, name in MOE_FIELDS.items():
        assert name in MoEConfig.__dataclass_fields__, name
        if name not in ("num_experts", "ffn_hidden_size"):  # MoEConfig requires those
            assert getattr(shape, field) == MoEConfig.default(name), field
    assert shape.num_experts == DEFAULT_NUM_EXPERTS
    assert shape.moe_ffn_hidden_size == shape.ffn_hidden_size
    assert shape.moe == MoEConfig(shape.hidden_size, shape.moe_ffn_hidden_size, DEFAULT_NUM_EXPERTS)
    # from_config reads them under MoEConfig's names, and from_moe_config round-trips.
    moe = dict(
        num_experts=6,
        top_k=1,
        ffn_hidden_size=40,
        shared_expert_hidden_size=16,
        dispatcher="allgather",
        load_balancing="seq_aux_loss",
        expert_bias=True,
        capacity_factor=1.25,
        dispatch_chunks=2,
    )
    shape = ModelShape.from_config({"hidden_size": 32, "num_heads": 4, "moe": moe})
    assert shape.moe == MoEConfig(32, **moe)
    again = ModelShape.from_moe_config(shape.moe, ffn_hidden_size=shape.ffn_hidden_size)
    assert again == shape
    with pytest.raises(ValueError, match=r"\['top_k'\] come from the MoEConfig"):
        ModelShape.from_moe_config(shape.moe, top_k=2)


def test_moegpt_layers_share_one_config():
    from lightning_moe.models import MoEGPT

    model = MoEGPT(hidden_size=16, num_layers=4, num_heads=2, moe_layer_freq=2, moe={"num_experts": 4, "top_k": 1})
    first, second = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert first.config is second.config
    assert first.config == MoEConfig(16, 64, 4, top_k=1)  # experts as wide as the dense FFN: 64 * ceil(8 * 16 / 3 / 64)
    # Without MoE layers the moe settings are never read, as before.
    MoEGPT(hidden_size=16, num_layers=2, num_heads=2, moe_layer_freq=0, moe={"top_k": 99})
