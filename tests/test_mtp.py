"""Multi-token prediction (DeepSeek-V3) in `MoEGPT`: the loss against an independent computation,
bad input refused before work, and the training curve of every parallel layout family against one
process (the objective `loss + weight * mtp_loss`, rel 1e-5)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.models import MoEGPT
from lightning_moe.models.blocks import rotary_cos_sin
from lightning_moe.models.mtp import MTP_KEYS, add_mtp_targets
from lightning_moe.parallel.plans.context_parallel import SEQUENCE_KEYS
from tests.cli import train_in_pool

REL = 1e-5
SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "moe": {"num_experts": 4, "ffn_hidden_size": 32}}


def small_model(**kwargs) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(**SMALL, max_seq_len=16, **kwargs)


def truncated_mtp_losses(model: MoEGPT, input_ids: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """DeepSeek-V3's formulation: depth k runs on the row cut to its first `seq - k` positions (no
    masks), each from the main model's hidden states computed here layer by layer."""
    seq = input_ids.shape[1]
    cos, sin = rotary_cos_sin(torch.arange(seq), model.head_dim, model.rope_theta)
    h = model.tok_embeddings(input_ids)
    for layer in model.layers.values():
        h = layer(h, cos, sin)
    losses = []
    for k, module in enumerate(model.mtp.values(), start=1):
        length = seq - k
        h = h[:, :length]
        ahead = model.tok_embeddings(input_ids[:, k:])
        combined = torch.cat([module.enorm(ahead), module.hnorm(h)], dim=-1)
        h = module.block(module.eh_proj(combined), cos[:length], sin[:length])
        logits = model.output(module.norm(h))
        losses.append(F.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten()))
    return losses


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_loss_equals_independent_computation(depth):
    model = small_model(mtp_depth=depth, mtp_loss_weight=0.5)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    objective, terms = model.loss_terms(batch)
    expected = torch.stack(truncated_mtp_losses(model, batch["input_ids"], batch["labels"])).mean()
    plain = MoEGPT.forward(model, batch["input_ids"])
    main = F.cross_entropy(plain.flatten(0, 1), batch["labels"].flatten())
    torch.testing.assert_close(terms["mtp_loss"], expected, rtol=REL, atol=0)
    torch.testing.assert_close(terms["loss"], main, rtol=REL, atol=0)
    torch.testing.assert_close(objective, main + 0.5 * expected, rtol=REL, atol=0)
    objective.backward()
    assert model.mtp["0"].eh_proj.weight.grad.abs().sum() > 0
    assert model.layers["0"].attention.wq.weight.grad.abs().sum() > 0, "MTP trains the main trunk too"


def test_mtp_targets_respect_loss_mask_and_documents():
    input_ids = torch.arange(8).unsqueeze(0)
    labels = input_ids + 1
    loss_mask = torch.ones_like(input_ids).bool()
    loss_mask[0, 5] = False
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    batch = add_mtp_targets(
        {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask, "document_ids": documents}, 2
    )
    assert batch["mtp_input_ids"][0, :, 1].tolist() == [2, 3, 4, 5, 6, 7, 0, 0]
    assert batch["mtp_labels"][0, :, 0].tolist() == [2, 3, 4, 5, 6, 7, 8, 0]
    # depth 1 at t: target t+1 kept unless masked (t+1 = 5), across documents (t = 2) or past the end (t = 7)
    assert batch["mtp_loss_mask"][0, :, 0].tolist() == [True, True, False, True, False, True, True, False]
    assert set(MTP_KEYS) <= set(SEQUENCE_KEYS), "context parallelism shards the MTP targets like input_ids"


