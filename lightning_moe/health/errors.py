"""How an unhealthy run stops: the exit codes a launcher reads, and the marker that keeps a
persistent fault from looping through restarts.

- :data:`EXIT_RESTART` (16): the fault is in the machine, not in the run (too many transient
  faults, gradients that differ when a step runs again). Restart the job, on other nodes if the
  scheduler can; ``ckpt_path=auto`` resumes from the newest complete checkpoint.
- :data:`EXIT_PERSISTENT` (17): the step gives non-finite values every time it runs (data or
  numerics). A restart would fail the same way: fix the cause first.

Megatron-LM's rerun state machine uses the same two numbers for the same two cases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_moe.callbacks.summary import write_json_atomic

__all__ = [
    "EXIT_PERSISTENT",
    "EXIT_RESTART",
    "FAULT_MARKER",
    "ROLLBACK_MARKER",
    "PersistentFaultError",
    "RestartRequestedError",
    "RunHealthError",
    "check_no_persistent_fault",
    "write_fault_marker",
]

EXIT_RESTART = 16
EXIT_PERSISTENT = 17
# In the run directory: written when a persistent fault stops the run, read when it starts again.
FAULT_MARKER = Path("health") / "persistent_fault.json"
# In the run directory: written when a loss spike asks for a rollback, read by the restarted run.
ROLLBACK_MARKER = Path("health") / "rollback.json"


class RunHealthError(RuntimeError):
    """A health check stopped the run; ``exit_code`` is what ``python -m lightning_moe.train`` exits with."""

    exit_code = 1

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.details = details or {}


class RestartRequestedError(RunHealthError):
    """Stop and ask the launcher for a restart (:data:`EXIT_RESTART`)."""

    exit_code = EXIT_RESTART


class PersistentFaultError(RunHealthError):
    """Stop for good: the fault repeats on the same data (:data:`EXIT_PERSISTENT`)."""

    exit_code = EXIT_PERSISTENT


def write_fault_marker(run_dir: Path, details: dict[str, Any]) -> Path:
    """Record a persistent fault in ``run_dir`` (atomically), so that a restart of the job stops at once."""
    path = Path(run_dir) / FAULT_MARKER
    write_json_atomic(path, details)
    return path


def check_no_persistent_fault(run_dir: Path) -> None:
    """Raise :class:`PersistentFaultError` when an earlier attempt of this run stopped on a persistent
    fault: a launcher that restarts on any exit code (torchrun ``--max-restarts``) ends at once instead
    of failing the same step again."""
    path = Path(run_dir) / FAULT_MARKER
    if path.exists():
        fault = json.loads(path.read_text())
        raise PersistentFaultError(
            f"an earlier attempt of this run stopped on a persistent fault at step {fault.get('step')} (rank"
            f" {fault.get('rank')}, {fault.get('where')} of {fault.get('module')});"
            f" it would fail again: fix its cause (the data samples or the module it names), then delete {path}"
            " to resume, or start the run in a new directory"
        )
