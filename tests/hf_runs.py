"""Run a test script in a subprocess on one process or under torchrun (Lightning's launcher
re-executes sys.argv, so a multi-process Trainer never starts inside pytest)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.conftest import close_pools

ROOT = Path(__file__).resolve().parents[1]


def run_script(
    script: Path, args: Sequence[str], world: int, cwd: Path = ROOT, env: Mapping[str, str] | None = None, timeout: int = 900
) -> None:
    """``python script *args`` (``world > 1``: under ``torchrun --nproc_per_node=world``), offline, one
    thread per process; ``AssertionError`` with the command and its output tails when it fails."""
    close_pools()  # the run's processes get the cores to themselves
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **(env or {}))
    launcher = [sys.executable]
    if world > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd = [*launcher, str(script), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
