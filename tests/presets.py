"""The parallel presets this torch builds: the V pipeline schedules need torch >= 2.13
(lightning_moe._compat.V_SCHEDULE_MIN_TORCH); on the floor torch their presets are refused before any
work, which tests that build every preset must skip."""

from __future__ import annotations

import pytest
import torch
import yaml

TORCH_RELEASE = tuple(int(v) for v in torch.__version__.split(".")[:2])
NEEDS_V_SCHEDULE_TORCH = pytest.mark.skipif(TORCH_RELEASE < (2, 13), reason="the V schedules need torch >= 2.13")


def presets_this_torch_builds(options: list[str]) -> list:
    """Config options (``name`` or ``group=name``) as pytest params, a parallel preset that runs a V
    schedule marked to skip where this torch refuses it."""
    from lightning_moe.conf import CONF_DIR
    from lightning_moe.layout import V_SCHEDULES

    def runs_v_schedule(option: str) -> bool:
        path = CONF_DIR / "parallel" / f"{option.split('=')[-1]}.yaml"
        if not (option.startswith("parallel=") or "=" not in option) or not path.exists():
            return False
        return (yaml.safe_load(path.read_text()) or {}).get("pp_schedule") in V_SCHEDULES

    return [pytest.param(o, marks=NEEDS_V_SCHEDULE_TORCH) if runs_v_schedule(o) else o for o in options]


def long_where(params: list, is_long) -> list:
    """``params`` (names or pytest params of one value) with those whose name ``is_long`` marked ``long``
    (`make test-long`), their other marks kept."""
    marked = []
    for param in params:
        name, marks = (param.values[0], list(param.marks)) if hasattr(param, "values") else (param, [])
        marked.append(pytest.param(name, marks=[*marks, pytest.mark.long]) if is_long(name) else param)
    return marked
