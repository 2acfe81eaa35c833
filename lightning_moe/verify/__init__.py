"""Prove that a module, a layout and a config give the single-device numbers, and find where they don't.

- ``python -m lightning_moe.verify parallel=tp2_ep2`` (Hydra, the config groups of ``train``);
- :func:`verify_layout` from Python; both return/print a :class:`VerifyReport`.

Two real Lightning runs of the same seed and global batch, one process and the layout, each in
its own processes, cutting every step into the same micro-batches (the reference takes the
layout's micro-batch size when its data module has a ``micro_batch_size`` argument); compared in
fp32: the loss per step, every parameter's reduced gradient at step 1 and every parameter after the
last step (less the part that step-1 gradient rounding explains through the optimizer). A FAIL
that micro-batching or statistics spanning several ranks explain says so and names the fix. On failure, step 1 is run again with forward hooks
on every module, whose outputs are reassembled to full tensors (DTensor, tensor-parallel shards,
context-parallel zigzag, pipeline stages) and compared in execution order.

The modules, in the order a verification uses them: ``runner`` (checks, the two runs in their own
processes, the job), ``worker`` (one run, recording what is compared), ``runs`` (a run as its ranks
wrote it), ``numerics`` (relative differences, optimizer noise, the comparison of losses, gradients
and final parameters), ``assembly`` (full tensors from the ranks' pieces), ``localise`` (the first
difference and what explains it) and ``report`` (:class:`VerifyReport` and its table).
"""

from lightning_moe.verify.report import VerifyReport
from lightning_moe.verify.runner import VerifyConfigError, verify_layout

__all__ = ["VerifyConfigError", "VerifyReport", "verify_layout"]
