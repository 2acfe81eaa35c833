"""The ``health`` callback: non-finite steps re-run and attributed, loss spikes, silent data
corruption, stragglers and starving experts (docs/health.md)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_moe.callbacks.base import OptimizerStepCallback, log_to_loggers
from lightning_moe.callbacks.comm_accounting import uncounted
from lightning_moe.callbacks.moe_metrics import MoEMetricsCallback, MoEStepResult
from lightning_moe.callbacks.summary import write_json_atomic
from lightning_moe.checkpoint.periodic import PeriodicCheckpoint
from lightning_moe.health.attribution import NonFiniteWatch, first_event
from lightning_moe.health.errors import (
    ROLLBACK_MARKER,
    PersistentFaultError,
    RestartRequestedError,
    check_no_persistent_fault,
    write_fault_marker,
)
from lightning_moe.health.experts import ExpertStarvation
from lightning_moe.health.injection import FaultInjection, local_view
from lightning_moe.health.replay import StepRecord, clear_step_state, sample_indices
from lightning_moe.health.spike import SpikeDetection
from lightning_moe.health.stragglers import CollectiveWaitClock, StragglerDetection, straggler_ratio
from lightning_moe.parallel.plans.pipeline import pipeline_stage_modules

__all__ = ["NONFINITE_ACTIONS", "HealthCallback"]

NONFINITE_ACTIONS = ("rerun", "skip", "stop")


def _as(kind: type, value: Any) -> Any:
    """A settings dataclass from itself, a mapping of its fields (a plain config) or None (defaults)."""
    if value is None:
        return kind()
    return kind(**value) if isinstance(value, Mapping) else value


def _ranges(indices: list[int], limit: int = 32) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"`` (the first ``limit`` ranges)."""
    if not indices:
        return "none recorded (the batches carry no sample_index)"
    parts: list[str] = []
    ordered = sorted(set(indices))
    start = prev = ordered[0]
    for i in [*ordered[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    more = f" and {len(parts) - limit} more ranges" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


class HealthCallback(OptimizerStepCallback):
    """Keep a run healthy: every optimizer step is checked before it updates anything.

    - ``nonfinite``: before each optimizer step every rank learns, in one all-reduce, whether any
      rank's loss or gradients are non-finite. ``rerun`` (default) clears the step and runs its
      micro-batches again on the same data: finite then, the fault was transient (logged, counted,
      the rerun's update used); non-finite again, it is persistent: the run stops with exit code 17
      naming the step, the rank and module where it started, and the samples. ``skip`` drops the
      step's update; ``stop`` stops at once (exit code 17).
    - ``max_transient_faults``: more transient faults than this stop the run with exit code 16 (a
      restart, on other hardware if the scheduler can).
    - ``sdc_check_every_n_steps``: every n steps the step runs twice and its gradients must agree
      bit for bit, else the run stops with exit code 16 naming the rank and parameter (0: off).
    - ``spike`` (:class:`SpikeDetection`), ``straggler`` (:class:`StragglerDetection`), ``expert``
      (:class:`ExpertStarvation`), ``inject`` (:class:`FaultInjection`).

    Example::

        trainer = Trainer(strategy="moe5d", callbacks=[MoEMetricsCallback(), HealthCallback(
            spike=SpikeDetection(window=50, action="skip"),
            inject=FaultInjection(kind="nan_grad", step=5, rank=1))])   # a drill: a transient NaN
    """

    def __init__(
        self,
        nonfinite: str = "rerun",
        max_transient_faults: int = 3,
        sdc_check_every_n_steps: int = 0,
        spike: SpikeDetection | Mapping[str, Any] | None = None,
        straggler: StragglerDetection | Mapping[str, Any] | None = None,
        expert: ExpertStarvation | Mapping[str, Any] | None = None,
        inject: FaultInjection | Mapping[str, Any] | None = None,
    ) -> None:
        if nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(f"health.nonfinite={nonfinite!r} is not one of {', '.join(NONFINITE_ACTIONS)}")
        if max_transient_faults < 0:
            raise ValueError(f"health.max_transient_faults={max_transient_faults} must be >= 0")
        if sdc_check_every_n_steps is None or sdc_check_every_n_steps < 0:
            raise ValueError(f"health.sdc_check_every_n_steps={sdc_check_every_n_steps} must be >= 0 (0: off)")
        self.nonfinite = nonfinite
        self.max_transient_faults = max_transient_faults
        self.sdc_check_every_n_steps = sdc_check_every_n_steps
        self.spike = _as(SpikeDetection, spike)
        self.straggler = _as(StragglerDetection, straggler)
        self.expert = _as(ExpertStarvation, expert)
        self.inject = _as(FaultInjection, inject)
        self._record = StepRecord()
        self._wait_clock = CollectiveWaitClock()
        self._hosts: list[str] = []
        self._reset()

    def _reset(self) -> None:
        self.transient_faults: list[dict[str, Any]] = []
        self.skipped_steps: list[dict[str, Any]] = []
        self.spikes: list[dict[str, Any]] = []
        self.stragglers: list[dict[str, Any]] = []
        self.expert_warnings: list[dict[str, Any]] = []
        self._step_metrics: dict[str, float] = {}
        self._clear_losses()

    def _clear_losses(self) -> None:
        self._loss_sum = torch.zeros((), dtype=torch.float64)
        self._loss_count = 0

    # -- set-up ------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        run_dir = Path(trainer.default_root_dir)
        check_no_persistent_fault(run_dir)
        self.inject.check_world(trainer.world_size)
        if self.spike.action == "rollback" and self.spike.window and not _saves_periodically(trainer):
            raise MisconfigurationException(
                "health.spike.action=rollback resumes from the newest periodic checkpoint, and this run saves none:"
                " add callbacks=checkpoint (callbacks.checkpoint.every_n_train_steps=N), or use"
                " health.spike.action=skip"
            )
        marker = run_dir / ROLLBACK_MARKER
        self._rollback_to = json.loads(marker.read_text())["to_step"] if marker.exists() else None
        if not pl_module.automatic_optimization and (self.nonfinite == "rerun" or self.sdc_check_every_n_steps):
            raise MisconfigurationException(
                "health.nonfinite=rerun and health.sdc_check_every_n_steps re-run a step's micro-batches, which"
                " needs automatic optimization: set health.nonfinite=skip (or stop) and"
                " health.sdc_check_every_n_steps=0 for a module with automatic_optimization=False"
            )
        if self.sdc_check_every_n_steps and trainer.strategy.root_device.type == "cuda":
            if not torch.are_deterministic_algorithms_enabled():
                raise MisconfigurationException(
                    "health.sdc_check_every_n_steps compares two runs of a step bit for bit, which on GPUs needs"
                    " deterministic kernels: set trainer.deterministic=true, or health.sdc_check_every_n_steps=0"
                )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        # The modules this rank runs (its pipeline stages under pp), built by now and fixed for the fit.
        self._model = _rank_model(pl_module)
        self.spike.reset()
        self.expert.reset()
        if self.straggler.every_n_steps:
            self._wait_clock.install()
            self._hosts = _gather_objects(socket.gethostname(), trainer.world_size)
        moe_metrics = next((c for c in trainer.callbacks if isinstance(c, MoEMetricsCallback)), None)
        if moe_metrics is not None and self.expert.patience:
            moe_metrics.add_step_listener(self._on_moe_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        self._wait_clock.uninstall()
        self.inject.end_execution()

    # -- each step ---------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._record.add(batch, batch_idx)

    def on_step_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self._record.begin()
        self._clear_losses()
        self._step_metrics = {}
        if self.straggler.measures(trainer.global_step):
            self._step_started = time.perf_counter()
            self._wait_clock.start()
        self.inject.begin_execution(self._model, trainer.global_step, trainer.global_rank)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # The loss as backpropagated: divided by the micro-batches per step, so the step's sum is its mean.
        self._loss_sum = self._loss_sum.to(loss.device) + loss.detach().double()
        self._loss_count += 1

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        step, rank = trainer.global_step, trainer.global_rank
        params = _parameters(optimizer)
        if self._rollback_to is not None:
            self._skip_rolled_back_step(trainer, pl_module, params)
            return
        self.inject.after_backward(params, step, rank)
        busy = None
        if self._wait_clock.running:
            busy = time.perf_counter() - self._step_started - self._wait_clock.stop()
        bad_ranks, loss, busy_seconds = self._check(trainer, params, busy)
        if busy_seconds is not None:
            self._report_stragglers(step, busy_seconds)
        if bad_ranks:
            self._on_nonfinite(trainer, pl_module, optimizer, params, bad_ranks)
        elif self.sdc_check_every_n_steps and (step + 1) % self.sdc_check_every_n_steps == 0:
            self._check_silent_corruption(trainer, pl_module, optimizer, params)
        elif loss is not None:
            self._check_spike(trainer, step, loss, params, pl_module)
        self.inject.end_execution()

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = {
            "health/transient_faults": float(len(self.transient_faults)),
            "health/skipped_steps": float(len(self.skipped_steps)),
            **self._step_metrics,
        }
        log_to_loggers(trainer, metrics)

    # -- the checks --------------------------------------------------------------------------------
    def _check(
        self, trainer: pl.Trainer, params: list[nn.Parameter], busy: float | None
    ) -> tuple[list[int], float | None, list[float] | None]:
        """One all-reduce: which ranks hold a non-finite loss or gradient, the step's mean loss, and
        (on measured steps) every rank's busy seconds."""
        world, rank = trainer.world_size, trainer.global_rank
        # A rank's shard of a small parameter can be empty, which has no max-abs norm.
        grads = [g for g in (local_view(p.grad) for p in params if p.grad is not None) if g.numel()]
        nonfinite = torch.zeros((), dtype=torch.bool)
        if grads:
            nonfinite = ~torch.isfinite(torch.nn.utils.get_total_norm(grads, norm_type=float("inf")))
        if self._loss_count:
            nonfinite = nonfinite.cpu() | ~torch.isfinite(self._loss_sum).cpu()
        size = 2 * world + 2 if busy is not None else world + 2
        vector = torch.zeros(size, dtype=torch.float64)
        vector[rank] = nonfinite.double()
        if self._loss_count:
            vector[world] = self._loss_sum.cpu()
            vector[world + 1] = 1.0
        if busy is not None:
            vector[world + 2 + rank] = busy
        if dist.is_available() and dist.is_initialized() and world > 1:
            device = trainer.strategy.root_device
            reduced = vector.to(device if device.type == "cuda" else "cpu")
            with uncounted():
                dist.all_reduce(reduced)
            vector = reduced.cpu()
        bad_ranks = [r for r in range(world) if vector[r] > 0]
        loss = float(vector[world] / vector[world + 1]) if vector[world + 1] > 0 else None
        return bad_ranks, loss, vector[world + 2 :].tolist() if busy is not None else None

    def _rerun(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: torch.optim.Optimizer,
        params: list[nn.Parameter],
        watch: NonFiniteWatch | None = None,
    ) -> list[torch.Tensor]:
        """The step's micro-batches again (under ``watch`` when given); the fault injection counts it
        as another execution of the step."""
        self._clear_losses()
        self.inject.begin_execution(self._model, trainer.global_step, trainer.global_rank)
        if watch is None:
            losses = self._record.rerun(trainer, optimizer, params, self._model)
        else:
            with watch:
                losses = self._record.rerun(trainer, optimizer, params, self._model)
            if self._loss_count and not bool(torch.isfinite(self._loss_sum)):
                watch.record("the loss", "loss")
        self.inject.after_backward(params, trainer.global_step, trainer.global_rank)
        if watch is not None:
            watch.check_parameter_gradients()
        self._tell_rerun(trainer, pl_module, losses)
        return losses

    def _tell_rerun(self, trainer: pl.Trainer, pl_module: pl.LightningModule, losses: list[torch.Tensor]) -> None:
        for callback in trainer.callbacks:
            if isinstance(callback, OptimizerStepCallback) and callback is not self:
                callback.on_step_rerun(trainer, pl_module, losses)

    def _on_nonfinite(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: torch.optim.Optimizer,
        params: list[nn.Parameter],
        bad_ranks: list[int],
    ) -> None:
        step = trainer.global_step
        if self.nonfinite == "stop":
            raise PersistentFaultError(
                f"non-finite loss or gradients at step {step} on ranks {bad_ranks} (health.nonfinite=stop);"
                f" samples of the step on this rank: {_ranges(self._step_samples())}"
            )
        if self.nonfinite == "skip":
            clear_step_state(params, self._model)
            self.skipped_steps.append({"step": step, "reason": "nonfinite", "ranks": bad_ranks})
            rank_zero_warn(f"health: non-finite loss or gradients at step {step} on ranks {bad_ranks}: update skipped")
            return
        watch = NonFiniteWatch(self._model, trainer.global_rank)
        self._rerun(trainer, pl_module, optimizer, params, watch)
        again, _, _ = self._check(trainer, params, None)
        if not again:
            self.transient_faults.append({"step": step, "kind": "nonfinite", "ranks": bad_ranks})
            rank_zero_warn(
                f"health: transient fault at step {step}: non-finite loss or gradients on ranks {bad_ranks}, finite"
                " when the step ran again on the same data; the rerun's update is used"
            )
            if len(self.transient_faults) > self.max_transient_faults:
                raise RestartRequestedError(
                    f"{len(self.transient_faults)} transient faults (more than health.max_transient_faults="
                    f"{self.max_transient_faults}), the last at step {step}: the hardware is suspect; restart the job"
                    " (on other nodes if the scheduler can); ckpt_path=auto resumes from the newest checkpoint",
                    {"transient_faults": self.transient_faults},
                )
            return
        self._persistent(trainer, step, again, watch)

    def _persistent(self, trainer: pl.Trainer, step: int, bad_ranks: list[int], watch: NonFiniteWatch) -> None:
        gathered = _gather_objects(
            (watch.event.as_dict() if watch.event else None, self._step_samples()), trainer.world_size
        )
        origin = first_event([event for event, _ in gathered])
        rank = origin.rank if origin is not None else bad_ranks[0]
        samples = gathered[rank][1]
        where = origin.describe() if origin is not None else f"rank {rank} (no module output went non-finite)"
        details = {
            "step": step,
            "rank": rank,
            "module": origin.module if origin else None,
            "where": origin.where if origin else None,
            "ranks": bad_ranks,
            "sample_index": sorted(samples),
        }
        message = (
            f"persistent fault at step {step}: the loss or gradients are non-finite again when the step runs a"
            f" second time on the same data (data or numerics, not hardware). It started on {where}; samples of"
            f" rank {rank}'s batches: {_ranges(samples)}. No update of this step was applied"
        )
        if trainer.is_global_zero:
            path = write_fault_marker(Path(trainer.default_root_dir), details)
            message += f"; {path} keeps a restart of this run from failing the same way"
        raise PersistentFaultError(message, details)

    def _check_silent_corruption(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: torch.optim.Optimizer,
        params: list[nn.Parameter],
    ) -> None:
        step, world = trainer.global_step, trainer.world_size
        first_run = [local_view(p.grad).clone() if p.grad is not None else None for p in params]
        self._rerun(trainer, pl_module, optimizer, params)
        differs = next(
            (
                i
                for i, (before, p) in enumerate(zip(first_run, params))
                if (before is None) != (p.grad is None)
                or (before is not None and not torch.equal(before, local_view(p.grad)))
            ),
            None,
        )
        names = {id(p): n for n, p in pl_module.named_parameters()}
        found = _gather_objects(None if differs is None else names.get(id(params[differs]), f"#{differs}"), world)
        bad = {r: name for r, name in enumerate(found) if name is not None}
        if bad:
            rank, name = next(iter(bad.items()))
            raise RestartRequestedError(
                f"silent data corruption at step {step}: the step's gradients differ bit for bit when it runs again"
                f" on the same data, first on rank {rank} ({self._hosts[rank] if self._hosts else 'its host'}),"
                f" parameter {name} (all ranks that differ: {sorted(bad)}); no update of this step was applied;"
                " restart the job without that device; ckpt_path=auto resumes from the newest checkpoint",
                {"step": step, "rank": rank, "parameter": name, "ranks": sorted(bad)},
            )
        self._step_metrics["health/sdc_checks"] = 1.0

    def _check_spike(
        self, trainer: pl.Trainer, step: int, loss: float, params: list[nn.Parameter], pl_module: pl.LightningModule
    ) -> None:
        z = self.spike.observe(loss)
        if z is not None:
            self._step_metrics["health/loss_zscore"] = z
        if not self.spike.is_spike(z):
            return
        self.spikes.append({"step": step, "loss": loss, "zscore": z, "action": self.spike.action})
        if self.spike.action == "rollback":
            self._request_rollback(trainer, step, loss, z)
        if self.spike.action == "skip":
            clear_step_state(params, self._model)
            self.skipped_steps.append({"step": step, "reason": "loss spike", "loss": loss, "zscore": z})
        rank_zero_warn(
            f"health: loss spike at step {step}: {loss:.4f} is {z:.1f} robust standard deviations above the median"
            f" of the last {self.spike.window} steps" + ("; update skipped" if self.spike.action == "skip" else "")
        )

    def _request_rollback(self, trainer: pl.Trainer, step: int, loss: float, z: float) -> None:
        run_dir = Path(trainer.default_root_dir)
        if trainer.is_global_zero:
            write_json_atomic(run_dir / ROLLBACK_MARKER, {"to_step": step, "loss": loss, "zscore": z})
        raise RestartRequestedError(
            f"loss spike at step {step} ({loss:.4f}, robust z-score {z:.1f}; health.spike.action=rollback): restart"
            " the job with ckpt_path=auto; it resumes from the newest checkpoint and drops the updates of the steps"
            f" from there to step {step} ({run_dir / ROLLBACK_MARKER})",
            {"step": step, "loss": loss, "zscore": z},
        )

    def _skip_rolled_back_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, params: list[nn.Parameter]
    ) -> None:
        """A step of the window a rollback drops: no update, its samples logged; the window's last step
        retires the marker."""
        assert self._rollback_to is not None
        step = trainer.global_step
        clear_step_state(params, self._model)
        samples = sorted({i for part in _gather_objects(self._step_samples(), trainer.world_size) for i in part})
        self.skipped_steps.append({"step": step, "reason": "rollback", "sample_index": _ranges(samples, limit=1000)})
        rank_zero_warn(f"health: step {step} dropped by the rollback to before step {self._rollback_to}'s loss spike")
        if step >= self._rollback_to:
            if trainer.is_global_zero:
                marker = Path(trainer.default_root_dir) / ROLLBACK_MARKER
                marker.replace(marker.with_name(f"rollback_done_step{self._rollback_to}.json"))
            self._rollback_to = None

    def _report_stragglers(self, step: int, busy_seconds: list[float]) -> None:
        ratio, slowest = straggler_ratio(busy_seconds)
        self._step_metrics.update({"health/straggler_ratio": ratio, "health/slowest_rank": float(slowest)})
        host = self._hosts[slowest] if self._hosts else "?"
        record = {"step": step, "ratio": ratio, "rank": slowest, "host": host, "busy_seconds": busy_seconds}
        if ratio > self.straggler.threshold:
            self.stragglers.append(record)
            rank_zero_warn(
                f"health: straggler at step {step}: rank {slowest} on {host} was busy {busy_seconds[slowest]:.3f} s,"
                f" {ratio:.2f}x the median rank (health.straggler.threshold={self.straggler.threshold})"
            )

    def _on_moe_step(self, trainer: pl.Trainer, result: MoEStepResult) -> None:
        for found in self.expert.observe(result.step, result.counts):
            self.expert_warnings.append(found)
            if found["kind"] == "starving_expert":
                rank_zero_warn(
                    f"health: expert {found['expert']} of MoE layer {found['layer']} got {found['load_fraction']:.1%}"
                    f" of its fair share of tokens for {found['steps']} steps (health.expert.min_load_fraction="
                    f"{self.expert.min_load_fraction})"
                )
            else:
                rank_zero_warn(
                    f"health: MoE layer {found['layer']}'s busiest expert got {found['max_over_mean']:.2f}x the mean"
                    f" load for {found['steps']} steps (health.expert.max_load_ratio={self.expert.max_load_ratio})"
                )
        self._step_metrics["health/starving_experts"] = float(
            sum(1 for w in self.expert_warnings if w["kind"] == "starving_expert")
        )

    def _step_samples(self) -> list[int]:
        return [i for batch, _ in self._record.batches for i in sample_indices(batch)]

    def summary_fields(self) -> dict[str, Any]:
        """``health`` in summary.json: the transient faults, skipped steps, spikes, stragglers and expert warnings."""
        return {
            "health": {
                "transient_faults": self.transient_faults,
                "skipped_steps": self.skipped_steps,
                "spikes": self.spikes,
                "stragglers": self.stragglers,
                "experts": self.expert_warnings,
            }
        }


def _parameters(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            seen.setdefault(id(param), param)
    return list(seen.values())


def _saves_periodically(trainer: pl.Trainer) -> bool:
    """Whether checkpoints are saved during training (``callbacks=checkpoint``)."""
    return any(isinstance(c, PeriodicCheckpoint) for c in trainer.callbacks)


def _rank_model(pl_module: pl.LightningModule) -> nn.Module:
    """The modules this rank runs: its pipeline stages under pp, else the module."""
    stages = pipeline_stage_modules(pl_module)
    if not stages:
        return pl_module
    return nn.ModuleDict({f"stage{index}": module for index, module in stages})


def _gather_objects(value: Any, world_size: int) -> list[Any]:
    """``value`` of every rank (this one alone without a process group)."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [value]
    gathered: list[Any] = [None] * world_size
    with uncounted():
        dist.all_gather_object(gathered, value)
    return gathered
