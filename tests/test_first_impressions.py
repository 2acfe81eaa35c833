"""What a new user sees first: ``make train`` and the README's first Python example print no
misleading line, count optimizer steps in the progress bar, and end with our run summary.

Both run as a user runs them (a subprocess; Lightning's launcher re-executes the command for the
other ranks), shortened by arguments only: the runs tests/test_readme.py makes of the README's
`make train` and first example, once for both modules. ``make train``'s stdout and stderr share one
unbuffered pipe, so the order of its lines is the order they were printed in.
"""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset

from lightning_moe.callbacks import StepProgressBar
from tests.test_readme import PYTHON_BLOCKS, make_train_run, python_block_run

# Lines the issue names: none may print.
VIEW_WARNING = "returned a view tensor"
NOISE = {
    "LeafSpec deprecation": "isinstance(treespec, LeafSpec)",
    "litlogger tip": "litlogger",
    "litmodels tip": "litmodels",
    "FLOPs column": "FLOPs",
    "view-tensor warning": VIEW_WARNING,
}

# The CLI config names Lightning's RichProgressBar (tests/test_hydra.py checks that type) and a
# Trainer given no callbacks gets Lightning's: the bar counts steps once MoE5DStrategy.connect
# calls use_lightning_moe_displays(model.trainer). Strict: these fail as soon as it does.


@pytest.fixture(scope="module")
def make_train_output(tmp_path_factory) -> tuple[str, Path]:
    return make_train_run(tmp_path_factory)


@pytest.fixture(scope="module")
def readme_example_output(tmp_path_factory) -> str:
    """The README's first example (tp=2, ep=2 on 4 processes), shrunk as tests/test_readme.py shrinks it."""
    block = next(
        block for block in PYTHON_BLOCKS if block.source == "README.md" and "trainer.fit(MoEGPT(" in block.text
    )
    proc, _ = python_block_run(block, tmp_path_factory)
    return proc.stdout + proc.stderr


def _bar_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "━" in line]


@pytest.mark.slow
def test_make_train_prints_no_misleading_line(make_train_output):
    output, _ = make_train_output
    for name, text in NOISE.items():
        assert text not in output, f"{name} printed:\n{output}"


@pytest.mark.slow
def test_make_train_progress_bar_counts_optimizer_steps(make_train_output):
    """4 micro-batches per optimizer step (16 samples, 2 per rank, 2 data ranks): the bar counts steps."""
    output, _ = make_train_output
    assert "Epoch 0/-" not in output
    assert any(re.match(r"Step\s+━+ 3/3 ", line) for line in _bar_lines(output)), output


@pytest.mark.slow
def test_make_train_ends_with_the_run_summary_after_wandb(make_train_output):
    output, run_dir = make_train_output
    lines = output.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line == "Run summary")
    block = lines[start:]
    assert not any(line.startswith("wandb:") for line in block)
    assert any(line.startswith("wandb:") for line in lines[:start])  # W&B's own closing lines come first
    offline_run = next((run_dir / "wandb").glob("offline-run-*"))
    assert block == [
        "Run summary",
        "  layout: tp=1 cp=1 ep=2 dp=1 pp=1 etp=1",
        block[2],
        block[3],
        f"  summary.json: {run_dir / 'summary.json'}",
        f"  W&B offline run: {offline_run}",
        f"  upload it with: wandb sync {offline_run}",
    ]
    assert re.fullmatch(r"  final loss: \d+\.\d{4} after 3 optimizer steps, [\d,]+ tokens/s", block[2]), block[2]
    assert re.fullmatch(r"  communication per optimizer step and rank: ep [\d.]+ MB in \d+ calls, dp .+", block[3]), (
        block[3]
    )


@pytest.mark.slow
def test_readme_example_prints_no_view_tensor_warning(readme_example_output):
    """tp=2: the logits leave the column-parallel head through DTensor.to_local() (a view) without a warning."""
    assert VIEW_WARNING not in readme_example_output, readme_example_output
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in readme_example_output


