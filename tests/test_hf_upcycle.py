"""Sparse upcycling (lightning_moe.hf.upcycle): tiny dense Llama, Mistral, Qwen2 and Qwen3 become MoE
modules whose logits equal the dense model's at init (rel 1e-5, fp32), on one process, under ep2 and
tp2, from a model or a folder, eagerly or built on the meta device; save_hf writes a transformers MoE
folder that loads with the same logits; what cannot keep the function is refused."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.dist_pool import get_pool, layout  # noqa: E402

REL = 1e-5
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
COMMON = dict(
    vocab_size=256,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
DENSE = {
    "llama": dict(COMMON),
    "mistral": dict(COMMON, sliding_window=None),
    "qwen2": dict(COMMON),
    "qwen3": dict(COMMON, head_dim=8),
}
MOE_CLASS = {
    "llama": "MixtralForCausalLM",
    "mistral": "MixtralForCausalLM",
    "qwen2": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3MoeForCausalLM",
}
# (granularity, num_experts, top_k): plain copies, and granular 2, 3 (odd: the down scale is inexact in binary) and 4.
GRANULAR = [(1, 4, 2), (2, 8, 2), (3, 6, 1), (4, 8, 2)]


def dense_model(family: str, **overrides) -> torch.nn.Module:
    """A tiny random dense causal LM whose MLP and norms matter: MLP weights std 0.2 (a wrong expert
    or scale moves the logits far beyond 1e-5), norm weights around 1."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **{**DENSE[family], **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif ".mlp." in name:
                p.normal_(0.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family in DENSE:
        folder = tmp_path_factory.mktemp(f"dense_{family}")
        dense_model(family).save_pretrained(folder)
        out[family] = folder
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    return ((got - want).abs().max() / want.abs().max()).item()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("family", list(DENSE))
@pytest.mark.parametrize("granularity,num_experts,top_k", GRANULAR)
def test_upcycled_logits_equal_dense(family, granularity, num_experts, top_k):
    from lightning_moe.hf import HFMoEModule, upcycle
    from lightning_moe.moe import MoELayer

    dense = dense_model(family)
    module = upcycle(dense, num_experts, top_k, granularity)
    assert isinstance(module, HFMoEModule) and type(module.model).__name__ == MOE_CLASS[family]
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    assert len(layers) == 2
    for layer in layers:
        assert layer.num_experts == num_experts and layer.experts.w1.shape[-1] == 48 // granularity
        assert layer.router.top_k == top_k * granularity
    rel = _rel(module.eval()(TOKENS), _logits(dense))
    assert rel < REL, f"{family} g={granularity}: rel {rel:.2e}"


def test_the_mlp_matters_to_the_logits():
    """The check above has teeth: the dense MLP moves the logits by far more than 1e-5, and a
    granular upcycle without the down-projection scale misses by as much."""
    from lightning_moe.hf import upcycle

    dense = dense_model("qwen3")
    want = _logits(dense)
    module = upcycle(dense, 8, 2, granularity=2).eval()
    with torch.no_grad():
        for layer in module.model.model.layers:
            layer.mlp.experts.w2.div_(2)  # forget the scale g
    assert _rel(module(TOKENS), want) > 1e-2


def test_from_folder_and_meta_build_equal_the_eager_upcycle(folders):
    """A folder is read by from_pretrained (eager) or slice by slice (meta build, as the CLI does): the
    same parameters as upcycling the model object, bit for bit."""
    from lightning_moe.hf import UpcycledHFMoEModule, upcycle
    from lightning_moe.parallel.plans.init import materialize_sharded

    dense = transformers.AutoModelForCausalLM.from_pretrained(folders["qwen2"], local_files_only=True)
    reference = upcycle(dense, 8, 1, granularity=2, seed=3)
    eager = upcycle(str(folders["qwen2"]), 8, 1, granularity=2, seed=3)
    with torch.device("meta"):
        meta = UpcycledHFMoEModule(pretrained=str(folders["qwen2"]), num_experts=8, top_k=1, granularity=2, seed=3)
    assert next(meta.parameters()).is_meta
    materialize_sharded(meta, torch.device("cpu"), meta.initial_value)
    want = dict(itertools.chain(reference.named_parameters(), reference.named_buffers()))
    for module in (eager, meta):
        for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
            assert torch.equal(t, want[name]), name
    assert _rel(meta.eval()(TOKENS), _logits(dense)) < REL
    rebuilt = UpcycledHFMoEModule(**eager.hparams)  # what load_from_checkpoint does: the folder and arguments
    for name, t in rebuilt.named_parameters():
        assert torch.equal(t, want[name]), name


@pytest.mark.parametrize("family,granularity", [("llama", 1), ("mistral", 2), ("qwen2", 2), ("qwen3", 4)])
def test_save_hf_writes_a_transformers_moe_that_loads_with_the_dense_logits(family, granularity, tmp_path):
    from lightning_moe.hf import upcycle

    dense = dense_model(family)
    module = upcycle(dense, 8, 2, granularity)
    module.save_hf(tmp_path / "moe")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe", local_files_only=True)
    assert type(loaded).__name__ == MOE_CLASS[family]
    assert loaded.config.num_experts_per_tok == 2 * granularity
    rel = _rel(_logits(loaded.eval()), _logits(dense))
    assert rel < REL, f"{family}: rel {rel:.2e}"


def test_tied_embeddings_and_sliding_window_are_kept():
    from lightning_moe.hf import upcycle

    dense = dense_model("mistral", sliding_window=4, tie_word_embeddings=True)
    module = upcycle(dense, 4, 1, granularity=2)
    assert module.config.sliding_window == 4 and module.config.tie_word_embeddings
    assert _rel(module.eval()(TOKENS), _logits(dense)) < REL
    dense = dense_model("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    module = upcycle(dense, 4, 1)
    assert module.config.sliding_window == 4
    assert _rel(module.eval()(TOKENS), _logits(dense)) < REL


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_experts=6, top_k=1, granularity=4), "num_experts=6 is not a multiple of granularity=4"),
        (dict(num_experts=10, top_k=1, granularity=5), "intermediate_size=48 is not divisible by granularity=5"),
        (dict(num_experts=8, top_k=3, granularity=4), "top_k=3 at granularity=4 routes top_k*granularity=12"),
        (dict(num_experts=8, top_k=0), "top_k must be a positive integer"),
        (dict(num_experts=8, top_k=1, granularity=2, router_std=0.0), "router_std=0 at granularity=2"),
        (
            dict(num_experts=8, top_k=1, shared_expert_intermediate_size=8),
            "shared_expert_intermediate_size is for Qwen2",
        ),
    ],
)
def test_arguments_that_cannot_keep_the_function_are_refused(kwargs, message):
    from lightning_moe.hf.upcycle import upcycle_config

    config = transformers.AutoConfig.for_model("qwen3", **DENSE["qwen3"])
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        upcycle_config(config, **kwargs)


