"""Training runs for benchmarks: ``python -m lightning_moe.train`` in a subprocess, one thread per rank."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_training(
    overrides: Sequence[str], run_dir: Path, env: Mapping[str, str] | None = None, timeout: float = 900
) -> None:
    """Train with ``overrides`` into ``run_dir`` (Lightning's launcher starts the other ranks), from
    the repository root with it on ``PYTHONPATH`` (benchmark callbacks are ``_target_``s there);
    ``RuntimeError`` with the run's output tail when it fails."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "lightning_moe.train", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
