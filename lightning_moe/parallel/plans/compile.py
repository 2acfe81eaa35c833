"""``torch.compile`` per transformer block, after parallelization (the torchtitan way).

:func:`apply_compile` compiles each block of the module's block list in place with
``nn.Module.compile`` (parameter names unchanged, FSDP2/TP hooks kept). The MoE expert GEMMs stay
eager (``torch.compiler.disable``): they already run as one grouped GEMM, and torch 2.13's fake
kernel of ``torch._grouped_mm`` accepts only bf16, so tracing them in fp32 fails. Dispatch with
data-dependent splits breaks the graph where it must; the dense parts (attention, norms, router,
shared expert) compile.

Callbacks that wrap ``torch.distributed`` functions (the comm accounting) see only the collectives
that run eagerly under compile; :class:`lightning_moe.callbacks.CommAccountingCallback` is meant
for eager runs.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe.parallel.plans.blocks import iter_blocks, require_block_container

_COMPILED_ATTR = "_lightning_moe_compiled"


def apply_compile(module: nn.Module, **compile_kwargs: object) -> int:
    """Compile every block of ``module``'s block list in place; return how many.

    Example::

        parallelize(model, dims)
        apply_compile(model)            # each model.layers[i] runs compiled
    """
    blocks = require_block_container(module, "compile=True")
    from lightning_moe.moe import MoELayer

    compiled = 0
    for block in iter_blocks(blocks):
        if block is None or getattr(block, _COMPILED_ATTR, False):
            continue
        for layer in (m for m in block.modules() if isinstance(m, MoELayer)):
            layer.experts.forward = torch.compiler.disable(layer.experts.forward)  # type: ignore[method-assign]
        block.compile(**compile_kwargs)
        setattr(block, _COMPILED_ATTR, True)
        compiled += 1
    return compiled
