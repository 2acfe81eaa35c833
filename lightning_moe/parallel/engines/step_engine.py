"""The step engine: how a global batch becomes work on this rank, behind one interface.

A layout runs one of three engines, chosen once (:func:`lightning_moe.parallel.engines.choose_step_engine`):

- :class:`~lightning_moe.parallel.engines.accumulation.AccumulationEngine`: Lightning's gradient
  accumulation, one loader micro-batch per Lightning batch (FSDP2's gather once per step optional);
- :class:`~lightning_moe.parallel.engines.accumulation.OverlapEngine`: the same with each micro-batch's
  backward interleaved with the next one's forward (``overlap_ep_comm``);
- :class:`~lightning_moe.parallel.engines.lightning_pipeline.PipelineEngine`: under pp > 1 a
  ``torch.distributed.pipelining`` schedule runs ``pp_microbatches`` loader micro-batches, forward
  and backward, inside each Lightning batch.

The engine owns the batch plan: the data module asks it for its micro-batch
(:meth:`StepEngine.plan_batches`), and the engine alone sets Lightning's
``trainer.accumulate_grad_batches`` (Lightning batches per optimizer step) from it, restoring the
user's value at teardown. ``MoE5DStrategy``'s hooks hand each step to it in a line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe.layout import resolve_batch_layout

__all__ = ["StepEngine"]


class StepEngine:
    """The interface of the step engines, and the batch plan they share.

    ``loader_batches_per_step``: loader micro-batches each Lightning batch holds (``pp_microbatches``
    under a pipeline, else 1); ``stages_group``: the pipeline's group, None without one. After :meth:`plan_batches`, ``accumulation`` is the loader
    micro-batches of one optimizer step on each rank.

    Example (what a data module does in ``setup``)::

        engine = step_engine_of(trainer)
        micro_batch_size, accumulation = engine.plan_batches(trainer, global_batch_size=16,
                                                             micro_batch_size=None, num_replicas=2)
    """

    loader_batches_per_step: int = 1
    # The ranks holding the other parts of the model (pipeline stages): gradient norms combine over
    # them and a checkpoint loads only this rank's part. None: every rank holds the whole model.
    stages_group: dist.ProcessGroup | None = None

    def __init__(self) -> None:
        self.accumulation: int | None = None
        self._user_accumulate_grad_batches: int | None = None

    # -- the batch plan ----------------------------------------------------------------------------
    def plan_batches(
        self, trainer: Any, global_batch_size: int, micro_batch_size: int | None, num_replicas: int
    ) -> tuple[int, int]:
        """``(micro_batch_size, accumulation)``: the samples of one forward on this rank and the loader
        micro-batches of one optimizer step (:func:`~lightning_moe.layout.resolve_batch_layout`);
        ``trainer`` (None: none attached) then accumulates that many. A ``Trainer(accumulate_grad_batches=...)``
        that disagrees is refused, naming the fix."""
        micro, accumulation = resolve_batch_layout(
            global_batch_size, micro_batch_size, num_replicas, self.loader_batches_per_step
        )
        if trainer is not None:
            requested = self._user_value(trainer)
            if requested not in (1, accumulation):
                raise ValueError(
                    f"Trainer(accumulate_grad_batches={requested}) conflicts with the data "
                    f"layout: global_batch_size // (micro_batch_size*dp_ep) = "
                    f"{accumulation}; leave accumulate_grad_batches at 1 and set "
                    "global_batch_size / micro_batch_size instead"
                )
        self.accumulation = accumulation
        if trainer is not None:
            self._apply(trainer)
        return micro, accumulation

    def _user_value(self, trainer: Any) -> int:
        """The trainer's ``accumulate_grad_batches`` as the user set it (before this engine wrote it)."""
        if self._user_accumulate_grad_batches is None:
            self._user_accumulate_grad_batches = trainer.accumulate_grad_batches
        return self._user_accumulate_grad_batches

    def _apply(self, trainer: Any) -> None:
        """Lightning's loops read ``accumulate_grad_batches`` at every batch: Lightning batches per
        optimizer step, each holding :attr:`loader_batches_per_step` loader micro-batches."""
        assert self.accumulation is not None
        trainer.accumulate_grad_batches = self.accumulation // self.loader_batches_per_step

    # -- the strategy's hooks ----------------------------------------------------------------------
    def setup(self, trainer: Any, module: Any, precision_plugin: Any) -> None:
        """Before the module is parallelized (fitting): refuse what the engine cannot run. A batch
        plan no data module made comes from ``Trainer(accumulate_grad_batches=...)``: loader
        micro-batches per optimizer step."""
        if self.accumulation is None:
            self.accumulation = self._user_value(trainer)
        self._apply(trainer)

    def build(self, model: nn.Module, module: Any, device: torch.device) -> None:
        """After the module is parallelized: what the engine runs on."""

    def process_dataloader(self, dataloader: object) -> object:
        """The training loader as Lightning iterates it: one Lightning batch per training step."""
        return dataloader

    def training_step(
        self,
        step: Callable[[], Any],
        batch: Any,
        trainer: Any,
        optimizers: list[torch.optim.Optimizer],
        module: Any,
        step_context: Callable[[], contextlib.AbstractContextManager],
    ) -> Any:
        """One Lightning batch's training step: ``step()`` is the module's own (inside ``step_context()``)."""
        raise NotImplementedError

    def backward(
        self, backward: Callable[[], Any], closure_loss: torch.Tensor, trainer: Any, precision_plugin: Any, module: Any
    ) -> torch.Tensor:
        """Lightning's backward of the step's loss: ``backward()`` is the strategy's own."""
        raise NotImplementedError

    def eval_context(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """Around an evaluation step: ``module(...)`` as the step calls it."""
        return contextlib.nullcontext()

    def teardown(self, trainer: Any) -> None:
        """Give the trainer back the ``accumulate_grad_batches`` the user set; forget the batch plan."""
        if self._user_accumulate_grad_batches is not None and trainer is not None:
            trainer.accumulate_grad_batches = self._user_accumulate_grad_batches
        self._user_accumulate_grad_batches = None
        self.accumulation = None
