"""A verification run as its ranks wrote it (see :mod:`lightning_moe.verify.worker`): losses, step-1
gradients, initial and final parameters, the batches, the module order and outputs at step 1."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class RunData:
    """What one run's ranks wrote (see :mod:`lightning_moe.verify.worker`)."""

    path: Path
    ranks: list[dict[str, Any]]
    errors: list[dict[str, Any]]

    @classmethod
    def load(cls, path: Path) -> RunData:
        ranks = [torch.load(p, weights_only=False) for p in sorted(path.glob("rank*.pt"))]
        errors = [json.loads(p.read_text()) for p in sorted(path.glob("error_rank*.json"))]
        return cls(path, sorted(ranks, key=lambda r: r["rank"]), errors)

    @property
    def losses(self) -> list[float]:
        for rank in self.ranks:
            if rank["losses"] is not None:
                return [float(x) for x in rank["losses"]]
        return []

    def _merged(self, key: str) -> dict[str, torch.Tensor | None]:
        merged: dict[str, torch.Tensor | None] = {}
        for rank in self.ranks:
            merged.update(rank.get(key) or {})
        return merged

    @property
    def grads(self) -> dict[str, torch.Tensor | None]:
        return self._merged("grads")

    @property
    def final(self) -> dict[str, torch.Tensor | None]:
        return self._merged("final")

    @property
    def initial(self) -> dict[str, torch.Tensor | None]:
        return self._merged("initial")

    @property
    def routing(self) -> dict[str, dict[str, Any]]:
        """Routing settings of the MoE layers (``load_balancing``, ...), by module name."""
        found: dict[str, dict[str, Any]] = {}
        for rank in self.ranks:
            found.update(rank.get("routing") or {})
        return found

    @property
    def types(self) -> dict[str, str]:
        types: dict[str, str] = {}
        for rank in self.ranks:
            types.update(rank["types"])
        return types

    @property
    def sizes(self) -> dict[str, int]:
        return self.ranks[0]["sizes"] if self.ranks else {}

    def order(self, key: str = "start_order") -> list[str]:
        """Module names in execution order at step 1 (``start_order``: forward start, ``end_order``: completion)."""
        if not self.ranks:
            return []
        by_stage: dict[int, list[str]] = {}
        for rank in self.ranks:
            by_stage.setdefault(rank["coords"]["pp"], rank[key])
        seen: dict[str, None] = {}
        for stage in sorted(by_stage):
            for name in by_stage[stage]:
                seen.setdefault(name, None)
        return list(seen)

    def dropout(self) -> list[str]:
        return self.ranks[0]["dropout"] if self.ranks else []
