"""A checkpoint save that a test kills (SIGKILL) while its files are being written.

``python tests/scripts/interrupted_save.py <folder> sync|async``: saves ``<folder>/last.ckpt``
(weights all 2.0) through :class:`lightning_moe.checkpoint.writer.CheckpointWriter` on a 1-rank
gloo group, then saves it again (weights 4.0), as ``ModelCheckpoint(save_last=True)`` does at the
next period. The second save blocks once its shard file is written and synced, before DCP's
``.metadata``: the process is then what a job killed mid-write is. It prints ``blocked`` from the
writing thread and, with ``async``, ``training goes on`` from the main thread once ``save``
returned, then waits for the kill.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_moe.checkpoint.writer import CheckpointWriter


def main(folder: Path, mode: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=0, world_size=1)
    writer = CheckpointWriter(asynchronous=mode == "async")
    target = folder / "checkpoints" / "last.ckpt"

    def save(value: float, step: int) -> None:
        tensors = {"state_dict": {"weight": torch.full((256, 64), value)}}
        writer.save(tensors, {"global_step": step}, target, global_step=step, is_global_zero=True, barrier=dist.barrier)

    save(2.0, step=2)
    writer.wait()
    synced = os.fsync

    def block_after_sync(descriptor: int) -> None:
        synced(descriptor)
        print("blocked", flush=True)
        threading.Event().wait()

    os.fsync = block_after_sync
    save(4.0, step=4)
    print("training goes on", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
