"""`python -m lightning_moe.verify` and `lightning_moe.verify_layout`: PASS on right layouts, a localised
FAIL on deliberate bugs (injected from outside the library by tests/scripts/verify_bugs.py), clear
errors on bad input.

Every case runs real multi-process Lightning runs in subprocesses; one single-process reference per
model is shared through `verify.cache_dir`, and most cases record module outputs in the main runs
(`verify.localize=always`) so that a failure needs no re-run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.cli import ROOT, TINY_RUN
from tests.conftest import close_pools

DATA = [o for o in TINY_RUN if o.startswith(("data.", "logger=", "++trainer.gradient_clip_val"))]
MOEGPT = [o for o in TINY_RUN if o.startswith("model.")]
USER = ["~model", "+model._target_=tests.scripts.verify_models.UserMoELM"]
BUG = "+verify.callbacks.bug._target_=tests.scripts.verify_bugs."


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("verify_cache")


def run_verify(run_dir: Path, cache: Path, *overrides: str, timeout: int = 600) -> tuple[int, str, dict | None]:
    """Run the verify CLI; returns (exit code, stdout + stderr, verify.json or None)."""
    close_pools()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "lightning_moe.verify", *DATA, *overrides, f"verify.cache_dir={cache}",
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    path = run_dir / "verify.json"
    return proc.returncode, proc.stdout + proc.stderr, json.loads(path.read_text()) if path.exists() else None


def _moegpt_parameter_names() -> set[str]:
    """The parameters of the model the verify CLI builds from the same overrides (composed here)."""
    import hydra
    from hydra import compose, initialize_config_dir

    from lightning_moe.train import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("verify", overrides=[*DATA, *MOEGPT])
    return {name for name, _ in hydra.utils.instantiate(cfg.model).named_parameters()}


# -- PASS ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["ep2", "tp2_ep2", "cp2", "pp2"])
def test_moegpt_layout_passes_and_lists_every_parameter(tmp_path, cache, preset):
    code, out, report = run_verify(tmp_path / preset, cache, *MOEGPT, f"parallel={preset}", "verify.localize=always")
    assert code == 0, out[-4000:]
    assert "PASS" in out and "FAIL" not in out
    assert report is not None and report["passed"] is True
    names = _moegpt_parameter_names()
    assert {p["name"] for p in report["parameters"]} == names
    table = out.split("parameter", 1)[1]
    assert all(f"\n{name} " in table for name in names)
    assert len(report["losses"]) == 3 and all(r["rel"] <= 1e-5 for r in report["losses"])
    assert all(p["grad_rel"] <= 1e-5 and p["final_rel"] <= 1e-5 for p in report["parameters"])
    # The module outputs at step 1 were reassembled (DTensor/TP shards, CP zigzag, pipeline stages) and match.
    compared = [m for m in report["modules"] if m.get("output") is not None]
    assert len(compared) >= 20 and all(m["output"] <= 1e-5 for m in compared), report["modules"]


# -- FAIL, localised -------------------------------------------------------------------------------
@pytest.mark.slow
def test_expert_gradient_times_two_names_the_experts_and_the_ratio(tmp_path, cache):
    # The default localisation (on_failure): step 1 is re-run with forward hooks.
    code, out, report = run_verify(tmp_path / "x2", cache, *MOEGPT, "parallel=ep2", BUG + "ExpertGradientTimesTwo")
    assert code == 1, out[-4000:]
    assert "FAIL" in out
    loc = report["localisation"]
    assert loc["kind"] == "gradient" and loc["parameter"] == "layers.0.feed_forward.experts.w1", loc
    assert abs(loc["ratio"] - 2.0) < 1e-3
    assert "ratio 2.000 on all elements: a reduction divides by the wrong group size" in report["first_difference"]
    differing = {p["name"] for p in report["parameters"] if p["grad_rel"] > 1e-5}
    assert differing == {f"layers.{i}.feed_forward.experts.{w}" for i in (0, 1) for w in ("w1", "w2", "w3")}
    assert (tmp_path / "x2" / "layout_step1").is_dir()


@pytest.mark.slow
def test_dispatcher_dropping_a_token_names_the_moe_layer(tmp_path, cache):
    code, out, report = run_verify(tmp_path / "drop", cache, *MOEGPT, "parallel=ep2", "verify.localize=always",
                                   BUG + "DropLastTokenDispatcher")
    assert code == 1, out[-4000:]
    loc = report["localisation"]
    assert loc == {**loc, "kind": "module_output", "module": "layers.0.feed_forward", "type": "MoELayer"}
    assert "first difference: layers.0.feed_forward (MoELayer) output, rel" in out
    assert "inputs equal" in report["first_difference"]


@pytest.mark.slow
def test_wrong_causal_ring_block_names_the_attention(tmp_path, cache):
    code, out, report = run_verify(tmp_path / "ring", cache, *MOEGPT, "parallel=cp2", "verify.localize=always",
                                   BUG + "WrongCausalRingBlock")
    assert code == 1, out[-4000:]
    loc = report["localisation"]
    assert loc["kind"] == "forward_code" and loc["module"] == "layers.0.attention" and loc["type"] == "Attention", loc
    assert loc["child"] == "layers.0.attention.wo"
    modules = {m["module"]: m for m in report["modules"]}
    assert all(modules[f"layers.0.attention.{p}"]["output"] <= 1e-5 for p in ("wq", "wk", "wv"))


@pytest.mark.slow
def test_user_module_passes_under_tp2(tmp_path, cache):
    code, out, report = run_verify(tmp_path / "user_tp2", cache, *USER, "parallel=tp2", "verify.localize=always")
    assert code == 0, out[-4000:]
    assert "PASS" in out and report["passed"]
    from tests.scripts.verify_models import UserMoELM

    assert {p["name"] for p in report["parameters"]} == {name for name, _ in UserMoELM().named_parameters()}


@pytest.mark.slow
def test_colwise_output_projection_names_the_projection(tmp_path, cache):
    code, out, report = run_verify(tmp_path / "colwise", cache, *USER, "parallel=tp2", "verify.localize=always",
                                   BUG + "ColwiseOutputProjection")
    assert code == 1, out[-4000:]
    assert "in blocks.0.attn.out (Linear) inside blocks.0.attn (UserAttention)" in report["first_difference"]
    assert report["error"]["module"] == "blocks.0.attn.out"


# -- the Python API --------------------------------------------------------------------------------
@pytest.mark.slow
def test_verify_layout_api_passes_and_turns_dropout_off(tmp_path):
    import lightning_moe
    from lightning_moe.data import ByteTextDataModule
    from tests.scripts.verify_models import DropoutGPT

    close_pools()
    model = partial(DropoutGPT, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32,
                    moe={"num_experts": 4, "ffn_hidden_size": 32}, dropout=0.2)
    data = partial(ByteTextDataModule, seq_len=32, global_batch_size=8, micro_batch_size=2, max_corpus_bytes=200000)
    with pytest.warns(UserWarning, match=r"dropout is not disabled \(embed_dropout \(Dropout p=0.2\)\)"):
        report = lightning_moe.verify_layout(model, data, {"ep": 2}, devices=2, steps=2, out_dir=tmp_path,
                                             trainer_kwargs={"accelerator": "cpu"}, verbose=False)
    assert isinstance(report, lightning_moe.VerifyReport)
    assert report.passed, str(report)
    assert len(report.losses) == 2 and report.layout["ep"] == 2
    assert any("dropout" in note for note in report.notes)
    assert json.loads((tmp_path / "verify.json").read_text())["passed"] is True


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_nondeterministic_configure_model_is_refused(tmp_path, cache):
    code, out, _ = run_verify(tmp_path / "unseeded", cache, *MOEGPT, "parallel=ep2",
                              "model._target_=tests.scripts.verify_models.UnseededGPT")
    assert code == 2, out[-3000:]
    assert "is not deterministic under a fixed seed: output.weight differs between two builds" in out
    assert not (tmp_path / "unseeded" / "layout").exists()


@pytest.mark.slow
def test_too_many_processes_is_refused(tmp_path, cache):
    code, out, _ = run_verify(tmp_path / "big", cache, *MOEGPT, "parallel=pp2_cp2_tp2_ep2", "verify.max_processes=8")
    assert code == 2, out[-3000:]
    assert "the layout needs 16 processes, more than verify.max_processes=8" in out


# -- the comparison itself (no processes) ----------------------------------------------------------
def test_uniform_ratio_and_its_explanation():
    from lightning_moe.verify.compare import describe_ratio, rel_diff, uniform_ratio

    b = torch.randn(64, 8)
    assert uniform_ratio(2 * b, b) == pytest.approx(2.0)
    assert uniform_ratio(b + 0.1 * torch.randn_like(b), b) is None
    assert describe_ratio(0.5).startswith("ratio 0.500 on all elements: a reduction divides by the wrong group size")
    assert "scale factor" in describe_ratio(1.37)
    assert rel_diff(b, b) == 0.0 and rel_diff(b[:3], b) == float("inf")
    # Below the floor (a fraction of the model's largest gradient), noise is measured against the floor.
    assert rel_diff(torch.tensor([2e-9]), torch.tensor([1e-9]), floor=1e-3) < 1e-5


def test_tensor_parallel_pieces_are_reassembled_on_the_sharded_dim():
    from lightning_moe.verify.compare import _merge_tp

    full = torch.randn(2, 8, 6)  # [batch, seq, hidden]
    seq_shards = list(full.chunk(2, dim=1))
    merged, _, _ = _merge_tp(seq_shards, (8, 6))
    torch.testing.assert_close(merged, full)
    hidden_shards = list(full.chunk(2, dim=2))
    merged, _, _ = _merge_tp(hidden_shards, (8, 6))
    torch.testing.assert_close(merged, full)
    _, disagreement, _ = _merge_tp([full, full + 1.0], (8, 6))  # "replicated" values that differ: a partial sum
    assert disagreement > 0.1
    merged, _, why = _merge_tp([full[:, :, :4], full[:, :, :4]], (8, 6))
    assert merged is None and "expected [8, 6]" in why
