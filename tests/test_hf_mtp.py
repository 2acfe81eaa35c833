"""DeepSeek-V3's multi-token prediction (MTP) layers in HFMoEModule: loaded from the published names
(whole and sharded), trained (one process and ep2 agree at rel 1e-5), written back bit for bit by
save_hf and ``checkpoint to-hf``; the loss against an independent computation with transformers'
own layer; bad input refused before work.

The checkpoint is built without lightning-moe: transformers writes a 3-layer model, whose third
layer becomes the MTP layer once the config says 2 layers, and the MTP parts are added to the
safetensors under the published names (``model.layers.2.enorm.weight`` ...).
"""

from __future__ import annotations

import gc
import itertools
import json
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from tests.dist_pool import pool_of  # noqa: E402

REL = 1e-5
SEQ = 16
STEPS = 3
MTP_PARTS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def write_published_checkpoint(path: Path) -> Path:
    """A tiny DeepSeek-V3 folder with one MTP layer, ``model.layers.2``, in the published layout."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from lightning_moe.hf import TINY_CONFIGS, build_config

    config = build_config(
        "deepseek_v3", **dict(TINY_CONFIGS["deepseek_v3"], num_hidden_layers=3, max_position_embeddings=64)
    )
    torch.manual_seed(0)
    three_layers = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms and expert biases away from their initial ones and zeros
        for param in three_layers.parameters():
            param.add_(0.01 * torch.randn_like(param))
        for layer in three_layers.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.01)
    three_layers.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    hidden = config.hidden_size
    tensors["model.layers.2.enorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    tensors["model.layers.2.hnorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    tensors["model.layers.2.eh_proj.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=generator)
    tensors["model.layers.2.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((path / "config.json").read_text())
    saved.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(saved))
    return path


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    return write_published_checkpoint(tmp_path_factory.mktemp("deepseek_v3_mtp"))


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def mtp_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in tensors.items() if key.startswith("model.layers.2.")}


def batch_of(seed: int = 1) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def independent_losses(folder: Path, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(main loss, depth-1 loss) with transformers' own modules: the folder read as the 3-layer model it
    was written from (layer 2, unconverted, is the MTP decoder layer), the MTP parts read from the
    file, depth 1 run on the row cut to its first ``S - 1`` positions (DeepSeek-V3's formulation)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, attn_implementation="eager")
    parts = mtp_tensors(tensors_of(folder))
    ids, labels = batch["input_ids"], batch["labels"]
    length = ids.shape[1] - 1
    inner = model.model
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    h = inner.embed_tokens(ids)
    rotary = inner.rotary_emb(h, positions)
    causal = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]
    for layer in inner.layers[:2]:
        h = layer(h, attention_mask=causal, position_ids=positions, position_embeddings=rotary)
    main = F.cross_entropy(model.lm_head(inner.norm(h)).flatten(0, 1), labels.flatten())

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        rms = x.pow(2).mean(-1, keepdim=True).add(config.rms_norm_eps).rsqrt()
        return parts[f"model.layers.2.{name}.weight"] * (x * rms)

    combined = torch.cat([norm(inner.embed_tokens(ids[:, 1:]), "enorm"), norm(h[:, :length], "hnorm")], dim=-1)
    x = F.linear(combined, parts["model.layers.2.eh_proj.weight"])
    x = inner.layers[2](
        x,
        attention_mask=causal[..., :length, :length],
        position_ids=positions[:, :length],
        position_embeddings=tuple(t[:, :length] for t in rotary),
    )
    logits = F.linear(norm(x, "shared_head.norm"), parts["model.layers.2.shared_head.head.weight"])
    return main, F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())


# -- one process -----------------------------------------------------------------------------------
def test_load_whole_and_sharded_then_save_bit_for_bit(published, tmp_path):
    from lightning_moe.hf import HFMoEModule
    from lightning_moe.parallel.plans.init import materialize_sharded

    whole = HFMoEModule(pretrained=published)
    assert whole.mtp_depth == 1 and whole.hparams.mtp_depth == 1
    names = {name for name, _ in whole.named_parameters()}
    assert {f"model.model.layers.2.{part}" for part in MTP_PARTS} <= names
    assert not any(f"layers.2.{copy}" in name for name in names for copy in COPIES), "the copies are no parameters"
    with torch.device("meta"):
        sharded = HFMoEModule(pretrained=published)
    materialize_sharded(sharded, torch.device("cpu"), sharded.initial_value)
    want = dict(itertools.chain(whole.named_parameters(), whole.named_buffers()))
    got = dict(itertools.chain(sharded.named_parameters(), sharded.named_buffers()))
    assert got.keys() == want.keys()
    assert [name for name in want if not torch.equal(got[name], want[name])] == []

    sharded.save_hf(tmp_path / "out")  # 0 steps
    original, written = tensors_of(published), tensors_of(tmp_path / "out")
    assert written.keys() == original.keys()
    assert [key for key in original if not torch.equal(written[key], original[key])] == []
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_mtp_loss_equals_transformers_layer(published):
    from lightning_moe.hf import HFMoEModule

    module = HFMoEModule(pretrained=published, mtp_loss_weight=0.5)
    batch = batch_of()
    objective, terms = module.loss_terms(batch)
    main, depth1 = independent_losses(published, batch)
    torch.testing.assert_close(terms["loss"], main, rtol=REL, atol=0)
    torch.testing.assert_close(terms["mtp_loss"], depth1, rtol=REL, atol=0)
    torch.testing.assert_close(objective, main + 0.5 * depth1, rtol=REL, atol=0)
    objective.backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    assert grads["model.model.layers.2.eh_proj.weight"].abs().sum() > 0
    assert grads["model.model.layers.2.mlp.experts.w1"].abs().sum() > 0
    off = HFMoEModule(pretrained=published, mtp_depth=0)
    assert off.mtp_depth == 0 and not any(".layers.2." in name for name, _ in off.named_parameters())
    assert list(off.loss_terms(batch)[1]) == ["loss"]


def test_new_depths_from_a_config_are_written_and_read_back(tmp_path):
    from lightning_moe.hf import TINY_CONFIGS, HFMoEModule
    from lightning_moe.parallel.plans.init import materialize_sharded

    config = {"model_type": "deepseek_v3", **TINY_CONFIGS["deepseek_v3"]}
    assert HFMoEModule(config).mtp_depth == 0, "a config's num_nextn_predict_layers alone adds no depth"
    torch.manual_seed(0)
    eager = HFMoEModule(config, mtp_depth=2)
    with torch.device("meta"):
        meta = HFMoEModule(config, mtp_depth=2)
    materialize_sharded(meta, torch.device("cpu"), meta.initial_value)
    for module in (eager, meta):
        assert module.config.num_nextn_predict_layers == 2
        assert torch.equal(module.model.model.layers[3].enorm.weight, torch.ones(32)), "norms start at one"
        assert module.model.model.layers[3].eh_proj.weight.std() > 0.01
        assert set(module.loss_terms(batch_of())[1]) == {"loss", "mtp_loss"}
    eager.save_hf(tmp_path / "out")
    written = tensors_of(tmp_path / "out")
    assert {f"model.layers.{i}.{part}" for i in (2, 3) for part in (*MTP_PARTS, *COPIES)} <= written.keys()
    again = HFMoEModule(pretrained=tmp_path / "out")
    assert again.mtp_depth == 2
    want = dict(eager.named_parameters())
    assert [name for name, p in again.named_parameters() if not torch.equal(p, want[name])] == []


def test_a_differing_copy_warns_on_both_loads(published, tmp_path):
    from safetensors.torch import save_file

    from lightning_moe.hf import HFMoEModule
    from lightning_moe.parallel.plans.init import materialize_sharded

    folder = tmp_path / "edited"
    shutil.copytree(published, folder)
    tensors = tensors_of(folder)
    tensors["model.layers.2.shared_head.head.weight"][3, 5] += 1.0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    message = r"MTP copy model.layers.2.shared_head.head.weight differs from lm_head.weight \(max abs difference 1\)"
    with pytest.warns(UserWarning, match=message):
        HFMoEModule(pretrained=folder)
    with torch.device("meta"):
        module = HFMoEModule(pretrained=folder)
    with pytest.warns(UserWarning, match=message):
        materialize_sharded(module, torch.device("cpu"), module.initial_value)


def test_bad_mtp_requests_are_refused_with_the_fix(published):
    from lightning_moe.hf import TINY_CONFIGS, HFMoEModule

    with pytest.raises(
        ValueError, match=r"mtp_depth=2 but .* holds the weights of 1 MTP layer\(s\) .*use mtp_depth<=1"
    ):
        HFMoEModule(pretrained=published, mtp_depth=2)
    with pytest.raises(
        ValueError, match=r"mtp_depth=1: qwen3_moe models have no multi-token prediction layers.*use mtp_depth=0"
    ):
        HFMoEModule({"model_type": "qwen3_moe", **TINY_CONFIGS["qwen3_moe"]}, mtp_depth=1)
    with pytest.raises(ValueError, match=r"mtp_depth must be >= 0"):
        HFMoEModule(pretrained=published, mtp_depth=-1)
    with pytest.raises(ValueError, match=r"mtp_loss_weight must be >= 0"):
        HFMoEModule(pretrained=published, mtp_loss_weight=-1.0)
    with torch.device("meta"):
        module = HFMoEModule(pretrained=published)
    with pytest.raises(ValueError, match=r"mtp_depth=1 with pp=2: .*use pp=1 or mtp_depth=0"):
        module.check_layout(pp=2)
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(seq_len=1, vocab_size=256), strategy=SimpleNamespace())
    with pytest.raises(ValueError, match=r"mtp_depth=1 needs sequences longer than 1 tokens, got seq_len=1"):
        module.setup("fit")


# -- training: one process against ep2 (worker pool) -----------------------------------------------
class TermsRecorder(L.Callback):
    """Per optimizer step, the mean over ranks and micro-batches of the logged train/loss and train/mtp_loss
    (every micro-batch holds as many loss tokens, so this is the mean over the global batch)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        step = batch_idx // trainer.accumulate_grad_batches
        if step == len(self.steps):
            self.steps.append({"loss": 0.0, "mtp_loss": 0.0})
        for name in ("loss", "mtp_loss"):
            value = trainer.strategy.reduce(trainer.callback_metrics[f"train/{name}"], reduce_op="mean")
            self.steps[step][name] += value.item() / trainer.accumulate_grad_batches