def test_model_without_mtp_is_unchanged():
    model = small_model()
    assert not any(name.startswith("mtp") for name in model.state_dict())
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    objective, terms = model.loss_terms({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    assert list(terms) == ["loss"] and objective is terms["loss"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mtp_depth": 16}, r"mtp_depth=16 needs sequences longer than 16 tokens, got max_seq_len=16: lower mtp_depth"),
        ({"mtp_depth": -1}, r"mtp_depth must be >= 0"),
        ({"mtp_depth": 1, "mtp_loss_weight": -0.1}, r"mtp_loss_weight must be >= 0"),
    ],
)
def test_bad_mtp_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        small_model(**kwargs)


def test_mtp_depth_beyond_the_data_is_refused_at_setup():
    model = small_model(mtp_depth=2)
    model._trainer = SimpleNamespace(datamodule=SimpleNamespace(seq_len=2), strategy=SimpleNamespace())
    with pytest.raises(
        ValueError, match=r"mtp_depth=2 needs sequences longer than 2 tokens, got seq_len=2: .*data.seq_len"
    ):
        model.setup("fit")
    with pytest.raises(ValueError, match="raise data.seq_len"):
        add_mtp_targets(
            {"input_ids": torch.zeros(1, 2, dtype=torch.long), "labels": torch.zeros(1, 2, dtype=torch.long)}, 2
        )


# -- layouts: the one-process curve, rel 1e-5 -------------------------------------------------------
STEPS = ["trainer.max_steps=5", "model.mtp_loss_weight=1.0"]
_REFERENCES: dict[int, list[float]] = {}


def reference(tmp_path_factory, depth: int) -> list[float]:
    """The one-process objective per step at `mtp_depth=depth` (trained once per session)."""
    if depth not in _REFERENCES:
        run_dir = tmp_path_factory.mktemp(f"mtp{depth}_single") / "run"
        _REFERENCES[depth] = train_in_pool(run_dir, "parallel=single", *STEPS, f"model.mtp_depth={depth}")["losses"]
        assert len(_REFERENCES[depth]) == 5
    return _REFERENCES[depth]


# ep2: experts of the MTP block across ranks; tp2: the MTP plan under sequence parallelism; cp2: the
# shifted targets built from whole rows before zigzag sharding (depth 2: two tokens across shard
# borders); tp2_ep2_folded: experts folded over tp.
# Slow: the fast subset also runs on torch 2.11, whose DTensor cannot run eh_proj on a sequence-sharded
# input under tp (docs/mtp.md).
@pytest.mark.slow
@pytest.mark.parametrize(("preset", "depth"), [("ep2", 1), ("tp2", 1), ("cp2", 1), ("tp2_ep2_folded", 1), ("cp2", 2)])
def test_mtp_layouts_match_one_process(tmp_path, tmp_path_factory, preset, depth):
    expected = reference(tmp_path_factory, depth)
    summary = train_in_pool(tmp_path / "run", f"parallel={preset}", *STEPS, f"model.mtp_depth={depth}")
    assert summary["losses"] == pytest.approx(expected, rel=REL)


def test_the_mfu_numerator_counts_each_depth_as_a_layer_and_the_head_once_more():
    """Megatron-LM's convention: the depths' blocks as layers, eh_proj and the three norms, and the
    shared head applied again per depth; the module walk (the callback's) and the planner agree."""
    from lightning_moe.callbacks import model_flops_per_token
    from lightning_moe.planner.model_shape import ModelShape

    config = {**SMALL, "vocab_size": 256, "num_kv_heads": 2}
    seq, h, v = 16, 32, 256
    plain, deep = small_model(vocab_size=256, num_kv_heads=2), small_model(vocab_size=256, num_kv_heads=2, mtp_depth=2)
    # A depth's block: attention (q 32x32, k/v 32x16, o 32x32) and two norms; router 4x32 and top-2 of
    # 4 experts of 3 x 32 x 32 each.
    block = (32 * 32 + 2 * 32 * 16 + 32 * 32 + 2 * h) + (4 * h + 2 * 3 * 32 * 32)
    per_depth = 6 * (block + 2 * h * h + 3 * h + v * h) + 12 * 32 * seq
    assert model_flops_per_token(deep, seq) - model_flops_per_token(plain, seq) == pytest.approx(2 * per_depth)
    for model, depth in ((plain, 0), (deep, 2)):
        shape = ModelShape.from_config({**config, "mtp_depth": depth})
        assert shape.model_flops_per_token(seq) == pytest.approx(model_flops_per_token(model, seq))


def test_planner_counts_mtp_flops_on_the_last_stage_only():
    from lightning_moe.planner.candidate import Layout
    from lightning_moe.planner.flops import flops_per_microbatch
    from lightning_moe.planner.model_shape import ModelShape

    config = {"hidden_size": 64, "num_layers": 2, "moe_layer_freq": 2, "vocab_size": 256}
    plain, mtp = ModelShape.from_config(config), ModelShape.from_config({**config, "mtp_depth": 2})
    layout, seq = Layout(tp=2), 128
    assert flops_per_microbatch(mtp, layout, seq, [0], last=False) == flops_per_microbatch(
        plain, layout, seq, [0], last=False
    )
    added = {
        k: flops_per_microbatch(mtp, layout, seq, [0, 1], last=True)[k] - v
        for k, v in flops_per_microbatch(plain, layout, seq, [0, 1], last=True).items()
    }
    # Per depth: the last layer's kind (MoE here: layer 1 with moe_layer_freq=2), eh_proj and the head.
    block = flops_per_microbatch(plain, layout, seq, [1], last=False)
    tokens = layout.micro_batch_size * seq
    assert block["expert"] > 0
    assert added["expert"] == pytest.approx(2 * block["expert"])
    assert added["attention"] == pytest.approx(2 * block["attention"])
    assert added["dense"] == pytest.approx(2 * (block["dense"] + 2 * tokens * (2 * 64 * 64 + 64 * 256) / 2))