@pytest.mark.parametrize(
    "family,overrides,message",
    [
        ("llama", dict(attention_bias=True), "attention_bias=True: Mixtral's q/k/v/o projections have no bias"),
        ("llama", dict(mlp_bias=True), "mlp_bias=True: Mixtral's experts"),
        ("mistral", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), "Qwen3-MoE applies one window"),
    ],
)
def test_architectures_that_cannot_keep_the_function_are_refused(family, overrides, message):
    from lightning_moe.hf import upcycle

    config = transformers.AutoConfig.for_model(family, **{**DENSE[family], **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        upcycle(model, 4, 1)


def test_unknown_families_and_folders_are_refused(tmp_path):
    from lightning_moe.hf import upcycle
    from lightning_moe.hf.upcycle import upcycle_config

    with pytest.raises(ValueError, match="dense model_type 'qwen3_moe' is not supported"):
        upcycle_config(transformers.AutoConfig.for_model("qwen3_moe"), 4, 1)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        upcycle(tmp_path, 4, 1)


# -- several processes ------------------------------------------------------------------------------------------


def upcycle_layout_case(folder: str, sizes: dict, meta: bool) -> float:
    from lightning_moe import parallelize
    from lightning_moe.hf import UpcycledHFMoEModule
    from lightning_moe.parallel.plans.init import materialize_sharded

    dense = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    kwargs = dict(pretrained=folder, num_experts=8, top_k=1, granularity=2, seed=0)
    if meta:
        with torch.device("meta"):
            module = UpcycledHFMoEModule(**kwargs)
        parallelize(module, layout(**sizes))
        materialize_sharded(module, torch.device("cpu"), module.initial_value)
    else:
        module = UpcycledHFMoEModule(**kwargs)
        parallelize(module, layout(**sizes))
    module.eval()
    with torch.no_grad():
        got = module(TOKENS)
    return _rel(got, _logits(dense))


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [{"ep": 2}, {"tp": 2}], ids=["ep2", "tp2"])
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])
def test_upcycled_logits_equal_dense_under_layouts(folders, family, sizes):
    pool = get_pool(2)
    for meta in (False, True):
        rels = pool.run(upcycle_layout_case, folder=str(folders[family]), sizes=sizes, meta=meta)
        assert max(rels) < REL, f"{family} {sizes} meta={meta}: {rels}"


CLI_RUN = [
    "logger=none",
    "trainer.max_steps=4",
    "trainer.val_check_interval=null",
    "trainer.limit_val_batches=0",
    "data.seq_len=32",
    "data.global_batch_size=4",
    "data.max_corpus_bytes=100000",
]


@pytest.mark.slow
def test_cli_trains_an_upcycled_model(folders, tmp_path):
    from tests.cli import run_cli

    summary = run_cli(
        tmp_path / "run",
        "model=hf_upcycle",
        f"model.pretrained={folders['qwen3']}",
        "model.num_experts=4",
        "model.top_k=1",
        "model.granularity=2",
        "trainer.devices=1",
        base=CLI_RUN,
    )
    assert len(summary["losses"]) == 4 and all(loss == loss for loss in summary["losses"])
    assert len(summary["expert_load"]) == 2


def test_a_config_mapping_upcycles_a_seeded_random_dense_model(folders):
    """The preset's default (no folder): the same values eagerly and built on the meta device; a
    ``pretrained`` folder replaces the mapping (the CLI's ``model.pretrained=...``)."""
    from lightning_moe.hf import UpcycledHFMoEModule, upcycle
    from lightning_moe.parallel.plans.init import materialize_sharded

    spec = {"model_type": "qwen3", **DENSE["qwen3"]}
    eager = upcycle(spec, 4, 1, granularity=2, seed=1)
    with torch.device("meta"):
        meta = UpcycledHFMoEModule(spec, num_experts=4, top_k=1, granularity=2, seed=1)
    materialize_sharded(meta, torch.device("cpu"), meta.initial_value)
    want = dict(eager.named_parameters())
    for name, t in meta.named_parameters():
        assert torch.equal(t, want[name]), name
    replaced = UpcycledHFMoEModule(spec, num_experts=4, top_k=1, pretrained=str(folders["qwen3"]))
    assert _rel(replaced.eval()(TOKENS), _logits(dense_model("qwen3"))) < REL
