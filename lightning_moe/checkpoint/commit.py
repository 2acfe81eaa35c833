"""Commit markers: when a checkpoint counts as complete, and the newest complete one of a run.

A checkpoint folder is complete once ``commit.json`` is in it. Global rank 0 writes it last, after
every rank's DCP shards, DCP's ``.metadata`` and ``meta.pt`` are on disk; it lists each file with
its size, so a folder truncated later (a copy cut short, a file lost) is told from a complete one.
A single-file checkpoint (``save_distributed_checkpoint=False``) is written under a staging name
and renamed: a file at its final name is complete.

Example::

    from lightning_moe.checkpoint import latest_checkpoint

    trainer.fit(model, datamodule=data, ckpt_path=latest_checkpoint("outputs/run/checkpoints"))  # None: start fresh
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_warn

from lightning_moe.checkpoint.state import PREVIOUS_SUFFIX, STAGING_SUFFIX

COMMIT_FILE = "commit.json"
# What ModelCheckpoint names checkpoints (FILE_EXTENSION), plus the names a save passes through.
_CHECKPOINT_SUFFIXES = (".ckpt", ".ckpt" + PREVIOUS_SUFFIX, ".ckpt" + STAGING_SUFFIX)


def write_commit_marker(folder: Path, global_step: int) -> None:
    """Mark ``folder`` complete: list its files and their sizes in ``commit.json``, written last and durably."""
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    temporary = folder / (COMMIT_FILE + ".tmp")
    with open(temporary, "w") as handle:
        json.dump({"global_step": int(global_step), "files": files}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    temporary.rename(folder / COMMIT_FILE)  # the marker itself appears whole or not at all
    _sync_directory(folder)


def _sync_directory(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def incomplete_reason(checkpoint: str | Path) -> str | None:
    """Why ``checkpoint`` is not a complete checkpoint (``None`` when it is)."""
    path = Path(checkpoint)
    if path.name.endswith(STAGING_SUFFIX):
        return "a save into it was interrupted (staging folder)"
    if not path.exists():
        return "it does not exist" + (" (a link to a checkpoint not written yet)" if path.is_symlink() else "")
    if path.is_file():
        return None
    marker = path / COMMIT_FILE
    if not marker.is_file():
        return f"it has no commit marker {COMMIT_FILE}: its save did not finish"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError) as err:
        return f"its commit marker is unreadable ({err})"
    for name, size in files.items():
        part = path / name
        if not part.is_file():
            return f"{name} is missing"
        if part.stat().st_size != size:
            return f"{name} is truncated ({part.stat().st_size} of {size} bytes)"
    return None


def is_legacy_checkpoint(checkpoint: str | Path) -> bool:
    """A DCP folder written before commit markers existed: DCP's ``.metadata`` and ``meta.pt``, no marker.

    Those versions renamed a folder to its final name only once complete, so one named explicitly
    is loaded (with a warning); ``latest_checkpoint`` never picks it.
    """
    path = Path(checkpoint)
    return (
        path.is_dir()
        and not (path / COMMIT_FILE).exists()
        and (path / ".metadata").is_file()
        and (path / "meta.pt").is_file()
    )


def require_complete(checkpoint: str | Path) -> None:
    """Raise ``ValueError`` naming ``checkpoint`` and why, unless it is complete (or a legacy folder, with a warning)."""
    reason = incomplete_reason(checkpoint)
    if reason is None:
        return
    if not Path(checkpoint).is_symlink() and not Path(checkpoint).exists():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
    if is_legacy_checkpoint(checkpoint):
        rank_zero_warn(
            f"{checkpoint} has no commit marker {COMMIT_FILE} (written by lightning-moe before markers existed):"
            " loading it as complete"
        )
        return
    raise ValueError(
        f"checkpoint {checkpoint} is incomplete: {reason}; resume from a complete one"
        " (ckpt_path=auto picks the newest complete checkpoint of the run)"
    )


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The most recently committed complete checkpoint in ``directory``, or ``None`` (start fresh).

    Incomplete ones (an interrupted save, a missing or truncated file) are skipped with a warning
    naming each. Every rank scans the same folder; the strategy loads global rank 0's choice.
    """
    folder = Path(directory)
    if not folder.is_dir():
        return None
    newest: tuple[float, Path] | None = None
    for entry in sorted(folder.iterdir()):
        if not entry.name.endswith(_CHECKPOINT_SUFFIXES):
            continue
        reason = incomplete_reason(entry)
        if reason is not None:
            rank_zero_warn(f"skipping checkpoint {entry}: {reason}")
            continue
        target = entry.resolve()
        committed_at = (target if target.is_file() else target / COMMIT_FILE).stat().st_mtime
        if newest is None or committed_at > newest[0]:
            newest = (committed_at, entry)
    return None if newest is None else newest[1]
