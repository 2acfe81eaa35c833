"""End a rank that stopped making collective progress, and leave the evidence behind.

A rank that never reaches a collective (stuck in data loading, a deadlock, a debugger) leaves its
peers blocked inside it; a process-group timeout ends those peers with a transport error that names
no collective, and the stuck rank itself runs on. The watchdog reads torch's flight recorder (the
last collectives each rank issued, with their process group and time) from a thread: when this rank
issued no collective for 95% of the process-group timeout it writes every thread's Python stack to
``stack_file``, prints an error naming the collective it waits in (or the last one it finished),
and ends the process with exit code 1. So every rank of a hung job exits within the timeout, each
with its stacks on disk. A rank that a launcher stops first (torchrun sends SIGTERM to the others
once one rank failed) writes its stacks on the signal.

"No collective issued for that long" is the rule: a rank that computes that long without any
collective (a first step that compiles for longer than a short timeout, say) counts as hung too.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_moe._compat import flight_recorder_entries, resolve_process_group

# Entries torch's flight recorder keeps per process (only the newest is read; the dump stays small).
FLIGHT_RECORDER_ENTRIES = 64
# The watchdog fires at this share of the process-group timeout: before the backend's own timeout error
# (at the full timeout) unwinds a rank blocked in a collective, so that its stacks still show the wait.
FIRES_AT = 0.95


def enable_flight_recorder() -> None:
    """Have torch record the collectives of the process groups created from now on (``TORCH_FR_BUFFER_SIZE``,
    unless the user set it); call before ``init_process_group``."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))


@dataclass(frozen=True)
class Collective:
    """One flight-recorder entry: what a rank issued, on which group, when, and whether it finished."""

    name: str  # e.g. "all_to_all" (the recorder's "gloo:all_to_all" without the backend)
    group: str  # the group's description (a mesh dim such as "mesh_ep") or its name
    ranks: list[int] | None  # global ranks of the group (None: the group is gone)
    sequence: int
    issued_at: float  # time.time() seconds
    finished: bool

    def describe(self) -> str:
        return f"{self.name} on process group {self.group!r} (ranks {self.ranks}, collective #{self.sequence})"


def newest_collective() -> Collective | None:
    """The collective this process issued last, from torch's flight recorder (``None``: none recorded)."""
    trace = flight_recorder_entries()
    entries = (trace or {}).get("entries") or []
    if not entries:
        return None
    entry = max(entries, key=lambda e: e["record_id"])
    pg_name, pg_desc = entry["process_group"]
    status = trace.get("pg_status", {}).get(str(entry["pg_id"]), {})
    finished = int(status.get("last_completed_collective", -1)) >= entry["collective_seq_id"]
    return Collective(
        name=entry["profiling_name"].split(":")[-1],
        group=pg_desc if pg_desc and pg_desc != "undefined" else pg_name,
        ranks=_group_ranks(pg_name),
        sequence=entry["collective_seq_id"],
        issued_at=entry["time_created_ns"] / 1e9,
        finished=finished,
    )


def _group_ranks(name: str) -> list[int] | None:
    # The recorder's own group table is empty for gloo groups (torch 2.13): ask c10d for the ranks.
    try:
        return dist.get_process_group_ranks(resolve_process_group(name))
    except (KeyError, ValueError, RuntimeError):
        return None


class HangWatchdog:
    """A thread that ends this rank once it issued no collective for ``FIRES_AT * timeout`` seconds.

    :class:`lightning_moe.MoE5DStrategy` runs one per rank from the first training batch to the end
    of fit, with its process-group ``timeout``, the stacks going to
    ``<default_root_dir>/stacks/rank<r>.txt``. Example::

        enable_flight_recorder()            # before init_process_group
        watchdog = HangWatchdog(600.0, Path("run/stacks/rank0.txt"), rank=0).start()
        ...                                 # training; a hang ends the process with exit code 1
        watchdog.stop()
    """

    def __init__(self, timeout: float, stack_file: Path, rank: int) -> None:
        if timeout <= 0:
            raise ValueError(f"HangWatchdog timeout={timeout}: give a positive number of seconds")
        self.timeout, self.stack_file, self.rank = timeout, Path(stack_file), rank
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"hang-watchdog-rank{rank}", daemon=True)
        self.running = False

    def start(self) -> HangWatchdog:
        """Start watching; calling it again does nothing."""
        if self.running:
            return self
        self.running = True
        self._started_at = time.time()
        self.stack_file.parent.mkdir(parents=True, exist_ok=True)
        self._stacks = open(self.stack_file, "a")  # noqa: SIM115 - open until stop(), for the signal handler
        # A launcher that ends a job sends SIGTERM first (torchrun stops the other ranks once one failed):
        # the stacks are written then, from C, even while the main thread is blocked in a collective.
        faulthandler.register(signal.SIGTERM, file=self._stacks, all_threads=True, chain=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread and the SIGTERM dump; a run that never hung leaves no stack file behind."""
        if not self.running:
            return
        self.running = False
        self._stopped.set()
        self._thread.join()
        faulthandler.unregister(signal.SIGTERM)
        self._stacks.close()
        if self.stack_file.stat().st_size == 0:
            self.stack_file.unlink()
            with contextlib.suppress(OSError):  # other ranks' files may be there
                self.stack_file.parent.rmdir()

    def report(self, what: str) -> str:
        """Write every thread's stack to ``stack_file`` (after ``what``); return the error naming the collective."""
        collective = newest_collective()
        if collective is None:
            where = "no collective recorded"
        elif collective.finished:
            where = f"last collective {collective.describe()} finished {time.time() - collective.issued_at:.1f} s ago"
        else:
            where = f"waiting in {collective.describe()} for {time.time() - collective.issued_at:.1f} s"
        message = f"rank {self.rank}: {what}; {where}. Python stacks of every thread: {self.stack_file}"
        self._stacks.write(f"{message}\n")
        self._stacks.flush()
        faulthandler.dump_traceback(self._stacks, all_threads=True)
        return message

    def _watch(self) -> None:
        # The newest issue time is the rank's last sign of progress; sleep until it is `timeout` old.
        while not self._stopped.is_set():
            collective = newest_collective()
            progress = max(self._started_at, collective.issued_at if collective else 0.0)
            remaining = progress + FIRES_AT * self.timeout - time.time()
            if remaining > 0:
                self._stopped.wait(remaining)
                continue
            print(
                self.report(
                    f"no collective issued for {time.time() - progress:.1f} s "
                    f"({FIRES_AT:.0%} of the process-group timeout, {self.timeout:g} s)"
                ),
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)  # the main thread may be blocked in C++ (a collective) and never see an exception


def hang_watchdog(timeout: Any, stack_dir: Path, rank: int, world_size: int) -> HangWatchdog | None:
    """A :class:`HangWatchdog` (not started) for a process-group ``timeout`` (``timedelta``; ``None``: no
    watchdog), writing to ``stack_dir/rank<r>.txt``. ``None`` for one process (no peer to wait for),
    and when torch's flight recorder recorded nothing (it was not enabled before the process group was
    created): the watchdog would then see no progress at all."""
    if timeout is None or world_size < 2 or newest_collective() is None:
        return None
    return HangWatchdog(timeout.total_seconds(), Path(stack_dir) / f"rank{rank}.txt", rank)
