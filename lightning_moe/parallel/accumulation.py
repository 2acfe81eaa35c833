"""Gradient accumulation's per-micro-batch work under pp = 1, besides the module's own step.

Two options act around each micro-batch's forward and backward: FSDP2's one gather per optimizer
step (:class:`~lightning_moe.parallel.fsdp_accumulation.GatherOncePerStep`,
``gather_once_per_step``) and micro-batch ep overlap
(:class:`~lightning_moe.microbatch_overlap.MicroBatchOverlap`, ``overlap_ep_comm``), which defers
each backward into the next micro-batch's forward. :class:`MicroBatchAccumulation` owns both and
their order, so that a training loop (``MoE5DStrategy``'s ``training_step`` and ``backward``)
hands each forward and backward to it in a line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from lightning_moe.microbatch_overlap import MicroBatchOverlap
from lightning_moe.parallel.fsdp_accumulation import GatherOncePerStep

__all__ = ["MicroBatchAccumulation"]

T = TypeVar("T")


class MicroBatchAccumulation:
    """Each micro-batch's forward and backward under gradient accumulation, with the step's options.

    Example::

        accumulation = MicroBatchAccumulation(overlap_ep_comm=True)
        accumulation.gather_once_per_step(model)            # after fully_shard (optional)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            loss = accumulation.forward(lambda: model(batch).sum(), steps_optimizer=last)
            accumulation.backward(loss.backward, steps_optimizer=last)
        optimizer.step()
    """

    def __init__(self, overlap_ep_comm: bool = False) -> None:
        self.overlap = MicroBatchOverlap() if overlap_ep_comm else None
        self.gather_once: GatherOncePerStep | None = None

    def gather_once_per_step(self, model: nn.Module) -> None:
        """Gather ``model``'s FSDP2 units once per optimizer step from now on."""
        self.gather_once = GatherOncePerStep(model)

    def forward(self, step: Callable[[], T], steps_optimizer: bool) -> T:
        """``step()`` (a micro-batch's forward); ``steps_optimizer``: the optimizer steps after its backward.
        Under overlap the previous micro-batch's backward runs interleaved with it."""
        if self.gather_once is not None:
            # Under overlap this forward runs before the step's last backward: that one sets the flags.
            self.gather_once.begin_micro_batch(steps_optimizer and self.overlap is None)
        return step() if self.overlap is None else self.overlap.forward(step)

    def backward(self, backward: Callable[[], Any], steps_optimizer: bool) -> None:
        """``backward()`` now, or, under overlap and before the step's last micro-batch, inside the next forward."""

        def run() -> None:
            backward()
            if self.gather_once is not None:
                self.gather_once.end_micro_batch()

        if self.overlap is None:
            run()
            return
        if steps_optimizer and self.gather_once is not None:
            self.gather_once.begin_micro_batch(steps_optimizer=True)  # its forward ran as a non-last one's
        self.overlap.backward(run, steps_optimizer)

    def discard(self) -> None:
        """Forget a deferred backward (the loop ended before the next forward)."""
        if self.overlap is not None:
            self.overlap.discard()
