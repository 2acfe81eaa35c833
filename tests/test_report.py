"""``python -m lightning_moe.report`` on hand-made sweep directories and on a real 2-job multirun with a
crash; the sweep experiments' grids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

from experiments.sweeps.layouts import sweep_override, valid_layouts
from lightning_moe.conf import CONF_DIR
from lightning_moe.report import load_jobs, main, write_report
from tests.cli import TINY_RUN
from tests.dist_pool import trim_pools


def _summary(final_loss: float, imbalance: list[float], ep: int = 1) -> dict:
    losses = [final_loss + 1.0, final_loss]
    return {
        "layout": {"tp": 1, "cp": 1, "ep": ep, "dp": 1, "pp": 1, "etp": 1},
        "losses": losses,
        "final_loss": final_loss,
        "tokens_per_second": 12345.6,
        "mfu": 0.0123,
        "moe_history": {"load_imbalance": imbalance},
        "comm": {"ep": {"bytes": 2.5e6, "calls": 10.0}, "dp": {"bytes": 0.5e6, "calls": 2.0}},
    }


def _job(sweep: Path, num: int, overrides: list[str], summary: dict | None = None, error: str | None = None) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))
    if error is not None:
        (job / "error.txt").write_text(error)


def _rows(table: str) -> list[list[str]]:
    lines = table.strip().splitlines()
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "sweep"
    common = "experiment=[router_sweep,sweep_smoke]"
    _job(sweep, 0, ["model.moe={load_balancing:aux_loss,aux_loss_coeff:0.01}", common], _summary(3.0, [2.0, 1.5]))
    _job(sweep, 1, ["model.moe={load_balancing:none,expert_bias:true}", common], _summary(3.2, [3.0, 4.0], ep=2))
    _job(sweep, 2, ["model.moe={load_balancing:sinkhorn}", common], error="ValueError: bad config\nmore")
    _job(sweep, 4, ["model.moe={load_balancing:aux_loss}", common])  # crashed before writing anything
    return sweep


def test_every_job_gets_a_row_and_failures_say_why(sweep):
    report = write_report(sweep)
    # No multirun.yaml: job 3 is only known as a gap in the numbering.
    assert [(job.num, job.status) for job in report.jobs] == [
        (0, "ok"),
        (1, "ok"),
        (2, "failed"),
        (3, "not run"),
        (4, "failed"),
    ]
    header = report.table.splitlines()[0]
    assert header.startswith("| job | status | load_balancing | aux_loss_coeff | expert_bias | layout | final loss |")
    rows = {row[0]: row for row in _rows(report.table)}
    assert rows["0"][:9] == ["0", "ok", "aux_loss", "0.01", "", "single", "3", "12,346", "1.2%"]
    assert rows["0"][9:12] == ["1.75", "1.5", "3 MB"]  # imbalance mean, last; comm bytes per step
    assert rows["1"][2:6] == ["none", "", "true", "ep2"]
    assert rows["2"][1] == "failed" and rows["2"][-1] == "ValueError: bad config"
    assert rows["3"][1:] == ["not run", *[""] * 10, "no job directory"]
    assert rows["4"][-1].startswith("no summary.json")
    text = report.path.read_text()
    assert report.path == sweep / "report.md" and report.table in text
    assert [p.name for p in report.plots] == ["loss_curves.png", "load_imbalance.png"]
    assert all(p.stat().st_size > 0 for p in report.plots)
    assert "![loss curves](loss_curves.png)" in text and "![load imbalance](load_imbalance.png)" in text


def test_jobs_the_sweep_planned_but_never_started_are_rows_too(tmp_path):
    sweep = tmp_path / "sweep"
    multirun = {
        "hydra": {
            "sweeper": {
                "_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                "params": {"seed": "1,2"},
            },
            "overrides": {"task": ["model.moe.top_k=1,2", "logger=csv"]},
            "sweep": {"dir": "${now:%H}"},  # unresolvable here: must not be resolved
        }
    }
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(multirun))
    _job(sweep, 0, ["seed=1", "model.moe.top_k=1", "logger=csv"], _summary(3.0, [2.0]))
    jobs = load_jobs(sweep)
    assert [(job.num, job.status) for job in jobs] == [(0, "ok"), (1, "not run"), (2, "not run"), (3, "not run")]
    assert jobs[3].overrides == ["seed=2", "model.moe.top_k=2", "logger=csv"]
    assert [job.swept for job in jobs] == [
        {"seed": "1", "top_k": "1"}, {"seed": "1", "top_k": "2"}, {"seed": "2", "top_k": "1"}, {"seed": "2", "top_k": "2"},
    ]  # fmt: skip


def test_a_directory_without_jobs_is_an_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 1
    assert "no jobs in" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_two_job_multirun_with_a_crash_then_report(tmp_path):
    """Job 0 trains; job 1 resumes from a checkpoint that does not exist and crashes in fit."""
    sweep = tmp_path / "sweep"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    train = [
        sys.executable, "-m", "lightning_moe.train", "--multirun", *TINY_RUN, "trainer.max_steps=3",
        "ckpt_path=null,/nonexistent/last.ckpt", f"hydra.sweep.dir={sweep}",
    ]  # fmt: skip
    trim_pools()  # the launched processes get the cores but for a few idle pool ranks
    proc = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0  # Hydra re-raises the failed job's exception after the sweep
    assert (sweep / "0" / "summary.json").is_file() and not (sweep / "1" / "summary.json").exists()

    report_cmd = [sys.executable, "-m", "lightning_moe.report", str(sweep)]
    proc = subprocess.run(report_cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    table = (sweep / "report.md").read_text()
    rows = _rows(table.split("\n\n")[2])
    assert [row[:3] for row in rows] == [["0", "ok", "null"], ["1", "failed", "/nonexistent/last.ckpt"]]
    assert rows[1][-1].startswith("FileNotFoundError: checkpoint /nonexistent/last.ckpt does not exist")
    assert rows[0][3] == "single" and float(rows[0][4]) > 0
    assert (sweep / "loss_curves.png").stat().st_size > 0 and (sweep / "load_imbalance.png").stat().st_size > 0
    assert "| 1 | failed | /nonexistent/last.ckpt |" in proc.stdout


def _sweep_params(experiment: str) -> dict[str, list]:
    params = yaml.safe_load((CONF_DIR / "experiment" / f"{experiment}.yaml").read_text())["hydra"]["sweeper"]["params"]
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    return {o.key_or_group: list(o.sweep_iterator()) for o in parsed}


def test_router_sweep_covers_every_balancing_method_with_a_coefficient_grid():
    (grid,) = _sweep_params("router_sweep").values()
    methods = {}
    for point in grid:
        name = "expert_bias" if point["expert_bias"] else point["load_balancing"]
        coefficient = point.get("aux_loss_coeff", point.get("bias_update_rate"))
        methods.setdefault(name, []).append(coefficient)
    assert methods == {
        "aux_loss": [1e-3, 1e-2, 1e-1], "seq_aux_loss": [1e-3, 1e-2, 1e-1], "global_aux_loss": [1e-3, 1e-2, 1e-1],
        "sinkhorn": [None], "none": [None], "expert_bias": [1e-3, 1e-2, 1e-1],
    }  # fmt: skip
    assert all(p["load_balancing"] == "none" for p in grid if p["expert_bias"])


def test_dispatcher_sweep_and_layout_sweep_grids():
    assert _sweep_params("dispatcher_sweep") == {
        "parallel.ep": [2, 4],
        "model.moe.dispatcher": ["alltoall_dedup", "alltoall", "allgather"],
    }
    (layouts,) = _sweep_params("layout_sweep").values()
    assert layouts == valid_layouts(4, num_experts=8) == [{"dp": 4, "ep": 1}, {"dp": 2, "ep": 2}, {"dp": 1, "ep": 4}]
    assert sweep_override(valid_layouts(8, num_experts=4)) == "parallel={dp:8,ep:1},{dp:4,ep:2},{dp:2,ep:4}"
