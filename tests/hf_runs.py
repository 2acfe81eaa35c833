"""Run a test script in a subprocess on one process or under torchrun (Lightning's launcher
re-executes sys.argv, so a multi-process Trainer never starts inside pytest), or tests/scripts/hf_train.py's
training on the ranks of the persistent gloo test pool."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.dist_pool import close_pools, pool_of, trim_pools
from tests.launched_rank import launched_rank

ROOT = Path(__file__).resolve().parents[1]


def run_script(
    script: Path,
    args: Sequence[str],
    world: int,
    cwd: Path = ROOT,
    env: Mapping[str, str] | None = None,
    timeout: int = 900,
) -> None:
    """``python script *args`` (``world > 1``: under ``torchrun --nproc_per_node=world``), offline, one
    thread per process; ``AssertionError`` with the command and its output tails when it fails."""
    trim_pools()  # the launched processes get the cores but for a few idle pool ranks
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **(env or {}))
    launcher = [sys.executable]
    if world > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd = [*launcher, str(script), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


def train_hf_in_pool(layout: Mapping[str, int], out: Path, save_hf: bool, families: Sequence[str]) -> None:
    """What ``tests/scripts/hf_train.py`` does under ``torchrun`` (no layout: run plainly), on the ranks of a
    test pool of ``prod(layout)`` processes instead of new ones: every family in turn, the same files in ``out``.

    Lightning sees the ranks as already launched (``LOCAL_RANK`` set, as under torchrun); only the
    start-up of the processes and their imports are saved. A pipeline layout leaves the lazily created
    MoE process groups different between the stages (see test_hf_trainer.LAYOUTS), so its pool is closed
    after it: a later fit in the same processes would hang.
    """
    world = 1
    for size in layout.values():
        world *= size
    pool = pool_of(world)  # the run's processes get the cores to themselves
    try:
        for family in families:  # one task a family: hf_train.main's loop, each well within the pool's task timeout
            pool.run(_train_hf_on_this_rank, layout=dict(layout), out=str(out), save_hf=save_hf, family=family)
    finally:
        if layout.get("pp", 1) > 1:
            close_pools()


def _train_hf_on_this_rank(layout: dict, out: str, save_hf: bool, family: str) -> None:
    import gc

    import torch.distributed as dist

    # Lightning takes the processes as launched (torchrun's variables); WORLD_SIZE is what the script
    # reads for the Trainer's devices.
    try:
        with launched_rank(env={"WORLD_SIZE": str(dist.get_world_size()), "HF_HUB_OFFLINE": "1"}):
            from tests.scripts import hf_train

            Path(out).mkdir(parents=True, exist_ok=True)
            hf_train.train_one(family, layout, Path(out), save_hf)
    finally:
        gc.collect()  # as hf_train.main: this family's module and trainer are gone before the next fit
