"""FSDP2 under gradient accumulation: one all-gather and one reduce-scatter per optimizer step.

By default every FSDP2 unit all-gathers its parameters in each micro-batch's forward (and again in
its backward, except the root) and reduce-scatters its gradients after each micro-batch's backward:
data-parallel bytes grow with the accumulation count. :class:`GatherOncePerStep` keeps the
parameters gathered from the first forward of an optimizer step to the last backward, and
accumulates unsharded gradients until that backward reduce-scatters them once (FSDP2's
``set_reshard_after_forward``, ``set_reshard_after_backward`` and ``set_requires_gradient_sync``).
The price is memory: each unit's unsharded parameters and gradients stay allocated for the whole
step, as without FSDP (``MoE5DStrategy(gather_once_per_step=True)``). This class serves pp = 1; under
a pipeline :class:`~lightning_moe.parallel.engines.pipeline_runner.PipelineRunner` does the same
around its schedule's steps.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["GatherOncePerStep"]


class GatherOncePerStep:
    """Switch every FSDP2 unit of ``model`` to one gather and one gradient reduction per optimizer step.

    Example::

        gather = GatherOncePerStep(model)         # after fully_shard
        for i, batch in enumerate(micro_batches):
            gather.begin_micro_batch(steps_optimizer=i == len(micro_batches) - 1)
            loss(model(batch)).backward()
            gather.end_micro_batch()              # after the step's last backward: FSDP's defaults again
        optimizer.step()
    """

    def __init__(self, model: nn.Module) -> None:
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        # FSDP2 keeps the root unit gathered after forward by default; every other unit reshards.
        self._default_reshard_after_forward = {id(u): u is not model for u in self.units}
        self._last = False

    def begin_micro_batch(self, steps_optimizer: bool) -> None:
        """Before a micro-batch's forward; ``steps_optimizer``: the optimizer steps after its backward."""
        self._last = steps_optimizer
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.set_reshard_after_backward(steps_optimizer, recurse=False)
            unit.set_requires_gradient_sync(steps_optimizer, recurse=False)

    def end_micro_batch(self) -> None:
        """After a micro-batch's backward: after the step's last one, FSDP2's defaults come back (so
        that validation between steps reshards as usual)."""
        if not self._last:
            return
        for unit in self.units:
            unit.set_reshard_after_forward(self._default_reshard_after_forward[id(unit)], recurse=False)