@pytest.mark.slow
def test_readme_example_progress_bar_counts_optimizer_steps(readme_example_output):
    assert "Epoch 0/-" not in readme_example_output
    assert any(re.match(r"Step\s+━+ 3/3 ", line) for line in _bar_lines(readme_example_output)), readme_example_output
    assert "FLOPs" not in readme_example_output


def test_step_progress_bar_runs_on_across_epochs(tmp_path):
    """2 steps per epoch (4 batches, 2 per step), 5 steps: one bar from 0 to 5, never reset by an epoch."""
    seen: list[tuple[int, float]] = []

    class Recorder(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            bar = trainer.progress_bar_callback
            task = bar.progress.tasks[bar.train_progress_bar_id]
            seen.append((int(task.completed), task.total))

    trainer = L.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        max_steps=5,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[StepProgressBar(), Recorder()],
    )
    model = BoringModel()
    model.train_dataloader = lambda: torch.utils.data.DataLoader(RandomDataset(32, 4), batch_size=1)
    trainer.fit(model)
    bar = trainer.progress_bar_callback
    assert bar._get_train_description(trainer.current_epoch).strip() == "Step"
    # After each micro-batch of the 3 epochs (4, 4 and 2 batches): the optimizer steps so far, against max_steps.
    assert seen == [(0, 5), (1, 5), (1, 5), (2, 5), (2, 5), (3, 5), (3, 5), (4, 5), (4, 5), (5, 5)]


def test_step_progress_bar_keeps_lightnings_bar_for_epoch_bounded_runs(tmp_path):
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[StepProgressBar()],
    )
    model = BoringModel()
    model.train_dataloader = lambda: torch.utils.data.DataLoader(RandomDataset(32, 4), batch_size=1)
    trainer.fit(model)
    bar = trainer.progress_bar_callback
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert bar._get_train_description(1).strip() == "Epoch 1/1"
    assert (task.completed, task.total) == (4, 4)  # loader batches of the epoch, as Lightning counts them


def test_lightnings_default_displays_become_ours_with_their_settings(tmp_path):
    from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar, TQDMProgressBar

    from lightning_moe.callbacks import ParameterSummary, use_lightning_moe_displays

    trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=5, logger=False)
    assert type(trainer.progress_bar_callback) is RichProgressBar  # what Lightning adds by default
    use_lightning_moe_displays(trainer)
    assert type(trainer.progress_bar_callback) is StepProgressBar
    assert [type(c) for c in trainer.callbacks if isinstance(c, RichModelSummary)] == [ParameterSummary]

    class MyBar(RichProgressBar):
        pass

    for bar in (MyBar(refresh_rate=7), TQDMProgressBar(), RichProgressBar(refresh_rate=7)):
        trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, logger=False, callbacks=[bar])
        use_lightning_moe_displays(trainer)
        expected = StepProgressBar if type(bar) is RichProgressBar else type(bar)
        assert type(trainer.progress_bar_callback) is expected and trainer.progress_bar_callback is bar
    assert bar.refresh_rate == 7


def test_tp_outputs_own_their_storage_with_the_same_values_and_gradients():
    """What keeps FSDP quiet: a view output comes back as no view, without a copy, same gradient."""
    from lightning_moe.parallel.plans.tensor_parallel import own_view_outputs

    x = torch.randn(2, 3, requires_grad=True)
    logits = (x * 3).view_as(x)  # DTensor.to_local() returns such a view
    assert logits._base is not None
    owned = own_view_outputs(torch.nn.Identity(), (), {"logits": logits, "other": 1})
    assert owned["logits"]._base is None and owned["other"] == 1
    assert owned["logits"].data_ptr() == logits.data_ptr()  # no copy
    owned["logits"].pow(2).sum().backward()
    torch.testing.assert_close(x.grad, 18 * x.detach())
    # An in-place change to what backward needs still raises, as it would on the view.
    saved = x.sigmoid().view_as(x)
    own_view_outputs(torch.nn.Identity(), (), saved).mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()
