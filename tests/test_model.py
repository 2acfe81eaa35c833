"""MoEGPT: shapes, causality, RoPE positions, GQA, layer pattern, optimizer, schedule, loss, training."""

from __future__ import annotations

import math
import time

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import SequenceParallel

from lightning_moe.data import ByteTextDataModule
from lightning_moe.models import (
    Attention,
    FeedForward,
    MoEGPT,
    apply_rotary,
    causal_lm,
    rotary_cos_sin,
    warmup_cosine_factor,
)
from lightning_moe.moe import MoELayer

SMALL_MOE = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32}


def small_model(**kwargs) -> MoEGPT:
    torch.manual_seed(0)
    defaults = dict(hidden_size=32, num_layers=2, num_heads=4, moe=SMALL_MOE)
    return MoEGPT(**{**defaults, **kwargs})


def tokens(batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def quiet_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_output_shape_and_initial_loss():
    model = small_model()
    x = tokens()
    assert model(x).shape == (2, 12, 256)
    # Small init: predictions start near uniform over the 256 bytes.
    loss = model.loss({"input_ids": x, "labels": x})
    assert abs(loss.item() - math.log(256)) < 0.2


def test_same_seed_same_weights():
    a, b = small_model(), small_model()
    torch.manual_seed(1)
    c = MoEGPT(hidden_size=32, num_layers=2, num_heads=4, moe=SMALL_MOE)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    # Residual-output projections get the depth-scaled std.
    wo = a.layers["0"].attention.wo.weight
    wq = a.layers["0"].attention.wq.weight
    assert wo.std() < 0.7 * wq.std()


def test_causal():
    model = small_model().eval()
    x = tokens()
    changed = x.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    with torch.no_grad():
        before, after = model(x), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_position_ids_drive_rope():
    # A larger init makes attention position-sensitive enough to see RoPE in the logits.
    model = small_model(init_std=0.2).eval()
    x = tokens()
    arange = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        default = model(x)
        torch.testing.assert_close(default, model(x, arange))
        # RoPE only sees relative positions: a constant shift changes nothing...
        torch.testing.assert_close(default, model(x, arange + 100), atol=2e-5, rtol=1e-4)
        # ...but other spacings do, so the ids are really used.
        assert not torch.allclose(default, model(x, arange * 2), atol=1e-3)
        # A shard carrying its global positions matches the same tokens of the full sequence
        # (first half only: causal attention needs no later tokens).
        torch.testing.assert_close(default[:, :6], model(x[:, :6], arange[:, :6]))


def test_rotary_is_a_rotation_by_position():
    x = torch.randn(1, 3, 2, 8)
    cos, sin = rotary_cos_sin(torch.tensor([0, 1, 5]), head_dim=8)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[:, 0], x[:, 0])  # position 0: identity
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
    # pair (0, 4) at position 5 rotates by angle 5 * theta^0 = 5
    c, s = math.cos(5.0), math.sin(5.0)
    expected = torch.stack([x[0, 2, :, 0] * c - x[0, 2, :, 4] * s, x[0, 2, :, 4] * c + x[0, 2, :, 0] * s])
    torch.testing.assert_close(torch.stack([out[0, 2, :, 0], out[0, 2, :, 4]]), expected)


def test_grouped_query_attention_matches_repeated_kv_heads():
    torch.manual_seed(0)
    attn = Attention(hidden_size=32, num_heads=4, num_kv_heads=2)
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 8)
    assert attn.wk.weight.shape == (16, 32) and attn.wq.weight.shape == (32, 32)
    x = torch.randn(2, 10, 32)
    cos, sin = rotary_cos_sin(torch.arange(10), 8)
    q = apply_rotary(attn.wq(x).view(2, 10, 4, 8), cos, sin).transpose(1, 2)
    k = apply_rotary(attn.wk(x).view(2, 10, 2, 8), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(2, 10, 2, 8).transpose(1, 2)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # q head h uses kv h // 2
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attn(x, cos, sin), attn.wo(ref.transpose(1, 2).reshape(2, 10, 32)))
    model = small_model(num_kv_heads=2)
    assert model(tokens()).shape == (2, 12, 256)


