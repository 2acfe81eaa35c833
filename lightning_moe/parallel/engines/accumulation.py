"""The gradient-accumulation step engines (pp = 1): one loader micro-batch per Lightning batch.

:class:`AccumulationEngine` runs each micro-batch's forward and backward as Lightning calls them,
with FSDP2's one gather per optimizer step when asked
(:class:`~lightning_moe.parallel.engines.fsdp_accumulation.GatherOncePerStep`, ``gather_once_per_step``).
:class:`OverlapEngine` (``overlap_ep_comm``) defers each micro-batch's backward into the next
micro-batch's forward and runs the two interleaved (:func:`lightning_moe.comm.interleave.run_interleaved`),
so that each one's expert all-to-alls are in flight while the other computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_moe._compat import optimizer_steps_after_this_batch
from lightning_moe.comm.interleave import run_interleaved
from lightning_moe.moe import set_aux_loss_scale
from lightning_moe.parallel.engines.fsdp_accumulation import GatherOncePerStep
from lightning_moe.parallel.engines.step_engine import StepEngine

__all__ = ["AccumulationEngine", "MicroBatchOverlap", "OverlapEngine"]

T = TypeVar("T")


class AccumulationEngine(StepEngine):
    """Lightning's gradient accumulation: ``training_step`` then ``backward`` per loader micro-batch.

    ``cp``: the context-parallel size (each cp rank's MoE aux loss is a partial one while gradients
    are averaged over cp, so the aux losses are scaled by cp). ``gather_once_per_step``: FSDP2 (or HSDP) gathers
    each unit once per optimizer step (:meth:`build` after ``fully_shard``).

    Example (what ``MoE5DStrategy`` does per Lightning batch)::

        engine = AccumulationEngine(cp=1, gather_once_per_step=True)
        engine.build(model, module, device)
        loss = engine.training_step(lambda: module.training_step(batch, i), batch, trainer, optimizers, module, nullcontext)
        engine.backward(loss.backward, loss, trainer, precision_plugin, module)
    """

    def __init__(self, cp: int = 1, gather_once_per_step: bool = False) -> None:
        super().__init__()
        self.cp = cp
        self.gather_once_per_step = gather_once_per_step
        self.gather_once: GatherOncePerStep | None = None

    def build(self, model: nn.Module, module: Any, device: torch.device) -> None:
        if self.gather_once_per_step:
            self.gather_once = GatherOncePerStep(model)

    def training_step(
        self,
        step: Callable[[], Any],
        batch: Any,
        trainer: Any,
        optimizers: list[torch.optim.Optimizer],
        module: Any,
        step_context: Callable[[], contextlib.AbstractContextManager],
    ) -> Any:
        # Lightning divides the task loss by the accumulation count; the MoE aux losses follow. Each
        # cp rank holds a partial aux loss (the cp ranks' parts sum to the micro-batch's) while
        # gradients are averaged over cp, hence the factor cp.
        set_aux_loss_scale(self.cp / trainer.accumulate_grad_batches)

        def run() -> Any:
            with step_context():
                return step()

        return self._forward(run, optimizer_steps_after_this_batch(trainer))

    def _forward(self, step: Callable[[], T], steps_optimizer: bool) -> T:
        """``step()``, a micro-batch's forward; ``steps_optimizer``: the optimizer steps after its backward."""
        if self.gather_once is not None:
            self.gather_once.begin_micro_batch(steps_optimizer)
        return step()

    def backward(
        self, backward: Callable[[], Any], closure_loss: torch.Tensor, trainer: Any, precision_plugin: Any, module: Any
    ) -> torch.Tensor:
        self._backward(self._with_gather_once(backward), optimizer_steps_after_this_batch(trainer))
        return closure_loss

    def _with_gather_once(self, backward: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            backward()
            if self.gather_once is not None:
                self.gather_once.end_micro_batch()

        return run

    def _backward(self, run: Callable[[], None], steps_optimizer: bool) -> None:
        run()


class OverlapEngine(AccumulationEngine):
    """:class:`AccumulationEngine` with micro-batch overlap (``overlap_ep_comm``): each micro-batch's
    backward runs inside the next micro-batch's forward, interleaved with it; the step's last
    backward runs at once. The numbers are those without overlap."""

    def __init__(self, cp: int = 1, gather_once_per_step: bool = False) -> None:
        super().__init__(cp, gather_once_per_step)
        self.overlap = MicroBatchOverlap()

    def setup(self, trainer: Any, module: Any, precision_plugin: Any) -> None:
        if not module.automatic_optimization:
            raise MisconfigurationException(
                "overlap_ep_comm=True runs each micro-batch's backward inside the next training_step, which needs"
                " automatic optimization: set overlap_ep_comm=False for a module with automatic_optimization=False"
            )
        super().setup(trainer, module, precision_plugin)

    def _forward(self, step: Callable[[], T], steps_optimizer: bool) -> T:
        if self.gather_once is not None:
            # This forward runs before the step's last backward: that one sets the flags.
            self.gather_once.begin_micro_batch(False)
        return self.overlap.forward(step)

    def _backward(self, run: Callable[[], None], steps_optimizer: bool) -> None:
        if steps_optimizer and self.gather_once is not None:
            self.gather_once.begin_micro_batch(steps_optimizer=True)  # its forward ran as a non-last one's
        self.overlap.backward(run, steps_optimizer)

    def teardown(self, trainer: Any) -> None:
        self.overlap.discard()  # the loop ended before the next forward
        super().teardown(trainer)


class MicroBatchOverlap:
    """A training loop's side of :func:`~lightning_moe.comm.interleave.run_interleaved`: a micro-batch's
    backward is deferred until the next micro-batch's forward, and run interleaved with it. The
    step's last backward runs at once (nothing follows it before the optimizer step).

    Example::

        overlap = MicroBatchOverlap()
        for i, batch in enumerate(micro_batches):
            loss = overlap.forward(lambda: model(batch).sum())
            overlap.backward(loss.backward, last=i == len(micro_batches) - 1)
        optimizer.step()
    """

    def __init__(self) -> None:
        self._pending: Callable[[], None] | None = None

    def forward(self, step: Callable[[], T]) -> T:
        """``step()``, interleaved with the previous micro-batch's backward when one is pending."""
        pending, self._pending = self._pending, None
        return step() if pending is None else run_interleaved(pending, step)

    def backward(self, run: Callable[[], None], last: bool) -> None:
        """Run ``run()`` now when ``last``, else keep it for the next :meth:`forward`."""
        if self._pending is not None:
            raise RuntimeError("a deferred backward is still pending: call forward() between two backward() calls")
        if last:
            run()
        else:
            self._pending = run

    def discard(self) -> None:
        """Forget a deferred backward (the loop ended before the next forward)."""
        self._pending = None
