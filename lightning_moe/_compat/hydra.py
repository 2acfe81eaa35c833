"""Hydra internals: its command-line parser and the basic sweeper's job expansion. Hydra is
imported inside each function, not when this module is.

Floors: hydra-core >= 1.3.
"""

from __future__ import annotations

from typing import Any


def hydra_args_parser() -> Any:
    """Hydra's own command-line parser (``hydra._internal.utils.get_args_parser``). Run on hydra-core 1.3.
    Checked on: hydra-core 1.3-1.3."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def hydra_sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The basic sweeper's expansion of sweep overrides into jobs, in job order
    (``hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments``). Run on hydra-core 1.3.
    Checked on: hydra-core 1.3-1.3."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    return [list(job) for batch in batches for job in batch]