def test_attention_calls_sdpa_once_through_F(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    small_model(num_layers=3)(tokens())
    assert len(calls) == 3 and all(c["is_causal"] for c in calls)


@pytest.mark.parametrize(
    "freq, expected",
    [(1, [1, 1, 1, 1]), (2, [0, 1, 0, 1]), (3, [0, 0, 1, 0]), (0, [0, 0, 0, 0])],
)
def test_moe_layer_freq_pattern(freq, expected):
    model = small_model(num_layers=4, moe_layer_freq=freq)
    assert list(model.layers.keys()) == ["0", "1", "2", "3"]
    kinds = [isinstance(block.feed_forward, MoELayer) for block in model.layers.values()]
    assert kinds == [bool(e) for e in expected]
    for block in model.layers.values():
        assert isinstance(block.feed_forward, (MoELayer, FeedForward))
    moe = next((b.feed_forward for b in model.layers.values() if isinstance(b.feed_forward, MoELayer)), None)
    if moe is not None:
        assert moe.experts.w1.shape == (4, 32, 32) and moe.top_k == 2


def test_loss_mask_is_respected():
    model = small_model().eval()
    x = tokens()
    labels = tokens(seed=2)
    mask = torch.zeros(2, 12)
    mask[:, 3:9] = 1
    with torch.no_grad():
        logits = model(x).float()
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 12)
        masked = model.loss({"input_ids": x, "labels": labels, "loss_mask": mask})
        torch.testing.assert_close(masked, per_token[:, 3:9].mean())
        torch.testing.assert_close(model.loss({"input_ids": x, "labels": labels}), per_token.mean())
        other = labels.clone()
        other[:, :3] = (other[:, :3] + 1) % 256  # masked positions do not count
        torch.testing.assert_close(model.loss({"input_ids": x, "labels": other, "loss_mask": mask}), masked)


def test_warmup_cosine_values():
    f = lambda s: warmup_cosine_factor(s, warmup_steps=4, max_steps=24, min_lr_ratio=0.1)  # noqa: E731
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(14) == pytest.approx(0.55)  # half-way through the cosine: (1 + 0.1) / 2
    assert f(24) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    values = [f(s) for s in range(4, 25)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_configure_optimizers_schedule_and_decay_groups():
    model = small_model(lr=1e-2, warmup_steps=4, max_steps=24, min_lr_ratio=0.1, weight_decay=0.1)
    config = model.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.95)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = lambda params: {id(p) for p in params}  # noqa: E731
    assert id(model.tok_embeddings.weight) in ids(no_decay["params"])
    assert id(model.norm.weight) in ids(no_decay["params"])
    assert ids([model.output.weight, model.layers["0"].feed_forward.experts.w1]) <= ids(decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    lrs = []
    for _ in range(25):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:5] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])
    assert lrs[14] == pytest.approx(5.5e-3) and lrs[24] == pytest.approx(1e-3)


def test_max_steps_defaults_to_the_trainers(tmp_path):
    model = small_model(warmup_steps=0)
    model.trainer = quiet_trainer(max_steps=8)
    scheduler = model.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert scheduler.lr_lambdas[0].keywords["max_steps"] == 8


def _byte_bin(tmp_path, size: int = 20_000):
    rng = np.random.default_rng(0)
    path = tmp_path / "c.bin"
    path.write_bytes(rng.integers(0, 256, size=size, dtype=np.uint8).tobytes())
    return path


def test_optimizer_step_updates_expert_bias_once_per_step(tmp_path, monkeypatch):
    moe = {
        **SMALL_MOE,
        "score_func": "sigmoid",
        "load_balancing": "none",
        "expert_bias": True,
        "bias_update_rate": 0.01,
    }
    model = small_model(moe=moe)
    routers = [block.feed_forward.router for block in model.layers.values()]
    updates = []
    real = causal_lm.update_expert_biases

    def checked(module):
        loads = [r.expert_load.clone() for r in routers]
        before = [r.expert_bias.clone() for r in routers]
        real(module)
        for load, old, router in zip(loads, before, routers):
            # b += rate * sign(mean_load - load), with the loads of the whole optimizer step
            torch.testing.assert_close(router.expert_bias - old, 0.01 * torch.sign(load.mean() - load))
            updates.append(load.sum().item())

    monkeypatch.setattr(causal_lm, "update_expert_biases", checked)
    # 2 micro-batches of 4 x 16 tokens per optimizer step: one update per step, after both.
    dm = ByteTextDataModule(path=_byte_bin(tmp_path), seq_len=16, global_batch_size=8, micro_batch_size=4)
    quiet_trainer(max_steps=3, limit_val_batches=0).fit(model, datamodule=dm)
    assert updates == [2 * 4 * 16 * 2] * (3 * len(routers))  # micro-batches x tokens x top_k
    assert any(torch.count_nonzero(r.expert_bias) for r in routers)


