"""Mixed precision for FSDP2: a ``MixedPrecisionPolicy`` chosen from Lightning's precision flag.

Under ``precision="bf16-mixed"`` Lightning runs the step under ``torch.autocast``; without a
policy FSDP2 would still all-gather the fp32 parameters and autocast would cast them after the
all-gather. :func:`apply_mixed_precision` gives every FSDP2 unit of a module (the strategy's or the
user's own ``fully_shard``) the policy of :func:`mixed_precision_policy`: bf16 all-gathers and
compute, gradients reduced in fp32 into the fp32 sharded (master) parameters. Under ``"bf16-true"``
the parameters themselves are bf16 (Lightning converts the module); gradients are still reduced in
fp32. The MoE router computes in fp32 under both (see :mod:`lightning_moe.moe`).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe._compat import set_fsdp_mixed_precision

# Lightning precision flags MoE5DStrategy runs, and the flags it refuses with the fix.
SUPPORTED_PRECISIONS: tuple[str, ...] = ("32-true", "32", "bf16-mixed", "bf16-true", "64-true")
REFUSED_PRECISIONS: dict[str, str] = {
    "16-mixed": "fp16 autocast needs a gradient scaler, which the sharded (DTensor) gradients and the pipeline"
    " schedule's own backward do not support",
    "16-true": "pure fp16 training has no gradient scaler and overflows",
    "transformer-engine": "Transformer Engine layers are not wrapped by the strategy",
    "transformer-engine-float16": "Transformer Engine layers are not wrapped by the strategy",
}


def check_precision(precision: str) -> None:
    """Raise ``ValueError`` naming the fix for a precision flag the strategy cannot train with."""
    precision = str(precision)
    if precision in REFUSED_PRECISIONS or precision not in SUPPORTED_PRECISIONS:
        why = REFUSED_PRECISIONS.get(precision, "it is not a precision the strategy knows")
        raise ValueError(
            f"MoE5DStrategy does not support precision={precision!r}: {why}. Use precision='bf16-mixed'"
            " (bf16 compute, fp32 master weights and gradient reduction), 'bf16-true' or '32-true'"
        )


def mixed_precision_policy(precision: str):  # noqa: ANN201 - MixedPrecisionPolicy | None
    """The FSDP2 ``MixedPrecisionPolicy`` for a Lightning precision flag, or None (full precision).

    ``"bf16-mixed"``: ``param_dtype=bf16`` (all-gathers and compute), ``reduce_dtype=fp32``; the sharded
    parameters keep their fp32 dtype (master weights). ``"bf16-true"``: the same policy over bf16
    parameters (reduction in fp32, cast back to bf16).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    check_precision(precision)
    if str(precision).startswith("bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def apply_mixed_precision(module: nn.Module, policy) -> int:  # noqa: ANN001
    """Give every FSDP2 unit in ``module`` the ``policy`` (before its first forward); return how many.

    ``policy=None`` leaves the units as they are. FSDP2 fixes its dtypes at its lazy
    initialisation (the first forward), so this must run before it.

    Example::

        parallelize(model, dims)                                   # fully_shard, fp32 all-gathers
        apply_mixed_precision(model, mixed_precision_policy("bf16-mixed"))   # bf16 all-gathers
    """
    if policy is None:
        return 0
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        set_fsdp_mixed_precision(unit, policy)
    return len(units)


def fsdp_policies(module: nn.Module) -> list:
    """The ``MixedPrecisionPolicy`` of every FSDP2 unit in ``module`` (for checks and tests)."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_moe._compat import fsdp_mixed_precision

    return [fsdp_mixed_precision(m) for m in module.modules() if isinstance(m, FSDPModule)]
