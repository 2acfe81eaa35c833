"""Hydra entry point: ``python -m lightning_moe.train [overrides]``.

The config tree lives in ``lightning_moe/conf`` (inside the package), so the command works from
any working directory and from an installed package. Every object (model, data module, strategy,
loggers, callbacks, trainer) is built from its ``_target_``; see ``conf/train.yaml``.

Examples::

    python -m lightning_moe.train                                   # tiny model, one process, W&B offline
    python -m lightning_moe.train parallel=dp2_ep2                  # 4 CPU processes, same losses
    python -m lightning_moe.train parallel.ep=2 trainer.devices=2   # sizes set one by one
    python -m lightning_moe.train -m model.moe.top_k=1,2 logger=csv # a sweep, one output dir per job
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, read_write

import lightning_moe.conf  # noqa: F401  (registers the lmoe.devices resolver the configs use)
from lightning_moe._compat import hydra_args_parser
from lightning_moe.callbacks import SummaryCallback
from lightning_moe.callbacks.routing_replay import RoutingReplayCallback
from lightning_moe.checkpoint import latest_checkpoint
from lightning_moe.data import resolve_batch_layout
from lightning_moe.health import RunHealthError
from lightning_moe.layout import PARALLEL_DIMS, size_problems
from lightning_moe.parallel.config.world_size import resolve_world_size
from lightning_moe.parallel.plans.context_parallel import check_context_parallel_support
from lightning_moe.parallel.plans.parallelize import check_layout


def _launch_children_for_this_job_only() -> None:
    """Make Lightning's process launcher re-run this sweep job, not the whole ``--multirun``.

    Lightning starts processes 1..N-1 by re-executing ``sys.argv`` with ``hydra.run.dir`` set to
    ``HydraConfig.run.dir``. In a sweep that command line still holds ``--multirun`` and the swept
    lists, and ``run.dir`` is not the job's directory, so the children would start a sweep of their
    own. Point both at this job: its own overrides and its output directory.
    """
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    hydra_cfg = HydraConfig.get()
    # Keep the options that choose the config (--config-name, --config-dir, ...), drop the sweep.
    args = hydra_args_parser().parse_args(sys.argv[1:])  # Hydra's own parser: no public equivalent
    argv = [sys.argv[0]]
    for flag, value in (
        ("--config-path", args.config_path),
        ("--config-name", args.config_name),
        ("--config-dir", args.config_dir),
    ):
        if value is not None:
            argv += [flag, value]
    sys.argv = argv + list(hydra_cfg.overrides.task)
    with read_write(hydra_cfg.run):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir


# Set by Lightning's process launcher in the main process; a later sweep job that finds LOCAL_RANK
# set would think another tool started its processes and would wait for ranks that never come.
_LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


@contextlib.contextmanager
def _separate_from_other_sweep_jobs() -> Iterator[None]:
    """Leave the process as this job found it: launcher variables restored, process group closed."""
    saved = {name: os.environ.get(name) for name in _LAUNCHER_ENV}
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _instantiate_all(group: DictConfig | None) -> list[Any]:
    """Build every named entry of a group such as ``callbacks`` or ``logger`` (null entries skipped)."""
    if not group:
        return []
    return [hydra.utils.instantiate(node) for node in group.values() if node is not None]


@dataclass
class TrainingRun:
    """Everything :func:`build` makes from a config, ready for ``trainer.fit(model, datamodule=datamodule)``."""

    trainer: pl.Trainer
    model: pl.LightningModule
    datamodule: pl.LightningDataModule
    callbacks: list[Any]
    loggers: list[Any]


def build(cfg: DictConfig) -> TrainingRun:
    """Instantiate the data module, model, strategy, callbacks, loggers and trainer of ``cfg``.

    Example (the config composed as the CLI would, without Hydra's run directory)::

        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=["trainer.default_root_dir=/tmp/run", "parallel=ep2"])
        built = build(cfg)
        built.trainer.strategy.parallel_dims.ep  # 2
    """
    datamodule = hydra.utils.instantiate(cfg.data)
    strategy = hydra.utils.instantiate(cfg.parallel)
    callbacks = _instantiate_all(cfg.callbacks)
    if cfg.get("health"):  # the `health` group: checks of every step (docs/health.md)
        callbacks.append(hydra.utils.instantiate(cfg.health))
    if cfg.get("link"):  # the `link` group: simulated link speeds (lightning_moe.comm.link_simulator)
        callbacks.append(hydra.utils.instantiate(cfg.link))
    loggers = _instantiate_all(cfg.logger)
    if cfg.get("routing") is not None:  # +routing.record=<path> / +routing.replay=<path> (docs/routing-replay.md)
        callbacks.append(RoutingReplayCallback(**cfg.routing))
    trainer = hydra.utils.instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers or False)
    # A model that says how to initialise any shard of itself is built on the meta device: no
    # process ever holds all of it, and the strategy materialises each rank's shards.
    meta_init = callable(getattr(hydra.utils.get_class(cfg.model._target_), "initial_value", None))
    with trainer.init_module(empty_init=True) if meta_init else contextlib.nullcontext():
        model = hydra.utils.instantiate(cfg.model)
    return TrainingRun(trainer, model, datamodule, callbacks, loggers)


def describe_run(summary: dict[str, Any]) -> str:
    """The lines of a ``summary.json`` a user reads first: layout, final loss and throughput, and the
    bytes each rank sent per optimizer step.

    Example::

        describe_run({"layout": {"tp": 1, "ep": 2}, "losses": [5.5, 4.9], "final_loss": 4.9,
                      "tokens_per_second": 3210.4, "comm": {"ep": {"bytes": 2.5e6, "calls": 10}}})
        # 'layout: tp=1 ep=2\nfinal loss: 4.9000 after 2 optimizer steps, 3,210 tokens/s\n'
        # 'communication per optimizer step and rank: ep 2.50 MB in 10 calls'
    """
    layout = " ".join(f"{name}={size}" for name, size in summary.get("layout", {}).items())
    lines = [f"layout: {layout}"]
    final_loss, tokens_per_second = summary.get("final_loss"), summary.get("tokens_per_second")
    if final_loss is not None:
        steps = len(summary.get("losses", []))
        rate = "" if tokens_per_second is None else f", {tokens_per_second:,.0f} tokens/s"
        lines.append(f"final loss: {final_loss:.4f} after {steps} optimizer step{'s' * (steps != 1)}{rate}")
    sent = [
        f"{name} {entry['bytes'] / 1e6:.2f} MB in {entry['calls']:.0f} calls"
        for name, entry in summary.get("comm", {}).items()
        if entry.get("calls")
    ]
    lines.append(f"communication per optimizer step and rank: {', '.join(sent) or 'none'}")
    return "\n".join(lines)


def check_config(cfg: DictConfig) -> None:
    """Check a composed config against every layout rule, in this process, before anything starts.

    Raises the error the run would raise later (``ValueError``/``MisconfigurationException``,
    naming the fix): the strategy's arguments (pipeline schedule, sizes), ``world_size`` =
    ``trainer.devices * trainer.num_nodes`` against ``tp*cp*ep*dp*pp``, the batch layout
    (``global_batch_size`` over ``micro_batch_size * dp*ep * pp_microbatches``), ``seq_len`` for cp,
    and the model (built on the meta device: heads, KV heads, experts, expert FFN and pipeline
    split). Needs no process group. Example::

        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            check_config(compose("train", overrides=["parallel=pp2"]))
    """
    strategy = hydra.utils.instantiate(cfg.parallel)
    dims = dataclasses.replace(strategy.parallel_dims)
    devices, num_nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1)
    if not isinstance(devices, int):  # "auto" and device lists: Lightning resolves them at launch
        return
    config = strategy.config
    layout = resolve_world_size(dims, devices * num_nodes, config.data_parallel, config.dp_replicate, config.dp_shard)
    data = cfg.data
    if "global_batch_size" in data:
        resolve_batch_layout(
            data.global_batch_size, data.get("micro_batch_size"), layout.dp_ep, strategy.microbatches_per_step
        )
    problems = size_problems(
        *(getattr(dims, d) for d in PARALLEL_DIMS), dims.etp, seq_len=data.get("seq_len"), fold_ep=dims.fold_ep
    )
    if problems:
        raise ValueError(problems[0])
    try:
        with torch.device("meta"):
            model = hydra.utils.instantiate(cfg.model)
    except Exception:  # noqa: BLE001 - a model that reads files at construction cannot be built on meta;
        return  # the strategy runs the same checks (lightning_moe.parallelize) before training
    check_layout(model, dims, config.pp_stages_per_rank, config.pp_stage_layers)
    check_context_parallel_support(model, dims, config.cp_comm)


def fit(cfg: DictConfig) -> tuple[TrainingRun, list[Any]]:
    """Seed, build everything from ``cfg`` and fit, in this process; returns the run and its finished W&B runs.

    ``cfg.ckpt_path="auto"`` resumes from :func:`lightning_moe.checkpoint.latest_checkpoint` of
    ``<trainer.default_root_dir>/checkpoints``, or starts fresh when it holds no complete checkpoint.
    A process group that is already initialised is used as it is and left open, so that processes
    started once can fit several configs in turn (each ``world_size`` = ``trainer.devices``,
    ``LOCAL_RANK`` set as a launcher sets it).
    """
    pl.seed_everything(cfg.seed, workers=True)
    run = build(cfg)
    ckpt_path = cfg.ckpt_path
    if ckpt_path == "auto":  # the newest complete checkpoint of this run directory, or a fresh start
        ckpt_path = latest_checkpoint(Path(run.trainer.default_root_dir) / "checkpoints")
    run.trainer.fit(run.model, datamodule=run.datamodule, ckpt_path=ckpt_path)
    wandb_runs = [logger.experiment for logger in run.loggers if isinstance(logger, WandbLogger)]
    for wandb_run in wandb_runs:
        # The next job of a sweep (same process) must start a new W&B run, not append to this one.
        # Finishing also prints W&B's closing lines now, before the run report.
        wandb_run.finish()
    return run, wandb_runs


def train(cfg: DictConfig) -> float | None:
    """Build everything from ``cfg``, fit, and report where the outputs are; returns the final loss."""
    _launch_children_for_this_job_only()
    check_config(cfg)
    with _separate_from_other_sweep_jobs():
        run, wandb_runs = fit(cfg)

    summary = next((c for c in run.callbacks if isinstance(c, SummaryCallback)), None)
    if run.trainer.is_global_zero:
        print(run_report(summary, wandb_runs), flush=True)
    return summary.final_loss if summary is not None else None


def run_report(summary: SummaryCallback | None, wandb_runs: list[Any]) -> str:
    """The block the CLI prints last: :func:`describe_run` of ``summary.json`` and where the outputs are."""
    lines = ["", "Run summary"]
    if summary is not None and summary.path is not None:
        lines += [f"  {line}" for line in describe_run(json.loads(summary.path.read_text())).splitlines()]
        lines.append(f"  summary.json: {summary.path}")
    for wandb_run in wandb_runs:
        lines.append(f"  W&B {wandb_run.settings.mode} run: {wandb_run.settings.sync_dir}")
        if wandb_run.settings.mode == "offline":
            lines.append(f"  upload it with: wandb sync {wandb_run.settings.sync_dir}")
    return "\n".join(lines)


class _DropHostedServiceTips(logging.Filter):
    """Lightning's tips to install ``litlogger`` and ``litmodels`` (its hosted services), printed on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("💡 Tip:") and ("litlogger" in message or "litmodels" in message))


