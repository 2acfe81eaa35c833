"""Atomic checkpoint saves, in the foreground or in the background (DCP ``async_save``).

A save writes ``<path>.staging`` on every rank; global rank 0 then writes the commit marker
(:mod:`lightning_moe.checkpoint.commit`) and swaps the staging folder in: ``<path>`` is renamed to
``<path>.previous``, the staging folder to ``<path>``, and the previous one removed. A process
killed at any moment leaves the previous complete checkpoint (:func:`resolve_checkpoint_path`,
:func:`latest_checkpoint` find it).

In the background, the tensors are copied to host memory before ``save`` returns (training may
change them at once); a thread writes them and rank 0 commits when every rank is done. At most
one save is in flight: the next one, a removal of an older checkpoint and :meth:`wait` wait for it.

Example::

    writer = CheckpointWriter(asynchronous=True)
    writer.save(tensors, metadata, Path("ckpt/step_000004.ckpt"), global_step=4, is_global_zero=rank == 0, barrier=dist.barrier)
    ...  # training goes on
    writer.wait()  # before exit
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_moe.checkpoint.commit import COMMIT_FILE, write_commit_marker
from lightning_moe.checkpoint.state import METADATA_FILE, PREVIOUS_SUFFIX, STAGING_SUFFIX


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint dict as (DCP tensors: ``state_dict``, ``optimizer_<i>``; the rest for ``meta.pt``)."""
    rest = dict(checkpoint)
    tensors = {"state_dict": rest.pop("state_dict")}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(rest.pop("optimizer_states", []))})
    return tensors, rest


def staging_path(path: Path) -> Path:
    return path.with_name(path.name + STAGING_SUFFIX)


def commit(path: Path, global_step: int) -> None:
    """Rank 0, once every rank wrote ``<path>.staging``: mark it complete and swap it in for ``path``."""
    staging, previous = staging_path(path), path.with_name(path.name + PREVIOUS_SUFFIX)
    write_commit_marker(staging, global_step)
    remove_checkpoint(previous)
    if path.exists() or path.is_symlink():
        path.rename(previous)
    staging.rename(path)
    remove_checkpoint(previous)


def save_file_atomically(
    path: Path, write: Callable[[Path], None], *, is_global_zero: bool, barrier: Callable[[], None]
) -> None:
    """A single-file checkpoint: ``write(<path>.staging)`` (Lightning's CheckpointIO, rank 0), then rename it to ``path``."""
    staging = staging_path(path)
    write(staging)
    barrier()
    if is_global_zero:
        if path.is_dir():  # a DCP folder of an earlier save under this name
            remove_checkpoint(path)
        staging.replace(path)
    barrier()


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint; a folder loses its commit marker first, so a removal cut short leaves no complete-looking folder."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        (path / COMMIT_FILE).unlink(missing_ok=True)
        shutil.rmtree(path)


class CheckpointWriter:
    """Writes DCP checkpoint folders atomically on every rank; ``asynchronous`` writes them in a background thread."""

    def __init__(self, asynchronous: bool = False) -> None:
        self.asynchronous = asynchronous
        self._in_flight: Future | None = None  # written on this rank (and, on rank 0, committed)
        self._after_commit: list[Path] = []  # removals that wait for the save in flight
        self._lock = threading.Lock()  # the writer thread empties _after_commit
        self._group: Any = None

    def save(
        self,
        tensors: dict[str, Any],
        metadata: dict[str, Any],
        path: Path,
        *,
        global_step: int,
        is_global_zero: bool,
        barrier: Callable[[], None],
    ) -> None:
        """Write ``tensors`` (DCP) and ``metadata`` (``meta.pt``) as the checkpoint folder ``path``; every rank calls it."""
        self.wait()
        staging = staging_path(path)
        if is_global_zero:
            remove_checkpoint(staging)  # left by a save that was interrupted
        barrier()
        if not self.asynchronous:
            dcp.save(tensors, checkpoint_id=staging)
            if is_global_zero:
                torch.save(metadata, staging / METADATA_FILE)
            barrier()
            if is_global_zero:
                commit(path, global_step)
            barrier()
            return
        written = dcp.async_save(tensors, checkpoint_id=staging, process_group=self._checkpoint_group())
        written = getattr(written, "upload_completion", written)  # torch versions that stage asynchronously
        if is_global_zero:
            staging.mkdir(parents=True, exist_ok=True)
            torch.save(metadata, staging / METADATA_FILE)
        self._in_flight = self._committed_when_written(written, path, global_step) if is_global_zero else written

    def _committed_when_written(self, written: Future, path: Path, global_step: int) -> Future:
        # DCP's save ends with a collective over the ranks: once rank 0's write is done, every
        # rank's shards and the .metadata are on disk.
        committed: Future = Future()

        def finish(done: Future) -> None:
            try:
                done.result()
                commit(path, global_step)
                with self._lock:  # remove() queues nothing more once the save reads as done
                    for removal in self._after_commit:
                        remove_checkpoint(removal)
                    self._after_commit.clear()
                    committed.set_result(None)
            except BaseException as err:  # noqa: BLE001 - re-raised by wait() in the training thread
                committed.set_exception(err)

        written.add_done_callback(finish)
        return committed

    def _checkpoint_group(self) -> Any:
        """A gloo group of its own: the writer thread's collectives never interleave with training's."""
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def remove(self, path: Path) -> None:
        """Delete a checkpoint (rank 0); while a save is in flight, only once it is committed."""
        with self._lock:
            if self._in_flight is not None and not self._in_flight.done():
                self._after_commit.append(path)
                return
        remove_checkpoint(path)

    def wait(self) -> None:
        """Block until the save in flight is written and committed; re-raise its error."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()
