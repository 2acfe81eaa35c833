"""Run the training CLI in a subprocess (Lightning's launcher re-executes sys.argv, so never in-process),
or the same training in the persistent gloo pool when the launcher is not what a test is about."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.dist_pool import pool_of, trim_pools
from tests.launched_rank import launched_rank

ROOT = Path(__file__).resolve().parents[1]

# Rendering the PNG plots at a run's end takes about a fifth of a tiny 2-rank run and changes no number:
# the runs of train_in_pool and run_cli leave them out unless a test asks for them (plots=True).
NO_PLOTS = "~callbacks.expert_load_plots"


def _without_plots(overrides: Sequence[str], plots: bool) -> list[str]:
    overrides = list(overrides)
    return overrides if plots or NO_PLOTS in overrides else [*overrides, NO_PLOTS]


# A tiny model on a small corpus; the data layout's micro-batch is left at its default.
TINY_MODEL = [
    "data.seq_len=32",
    "data.global_batch_size=8",
    "data.max_corpus_bytes=200000",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.moe.num_experts=4",
    "model.moe.ffn_hidden_size=32",
]

# A tiny model and a short run: enough steps for layouts to drift apart if anything is wrong.
TINY_RUN = [
    "logger=none",
    "trainer.max_steps=10",
    # Clipping is active at this size: a mis-scaled gradient would change the curve (Adam alone would hide it).
    "++trainer.gradient_clip_val=0.05",
    "trainer.val_check_interval=null",
    "trainer.limit_val_batches=0",
    "data.micro_batch_size=2",
    *TINY_MODEL,
]


def run_cli(
    run_dir: Path,
    *overrides: str,
    timeout: int = 600,
    torchrun_procs: int | None = None,
    base: Sequence[str] = TINY_RUN,
    plots: bool = False,
) -> dict:
    """Run ``python -m lightning_moe.train`` with ``base`` and ``overrides``; return its summary.json.

    ``torchrun_procs``: start the processes with ``torchrun --nproc_per_node`` instead of
    Lightning's own launcher. ``plots``: keep the expert-load plots (:data:`NO_PLOTS`).
    """
    trim_pools()  # the launched processes get the cores but for a few idle pool ranks
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE=os.environ.get("WANDB_MODE", "offline"))
    launcher = [sys.executable, "-m"]
    if torchrun_procs is not None:
        launcher += ["torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun_procs}", "-m"]
    cmd = [*launcher, "lightning_moe.train", *_without_plots([*base, *overrides], plots), f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads((run_dir / "summary.json").read_text())


def run_cli_error(run_dir: Path, *overrides: str, timeout: int = 300) -> str:
    """Run the CLI expecting a failure; return its combined output."""
    trim_pools()  # the launched processes get the cores but for a few idle pool ranks
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lightning_moe.train", *TINY_RUN, *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode != 0, f"{' '.join(cmd)} unexpectedly succeeded"
    return proc.stdout + proc.stderr


def train_in_pool(run_dir: Path, *overrides: str, base: Sequence[str] = TINY_RUN, plots: bool = False) -> dict:
    """What :func:`run_cli` runs, on the ranks of a test pool instead of new processes; returns summary.json.

    The config is composed and checked and the training run exactly as the CLI does
    (:func:`lightning_moe.train.fit`); only the start-up of the processes and their imports (about
    10 s a run on 2 cores) are paid once per pool. For tests that are not about the launcher.
    ``plots``: keep the expert-load plots (:data:`NO_PLOTS`).
    """
    cfg = compose_train_config(run_dir, _without_plots([*base, *overrides], plots))
    # Composed once here and sent: composing again on every rank costs a Hydra defaults walk (about 0.9 s
    # a rank on 2 loaded cores) and gives the same config.
    pool_of(cfg.trainer.devices * cfg.trainer.num_nodes).run(_fit_config_on_this_rank, cfg=cfg)
    return json.loads((run_dir / "summary.json").read_text())


def compose_train_config(run_dir: Path, overrides: Sequence[str]) -> Any:
    """The config ``python -m lightning_moe.train`` composes, its output directory ``run_dir``."""
    from hydra import compose, initialize_config_dir

    from lightning_moe.conf import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[*overrides, f"trainer.default_root_dir={run_dir}"])


def fit_on_this_rank(overrides: Sequence[str], run_dir: str | Path) -> Any:
    """What ``python -m lightning_moe.train *overrides`` does on this rank of a test pool: the config
    composed (output directory ``run_dir``) and checked, and :func:`lightning_moe.train.fit`'s result,
    the processes taken as launched (as under torchrun)."""
    return fit_config_on_this_rank(compose_train_config(Path(run_dir), overrides))


def fit_config_on_this_rank(cfg: Any) -> Any:
    """:func:`fit_on_this_rank` of a config already composed (:func:`compose_train_config`)."""
    from lightning_moe.train import check_config, fit

    check_config(cfg)
    with launched_rank(cfg.trainer.devices):
        return fit(cfg)


def _fit_config_on_this_rank(cfg: Any) -> None:
    fit_config_on_this_rank(cfg)  # a pool task: nothing to send back