def train_on_this_rank(folder: str, out: str, layout: dict) -> dict:
    """Build HFMoEModule on the meta device (each rank reads its shards of ``folder``), train
    ``STEPS`` steps under ``MoE5DStrategy(**layout)``, then save_hf and a trainer checkpoint."""
    import torch.distributed as dist

    from lightning_moe import MoE5DStrategy
    from lightning_moe.data import ByteTextDataModule
    from lightning_moe.hf import HFMoEModule
    from tests.launched_rank import launched_rank

    out_dir = Path(out)
    with launched_rank(env={"WORLD_SIZE": str(dist.get_world_size())}):
        L.seed_everything(0)
        recorder = TermsRecorder()
        data = ByteTextDataModule(
            seq_len=SEQ,
            global_batch_size=4,
            micro_batch_size=1,
            max_corpus_bytes=50_000,
            val_fraction=0.0,
            cache_dir=str(out_dir / "cache"),
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=dist.get_world_size(),
            strategy=MoE5DStrategy(**layout),
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[recorder],
            gradient_clip_val=0.05,
        )
        with trainer.init_module(empty_init=True):
            module = HFMoEModule(
                pretrained=folder, learning_rate=1e-2, warmup_steps=1, max_steps=STEPS, mtp_loss_weight=0.5
            )
        trainer.fit(module, datamodule=data)
        module.save_hf(out_dir / "hf")
        trainer.save_checkpoint(out_dir / "last.ckpt")
        shards = module._pretrained_shards.folder
        report = {"steps": recorder.steps, "expert_bytes_read": shards.expert_bytes_read}
    del trainer, module
    gc.collect()
    return report


