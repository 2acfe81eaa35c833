"""HFMoEModule under moe5d layouts: 6 training steps of tiny Qwen3-MoE and DeepSeek-V3 give the
single-process losses and, where one rank runs the whole model, the single-process trained logits
(rel 1e-5), and save_hf from a layout loads with the trained logits.

One run per layout trains its families (tests/scripts/hf_train.py's training, on the ranks of the
persistent gloo test pool instead of under torchrun); the single-process reference runs once for the
module, on a pool of one rank. The CLI test starts `python -m lightning_moe.train` itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.dist_pool import trim_pools  # noqa: E402
from tests.hf_runs import train_hf_in_pool  # noqa: E402

ALL = ("qwen3_moe", "deepseek_v3", "mixtral", "qwen2_moe", "olmoe", "gpt_oss")
ISSUE = ("qwen3_moe", "deepseek_v3")  # the issue's pair: every layout
REL = 1e-5


def _run(layout: dict, out: Path, save_hf: bool, families: tuple[str, ...]) -> None:
    """tests/scripts/hf_train.py's training of ``families`` under ``layout``, on a test pool of the layout's size."""
    train_hf_in_pool(layout, out, save_hf, families)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_single")
    _run({}, out, save_hf=True, families=ALL)
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


# layout, save_hf round trip, families (the cheap layouts take every family that supports them;
# gpt_oss refuses cp, olmoe refuses tp).
LAYOUTS = {
    "ep2": ({"ep": 2}, True, ALL),
    # GPT-OSS: attention sinks sharded with the heads, expert biases sharded under expert TP.
    "tp2_sp": ({"tp": 2}, True, ("qwen3_moe", "deepseek_v3", "mixtral", "qwen2_moe", "gpt_oss")),
    "cp2": ({"cp": 2}, False, ("qwen3_moe", "deepseek_v3", "mixtral", "qwen2_moe", "olmoe")),
    # DeepSeek-V3 last: its first pipeline stage holds no MoE layer, and the process groups created
    # lazily for MoE layers then differ between the stages, so a later fit in the same processes
    # would hang in Lightning's next new_group (a strategy issue, reported; one fit per process is fine).
    "pp2": ({"pp": 2}, False, ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "deepseek_v3")),
    "pp2_tp2_ep2": ({"pp": 2, "tp": 2, "ep": 2}, True, (*ISSUE, "gpt_oss")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hf_module_layout_matches_single_process(name, reference, tmp_path):
    layout, save_hf, families = LAYOUTS[name]
    _run(layout, tmp_path, save_hf, families)
    for family in families:
        want = json.loads((reference / f"{family}.json").read_text())
        got = json.loads((tmp_path / f"{family}.json").read_text())
        assert len(got) == len(want) == 6
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
        assert worst < REL, f"{name} {family}: losses {got} vs single-process {want} (rel {worst:.2e})"
        assert want[-1] < want[0]  # it trains
        if not save_hf:
            continue
        # Round trip: what rank 0 wrote loads in plain transformers with the trained logits.
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}_hf", local_files_only=True)
        logits_file = tmp_path / f"{family}_logits.pt"
        want_logits = torch.load(reference / f"{family}_logits.pt")
        if logits_file.exists():
            # The trained model itself, not only its loss: GPT-OSS's sinks once stayed untrained under
            # tp2 with losses still within 2e-5 and logits 2.2e-3 apart.
            saved = torch.load(logits_file)
            assert torch.equal(saved["ids"], want_logits["ids"])
            rel = _rel(saved["logits"], want_logits["logits"])
            assert rel < REL, f"{name} {family}: trained logits vs single-process rel {rel:.2e}"
        else:
            saved = want_logits  # under pp no rank runs the whole model: the single-process logits stand in
        with torch.no_grad():
            got_logits = loaded(saved["ids"]).logits
        assert _rel(got_logits, saved["logits"]) < REL, f"{name} {family}: save_hf round trip"


CLI_RUN = [
    "logger=none",
    "trainer.max_steps=6",
    "trainer.val_check_interval=null",
    "trainer.limit_val_batches=0",
    "data.seq_len=32",
    "data.global_batch_size=4",
    "data.max_corpus_bytes=200000",
]


def _cli(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    trim_pools()  # the launched processes get the cores but for a few idle pool ranks
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "lightning_moe.train", *CLI_RUN, *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_trains_the_tiny_qwen3_moe_preset_under_ep2(tmp_path):
    """The issue's done-when: `python -m lightning_moe.train model=hf_tiny_qwen3_moe parallel=ep2`."""
    proc = _cli(tmp_path / "run", "model=hf_tiny_qwen3_moe", "parallel=ep2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["layout"]["ep"] == 2 and len(summary["losses"]) == 6
    assert summary["losses"][-1] < summary["losses"][0]
    assert len(summary["expert_load"]) == 2  # both MoE layers report their load
