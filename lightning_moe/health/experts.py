"""Dying experts: an expert that gets almost no tokens for many steps, a layer that stays lopsided."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ExpertStarvation"]


@dataclass
class ExpertStarvation:
    """Watch the tokens per expert of each optimizer step (the global batch, ``health.expert``).

    An expert below ``min_load_fraction`` of its fair share (tokens / experts) for ``patience``
    consecutive steps is reported once (again only after it recovered and starved again), and so is a
    layer whose max/mean load stays above ``max_load_ratio`` for ``patience`` steps (null: not
    watched). ``patience=0`` turns the watch off.

    Example::

        watch = ExpertStarvation(min_load_fraction=0.1, patience=3)
        for step in range(3):
            found = watch.observe(step, [[100.0, 100.0, 100.0, 0.0]])
        found   # [{"kind": "starving_expert", "layer": 0, "expert": 3, "step": 2, ...}]
    """

    min_load_fraction: float = 0.05
    patience: int = 200
    max_load_ratio: float | None = 4.0
    _low_streak: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)
    _lopsided_streak: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.min_load_fraction < 1:
            raise ValueError(f"health.expert.min_load_fraction={self.min_load_fraction} must be in [0, 1)")
        if self.patience < 0:
            raise ValueError(f"health.expert.patience={self.patience} must be >= 0 (0: off)")
        if self.max_load_ratio is not None and self.max_load_ratio <= 1:
            raise ValueError(f"health.expert.max_load_ratio={self.max_load_ratio} must be > 1 (or null)")

    def reset(self) -> None:
        """Forget the streaks (a new fit counts them again)."""
        self._low_streak.clear()
        self._lopsided_streak.clear()

    def observe(self, step: int, counts: list[list[float]]) -> list[dict[str, float | int | str]]:
        """The step's tokens per expert, one list per MoE layer; returns what became reportable."""
        if not self.patience:
            return []
        found: list[dict[str, float | int | str]] = []
        for layer, loads in enumerate(counts):
            if not loads:
                continue
            mean = sum(loads) / len(loads)
            if mean <= 0:
                continue
            for expert, load in enumerate(loads):
                streak = _advance(self._low_streak, (layer, expert), load < self.min_load_fraction * mean)
                if streak == self.patience:
                    found.append(
                        {
                            "kind": "starving_expert",
                            "layer": layer,
                            "expert": expert,
                            "step": step,
                            "load_fraction": load / mean,
                            "steps": streak,
                        }
                    )
            if self.max_load_ratio is not None:
                ratio = max(loads) / mean
                streak = _advance(self._lopsided_streak, layer, ratio > self.max_load_ratio)
                if streak == self.patience:
                    found.append(
                        {
                            "kind": "lopsided_layer",
                            "layer": layer,
                            "step": step,
                            "max_over_mean": ratio,
                            "steps": streak,
                        }
                    )
        return found


def _advance(streaks: dict[Any, int], key: Any, holds: bool) -> int:
    """One more step of ``key``'s streak when the condition ``holds``, else back to 0; returns it."""
    streaks[key] = streaks.get(key, 0) + 1 if holds else 0
    return streaks[key]
