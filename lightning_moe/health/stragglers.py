"""Stragglers: each rank's busy time per step (the step's wall time less its waits in collectives).

Every rank's step takes as long as the slowest one's, because collectives wait for it: wall time
cannot tell them apart. What differs is how long each rank *waits*. A :class:`CollectiveWaitClock`
adds up the host time spent inside torch.distributed's collectives, ``Work.wait`` and the functional
collectives' ``wait_tensor`` (on CPU/gloo that is the wait; on GPUs with NCCL the host returns at
once, so the busy time is the host's, not the device's). The slowest rank is the one with the most
busy time.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_moe._compat import wrap_distributed_functions
from lightning_moe.comm.traffic import C10D_SENT_BYTES, FUNCOL_SENT_BYTES

__all__ = ["CollectiveWaitClock", "StragglerDetection", "straggler_ratio"]

_BLOCKING_C10D = (*C10D_SENT_BYTES, "batch_isend_irecv", "barrier", "recv", "monitored_barrier")


@dataclass
class StragglerDetection:
    """Every ``every_n_steps`` optimizer steps, gather each rank's busy seconds of that step and log
    ``health/straggler_ratio`` (slowest / median) and ``health/slowest_rank``; above ``threshold`` a
    warning names the rank and its host (``health.straggler``; ``every_n_steps=0``: off).

    Example::

        StragglerDetection(every_n_steps=50, threshold=1.5)
    """

    every_n_steps: int = 100
    threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.every_n_steps < 0:
            raise ValueError(f"health.straggler.every_n_steps={self.every_n_steps} must be >= 0 (0: off)")
        if self.threshold <= 1:
            raise ValueError(f"health.straggler.threshold={self.threshold} must be > 1 (slowest / median, e.g. 1.5)")

    def measures(self, global_step: int) -> bool:
        """Whether the optimizer step running at ``global_step`` is measured (the first one is not:
        it holds the start-up)."""
        return bool(self.every_n_steps) and global_step > 0 and global_step % self.every_n_steps == 0


def straggler_ratio(busy_seconds: list[float]) -> tuple[float, int]:
    """``(slowest / median, slowest rank)`` of the ranks' busy seconds."""
    slowest = max(range(len(busy_seconds)), key=busy_seconds.__getitem__)
    median = statistics.median(busy_seconds)
    return busy_seconds[slowest] / max(median, 1e-9), slowest


class CollectiveWaitClock:
    """Host seconds spent inside collectives while :attr:`running`, from :meth:`install` to :meth:`uninstall`.

    The wrappers stay installed for the whole fit (a flag check per collective call when not
    running), below any per-step wrapping of the same functions (communication accounting), so that
    the two never undo each other. Nested calls count once.

    Example::

        clock = CollectiveWaitClock()
        clock.install()
        clock.start()
        dist.all_reduce(t)
        clock.seconds        # the time all_reduce blocked
        clock.uninstall()
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.running = False
        self._depth = 0
        self._restore: Callable[[], None] | None = None
        self._work_wait: Callable[..., Any] | None = None

    def start(self) -> None:
        self.seconds, self.running = 0.0, True

    def stop(self) -> float:
        self.running = False
        return self.seconds

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.running or self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self._depth -= 1

        return wrapper

    def install(self) -> None:
        if self._restore is not None:
            return
        self._restore = wrap_distributed_functions(
            c10d=dict.fromkeys(_BLOCKING_C10D, self._timed),
            functional=dict.fromkeys((*FUNCOL_SENT_BYTES, "wait_tensor"), self._timed),
        )
        self._work_wait = dist.Work.wait
        dist.Work.wait = self._timed(self._work_wait)  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None
        if self._work_wait is not None:
            dist.Work.wait = self._work_wait  # type: ignore[method-assign]
            self._work_wait = None