_ONE_PROCESS: dict[str, dict] = {}


def one_process(published: Path, tmp_path_factory) -> dict:
    """The one-process run's report, its folders in ``report["out"]`` (trained once per session)."""
    if "report" not in _ONE_PROCESS:
        out = tmp_path_factory.mktemp("mtp_one")
        _ONE_PROCESS["report"] = {
            **pool_of(1).run(train_on_this_rank, folder=str(published), out=str(out), layout={})[0],
            "out": out,
        }
    return _ONE_PROCESS["report"]


@pytest.mark.slow
@pytest.mark.parametrize("dims", [{"ep": 2}, {"tp": 2}, {"cp": 2}], ids=["ep2", "tp2", "cp2"])
def test_trained_in_two_processes_equals_one_and_writes_back(published, tmp_path, tmp_path_factory, dims):
    from lightning_moe.checkpoint.to_hf import checkpoint_to_hf

    one = one_process(published, tmp_path_factory)
    ranks = pool_of(2).run(train_on_this_rank, folder=str(published), out=str(tmp_path), layout=dims)
    assert len(one["steps"]) == STEPS
    for name in ("loss", "mtp_loss"):
        assert [s[name] for s in ranks[0]["steps"]] == pytest.approx([s[name] for s in one["steps"]], rel=REL), name
    # Both layouts split the experts over the two ranks: each read half of them, the MTP layer's included.
    assert [r["expert_bytes_read"] for r in ranks] == [one["expert_bytes_read"] / 2] * 2

    saved = tensors_of(tmp_path / "hf")
    original, trained = mtp_tensors(tensors_of(published)), mtp_tensors(saved)
    assert trained.keys() == original.keys()
    # Every MTP tensor trained: the copies follow the embedding and head, the expert bias the loads.
    assert [key for key in original if torch.equal(trained[key], original[key])] == []
    for copy, main in (
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("shared_head.head.weight", "lm_head.weight"),
    ):
        assert torch.equal(trained[f"model.layers.2.{copy}"], saved[main])
    one_trained = mtp_tensors(tensors_of(one["out"] / "hf"))
    for key in original:  # atol: Adam turns rounding-level differences of near-zero gradients into ~1e-6 steps
        torch.testing.assert_close(
            trained[key], one_trained[key], rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )

    checkpoint_to_hf(tmp_path / "last.ckpt", tmp_path / "to_hf")
    from_checkpoint = tensors_of(tmp_path / "to_hf")
    assert from_checkpoint.keys() == saved.keys()
    assert [key for key in saved if not torch.equal(from_checkpoint[key], saved[key])] == []
