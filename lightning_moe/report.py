"""``python -m lightning_moe.report <multirun dir>``: one table and a few plots for a Hydra sweep.

Reads every job of a ``python -m lightning_moe.train --multirun`` output directory (numbered job
directories ``0/``, ``1/``, ... with ``summary.json`` and ``.hydra/overrides.yaml``) and writes, in
that directory:

- ``report.md``: a table with one row per job (swept values, layout, final loss, tokens/s, MFU,
  load imbalance, communication per step) and the plots below;
- ``loss_curves.png``: training loss per optimizer step, one line per job;
- ``load_imbalance.png``: load imbalance (max/mean tokens per expert, mean over MoE layers) per
  optimizer step, one line per job.

Every job of the sweep gets a row: a job without ``summary.json`` is ``failed`` (with the
exception from ``error.txt`` when the run wrote one), and a job the sweep planned but never
started (found through ``multirun.yaml``) is ``not run``. The table is printed too.

Examples::

    python -m lightning_moe.train -m 'experiment=[router_sweep,sweep_smoke]' hydra.sweep.dir=multirun/rs
    python -m lightning_moe.report multirun/rs          # writes multirun/rs/report.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lightning_moe._compat import hydra_sweep_jobs
from lightning_moe.callbacks.plots import plot_curves
from lightning_moe.layout import PARALLEL_DIMS


@dataclass
class Job:
    """One job of a sweep: its number, overrides, ``summary.json`` (None if missing) and status."""

    num: int
    overrides: list[str]
    summary: dict[str, Any] | None = None
    status: str = "ok"  # ok | failed | not run
    note: str = ""
    swept: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        values = " ".join(f"{k}={v}" for k, v in self.swept.items() if v)
        return f"#{self.num} {values}".strip()


@dataclass
class Report:
    """What :func:`write_report` produced: the jobs, the markdown table and the files written."""

    jobs: list[Job]
    table: str
    path: Path
    plots: list[Path]


class NoJobsError(ValueError):
    """The directory holds no sweep job."""


def _planned_overrides(sweep_dir: Path) -> list[list[str]] | None:
    """The jobs the basic sweeper planned, in job order, from ``multirun.yaml`` (None if unknown)."""
    path = sweep_dir / "multirun.yaml"
    if not path.is_file():
        return None
    # Hydra's own expansion of the sweep, so the job numbers match; internal API, hence the guard.
    try:
        hydra_cfg = OmegaConf.load(path).hydra
        if not str(hydra_cfg.sweeper.get("_target_", "")).endswith("BasicSweeper"):
            return None
        params = OmegaConf.to_container(hydra_cfg.sweeper.get("params") or {}, resolve=False)
        task = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)
        assert isinstance(params, dict) and isinstance(task, list)
        overrides = [f"{key}={value}" for key, value in params.items()] + [str(o) for o in task]
        return hydra_sweep_jobs(overrides)
    except Exception:  # noqa: BLE001 - an unexpected multirun.yaml: fall back to the job directories
        return None


def load_jobs(sweep_dir: str | Path) -> list[Job]:
    """Every job of ``sweep_dir``, in job order; raises :class:`NoJobsError` if there is none.

    Example::

        [(job.num, job.status) for job in load_jobs("multirun/rs")]   # [(0, "ok"), (1, "failed")]
    """
    sweep_dir = Path(sweep_dir)
    job_dirs = {int(p.name): p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()}
    planned = _planned_overrides(sweep_dir) or []
    count = max(len(planned), max(job_dirs, default=-1) + 1)
    if not count:
        raise NoJobsError(
            f"no jobs in {sweep_dir}: expected numbered job directories (0/, 1/, ...) written by "
            "`python -m lightning_moe.train --multirun ...`"
        )
    jobs = []
    for num in range(count):
        job_dir = job_dirs.get(num)
        overrides = planned[num] if num < len(planned) else []
        if job_dir is None:
            note = "planned by the sweep, never started" if num < len(planned) else "no job directory"
            jobs.append(Job(num, overrides, status="not run", note=note))
            continue
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        if overrides_file.is_file():
            overrides = [str(o) for o in OmegaConf.to_container(OmegaConf.load(overrides_file), resolve=False)]  # type: ignore[union-attr]
        jobs.append(_load_job(num, job_dir, overrides))
    _set_swept_values(jobs)
    return jobs


def _load_job(num: int, job_dir: Path, overrides: list[str]) -> Job:
    summary_file, error_file = job_dir / "summary.json", job_dir / "error.txt"
    if summary_file.is_file():
        try:
            return Job(num, overrides, summary=json.loads(summary_file.read_text()))
        except json.JSONDecodeError as err:
            return Job(num, overrides, status="failed", note=f"unreadable summary.json: {err}")
    if error_file.is_file():
        lines = error_file.read_text().strip().splitlines()
        return Job(num, overrides, status="failed", note=lines[0] if lines else "error.txt")
    return Job(num, overrides, status="failed", note="no summary.json (crashed, killed or still running)")


def _flatten_override(override: str) -> dict[str, str]:
    """``model.moe={a:1,b:2}`` -> ``{"model.moe.a": "1", "model.moe.b": "2"}``; ``x=3`` -> ``{"x": "3"}``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        (parsed,) = OverridesParser.create().parse_overrides([override])
    except Exception:  # noqa: BLE001 - show what cannot be parsed as it is
        key, _, value = override.partition("=")
        return {key: value}
    key = parsed.key_or_group
    if parsed.is_delete():
        return {key: "deleted"}
    value = parsed.value()
    if isinstance(value, dict):
        return {f"{key}.{k}": _format_value(v) for k, v in value.items()}
    return {key: parsed.get_value_element_as_str()}


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def _set_swept_values(jobs: list[Job]) -> None:
    """Fill ``job.swept`` with the overrides that differ between jobs (all of them for a single job)."""
    flat = [{k: v for o in job.overrides for k, v in _flatten_override(o).items()} for job in jobs]
    known = [values for job, values in zip(jobs, flat) if job.overrides]  # not the gaps in the numbering
    keys: list[str] = []
    for values in known:
        keys += [k for k in values if k not in keys]
    if len(known) > 1:
        keys = [k for k in keys if len({values.get(k) for values in known}) > 1]
    names = _short_names(keys)
    for job, values in zip(jobs, flat):
        job.swept = {names[k]: values.get(k, "") for k in keys}


