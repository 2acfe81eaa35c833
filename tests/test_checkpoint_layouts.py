"""Checkpoints move between layouts: train 5 steps on A, resume on B, get the uninterrupted single-process curve.

Every pair compares steps 6-10 with 10 uninterrupted steps on one process (rel 1e-5, fp32, clipping
on): model, Adam moments, LR schedule, step counters, RNG and the data position all carry over.
The 4-layer tiny model lets the interleaved pipeline (4 virtual stages) take part.
"""

from __future__ import annotations

import pytest
import torch

from tests.cli import run_cli, run_cli_error

REL = 1e-5
FOUR_LAYERS = ["model.num_layers=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    summary = run_cli(tmp_path_factory.mktemp("reference") / "run", "parallel=single", *FOUR_LAYERS)
    assert len(summary["losses"]) == 10
    return summary["losses"]


_CHECKPOINTS: dict[str, object] = {}


def checkpoint_after_5_steps(tmp_path_factory, name: str, *overrides: str):
    """Train 5 of the 10 scheduled steps on a layout (once per test session) and return its DCP folder."""
    if name not in _CHECKPOINTS:
        run_dir = tmp_path_factory.mktemp(f"ckpt_{name}") / "run"
        run_cli(run_dir, *overrides, *FOUR_LAYERS, "trainer.max_steps=5", "model.max_steps=10", "callbacks=checkpoint",
                "callbacks.checkpoint.every_n_train_steps=5")
        ckpt = run_dir / "checkpoints" / "last.ckpt"
        assert ckpt.is_dir(), "a sharded DCP checkpoint folder"
        assert not list(run_dir.glob("checkpoints/*.staging")), "no half-written checkpoint is left behind"
        _CHECKPOINTS[name] = ckpt
    return _CHECKPOINTS[name]


# (id, layout A, layout B): each A checkpoint is written once and resumed by every pair that names it.
A_LAYOUTS = {
    "ep2": ["parallel=ep2"],
    "tp2": ["parallel=tp2"],
    "pp2_interleaved": ["parallel=pp2_interleaved"],
    "dp2_tp2_ep2": ["parallel=dp2_tp2_ep2"],  # 8 processes
}
PAIRS = [
    ("ep2_to_single", "ep2", ["parallel=single"]),  # ep 2 -> 1, accumulation 2 -> 4
    ("ep2_to_ep4", "ep2", ["parallel=ep4"]),
    ("ep2_to_pp2", "ep2", ["parallel=pp2"]),  # pp 1 -> 2
    ("fsdp_to_ddp", "ep2", ["parallel=dp2_ep2", "parallel.data_parallel=ddp"]),
    ("tp2_to_cp2", "tp2", ["parallel=cp2"]),
    ("interleaved_to_1f1b", "pp2_interleaved", ["parallel=pp2"]),
    ("pp2_to_single_micro4", "pp2_interleaved", ["parallel=single", "data.micro_batch_size=4"]),  # pp 2 -> 1, micro 2 -> 4
    ("8_processes_to_ep2", "dp2_tp2_ep2", ["parallel=ep2"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,source,target", PAIRS, ids=[pair[0] for pair in PAIRS])
def test_resume_on_another_layout_continues_the_single_process_curve(tmp_path, tmp_path_factory, reference, name, source, target):
    ckpt = checkpoint_after_5_steps(tmp_path_factory, source, *A_LAYOUTS[source])
    resumed = run_cli(tmp_path / name, *target, *FOUR_LAYERS, "model.max_steps=10", f"ckpt_path={ckpt}")
    assert len(resumed["losses"]) == 5, "the resumed run starts at step 6"
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(reference[5:]), rtol=REL, atol=0.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.hidden_size=48"], r"the checkpoint holds another model .*shape differs: .*tok_embeddings.weight is \(256, 32\)"),
        (["parallel=ep4", "model.moe.num_experts=6"], r"num_experts 6 is not divisible by ep 4"),
    ],
    ids=["another_model", "experts_not_divisible"],
)
def test_bad_resume_fails_before_training(tmp_path, tmp_path_factory, overrides, message):
    import re

    ckpt = checkpoint_after_5_steps(tmp_path_factory, "ep2", *A_LAYOUTS["ep2"])
    output = run_cli_error(tmp_path / "bad", *FOUR_LAYERS, "model.max_steps=10", f"ckpt_path={ckpt}", *overrides)
    assert re.search(message, output, re.S), output[-3000:]


@pytest.mark.slow
def test_missing_checkpoint_folder_names_itself(tmp_path):
    output = run_cli_error(tmp_path / "bad", *FOUR_LAYERS, f"ckpt_path={tmp_path / 'nowhere' / 'last.ckpt'}")
    assert "nowhere/last.ckpt" in output and ("does not exist" in output or "not found" in output.lower()), output[-3000:]
