"""Runs that survive: periodic checkpoints (every N steps, keep the last K), atomic and optionally
asynchronous saves with a commit marker, and ``ckpt_path=auto``.

- A process killed (SIGKILL) while a checkpoint is written, in the foreground or the background,
  leaves the previous checkpoint complete and loadable, and ``latest_checkpoint`` picks it.
- On ep2 (the test pool), an async run's periodic checkpoints hold the sync run's tensors, and
  ``ckpt_path=auto`` resumes the newest complete one (skipping a truncated and a half-written
  newer one) on the uninterrupted per-step losses (rel 1e-5).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_moe.checkpoint import PeriodicCheckpoint, latest_checkpoint
from lightning_moe.checkpoint.commit import COMMIT_FILE, incomplete_reason, require_complete
from lightning_moe.checkpoint.state import STAGING_SUFFIX, resolve_checkpoint_path
from tests.cli import ROOT, train_in_pool

REL = 1e-5
EVERY_2_STEPS = ["callbacks=checkpoint", "callbacks.checkpoint.every_n_train_steps=2"]


def _kill_while_writing(tmp_path: Path, mode: str) -> Path:
    """Run tests/scripts/interrupted_save.py until its second save of last.ckpt blocks mid-write, then SIGKILL it."""
    script = ROOT / "tests" / "scripts" / "interrupted_save.py"
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    expected = {"blocked", "training goes on"} if mode == "async" else {"blocked"}
    seen: set[str] = set()
    try:
        while not expected <= seen:
            line = child.stdout.readline()
            assert line, f"the save ended before it could be killed:\n{child.stderr.read()[-3000:]}"
            seen.add(line.strip())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    return tmp_path / "checkpoints"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the test reads the checkpoint in one process
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_kill_while_writing_leaves_the_previous_checkpoint_and_auto_picks_it(tmp_path, mode):
    import torch.distributed.checkpoint as dcp

    folder = _kill_while_writing(tmp_path, mode)
    last, staging = folder / "last.ckpt", folder / f"last.ckpt{STAGING_SUFFIX}"
    assert staging.is_dir() and any(staging.glob("*.distcp")), "the killed save had written a shard"
    assert not (staging / COMMIT_FILE).exists() and not (staging / ".metadata").exists()
    with pytest.warns(UserWarning, match=rf"skipping checkpoint {staging}: a save into it was interrupted"):
        assert latest_checkpoint(folder) == last
    assert resolve_checkpoint_path(last) == last and incomplete_reason(last) is None
    state = {"state_dict": {"weight": torch.empty(256, 64)}}
    dcp.load(state, checkpoint_id=last, no_dist=True)
    assert torch.equal(state["state_dict"]["weight"], torch.full((256, 64), 2.0)), "the previous save's weights"
    assert json.loads((last / COMMIT_FILE).read_text())["global_step"] == 2


def test_incomplete_checkpoints_are_skipped_or_refused_with_their_name(tmp_path):
    assert latest_checkpoint(tmp_path / "none_yet") is None, "no run directory yet: start fresh"
    complete = tmp_path / "step_000002.ckpt"
    complete.mkdir()
    (complete / "__0_0.distcp").write_bytes(b"x" * 10)
    (complete / COMMIT_FILE).write_text(json.dumps({"global_step": 2, "files": {"__0_0.distcp": 10}}))
    truncated = tmp_path / "step_000004.ckpt"
    shutil.copytree(complete, truncated)
    (truncated / "__0_0.distcp").write_bytes(b"x" * 4)
    unmarked = tmp_path / "step_000006.ckpt"
    unmarked.mkdir()
    (tmp_path / "last.ckpt").symlink_to("step_000008.ckpt")  # save_last="link" to a save still in flight
    with pytest.warns(UserWarning) as caught:
        assert latest_checkpoint(tmp_path) == complete
    messages = "\n".join(str(w.message) for w in caught)
    assert f"skipping checkpoint {truncated}: __0_0.distcp is truncated (4 of 10 bytes)" in messages
    assert f"skipping checkpoint {unmarked}: it has no commit marker {COMMIT_FILE}" in messages
    assert f"skipping checkpoint {tmp_path / 'last.ckpt'}: it does not exist" in messages
    with pytest.raises(
        ValueError, match=rf"checkpoint {truncated} is incomplete: __0_0.distcp is truncated .*ckpt_path=auto"
    ):
        require_complete(truncated)
    with pytest.raises(FileNotFoundError, match=r"nowhere.ckpt does not exist"):
        require_complete(tmp_path / "nowhere.ckpt")


def test_bad_periodic_and_async_arguments_are_refused():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_moe import MoE5DStrategy

    with pytest.raises(ValueError, match=r"needs every_n_train_steps and/or every_n_minutes"):
        PeriodicCheckpoint("ckpt")
    with pytest.raises(ValueError, match=r"\(every_n_minutes=0\) must be a positive number"):
        PeriodicCheckpoint("ckpt", every_n_minutes=0)
    with pytest.raises(ValueError, match=r"\(keep_last=0\) must be a positive integer, or -1"):
        PeriodicCheckpoint("ckpt", every_n_train_steps=2, keep_last=0)
    with pytest.raises(
        MisconfigurationException, match=r"async_checkpoint=True needs save_distributed_checkpoint=True"
    ):
        MoE5DStrategy(async_checkpoint=True, save_distributed_checkpoint=False)


def test_saves_come_right_after_an_optimizer_step_every_n_steps_or_minutes(monkeypatch):
    """Two batches per optimizer step, 10 s each; every 4 steps or 45 s, whichever comes first. The
    45 s pass mid-accumulation (batches 4 and 12): the save waits for the step that follows."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_moe.checkpoint import periodic

    saved: list[tuple[int, int]] = []
    monkeypatch.setattr(
        ModelCheckpoint,
        "on_train_batch_end",
        lambda self, trainer, module, outputs, batch, batch_idx: saved.append((trainer.global_step, batch_idx)),
    )
    clock = [0.0]
    monkeypatch.setattr(periodic.time, "monotonic", lambda: clock[0])
    callback = PeriodicCheckpoint("ckpt", every_n_train_steps=4, every_n_minutes=0.75)
    trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(broadcast=lambda decision: decision))
    callback.on_train_start(trainer, None)
    for batch_idx in range(16):
        clock[0] += 10.0
        trainer.global_step = (batch_idx + 1) // 2  # the odd batches end with an optimizer step
        callback.on_train_batch_end(trainer, None, None, None, batch_idx)
    assert saved == [(3, 5), (4, 7), (7, 13), (8, 15)]