_HOSTED_SERVICE_TIPS = _DropHostedServiceTips()


def quiet_known_harmless_output() -> None:
    """Hide what Lightning prints on every CLI run that says nothing about this run (lightning 2.6, torch 2.13).

    - torch 2.13 deprecates ``LeafSpec``, which Lightning's ``CombinedLoader`` builds: one
      ``FutureWarning`` per rank, from Lightning's own module only;
    - Lightning's tips for its hosted services (``litlogger``, ``litmodels``).

    Exact messages and origins, so any other warning still prints. The CLI's processes all call
    this (Lightning's launcher re-runs the command for ranks 1..N-1); Python users keep their own
    warning filters.
    """
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    # rank_zero_info logs to whichever of the two names was imported last.
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_HOSTED_SERVICE_TIPS)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """``python -m lightning_moe.train``; the return value serves Hydra sweepers (e.g. Optuna). A run the
    health checks stop exits with their code (16: restart it, 17: do not; docs/cluster.md)."""
    quiet_known_harmless_output()
    try:
        return train(cfg)
    except RunHealthError as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        sys.exit(error.exit_code)


def _end_launched_rank() -> None:
    """End a rank that a launcher started (``LOCAL_RANK`` > 0) without interpreter finalization.

    After ``destroy_process_group`` torch 2.13 still holds the gloo process groups (its DTensor
    caches keep the meshes alive), and finalizing them can abort the process: a loaded machine
    printed "terminate called without an active exception" after a run had ended well. This
    rank's outputs are all written by now, so the process flushes them and exits at once.
    """
    if os.environ.get("LOCAL_RANK", "0") in ("", "0"):
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    _end_launched_rank()
