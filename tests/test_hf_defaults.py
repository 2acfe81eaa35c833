"""HFMoEModule with nothing but the defaults a user types (issue 21, items 2 and 7).

- ``HFMoEModule(<tiny Qwen3-MoE>)`` with ``ByteTextDataModule(global_batch_size=4, seq_len=32)``,
  3 steps under ``MoE5DStrategy(ep=2)``, gives the one-process losses and trained logits (rel 1e-5):
  the default micro-batch no longer depends on the layout (it gave 2.6e-3 before).
- A tiny DeepSeek-V3 trained with a plain ``Trainer(strategy="auto")`` updates its expert biases
  exactly as under ``MoE5DStrategy`` (the update lives in the shared causal-LM base, not in the
  strategy alone).

Trainer-level runs go through tests/scripts/hf_defaults.py in a subprocess (Lightning's launcher
re-executes sys.argv): one single-process run and one two-process run serve every assertion.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.conftest import close_pools  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hf_defaults.py"
REL = 1e-5


def _run(run: str, out: Path, world: int) -> None:
    close_pools()  # the run's processes get the cores to themselves
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    launcher = [sys.executable]
    if world > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd = [*launcher, str(SCRIPT), run, str(out)]
    # cwd: Lightning's default root dir for anything a user's defaults write.
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_defaults_single")
    _run("single", out, 1)
    return out


def _load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.slow
def test_ep2_with_default_micro_batch_matches_one_process(single, tmp_path):
    _run("ep2", tmp_path, 2)
    want, got = _load(single, "moe5d_qwen3_moe"), _load(tmp_path, "ep2_qwen3_moe")
    assert len(want["losses"]) == len(got["losses"]) == 3
    worst = max(abs(g - w) / abs(w) for g, w in zip(got["losses"], want["losses"]))
    assert worst < REL, f"ep2 losses {got['losses']} vs one process {want['losses']} (rel {worst:.2e})"
    rel = _rel(got["logits"], want["logits"])
    assert rel < REL, f"logits after training: ep2 vs one process rel {rel:.2e}"


@pytest.mark.slow
def test_plain_trainer_updates_deepseek_expert_biases_as_moe5d(single):
    auto, moe5d = _load(single, "auto_deepseek_v3"), _load(single, "moe5d_deepseek_v3")
    assert list(auto["biases"]) == list(moe5d["biases"]) == ["model.model.layers.1.mlp"]  # the one MoE layer
    for name, want in moe5d["biases"].items():
        # 3 sign updates of bias_update_rate (1e-3): every expert moved, by the same steps in both runs.
        assert torch.count_nonzero(want) == want.numel(), f"{name}: moe5d left expert biases at zero: {want}"
        assert torch.equal(auto["biases"][name], want), f"{name}: plain Trainer {auto['biases'][name]} vs moe5d {want}"
    worst = max(abs(g - w) / abs(w) for g, w in zip(auto["losses"], moe5d["losses"]))
    assert worst < REL, f"losses: plain Trainer {auto['losses']} vs moe5d {moe5d['losses']}"
    rel = _rel(auto["logits"], moe5d["logits"])
    assert rel < REL, f"logits after training: plain Trainer vs moe5d rel {rel:.2e}"
