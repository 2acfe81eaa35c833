"""What the strategy applies to a parallelized model before the first step, in torchtitan's order."""

from __future__ import annotations

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_moe.parallel.plans.activation_checkpoint import apply_activation_checkpointing
from lightning_moe.parallel.plans.compile import apply_compile
from lightning_moe.parallel.plans.precision import apply_mixed_precision, mixed_precision_policy

__all__ = ["apply_training_plans"]


def apply_training_plans(
    model: nn.Module, *, precision: str, activation_checkpointing: str, recompute_attention: bool, compile: bool
) -> None:
    """Mixed precision on every FSDP2 unit, then activation checkpointing, then ``torch.compile``.

    ``precision`` is Lightning's flag: FSDP2 all-gathers (and computes) in it, reducing gradients
    in fp32, on every unit, the strategy's or the module's own. ``recompute_attention=False`` keeps
    the attention core out of recomputation (ring attention would send K/V around the ring again).
    Compilation comes last, after parallelization and checkpointing, as torchtitan does.
    """
    apply_mixed_precision(model, mixed_precision_policy(precision))
    try:
        apply_activation_checkpointing(model, activation_checkpointing, attention=recompute_attention)
        if compile:
            apply_compile(model)
    except ValueError as err:
        raise MisconfigurationException(str(err)) from err