def test_tensor_parallel_plan_names_real_modules():
    model = small_model(num_layers=4, moe_layer_freq=2, num_kv_heads=2)
    plan = model.tensor_parallel_plan()
    for key in plan:
        model.get_submodule(key)  # raises if the name does not exist
    assert {"tok_embeddings", "norm", "output", "layers.0.attention.wq", "layers.3.attention.wo"} <= set(plan)
    # Dense SwiGLU layers are in the plan; MoE layers are left to lightning_moe.parallelize.
    assert "layers.0.feed_forward.w1" in plan and "layers.2.feed_forward.w2" in plan
    # MoE layers get no sharding style, only a mark that their tokens arrive as sequence shards.
    moe_keys = {k for k in plan if k.startswith(("layers.1.feed_forward", "layers.3.feed_forward"))}
    assert moe_keys == {"layers.1.feed_forward", "layers.3.feed_forward"}
    assert all(type(plan[k]).__name__ == "PrepareModuleInputOutput" for k in moe_keys)
    no_sp = model.tensor_parallel_plan(sequence_parallel=False)
    assert not any(k.startswith(("layers.1.feed_forward", "layers.3.feed_forward")) for k in no_sp)
    no_sp = model.tensor_parallel_plan(sequence_parallel=False)
    assert not any(isinstance(style, SequenceParallel) for style in no_sp.values())
    # A pipeline stage (layers deleted, no head) only lists what it holds.
    del model.layers["0"], model.layers["1"]
    model.output = None
    stage_plan = model.tensor_parallel_plan()
    assert "output" not in stage_plan and not any(k.startswith("layers.0.") for k in stage_plan)


def test_pipeline_stage_convention():
    model = small_model(num_layers=2, moe_layer_freq=0).eval()
    x = tokens()
    with torch.no_grad():
        full = model(x)
        first, last = small_model(num_layers=2, moe_layer_freq=0), small_model(num_layers=2, moe_layer_freq=0)
        del first.layers["1"]
        first.norm, first.output = None, None
        del last.layers["0"]
        last.tok_embeddings = None
        torch.testing.assert_close(last(first(x)), full)


def test_max_seq_len_error():
    with pytest.raises(ValueError, match="max_seq_len 8"):
        small_model(max_seq_len=8)(tokens(seq=12))


@pytest.mark.slow
def test_tiny_model_learns_the_default_corpus(tmp_path):
    """60 optimizer steps of the `model/tiny` shape on the stdlib corpus cut the val loss clearly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        L.seed_everything(0, verbose=False)
        model = MoEGPT(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=128,
            moe={"num_experts": 8, "top_k": 2, "ffn_hidden_size": 64, "z_loss_coeff": 1e-3},
            lr=3e-3,
            warmup_steps=10,
        )
        dm = ByteTextDataModule(seq_len=128, global_batch_size=16, cache_dir=tmp_path)
        trainer = quiet_trainer(max_steps=60, limit_val_batches=16, num_sanity_val_steps=0)
        start = time.perf_counter()
        initial = trainer.validate(model, datamodule=dm, verbose=False)[0]["val/loss"]
        trainer.fit(model, datamodule=dm)
        final = trainer.validate(model, datamodule=dm, verbose=False)[0]["val/loss"]
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    print(f"val loss {initial:.3f} -> {final:.3f} in {elapsed:.1f} s")
    assert trainer.global_step == 60
    assert abs(initial - math.log(256)) < 0.3
    assert final < initial - 1.0
