"""A hung job ends: a rank that stops before a collective makes every rank exit with an error naming the
collective, within the process-group timeout, each rank's Python stacks in <run dir>/stacks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import ROOT, TINY_RUN
from tests.dist_pool import close_pools

TIMEOUT_S = 15
# Writing the stacks, the launcher's shutdown and a loaded 2-core machine.
MARGIN_S = 10
STOP_STEP = 3


def _processes_with(text: str) -> list[int]:
    """Ids of the live processes whose command line holds ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("State:"))
            except (OSError, StopIteration):
                continue
            if text in cmdline and "zombie" not in state:
                found.append(int(proc.name))
    return found


@pytest.mark.slow
def test_a_stopped_rank_ends_every_rank_with_the_collective_and_the_stacks(tmp_path):
    run_dir = tmp_path / "run"
    close_pools()
    # torchrun starts both ranks at once: with Lightning's launcher rank 1 starts after rank 0's imports,
    # and rank 0 waits for it to join for at most the process-group timeout, too short on loaded cores.
    # torchrun also stops rank 0 (SIGTERM) once rank 1 failed, the case a cluster job meets.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "lightning_moe.train",
        *TINY_RUN,
        "parallel=ep2",
        f"parallel.timeout={TIMEOUT_S}",
        "+callbacks.fault._target_=tests.faults.StopRank",
        "+callbacks.fault.rank=1",
        f"+callbacks.fault.step={STOP_STEP}",
        f"hydra.run.dir={run_dir}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    ended = time.time()
    output = proc.stdout + proc.stderr

    assert proc.returncode != 0, output[-3000:]
    assert "exitcode: 1" in output  # torchrun's report of the rank that failed first
    stopped = float(re.search(r"rank 1 stops at step \d+ at ([\d.]+)", output).group(1))
    assert ended - stopped < TIMEOUT_S + MARGIN_S, output[-3000:]
    assert not _processes_with(f"hydra.run.dir={run_dir}"), "a rank of the hung job is still running"
    # Rank 0 waits inside the step's first collective (an FSDP all-gather) and says so; rank 1 never got there.
    fired = rf"no collective issued for [\d.]+ s \(95% of the process-group timeout, {TIMEOUT_S} s\)"
    collective = r"(all_gather|all_to_all|all_reduce|reduce_scatter|broadcast)"
    assert re.search(rf"rank 0: {fired}; waiting in {collective} on process group '\w+' \(ranks \[0, 1\]", output), (
        output[-3000:]
    )
    assert re.search(rf"rank 1: {fired}; last collective {collective} on process group .* finished", output), output[
        -3000:
    ]
    stacks = {rank: (run_dir / "stacks" / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert (
        "torch/distributed" in stacks[0] and "in on_train_batch_start" in stacks[1] and "tests/faults.py" in stacks[1]
    )
