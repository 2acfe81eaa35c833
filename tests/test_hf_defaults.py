"""HFMoEModule with nothing but the defaults a user types (issue 21, items 2 and 7).

- ``HFMoEModule(<tiny Qwen3-MoE>)`` with ``ByteTextDataModule(global_batch_size=4, seq_len=32)``,
  3 steps under ``MoE5DStrategy(ep=2)``, gives the one-process losses and trained logits (rel 1e-5):
  the default micro-batch no longer depends on the layout (it gave 2.6e-3 before).
- A tiny DeepSeek-V3 trained with a plain ``Trainer(strategy="auto")``, and with Lightning's DDP on
  two processes, updates its expert biases exactly as under ``MoE5DStrategy`` (the update lives in
  the shared causal-LM base, not in the strategy alone; under DDP the loads of all ranks count).

Trainer-level runs go through tests/scripts/hf_defaults.py in a subprocess (Lightning's launcher
re-executes sys.argv): one single-process run and one two-process run serve every assertion.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf_runs import ROOT, run_script  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "hf_defaults.py"
REL = 1e-5


def _run(run: str, out: Path, world: int) -> None:
    # cwd: Lightning's default root dir for anything a user's defaults write.
    run_script(SCRIPT, [run, str(out)], world, cwd=out)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_defaults_single")
    _run("single", out, 1)
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_defaults_two")
    _run("ep2", out, 2)
    return out


def _load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.slow
def test_ep2_with_default_micro_batch_matches_one_process(single, two_processes):
    want, got = _load(single, "moe5d_qwen3_moe"), _load(two_processes, "ep2_qwen3_moe")
    assert len(want["losses"]) == len(got["losses"]) == 3
    worst = max(abs(g - w) / abs(w) for g, w in zip(got["losses"], want["losses"]))
    assert worst < REL, f"ep2 losses {got['losses']} vs one process {want['losses']} (rel {worst:.2e})"
    rel = _rel(got["logits"], want["logits"])
    assert rel < REL, f"logits after training: ep2 vs one process rel {rel:.2e}"


def _same_training_and_biases(run: dict, moe5d: dict, what: str) -> None:
    assert list(moe5d["biases"]) == ["model.model.layers.1.mlp"]  # the one MoE layer
    for name, want in moe5d["biases"].items():
        # 3 sign updates of bias_update_rate (1e-3): every expert moved, by the same steps in both runs.
        assert torch.count_nonzero(want) == want.numel(), f"{name}: moe5d left expert biases at zero: {want}"
        for rank, biases in enumerate(run["rank_biases"]):
            assert torch.equal(biases[name], want), f"{name}: {what} rank {rank} {biases[name]} vs moe5d {want}"
    # The loads the rule saw at each step (summed over the processes): the same tokens, the same routing.
    assert len(run["loads"]) == len(moe5d["loads"]) == 3
    for step, (got, want) in enumerate(zip(run["loads"], moe5d["loads"])):
        assert torch.equal(got, want), f"{what} step {step + 1}: expert loads {got} vs moe5d {want}"
    worst = max(abs(g - w) / abs(w) for g, w in zip(run["losses"], moe5d["losses"]))
    assert worst < REL, f"losses: {what} {run['losses']} vs moe5d {moe5d['losses']}"
    rel = _rel(run["logits"], moe5d["logits"])
    assert rel < REL, f"logits after training: {what} vs moe5d rel {rel:.2e}"


@pytest.mark.slow
def test_plain_trainer_updates_deepseek_expert_biases_as_moe5d(single):
    _same_training_and_biases(_load(single, "auto_deepseek_v3"), _load(single, "moe5d_deepseek_v3"), "plain Trainer")


@pytest.mark.slow
def test_ddp_updates_deepseek_expert_biases_from_every_rank_as_moe5d(single, two_processes):
    # Two micro-batches per rank and step. Each rank once applied its own loads (rank 1's biases
    # ended 2e-3 off moe5d's) and DDP's buffer broadcast then kept rank 0's.
    run = _load(two_processes, "ddp_deepseek_v3")
    assert len(run["rank_biases"]) == 2
    _same_training_and_biases(run, _load(single, "moe5d_deepseek_v3"), "DDP")