def _short_names(keys: Sequence[str]) -> dict[str, str]:
    """The shortest dotted suffix of each key that is unique among ``keys``."""
    names = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if sum(k == suffix or k.endswith("." + suffix) for k in keys) == 1:
                break
        names[key] = suffix
    return names


def _layout(summary: dict[str, Any]) -> str:
    layout = summary.get("layout") or {}
    parts = [f"{dim}{layout[dim]}" for dim in PARALLEL_DIMS if layout.get(dim, 1) > 1]
    if layout.get("etp", layout.get("tp", 1)) != layout.get("tp", 1):
        parts.append(f"etp{layout['etp']}")
    if layout.get("fold_ep"):
        parts.append(f"fold_ep={layout['fold_ep']}")
    return " ".join(parts) or "single"


def _number(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "" if value is None else str(value)
    return f"{value:.{digits}g}"


def _integer(value: float | None) -> str:
    return f"{value:,.0f}" if isinstance(value, (int, float)) and math.isfinite(value) else _number(value)


def _bytes(value: float | None) -> str:
    if value is None:
        return ""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def _metrics(summary: dict[str, Any]) -> dict[str, str]:
    imbalance = (summary.get("moe_history") or {}).get("load_imbalance") or []
    comm = summary.get("comm")
    mfu = summary.get("mfu")
    return {
        "layout": _layout(summary),
        "final loss": _number(summary.get("final_loss")),
        "tokens/s": _integer(summary.get("tokens_per_second")),
        "MFU": f"{100 * mfu:.2g}%" if isinstance(mfu, (int, float)) else "",
        "imbalance (mean)": _number(sum(imbalance) / len(imbalance), 3) if imbalance else "",
        "imbalance (last)": _number(imbalance[-1], 3) if imbalance else "",
        "comm/step": _bytes(sum(v["bytes"] for v in comm.values())) if comm else "",
    }


METRIC_COLUMNS: tuple[str, ...] = (
    "layout", "final loss", "tokens/s", "MFU", "imbalance (mean)", "imbalance (last)", "comm/step",
)  # fmt: skip


def markdown_table(jobs: list[Job]) -> str:
    """One row per job: ``job``, ``status``, the swept values, :data:`METRIC_COLUMNS`, and ``note``
    when some job did not succeed."""
    swept = list(jobs[0].swept) if jobs else []
    with_note = any(job.status != "ok" for job in jobs)
    header = ["job", "status", *swept, *METRIC_COLUMNS, *(["note"] if with_note else [])]
    rows = []
    for job in jobs:
        metrics = _metrics(job.summary) if job.summary is not None else {}
        row = [str(job.num), job.status, *job.swept.values(), *(metrics.get(c, "") for c in METRIC_COLUMNS)]
        rows.append(row + ([job.note.replace("|", "\\|")] if with_note else []))
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(sweep_dir: str | Path, output: str | Path | None = None) -> Report:
    """Write ``report.md`` (or ``output``) and its plots for the sweep in ``sweep_dir``.

    Example::

        report = write_report("multirun/rs")
        print(report.table)
    """
    sweep_dir = Path(sweep_dir)
    jobs = load_jobs(sweep_dir)
    path = Path(output) if output is not None else sweep_dir / "report.md"
    done = [job for job in jobs if job.summary is not None]
    plots = []
    curves = {
        "loss_curves.png": ("training loss", "loss (mean over the global batch)", None, lambda s: s.get("losses")),
        "load_imbalance.png": (
            "load imbalance (mean over MoE layers)", "max / mean tokens per expert", 1.0,
            lambda s: (s.get("moe_history") or {}).get("load_imbalance"),
        ),
    }  # fmt: skip
    for filename, (title, ylabel, hline, read) in curves.items():
        series = {job.label: values for job in done if (values := read(job.summary))}
        if series:
            plot_curves(series, path.parent / filename, title=title, ylabel=ylabel, hline=hline)
            plots.append(path.parent / filename)
    table = markdown_table(jobs)
    counts = {status: sum(job.status == status for job in jobs) for status in ("ok", "failed", "not run")}
    summary_line = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    images = "\n\n".join(f"![{p.stem.replace('_', ' ')}]({p.name})" for p in plots)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# Sweep report: `{sweep_dir}`\n\n{len(jobs)} jobs: {summary_line}.\n\n{table}\n\n{images}\n\n"
        "Columns: swept overrides that differ between jobs; `layout`: parallel sizes above 1; `final loss`: "
        "training loss of the last optimizer step; `tokens/s`: training throughput (first step excluded); "
        "`MFU`: model FLOPs utilisation; `imbalance`: max/mean tokens per expert over the global batch, mean over "
        "MoE layers (1 is perfect balance), averaged over the steps and at the last step; `comm/step`: bytes one "
        "rank sent per optimizer step, all parallel dimensions.\n"
    )
    return Report(jobs, table, path, plots)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m lightning_moe.report <multirun dir> [--output report.md]``."""
    parser = argparse.ArgumentParser(prog="python -m lightning_moe.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a --multirun output directory (holds 0/, 1/, ...)")
    parser.add_argument("--output", type=Path, default=None, help="report path (default: <sweep_dir>/report.md)")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        report = write_report(args.sweep_dir, args.output)
    except NoJobsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(report.table)
    print(f"\nreport: {report.path}")
    for plot in report.plots:
        print(f"plot:   {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
