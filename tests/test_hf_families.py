"""lightning_moe.hf.families: one entry per supported model type, and the code that differs between
families (layout refusals, attention, tensor-parallel plan) follows its entries."""

from __future__ import annotations

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

from lightning_moe.hf import SUPPORTED_MODEL_TYPES, TINY_CONFIGS, HFMoEModule  # noqa: E402
from lightning_moe.hf.families import MODEL_FAMILIES, model_family  # noqa: E402
from lightning_moe.hf.loading import PADDED_SDPA  # noqa: E402


def tiny(model_type: str) -> HFMoEModule:
    return HFMoEModule({"model_type": model_type, **TINY_CONFIGS[model_type]})


def test_every_supported_model_type_has_one_entry():
    assert set(MODEL_FAMILIES) == set(SUPPORTED_MODEL_TYPES) == set(TINY_CONFIGS)
    assert all(model_family(t).model_type == t for t in SUPPORTED_MODEL_TYPES)
    with pytest.raises(ValueError, match="unknown Hugging Face MoE model_type 'jamba'"):
        model_family("jamba")


@pytest.mark.parametrize("model_type", [t for t, f in MODEL_FAMILIES.items() if f.unsupported])
def test_layout_refusals_are_the_registry_reasons(model_type):
    module = tiny(model_type)
    for dim, reason in model_family(model_type).unsupported.items():
        with pytest.raises(ValueError, match=f"{dim}=2 is not supported for {model_type}: ") as info:
            module.check_layout(**{dim: 2})
        assert reason in str(info.value)


def test_a_new_refusal_needs_only_a_registry_entry(monkeypatch):
    module = tiny("qwen3_moe")
    module.check_layout(ep=2)
    entry = dataclasses.replace(MODEL_FAMILIES["qwen3_moe"], unsupported={"ep": "a reason for the test"})
    monkeypatch.setitem(MODEL_FAMILIES, "qwen3_moe", entry)
    with pytest.raises(ValueError, match="ep=2 is not supported for qwen3_moe: a reason for the test; use ep=1"):
        module.check_layout(ep=2)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_attention_and_plan_follow_the_entry(model_type):
    family = model_family(model_type)
    module = tiny(model_type)
    expected_attn = PADDED_SDPA if family.narrow_value_heads else ("sdpa" if family.sdpa else "eager")
    assert module.config._attn_implementation == expected_attn
    plan = module.tensor_parallel_plan()
    layer = "model.model.layers.0.self_attn"
    assert (f"{layer}.kv_a_proj_with_mqa" in plan) == family.shared_rotary_key
    assert (f"{layer}.q_norm" in plan and f"{layer}.k_norm" in plan) == (family.qk_norm == "per_head")
    styles = getattr(plan[layer], "styles", [])
    assert any(type(s).__name__ == "ShardHeadParameter" for s in styles) == family.attention_sinks
