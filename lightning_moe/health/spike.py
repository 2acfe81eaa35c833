"""Loss spikes: a robust z-score of each step's loss against the steps before it."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["SPIKE_ACTIONS", "SpikeDetection"]

SPIKE_ACTIONS = ("warn", "skip", "rollback")
# The median absolute deviation of a normal distribution is 0.6745 standard deviations.
_MAD_TO_STD = 1.4826


@dataclass
class SpikeDetection:
    """Flag a step whose loss lies more than ``zscore`` robust standard deviations above the median of
    the last ``window`` steps (``health.spike``). The spread is the median absolute deviation, so
    earlier spikes do not hide later ones. ``action``: ``warn`` (log it and go on), ``skip`` (drop
    the step's update, as for a non-finite step) or ``rollback`` (stop with exit code 16; the
    restarted run resumes from the newest periodic checkpoint and drops the updates of the steps
    from there to the spike, so their data never reaches the model); ``window=0`` turns detection
    off. A flagged step does not enter the window.

    Example::

        spikes = SpikeDetection(window=20, zscore=6.0)
        z = spikes.observe(loss)   # None until the window is full, then the step's robust z-score
    """

    window: int = 100
    zscore: float = 6.0
    action: str = "warn"

    def __post_init__(self) -> None:
        if self.window < 0 or self.window == 1 or self.window == 2:
            raise ValueError(f"health.spike.window={self.window}: use 0 (off) or at least 3 steps")
        if self.zscore <= 0:
            raise ValueError(f"health.spike.zscore={self.zscore} must be > 0 (e.g. 6.0)")
        if self.action not in SPIKE_ACTIONS:
            raise ValueError(f"health.spike.action={self.action!r} is not one of {', '.join(SPIKE_ACTIONS)}")
        self._losses: deque[float] = deque(maxlen=max(self.window, 1))

    def reset(self) -> None:
        """Forget the window (a new fit starts it again)."""
        self._losses.clear()

    def score(self, loss: float) -> float | None:
        """The robust z-score of ``loss`` against the window (None while it is not full, or off)."""
        if not self.window or len(self._losses) < self.window:
            return None
        median = statistics.median(self._losses)
        spread = _MAD_TO_STD * statistics.median(abs(x - median) for x in self._losses)
        # A flat window (spread 0) flags any rise above a relative 1e-6 of the loss.
        return (loss - median) / max(spread, 1e-6 * abs(median), 1e-12)

    def observe(self, loss: float) -> float | None:
        """Score ``loss``; it joins the window unless it is a spike. Returns the score, or None."""
        z = self.score(loss)
        if z is None or z <= self.zscore:
            self._losses.append(loss)
        return z

    def is_spike(self, z: float | None) -> bool:
        return z is not None and z > self.zscore
