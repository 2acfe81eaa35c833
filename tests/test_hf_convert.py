"""lightning_moe.hf: conversion of the six supported families, HFMoEModule's forward, save_hf, bad input.

Tiny random configs in fp32 (nothing downloaded): the converted model's logits equal the
transformers model's at rel 1e-5, and so do the gradients of one loss step (mapped back to the
transformers layout).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_moe.hf import (  # noqa: E402
    TINY_CONFIGS,
    HFMoEModule,
    build_config,
    convert_moe_blocks,
    hf_state_dict,
)
from lightning_moe.moe import MoELayer  # noqa: E402

FAMILIES = list(TINY_CONFIGS)
REL = 1e-5


def tiny_model(family: str, seed: int = 0, **overrides) -> nn.Module:
    """A tiny transformers model with every router, bias and gate non-trivial (they may init to 0)."""
    kwargs = dict(TINY_CONFIGS[family], **overrides)
    if family == "gpt_oss":
        kwargs.setdefault("swiglu_limit", 0.5)  # so that the clamps really cut
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(build_config(family, **kwargs))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name and "bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("gate.weight", "router.weight", "shared_expert_gate.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "experts" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.1, 0.1, b.numel()))
    return model


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _ids(batch: int = 2, seq: int = 16, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_logits_and_gradients_equal_transformers(family):
    reference = tiny_model(family)
    model = convert_moe_blocks(copy.deepcopy(reference), aux_loss_coeff=0.0)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    expected_layers = 1 if family == "deepseek_v3" else 2  # DeepSeek-V3's first layer is dense
    assert len(layers) == expected_layers and all(m.hf_family == family for m in layers)

    ids = _ids()
    want = reference(ids, labels=ids)
    got = model(ids, labels=ids)
    assert rel_err(got.logits, want.logits) < REL
    # Routing really differs between tokens and both expert choices are used.
    assert all((m.stats["tokens_per_expert"] > 0).sum() >= 4 for m in layers)
    want.loss.backward()
    got.loss.backward()
    grads = hf_state_dict(model, grads=True)
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert set(grads) >= set(ref_grads)
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) < REL, f"{family}: gradient of {name} differs by {rel_err(grads[name], g):.2e}"
    # The weights map back exactly (the inverse of the conversion).
    state = hf_state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


def test_gpt_oss_clamps_cut_and_interleaving_matters():
    model = tiny_model("gpt_oss")
    block = model.model.layers[0].mlp
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(3))
    gate_up = x @ block.experts.gate_up_proj[0] + block.experts.gate_up_proj_bias[0]
    gate, up = gate_up[:, ::2], gate_up[:, 1::2]
    assert (gate > 0.5).any() and (up.abs() > 0.5).any()
    # Mapping gate/up by halves instead of interleaved would not match.
    converted = convert_moe_blocks(copy.deepcopy(model), aux_loss_coeff=0.0)
    ex = converted.model.layers[0].mlp.moe.experts
    assert not torch.equal(ex.w1, block.experts.gate_up_proj[..., : ex.w1.shape[-1]])


@pytest.mark.parametrize("family", FAMILIES)
def test_module_forward_equals_transformers(family):
    """HFMoEModule's own decoder loop (pipeline-splittable, mask-free SDPA) gives the model's logits."""
    reference = tiny_model(family)
    module = HFMoEModule(copy.deepcopy(reference), aux_loss_coeff=0.0)
    assert module.model.config.output_router_logits is False
    ids = _ids(seq=24)  # longer than GPT-OSS's sliding window of 8
    with torch.no_grad():
        want = reference(ids).logits
        assert rel_err(module(ids), want) < REL
        positions = torch.arange(24).expand(2, 24)
        assert rel_err(module(ids, position_ids=positions), want) < REL


def test_module_loss_matches_moegpt_convention_and_aux_loss_enters():
    module = HFMoEModule(tiny_model("qwen3_moe"))
    assert all(
        m.aux_loss_coeff == pytest.approx(module.config.router_aux_loss_coef)
        for m in module.modules()
        if isinstance(m, MoELayer)
    )
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": mask}
    logits = module(ids)
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    expected = (per_token * mask.flatten()).sum() / mask.sum()
    torch.testing.assert_close(module.loss(batch), expected)


def test_save_hf_round_trip_single_process(tmp_path):
    module = HFMoEModule(tiny_model("deepseek_v3"))
    with torch.no_grad():  # change the weights, so that a fresh init would not pass
        for p in module.parameters():
            p.add_(0.01 * torch.randn_like(p))
        for m in module.modules():
            if isinstance(m, MoELayer) and m.router.use_expert_bias:
                m.router.expert_bias.add_(torch.linspace(-0.05, 0.05, m.num_experts))
    module.save_hf(tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "hf").iterdir())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    ids = _ids()
    with torch.no_grad():
        assert rel_err(loaded(ids).logits, module(ids)) < REL
    # And back in: a folder is a valid HFMoEModule source.
    again = HFMoEModule(str(tmp_path / "hf"))
    with torch.no_grad():
        assert rel_err(again(ids), module(ids)) < REL


def test_presets_and_config_mapping_build():
    module = HFMoEModule({"model_type": "qwen3_moe", **TINY_CONFIGS["qwen3_moe"]})
    assert module.family == "qwen3_moe" and module.hparams.model["model_type"] == "qwen3_moe"


# -- bad input ------------------------------------------------------------------------------------


def test_unknown_architecture_is_refused():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(ValueError, match=r"unknown architecture .*model_type='llama'.*supports"):
        HFMoEModule(config)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM .*model_type='llama'.* not a supported"):
        convert_moe_blocks(transformers.AutoModelForCausalLM.from_config(config))
    with pytest.raises(ValueError, match="model_type"):
        HFMoEModule({"hidden_size": 16})


def test_unknown_moe_block_is_named():
    model = tiny_model("qwen3_moe")

    class JambaSparseMoeBlock(nn.Module):  # noqa: N801 - a transformers block class we do not know
        pass

    JambaSparseMoeBlock.__module__ = "transformers.models.jamba.modeling_jamba"
    model.model.layers[0].extra = JambaSparseMoeBlock()
    with pytest.raises(ValueError, match="JambaSparseMoeBlock"):
        convert_moe_blocks(model)


def test_missing_folder_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist: pass a local folder"):
        HFMoEModule(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        HFMoEModule(str(tmp_path / "empty"))


@pytest.mark.parametrize(
    "family,layout,match",
    [
        ("qwen3_moe", dict(tp=4), "num_kv_heads=2 is not divisible by tp=4"),
        ("qwen3_moe", dict(tp=3), "num_heads=4 is not divisible by tp=3"),
        ("qwen3_moe", dict(ep=3), "num_experts 8 is not divisible by ep 3"),
        ("deepseek_v3", dict(pp=4), "num_hidden_layers=2 is not divisible by pp=4"),
        ("gpt_oss", dict(cp=2), "cp=2 is not supported for gpt_oss"),
        ("olmoe", dict(tp=2), "tp=2 is not supported for olmoe"),
        ("mixtral_window", dict(cp=2), "sliding_window=8: the window needs an explicit attention mask"),
        ("qwen3_tied", dict(pp=2), "pp=2 with tie_word_embeddings=True"),
    ],
)
def test_layouts_the_model_cannot_take(family, layout, match):
    if family in ("mixtral_window", "qwen3_tied"):
        overrides = dict(sliding_window=8) if family == "mixtral_window" else dict(tie_word_embeddings=True)
        module = HFMoEModule(tiny_model(family.split("_")[0] + ("_moe" if family == "qwen3_tied" else ""), **overrides))
        with pytest.raises(ValueError, match=match):
            module.check_layout(**layout)
        return
    module = HFMoEModule(tiny_model(family))
    with pytest.raises(ValueError, match=match):
        module.check_layout(**layout)


def test_tokenizer_larger_than_embeddings_is_refused():
    module = HFMoEModule(tiny_model("mixtral"))

    class Data:
        vocab_size = 300

    class Trainer:
        datamodule = Data()
        strategy = None

    module._trainer = Trainer()
    with pytest.raises(ValueError, match="tokenizer has 300 tokens but the model's embeddings hold 256"):
        module.setup("fit")


def test_only_the_hf_package_imports_transformers():
    """The core package must import without the [hf] extra: no module outside lightning_moe/hf names it
    (safetensors is a core dependency: routing traces are safetensors files)."""
    import re
    from pathlib import Path

    import lightning_moe

    root = Path(lightning_moe.__file__).parent
    pattern = re.compile(r"^\s*(from|import)\s+(transformers|tokenizers)\b", re.M)
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "hf" not in p.relative_to(root).parts[:1] and p.name != "text.py" and pattern.search(p.read_text())
    ]
    assert not offenders, offenders