def _consolidated(checkpoint: Path) -> dict[str, torch.Tensor]:
    from lightning_moe.checkpoint.consolidate import consolidate

    return consolidate(checkpoint, with_optimizer=True)


@pytest.mark.slow
def test_async_periodic_checkpoints_resume_with_auto_on_the_uninterrupted_curve(tmp_path):
    # The uninterrupted run (sync saves); ckpt_path=auto finds no checkpoint and starts fresh.
    reference_dir = tmp_path / "reference"
    reference = train_in_pool(
        reference_dir, "parallel=ep2", *EVERY_2_STEPS, "callbacks.checkpoint.keep_last=-1", "ckpt_path=auto"
    )["losses"]
    assert len(reference) == 10

    # Steps 1-6 of the same schedule with background saves, keeping the last 2.
    run = tmp_path / "interrupted"
    first = train_in_pool(
        run,
        "parallel=ep2",
        "parallel.async_checkpoint=true",
        *EVERY_2_STEPS,
        "callbacks.checkpoint.keep_last=2",
        "trainer.max_steps=6",
        "model.max_steps=10",
    )["losses"]
    torch.testing.assert_close(torch.tensor(first), torch.tensor(reference[:6]), rtol=REL, atol=0.0)
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step_000004.ckpt", "step_000006.ckpt"]
    assert (checkpoints / "last.ckpt").resolve() == (checkpoints / "step_000006.ckpt").resolve()
    for name in ("step_000004.ckpt", "step_000006.ckpt"):  # what async wrote is what sync wrote, bit for bit
        written, expected = _consolidated(checkpoints / name), _consolidated(reference_dir / "checkpoints" / name)
        assert written.keys() == expected.keys()
        for key in expected:
            assert torch.equal(written[key], expected[key]), f"{name}: {key}"

    # What a kill leaves behind, newer than step 6: a checkpoint truncated after its commit and a half-written one.
    shutil.copytree(checkpoints / "step_000006.ckpt", checkpoints / "step_000008.ckpt")
    shard = next((checkpoints / "step_000008.ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (checkpoints / f"step_000010.ckpt{STAGING_SUFFIX}").mkdir()
    shutil.copy(shard, checkpoints / f"step_000010.ckpt{STAGING_SUFFIX}" / shard.name)

    resumed = train_in_pool(
        run, "parallel=ep2", *EVERY_2_STEPS, "callbacks.checkpoint.keep_last=2", "model.max_steps=10", "ckpt_path=auto"
    )["losses"]
    assert len(resumed) == 4, "resumed from step_000006.ckpt, the newest complete checkpoint"
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(reference[6:]), rtol=REL, atol=0.0)
    # The resumed run kept its last 2 and replaced what the kill left.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step_000008.ckpt", "step_000010.ckpt"]
    assert all(incomplete_reason(p) is None for p in checkpoints.iterdir())
