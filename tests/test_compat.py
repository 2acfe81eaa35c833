"""Private APIs live in lightning_moe/_compat.py only, and the version floors it states are enforced."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lightning_moe
from lightning_moe import _compat

PACKAGE = Path(lightning_moe.__file__).resolve().parent
# Imports or calls of private torch / Lightning / Hydra names.
PRIVATE_USE = re.compile(
    r"hydra\._internal|import .*_composable|import .*_functional_collectives|\bmesh\]?\._flatten\(|torch\._grouped_mm\(|"
    r"from lightning[\w.]* import _|\bc10d\._[a-z]|set_force_sum_reduction_for_comms\(|\bschedule\.eval\("
)


def test_private_apis_are_used_only_through_compat():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE_USE.search(line.split("#")[0]):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "private API used outside lightning_moe/_compat.py:\n" + "\n".join(offenders)


def test_pipeline_refuses_a_torch_older_than_its_stage_internals(monkeypatch):
    monkeypatch.setattr(_compat.torch, "__version__", "2.11.0+cu130")
    with pytest.raises(RuntimeError, match=r"pipeline parallelism \(pp > 1\) needs torch >= 2.13, found 2.11.0"):
        _compat.require_pipeline_stage_internals()
    monkeypatch.setattr(_compat.torch, "__version__", "2.13.0+cpu")
    _compat.require_pipeline_stage_internals()


def test_pyproject_floors_match_compat():
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    assert '"torch>=2.11"' in text and '"lightning>=2.6"' in text
